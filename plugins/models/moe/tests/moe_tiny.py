"""Tiny random MoE models from transformers' own config classes (no downloads), their weights
scaled so that routing matters, and the per-expert checkpoint names each family's files use."""

from __future__ import annotations

import torch
import transformers as tf

COMMON = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # fmt: skip


def configs() -> dict[str, tf.PretrainedConfig]:
    return {
        "mixtral": tf.MixtralConfig(**COMMON, intermediate_size=96, num_local_experts=8,
                                    num_experts_per_tok=2),
        # Shared expert with its gate; layer 0 dense (mlp_only_layers); top-k not renormalised.
        "qwen2_moe": tf.Qwen2MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, num_experts=8,
                                       num_experts_per_tok=2, mlp_only_layers=[0],
                                       norm_topk_prob=False),
        # Qwen3-30B-A3B's routing: top-k renormalised; q/k norms per head.
        "qwen3_moe": tf.Qwen3MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32,
                                       num_experts=8, num_experts_per_tok=4, head_dim=16,
                                       norm_topk_prob=True),
        "olmoe": tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=4.0),
    }  # fmt: skip


def hf_model(name: str, seed: int = 0, **overrides) -> tuple[torch.nn.Module, dict]:
    """The transformers model of config ``name`` (float32, eager) with weights that make the
    routing matter: every matrix ``N(0, 1/fan_in)``, routers 1.5x sharper, experts 2x, norms
    near 1."""
    cfg = configs()[name]
    for key, value in overrides.items():
        setattr(cfg, key, value)
    cfg.architectures = [type(tf.AutoModelForCausalLM.from_config(cfg)).__name__]
    model = tf.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            if pname.endswith("mlp.gate.weight"):  # routers that pick, yet leave mass outside
                p.mul_(1.5)
            if "experts." in pname or "shared_expert" in pname:  # experts that weigh on tokens
                p.mul_(2.0)
    return model, cfg.to_dict()


def per_expert_checkpoint(model: torch.nn.Module, architecture: str) -> dict[str, torch.Tensor]:
    """The model's weights under the names its family's checkpoint files use: one tensor per
    expert and projection (Mixtral: ``block_sparse_moe.experts.E.w1/w3/w2``)."""
    mixtral = architecture == "MixtralForCausalLM"
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        prefix = name.rsplit(".experts.", 1)[0]
        if mixtral:
            prefix = prefix.replace(".mlp", ".block_sparse_moe")
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                gate, up = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
                out[f"{prefix}.experts.{e}.{gate}.weight"] = t[e, :inter].clone()
                out[f"{prefix}.experts.{e}.{up}.weight"] = t[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                down = "w2" if mixtral else "down_proj"
                out[f"{prefix}.experts.{e}.{down}.weight"] = t[e].clone()
        elif mixtral and name.endswith("mlp.gate.weight"):
            out[name.replace(".mlp.", ".block_sparse_moe.")] = t.clone()
        else:
            out[name] = t.clone()
    return out


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ``n`` tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()
