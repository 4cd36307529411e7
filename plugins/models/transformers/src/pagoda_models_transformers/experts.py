"""Pagoda's fused MoE operator as a transformers experts implementation.

transformers computes a MoE layer's experts through its experts-implementation registry
(``experts_implementation=``): this module registers ``pagoda`` there, which runs
``pagoda.ops.fused_experts`` (grouped-GEMM Triton kernels on CUDA: only the routed experts'
weights are read; the torch reference elsewhere) on the module's stacked ``gate_up_proj``
[E, 2 * I, H] and ``down_proj`` [E, H, I]. An experts module of another layout (biases,
transposed or interleaved weights, a custom gate, an activation other than SiLU, a norm after
each expert, transformers' own expert parallelism) runs transformers' ``grouped_mm`` instead.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import (
    ExpertsInterface,
    _default_apply_gate,
    grouped_mm_experts_forward,
)

from pagoda.ops import fused_experts

NAME = "pagoda"


def fits(module: torch.nn.Module) -> bool:
    """Whether the fused operator computes ``module`` exactly as transformers would."""
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    return (
        getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_post_expert_norm", True)
        and not getattr(module, "_is_expert_parallel", True)
        and gate is _default_apply_gate
        and act in ("silu", "swish")
        and getattr(module, "gate_up_proj", None) is not None
    )


def pagoda_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts forward signature: ``hidden_states`` [n, H], each token's experts
    ``top_k_index`` [n, k] and their weights ``top_k_weights`` [n, k]; returns [n, H]."""
    if not fits(self):
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return fused_experts(
        hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index
    )


def experts_implementation() -> str:
    """Register the fused operator with transformers (once; idempotent) and return its name,
    to pass as ``experts_implementation``."""
    if NAME not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(NAME, pagoda_experts_forward)
    return NAME
