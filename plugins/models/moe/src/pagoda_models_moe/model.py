"""Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE: the core's Llama-family attention with a MoE block
(dense MLP layers where Qwen's ``mlp_only_layers`` or ``decoder_sparse_step`` say)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagoda.attention.backend import AttentionBackend
from pagoda.distributed import (
    all_reduce,
    check_tensor_parallel,
    get_tp_rank,
    get_tp_size,
    tp_shape,
)
from pagoda.loader.sharded import WeightSlice, as_slice
from pagoda.models.layers import RMSNorm, RotaryEmbedding
from pagoda.models.llama import LlamaAttention, LlamaMLP
from pagoda.models.llama import attention_specs as llama_attention_specs
from pagoda.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding, copy_weight
from pagoda.models.shape import ModelShape
from pagoda_models_moe.config import MoEArchConfig
from pagoda_models_moe.layers import SHARDS, FusedMoE, MoEBlock

_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)$")
_MERGED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
           "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip


class ShardedRMSNorm(nn.Module):
    """OLMoE's RMSNorm over a whole projection (all heads) of which this rank holds the columns
    ``start .. start + local`` of ``total``: the sum of squares is summed over the ranks."""

    def __init__(self, total: int, start: int, local: int, eps: float) -> None:
        super().__init__()
        self.total, self.start, self.eps = total, start, eps
        self.weight = nn.Parameter(torch.ones(local))

    def load_weight(self, param_name: str, w: torch.Tensor | WeightSlice, shard=None) -> None:
        w = as_slice(w)
        if tuple(w.shape) != (self.total,):
            raise ValueError(f"checkpoint norm weight has shape {tuple(w.shape)}, the model "
                             f"expects ({self.total},)")  # fmt: skip
        with torch.no_grad():
            self.weight.copy_(w.narrow(0, self.start, self.weight.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if get_tp_size() > 1:
            squares = all_reduce(squares)
        y = xf * torch.rsqrt(squares / self.total + self.eps)
        return self.weight * y.to(x.dtype)


class OlmoeAttention(LlamaAttention):
    """Llama attention with OLMoE's norms of the whole query and key projections and its
    optional clip of q, k and v."""

    def __init__(self, cfg: MoEArchConfig, backend, rotary_emb, layer_idx: int) -> None:
        super().__init__(cfg.arch, backend, rotary_emb, layer_idx)
        arch, shape = cfg.arch, tp_shape(cfg.arch)
        head = self.head_dim
        self.q_norm = ShardedRMSNorm(arch.num_attention_heads * head,
                                     get_tp_rank() * shape.num_heads * head, self.q_size,
                                     arch.rms_norm_eps)  # fmt: skip
        self.k_norm = ShardedRMSNorm(arch.num_key_value_heads * head,
                                     shape.kv_head_start * head, self.kv_size,
                                     arch.rms_norm_eps)  # fmt: skip
        self.clip = cfg.clip_qkv

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class MoEDecoderLayer(nn.Module):
    def __init__(self, cfg: MoEArchConfig, backend, rotary_emb, layer_idx: int) -> None:
        super().__init__()
        arch = cfg.arch
        self.self_attn = (
            OlmoeAttention(cfg, backend, rotary_emb, layer_idx)
            if cfg.full_qk_norm
            else LlamaAttention(arch, backend, rotary_emb, layer_idx)
        )
        self.mlp = MoEBlock(cfg) if cfg.sparse_layers[layer_idx] else LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEArchConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        arch = cfg.arch
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )
        self.layers = nn.ModuleList(
            MoEDecoderLayer(cfg, backend, rotary_emb, i) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


def attention_specs(cfg: MoEArchConfig, tensor_parallel_size: int | None = None) -> list:
    return llama_attention_specs(cfg.arch, tensor_parallel_size)


class MoEForCausalLM(nn.Module):
    """Every family of :data:`pagoda_models_moe.config.FAMILIES`: their differences are in the
    config (routing, shared expert, dense layers, norms)."""

    attention_specs = staticmethod(attention_specs)

    @classmethod
    def model_shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        """What the ``native`` model impl reads of a MoE config.json (see its docstring)."""
        cfg = MoEArchConfig.from_hf_config(hf_config)
        arch = cfg.arch
        check_tensor_parallel(arch, tensor_parallel_size)
        if cfg.full_qk_norm and arch.num_key_value_heads % tensor_parallel_size:
            raise ValueError(
                f"{arch.architecture}: {tensor_parallel_size} ranks do not split its "
                f"{arch.num_key_value_heads} KV heads (its key norm spans them all)"
            )
        return ModelShape(
            architecture=arch.architecture,
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            num_hidden_layers=arch.num_hidden_layers,
            max_position_embeddings=arch.max_position_embeddings,
            attention=tuple(attention_specs(cfg, tensor_parallel_size)),
            config=cfg,
            torch_dtype=arch.torch_dtype,
            bos_token_id=arch.bos_token_id,
            eos_token_id=arch.eos_token_id,
        )

    def __init__(self, cfg: MoEArchConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.config = cfg
        self.model = MoEModel(cfg, backend)
        self.lm_head = ParallelLMHead(cfg.arch.vocab_size, cfg.arch.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | WeightSlice]]) -> set[str]:
        """Load a checkpoint's weights: experts one by one as the files store them
        (``experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``)
        or stacked as transformers holds them (``experts.gate_up_proj``), each into this
        rank's part of the stacked parameters. Raises on a weight with no home or a
        parameter (an expert's projection included) left unset, naming it."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        experts_seen: dict[str, set[tuple[int, str]]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")
            m = _EXPERT.match(name)
            if m and m.group(3) in SHARDS:
                module = self._experts(m.group(1), name)
                module.load_expert(int(m.group(2)), SHARDS[m.group(3)], tensor)
                seen = experts_seen.setdefault(m.group(1), set())
                seen.add((int(m.group(2)), SHARDS[m.group(3)]))
                continue
            m = _STACKED.match(name)
            if m:
                self._experts(m.group(1), name).load_stacked(m.group(2), tensor)
                shards = ("down",) if m.group(2) == "down_proj" else ("gate", "up")
                seen = experts_seen.setdefault(m.group(1), set())
                seen.update((e, s) for e in range(self.config.num_experts) for s in shards)
                continue
            parts = name.split(".")
            shard = parts[-2] if len(parts) >= 2 else ""
            if shard in _MERGED:
                module_name = ".".join(parts[:-2] + [_MERGED[shard]])
                if f"{module_name}.{parts[-1]}" not in params:
                    raise ValueError(f"checkpoint weight {name!r} has no parameter in the model")
                self.get_submodule(module_name).load_weight(parts[-1], tensor, shard)
                loaded.add(f"{module_name}.{parts[-1]}")
                continue
            if name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no parameter in the model")
            module = self.get_submodule(".".join(parts[:-1]))
            if hasattr(module, "load_weight"):
                module.load_weight(parts[-1], tensor)
            else:
                copy_weight(params[name], name, tensor)
            loaded.add(name)
        every = {(e, s) for e in range(self.config.num_experts) for s in ("gate", "up", "down")}
        for prefix, seen in experts_seen.items():
            if seen == every:
                loaded.update({f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"})
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")
        return loaded

    def _experts(self, prefix: str, name: str) -> FusedMoE:
        try:
            module = self.get_submodule(f"{prefix}.experts")
        except AttributeError:
            module = None
        if not isinstance(module, FusedMoE):
            raise ValueError(f"checkpoint weight {name!r} has no parameter in the model")
        return module
