"""The inputs of a verification launched ahead (``pagoda.worker.drafts_ahead``) in one Triton
kernel.

Request ``i`` of the step starts at ``p = base[i] + emitted[i]`` (its last token's position in
the verification before, which is still on the device); it gets positions ``p .. p + q - 1``,
their key and value slots from its block-table row, sequence length ``p + q``, query start
``i * q``, and input ids: its last emitted token, then its ``q - 1`` drafts. In torch that is
about fifteen small operations, each a launch and host time on the step's critical path at batch
1; here it is one launch (through :class:`CachedLaunch`), one program a request.
:func:`build_inputs_torch` is the reference it must equal
(``tests/unit/test_ahead_inputs_kernel.py``).
"""

from __future__ import annotations

import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch path runs instead
    triton = None

from pagoda.ops.launch import CachedLaunch

logger = logging.getLogger(__name__)

if triton is not None:

    @triton.jit(
        do_not_specialize=[
            "tokens_ptr",
            "emitted_ptr",
            "base_ptr",
            "drafts_ptr",
            "table_ptr",
            "input_ids_ptr",
            "positions_ptr",
            "slots_ptr",
            "seq_lens_ptr",
            "qsl_ptr",
            "tokens_stride",
            "table_stride",
            "Q",
            "BS",
        ]
    )
    def _ahead_inputs(
        tokens_ptr,  # [n, tokens_stride] int64: the verification before (-1 past emitted)
        emitted_ptr,  # [n] int64: its emitted count of each request (>= 1)
        base_ptr,  # [n] int64: the position of each request's first input there
        drafts_ptr,  # [n, Q - 1] int64, contiguous
        table_ptr,  # [rows, table_stride] int32: row i is request i's block table
        input_ids_ptr,  # [n * Q] int64 out
        positions_ptr,  # [n * Q] int64 out
        slots_ptr,  # [n * Q] int64 out
        seq_lens_ptr,  # [n] int32 out
        qsl_ptr,  # [n + 1] int32 out
        tokens_stride,
        table_stride,
        Q,
        BS,
        BLOCK: tl.constexpr,  # a power of two >= Q
    ):
        i = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        m = j < Q
        e = tl.load(emitted_ptr + i)
        first = tl.load(base_ptr + i) + e
        pos = first + j
        tl.store(positions_ptr + i * Q + j, pos, mask=m)
        block = tl.load(table_ptr + i * table_stride + pos // BS, mask=m, other=0)
        tl.store(slots_ptr + i * Q + j, block.to(tl.int64) * BS + pos % BS, mask=m)
        last = tl.load(tokens_ptr + i * tokens_stride + e - 1)
        d = tl.load(drafts_ptr + i * (Q - 1) + j - 1, mask=m & (j > 0), other=0)
        tl.store(input_ids_ptr + i * Q + j, tl.where(j == 0, last, d), mask=m)
        tl.store(seq_lens_ptr + i, (first + Q).to(tl.int32))
        tl.store(qsl_ptr + i + 1, ((i + 1) * Q).to(tl.int32))
        if i == 0:
            tl.store(qsl_ptr, 0)

    _launch = CachedLaunch(_ahead_inputs)


_failed: list[str] = []  # why the kernel did not compile at start-up (then torch runs)


def available(device: torch.device) -> bool:
    """Whether :func:`build_inputs` takes the kernel for tensors on ``device``: CUDA, with
    Triton installed, and it compiled at start-up (``warm``). (Its tests also run it on the
    CPU, interpreted.)"""
    return triton is not None and device.type == "cuda" and not _failed


def build_inputs(
    tokens: torch.Tensor,
    emitted: torch.Tensor,
    base: torch.Tensor,
    drafts: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    kernel: bool | None = None,
) -> None:
    """Fill ``out = (input_ids, positions, slot_mapping, seq_lens, query_start_loc)`` (the
    runner's buffers, from their start) for ``n = len(emitted)`` requests of ``q =
    drafts.shape[1] + 1`` tokens: request ``i`` starts at ``base[i] + emitted[i]``, its ids are
    ``tokens[i, emitted[i] - 1]`` and ``drafts[i]``, its slots come from ``block_table[i]``.
    ``kernel``: the Triton kernel (default: where :func:`available`), else torch."""
    if kernel is None:
        kernel = available(tokens.device)
    if not kernel:
        build_inputs_torch(tokens, emitted, base, drafts, block_table, block_size, out)
        return
    n, q = len(emitted), drafts.shape[1] + 1
    if n == 0:
        return
    tokens, drafts = tokens.contiguous(), drafts.contiguous()
    input_ids, positions, slots, seq_lens, qsl = out
    block = _block(q)
    args = (tokens, emitted, base, drafts, block_table, input_ids, positions, slots, seq_lens, qsl)
    scalars = (tokens.stride(0), block_table.stride(0), q, block_size, block)
    _launch((n, block, tokens.device.index), (n,), (*args, *scalars), num_warps=1)


def build_inputs_torch(
    tokens: torch.Tensor,
    emitted: torch.Tensor,
    base: torch.Tensor,
    drafts: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """:func:`build_inputs` in torch operations (the CPU's path, and the kernel's reference)."""
    input_ids, positions, slots, seq_lens, qsl = out
    n, q = len(emitted), drafts.shape[1] + 1
    first = base + emitted
    offsets = torch.arange(q, dtype=torch.int64, device=first.device)
    pos = first.unsqueeze(1) + offsets
    positions[: n * q].copy_(pos.view(-1))
    blocks = block_table[:n].gather(1, pos // block_size).to(torch.int64)
    slots[: n * q].copy_((blocks * block_size + pos % block_size).view(-1))
    seq_lens[:n].copy_(first + q)
    qsl[: n + 1].copy_(torch.arange(n + 1, device=first.device) * q)
    ids = input_ids[: n * q].view(n, q)
    ids[:, :1].copy_(tokens.gather(1, (emitted - 1).unsqueeze(1)))
    ids[:, 1:].copy_(drafts)


def _block(q: int) -> int:
    # NOTE: at least 8 (q up to 8 in one compiled kernel).
    return max(8, triton.next_power_of_2(q))


def warm(device: torch.device, k: int) -> None:
    """Compile the kernel for ``k`` drafts a request now (start-up), not in a step, and check it
    against the torch operations on a few requests; if it fails or differs, the torch
    operations build the inputs from then on (said once, as a warning)."""
    if not available(device):
        return
    q, n, bs = k + 1, 3, 4
    i64 = {"dtype": torch.int64, "device": device}
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, 1000, (n, q), generator=gen, **i64)
    emitted = torch.arange(1, n + 1, **i64).clamp(max=q)
    base = torch.randint(0, 50, (n,), generator=gen, **i64)
    drafts = torch.randint(0, 1000, (n, k), generator=gen, **i64)
    table = torch.randperm(n * 32, generator=gen, **i64).view(n, 32).to(torch.int32)

    def buffers() -> tuple:
        return (
            torch.full((n * q,), -1, **i64),
            torch.full((n * q,), -1, **i64),
            torch.full((n * q,), -1, **i64),
            torch.full((n,), -1, dtype=torch.int32, device=device),
            torch.full((n + 1,), -1, dtype=torch.int32, device=device),
        )

    got, want = buffers(), buffers()
    try:
        build_inputs(tokens, emitted, base, drafts, table, bs, got, kernel=True)
        build_inputs_torch(tokens, emitted, base, drafts, table, bs, want)
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        problem = None if same else "its inputs differ from the torch operations'"
    except Exception as e:  # noqa: BLE001 (the torch operations build the same inputs)
        problem = repr(e)
    if problem is not None:
        _failed.append(problem)
        logger.warning("verification inputs ahead: built in torch (the kernel: %s)", problem)
