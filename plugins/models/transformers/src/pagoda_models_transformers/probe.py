"""What transformers' own code says about a model: whether the impl can serve it, and each
attention layer's :class:`AttentionSpec`, read from a forward pass on the meta device (free:
no memory, no arithmetic) whose attention calls are recorded."""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import CONFIG_MAPPING, PretrainedConfig
from transformers.initialization import no_init_weights
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pagoda.attention.spec import AttentionSpec
from pagoda_models_transformers import attention

#: Layer types whose layers attend through the KV cache; any other (linear attention, mamba,
#: convolutions) keeps a state the paged cache does not hold.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
#: RoPE types that change with the length of the sequence in the batch (host-side, per forward).
DYNAMIC_ROPE = frozenset({"dynamic", "longrope"})
#: Keyword arguments of an attention call that the spec expresses or that do not matter here.
KNOWN_KWARGS = frozenset({"scaling", "sliding_window", "softcap", "s_aux", "is_causal"})
#: Those that say nothing about what attention computes (bookkeeping passed through).
INERT_KWARGS = frozenset(
    {
        "dropout",
        "position_ids",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "cache_position",
        "head_mask",
    }
)


class Refusal(ValueError):
    """A model the impl does not serve; the message is one line that says why."""


@dataclass(frozen=True)
class Probed:
    """A model as transformers builds it: its config and its attention layers, in call order."""

    config: PretrainedConfig
    model_class: type
    #: Qualified names (in the causal-LM module) of the attention modules, in call order.
    module_names: tuple[str, ...]
    #: One spec per attention module, every head (tensor-parallel size 1).
    specs: tuple[AttentionSpec, ...]
    #: For each module, the name of its sinks parameter (relative to the module), or None.
    sinks: tuple[str | None, ...]


def build_config(hf_config: dict[str, Any]) -> PretrainedConfig:
    """The transformers config of a config.json; raises :class:`Refusal` for one it cannot
    build from its own classes."""
    model_type = hf_config.get("model_type")
    if not model_type:
        raise Refusal("config.json names no model_type")
    if model_type not in CONFIG_MAPPING:
        if hf_config.get("auto_map"):
            raise Refusal(
                f"model type {model_type!r} needs remote code (auto_map), which the transformers "
                "impl does not run"
            )
        raise Refusal(
            f"model type {model_type!r} is unknown to transformers {transformers.__version__}"
        )
    cls = CONFIG_MAPPING[model_type]
    try:
        # Infinity and NaN are written as {"__float__": "Infinity"} (plain JSON has neither).
        return cls.from_dict(cls._decode_special_floats(dict(hf_config)))
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise Refusal(f"config.json does not build a {model_type} config: {first}") from e


def _rope_types(config: PretrainedConfig) -> set[str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return set()
    nested = [v for v in params.values() if isinstance(v, dict)]
    found = [p.get("rope_type", p.get("type")) for p in (nested or [params])]
    return {t for t in found if t}


def _text_causal_lm(config: PretrainedConfig, architecture: str) -> str | None:
    """The causal-LM class that ``architecture`` names, where it takes ``config`` as it is: the
    text model of a multimodal type, saved by that type's causal LM (``Emu3ForCausalLM`` writes
    an ``emu3_text_model`` config)."""
    if architecture not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return None
    cls = getattr(transformers, architecture, None)
    return architecture if cls is not None and cls.config_class is type(config) else None


def check_config(config: PretrainedConfig, architecture: str) -> type:
    """The causal-LM class of ``config``; raises :class:`Refusal` for what the impl does not
    serve (checks that read only the config and the classes)."""
    mt = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise Refusal(f"{mt} is an encoder-decoder model (only decoder-only causal LMs)")
    # A sub-config with a model type of its own is another model (a vision tower, a text model
    # inside a multimodal one); one without is a part of this model's config (DBRX's attn_config).
    subs = [
        k
        for k in getattr(config, "sub_configs", {})
        if getattr(getattr(config, k, None), "model_type", "")
    ]
    if subs:
        raise Refusal(f"{mt} is a composite (multimodal) model with {', '.join(sorted(subs))}")
    cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt) or _text_causal_lm(config, architecture)
    if not cls_name:
        raise Refusal(f"{mt} has no causal-LM class in transformers")
    if not isinstance(cls_name, str):
        cls_name = cls_name[0]
    if architecture and architecture != cls_name and architecture not in (mt, ""):
        known = getattr(transformers, architecture, None)
        if known is not None:
            raise Refusal(f"{architecture} is not a causal LM (its model type's is {cls_name})")
    kinds = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if kinds:
        raise Refusal(
            f"{mt} has layers of type {', '.join(sorted(map(str, kinds)))} (linear or hybrid "
            "attention, whose state the paged KV cache does not hold)"
        )
    dynamic = _rope_types(config) & DYNAMIC_ROPE
    if dynamic:
        raise Refusal(
            f"{mt} uses {', '.join(sorted(dynamic))} RoPE, which changes with the batch's "
            "sequence length"
        )
    if getattr(config, "position_embedding_type", "rotary") not in ("rotary", "rope"):
        raise Refusal(
            f"{mt} uses {config.position_embedding_type} position embeddings (only rotary)"
        )
    model_cls = getattr(transformers, cls_name)
    base_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Model"), None)
    forward = getattr(base_cls, "forward", None) if base_cls is not None else None
    if forward is not None and "position_ids" not in inspect.signature(forward).parameters:
        raise Refusal(f"{base_cls.__name__} takes no position_ids (it would ignore positions)")
    return model_cls


def build_hf_model(
    model_cls: type,
    config: PretrainedConfig,
    attn_implementation: str,
    dtype: torch.dtype,
    experts: str | None = None,
) -> Any:
    """``model_cls`` built from ``config`` with its weights allocated, not initialised (in the
    current device context), attending through ``attn_implementation`` (and, for a mixture of
    experts, computing them with ``experts``; None: transformers' default)."""
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "dtype": dtype}
    if experts is not None and model_cls._can_set_experts_implementation():
        kwargs["experts_implementation"] = experts
    with no_init_weights():
        model = model_cls._from_config(config, **kwargs)
    model.tie_weights()
    return model.eval()


def _spec(call: attention.ProbeCall, layer: int) -> AttentionSpec:
    unknown = sorted(
        k for k, v in call.kwargs.items() if v is not None and k not in KNOWN_KWARGS | INERT_KWARGS
    )
    if unknown:
        raise Refusal(
            f"attention layer {layer} ({type(call.module).__name__}) passes {', '.join(unknown)} "
            "to its attention function, which an attention spec cannot express"
        )
    _, heads, _, head_size = call.query_shape
    kw = call.kwargs
    scale = kw.get("scaling")
    causal = kw.get("is_causal", getattr(call.module, "is_causal", True))
    window = kw.get("sliding_window")
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=call.key_shape[1],
        head_size=head_size,
        scale=float(head_size**-0.5 if scale is None else scale),
        value_head_size=call.value_shape[-1],
        causal=bool(causal) if causal is not None else True,
        sliding_window=int(window) if window else None,
        logit_softcap=float(kw["softcap"]) if kw.get("softcap") else None,
        sinks=kw.get("s_aux") is not None,
    )


def _sinks_name(call: attention.ProbeCall) -> str | None:
    s_aux = call.kwargs.get("s_aux")
    if s_aux is None:
        return None
    for name, param in call.module.named_parameters():
        if param is s_aux:
            return name
    raise Refusal(f"{type(call.module).__name__}'s sinks are not one of its parameters")


def probe(hf_config: dict[str, Any], architecture: str) -> Probed:
    """The model's attention layers, as its transformers code calls them; raises
    :class:`Refusal` naming what the impl does not serve. Cached per config."""
    return _probe(json.dumps(hf_config, sort_keys=True, default=str), architecture)


@functools.lru_cache(maxsize=16)
def _probe(config_json: str, architecture: str) -> Probed:
    config = build_config(json.loads(config_json))
    model_cls = check_config(config, architecture)
    text = config.get_text_config()
    try:
        with torch.device("meta"):
            # Batched experts: the looping and grouped ones read routing values or dtypes
            # that the meta device does not have.
            model = build_hf_model(
                model_cls, config, attention.PROBE, torch.float32, experts="batched_mm"
            )
        names = {id(m): n for n, m in model.named_modules()}
        calls = attention.record_attention(model)
    except Refusal:
        raise
    except Exception as e:
        if isinstance(e, KeyError) and e.args == (attention.PROBE,):
            raise Refusal(
                f"{model_cls.__name__} picks its attention from a table of its own, not through "
                "ALL_ATTENTION_FUNCTIONS"
            ) from e
        first = str(e).splitlines()[0] if str(e) else ""
        raise Refusal(
            f"{model_cls.__name__} does not run on the meta device ({type(e).__name__}: {first})"
        ) from e
    layers = text.num_hidden_layers
    if not calls:
        raise Refusal(
            f"{model_cls.__name__}'s attention does not go through ALL_ATTENTION_FUNCTIONS"
        )
    modules = [names[id(c.module)] for c in calls]
    if len(set(modules)) != len(modules):
        raise Refusal(f"{model_cls.__name__} calls an attention module more than once per step")
    if len(calls) < layers:
        raise Refusal(
            f"{model_cls.__name__}: {layers - len(calls)} of {layers} layers attend otherwise "
            "than through ALL_ATTENTION_FUNCTIONS on text alone (linear, hybrid or "
            "cross-attention)"
        )
    specs = tuple(_spec(c, i) for i, c in enumerate(calls))
    bidirectional = [i for i, s in enumerate(specs) if not s.causal]
    if bidirectional:
        raise Refusal(
            f"{model_cls.__name__} attends bidirectionally in layers {bidirectional} (an "
            "encoder: only causal attention generates through a KV cache)"
        )
    sinks = tuple(_sinks_name(c) for c in calls)
    # The probe's module is dropped here: only names and specs are kept.
    return Probed(config, model_cls, tuple(modules), specs, sinks)
