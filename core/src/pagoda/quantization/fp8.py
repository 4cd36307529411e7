"""``fp8``: FP8 e4m3 weights with one scale per output channel, activations quantized per token
as they come (W8A8, dynamic), the product on FP8 tensor cores (:func:`pagoda.ops.fp8.fp8_linear`).

Weights come from either source:

- a full-precision checkpoint (safetensors or GGUF, ``quantization: fp8``): each weight row is
  quantized with its own scale as it loads, so a model never sits in memory in both precisions;
- an FP8 checkpoint as Hugging Face publishes them: compressed-tensors (``quant_method:
  compressed-tensors``, float weights of 8 bits, per-channel or per-tensor scales,
  ``weight_scale`` beside each ``weight``) and FBGEMM (``quant_method: fbgemm_fp8``, per-channel
  ``weight_scale``). A per-tensor scale becomes one per row of its projection, so q, k and v
  (gate and up) with scales of their own share one merged matrix. Activation scales of the
  checkpoint (``input_scale``, ``activation_scale_ub``) are not read: activations are scaled
  per token, at run time, which is as accurate or more.

Layers the checkpoint leaves in full precision (compressed-tensors ``ignore``, FBGEMM
``modules_to_not_convert``) stay so; the LM head and the embedding always do.

On a CPU the product is emulated (:func:`pagoda.ops.fp8.fp8_linear`): each layer keeps its
weights dequantized in float32 beside the FP8 ones, four times their bytes, so that a step does
not dequantize them again. It is the path tests check the GPU's against, not a way to save
memory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from pagoda.loader.sharded import WeightSlice
from pagoda.ops.fp8 import (
    FP8_DTYPE,
    fp8_linear,
    fp8_unsupported,
    from_fp8,
    quantize_rows,
)
from pagoda.quantization.method import LinearMethod, LinearSlice, QuantizationMethod

logger = logging.getLogger(__name__)

COMPRESSED_TENSORS = "compressed-tensors"
FBGEMM = "fbgemm_fp8"
HF_FP8 = "fp8"  # transformers' fine-grained FP8: block scales (weight_scale_inv)
# Checkpoint tensors of a linear that dynamic per-token activations make unused.
_IGNORED_TENSORS = frozenset({"input_scale", "input_scale_ub", "input_zero_point"})


def checkpoint_layout(cfg: dict[str, Any]) -> str | None:
    """None when :class:`Fp8Method` reads a checkpoint with this ``quantization_config``
    (``{}``: full precision, quantized online), else why not, one line."""
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method == FBGEMM:
        return None
    if method == HF_FP8:
        return (
            f"its weights are FP8 in blocks of {cfg.get('weight_block_size') or [128, 128]} "
            "(quant_method fp8), which fp8 does not read yet: load the model's bf16 checkpoint "
            "with quantization: fp8, or a compressed-tensors or FBGEMM FP8 export"
        )
    if method != COMPRESSED_TENSORS:
        return f"its quant_method {method!r} is not one fp8 reads ({COMPRESSED_TENSORS}, {FBGEMM})"
    groups = cfg.get("config_groups") or {}
    if not groups:
        return "its compressed-tensors config has no config_groups"
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            return (
                f"config group {name!r} has {w.get('num_bits')}-bit {w.get('type')} weights; fp8 "
                "reads 8-bit float weights"
            )
        if w.get("strategy") not in ("channel", "tensor"):
            return (
                f"config group {name!r} scales weights by {w.get('strategy')!r}; fp8 reads "
                "per-channel and per-tensor scales (block scales are not supported)"
            )
    return None


def _ignored(cfg: dict[str, Any], name: str) -> bool:
    """Whether the checkpoint left layer ``name`` (``model.layers.0.mlp.down_proj``) unquantized."""
    if cfg.get("quant_method") == FBGEMM:
        return any(m in name for m in cfg.get("modules_to_not_convert") or [])
    for entry in cfg.get("ignore") or []:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name):
                return True
        elif entry == name:
            return True
    return False


class Fp8Method(QuantizationMethod):
    """FP8 W8A8 (see the module's docstring)."""

    name = "fp8"
    # NOTE: transformers' block-scaled "fp8" is listed so that such a checkpoint is refused
    # by this method, saying why, rather than by no method at all.
    checkpoint_formats: ClassVar[tuple[str, ...]] = (COMPRESSED_TENSORS, FBGEMM, HF_FP8)
    quantizes_online = True

    @classmethod
    def unsupported(
        cls, checkpoint_config: dict[str, Any], device: torch.device, dtype: torch.dtype
    ) -> str | None:
        why = fp8_unsupported(device)
        if why is not None:
            return why
        layout = checkpoint_layout(checkpoint_config)
        if layout is not None:
            return f"the checkpoint cannot be read: {layout}"
        return None

    def __init__(self, checkpoint_config: dict[str, Any]) -> None:
        super().__init__(checkpoint_config)
        self.linear = Fp8LinearMethod()

    def linear_method(self, prefixes: Sequence[str]) -> LinearMethod | None:
        ignored = [p for p in prefixes if _ignored(self.checkpoint_config, p)]
        if not ignored:
            return self.linear
        if len(ignored) == len(prefixes):
            return None
        raise ValueError(
            f"the checkpoint quantizes {sorted(set(prefixes) - set(ignored))} but not "
            f"{ignored}, which the model merges into one layer"
        )


class Fp8LinearMethod(LinearMethod):
    """A layer's ``weight`` [out, in] FP8 and ``weight_scale`` [out] float32 (a buffer: a
    full-precision checkpoint has none to load)."""

    takes_quantized_rows = True

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        if layer.weight.is_cuda and (in_features % 16 or out_features % 16):
            raise ValueError(
                f"fp8 needs a linear's sizes to be multiples of 16 on a GPU (cuBLASLt's FP8 "
                f"GEMM); this model has one of {in_features} inputs and {out_features} outputs "
                "on this tensor-parallel rank"
            )
        layer.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        # Projections whose FP8 weight came without its scale yet, and those with a scale.
        layer.fp8_unscaled = set()
        layer.fp8_scaled = set()
        layer.fp8_dequantized = None

    def load_weight(
        self, layer: nn.Module, name: str, weight: WeightSlice, where: LinearSlice
    ) -> None:
        rows = slice(where.row_offset, where.row_offset + where.rows)
        if name in _IGNORED_TENSORS:
            return
        if name == "weight":
            w = weight.narrow(0, where.row_start, where.rows)
            if where.cols != where.col_total:
                w = w.narrow(1, where.col_start, where.cols)
            with torch.no_grad():
                if w.dtype == FP8_DTYPE:
                    layer.weight[rows] = w.to(layer.weight.device)
                    if where.shard not in layer.fp8_scaled:
                        layer.fp8_unscaled.add(where.shard)
                    return
                if w.dtype in (torch.float8_e5m2, torch.float8_e4m3fnuz):
                    raise ValueError(f"checkpoint weight of {where.shard or 'the layer'} is "
                                     f"{w.dtype}; fp8 reads float8_e4m3fn")  # fmt: skip
                q, scale = quantize_rows(w.to(layer.weight.device))
                layer.weight[rows] = q
                layer.weight_scale[rows] = scale.view(-1)
            layer.fp8_scaled.add(where.shard)
            return
        if name == "weight_scale":
            s = weight.full().float()
            with torch.no_grad():
                if s.numel() == 1:  # per tensor: every row of the projection
                    layer.weight_scale[rows] = s.reshape(()).to(layer.weight_scale.device)
                elif s.numel() == where.row_total:  # per channel
                    part = s.reshape(-1).narrow(0, where.row_start, where.rows)
                    layer.weight_scale[rows] = part.to(layer.weight_scale.device)
                else:
                    raise ValueError(
                        f"checkpoint weight_scale of {where.shard or 'the layer'} has shape "
                        f"{tuple(s.shape)}: fp8 reads one scale, or one per output row "
                        f"({where.row_total}); block scales are not supported"
                    )
            layer.fp8_unscaled.discard(where.shard)
            layer.fp8_scaled.add(where.shard)
            return
        raise ValueError(
            f"checkpoint tensor {name!r} of {where.shard or 'the layer'} is not one fp8 reads "
            "(weight, weight_scale, input_scale)"
        )

    def finish_loading(self, layer: nn.Module) -> None:
        if layer.fp8_unscaled:
            raise ValueError(
                f"the checkpoint's FP8 weights of {sorted(layer.fp8_unscaled)} come without a "
                "weight_scale"
            )
        if layer.weight.device.type == "cpu":
            # The emulation multiplies dequantized weights: dequantized once, here.
            layer.fp8_dequantized = from_fp8(
                layer.weight, layer.weight_scale[:, None], torch.float32
            )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # (``x`` may come quantized: ``takes_quantized_rows``)
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, layer.fp8_dequantized)
