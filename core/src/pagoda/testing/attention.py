"""Attention backend conformance: a backend's output against a float64 reference.

Each :class:`AttentionCase` is a short sequence of engine steps over a paged KV cache whose blocks
are scattered at random, whose unused memory (block 0, the tail of each last block, free blocks)
holds random values that a correct backend masks out, and whose block tables are padded with 0.
Every step's output is compared with attention computed in float64 from the same inputs; a last
decode step for every request reads back what the case's final step wrote. The scenarios are
what the scheduler produces: prefill, decode, mixed batches (decodes, chunked prefills and new
prompts together) and prefix-cached context (requests that share the blocks of a common prefix).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata

#: (atol, rtol) per dtype; backends with looser arithmetic (TF32, fp8) pass their own.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

# A step: (request index, first token, end token) for each request scheduled in it.
Step = list[tuple[int, int, int]]


@dataclass(frozen=True)
class AttentionCase:
    """One scenario on one model shape. ``steps`` say which tokens of which request each step
    computes; a request's tokens before ``start`` are its context, already in the cache."""

    scenario: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    seq_lens: tuple[int, ...]  # every request's length at the end of the case
    steps: tuple[tuple[tuple[int, int, int], ...], ...]
    shared_prefix: int = 0  # leading tokens (whole blocks) all requests share with request 0
    seed: int = 0

    @property
    def name(self) -> str:
        g = self.num_heads // self.num_kv_heads
        return (
            f"{self.scenario}-h{self.num_heads}kv{self.num_kv_heads}(g{g})-d{self.head_size}"
            f"-bs{self.block_size}"
        )


def _scenarios(bs: int) -> dict[str, tuple[tuple[int, ...], list[Step], int]]:
    """scenario -> (final lengths, steps, shared prefix), for block size ``bs``."""
    shared = 2 * bs
    return {
        # New prompts only, one of them a single token; lengths straddle block boundaries.
        "prefill": (
            (1, bs - 1, bs, 2 * bs + 3),
            [[(0, 0, 1), (1, 0, bs - 1), (2, 0, bs), (3, 0, 2 * bs + 3)]],
            0,
        ),
        # Contexts written by a prefill step, then one token each.
        "decode": (
            (bs, bs + 1, 2 * bs - 1, 3 * bs + 5),
            [
                [(0, 0, bs - 1), (1, 0, bs), (2, 0, 2 * bs - 2), (3, 0, 3 * bs + 4)],
                [
                    (0, bs - 1, bs),
                    (1, bs, bs + 1),
                    (2, 2 * bs - 2, 2 * bs - 1),
                    (3, 3 * bs + 4, 3 * bs + 5),
                ],
            ],
            0,
        ),
        # Decodes, a chunked prefill that continues, and a new prompt in the same step.
        "mixed": (
            (bs + 5, 2 * bs + 7, 11, 3 * bs + 1),
            [
                [(0, 0, bs + 4), (1, 0, bs), (3, 0, 3 * bs)],
                [(0, bs + 4, bs + 5), (1, bs, 2 * bs + 7), (2, 0, 11), (3, 3 * bs, 3 * bs + 1)],
            ],
            0,
        ),
        # Request 0 computes a prefix; the others hit it in the prefix cache and compute only
        # their own tokens (one of them a single token) while request 0 decodes.
        "prefix_cached": (
            (shared + 6, shared + 7, shared + 1, shared + bs + 2),
            [
                [(0, 0, shared + 5)],
                [
                    (0, shared + 5, shared + 6),
                    (1, shared, shared + 7),
                    (2, shared, shared + 1),
                    (3, shared, shared + bs + 2),
                ],
            ],
            shared,
        ),
    }


HEAD_CONFIGS = ((4, 4), (8, 2), (6, 2), (4, 1))  # MHA, GQA 4, GQA 3, MQA
HEAD_SIZES = (64, 128)
BLOCK_SIZES = (16, 32)


def attention_cases(
    head_sizes: tuple[int, ...] = HEAD_SIZES,
    block_sizes: tuple[int, ...] = BLOCK_SIZES,
    head_configs: tuple[tuple[int, int], ...] = HEAD_CONFIGS,
) -> list[AttentionCase]:
    """Every scenario on every (heads, kv heads), head size and block size given."""
    cases = []
    for i, (bs, (h, kv), d) in enumerate(itertools.product(block_sizes, head_configs, head_sizes)):
        for scenario, (lens, steps, shared) in _scenarios(bs).items():
            final = [(r, s, e) for r, (s, e) in enumerate((n, n + 1) for n in lens)]
            all_steps = tuple(tuple(step) for step in [*steps, final])
            lens_plus = tuple(n + 1 for n in lens)
            cases.append(AttentionCase(scenario, h, kv, d, bs, lens_plus, all_steps, shared, i))
    return cases


# ---- running a case -----------------------------------------------------------------------------


@dataclass
class _Layout:
    block_tables: list[list[int]]  # each request's blocks
    num_blocks: int
    q: list[torch.Tensor]  # per request [len, heads, d], float64
    k: list[torch.Tensor]  # per request [len, kv_heads, d], float64
    v: list[torch.Tensor]


def _layout(case: AttentionCase, dtype: torch.dtype) -> _Layout:
    gen = torch.Generator().manual_seed(case.seed)
    rng = np.random.default_rng(case.seed)
    bs = case.block_size
    shared_blocks = case.shared_prefix // bs
    own = [-(-n // bs) - (shared_blocks if r else 0) for r, n in enumerate(case.seq_lens)]
    num_blocks = 1 + 2 * sum(own) + 3  # block 0 is the null block; the rest is never touched
    ids = rng.permutation(np.arange(1, num_blocks)).tolist()
    tables, pos = [], 0
    for r, n in enumerate(own):
        mine = ids[pos : pos + n]
        pos += n
        tables.append(mine if r == 0 else tables[0][:shared_blocks] + mine)

    def rand(n: int, heads: int) -> torch.Tensor:
        t = torch.randn(n, heads, case.head_size, generator=gen, dtype=torch.float64)
        return t.to(dtype).to(torch.float64)  # exactly representable in the backend's dtype

    q = [rand(n, case.num_heads) for n in case.seq_lens]
    k = [rand(n, case.num_kv_heads) for n in case.seq_lens]
    v = [rand(n, case.num_kv_heads) for n in case.seq_lens]
    for r in range(1, len(case.seq_lens)):  # the shared prefix holds the same keys and values
        k[r][: case.shared_prefix] = k[0][: case.shared_prefix]
        v[r][: case.shared_prefix] = v[0][: case.shared_prefix]
    return _Layout(tables, num_blocks, q, k, v)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """float64 causal attention of queries at positions ``start..`` over keys ``0..``:
    ``q`` [n, heads, d], ``k``/``v`` [start + n, kv_heads, d] -> [n, heads, d]."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores.masked_fill_(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vv)


def run_attention_case(
    backend: type[AttentionBackend],
    case: AttentionCase,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run every step of ``case`` through ``backend``; (output, float64 reference) per step."""
    device = torch.device(device)
    if device.type != "cpu":
        return _run(backend, case, device, dtype)
    # NOTE: the shapes are tiny; on a CPU, threads only contend (several times slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(backend, case, device, dtype)
    finally:
        torch.set_num_threads(threads)


def _run(
    backend: type[AttentionBackend], case: AttentionCase, device: torch.device, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    lay = _layout(case, dtype)
    bs, d = case.block_size, case.head_size
    scale = d**-0.5
    shape = backend.get_kv_cache_shape(lay.num_blocks, bs, case.num_kv_heads, d)
    gen = torch.Generator().manual_seed(case.seed + 1)
    kv_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    impl = backend.get_impl_cls()(case.num_heads, d, scale, case.num_kv_heads)
    width = max(len(t) for t in lay.block_tables) + 2
    results = []
    for step in case.steps:
        common = _metadata(step, lay, bs, width, device)
        q = torch.cat([lay.q[r][s:e] for r, s, e in step]).to(dtype).to(device)
        k = torch.cat([lay.k[r][s:e] for r, s, e in step]).to(dtype).to(device)
        v = torch.cat([lay.v[r][s:e] for r, s, e in step]).to(dtype).to(device)
        md = backend.build_metadata(common)
        with torch.inference_mode():
            out = impl.forward(q, k, v, kv_cache, md)
        ref = torch.cat(
            [
                reference_attention(lay.q[r][s:e], lay.k[r][:e], lay.v[r][:e], s, scale)
                for r, s, e in step
            ]
        )
        results.append((out[: q.shape[0]].double().cpu(), ref))
    return results


def _metadata(
    step: Step, lay: _Layout, bs: int, width: int, device: torch.device
) -> CommonAttentionMetadata:
    q_lens = np.array([e - s for _, s, e in step], dtype=np.int64)
    seq_lens = np.array([e for _, _, e in step], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    table = np.zeros((len(step), width), dtype=np.int32)
    for i, (r, _, _) in enumerate(step):
        table[i, : len(lay.block_tables[r])] = lay.block_tables[r]
    positions = np.concatenate([np.arange(s, e) for _, s, e in step])
    rows = np.repeat(np.arange(len(step)), q_lens)
    slots = table[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def dev(a: np.ndarray, dt: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dt)

    return CommonAttentionMetadata(
        num_reqs=len(step),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=dev(qsl, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_table=dev(table, torch.int32),
        slot_mapping=dev(slots, torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=bs,
    )


def check_attention_backend(
    backend: type[AttentionBackend],
    case: AttentionCase,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tolerances: dict[torch.dtype, tuple[float, float]] | None = None,
) -> None:
    """Run ``case`` and raise ``AssertionError`` at the first step whose output differs from the
    float64 reference by more than the tolerance of ``dtype``."""
    atol, rtol = {**DEFAULT_TOLERANCES, **(tolerances or {})}[dtype]
    for i, (out, ref) in enumerate(run_attention_case(backend, case, device, dtype)):
        err = (out - ref).abs().max().item() if out.shape == ref.shape else float("nan")

        def msg(m: str, i: Any = i, err: float = err) -> str:
            return (
                f"{backend.__name__} on {case.name} ({dtype}, {device}), step {i + 1} of "
                f"{len(case.steps)} {list(case.steps[i])}: max abs error {err:.3g}\n{m}"
            )

        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=msg)
