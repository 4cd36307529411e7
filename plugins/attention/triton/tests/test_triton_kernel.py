"""The Triton kernel against a float64 reference over random paged layouts (the interpreter runs
it on the CPU; on a GPU it runs natively)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pagoda_attention_triton.kernels import (  # noqa: E402
    longest_first,
    paged_attention,
)

import pagoda.ops as ops  # noqa: E402
from pagoda.attention.backend import write_kv_cache  # noqa: E402
from pagoda.ops.triton_kv_write import write_kv_triton  # noqa: E402
from pagoda.testing.attention import reference_paged_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on CUDA where there is one, else on the CPU


def _paged_layout(q_lens, ctx, heads, kv_heads, head_dim, page, dtype, seed=0):
    """Random queries and a paged cache of scattered blocks (block 0 left as padding): q, key
    cache, value cache, block table, seq lens, query start locations."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    max_blocks = max(-(-s // page) for s in seq_lens)
    num_blocks = len(q_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 stays padding
    bt = perm[: len(q_lens) * max_blocks].view(len(q_lens), max_blocks).int()
    kc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, kc, vc, bt, seq_lens, qsl


DECODE_6 = ([1] * 6, [40, 7, 300, 0, 129, 65])  # one request with no context before its token


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page,q_lens,ctx,splits,dtype,ordered",
    [
        (4, 4, 64, 16, [1, 1, 1], [40, 7, 100], 1, torch.float32, False),  # decode
        (6, 2, 64, 16, [17, 1, 5], [0, 30, 64], 1, torch.float32, False),  # mixed, GQA 3
        (8, 2, 128, 32, [33], [20], 1, torch.float32, False),  # chunked prefill over a context
        (4, 1, 64, 16, [1, 1], [300, 33], 4, torch.float32, False),  # split-KV decode
        # A verification step (5 queries a request, GQA 3: 16-row programs), split as decode.
        (9, 3, 64, 16, [5, 5], [600, 37], 4, torch.float32, False),
        # A long prefill chunk (the launch of 128 rows and 32-key tiles) beside a decode.
        (4, 2, 64, 16, [150, 1], [10, 40], 1, torch.float32, False),
        (4, 2, 64, 16, [9, 1], [5, 70], 1, torch.float16, False),
        # Decode longest first: each program finds its request through the permutation (not
        # the search of the query start locations), unsplit (`_paged_decode`) and split.
        (4, 2, 64, 16, *DECODE_6, 1, torch.float32, True),
        (4, 2, 64, 16, *DECODE_6, 4, torch.float32, True),
    ],
)
def test_paged_attention_matches_float64_reference(
    heads, kv_heads, head_dim, page, q_lens, ctx, splits, dtype, ordered
) -> None:
    if dtype != torch.float32 and DEVICE == "cpu":
        pytest.skip("half precision dot needs a GPU")
    q, kc, vc, bt, seq_lens, qsl = _paged_layout(
        q_lens, ctx, heads, kv_heads, head_dim, page, dtype
    )
    scale = head_dim**-0.5
    want = reference_paged_attention(q, kc, vc, bt, seq_lens, q_lens, scale)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    order = dev(torch.from_numpy(longest_first(np.array(seq_lens)))) if ordered else None
    out = torch.full_like(dev(q), float("nan"))  # a row no program writes fails the comparison
    paged_attention(
        dev(q),
        dev(kc),
        dev(vc),
        out,
        dev(bt),
        dev(torch.tensor(seq_lens, dtype=torch.int32)),
        dev(qsl),
        len(q_lens),
        sum(q_lens),
        max(q_lens),
        max(seq_lens),
        scale,
        splits,
        order=order,
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "q_lens,ctx,splits,tile_n",
    [
        # A verification graph of 9 queries a request (GQA 3), captured at 2,048 and replayed
        # with contexts of 1,000 and 37: 32 slices of each program's own keys, in 16-key tiles
        # (1,009 keys: 32 slices of 32, the last ones empty), and one request past every slice
        # but its first.
        ([9, 9], [1000, 37], 32, 16),
        # Decode: contexts that are not a multiple of anything, a request with no context, and
        # slices of one tile where a context is shorter than the splits' tiles.
        ([1, 1, 1, 1], [700, 5, 0, 129], 32, 64),
        ([1, 1], [2040, 300], 8, None),
    ],
)
def test_splits_share_each_programs_own_keys_below_a_captured_length(
    q_lens, ctx, splits, tile_n
) -> None:
    """A graph's steps pass the longest context it may replay with (2,048 here), not theirs:
    the kernel cuts each program's own keys into the slices, and every key is in one slice."""
    heads, kv_heads, head_dim = 9, 3, 64
    q, kc, vc, bt, seq_lens, qsl = _paged_layout(
        q_lens, ctx, heads, kv_heads, head_dim, 16, torch.float32, seed=3
    )
    captured = 2048
    table = torch.zeros(len(q_lens), captured // 16, dtype=torch.int32)
    table[:, : bt.shape[1]] = bt
    scale = head_dim**-0.5
    want = reference_paged_attention(q, kc, vc, bt, seq_lens, q_lens, scale)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = torch.full_like(dev(q), float("nan"))
    paged_attention(
        dev(q), dev(kc), dev(vc), out, dev(table),
        dev(torch.tensor(seq_lens, dtype=torch.int32)), dev(qsl), len(q_lens), sum(q_lens),
        max(q_lens), captured, scale, splits, tile_n=tile_n,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)


# Every launch of the kernels, for the spec's extras: (q_lens, ctx, splits, ordered, tile_n).
# Contexts reach several tiles past the window, so whole tiles lie below it.
SPEC_PATHS = {
    # `_paged_attention` unsplit: a new prompt, a decode, a chunked prefill over a context and a
    # decode shorter than the window, in one step.
    "mixed": ([17, 1, 5, 1], [0, 130, 64, 7], 1, False, None),
    # The long-prefill launch (128 rows, 32-key tiles): its later q-blocks start past the window.
    "long_prefill": ([150, 1], [10, 40], 1, False, None),
    # Split-KV decode in 16-key tiles: the window's keys fall in several of the splits.
    "split": (*DECODE_6, 4, False, 16),
    # Split-KV over the mixed step's longer queries (the kernel splits any step it is asked to;
    # the backend splits decode steps only): a bidirectional query's keys above it fall in
    # later splits than its own position's.
    "split_prefill": ([17, 1, 5, 1], [0, 130, 64, 7], 4, False, 16),
    # Decode longest first: `_paged_decode` unsplit, then `_paged_attention` in order, split.
    "ordered": (*DECODE_6, 1, True, None),
    "ordered_split": (*DECODE_6, 4, True, 16),
}
# The spec's extras at the conformance kit's scale (pagoda.testing.attention.FEATURES): a window
# and chunks shorter than most contexts, logits scaled up past the soft-cap, sink logits around
# 3. All together, the chunks are longer than the window and still cut it at their starts.
# Bidirectional (``causal: False``): alone, with a window or chunks (keys on both sides of a
# query, up to its window's or chunk's end), and with all the others.
SPEC_FEATURES = {
    "sliding_window": {"sliding_window": 40},
    "logit_softcap": {"logit_softcap": 2.0},
    "sinks": {"sinks": True},
    "chunk_size": {"chunk_size": 24},
    "all": {"sliding_window": 40, "logit_softcap": 2.0, "sinks": True, "chunk_size": 96},
    "bidirectional": {"causal": False},
    "bidirectional_window": {"causal": False, "sliding_window": 40},
    "bidirectional_chunk": {"causal": False, "chunk_size": 24},
    "bidirectional_all": {
        "causal": False,
        "sliding_window": 40,
        "logit_softcap": 2.0,
        "sinks": True,
        "chunk_size": 96,
    },
}
# What each rule is when a feature is dropped (the reference's and the kernel's default).
_DROPPED = {"causal": True}
# The launches where queries have keys above them (every path but the decode ones).
_MULTI_QUERY_PATHS = ("mixed", "long_prefill", "split_prefill")


def _spec_case(path: str, features: dict, dtype: torch.dtype, heads=4, kv_heads=2, head_dim=32):
    """The layout of ``path`` with ``features``: (kernel inputs, kernel keyword arguments, float64
    reference rules, ``paged_attention``'s positional tail)."""
    q_lens, ctx, splits, ordered, tile_n = SPEC_PATHS[path]
    page = 16
    q, kc, vc, bt, seq_lens, qsl = _paged_layout(
        q_lens, ctx, heads, kv_heads, head_dim, page, dtype
    )
    scale = head_dim**-0.5 * (4 if "logit_softcap" in features else 1)
    gen = torch.Generator().manual_seed(1)
    sinks = (torch.randn(heads, generator=gen) + 3).to(dtype) if features.get("sinks") else None
    rules = {
        "causal": features.get("causal", True),
        "sliding_window": features.get("sliding_window"),
        "logit_softcap": features.get("logit_softcap"),
        "sinks": sinks,
        "chunk_size": features.get("chunk_size"),
    }
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    kwargs = {**rules, "sinks": None if sinks is None else dev(sinks), "tile_n": tile_n}
    if ordered:
        kwargs["order"] = dev(torch.from_numpy(longest_first(np.array(seq_lens))))
    tail = (
        dev(bt),
        dev(torch.tensor(seq_lens, dtype=torch.int32)),
        dev(qsl),
        len(q_lens),
        sum(q_lens),
        max(q_lens),
        max(seq_lens),
        scale,
        splits,
    )
    return (q, kc, vc, bt, seq_lens, q_lens, ctx), kwargs, rules, tail


# Each extra alone on the mixed launch, all of them together on every launch (the window and
# the chunks alone on the others: the skipping test below). Bidirectional alone and with a
# window or chunks on each launch of longer queries too; with all the others on every launch
# (the decode launches run it causal: the same keys for a request's last token).
@pytest.mark.parametrize(
    "path,features,dtype",
    [
        *(("mixed", f, torch.float32) for f in SPEC_FEATURES if "all" not in f),
        *((p, "all", torch.float32) for p in SPEC_PATHS),
        *((p, "all", torch.bfloat16) for p in SPEC_PATHS),  # the engine's dtype, on a GPU
        *(
            (p, f, dtype)
            for p in ("long_prefill", "split_prefill")
            for f in ("bidirectional", "bidirectional_window", "bidirectional_chunk")
            for dtype in (torch.float32, torch.bfloat16)
        ),
        *(("mixed", f, torch.bfloat16) for f in SPEC_FEATURES if f.startswith("bidirectional")),
        *((p, "bidirectional_all", torch.float32) for p in SPEC_PATHS),
        *((p, "bidirectional_all", torch.bfloat16) for p in SPEC_PATHS),
    ],
)
def test_spec_extras_match_float64_reference_on_every_kernel_path(
    path: str, features: str, dtype: torch.dtype
) -> None:
    """Window, soft-cap, sinks and chunks, alone and together, on each launch: the unsplit mixed
    kernel, its long-prefill launch, split-KV decode (sinks join in the merge), ordered decode
    (`_paged_decode`) and ordered split decode. Each case also fails a reference that drops a
    feature, so a kernel that ignored it would not pass."""
    if dtype != torch.float32 and DEVICE == "cpu":
        pytest.skip("half precision dot needs a GPU")
    (q, kc, vc, bt, seq_lens, q_lens, _), kwargs, rules, tail = _spec_case(
        path, SPEC_FEATURES[features], dtype
    )
    want = reference_paged_attention(q, kc, vc, bt, seq_lens, q_lens, tail[7], **rules)
    for name, value in rules.items():
        off = _DROPPED.get(name)
        if value is off or (name == "causal" and path not in _MULTI_QUERY_PATHS):
            continue
        dropped = reference_paged_attention(
            q, kc, vc, bt, seq_lens, q_lens, tail[7], **{**rules, name: off}
        )
        assert (dropped - want).abs().max() > 1e-2, f"{path} does not depend on {name}"
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = torch.full_like(dev(q), float("nan"))  # a row no program writes fails the comparison
    paged_attention(dev(q), dev(kc), dev(vc), out, *tail, **kwargs)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


# The window on every launch; chunks (whose first key takes the same code from there on) on the
# two kernels that find it.
@pytest.mark.parametrize(
    "path,feature",
    [
        *((p, "sliding_window") for p in ("mixed", "split", "ordered", "ordered_split")),
        ("mixed", "chunk_size"),
        ("ordered", "chunk_size"),
    ],
)
def test_a_window_skips_the_tiles_below_it_not_only_masks_them(path: str, feature: str) -> None:
    """Keys and values wholly below the first key of a request's first query (its window's, its
    chunk's) are NaN in the cache: a kernel that read them (and masked them) would return NaN,
    as 0 x NaN is NaN in the dot with the values. 16-key tiles, one a page, so the poisoned
    pages are whole tiles."""
    features = SPEC_FEATURES[feature]
    (q, kc, vc, bt, seq_lens, q_lens, ctx), kwargs, rules, tail = _spec_case(
        path, features, torch.float32
    )
    want = reference_paged_attention(q, kc, vc, bt, seq_lens, q_lens, tail[7], **rules)
    page = kc.shape[1]
    poisoned = 0
    for i, first_q in enumerate(ctx):
        if feature == "sliding_window":
            first_key = max(first_q - features["sliding_window"] + 1, 0)
        else:
            first_key = first_q // features["chunk_size"] * features["chunk_size"]
        below = bt[i, : first_key // page].long()
        kc[below] = float("nan")
        vc[below] = float("nan")
        poisoned += len(below)
    assert poisoned >= 5  # the layouts reach well past the window
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = torch.full_like(dev(q), float("nan"))
    paged_attention(dev(q), dev(kc), dev(vc), out, *tail, **{**kwargs, "tile_n": 16})
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)


# The later q-blocks read the NaN pages (as they should), and their split partials divide NaN.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize(
    "features",
    [
        {"causal": False},
        {"causal": False, "sliding_window": 5},
        {"causal": False, "chunk_size": 12},
        {"causal": False, "sliding_window": 9, "chunk_size": 12},
    ],
    ids=str,
)
def test_a_bidirectional_query_sees_keys_above_it_and_a_window_skips_the_tiles_past_it(
    features: dict, split: int
) -> None:
    """A 40-token prompt in q-blocks of 8 queries (16 rows, 2 heads a KV head), 16-key tiles of
    one page. Its first q-block sees keys above its own queries (a causal one would not): up to
    the prompt's end, or with a window (chunks) only to its last query's window's (chunk's)
    end, 12 (or 12: chunk 0 ends there). Past that the pages are NaN: a kernel that read them
    would return NaN in that q-block's rows, which must match the reference (the later
    q-blocks read the NaN pages by rights). Unsplit and in 2 splits, whose second slice lies
    wholly past the window."""
    page, heads, kv_heads, head_dim = 16, 4, 2, 32
    q, kc, vc, bt, seq_lens, qsl = _paged_layout(
        [40], [0], heads, kv_heads, head_dim, page, torch.float32
    )
    scale = head_dim**-0.5
    rules = {"sliding_window": None, "chunk_size": None, **features}
    want = reference_paged_attention(q, kc, vc, bt, seq_lens, [40], scale, **rules)
    causal = reference_paged_attention(
        q, kc, vc, bt, seq_lens, [40], scale, **{**rules, "causal": True}
    )
    assert (causal[:8] - want[:8]).abs().max() > 1e-2  # the first q-block sees keys above it
    local = len(features) > 1
    if local:
        poisoned = bt[0, 1:].long()  # pages from key 16: past 7 + 5 (window) and 12 (chunk)
        kc[poisoned] = float("nan")
        vc[poisoned] = float("nan")
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = torch.full_like(dev(q), float("nan"))
    paged_attention(
        dev(q),
        dev(kc),
        dev(vc),
        out,
        dev(bt),
        dev(torch.tensor(seq_lens, dtype=torch.int32)),
        dev(qsl),
        1,
        40,
        40,
        40,
        scale,
        split,
        tile_n=16,
        block_m=16,
        **{k: v for k, v in rules.items() if v is not None},
    )
    rows = 8 if local else 40
    torch.testing.assert_close(out.cpu().double()[:rows], want[:rows], atol=2e-5, rtol=2e-5)


def test_longest_first_orders_by_descending_length_ties_in_their_own_order() -> None:
    assert longest_first(np.array([41, 8, 301, 1, 130, 66])).tolist() == [2, 4, 5, 0, 1, 3]
    assert longest_first(np.array([5, 7, 5])).tolist() == [1, 0, 2]


@pytest.mark.parametrize("heads_per_program", [1, 2, 8])
def test_the_order_changes_which_program_runs_when_not_what_it_computes(
    heads_per_program: int,
) -> None:
    """Each (request, KV head) does the same arithmetic in either launch, alone in a program or
    one of several heads a program loops over: the outputs are bit-identical (on a GPU in bf16,
    over 64 requests of 1 - 600 tokens)."""
    on_gpu = DEVICE == "cuda"
    n, heads, kv_heads, head_dim, page = (64, 16, 8, 128, 16) if on_gpu else (5, 16, 8, 32, 16)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gen = torch.Generator().manual_seed(2)
    seq_lens = torch.randint(1, 600 if on_gpu else 60, (n,), generator=gen)
    blocks = -(-seq_lens // page)
    bt = torch.zeros(n, int(blocks.max()), dtype=torch.int32)
    perm = torch.randperm(int(blocks.sum()), generator=gen) + 1
    at = 0
    for i, b in enumerate(blocks.tolist()):
        bt[i, :b] = perm[at : at + b]
        at += b
    kc = torch.randn(at + 1, page, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(at + 1, page, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    args = (dev(q), dev(kc), dev(vc))
    rest = (dev(bt), dev(seq_lens.int()), dev(torch.arange(n + 1, dtype=torch.int32)), n, n, 1)
    rest = (*rest, int(seq_lens.max()), head_dim**-0.5)
    plain, ordered = torch.empty_like(args[0]), torch.empty_like(args[0])
    # One launch for both (ordered decode defaults to shorter tiles: another summation order).
    launch = {"tile_n": 128, "num_warps": 4, "num_stages": 2}
    paged_attention(*args, plain, *rest, **launch)
    order = dev(torch.from_numpy(longest_first(seq_lens.numpy())))
    paged_attention(
        *args, ordered, *rest, order=order, heads_per_program=heads_per_program, **launch
    )
    assert torch.equal(plain, ordered)


def test_an_order_is_refused_for_steps_with_longer_queries() -> None:
    q = torch.zeros(3, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="decode steps"):
        paged_attention(
            q,
            cache,
            cache,
            torch.empty_like(q),
            torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
            torch.tensor([2, 1], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE),
            2,
            3,
            2,
            2,
            1.0,
            order=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cache_write_stores_what_the_two_copies_store(dtype: torch.dtype) -> None:
    tokens, heads, kv_heads, dim, blocks, page = 9, 4, 2, 64, 6, 4
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    k = k.view(tokens, kv_heads, dim)  # strided views of the projection, as the model has them
    v = v.view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * page, generator=gen)[: tokens + 2].to(DEVICE)
    cache = torch.randn(2, blocks, page, kv_heads, dim, generator=gen).to(dtype).to(DEVICE)
    want = cache.clone()
    try:  # the torch copies (on a GPU write_kv_cache takes this kernel too)
        ops.set_fused_ops(False)
        write_kv_cache(k, v, want, slots, tokens - 2)  # fewer tokens than the slots given
    finally:
        ops.set_fused_ops(True)
    write_kv_triton(k, v, cache, slots, tokens - 2)
    assert torch.equal(cache, want)
