"""Tiny random configs for every causal-LM model type of the installed transformers.

`tiny_config(model_type)` takes transformers' own config class for the type
(`CONFIG_MAPPING[model_type]`), reads its defaults and rebuilds it with every size shrunk: two
layers, or as many as the layer pattern needs for each kind of layer to be present (Gemma 3's one
global layer in six keeps six); hidden size 64; 4 query heads over 2 KV heads wherever the config
can group KV heads, even where the class defaults to MHA (MQA stays MQA, MLA keeps a KV head per
query head); head size 16; MLP 128; vocabulary 256; context >= 512; sliding windows of 8 (shorter
than a test prompt, so that they bite); at most 4 experts and top-2; float32.
`tie_word_embeddings` and the attention implementation are left as the class has them. Nothing
is downloaded, and the models hold well under a million parameters, so that a test can build and
run each of the ~200 architectures on a CPU in seconds.

Special token ids beyond the tiny vocabulary are moved to its top (255, 254, ...), each original
id to its own new one; ids below 256 keep their value.

The shrinking is generic, by attribute name (`hidden_size`/`n_embd`/`d_model`,
`num_hidden_layers`/`n_layer`, ...), applied to the config and to each of its sub-configs
(`text_config`, `vision_config`, ...); `_OVERRIDES` holds the few per-type fixes that no rule by
name can find (layer-pattern knobs, sizes that must agree with each other in ways particular to
one model). Only dataclass fields of the config class are passed back as keyword arguments:
attributes that the class derives in `__post_init__` (`qk_head_dim`, a `head_dim` taken from
`qk_rope_head_dim`, ...) are then derived again from the shrunk values instead of keeping the
full-size ones.

`hf_reference(cfg, input_ids)` builds the transformers model of such a config (seeded, float32,
eval mode, eager attention by default: every model has it, and where SDPA exists too it agrees
within 1e-4) and returns its logits: the reference that Pagoda's own implementation of the
architecture is compared against. `tiny_input_ids(cfg)` gives token ids that a test can feed
both: inside the vocabulary and clear of every special token (an image placeholder id in a
prompt without an image would make a multimodal model fail).

Importing this module imports neither torch nor transformers; both are imported on first use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "DEFAULT_PARAM_BOUND",
    "TINY_HIDDEN",
    "TINY_VOCAB",
    "causal_lm_types",
    "hf_reference",
    "build_hf_model",
    "param_bound",
    "tiny_config",
    "tiny_config_or_reason",
    "tiny_input_ids",
]

# The target sizes. Hidden = heads * head_dim, so that models which derive the head size from the
# hidden size (most older ones) land on the same 16 as those that declare it.
TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_HEAD_DIM = 16
TINY_INTERMEDIATE = 128
TINY_MOE_INTERMEDIATE = 32
TINY_VOCAB = 256
TINY_LAYERS = 2
TINY_EXPERTS = 4
TINY_TOP_K = 2
TINY_MAX_POSITIONS = 512
TINY_WINDOW = 8

# The parameter budget that the test holds every tiny model to, and the types allowed more, each
# with the reason it needs more (none does at present: vision and audio towers shrink too).
DEFAULT_PARAM_BOUND = 1_000_000
_PARAM_BOUNDS: dict[str, int] = {}

# --- attribute names, by role -------------------------------------------------------------------

_HIDDEN_KEYS = {
    "hidden_size",
    "n_embd",
    "n_embed",
    "d_model",
    "embed_dim",
    "dim",
    "embedding_size",
    "word_embed_proj_dim",
    "hidden_dim",
    "lru_width",
    "input_embedding_size",
    "output_embedding_size",
    "backbone_hidden_size",
    "emb_dim",
    "hidden_size_global",
    "adapter_in_dim",
    "adapter_out_dim",
    "adapter_input_size",
}
_LAYER_KEYS = {
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "num_blocks",
}
_HEAD_KEYS = {
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "decoder_attention_heads",
    "encoder_attention_heads",
    "num_decoder_attention_heads",
    "num_encoder_attention_heads",
    "attention_heads",
    "swa_num_attention_heads",
    "num_attention_heads_per_layer",
}
_KV_HEAD_KEYS = {
    "num_key_value_heads",
    "num_kv_heads",
    "multi_query_group_num",
    "num_query_groups",
    "swa_num_key_value_heads",
}
_HEAD_DIM_KEYS = {
    "head_dim",
    "kv_channels",
    "attention_head_dim",
    "attention_head_size",
    "d_head",
    "dim_head",
    "swa_head_dim",
    "d_kv",
}
_INTERMEDIATE_KEYS = {
    "intermediate_size",
    "ffn_dim",
    "n_inner",
    "decoder_ffn_dim",
    "encoder_ffn_dim",
    "ffn_hidden_size",
    "dim_ff",
    "dff",
    "d_ff",
    "feed_forward_size",
    "intermediate_size_mlp",
    "dense_intermediate_size",
    "first_dense_intermediate_size",
    "mlp_only_intermediate_size",
    "mlp_hidden_size",
    "d_inner",
    "mlp_dim",
}
# Side widths: per-layer embeddings (Gemma 3n/4, Qwen4-Exp), low ranks, glyph embeddings.
_SMALL_DIM_KEYS = {
    "hidden_size_per_layer_input",
    "laurel_rank",
    "hc_lowrank",
    "ple_embed_dim",
    "shape_embed_dim",
    "pronunciation_embed_dim",
}
# Convolution widths (vision necks, audio front ends).
_CHANNEL_KEYS = {
    "output_channels",
    "ext_pw_out_channel",
    "depthwise_separable_out_channel",
    "nemo_conv_channels",
}
_EXPERT_INTERMEDIATE_KEYS = {
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "shared_experts_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "expert_ffn_hidden_size",
    "expert_intermediate_size",
}
_EXPERT_COUNT_KEYS = {
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
}
_TOP_K_KEYS = {
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "moe_top_k",
    "moe_k",
    "top_k",
    "top_k_experts",
}
_SHARED_EXPERT_KEYS = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}
_POSITION_KEYS = {
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_target_positions",
    "max_seq_len",
    "context_length",
    "model_max_length",
}
_WINDOW_KEYS = {
    "sliding_window",
    "sliding_window_size",
    "attention_window_size",
    "local_attention_window_len",
    "attention_chunk_size",
}
# MLA (DeepSeek V2/V3 and their kin): the low-rank projections and the split head sizes.
_MLA_SIZES = {
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
# Linear-attention layers (Gated DeltaNet, KDA, ...): fewer key than value heads, as the models
# that have both keep.
_LINEAR_SIZES = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
}
# Sparse-attention indexers (DeepSeek V3.2's DSA and the like).
_INDEXER_SIZES = {"index_n_heads": 2, "index_num_heads": 2, "index_head_dim": 16, "index_topk": 8}
_ROLE_SETS = (
    _HIDDEN_KEYS,
    _LAYER_KEYS,
    _HEAD_KEYS,
    _KV_HEAD_KEYS,
    _HEAD_DIM_KEYS,
    _INTERMEDIATE_KEYS,
    _EXPERT_INTERMEDIATE_KEYS,
    _EXPERT_COUNT_KEYS,
    _TOP_K_KEYS,
    _POSITION_KEYS,
    _WINDOW_KEYS,
    _LINEAR_SIZES,
    _INDEXER_SIZES,
    _SHARED_EXPERT_KEYS,
    _CHANNEL_KEYS,
    _SMALL_DIM_KEYS,
)
# Lists of one entry per layer whose entries name a kind of layer; a prefix of them that holds
# every kind decides how many layers the tiny model keeps.
_PER_LAYER_SUFFIXES = (
    "layer_types",
    "layers_block_type",
    "block_types",
    "layers_num_experts",
    "no_rope_layers",
)
# Lists of layer indices (the layers that are of some kind): indices past the layers kept go.
_LAYER_INDEX_KEYS = {
    "mlp_only_layers",
    "cross_attention_layers",
    "moe_layers",
    "full_attn_idxs",
    "global_attn_indexes",
    "ple_layer_ids",
    "local_layer_ids",
}


def causal_lm_types() -> list[str]:
    """The model types of the installed transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> PretrainedConfig | None:
    """A tiny random config of `model_type`, or None where none can be built (see the reason with
    `tiny_config_or_reason`). Each call builds a new config, which the caller may change."""
    return tiny_config_or_reason(model_type)[0]


def tiny_config_or_reason(model_type: str) -> tuple[PretrainedConfig | None, str]:
    """`(config, "")`, or `(None, reason)` for a type whose config cannot be built here."""
    from transformers import CONFIG_MAPPING

    if model_type in _UNSUPPORTED:
        return None, _UNSUPPORTED[model_type]
    if model_type not in CONFIG_MAPPING:
        return None, f"no config class for {model_type!r} in this transformers"
    cls = CONFIG_MAPPING[model_type]
    try:
        kwargs = _tiny_kwargs(cls, _OVERRIDES.get(model_type, {}))
        cfg = cls(**kwargs)
    except Exception as exc:  # any failure is a reason to report, not to raise
        return None, f"config does not build: {type(exc).__name__}: {exc}"[:300]
    return cfg, ""


def param_bound(model_type: str) -> int:
    """The most parameters the tiny model of `model_type` may have."""
    return _PARAM_BOUNDS.get(model_type, DEFAULT_PARAM_BOUND)


def tiny_input_ids(
    cfg: PretrainedConfig, length: int = 12, batch: int = 1, seed: int = 0
) -> torch.Tensor:
    """Random token ids for `cfg`: inside its vocabulary and clear of all its special tokens."""
    import torch

    vocab = _text_vocab_size(cfg)
    special = _special_token_values(cfg)
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(allowed), (batch, length), generator=gen)
    return allowed[pick]


def build_hf_model(
    cfg: PretrainedConfig, *, seed: int = 0, attn_implementation: str = "eager"
) -> PreTrainedModel:
    """The transformers causal-LM model of `cfg`: random weights from `seed`, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()


def hf_reference(
    cfg: PretrainedConfig,
    input_ids: torch.Tensor,
    *,
    seed: int = 0,
    attn_implementation: str = "eager",
) -> torch.Tensor:
    """The logits of transformers' own model of `cfg` on `input_ids` (`[batch, seq]`, or `[seq]`
    for one sequence): `[batch, seq, vocab]` in float32. The weights come from `seed`, so an engine
    that loads the same state dict (`build_hf_model(cfg, seed=seed).state_dict()`) must match."""
    import torch

    model = build_hf_model(cfg, seed=seed, attn_implementation=attn_implementation)
    ids = input_ids if input_ids.dim() == 2 else input_ids.unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return out.logits.float()


# --- shrinking ----------------------------------------------------------------------------------


def _tiny_kwargs(cls: type, override: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments that rebuild `cls` tiny: its default instance shrunk by the generic rules,
    with `override` on top ("__layers__" there sets the layer count, per-layer lists cut to it)."""
    default = cls()
    tokens = _TokenMap(default)
    kwargs = _shrink(default, tokens, override.get("__layers__"))
    for key, value in override.items():
        if key == "__layers__":
            continue
        if isinstance(value, Mapping) and isinstance(kwargs.get(key), dict):
            kwargs[key] = {**kwargs[key], **value}  # a sub-config: merge, not replace
        else:
            kwargs[key] = value
    return kwargs


def _fields(cfg: Any) -> set[str]:
    return (
        {f.name for f in dataclasses.fields(type(cfg))} if dataclasses.is_dataclass(cfg) else set()
    )


def _field_values(cfg: Any) -> dict[str, Any]:
    """The dataclass fields of `cfg` with their values (read through `attribute_map`)."""
    # A heterogeneous config (per-layer overrides) refuses plain reads of its per-layer
    # attributes; the global value is what the generic rules shrink.
    read = getattr(cfg, "_getattr_without_heterogeneous_validation", None)
    values = {}
    for name in _fields(cfg):
        try:
            values[name] = read(name) if read else getattr(cfg, name)
        except Exception:  # an attribute that cannot be read is left as it is
            continue
    return values


def _role_known(key: str) -> bool:
    return any(key in keys for keys in _ROLE_SETS) or key in _MLA_SIZES or _is_token_key(key)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink(cfg: PretrainedConfig, tokens: _TokenMap, layers: int | None = None) -> dict[str, Any]:
    """The shrunk keyword arguments for one config (sub-configs as nested dicts); `layers`, where
    given, is the layer count instead of the one the layer pattern calls for."""
    from transformers import PretrainedConfig

    values = _field_values(cfg)
    aliases = getattr(type(cfg), "attribute_map", {}) or {}
    out: dict[str, Any] = {}
    for field, value in values.items():
        if isinstance(value, PretrainedConfig):
            out[field] = _sub_kwargs(cfg, field, value, tokens)
            continue
        if _is_token_key(field):
            new = tokens.remap(value)
        elif _is_int(value) or (isinstance(value, list) and value and all(map(_is_int, value))):
            # A field may be stored under another name (`attribute_map`); either tells its role.
            # A list of sizes is one per layer (Gemma 3n's MLP widths): each is shrunk.
            role = field if _role_known(field) else aliases.get(field, field)
            if isinstance(value, list):
                new = [_generic_size(role, v) for v in value]
            else:
                new = _generic_size(role, value)
        else:
            continue
        if new != value:
            out[field] = new
    _fill_moe(values, out)
    _shrink_ssm(values, out)
    _shrink_heads(cfg, values, out)
    keep = _shrink_layers(cfg, values, out, layers)
    _shrink_per_layer(cfg, values, out, keep)
    _shrink_rope(cfg, values, out)
    if "dtype" in values or hasattr(cfg, "dtype"):
        out["dtype"] = "float32"
    return out


def _generic_size(key: str, value: int) -> int:
    """The tiny value of the integer attribute `key` (its old `value` where no rule applies)."""
    caps = (
        (_HIDDEN_KEYS, TINY_HIDDEN),
        (_HEAD_KEYS, TINY_HEADS),
        (_HEAD_DIM_KEYS, TINY_HEAD_DIM),
        (_INTERMEDIATE_KEYS, TINY_INTERMEDIATE),
        (_EXPERT_INTERMEDIATE_KEYS, TINY_MOE_INTERMEDIATE),
        (_EXPERT_COUNT_KEYS, TINY_EXPERTS),
        (_TOP_K_KEYS, TINY_TOP_K),
        (_WINDOW_KEYS, TINY_WINDOW),
    )
    for keys, cap in caps:
        if key in keys:
            return min(value, cap)
    for table in (_MLA_SIZES, _LINEAR_SIZES, _INDEXER_SIZES):
        if key in table:
            return min(value, table[key])
    if key in _KV_HEAD_KEYS:
        # MQA stays MQA; every other model that can group its KV heads does (4 query heads over
        # 2 KV heads), also where the class defaults to MHA: the released checkpoints mostly
        # use GQA, and a grouped cache is what an engine must get right.
        return min(value, TINY_KV_HEADS)
    if key.endswith("vocab_size") or key in (
        "vocab_size_per_layer_input",
        "encoder_hash_byte_group_vocab",
    ):
        # The token vocabulary, and side tables indexed by token-derived ids (per-layer
        # embeddings, n-gram hashes, glyph shapes).
        return min(value, TINY_VOCAB)
    if key in _CHANNEL_KEYS:
        return min(value, TINY_HIDDEN)
    if key in _POSITION_KEYS and value > 0:
        # Learned position tables are this big; RoPE models just need it >= 512.
        return TINY_MAX_POSITIONS
    if key in ("n_group", "num_expert_group"):
        return min(value, 2)  # the 4 experts in 2 groups, of which top-k groups picks 1
    if key == "topk_group":
        return min(value, 1)
    if key == "first_k_dense_replace":
        return 1  # one dense layer, then MoE: both kinds in two layers
    if key in _SHARED_EXPERT_KEYS:
        return min(value, 1)
    if key == "zero_expert_num":
        return min(value, TINY_TOP_K)  # LongCat's identity experts, among the routed ones
    if key in _SMALL_DIM_KEYS:
        return min(value, TINY_HEAD_DIM)
    return value


def _fill_moe(values: dict[str, Any], out: dict[str, Any]) -> None:
    """Some MoE classes default their expert counts to None, which their own model cannot build
    (the real checkpoints always set them): give such a config experts, a top-k and a shared
    expert."""
    if not any(_is_int(values.get(k)) for k in _EXPERT_INTERMEDIATE_KEYS | _EXPERT_COUNT_KEYS):
        return
    for keys, tiny in ((_EXPERT_COUNT_KEYS, TINY_EXPERTS), (_TOP_K_KEYS, TINY_TOP_K)):
        for key in keys & values.keys():
            if values[key] is None:
                out[key] = tiny
    for key in _SHARED_EXPERT_KEYS & values.keys():
        if values[key] is None:
            out[key] = 1


def _shrink_ssm(values: dict[str, Any], out: dict[str, Any]) -> None:
    """Mamba-style mixers: a smaller state, and heads that still tile `expand * hidden`."""
    for key in ("state_size", "mamba_d_state", "ssm_state_size", "d_state"):
        if _is_int(values.get(key)) and values[key] > 16:
            out[key] = 16
    expand = next((values[k] for k in ("mamba_expand", "expand") if _is_int(values.get(k))), 2)
    inner = expand * TINY_HIDDEN
    pairs = (
        ("mamba_n_heads", "mamba_d_head"),
        ("mamba_num_heads", "mamba_head_dim"),
        ("n_mamba_heads", "mamba_headdim"),
    )
    for heads_key, dim_key in pairs:
        if _is_int(values.get(heads_key)):
            out[heads_key] = inner // TINY_HEAD_DIM
        if _is_int(values.get(dim_key)):
            out[dim_key] = TINY_HEAD_DIM
    if _is_int(values.get("mamba_d_ssm")):
        out["mamba_d_ssm"] = inner
    for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        if _is_int(values.get(key)) and values[key] > 2:
            out[key] = 2


def _sub_kwargs(parent: Any, key: str, sub: Any, tokens: _TokenMap) -> dict[str, Any]:
    """A sub-config as a dict for the parent's constructor: the spec's own defaults, shrunk."""
    kwargs = _shrink(sub, tokens)
    spec = (getattr(type(parent), "sub_configs_defaults", None) or {}).get(key)
    base: dict[str, Any] = {}
    if spec is not None:
        base.update(spec.init_kwargs)
        from transformers import PretrainedConfig

        if not (
            isinstance(spec.config_class, type) and issubclass(spec.config_class, PretrainedConfig)
        ):
            base["model_type"] = sub.model_type  # resolved through AutoConfig
    elif getattr(sub, "model_type", ""):
        base["model_type"] = sub.model_type
    return {**base, **kwargs}


def _per_layer_lists(cfg: Any, n: int) -> dict[str, list]:
    """The per-layer lists of kinds of `cfg` (fields and properties), `n` entries each."""
    found = {}
    for name in dir(type(cfg)) + list(vars(cfg)):
        if not name.endswith(_PER_LAYER_SUFFIXES) or name.startswith("_") or name in found:
            continue
        try:
            value = getattr(cfg, name)
        except Exception:  # a property that cannot be read here is no pattern
            continue
        if isinstance(value, (list, tuple)) and len(value) == n:
            found[name] = list(value)
    return found


def _shrink_layers(
    cfg: Any, values: dict[str, Any], out: dict[str, Any], layers: int | None = None
) -> int:
    """Set the layer counts, keeping the shortest prefix of the layer pattern that holds every kind
    of layer (so a model with one global layer in six keeps six layers), or `layers` where given.
    Returns the number of layers kept."""
    layer_keys = [k for k in values if k in _LAYER_KEYS and _is_int(values[k]) and values[k] > 0]
    main = next(
        (k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in layer_keys),
        None,
    )
    n = values[main] if main else None
    keep = TINY_LAYERS
    lists = _per_layer_lists(cfg, n) if n else {}
    if lists:
        keep = max(TINY_LAYERS, *(_prefix_with_all_kinds(v) for v in lists.values()))
        keep = min(keep, n)
    if layers is not None:
        keep = layers
    for key in layer_keys:
        put_value = min(values[key], keep if key == main else TINY_LAYERS)
        if put_value != values[key]:
            out[key] = put_value
    for name in _LAYER_INDEX_KEYS & values.keys():
        if isinstance(values[name], (list, tuple)):
            out[name] = [i for i in values[name] if _is_int(i) and i < keep]
    # Every per-layer list, of kinds or of sizes, keeps the entries of the layers kept.
    if n and n > keep:
        for name, value in values.items():
            value = out.get(name, value)
            if isinstance(value, (list, tuple)) and len(value) == n and name != "per_layer_config":
                out[name] = list(value[:keep])
    return keep


def _shrink_per_layer(cfg: Any, values: dict[str, Any], out: dict[str, Any], keep: int) -> None:
    """Shrink a heterogeneous config's per-layer overrides (`per_layer_config`) for the layers
    kept, each size in the same proportion to the tiny global value as it had to the full one,
    so that a layer with twice the head size (Gemma 4's global layers) keeps twice the head."""
    spec = vars(cfg).get("_heterogeneity_spec")
    if spec is None:
        return
    per_layer: dict[int, dict[str, Any]] = {}
    for idx, overrides in spec.per_layer_overrides.items():
        if idx >= keep:
            continue
        shrunk = {}
        for attr, value in overrides.items():
            full, tiny = values.get(attr), out.get(attr, values.get(attr))
            if _is_int(value) and _is_int(full) and _is_int(tiny) and full > 0:
                value = max(1, round(tiny * value / full))
            elif _is_int(value):
                value = _generic_size(attr, value)
            shrunk[attr] = value
        per_layer[idx] = shrunk
    out["per_layer_config"] = per_layer


def _prefix_with_all_kinds(kinds: list) -> int:
    wanted = {repr(k) for k in kinds}
    seen: set[str] = set()
    for i, kind in enumerate(kinds):
        seen.add(repr(kind))
        if seen == wanted:
            return i + 1
    return len(kinds)


def _role_field(cfg: Any, values: dict[str, Any], roles: set[str]) -> str | None:
    """The field of `cfg` that plays one of `roles` (by its name or its `attribute_map` alias)."""
    aliases = getattr(type(cfg), "attribute_map", {}) or {}
    for field in values:
        if field in roles or aliases.get(field) in roles:
            return field
    return None


def _head_dims(cfg: Any, values: dict[str, Any], out: dict[str, Any]) -> tuple[int, int] | None:
    """The head size before and after shrinking, declared or derived as hidden / heads."""
    sizes = []
    for source in (values, {**values, **out}):
        dim_key = _role_field(cfg, values, {"head_dim"})
        if dim_key and _is_int(source.get(dim_key)):
            sizes.append(source[dim_key])
            continue
        hidden = _role_field(cfg, values, {"hidden_size"} | _HIDDEN_KEYS)
        heads = _role_field(cfg, values, {"num_attention_heads"} | _HEAD_KEYS)
        if not (hidden and heads and _is_int(source.get(hidden)) and _is_int(source.get(heads))):
            return None
        sizes.append(source[hidden] // source[heads])
    return sizes[0], sizes[1]


def _shrink_heads(cfg: Any, values: dict[str, Any], out: dict[str, Any]) -> None:
    """Fill in head sizes that the class leaves None but its model reads as numbers (some
    configs of this transformers fail at their default size for it): `head_dim` as hidden /
    heads, KV heads grouped as everywhere else."""
    heads = _role_field(cfg, values, {"num_attention_heads"})
    if "kv_lora_rank" in values:
        # MLA: the KV heads are the query heads (the latent is what is shared), and a declared
        # `head_dim` is the RoPE part of the head (what the rotary embedding reads) where it
        # equals `qk_rope_head_dim` in the full config.
        for key in _KV_HEAD_KEYS & values.keys():
            if values[key] is not None and values[key] > 1 and heads:
                out[key] = out.get(heads, values[heads])
        rope = values.get("qk_rope_head_dim")
        if _is_int(rope) and values.get("head_dim") == rope:
            out["head_dim"] = out.get("qk_rope_head_dim", rope)
        return
    dims = _head_dims(cfg, values, out)
    if "head_dim" in values and values["head_dim"] is None and dims is not None:
        out["head_dim"] = dims[1]
    if "num_key_value_heads" in values and values["num_key_value_heads"] is None and heads:
        out["num_key_value_heads"] = TINY_KV_HEADS


def _shrink_rope(cfg: Any, values: dict[str, Any], out: dict[str, Any]) -> None:
    """Keep RoPE settings consistent with the smaller heads: a partial rotary factor must still
    give an even rotary size, an absolute rotary size shrinks with the head, and per-frequency
    lists (mrope sections, longrope factors) must cover the new half rotary size."""
    dims = _head_dims(cfg, values, out)
    if dims is None:
        return
    old_head, head_dim = dims
    if "qk_rope_head_dim" in values:  # MLA: RoPE covers only the rope part of the head
        head_dim = out.get("qk_rope_head_dim", values["qk_rope_head_dim"])
    if isinstance(values.get("partial_rotary_factor"), float):
        out["partial_rotary_factor"] = _even_factor(values["partial_rotary_factor"], head_dim)
    if _is_int(values.get("rotary_dim")) and old_head:
        rot = max(2, round(head_dim * values["rotary_dim"] / old_head / 2) * 2)
        out["rotary_dim"] = min(rot, head_dim)
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and rope:
        nested = all(isinstance(v, dict) or v is None for v in rope.values())
        if nested:
            out["rope_parameters"] = {
                k: (_fix_rope(v, head_dim) if isinstance(v, dict) else v) for k, v in rope.items()
            }
        else:
            out["rope_parameters"] = _fix_rope(rope, head_dim)


def _even_factor(factor: float, head_dim: int) -> float:
    """The factor nearest to `factor` whose rotary size `head_dim * factor` is even and >= 2."""
    rot = head_dim * factor
    if rot == int(rot) and int(rot) % 2 == 0 and rot >= 2:
        return factor
    return max(2, round(rot / 2) * 2) / head_dim


def _fix_rope(rope: dict[str, Any], head_dim: int) -> dict[str, Any]:
    rope = dict(rope)
    factor = rope.get("partial_rotary_factor")
    if isinstance(factor, float):
        rope["partial_rotary_factor"] = factor = _even_factor(factor, head_dim)
    half = int(head_dim * (factor or 1.0)) // 2
    if isinstance(rope.get("mrope_section"), list):
        rope["mrope_section"] = _split_sections(rope["mrope_section"], half)
    for key in ("long_factor", "short_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = rope[key][:half]
    if _is_int(rope.get("original_max_position_embeddings")):
        rope["original_max_position_embeddings"] = min(
            rope["original_max_position_embeddings"], TINY_MAX_POSITIONS
        )
    return rope


def _split_sections(sections: list[int], total: int) -> list[int]:
    """`sections` scaled to sum to `total`, each at least 1 where there is room."""
    old = sum(sections) or 1
    new = [max(1, math.floor(s * total / old)) for s in sections]
    while sum(new) > total and max(new) > 1:
        new[new.index(max(new))] -= 1
    new[0] += total - sum(new)
    return new


# --- special tokens -----------------------------------------------------------------------------


def _is_token_key(key: str) -> bool:
    return key.endswith(("_token_id", "_token_ids", "_token_index"))


def _ints(value: Any) -> list[int]:
    if _is_int(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if _is_int(v)]
    return []


class _TokenMap:
    """Moves the special token ids that fall outside the tiny vocabulary to the top of it, each
    original id to its own new id (so bos and eos stay apart), the same across sub-configs."""

    def __init__(self, cfg: Any) -> None:
        self._used = {v for v in _special_token_values(cfg, limit=None) if v < TINY_VOCAB}
        self._map: dict[int, int] = {}
        self._next = TINY_VOCAB - 1

    def remap(self, value: Any) -> Any:
        if _is_int(value):
            return self._one(value)
        if isinstance(value, list) and all(_is_int(v) for v in value):
            return [self._one(v) for v in value]
        return value

    def _one(self, value: int) -> int:
        if value < TINY_VOCAB:
            return value
        if value not in self._map:
            while self._next in self._used:
                self._next -= 1
            self._map[value] = self._next
            self._used.add(self._next)
        return self._map[value]


def _special_token_values(cfg: Any, limit: int | None = -1) -> set[int]:
    """Every special token id in `cfg` and its sub-configs; below the text vocabulary unless
    `limit` is None."""
    from transformers import PretrainedConfig

    found: set[int] = set()

    def walk(c: Any) -> None:
        for key, value in vars(c).items():
            if isinstance(value, PretrainedConfig):
                walk(value)
            elif _is_token_key(key):
                found.update(_ints(value))

    walk(cfg)
    if limit is None:
        return found
    return {v for v in found if 0 <= v < _text_vocab_size(cfg)}


def _text_vocab_size(cfg: Any) -> int:
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return getattr(text, "vocab_size", None) or getattr(cfg, "vocab_size", None) or TINY_VOCAB


# --- per-type fixes -----------------------------------------------------------------------------

# Types that get no tiny config, with the reason.
_UNSUPPORTED: dict[str, str] = {
    "gemma3n": "its vision tower is a timm model (TimmWrapper needs timm and PIL, not installed)",
    "gemma4_assistant": "a drafter: its forward needs the target model's shared KV states",
    "gemma4_unified_assistant": "a drafter: its forward needs the target model's shared KV states",
    "musicgen": (
        "the causal-LM class (MusicgenForCausalLM) takes the decoder sub-config, not the "
        "composite config AutoModelForCausalLM hands it; its inputs are codebook streams"
    ),
    "musicgen_melody": (
        "the causal-LM class (MusicgenMelodyForCausalLM) takes the decoder sub-config, not the "
        "composite config AutoModelForCausalLM hands it; its inputs are codebook streams"
    ),
}

_SLIDING, _FULL = "sliding_attention", "full_attention"

# Per-type keyword arguments applied over the generic shrinking: a dict for a sub-config key is
# merged into the shrunk sub-config; "__layers__" sets the layer count (per-layer lists are cut to
# it). Each says why the generic rules cannot find it.
_OVERRIDES: dict[str, dict[str, Any]] = {
    # The class defaults to all-global layers without the per-type RoPE the model reads; the
    # released models put one global layer after three sliding ones. Text-only, the multimodal
    # RoPE sections are plain RoPE; they must cover the smaller head.
    "cohere_compass_text": {
        "__layers__": 4,
        "layer_types": [_SLIDING] * 3 + [_FULL],
        "rope_parameters": {
            _SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            _FULL: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        },
    },
    # The attention reads `attn_config.rope_theta`, which the attention config class lacks, and
    # clamps by `clip_qkv`, which it leaves None; DBRX has GQA and routes to several experts.
    "dbrx": {
        "attn_config": {"rope_theta": 500000.0, "kv_n_heads": TINY_KV_HEADS, "clip_qkv": 8.0},
        "ffn_config": {"moe_top_k": TINY_TOP_K},
    },
    # Its sliding (SWA) layers have a head of qk_nope + qk_rope (24 + 8 once shrunk), which the
    # class checks against `head_dim`.
    "dots3_note_text": {"head_dim": 32},
    "dots3_note": {"text_config": {"head_dim": 32}},
    # Two attention kinds, alternating global and local.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": TINY_WINDOW},
    # Four sliding then one global layer, twice: the second five share the first five's KV
    # caches (`num_kv_shared_layers`), one of each kind.
    "gemma3n_text": {
        "__layers__": 10,
        "layer_types": ([_SLIDING] * 4 + [_FULL]) * 2,
        "num_kv_shared_layers": 5,
    },
    # The classes default to attention everywhere; the released models mix short convolutions
    # with attention layers (and the MoE one starts with dense MLPs).
    "lfm2": {"layer_types": ["conv", _FULL]},
    "lfm2_moe": {"layer_types": ["conv", _FULL], "num_dense_layers": 1},
    # Its class checks hidden_size * expand == num_heads * head_dim (SSM heads, not attention).
    "mamba2": {"num_heads": 2 * TINY_HIDDEN // TINY_HEAD_DIM},
    # Layers 0-1 Mamba, 2 hybrid, then a hybrid layer every 6th: 8 layers hold two hybrid layers,
    # which the model needs to tie their shared transformer block.
    "zamba": {"__layers__": 8},
    # The indexed (QSA) layers of the default pattern need the indexer sizes the class leaves
    # unset; a budget below the 12-token test prompt makes the selection bite.
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": TINY_HEAD_DIM,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    },
    "qwen4_exp": {
        "text_config": {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": TINY_HEAD_DIM,
            "indexer_budget": 8,
            "indexer_compress_ratio": 2,
        }
    },
    # The class defaults to a single expert; the released model routes over many.
    "hunyuan_v1_moe": {"num_experts": TINY_EXPERTS, "moe_topk": TINY_TOP_K},
    # The sliding window is half of `local_attention`.
    "modernbert-decoder": {"local_attention": 2 * TINY_WINDOW},
    # One cross-attention layer (every fifth in the released models) between self-attention
    # ones; text-only, the model skips it.
    "mllama": {"text_config": {"num_hidden_layers": 3, "cross_attention_layers": [1]}},
    # X-MOD picks a language adapter per forward and refuses without a default language.
    "xmod": {"default_language": "en_XX"},
    # Reformer: a decoder, one local and one LSH layer, axial position embeddings whose shape
    # multiplies to the context and whose widths add up to the hidden size, chunks that a short
    # prompt fills, and a fixed hash seed so that the LSH buckets are reproducible.
    "reformer": {
        "is_decoder": True,
        "attn_layers": ["local", "lsh"],
        "axial_pos_shape": [16, 32],
        "axial_pos_embds_dim": [32, 32],
        "max_position_embeddings": 512,
        "local_attn_chunk_length": 4,
        "lsh_attn_chunk_length": 4,
        "num_buckets": 4,
        "hash_seed": 0,
    },
}
