"""The profiled step's prompt lengths: the largest step the scheduler can send, with one long
prompt among them so that long-prefill kernel launches compile at start-up."""

from __future__ import annotations

import pytest

from pagoda.worker.profile import LONG_PROMPT, _profile_batch


@pytest.mark.parametrize(
    "tokens,reqs,model_len",
    [(16384, 256, 2048), (8192, 256, 40960), (2048, 4, 1024), (300, 256, 2048), (100, 1, 100)],
)
def test_profile_batch_fills_the_step_and_holds_one_long_prompt(
    tokens: int, reqs: int, model_len: int
) -> None:
    lens = _profile_batch(tokens, reqs, model_len)
    n_tok = min(tokens, reqs * model_len)
    assert int(lens.sum()) == n_tok and len(lens) == min(reqs, n_tok)
    assert lens.min() >= 1 and lens.max() <= model_len
    # As long as the limits allow, up to LONG_PROMPT tokens.
    assert lens.max() == max(
        min(model_len, n_tok - (len(lens) - 1), LONG_PROMPT), n_tok // len(lens)
    )
