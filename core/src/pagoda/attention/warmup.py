"""Every kind of step the model runner sends an attention backend, run once on a tiny cache.

A backend whose kernels compile on first use builds what the engine will load by running these
steps through its own code (``build_metadata``, ``build_graph_metadata``, ``prepare_graph_replay``
and its layers' ``forward``), rather than from a list of kernels kept by hand:

- ``prefill``: a new prompt, a prompt chunk after context and a decode in one step, as prompts
  and the GPU's memory-profiling pass run;
- ``decode``: one token a request, outside a CUDA graph (batches past the largest graph, or
  graphs off);
- ``decode graph``: a batch-size bucket's graph metadata with one token a request, planned by a
  forward over worst-case lengths as at capture, then brought up to a real step by
  ``prepare_graph_replay`` and run again, as before each replay (with a padding row);
- ``verification graph``: the same with several tokens a request (speculative decoding's
  ``k + 1``).

Each step runs through two layers: the first plans, the others reuse the plan.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata

STEP_KINDS = ("prefill", "decode", "decode graph", "verification graph")
_GRAPH_QUERY_LEN = {"decode graph": 1, "verification graph": 3}
_REQS, _BUCKET, _WIDTH = 3, 4, 4  # real requests, their graph bucket, blocks a request


def step_kinds(backend: type[AttentionBackend]) -> tuple[str, ...]:
    """The kinds of step the runner sends ``backend``: graph kinds only when it is graphed."""
    return STEP_KINDS if backend.supports_cuda_graph else STEP_KINDS[:2]


def run_step(
    backend: type[AttentionBackend],
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    block_size: int = 16,
    layers: int = 2,
) -> torch.Tensor:
    """Run one step of ``kind`` (one of :data:`STEP_KINDS`) through ``layers`` layers of
    ``backend`` on ``device`` in ``dtype``; returns the last layer's output for the step's real
    tokens (``[tokens, num_heads, head_size]``)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; known: {', '.join(STEP_KINDS)}")
    bs = block_size
    num_blocks = 1 + _REQS * _WIDTH  # block 0 is the null block, as in the engine's pool
    shape = backend.get_kv_cache_shape(num_blocks, bs, num_kv_heads, head_size)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    impl_cls = backend.get_impl_cls()
    impls = [impl_cls(num_heads, head_size, head_size**-0.5, num_kv_heads) for _ in range(layers)]
    table = 1 + np.arange(_REQS * _WIDTH, dtype=np.int32).reshape(_REQS, _WIDTH)

    def forward(md: object, n: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(n)

        def rand(heads: int) -> torch.Tensor:
            return torch.randn(n, heads, head_size, generator=gen).to(device=device, dtype=dtype)

        q, k, v = rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)
        with torch.inference_mode():
            for impl, cache in zip(impls, caches, strict=True):
                out = impl.forward(q, k, v, cache, md)
        return out

    if kind == "prefill":
        common = _common([5, 3, 1], [5, 2 * bs + 3, bs + 2], table, bs, device)
        return forward(backend.build_metadata(common), common.num_actual_tokens)
    if kind == "decode":
        common = _common([1] * _REQS, [bs + 2, 2 * bs + 1, 3 * bs], table, bs, device)
        return forward(backend.build_metadata(common), common.num_actual_tokens)
    return _graph_step(backend, _GRAPH_QUERY_LEN[kind], table, bs, device, forward)


def run_every_step_kind(
    backend: type[AttentionBackend],
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    **shape: int,
) -> list[str]:
    """:func:`run_step` for each of :func:`step_kinds`; returns the kinds run, in order."""
    kinds = step_kinds(backend)
    for kind in kinds:
        run_step(backend, kind, device, dtype, head_size, **shape)
    return list(kinds)


def _common(
    q_lens: list[int],
    seq_lens: list[int],
    table: np.ndarray,
    bs: int,
    device: torch.device,
) -> CommonAttentionMetadata:
    q = np.array(q_lens, dtype=np.int64)
    s = np.array(seq_lens, dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(q)])
    rows = np.repeat(np.arange(len(q)), q)
    positions = np.concatenate([np.arange(n - m, n) for m, n in zip(q, s, strict=True)])
    slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def dev(a: np.ndarray, dt: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

    return CommonAttentionMetadata(
        num_reqs=len(q),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(q.max()),
        max_seq_len=int(s.max()),
        query_start_loc=dev(qsl, torch.int32),
        seq_lens=dev(s, torch.int32),
        block_table=dev(table[: len(q)], torch.int32),
        slot_mapping=dev(slots, torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=s,
        block_size=bs,
    )


def _graph_step(
    backend: type[AttentionBackend],
    q: int,
    table: np.ndarray,
    bs: int,
    device: torch.device,
    forward: Callable[[object, int], torch.Tensor],
) -> torch.Tensor:
    """A graph bucket of ``_BUCKET`` rows over persistent buffers: planned at capture with
    worst-case lengths and padding rows, then replayed for ``_REQS`` real requests."""
    b, n, max_len = _BUCKET, _REQS, _WIDTH * bs
    i32 = dict(dtype=torch.int32, device=device)
    qsl_buf = torch.arange(b + 1, **i32) * q
    seq_buf = torch.full((b,), q, **i32)
    table_buf = torch.zeros(b, _WIDTH, **i32)
    slot_buf = torch.zeros(b * q, dtype=torch.int64, device=device)
    capture = CommonAttentionMetadata(
        num_reqs=b,
        num_actual_tokens=b * q,
        max_query_len=q,
        max_seq_len=max_len,
        query_start_loc=qsl_buf,
        seq_lens=seq_buf,
        block_table=table_buf,
        slot_mapping=slot_buf,
        query_start_loc_cpu=np.arange(b + 1) * q,
        seq_lens_cpu=np.full(b, max_len),
        block_size=bs,
    )
    md = backend.build_graph_metadata(capture)
    forward(md, b * q)  # NOTE: the runner's warm-up forward before capture plans here.

    step = _common([q] * n, [bs + q, 2 * bs + 1, 3 * bs], table, bs, device)
    seq_buf[:n].copy_(step.seq_lens)
    table_buf[:n].copy_(step.block_table)
    slot_buf[: n * q].copy_(step.slot_mapping)
    padded = CommonAttentionMetadata(
        num_reqs=b,
        num_actual_tokens=b * q,
        max_query_len=q,
        max_seq_len=step.max_seq_len,
        query_start_loc=qsl_buf,
        seq_lens=seq_buf,
        block_table=table_buf,
        slot_mapping=slot_buf,
        query_start_loc_cpu=np.arange(b + 1) * q,
        seq_lens_cpu=np.concatenate([step.seq_lens_cpu, np.full(b - n, q)]),
        block_size=bs,
    )
    with torch.inference_mode():  # as the runner replays: its steps run in inference mode
        backend.prepare_graph_replay(md, padded)
    return forward(md, b * q)[: n * q]
