"""LoRA test kit: a tiny random Llama shaped like SmolLM2 (tied embeddings, GQA, SiLU MLP;
shrunk) and random adapters in PEFT's layout, written by hand (rank 8 on q/v/o/down, rank 16
with rsLoRA on k/gate/up), with transformers models of the adapters merged by hand. Used by
tests/lora and tests/gpu/test_lora_gpu.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: name -> (rank, lora_alpha, use_rslora, target modules)
ADAPTERS = {
    "lora-a": (8, 16, False, ["q_proj", "v_proj", "o_proj", "down_proj"]),
    "lora-b": (16, 8, True, ["k_proj", "gate_proj", "up_proj"]),
}


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


def write_adapter(
    folder: Path, cfg: dict, rank: int, alpha: float, rslora: bool, targets: list[str], seed: int
) -> dict[str, torch.Tensor]:
    """A PEFT folder with random A and B (B not zero, unlike a fresh PEFT adapter, so that the
    adapter changes the output); returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = shapes(cfg)[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
        "target_modules": targets, "bias": "none", "lora_dropout": 0.0,
        "base_model_name_or_path": "tiny", "task_type": "CAUSAL_LM",
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return tensors


def merged_state(base: dict, adapter: dict, rank: int, alpha: float, rslora: bool) -> dict:
    """The base weights with the adapter merged by hand: W + scaling * B @ A."""
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    out = dict(base)
    for key, a in adapter.items():
        if not key.endswith("lora_A.weight"):
            continue
        stem = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = adapter[key.replace("lora_A", "lora_B")]
        out[f"{stem}.weight"] = base[f"{stem}.weight"] + scaling * (b @ a)
    return out


def build(root: Path, config: dict | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """The tiny model's folder (``config``: TINY_CONFIG's keys changed), its adapters' folders,
    and transformers models of the base and of each adapter merged (on the CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagoda.loader.synthetic import synthetic_tokenizer

    cfg = {**TINY_CONFIG, **(config or {})}
    folder = root / "base"
    torch.manual_seed(0)
    hf_cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    base = LlamaForCausalLM(LlamaConfig(**hf_cfg)).eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" not in name:
                p.normal_(0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
    base.to(dtype).save_pretrained(folder)
    base.float()
    synthetic_tokenizer(cfg["vocab_size"], cfg["eos_token_id"]).save_pretrained(folder)
    state = base.state_dict()
    out = {"base": folder, "hf": {None: base}, "paths": {}}
    for seed, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items(), start=1):
        path = root / name
        tensors = write_adapter(path, cfg, rank, alpha, rslora, targets, seed)
        merged = LlamaForCausalLM(LlamaConfig(**hf_cfg)).eval()
        merged.load_state_dict(merged_state(state, tensors, rank, alpha, rslora))
        out["hf"][name] = merged
        out["paths"][name] = path
    return out
