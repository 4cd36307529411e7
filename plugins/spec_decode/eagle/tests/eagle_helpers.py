"""Tiny targets and heads for the EAGLE plugin's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from pagoda_spec_eagle.checkpoint import llama_head_config, random_head_weights, write_head

from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.loader import ModelArchConfig
from pagoda.loader.construct import build_model
from pagoda.models.llama import LlamaForCausalLM
from pagoda.spec_decode import ProposerContext, TargetModel

ROOT = Path(__file__).parents[4]
TINY_LLAMA = ROOT / "benchmarks" / "configs" / "tiny-llama"  # hidden 64, vocab 1024, 2 layers


def write_random_head(
    path: Path,
    kind: str,
    hidden: int,
    vocab: int,
    *,
    draft_vocab: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """A head in the published layout of ``kind`` with random values; EAGLE-3's draft
    vocabulary is every other target id (``d2t[d] = d``)."""
    dv = draft_vocab if kind == "eagle3" else None
    cfg = llama_head_config(kind, hidden, 2 * hidden, heads, kv_heads, vocab, draft_vocab_size=dv)
    d2t = torch.arange(dv) if dv else None
    write_head(path, cfg, random_head_weights(cfg, seed, d2t, std=std))
    return path


def tiny_target(ctx: ProposerContext, num_layers: int = 4, block_size: int = 16) -> TargetModel:
    """A random Llama of the context's sizes, with block tables for its rows (each row's
    blocks distinct and in use)."""
    arch = ModelArchConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": ctx.hidden_size,
            "intermediate_size": 2 * ctx.hidden_size,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": num_layers,
            "vocab_size": ctx.vocab_size,
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5,
        }
    )
    torch.manual_seed(0)
    model = build_model(
        LlamaForCausalLM, arch, TorchNativeBackend, device=ctx.device, dtype=ctx.dtype
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    per_row = -(-(ctx.max_model_len + 1) // block_size)
    table = 1 + np.arange(ctx.max_num_reqs * per_row, dtype=np.int32).reshape(-1, per_row)
    return TargetModel(
        model=model,
        num_hidden_layers=num_layers,
        attn_backend=TorchNativeBackend,
        num_blocks=int(table.max()) + 1,
        block_size=block_size,
        block_table=table,
        num_row_blocks=np.full(ctx.max_num_reqs, per_row, dtype=np.int64),
    )
