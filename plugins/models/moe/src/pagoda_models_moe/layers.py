"""The MoE block: a router, the routed experts (stacked, split over the ranks by expert
dimension or by whole experts), and Qwen2-MoE's gated shared expert."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pagoda.distributed import all_reduce, get_tp_rank, get_tp_size
from pagoda.loader.sharded import WeightSlice, as_slice
from pagoda.models.llama import LlamaMLP
from pagoda.ops import fused_experts, linear
from pagoda.ops.fused_moe import route
from pagoda_models_moe.config import MoEArchConfig
from pagoda_models_moe.parallel import expert_parallel_enabled, expert_parallel_experts

#: A checkpoint's per-expert projections, by their names in each family's files.
SHARDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
          "w1": "gate", "w3": "up", "w2": "down"}  # fmt: skip


class FusedMoE(nn.Module):
    """``num_experts`` SiLU-gated experts as two stacked parameters, transformers' layout:
    ``gate_up_proj`` [experts, 2 * inter, hidden] (gate rows, then up rows) and ``down_proj``
    [experts, hidden, inter]. Over several ranks either every rank holds a slice of each
    expert's ``inter`` (tensor parallel: the partial outputs are summed) or whole experts
    (expert parallel, ``plugins.moe.expert_parallel``: pairs travel by all-to-all)."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        size, rank = get_tp_size(), get_tp_rank()
        self.num_experts, self.inter = num_experts, inter
        self.expert_parallel = size > 1 and expert_parallel_enabled()
        if self.expert_parallel:
            if num_experts % size:
                raise ValueError(
                    f"expert parallelism: {size} ranks do not split {num_experts} experts "
                    "evenly (use a rank count that divides the experts, or tensor parallelism)"
                )
            local, self.inter_local = num_experts // size, inter
            self.first, self.inter_start = rank * local, 0
        else:
            if inter % size:
                raise ValueError(
                    f"tensor parallelism of experts: {size} ranks do not split the experts' "
                    f"intermediate size {inter} evenly (try plugins.moe.expert_parallel)"
                )
            local, self.inter_local = num_experts, inter // size
            self.first, self.inter_start = 0, rank * self.inter_local
        self.num_local = local
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * self.inter_local, hidden))
        self.down_proj = nn.Parameter(torch.empty(local, hidden, self.inter_local))

    def _rows(self, shard: str) -> tuple[int, int]:
        """Where ``shard``'s rows of this rank start in ``gate_up_proj`` and in the checkpoint's
        ``gate_up_proj`` of one expert (2 * inter rows)."""
        if shard == "gate":
            return 0, self.inter_start
        return self.inter_local, self.inter + self.inter_start

    def load_expert(self, expert: int, shard: str, w: torch.Tensor | WeightSlice) -> None:
        """One expert's ``gate``, ``up`` or ``down`` projection, as a checkpoint stores it
        ([inter, hidden] or [hidden, inter]); an expert of another rank is skipped."""
        local = expert - self.first
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}; the model has {self.num_experts}")
        if not 0 <= local < self.num_local:
            return
        w = as_slice(w)
        hidden = self.down_proj.shape[1]
        want = (hidden, self.inter) if shard == "down" else (self.inter, hidden)
        if tuple(w.shape) != want:
            raise ValueError(f"checkpoint expert {expert} {shard} has shape {tuple(w.shape)}, "
                             f"the model expects {want}")  # fmt: skip
        with torch.no_grad():
            if shard == "down":
                self.down_proj[local].copy_(w.narrow(1, self.inter_start, self.inter_local))
            else:
                row = self._rows(shard)[0]
                part = w.narrow(0, self.inter_start, self.inter_local)
                self.gate_up_proj[local, row : row + self.inter_local].copy_(part)

    def load_stacked(self, param: str, w: torch.Tensor | WeightSlice) -> None:
        """transformers' stacked ``gate_up_proj`` [E, 2 * inter, hidden] or ``down_proj``."""
        w = as_slice(w)
        hidden = self.down_proj.shape[1]
        want = ((self.num_experts, 2 * self.inter, hidden) if param == "gate_up_proj"
                else (self.num_experts, hidden, self.inter))  # fmt: skip
        if tuple(w.shape) != want:
            raise ValueError(f"checkpoint experts.{param} has shape {tuple(w.shape)}, the model "
                             f"expects {want}")  # fmt: skip
        mine = w.narrow(0, self.first, self.num_local)
        for e in range(self.num_local):
            if param == "down_proj":
                self.load_expert(self.first + e, "down", mine[e])
            else:
                self.load_expert(self.first + e, "gate", mine[e, : self.inter])
                self.load_expert(self.first + e, "up", mine[e, self.inter :])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel:
            return expert_parallel_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        out = fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
        return all_reduce(out) if get_tp_size() > 1 else out


class Router(nn.Module):
    """The router's logits [tokens, experts]; its weight is whole on every rank."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class MoEBlock(nn.Module):
    """Route each token to ``top_k`` experts (softmax in float32, renormalised where the family
    says), sum their outputs by weight, and add the shared expert gated by a sigmoid."""

    def __init__(self, cfg: MoEArchConfig) -> None:
        super().__init__()
        arch = cfg.arch
        self.top_k, self.renormalize = cfg.top_k, cfg.renormalize
        self.gate = Router(arch.hidden_size, cfg.num_experts)
        self.experts = FusedMoE(cfg.num_experts, arch.hidden_size, cfg.expert_intermediate_size)
        self.shared_expert = None
        if cfg.shared_intermediate_size:
            shared = replace(arch, intermediate_size=cfg.shared_intermediate_size)
            self.shared_expert = LlamaMLP(shared)
            self.shared_expert_gate = Router(arch.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, "softmax", self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
