"""The kernel that stores a step's packed inputs (``pagoda.worker.step_inputs_kernel``) writes
what its torch reference writes, into the buffers' first rows and columns only, and
``StepBuffers.copy_inputs`` fills the buffers as six separate copies would.

On a machine without CUDA the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
from importlib.util import find_spec

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="needs triton")


def _buffers(max_tok: int, max_req: int, width: int) -> tuple[torch.Tensor, ...]:
    i64 = {"dtype": torch.int64, "device": DEVICE}
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return (
        torch.full((max_tok,), -7, **i64),
        torch.full((max_tok,), -7, **i64),
        torch.full((max_tok,), -7, **i64),
        torch.full((max_req + 1,), -7, **i32),
        torch.full((max_req,), -7, **i32),
        torch.full((max_req, width), -7, **i32),
    )


def _step(n_tok: int, n_req: int, cols: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 50_000, n_tok),
        rng.integers(0, 4_000, n_tok),
        rng.integers(0, 1 << 33, n_tok),  # (slots past 32 bits stay int64)
        np.arange(n_req + 1) * 3,
        rng.integers(1, 4_000, n_req),
        rng.integers(0, 1 << 20, (n_req, cols)).astype(np.int32),
    )


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(
    ("n_tok", "n_req", "cols"), [(1, 1, 1), (9, 1, 16), (700, 5, 3), (2000, 1, 130)]
)
def test_kernel_matches_the_torch_reference(n_tok: int, n_req: int, cols: int) -> None:
    from pagoda.worker.step_inputs_kernel import pack, unpack, unpack_torch

    host = pack(*_step(n_tok, n_req, cols, n_tok + cols))
    packed = torch.from_numpy(host).to(DEVICE)
    # (larger than the step, as the runner's buffers are: the rest must stay as it was)
    got, want = _buffers(n_tok + 5, n_req + 2, cols + 4), _buffers(n_tok + 5, n_req + 2, cols + 4)
    unpack(packed, got, n_tok, n_req, cols)
    unpack_torch(packed, want, n_tok, n_req, cols)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
    assert (want[0][n_tok:] == -7).all() and (want[5][:, cols:] == -7).all()
    assert (want[5][n_req:] == -7).all() and (want[3][n_req + 1 :] == -7).all()


def test_copy_inputs_fills_the_buffers_as_six_copies_do() -> None:
    from pagoda.worker.step_buffers import StepBuffers

    ids, pos, slots, qsl, seq_lens, table = _step(40, 3, 6, 1)
    buffers = StepBuffers.allocate(torch.device(DEVICE), 64, 4, 8, 16)
    buffers.copy_inputs(ids, pos, slots, qsl, seq_lens, table)
    assert torch.equal(buffers.input_ids[:40].cpu(), torch.from_numpy(ids))
    assert torch.equal(buffers.positions[:40].cpu(), torch.from_numpy(pos))
    assert torch.equal(buffers.slot_mapping[:40].cpu(), torch.from_numpy(slots))
    assert buffers.query_start_loc[:4].tolist() == qsl.tolist()
    assert buffers.seq_lens[:3].tolist() == seq_lens.tolist()
    assert torch.equal(buffers.block_table[:3, :6].cpu(), torch.from_numpy(table))
    assert (buffers.block_table[:, 6:] == 0).all() and (buffers.input_ids[40:] == 0).all()
