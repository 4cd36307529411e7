"""What the MoE families need from a config.json: the Llama-family attention's config (parsed by
the core, through the dense family whose attention each one shares) and the experts'."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pagoda.loader.arch import ModelArchConfig


@dataclass(frozen=True, slots=True)
class Family:
    #: The core's dense architecture whose attention (and config keys) this family shares.
    attention_like: str
    #: Where the number of routed experts is (transformers 5 writes ``num_local_experts``).
    experts_keys: tuple[str, ...]
    #: Where the expert's intermediate size is: Mixtral and OLMoE use ``intermediate_size``.
    expert_inter_key: str
    #: Mixtral always renormalises the top-k weights; the others as ``norm_topk_prob`` says.
    always_renormalize: bool = False
    #: OLMoE: RMSNorm over the whole query and key projections (not per head), optional clip.
    full_qk_norm: bool = False


_EXPERTS = ("num_experts", "num_local_experts")

FAMILIES: dict[str, Family] = {
    "MixtralForCausalLM": Family("MistralForCausalLM", ("num_local_experts",), "intermediate_size",
                                 always_renormalize=True),
    "Qwen2MoeForCausalLM": Family("Qwen2ForCausalLM", _EXPERTS, "moe_intermediate_size"),
    "Qwen3MoeForCausalLM": Family("Qwen3ForCausalLM", _EXPERTS, "moe_intermediate_size"),
    "OlmoeForCausalLM": Family("LlamaForCausalLM", _EXPERTS, "intermediate_size",
                               full_qk_norm=True),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class MoEArchConfig:
    """The attention and dense parts (``arch``; its ``intermediate_size`` is the dense layers'),
    and the experts of the sparse layers."""

    arch: ModelArchConfig
    num_experts: int
    top_k: int
    #: Each routed expert's intermediate size.
    expert_intermediate_size: int
    renormalize: bool
    #: Qwen2-MoE's shared expert (0: none), added with a sigmoid gate.
    shared_intermediate_size: int
    #: Per layer: True where the MLP is the experts, False where it is dense.
    sparse_layers: tuple[bool, ...]
    full_qk_norm: bool = False
    clip_qkv: float | None = None

    @property
    def architecture(self) -> str:
        return self.arch.architecture

    @property
    def tie_word_embeddings(self) -> bool:
        return self.arch.tie_word_embeddings

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> MoEArchConfig:
        names = [n for n in d.get("architectures") or [] if n in FAMILIES]
        if not names:
            raise ValueError(f"not a MoE architecture of this plugin: {d.get('architectures')}; "
                             f"supported: {', '.join(FAMILIES)}")  # fmt: skip
        name = names[0]
        family = FAMILIES[name]
        experts_key = next((k for k in family.experts_keys if d.get(k) is not None), None)
        if experts_key is None:
            raise ValueError(f"config.json for {name} lacks {family.experts_keys[0]!r}")
        for key in ("num_experts_per_tok", family.expert_inter_key):
            if d.get(key) is None:
                raise ValueError(f"config.json for {name} lacks {key!r}")
        dense = {**d, "architectures": [family.attention_like]}
        dense.setdefault("intermediate_size", d[family.expert_inter_key])
        arch = replace(ModelArchConfig.from_hf_config(dense), architecture=name)
        if family.full_qk_norm:  # the core's Llama attention norms nothing; this family does
            arch = replace(arch, qk_norm=False)
        experts, top_k = int(d[experts_key]), int(d["num_experts_per_tok"])
        if not 0 < top_k <= experts:
            raise ValueError(f"config.json for {name}: num_experts_per_tok={top_k} must be in "
                             f"1..{experts} (the experts)")  # fmt: skip
        step = int(d.get("decoder_sparse_step") or 1)
        dense_only = set(d.get("mlp_only_layers") or [])
        sparse = tuple(
            i not in dense_only and (i + 1) % step == 0 for i in range(arch.num_hidden_layers)
        )
        return cls(
            arch=arch,
            num_experts=experts,
            top_k=top_k,
            expert_intermediate_size=int(d[family.expert_inter_key]),
            renormalize=family.always_renormalize or bool(d.get("norm_topk_prob", False)),
            shared_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
            sparse_layers=sparse,
            full_qk_norm=family.full_qk_norm,
            clip_qkv=d.get("clip_qkv"),
        )
