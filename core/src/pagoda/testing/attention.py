"""Attention backend conformance: a backend's output against a float64 reference.

Each :class:`AttentionCase` is a short sequence of engine steps over a paged KV cache whose blocks
are scattered at random, whose unused memory (block 0, the tail of each last block, free blocks)
holds random values that a correct backend masks out, and whose block tables are padded with 0.
Every step's output is compared with attention computed in float64 from the same inputs; a last
decode step for every request reads back what the case's final step wrote. The scenarios are
what the scheduler produces: prefill, decode, mixed batches (decodes, chunked prefills and new
prompts together) and prefix-cached context (requests that share the blocks of a common prefix).
Feature cases run the same scenarios with one :class:`~pagoda.attention.spec.AttentionSpec` field
each set away from plain causal attention, at a scale where a backend that ignores the field
fails.

An FP8 KV cache (``kv_cache_dtype=torch.float8_e4m3fn``) runs the same cases with scales of the
layer's own (:data:`FP8_KV_SCALES`, not 1.0, so that a backend that ignores them fails); the
reference then attends over the keys and values as the cache holds them (``fp8(x / scale) *
scale``), so the tolerance (:data:`FP8_KV_TOLERANCES`) covers the backend's arithmetic, not the
format's rounding.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda.attention.backend import (
    AttentionBackend,
    CommonAttentionMetadata,
    kv_stored_by_model,
    write_kv_cache,
)
from pagoda.attention.spec import AttentionSpec
from pagoda.ops.fp8 import FP8_DTYPE, from_fp8, to_fp8

#: (atol, rtol) per dtype; backends with looser arithmetic (TF32, fp8) pass their own.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}

#: (atol, rtol) per compute dtype with an FP8 KV cache: the dequantized keys and values are
#: rounded to the compute dtype (or the scales applied in another order) before the dots.
FP8_KV_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (4e-2, 4e-2),
}
#: The key and value scales an FP8 case's layer has: the kit's keys and values (normal, at most
#: about 4.5) then span most of e4m3's range (448) without reaching past it.
FP8_KV_SCALES = (0.0125, 0.02)

# A step: (request index, first token, end token) for each request scheduled in it.
Step = list[tuple[int, int, int]]


@dataclass(frozen=True)
class AttentionCase:
    """One scenario on one model shape. ``steps`` say which tokens of which request each step
    computes; a request's tokens before ``start`` are its context, already in the cache. The
    fields from ``scale`` on are the layer's :class:`AttentionSpec` (``spec``); a case with
    ``sinks`` draws the sink logits too."""

    scenario: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    seq_lens: tuple[int, ...]  # every request's length at the end of the case
    steps: tuple[tuple[tuple[int, int, int], ...], ...]
    shared_prefix: int = 0  # leading tokens (whole blocks) all requests share with request 0
    seed: int = 0
    scale: float | None = None  # None: head_size ** -0.5
    value_head_size: int | None = None
    causal: bool = True
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: bool = False
    chunk_size: int | None = None

    @property
    def spec(self) -> AttentionSpec:
        return AttentionSpec(
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.head_size**-0.5 if self.scale is None else self.scale,
            self.value_head_size,
            self.causal,
            self.sliding_window,
            self.logit_softcap,
            self.sinks,
            self.chunk_size,
        )

    @property
    def name(self) -> str:
        g = self.num_heads // self.num_kv_heads
        features = "".join(f"-{f}" for f in self.spec.features())
        return (
            f"{self.scenario}-h{self.num_heads}kv{self.num_kv_heads}(g{g})-d{self.head_size}"
            f"-bs{self.block_size}{features}"
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

#: One spec field each, set where it changes every scenario's output by far more than the
#: tolerances: windows and chunks shorter than the contexts and not block-aligned, logits scaled
#: up past the soft-cap, sink logits that take a sizeable share of the softmax.
FEATURES: dict[str, dict[str, Any]] = {
    "value_head_size": {"value_head_size": 32},
    "causal": {"causal": False},
    "sliding_window": {"sliding_window": 7},
    "logit_softcap": {"logit_softcap": 2.0, "scale": 4 * 64**-0.5},
    "sinks": {"sinks": True},
    "chunk_size": {"chunk_size": 12},
}


def attention_cases(
    head_sizes: tuple[int, ...] = HEAD_SIZES,
    block_sizes: tuple[int, ...] = BLOCK_SIZES,
    head_configs: tuple[tuple[int, int], ...] = HEAD_CONFIGS,
    features: bool = True,
) -> list[AttentionCase]:
    """Every scenario on every (heads, kv heads), head size and block size given; then, when
    ``features``, every scenario with each :data:`FEATURES` entry, on 8 heads over 2 KV heads of
    64, blocks of 16 (a backend runs those its ``unsupported`` accepts)."""
    cases = []
    for i, (bs, (h, kv), d) in enumerate(itertools.product(block_sizes, head_configs, head_sizes)):
        for scenario in _scenarios(bs):
            cases.append(_case(scenario, h, kv, d, bs, i))
    if features:
        for j, fields in enumerate(FEATURES.values()):
            for scenario in _scenarios(16):
                cases.append(_case(scenario, 8, 2, 64, 16, 100 + j, **fields))
    return cases


def fp8_kv_cases() -> list[AttentionCase]:
    """The cases an FP8 KV cache runs: every scenario on 8 heads over 2 KV heads and on one KV
    head, head size 64, blocks of 16, and each scenario with a sliding window."""
    cases = attention_cases((64,), (16,), ((8, 2), (4, 1)), features=False)
    for scenario in _scenarios(16):
        cases.append(_case(scenario, 8, 2, 64, 16, 200, **FEATURES["sliding_window"]))
    return cases


def fresh_prompt_cases() -> list[AttentionCase]:
    """Steps of new prompts only, each of two tokens or more and one step whole (a pooling
    model's step): 8 heads over 2 KV heads of 64, causal and bidirectional, and 4 heads over
    one of 128, blocks of 16. Run with ``unread`` (:func:`run_attention_case`)."""
    bs = 16
    lens = (2, bs - 1, bs + 1, 2 * bs + 3)
    step = (tuple((r, 0, n) for r, n in enumerate(lens)),)
    return [
        AttentionCase("fresh", h, kv, d, bs, lens, step, 0, 300 + i, **spec)
        for i, (h, kv, d, spec) in enumerate(
            [(8, 2, 64, {}), (8, 2, 64, FEATURES["causal"]), (4, 1, 128, {})]
        )
    ]


def _case(scenario: str, h: int, kv: int, d: int, bs: int, seed: int, **spec: Any) -> AttentionCase:
    lens, steps, shared = _scenarios(bs)[scenario]
    final = [(r, s, e) for r, (s, e) in enumerate((n, n + 1) for n in lens)]
    all_steps = tuple(tuple(step) for step in [*steps, final])
    lens_plus = tuple(n + 1 for n in lens)
    return AttentionCase(scenario, h, kv, d, bs, lens_plus, all_steps, shared, seed, **spec)


# ---- running a case -----------------------------------------------------------------------------


@dataclass
class _Layout:
    block_tables: list[list[int]]  # each request's blocks
    num_blocks: int
    q: list[torch.Tensor]  # per request [len, heads, d], float64
    k: list[torch.Tensor]  # per request [len, kv_heads, d], float64
    v: list[torch.Tensor]  # per request [len, kv_heads, v_head_size], float64
    sinks: torch.Tensor | None  # [heads] float64, when the case has sinks


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

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return t.to(dtype).to(torch.float64)  # exactly representable in the backend's dtype

    dv = case.spec.v_head_size
    q = [rand(n, case.num_heads, case.head_size) for n in case.seq_lens]
    k = [rand(n, case.num_kv_heads, case.head_size) for n in case.seq_lens]
    v = [rand(n, case.num_kv_heads, dv) for n in case.seq_lens]
    for r in range(1, len(case.seq_lens)):  # the shared prefix holds the same keys and values
        k[r][: case.shared_prefix] = k[0][: case.shared_prefix]
        v[r][: case.shared_prefix] = v[0][: case.shared_prefix]
    # Sink logits around 3: exp(3) is a sizeable share of a softmax over tens of keys.
    sinks = (rand(case.num_heads) + 3).to(dtype).double() if case.sinks else None
    return _Layout(tables, num_blocks, q, k, v, sinks)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """float64 attention of queries at positions ``start..`` over keys ``0..``: ``q`` [n, heads,
    d], ``k`` [start + n, kv_heads, d], ``v`` [start + n, kv_heads, dv] -> [n, heads, dv]. The
    keyword arguments are :class:`AttentionSpec`'s rules (``sinks``: the [heads] sink logits);
    the defaults are plain causal attention."""
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    i = torch.arange(start, start + q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    seen = (j <= i) if causal else torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if sliding_window is not None:
        seen &= (i - j).abs() < sliding_window
    if chunk_size is not None:
        seen &= i // chunk_size == j // chunk_size
    scores.masked_fill_(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def reference_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    q_lens: list[int],
    scale: float,
    **rules: Any,
) -> torch.Tensor:
    """float64 attention of a step's queries (``q`` [sum(q_lens), heads, d], each request's the
    last ``q_lens[i]`` of its ``seq_lens[i]`` tokens) over each request's keys and values
    gathered from paged caches (``[num_blocks, block_size, kv_heads, d]``, any strides) through
    ``block_table``; ``rules`` are :func:`reference_attention`'s."""
    out = torch.zeros_like(q, dtype=torch.float64)
    start, page = 0, key_cache.shape[1]
    for i, (sl, ql) in enumerate(zip(seq_lens, q_lens)):
        blocks = block_table[i, : -(-sl // page)].long()
        k = key_cache[blocks].flatten(0, 1)[:sl]
        v = value_cache[blocks].flatten(0, 1)[:sl]
        out[start : start + ql] = reference_attention(
            q[start : start + ql], k, v, sl - ql, scale, **rules
        )
        start += ql
    return out


def run_attention_case(
    backend: type[AttentionBackend],
    case: AttentionCase,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    reference_spec: AttentionSpec | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    model_stores: bool = False,
    kept_rows: bool = False,
    unread: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run every step of ``case`` through ``backend``; (output, float64 reference) per step.
    The reference follows ``reference_spec``'s rules (default: the case's ``spec``; a negative
    control passes one with a feature dropped). ``kv_cache_dtype`` (None: ``dtype``) is the
    cache's; an FP8 one holds keys and values scaled by :data:`FP8_KV_SCALES`.
    ``model_stores``: each step's keys and values are stored before its forward, as a model's
    kernel would (``accepts_model_stored_kv``), and the forward runs under
    ``kv_stored_by_model``; ``AssertionError`` where it changes the cache. ``kept_rows`` (with
    ``model_stores``): then only one query a request attends, its last of the step (a
    bidirectional case's first), through the metadata of
    :meth:`CommonAttentionMetadata.kept_rows` (a pooling model's last layer), and the reference
    is those rows'. ``unread``: a step whose keys and values no later step reads (a case of
    :func:`fresh_prompt_cases`): where the impl's ``attends_from_inputs`` says so for it,
    nothing is stored and the forward runs under ``kv_stored_by_model`` over a cache whose
    slots hold other values; ``AssertionError`` where it changes the cache."""
    device = torch.device(device)
    ref_spec = case.spec if reference_spec is None else reference_spec
    cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
    if kept_rows and not model_stores:
        raise ValueError("kept_rows attend over keys and values stored first: model_stores")
    if unread and (model_stores or len(case.steps) != 1):
        raise ValueError("unread runs one step of new prompts, with nothing stored")
    args = (backend, case, device, dtype, ref_spec, cache_dtype, model_stores, kept_rows, unread)
    if device.type != "cpu":
        return _run(*args)
    # NOTE: the shapes are tiny; on a CPU, threads only contend (several times slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(*args)
    finally:
        torch.set_num_threads(threads)


def _run(
    backend: type[AttentionBackend],
    case: AttentionCase,
    device: torch.device,
    dtype: torch.dtype,
    ref_spec: AttentionSpec,
    cache_dtype: torch.dtype,
    model_stores: bool = False,
    kept_rows: bool = False,
    unread: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    lay = _layout(case, dtype)
    bs, d, spec = case.block_size, case.head_size, case.spec
    shape = backend.get_kv_cache_shape(lay.num_blocks, bs, case.num_kv_heads, spec.cache_head_size)
    gen = torch.Generator().manual_seed(case.seed + 1)
    kv_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    impl = backend.get_impl_cls()(case.num_heads, d, spec.scale, case.num_kv_heads)
    impl.spec = spec  # as the layer does
    fp8 = cache_dtype == FP8_DTYPE
    k_scale, v_scale = FP8_KV_SCALES if fp8 else (1.0, 1.0)
    impl.k_scale = torch.tensor([k_scale], dtype=torch.float32, device=device)
    impl.v_scale = torch.tensor([v_scale], dtype=torch.float32, device=device)
    if fp8:  # the reference reads what the cache holds
        lay.k = [from_fp8(to_fp8(t.to(dtype), k_scale), k_scale, torch.float64) for t in lay.k]
        lay.v = [from_fp8(to_fp8(t.to(dtype), v_scale), v_scale, torch.float64) for t in lay.v]
    if lay.sinks is not None:
        impl.sinks = lay.sinks.to(dtype).to(device)
    rules = {
        "causal": ref_spec.causal,
        "sliding_window": ref_spec.sliding_window,
        "logit_softcap": ref_spec.logit_softcap,
        "sinks": lay.sinks if ref_spec.sinks else None,
        "chunk_size": ref_spec.chunk_size,
    }
    width = max(len(t) for t in lay.block_tables) + 2
    results = []
    for step in case.steps:
        common = _metadata(step, lay, bs, width, device)
        q = torch.cat([lay.q[r][s:e] for r, s, e in step]).to(dtype).to(device)
        k = torch.cat([lay.k[r][s:e] for r, s, e in step]).to(dtype).to(device)
        v = torch.cat([lay.v[r][s:e] for r, s, e in step]).to(dtype).to(device)
        kept = None
        if kept_rows:  # one query a request, as a step of its own
            qsl = common.query_start_loc_cpu
            # (a bidirectional query sees every key: its request's first row stands for any)
            kept = torch.from_numpy(qsl[1:] - 1 if spec.causal else qsl[:-1].copy()).to(device)
            n = common.num_reqs
            kept_qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
            md = backend.build_metadata(common.kept_rows(kept, kept_qsl))
        else:
            md = backend.build_metadata(common)
        with torch.inference_mode():
            if model_stores:  # the model's store, before the forward
                write_kv_cache(k, v, kv_cache, common.slot_mapping, q.shape[0])
            # (nothing stored at all: the step's slots keep the cache's random values)
            skip = unread and impl.attends_from_inputs(kv_cache, md)
            if model_stores or skip:
                stored = kv_cache.clone()
            with kv_stored_by_model() if model_stores or skip else nullcontext():
                if kept is None:
                    out = impl.forward(q, k, v, kv_cache, md)
                else:
                    out = impl.forward(q[kept], k[kept], v[kept], kv_cache, md)
            if model_stores and not torch.equal(kv_cache, stored):
                raise AssertionError(
                    f"{backend.__name__} says accepts_model_stored_kv, but its forward changed "
                    f"the cache the model had stored the step's keys and values in "
                    f"({case.name}, step {list(step)})"
                )
            if skip and not torch.equal(kv_cache, stored):
                raise AssertionError(
                    f"{backend.__name__}'s impl says attends_from_inputs, but its forward under "
                    f"kv_stored_by_model wrote the cache ({case.name}, step {list(step)})"
                )
        ref = torch.cat(
            [
                reference_attention(
                    lay.q[r][s:e], lay.k[r][:e], lay.v[r][:e], s, ref_spec.scale, **rules
                )[slice(-1, None) if spec.causal else slice(0, 1)]
                if kept_rows
                else reference_attention(
                    lay.q[r][s:e], lay.k[r][:e], lay.v[r][:e], s, ref_spec.scale, **rules
                )
                for r, s, e in step
            ]
        )
        rows = q.shape[0] if kept is None else kept.shape[0]
        results.append((out[:rows].double().cpu(), ref))
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
    reference_spec: AttentionSpec | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    model_stores: bool = False,
    kept_rows: bool = False,
    unread: bool = False,
) -> None:
    """Run ``case`` and raise ``AssertionError`` at the first step whose output differs from the
    float64 reference (of ``reference_spec``, default the case's) by more than the tolerance of
    ``dtype`` (with an FP8 ``kv_cache_dtype``: :data:`FP8_KV_TOLERANCES`'s, unless
    ``tolerances`` says). A case whose spec the backend's ``unsupported`` rejects, or a cache
    dtype its ``supports_kv_cache_dtype`` does not, raises ``ValueError``. ``model_stores``:
    the keys and values come stored by the model, and with ``kept_rows`` only one query a
    request attends; ``unread``: a step whose keys and values no later step reads, stored only
    where the impl's ``attends_from_inputs`` says it reads them (see
    :func:`run_attention_case`)."""
    missing = backend.unsupported(case.spec)
    if missing is not None:
        raise ValueError(f"{backend.__name__} does not support {missing}, which {case.name} needs")
    fp8 = kv_cache_dtype is not None and kv_cache_dtype != dtype
    if fp8 and not backend.supports_kv_cache_dtype(kv_cache_dtype):
        raise ValueError(f"{backend.__name__} does not read a KV cache of {kv_cache_dtype}")
    base = FP8_KV_TOLERANCES if fp8 else DEFAULT_TOLERANCES
    atol, rtol = {**base, **(tolerances or {})}[dtype]
    steps = run_attention_case(
        backend,
        case,
        device,
        dtype,
        reference_spec,
        kv_cache_dtype,
        model_stores,
        kept_rows,
        unread,
    )
    for i, (out, ref) in enumerate(steps):
        err = (out - ref).abs().max().item() if out.shape == ref.shape else float("nan")

        def msg(m: str, i: Any = i, err: float = err) -> str:
            return (
                f"{backend.__name__} on {case.name} ({dtype}{', fp8 KV' if fp8 else ''}, "
                f"{device}), step {i + 1} of "
                f"{len(case.steps)} {list(case.steps[i])}: max abs error {err:.3g}\n{m}"
            )

        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, msg=msg)
