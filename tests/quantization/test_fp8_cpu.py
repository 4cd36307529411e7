"""FP8 on the CPU, through the emulation the GPU path is checked against: the tiny Llama of
``fp8kit`` with ``quantization: fp8`` computes what its quantized-and-dequantized weights compute
in float32 with each linear's input quantized per token; FP8 checkpoints (compressed-tensors,
FBGEMM) load into the same weights as quantizing the full-precision checkpoint online; an FP8
KV cache stays close to a float32 one, takes its scales from the checkpoint or the first prompt,
and keeps prefix caching exact."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.models import parallel_layers
from pagoda.ops.fp8 import from_fp8, quantize_rows
from pagoda.testing import QuantizationMethodConformance
from pagoda.testing.quantization import fp8_checkpoint

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 3 for j in range(40)]} for i in range(3)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


class TestFp8Method(QuantizationMethodConformance):
    method = "fp8"
    checkpoint_configs = {
        "online": {},
        "compressed-tensors": fp8_checkpoint({})[1],
        "compressed-tensors-tensor": fp8_checkpoint({}, strategy="tensor")[1],
        "fbgemm": fp8_checkpoint({}, layout="fbgemm")[1],
    }


def _run(folder, **kwargs) -> tuple[list[list[int]], torch.Tensor, LLM]:
    """Greedy tokens and the prompt tokens' logprobs [prompts, positions] of an engine on
    ``folder``."""
    llm = LLM(model=str(folder), max_model_len=256, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY)
    logprobs = torch.tensor(
        [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outs]
    )
    return [o.outputs[0].token_ids for o in outs], logprobs, llm


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.engine_core.executor.worker.model_runner.model


@contextmanager
def _activations_quantized(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every decoder linear's input quantized per token and read back, before a float32
    product: with quantized-and-dequantized weights, the arithmetic of the W8A8 emulation."""

    def qdq(x: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_rows(x)
        return from_fp8(q, scale, x.dtype)

    col, row = (
        parallel_layers.ColumnParallelLinear.forward,
        parallel_layers.RowParallelLinear.forward,
    )
    with monkeypatch.context() as m:
        m.setattr(parallel_layers.ColumnParallelLinear, "forward", lambda s, x: col(s, qdq(x)))
        m.setattr(parallel_layers.RowParallelLinear, "forward", lambda s, x: row(s, qdq(x)))
        yield


def test_fp8_llama_on_cpu_computes_what_its_dequantized_weights_compute(
    fp8_folders, monkeypatch
) -> None:
    tokens, logprobs, _ = _run(fp8_folders["full"], quantization="fp8")
    with _activations_quantized(monkeypatch):
        ref_tokens, ref_logprobs, _ = _run(fp8_folders["qdq"])
    assert tokens == ref_tokens
    assert (logprobs - ref_logprobs).abs().max() < 1e-3
    # The control: without the activations' quantization the same weights are visibly off.
    _, plain, _ = _run(fp8_folders["qdq"])
    assert (plain - ref_logprobs).abs().mean() > 0.02


def test_fp8_weights_are_fp8_and_the_lm_head_and_embedding_are_not(fp8_folders) -> None:
    _, _, llm = _run(fp8_folders["full"], quantization="fp8")
    model = _model(llm)
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):  # fmt: skip
        assert linear.weight.dtype == torch.float8_e4m3fn
        assert linear.weight_scale.shape == (linear.weight.shape[0],)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("layout", ["compressed-tensors", "fbgemm"])
def test_fp8_checkpoint_loads_the_weights_online_quantization_makes(fp8_folders, layout) -> None:
    online_tokens, online_logprobs, online = _run(fp8_folders["full"], quantization="fp8")
    tokens, logprobs, llm = _run(fp8_folders[layout])  # the checkpoint names its method
    a, b = _model(online).state_dict(), _model(llm).state_dict()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.float8_e4m3fn
                           else a[name], b[name].view(torch.uint8)
                           if b[name].dtype == torch.float8_e4m3fn else b[name]), name  # fmt: skip
    qkv = _model(llm).model.layers[1].self_attn.qkv_proj
    assert torch.equal(
        qkv.weight_scale, _model(online).model.layers[1].self_attn.qkv_proj.weight_scale
    )
    assert tokens == online_tokens and torch.equal(logprobs, online_logprobs)


def test_per_tensor_fp8_checkpoint_gives_each_projection_its_scale(fp8_folders) -> None:
    _, _, llm = _run(fp8_folders["compressed-tensors-tensor"])
    qkv = _model(llm).model.layers[0].self_attn.qkv_proj
    q, k, v = qkv.weight_scale.split([64, 32, 32])
    for part in (q, k, v):
        assert (part == part[0]).all()
    assert len({q[0].item(), k[0].item(), v[0].item()}) == 3


def test_fp8_kv_cache_stays_close_to_a_float32_cache(fp8_folders) -> None:
    ref_tokens, ref_logprobs, _ = _run(fp8_folders["full"])
    tokens, logprobs, llm = _run(fp8_folders["full"], kv_cache_dtype="fp8")
    attn = _model(llm).model.layers[0].self_attn.attn
    assert attn.kv_cache.dtype == torch.float8_e4m3fn
    # Scales computed from the first prompt: its largest key lands at half the format's range.
    assert attn.k_scale.item() != 1.0 and attn.v_scale.item() != 1.0
    assert not attn.calibrate_kv_scales
    assert tokens == ref_tokens
    # (Logprobs of about -12 on average: the tiny model's logits are sharp.)
    err = (logprobs - ref_logprobs).abs()
    assert err.mean() < 0.15 and err.max() < 1.0, (err.mean(), err.max())


def test_fp8_kv_cache_holds_twice_the_blocks_of_bfloat16_in_the_same_memory(fp8_folders) -> None:
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model=str(fp8_folders["full"]), max_model_len=256, dtype="bfloat16",
                  kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20)  # fmt: skip
        blocks[kv] = llm.engine.engine_core.num_blocks
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_fp8_kv_scales_come_from_the_checkpoint(fp8_folders) -> None:
    _, _, llm = _run(fp8_folders["kv-scales"], kv_cache_dtype="fp8")
    layers = _model(llm).model.layers
    assert layers[0].self_attn.attn.k_scale.item() == pytest.approx(0.03)
    assert layers[1].self_attn.attn.v_scale.item() == pytest.approx(0.04)


def test_prefix_caching_with_an_fp8_kv_cache_gives_the_tokens_of_a_cold_cache(fp8_folders) -> None:
    shared = [(5 * j) % 250 + 3 for j in range(48)]  # three blocks of 16
    prompts = [{"prompt_token_ids": shared + [10 + i, 20 + i]} for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        llm = LLM(model=str(fp8_folders["full"]), max_model_len=256, kv_cache_dtype="fp8",
                  quantization="fp8", enable_prefix_caching=caching)  # fmt: skip
        first = llm.generate(prompts[:1], params)  # the first prompt sets the scales
        rest = llm.generate(prompts[1:], params)
        runs[caching] = [o.outputs[0].token_ids for o in first + rest]
        if caching:
            assert all(o.num_cached_tokens == 48 for o in rest)
    assert runs[True] == runs[False]


def test_kv_offload_carries_an_fp8_cache_through_the_cpu_pool(fp8_folders) -> None:
    """Prefixes pushed out of a small device cache into the CPU pool and loaded back give the
    tokens of a device cache that kept them (the pool holds the FP8 bytes as they are)."""
    prefixes = [[(11 * i + 7 * j) % 250 + 3 for j in range(96)] for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for offload in (0.0, 0.01):
        llm = LLM(model=str(fp8_folders["full"]), max_model_len=256, kv_cache_dtype="fp8",
                  num_gpu_blocks_override=17 if offload else 64, max_num_seqs=2,
                  cpu_offload_gb=offload)  # fmt: skip
        outs = []
        for rnd in range(2):  # the second round finds each prefix evicted (offload: in the pool)
            for i, p in enumerate(prefixes):
                o = llm.generate({"prompt_token_ids": p + [5 + rnd, 7 + i]}, params, use_tqdm=False)
                outs.append((o[0].outputs[0].token_ids, o[0].num_cached_tokens))
        runs[offload] = outs
        if offload:
            medium = llm.engine.engine_core.executor.worker.model_runner.kv_offload
            assert medium.cpu.dtype == torch.uint8  # the FP8 bytes
    assert [t for t, _ in runs[0.01]] == [t for t, _ in runs[0.0]]
    assert all(cached >= 80 for _, cached in runs[0.01][4:])  # hits, from the pool


def test_norms_before_fp8_projections_quantize_as_the_projections_would(
    fp8_folders, monkeypatch
) -> None:
    """The norm before each FP8 projection quantizes its output in its own kernel (interpreted
    here, as on a GPU): the same tokens and logprobs, bit for bit, as normalising, storing and
    quantizing in the projection; fails if the norms stop quantizing (no fused call) or
    quantize otherwise. (Both engines quantize through Triton's code, interpreted: the
    interpreter's FP8 cast rounds some values that carry into the next power of two down, 126.4
    to 64 where torch and a GPU give 128, so torch's quantization is not the reference here.)"""
    from pagoda import ops
    from pagoda.ops import triton_norm

    calls: list[int] = []
    real = triton_norm.rms_norm_fp8_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setenv("PAGODA_TRITON_ON_CPU", "1")
    monkeypatch.setattr(triton_norm, "rms_norm_fp8_triton", counted)
    enabled = ops._enabled
    try:
        # (bfloat16: the norms quantize for 16-bit models)
        fused_tokens, fused, llm = _run(fp8_folders["full"], quantization="fp8", dtype="bfloat16")
        # Both norms of every layer, at every forward (a prefill and seven decode steps at least).
        assert len(calls) >= 2 * len(_model(llm).model.layers) * 8
        calls.clear()
        monkeypatch.setattr(ops, "FUSED_NORM_FP8", False)
        tokens, unfused, _ = _run(fp8_folders["full"], quantization="fp8", dtype="bfloat16")
        assert not calls
    finally:
        ops.set_fused_ops(enabled)
    assert fused_tokens == tokens
    assert torch.equal(fused, unfused)
