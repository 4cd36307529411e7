"""The ragged prefill kernel (new prompts over their own keys) against a float64 reference, and
the backend's choice of it: steps of new prompts only, plain layers, the setting on. The
interpreter runs a subset on the CPU (float32); on a GPU every case runs natively."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pagoda_attention_triton import kernels, ragged_prefill  # noqa: E402
from pagoda_attention_triton.backend import (  # noqa: E402
    TritonAttentionBackend,
    TritonAttentionImpl,
)
from pagoda_attention_triton.ragged_prefill import (  # noqa: E402
    RaggedLaunch,
    default_launch,
    ragged_prefill_attention,
)

from pagoda.attention.backend import CommonAttentionMetadata  # noqa: E402
from pagoda.attention.spec import AttentionSpec  # noqa: E402
from pagoda.testing.attention import attention_cases, reference_attention  # noqa: E402

_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if _CUDA else "cpu"
pytestmark = pytest.mark.gpu  # on CUDA where there is one, else on the CPU

LENS = (1, 7, 64, 200, 513)  # one token, under a tile, a tile, several, one past a power of 2
SHORT = (1, 7, 64, 70)


def _ragged_inputs(lens, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    return q, k, v, qsl


def _reference(q, k, v, qsl, scale, causal):
    bounds = zip(qsl[:-1].tolist(), qsl[1:].tolist())
    return torch.cat(
        [reference_attention(q[s:e], k[s:e], v[s:e], 0, scale, causal=causal) for s, e in bounds]
    )


def _case(lens, group, head_dim, causal, dtype, launch=None):
    name = f"{len(lens)}seqs-g{group}-d{head_dim}-{'causal' if causal else 'bidirectional'}"
    name += f"-{str(dtype).removeprefix('torch.')}"
    if launch is not None:
        name += f"-{launch.heads_per_program}heads"
    return pytest.param(lens, group, head_dim, causal, dtype, launch, id=name)


# On the CPU the interpreter runs a subset of float32 cases (each group, head dim and direction
# at least once, the full lengths twice); on a GPU the whole grid, at the default launch, and
# with stacked heads.
def _cases() -> list:
    if not _CUDA:
        stacked = RaggedLaunch(32, 16, 4, 2, heads_per_program=2)
        return [
            _case(LENS, 2, 64, True, torch.float32),
            _case(LENS, 2, 64, False, torch.float32),
            _case(SHORT, 1, 80, True, torch.float32),
            _case(SHORT, 4, 128, False, torch.float32),
            _case(SHORT, 4, 80, True, torch.float32, stacked),
        ]
    cases = []
    for group in (1, 2, 4):
        for head_dim in (64, 128, 80):
            for causal in (True, False):
                for dtype in (torch.bfloat16, torch.float32):
                    cases.append(_case(LENS, group, head_dim, causal, dtype))
    stacked = RaggedLaunch(128, 64, 8, 3, heads_per_program=4)
    cases.append(_case(LENS, 4, 128, True, torch.bfloat16, stacked))
    cases.append(_case(LENS, 4, 80, False, torch.bfloat16, replace(stacked, heads_per_program=2)))
    return cases


@pytest.mark.parametrize("lens,group,head_dim,causal,dtype,launch", _cases())
def test_ragged_prefill_matches_float64_reference(lens, group, head_dim, causal, dtype, launch):
    """Requests of 1 to 513 tokens, grouped-query heads, padded head dims, both directions: every
    row written (the output starts as NaN) and within the dtype's tolerance."""
    kv_heads = 2
    q, k, v, qsl = _ragged_inputs(lens, kv_heads * group, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    want = _reference(q, k, v, qsl, scale, causal)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    out = torch.full_like(dev(q), float("nan"))
    ragged_prefill_attention(
        dev(q), dev(k), dev(v), out, dev(qsl), len(lens), sum(lens), scale, causal, launch
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


def test_strided_views_of_a_fused_projection_are_read_in_place() -> None:
    """Queries, keys and values as views of one [tokens, q + k + v] projection (strided rows):
    the kernel reads them through their strides."""
    lens, heads, kv_heads, d = (5, 40), 4, 2, 64
    n = sum(lens)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    q = qkv[:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
    qsl = torch.tensor([0, 5, 45], dtype=torch.int32)
    want = _reference(q, k, v, qsl, d**-0.5, True)
    qkv_dev = qkv.to(DEVICE)
    views = [t.as_strided(t.shape, t.stride(), t.storage_offset()) for t in (q, k, v)]
    q_d, k_d, v_d = (qkv_dev.as_strided(t.shape, t.stride(), t.storage_offset()) for t in views)
    out = torch.full((n, heads, d), float("nan"), device=DEVICE)
    ragged_prefill_attention(q_d, k_d, v_d, out, qsl.to(DEVICE), 2, n, d**-0.5)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group,heads", [(1, 1), (2, 2), (3, 1), (4, 2), (8, 2)])
def test_the_default_launch_stacks_heads_only_where_they_divide_the_group(group, heads) -> None:
    """The bf16 default at head dim 128 stacks two heads a program; a model with one head a KV
    head (or three) gets one head a program instead of a launch the kernel refuses."""
    launch = default_launch(128, torch.bfloat16, torch.device("cpu"), group)
    assert launch.heads_per_program == heads


def test_a_launch_whose_stacked_heads_do_not_divide_the_group_is_refused() -> None:
    q, k, v, qsl = _ragged_inputs((3,), 6, 2, 64, torch.float32)  # group 3
    with pytest.raises(ValueError, match="heads_per_program 2 must divide the 3 query heads"):
        ragged_prefill_attention(
            q, k, v, torch.empty_like(q), qsl, 1, 3, 0.125, launch=RaggedLaunch(32, 16, 4, 2, 2)
        )


def _common(q_lens, seq_lens, device, bs=16) -> CommonAttentionMetadata:
    q_lens, seq_lens = np.array(q_lens), np.array(seq_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    blocks = -(-seq_lens // bs)
    table = np.zeros((len(q_lens), int(blocks.max()) + 1), dtype=np.int32)
    at = 1
    for i, b in enumerate(blocks):
        table[i, :b] = np.arange(at, at + b)
        at += b
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    pos = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
    slots = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
    i32 = dict(dtype=torch.int32, device=device)
    return CommonAttentionMetadata(
        num_reqs=len(q_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_table=torch.tensor(table, **i32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=bs,
    )


@pytest.fixture
def ragged_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each forward's kernel, recorded: True for the ragged one, False for the paged one."""
    calls: list[bool] = []
    ragged, paged = ragged_prefill.ragged_prefill_attention, kernels.paged_attention

    def spy_ragged(*a, **kw):
        calls.append(True)
        return ragged(*a, **kw)

    def spy_paged(*a, **kw):
        calls.append(False)
        return paged(*a, **kw)

    monkeypatch.setattr(ragged_prefill, "ragged_prefill_attention", spy_ragged)
    monkeypatch.setattr(kernels, "paged_attention", spy_paged)
    monkeypatch.setenv("PAGODA_TRITON_ON_CPU", "1")
    return calls


PLAIN = AttentionSpec(4, 2, 64, 0.125)


def _forward(spec, common, kv_dtype=torch.float32):
    """One layer's forward of the step ``common``: (output, cache after it, the step's keys)."""
    dtype = torch.float32
    n = common.num_actual_tokens
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(n, spec.num_heads, spec.head_size, generator=gen).to(DEVICE)
    k = torch.randn(n, spec.num_kv_heads, spec.head_size, generator=gen).to(DEVICE)
    v = torch.randn(n, spec.num_kv_heads, spec.head_size, generator=gen).to(DEVICE)
    blocks = int(common.block_table.max()) + 1
    shape = TritonAttentionBackend.get_kv_cache_shape(
        blocks, common.block_size, spec.num_kv_heads, spec.head_size
    )
    kv_cache = torch.zeros(shape, dtype=dtype, device=DEVICE).to(kv_dtype)
    impl = TritonAttentionImpl(spec.num_heads, spec.head_size, spec.scale, spec.num_kv_heads)
    impl.spec = spec
    impl.sinks = torch.zeros(spec.num_heads, device=DEVICE) if spec.sinks else None
    impl.k_scale = torch.ones(1, device=DEVICE)
    impl.v_scale = torch.ones(1, device=DEVICE)
    md = TritonAttentionBackend.build_metadata(common)
    with torch.inference_mode():
        return impl.forward(q, k, v, kv_cache, md), kv_cache, k


def test_a_step_of_new_prompts_takes_the_ragged_kernel_and_still_fills_the_cache(
    ragged_calls: list[bool],
) -> None:
    """New prompts only: the ragged kernel, and the cache holds the step's keys and values
    after it, as the paged path leaves it (a later decode reads them there)."""
    common = _common([3, 20], [3, 20], DEVICE)
    _, kv_cache, k = _forward(PLAIN, common)
    assert ragged_calls == [True]
    slots = common.slot_mapping
    torch.testing.assert_close(kv_cache[0].flatten(0, 1)[slots], k)


@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [([3, 20], [3, 21]), ([1, 1], [5, 9]), ([4, 1], [4, 9])],
    ids=["a prompt after a cached prefix", "decode", "a new prompt beside a decode"],
)
def test_a_step_with_any_cached_context_takes_the_paged_kernel(
    ragged_calls: list[bool], q_lens: list[int], seq_lens: list[int]
) -> None:
    _forward(PLAIN, _common(q_lens, seq_lens, DEVICE))
    assert ragged_calls == [False]


@pytest.mark.parametrize(
    "spec",
    [
        replace(PLAIN, sliding_window=7),
        replace(PLAIN, chunk_size=12),
        replace(PLAIN, logit_softcap=2.0),
        replace(PLAIN, sinks=True),
    ],
    ids=lambda s: s.features()[0],
)
def test_a_layer_with_an_extra_takes_the_paged_kernel_for_new_prompts(
    ragged_calls: list[bool], spec: AttentionSpec
) -> None:
    _forward(spec, _common([3, 20], [3, 20], DEVICE))
    assert ragged_calls == [False]


def test_an_fp8_cache_keeps_new_prompts_on_the_paged_kernel(ragged_calls: list[bool]) -> None:
    """An FP8 cache is attended as stored, so that every read of a token sees the same values."""
    _forward(PLAIN, _common([3, 20], [3, 20], DEVICE), kv_dtype=torch.float8_e4m3fn)
    assert ragged_calls == [False]


def test_a_bidirectional_layer_takes_the_ragged_kernel_for_new_prompts(
    ragged_calls: list[bool],
) -> None:
    _forward(replace(PLAIN, causal=False), _common([3, 20], [3, 20], DEVICE))
    assert ragged_calls == [True]


def test_the_setting_off_keeps_new_prompts_on_the_paged_kernel(
    ragged_calls: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``plugins.triton.ragged_prefill: false``, as an engine's configuration gives it."""
    from pagoda.config import EngineConfig

    monkeypatch.setattr(TritonAttentionBackend, "ragged_prefill", True)
    monkeypatch.setenv("PAGODA_PLUGINS__TRITON__RAGGED_PREFILL", "false")
    TritonAttentionBackend.configure(EngineConfig.load(None).attention)
    assert TritonAttentionBackend.ragged_prefill is False
    _forward(PLAIN, _common([3, 20], [3, 20], DEVICE))
    assert ragged_calls == [False]


def test_a_ragged_kernel_launched_causal_fails_the_kits_bidirectional_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: the kit's bidirectional prefill case (new prompts only, so the ragged
    kernel's) fails when that kernel is launched causal."""
    from pagoda.testing.attention import check_attention_backend

    real = ragged_prefill.ragged_prefill_attention
    monkeypatch.setattr(
        ragged_prefill,
        "ragged_prefill_attention",
        lambda *a, **kw: real(
            *a[:8], causal=True, **{k: v for k, v in kw.items() if k != "causal"}
        ),
    )
    monkeypatch.setenv("PAGODA_TRITON_ON_CPU", "1")
    case = next(
        c for c in attention_cases() if c.scenario == "prefill" and c.spec.features() == ("causal",)
    )
    with pytest.raises(AssertionError, match="step 1 of"):
        check_attention_backend(TritonAttentionBackend, case, torch.device(DEVICE), torch.float32)
