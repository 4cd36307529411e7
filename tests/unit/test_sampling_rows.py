"""``SamplingRows.metadata``: a step of plain greedy rows gets bare greedy metadata without
building anything; any row with a setting that acts on the logits or asks for logprobs gets
the full metadata, whatever the other rows are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.sample.sampler import Sampler
from pagoda.sample.state import SamplingRows
from pagoda.sampling_params import SamplingParams

VOCAB = 50


def _rows(*params: SamplingParams) -> SamplingRows:
    rows = SamplingRows(8, VOCAB, torch.device("cpu"))
    for i, sp in enumerate(params):
        rows.add(i, sp, prompt_ids=[1, 2, 3], output_ids=[])
    return rows


def _md(rows: SamplingRows, n: int):
    token_ids = np.zeros((8, 16), dtype=np.int64)
    num_tokens = np.full(8, 3, dtype=np.int64)
    return rows.metadata(np.arange(n), token_ids, num_tokens, num_tokens.copy())


def test_plain_greedy_rows_get_bare_greedy_metadata() -> None:
    md = _md(_rows(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)), 2)
    assert md.all_greedy and md.max_num_logprobs is None
    assert md.banned is None and md.allowed_mask is None and md.logit_bias is None
    assert md.penalties is None


@pytest.mark.parametrize(
    ("setting", "check"),
    [
        ({"logprobs": 2}, lambda md: md.max_num_logprobs == 2),
        ({"min_tokens": 5, "stop_token_ids": [7]}, lambda md: md.banned is not None),
        ({"allowed_token_ids": [1, 2]}, lambda md: md.allowed_mask is not None),
        ({"logit_bias": {3: 1.5}}, lambda md: md.logit_bias is not None),
        ({"bad_words_token_ids": [[4]]}, lambda md: md.banned is not None),
        ({"presence_penalty": 0.5}, lambda md: md.penalties is not None),
        ({"temperature": 0.7}, lambda md: not md.all_greedy and md.uniform is not None),
    ],
)
def test_a_row_with_a_setting_gets_full_metadata(setting: dict, check) -> None:
    sp = SamplingParams(**{"temperature": 0.0, **setting})
    rows = _rows(SamplingParams(temperature=0.0), sp)
    assert not rows.plain[1] and rows.plain[0]
    assert check(_md(rows, 2))
    assert _md(rows, 1).all_greedy  # the plain row alone


@pytest.mark.parametrize(
    "setting",
    [
        {"logprobs": 0},
        {"min_tokens": 5},  # min_tokens alone (no stop ids beyond the model's): still not plain
        {"allowed_token_ids": [1, 2]},
        {"logit_bias": {3: 1.5}},
        {"bad_words_token_ids": [[4, 5]]},  # a word that matches nothing yet
        {"frequency_penalty": 0.2},
        {"repetition_penalty": 1.1},
    ],
)
def test_a_row_is_plain_exactly_when_its_metadata_is(setting: dict) -> None:
    """``SamplingRows.plain`` is ``SamplingMetadata.plain`` of the row's own metadata at its
    first output position: the settings that break the fast paths are listed once, there."""
    rows = _rows(SamplingParams(temperature=0.0, **setting), SamplingParams(temperature=0.0))
    assert not _md(rows, 1).plain and not rows.plain[0]
    assert _md(rows, 2).all_greedy and not _md(rows, 2).plain
    assert rows.plain[1]  # its plain neighbour stays plain


def test_a_random_row_is_never_plain_greedy_but_its_metadata_can_be_plain() -> None:
    """A random row at its temperature alone: the one-kernel draw's case (``Sampler.plain``)."""
    rows = _rows(SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=5))
    assert not rows.plain[0]
    md = _md(rows, 1)
    assert md.all_random and md.plain and Sampler().plain(md)
    processed = Sampler()
    processed.logits_processors.append(lambda logits, md: logits)
    assert not processed.plain(md)
    assert not _md(rows, 2).plain  # top-k filters the second row's draw


def _row_state(rows: SamplingRows, row: int) -> dict:
    """Every per-row field of ``rows`` at ``row`` (arrays with a row a request, and the padded
    lists' rows), found by walking its attributes: a field added later is compared too."""
    out = {}
    for name, value in vars(rows).items():
        if isinstance(value, np.ndarray) and value.shape[:1] == (8,) and name != "_no_history":
            out[name] = value[row].tolist()
        for part in ("ids", "values", "words", "has"):
            inner = getattr(value, part, None)
            if isinstance(inner, np.ndarray):
                out[f"{name}.{part}"] = inner[row].tolist()
    return out


def test_an_unsampled_row_holds_what_a_default_greedy_request_would() -> None:
    """A pooling request's row (``add_unsampled``) is left as ``add`` leaves a greedy request
    that asks for nothing, over a row whose former request set everything a row holds."""
    everything = SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=7, logprobs=2, prompt_logprobs=1,
        min_tokens=2, stop_token_ids=[4], allowed_token_ids=[1, 2, 3], logit_bias={3: 1.0},
        presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1,
    )  # fmt: skip
    everything.bad_words_token_ids = [[5, 6]]
    want = _rows(everything, everything)
    want.add(1, SamplingParams(max_tokens=1, temperature=0.0), prompt_ids=[1, 2, 3], output_ids=[])
    got = _rows(everything, everything)
    assert _row_state(got, 1) != _row_state(want, 1)  # (the former request's settings)
    got.add_unsampled(1)
    assert _row_state(got, 1) == _row_state(want, 1)
    assert _row_state(got, 0) == _row_state(want, 0)  # the other row untouched
    assert not got.needs_token_history(np.array([1])) and got.plain[1]
