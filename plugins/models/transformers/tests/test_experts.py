"""Pagoda's fused MoE operator as transformers' experts implementation ``pagoda``: a tiny
Qwen3-MoE computes what transformers' eager experts compute, and an experts layout the
operator does not take (biases) runs transformers' grouped_mm instead."""

from __future__ import annotations

import torch
import transformers as tf
from pagoda_models_transformers.experts import NAME, experts_implementation, fits


def _qwen3_moe(impl: str) -> torch.nn.Module:
    cfg = tf.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=80,
                            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation=impl).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return model


def test_the_fused_operator_computes_transformers_eager_experts() -> None:
    assert experts_implementation() == NAME
    ids = torch.tensor([[3, 17, 99, 5, 64, 2, 11]])
    eager, fused = _qwen3_moe("eager"), _qwen3_moe(NAME)
    experts = [m for m in fused.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(fits(m) for m in experts)
    with torch.no_grad():
        want, got = eager(ids).logits, fused(ids).logits
    assert (got - want).abs().max() <= 1e-5


def test_an_experts_layout_with_biases_runs_transformers_grouped_mm() -> None:
    model = _qwen3_moe(NAME)
    (experts, *_) = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    experts.has_bias = True
    assert not fits(experts)
