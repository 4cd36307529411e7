"""FP8 test kit: a tiny random Llama (SmolLM2's build, shrunk; every linear's sizes multiples of
16, as FP8 GEMMs want) written as a float32 safetensors folder, and the same weights as other
checkpoints: quantized and dequantized in float32, and FP8 in the compressed-tensors and FBGEMM
layouts. Used by tests/quantization and tests/gpu/test_fp8_gpu.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagoda.loader.synthetic import synthetic_tokenizer
from pagoda.testing.quantization import fp8_checkpoint, quantize_dequantize

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def random_state(cfg: Mapping[str, Any] = TINY_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights with activations of order one (normal, scaled by fan-in; norms one)."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    st = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g),
        "lm_head.weight": torch.randn(v, h, generator=g) / h**0.5 * 4,
        "model.norm.weight": torch.ones(h),
    }
    shapes = {
        "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }  # fmt: skip
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name, (rows, cols) in shapes.items():
            st[p + name + ".weight"] = torch.randn(rows, cols, generator=g) / cols**0.5
        st[p + "input_layernorm.weight"] = torch.ones(h)
        st[p + "post_attention_layernorm.weight"] = torch.ones(h)
    return st


def write_folder(
    folder: Path,
    tensors: Mapping[str, torch.Tensor],
    cfg: Mapping[str, Any] = TINY_CONFIG,
    quantization_config: dict[str, Any] | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = dict(cfg)
    if quantization_config:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    synthetic_tokenizer(cfg["vocab_size"], cfg["eos_token_id"]).save_pretrained(folder)
    return folder


def build(root: Path, cfg: Mapping[str, Any] = TINY_CONFIG) -> dict[str, Path]:
    """The model's folders: ``full`` (float32), ``qdq`` (its linear weights quantized per
    channel and read back, float32), ``compressed-tensors`` (per channel),
    ``compressed-tensors-tensor`` (per tensor), ``fbgemm``, and ``kv-scales``
    (compressed-tensors with KV cache scales)."""
    state = random_state(cfg)
    out = {
        "full": write_folder(root / "full", state, cfg),
        "qdq": write_folder(root / "qdq", quantize_dequantize(state), cfg),
    }
    for name, layout, strategy, kv in (
        ("compressed-tensors", "compressed-tensors", "channel", None),
        ("compressed-tensors-tensor", "compressed-tensors", "tensor", None),
        ("fbgemm", "fbgemm", "channel", None),
        ("kv-scales", "compressed-tensors", "channel", {0: (0.03, 0.02), 1: (0.05, 0.04)}),
    ):
        tensors, qcfg = fp8_checkpoint(state, layout, strategy, kv)
        out[name] = write_folder(root / name, tensors, cfg, qcfg)
    return out
