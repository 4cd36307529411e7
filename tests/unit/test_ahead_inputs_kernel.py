"""The kernel that builds a verification's inputs ahead (``pagoda.worker.verify_inputs_kernel``)
writes what its torch reference writes, for requests that accepted every number of drafts.

On a machine without CUDA the kernel runs in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(find_spec("triton") is None, reason="needs triton"),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _buffers(n: int, q: int):
    i64 = {"dtype": torch.int64, "device": DEVICE}
    i32 = {"dtype": torch.int32, "device": DEVICE}
    size = n * q + 5  # longer than the step, as the runner's buffers are: the tail stays
    return (
        torch.full((size,), -7, **i64),
        torch.full((size,), -7, **i64),
        torch.full((size,), -7, **i64),
        torch.full((n + 3,), -7, **i32),
        torch.full((n + 4,), -7, **i32),
    )


@pytest.mark.parametrize("k", [1, 3, 4, 7])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_matches_the_torch_reference(k: int, block_size: int) -> None:
    from pagoda.worker.verify_inputs_kernel import build_inputs

    gen = torch.Generator().manual_seed(k * 100 + block_size)
    n, q = 5, k + 1
    emitted = torch.arange(1, n + 1) % (k + 1) + 1  # 2, 3, .., wrapping: every count occurs
    emitted[0] = 1
    emitted[1] = k + 1
    base = torch.randint(0, 200, (n,), generator=gen)
    tokens = torch.randint(0, 1000, (n, k + 1), generator=gen)
    tokens[torch.arange(k + 1).unsqueeze(0) >= emitted.unsqueeze(1)] = -1
    drafts = torch.randint(0, 1000, (n, k), generator=gen)
    width = (200 + 2 * q) // block_size + 2
    table = torch.randperm(n * width, generator=gen).view(n, width).to(torch.int32) + 1
    table = torch.cat([table, torch.zeros(2, width, dtype=torch.int32)])  # rows past n
    args = [t.to(DEVICE) for t in (tokens, emitted, base, drafts, table)]
    got, want = _buffers(n, q), _buffers(n, q)
    build_inputs(*args, block_size, got, kernel=True)
    build_inputs(*args, block_size, want, kernel=False)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
    input_ids, positions, slots, seq_lens, qsl = (t.cpu() for t in want)
    # The reference itself, by hand for request 1 (every draft accepted).
    first = int(base[1]) + k + 1
    assert positions[q : 2 * q].tolist() == list(range(first, first + q))
    assert input_ids[q : 2 * q].tolist() == [int(tokens[1, k])] + drafts[1].tolist()
    p = first + q - 1
    assert int(slots[2 * q - 1]) == int(table[1, p // block_size]) * block_size + p % block_size
    assert int(seq_lens[1]) == first + q and qsl[: n + 1].tolist() == [i * q for i in range(n + 1)]
    assert int(positions[n * q]) == -7 and int(seq_lens[n]) == -7  # nothing past the step


def test_start_up_check_keeps_the_torch_path_when_the_kernel_differs(monkeypatch) -> None:
    import pagoda.worker.verify_inputs_kernel as ak

    monkeypatch.setattr(ak, "_failed", [])
    monkeypatch.setattr(ak, "available", lambda device: not ak._failed)
    ak.warm(torch.device(DEVICE), 4)
    assert ak._failed == []  # the kernel agrees with the torch operations

    def off_by_one(tokens, emitted, base, drafts, table, bs, out):
        ak_reference(tokens, emitted, base + 1, drafts, table, bs, out)

    ak_reference = ak.build_inputs_torch
    monkeypatch.setattr(ak, "build_inputs_torch", off_by_one)
    ak.warm(torch.device(DEVICE), 4)
    assert ak._failed and not ak.available(torch.device(DEVICE))
