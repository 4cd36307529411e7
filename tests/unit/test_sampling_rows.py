"""``SamplingRows.metadata``: a step of plain greedy rows gets bare greedy metadata without
building anything; any row with a setting that acts on the logits or asks for logprobs gets
the full metadata, whatever the other rows are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
