"""What the model code needs from a Hugging Face config.json, parsed once and normalised."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ArchTraits:
    """What an architecture fixes regardless of its config.json."""

    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    uses_sliding_window_key: bool = False  # honours `sliding_window` without `use_sliding_window`


# NOTE: the one list of architectures the loader accepts; the model registry serves these names.
SUPPORTED_ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits("llama"),
    "MistralForCausalLM": ArchTraits("mistral", uses_sliding_window_key=True),
    "Qwen2ForCausalLM": ArchTraits("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": ArchTraits("qwen3", qk_norm=True),
}

#: The same bodies without an LM head (embedding models: Qwen3-Embedding saved by
#: sentence-transformers, GTE-Qwen2) and with a sequence classification head: pooling models.
POOLING_ARCHITECTURES: dict[str, ArchTraits] = {
    "LlamaModel": ArchTraits("llama"),
    "MistralModel": ArchTraits("mistral", uses_sliding_window_key=True),
    "Qwen2Model": ArchTraits("qwen2", qkv_bias=True),
    "Qwen3Model": ArchTraits("qwen3", qk_norm=True),
    "LlamaForSequenceClassification": ArchTraits("llama"),
    "Qwen2ForSequenceClassification": ArchTraits("qwen2", qkv_bias=True),
    "Qwen3ForSequenceClassification": ArchTraits("qwen3", qk_norm=True),
}

_ALL = {**SUPPORTED_ARCHITECTURES, **POOLING_ARCHITECTURES}

_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass(slots=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    #: Which layers attend over ``sliding_window``: None, every layer (when it is set); else
    #: one entry per layer, ``"sliding_attention"`` or ``"full_attention"`` (transformers' names).
    layer_types: tuple[str, ...] | None
    torch_dtype: str
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    hidden_act: str
    #: A sequence classification head's outputs (0: the architecture has none).
    num_labels: int = 0

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelArchConfig:
        """Parse a config.json dict (transformers 4 or 5 key style)."""
        arch = architecture_of(d)
        traits = _ALL[arch]
        heads = _required(d, "num_attention_heads", arch)
        hidden = _required(d, "hidden_size", arch)
        rope_theta, rope_scaling = _rope(d)
        use_window = traits.uses_sliding_window_key or bool(d.get("use_sliding_window"))
        window = d.get("sliding_window") if use_window else None
        if d.get("mlp_bias"):
            raise ValueError(f"{arch} with mlp_bias=true is not supported (no MLP bias weights)")
        return cls(
            architecture=arch,
            vocab_size=_required(d, "vocab_size", arch),
            hidden_size=hidden,
            intermediate_size=_required(d, "intermediate_size", arch),
            num_hidden_layers=_required(d, "num_hidden_layers", arch),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=traits.qkv_bias or bool(d.get("attention_bias", False)),
            qk_norm=traits.qk_norm,
            sliding_window=window,
            layer_types=_layer_types(d, window, arch),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            hidden_act=d.get("hidden_act", "silu"),
            num_labels=_num_labels(d) if arch.endswith("ForSequenceClassification") else 0,
        )


def architecture_of(d: dict[str, Any]) -> str:
    """The supported architecture a config.json names; ValueError (which lists the supported
    ones) when it names none of them."""
    supported = ", ".join(_ALL)
    names = d.get("architectures") or []
    if not names:
        by_type = {t.model_type: a for a, t in SUPPORTED_ARCHITECTURES.items()}
        if d.get("model_type") in by_type:
            return by_type[d["model_type"]]
        raise ValueError(
            f"config.json names no architecture (architectures={names!r}, "
            f"model_type={d.get('model_type')!r}); supported: {supported}"
        )
    for name in names:
        if name in _ALL:
            return name
    raise ValueError(f"unsupported architecture {', '.join(names)}; supported: {supported}")


def _layer_types(d: dict[str, Any], window: int | None, arch: str) -> tuple[str, ...] | None:
    """Per-layer attention kinds: the config's ``layer_types`` where it lists them, else Qwen's
    ``max_window_layers`` (the first that many layers attend fully), else None (all alike)."""
    if window is None:
        return None
    layers = int(d.get("num_hidden_layers") or 0)
    kinds = d.get("layer_types")
    if kinds is None and d.get("max_window_layers") is not None:
        first = int(d["max_window_layers"])
        kinds = ["full_attention" if i < first else "sliding_attention" for i in range(layers)]
    if kinds is None:
        return None
    if len(kinds) != layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"config.json for {arch} has layer_types {kinds!r}: want {layers} entries of "
            "'full_attention' or 'sliding_attention'"
        )
    return tuple(kinds)


def _num_labels(d: dict[str, Any]) -> int:
    if d.get("num_labels") is not None:
        return int(d["num_labels"])
    return len(d.get("id2label") or {}) or 2


def _required(d: dict[str, Any], key: str, arch: str) -> int:
    if d.get(key) is None:
        raise ValueError(f"config.json for {arch} lacks {key!r}")
    return int(d[key])


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from `rope_parameters` (transformers 5) or the older keys."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if params.get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling of type llama3 lacks {', '.join(missing)}")
    return theta, {"rope_type": rope_type, **params}
