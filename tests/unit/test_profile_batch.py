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


def test_the_profiled_step_lays_its_prompts_out_from_block_1() -> None:
    """``laid_out_step`` (the profiling pass's step, and the start-up's): prompts of 5, 16 and
    17 tokens take blocks 1, 2 and 3 - 4 of 16 slots, in order, their positions from 0."""
    import numpy as np
    import torch

    from pagoda.worker.profile import laid_out_step
    from pagoda.worker.step_buffers import StepBuffers

    buffers = StepBuffers.allocate(torch.device("cpu"), 64, 4, 8, 16)
    lens = np.array([5, 16, 17])
    common = laid_out_step(buffers, lens, lens)
    assert common.query_start_loc_cpu.tolist() == [0, 5, 21, 38]
    positions = buffers.positions[:38].tolist()
    assert positions == list(range(5)) + list(range(16)) + list(range(17))
    slots = buffers.slot_mapping[:38].tolist()
    assert slots == [*range(16, 21), *range(32, 48), *range(48, 65)]
    assert buffers.block_table[:3, :3].tolist() == [[1, 0, 0], [2, 0, 0], [3, 4, 0]]
    assert common.max_seq_len == 17 and common.seq_lens.tolist() == [5, 16, 17]
