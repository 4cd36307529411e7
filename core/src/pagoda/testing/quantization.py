"""Quantization method conformance: a method's linear layers against float64, and FP8 checkpoints.

:func:`check_linear_method` builds the model's two kinds of linear (a column-parallel one that
merges three projections of different sizes, q/k/v-like, and a row-parallel one) with a
method's :class:`~pagoda.quantization.LinearMethod`, loads random full-precision weights
through ``load_weight`` one projection at a time in a shuffled order (as a checkpoint's file
order gives them), and compares ``apply`` with the float64 product, bias included. A method
that mixes up the projections' rows, drops a scale or ignores the bias fails; its error is
measured relative to the product's size (``||y - ref|| / ||ref||``), the one measure every
method can state.

FP8 checkpoints as Hugging Face publishes them, for tests of loading: :func:`fp8_checkpoint`
turns a full-precision state dict (Hugging Face names) into the compressed-tensors or FBGEMM
layout, with its ``quantization_config``; :func:`quantize_dequantize` gives the weights a
per-channel FP8 model computes with, in float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pagoda.loader.construct import build_model
from pagoda.models.parallel_layers import ColumnParallelLinear, Part, RowParallelLinear
from pagoda.ops.fp8 import QuantizedRows, from_fp8, quantize_rows, quantize_tensor, quantize_tokens
from pagoda.quantization import QuantizationMethod, method_class

#: ``||y - ref|| / ||ref||`` of a W8A8 FP8 linear (e4m3 keeps 3 mantissa bits: each product's
#: factors are off by up to 1/16 of their size, about 3% on average, and the errors of a sum of
#: many products mostly cancel).
FP8_TOLERANCE = 0.05
#: The projections whose ``.weight`` a Llama-family checkpoint quantizes.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linear_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES


def quantize_dequantize(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every linear weight (q/k/v/o, gate/up/down) replaced by its per-channel
    FP8 quantization read back in float32: the weights an ``fp8`` model multiplies by."""
    out = dict(state)
    for name, w in state.items():
        if _linear_weight(name):
            q, scale = quantize_rows(w.float())
            out[name] = from_fp8(q, scale, torch.float32)
    return out


def fp8_checkpoint(
    state: Mapping[str, torch.Tensor],
    layout: str = "compressed-tensors",
    strategy: str = "channel",
    kv_scales: Mapping[int, tuple[float, float]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, ``quantization_config``) of ``state`` (full precision, Hugging Face names) as
    an FP8 checkpoint: every linear weight as ``float8_e4m3fn`` with its ``weight_scale``,
    float32, one per output row (``strategy="channel"``, shape ``[out, 1]``) or one per tensor
    (``"tensor"``, compressed-tensors only, shape ``[1]``), and the LM head left as it is.
    ``layout`` is ``"compressed-tensors"`` (an ``input_scale`` beside each weight, as static
    exports carry; readers that scale activations per token skip it) or ``"fbgemm"``.
    ``kv_scales`` (layer -> (k_scale, v_scale)) adds compressed-tensors' KV cache scales."""
    if layout not in ("compressed-tensors", "fbgemm"):
        raise ValueError(f"unknown FP8 checkpoint layout {layout!r}")
    if strategy not in ("channel", "tensor") or (layout == "fbgemm" and strategy != "channel"):
        raise ValueError(f"{layout} has no {strategy!r} weight scales")
    tensors: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not _linear_weight(name):
            tensors[name] = w
            continue
        q, scale = quantize_rows(w.float()) if strategy == "channel" else quantize_tensor(w.float())
        tensors[name] = q
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.weight_scale"] = scale.reshape(-1, 1) if strategy == "channel" else scale
        if layout == "compressed-tensors":
            tensors[f"{stem}.input_scale"] = torch.ones(1)
    if layout == "fbgemm":
        return tensors, {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        }
    scheme = {"num_bits": 8, "type": "float", "symmetric": True}
    config: dict[str, Any] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**scheme, "strategy": strategy, "dynamic": False},
                "input_activations": {**scheme, "strategy": "tensor", "dynamic": False},
            }
        },
        "ignore": ["lm_head"],
    }
    if kv_scales:
        config["kv_cache_scheme"] = {**scheme, "strategy": "tensor", "dynamic": False}
        for layer, (k, v) in kv_scales.items():
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    return tensors, config


def _layers(
    method: QuantizationMethod, parts: list[Part], in_features: int, device: torch.device,
    dtype: torch.dtype,
) -> tuple[ColumnParallelLinear, RowParallelLinear]:  # fmt: skip
    names = [f"model.layers.0.self_attn.{p.name}" for p in parts]
    col_method = method.linear_method(names)
    row_method = method.linear_method(["model.layers.0.self_attn.o_proj"])
    if col_method is None or row_method is None:
        raise AssertionError(f"{type(method).__name__}.linear_method left a decoder layer unset")
    col = build_model(
        ColumnParallelLinear, in_features, parts, True, col_method, device=device, dtype=dtype
    )
    out = sum(p.size for p in parts)
    row = build_model(RowParallelLinear, out, in_features, True, row_method, device=device,
                      dtype=dtype)  # fmt: skip
    return col, row


def check_linear_method(
    method: type[QuantizationMethod] | str,
    checkpoint_config: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    tolerance: float = FP8_TOLERANCE,
    seed: int = 0,
) -> float:
    """Raise ``AssertionError`` unless ``method`` (a class or a registered name; a method that
    quantizes online, built with ``checkpoint_config``, default ``{}``) gives, for a merged
    column-parallel linear (projections of 48, 16 and 16 rows, with a bias) and a row-parallel
    one, products within ``tolerance`` of float64 (relative to the product's norm). Returns the
    worst relative error seen."""
    cls = method_class(method) if isinstance(method, str) else method
    device = torch.device(device)
    why = cls.unsupported(dict(checkpoint_config or {}), device, dtype)
    if why is not None:
        raise ValueError(f"{cls.__name__} does not run here: {why}")
    gen = torch.Generator().manual_seed(seed)
    k = 64
    parts = [Part("q_proj", 48, 0, 48), Part("k_proj", 16, 0, 16), Part("v_proj", 16, 0, 16)]
    col, row = _layers(cls(dict(checkpoint_config or {})), parts, k, device, dtype)
    weights = {p.name: torch.randn(p.size, k, generator=gen) / k**0.5 for p in parts}
    bias = torch.randn(sum(p.size for p in parts), generator=gen)
    order = torch.randperm(len(parts), generator=gen).tolist()
    for i in order:  # the checkpoint's order, not the layer's
        col.load_weight("weight", weights[parts[i].name].to(dtype), parts[i].name)
    with torch.no_grad():
        col.bias.copy_(bias)
    w_row = torch.randn(k, 80, generator=gen) / 80**0.5
    row.load_weight("weight", w_row.to(dtype))
    b_row = torch.randn(k, generator=gen)
    row.load_weight("bias", b_row.to(dtype))
    for layer in (col, row):
        layer.quant_method.finish_loading(layer)
    x = torch.randn(37, k, generator=gen)
    w_col = torch.cat([weights[p.name] for p in parts])
    worst = 0.0
    with torch.inference_mode():
        for what, layer, inp, w, b in (
            ("column-parallel q/k/v", col, x, w_col, bias),
            ("row-parallel", row, torch.randn(37, 80, generator=gen), w_row, b_row),
        ):
            y = layer(inp.to(dtype).to(device))
            if y.shape != (inp.shape[0], w.shape[0]) or y.dtype != dtype:
                raise AssertionError(
                    f"{cls.__name__}: the {what} linear gave {tuple(y.shape)} {y.dtype}, not "
                    f"{(inp.shape[0], w.shape[0])} {dtype}"
                )
            if layer.quant_method.takes_quantized_rows:
                # The activations as a norm's kernel hands them over, quantized already: the
                # same product as quantizing them in apply.
                q, scale = quantize_tokens(inp.to(dtype).to(device))
                given = layer(QuantizedRows(q, scale, dtype))
                if not torch.equal(given, y):
                    raise AssertionError(
                        f"{cls.__name__}: the {what} linear given its input as QuantizedRows "
                        "(takes_quantized_rows) does not give the product of the same input "
                        f"unquantized: {(given.float() - y.float()).abs().max().item():.3g} apart"
                    )
            ref = inp.to(dtype).double() @ w.to(dtype).double().T + b.to(dtype).double()
            err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
            worst = max(worst, err)
            if not err <= tolerance:
                raise AssertionError(
                    f"{cls.__name__}: the {what} linear is off the float64 product by {err:.3g} "
                    f"(relative), more than {tolerance}"
                )
    return worst
