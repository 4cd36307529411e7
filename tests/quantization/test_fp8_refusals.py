"""What FP8 refuses, each in one line that names what is missing: an attention backend that
cannot read an FP8 KV cache, a GPU without FP8 tensor cores (the capability query stood in for),
an unknown method, a checkpoint the method cannot read; and the kits' negative controls (a kit
that passes everything tests nothing)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagoda.attention.backend import AttentionImpl
from pagoda.attention.selector import select_attention_backend
from pagoda.attention.torch_native import TorchNativeBackend, TorchNativeImpl
from pagoda.ops import fp8 as fp8_ops
from pagoda.plugins import PluginSelectionError, UnknownNameError, hookimpl, plugin_registered
from pagoda.quantization import kv_cache_unsupported, resolve_quantization
from pagoda.quantization.fp8 import Fp8LinearMethod, Fp8Method
from pagoda.testing.attention import check_attention_backend, fp8_kv_cases
from pagoda.testing.quantization import check_linear_method, fp8_checkpoint

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


class PlainCacheBackend(TorchNativeBackend):
    """The reference backend, without FP8 caches (as any backend that does not declare them)."""

    name = "plain_cache"

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype) -> bool:
        return False


class _PlainCachePlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_attention_backends(self, register):
        register("plain_cache", PlainCacheBackend)


def test_a_named_backend_that_cannot_read_an_fp8_cache_is_refused_in_one_line() -> None:
    with plugin_registered(_PlainCachePlugin(), "plain_cache_plugin"):
        with pytest.raises(PluginSelectionError) as e:
            select_attention_backend("plain_cache", CPU, torch.float32, 64, 16, (), FP8)
        assert select_attention_backend("plain_cache", CPU, torch.float32, 64) is PlainCacheBackend
        # auto passes over it for one that reads FP8
        chosen = select_attention_backend("auto", CPU, torch.float32, 64, 16, (), FP8)
    msg = str(e.value)
    assert "\n" not in msg
    assert "'plain_cache' cannot read a KV cache of float8_e4m3fn" in msg
    assert "torch_native" in msg and chosen.supports_kv_cache_dtype(FP8)


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> torch.device:
    monkeypatch.setattr(fp8_ops, "cuda_capability", lambda device: capability)
    return torch.device("cuda", 0)


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused_in_one_line(monkeypatch) -> None:
    ampere = _gpu(monkeypatch, (8, 0))
    with pytest.raises(ValueError) as e:
        resolve_quantization("fp8", {}, ampere, torch.bfloat16)
    msg = str(e.value)
    assert "\n" not in msg and "compute capability 8.9" in msg and "8.0" in msg
    why = kv_cache_unsupported("fp8", ampere)
    assert why is not None and "kv_cache_dtype=fp8" in why and "8.0" in why
    assert kv_cache_unsupported("auto", ampere) is None


def test_fp8_runs_on_hopper_and_ada(monkeypatch) -> None:
    for cap in ((9, 0), (8, 9)):
        gpu = _gpu(monkeypatch, cap)
        assert resolve_quantization("fp8", {}, gpu, torch.bfloat16) == "fp8"
        assert kv_cache_unsupported("fp8", gpu) is None


def test_an_unknown_quantization_method_names_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown quantization method 'awq'; available: "
                       r"[^\n]*fp8"):  # fmt: skip
        resolve_quantization("awq", {}, CPU, torch.float32)


def test_checkpoints_fp8_cannot_read_are_refused_in_one_line() -> None:
    _, block = fp8_checkpoint({})
    block["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    hf_blocks = {"quant_method": "fp8", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128]}  # fmt: skip
    for cfg, words in (
        (block, "block scales are not supported"),
        (hf_blocks, "FP8 in blocks of [128, 128] (quant_method fp8), which fp8 does not read"),
        ({"quant_method": "gptq", "bits": 4}, "no quantization method reads it"),
    ):
        with pytest.raises(ValueError) as e:
            resolve_quantization(None, {"quantization_config": cfg}, CPU, torch.float32)
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot load in full precision"):
        resolve_quantization("none", {"quantization_config": fp8_checkpoint({})[1]}, CPU,
                             torch.float32)  # fmt: skip


def test_the_checkpoint_selects_fp8_and_a_full_precision_one_nothing() -> None:
    cfg = {"quantization_config": fp8_checkpoint({}, layout="fbgemm")[1]}
    assert resolve_quantization(None, cfg, CPU, torch.float32) == "fp8"
    assert resolve_quantization(None, {}, CPU, torch.float32) is None
    assert resolve_quantization("none", {}, CPU, torch.float32) is None


def test_a_model_class_without_quantization_is_refused(monkeypatch) -> None:
    from pagoda import LLM
    from pagoda.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_quantization", False)
    with pytest.raises(ValueError, match="takes no quantization method"):
        LLM(model=None, load_format="dummy", quantization="fp8", max_model_len=64)


class _RowsIgnored(Fp8LinearMethod):
    """Loads every projection at the top of the layer: the classic merged-layer bug."""

    def load_weight(self, layer, name, weight, where):
        super().load_weight(layer, name, weight, replace(where, row_offset=0))


class _RowsIgnoredMethod(Fp8Method):
    name = "rows_ignored"

    def __init__(self, checkpoint_config):
        super().__init__(checkpoint_config)
        self.linear = _RowsIgnored()


def test_the_linear_kit_fails_a_method_that_misplaces_projections() -> None:
    assert check_linear_method(Fp8Method) < 0.05
    with pytest.raises(AssertionError, match="column-parallel q/k/v linear is off"):
        check_linear_method(_RowsIgnoredMethod)


class _ScalesIgnoredImpl(TorchNativeImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata):
        self.k_scale = self.v_scale = None  # as a backend that never reads them
        return super().forward(query, key, value, kv_cache, attn_metadata)


class ScalesIgnoredBackend(TorchNativeBackend):
    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return _ScalesIgnoredImpl


def test_the_attention_kit_fails_a_backend_that_ignores_the_kv_scales() -> None:
    case = fp8_kv_cases()[1]  # decode: the second step reads back what the first wrote
    check_attention_backend(TorchNativeBackend, case, kv_cache_dtype=FP8)
    with pytest.raises(AssertionError, match="fp8 KV"):
        check_attention_backend(ScalesIgnoredBackend, case, kv_cache_dtype=FP8)


def test_lora_over_quantized_linears_is_refused_in_one_line() -> None:
    from pagoda import LLM

    with pytest.raises(ValueError) as e:
        LLM(model=None, load_format="dummy", quantization="fp8", enable_lora=True,
            max_model_len=64)  # fmt: skip
    assert "LoRA adapters do not run over quantized linears" in str(e.value)
    assert "\n" not in str(e.value)
