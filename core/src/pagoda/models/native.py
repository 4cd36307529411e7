"""``native``: the core's own implementations (the Llama family), as a model impl."""

from __future__ import annotations

from typing import Any

from pagoda.distributed import check_tensor_parallel
from pagoda.loader.arch import ModelArchConfig, architecture_of
from pagoda.models.bert import ENCODER_ARCHITECTURES, BertArchConfig
from pagoda.models.bert import attention_specs as encoder_attention_specs
from pagoda.models.impl import ModelImpl
from pagoda.models.llama import attention_specs as llama_attention_specs
from pagoda.models.shape import ModelShape
from pagoda.plugins import get_registry


class NativeModelImpl(ModelImpl):
    """The architectures of ``pagoda.loader.arch.SUPPORTED_ARCHITECTURES``, each built from the
    class that ``register_models`` registered under its name (a plugin may override one). The
    class declares its layers' specs with ``attention_specs(arch, tensor_parallel_size)``
    (without one: the Llama family's). BERT-style encoders (``pagoda.models.bert``) are served
    here too, each layer bidirectional. A plugin adds a native architecture of its own by
    registering, with ``register_models``, a class that declares its shape: a classmethod
    ``model_shape(hf_config, tensor_parallel_size) -> ModelShape``."""

    priority = 100

    @classmethod
    def supports(cls, hf_config: dict[str, Any], architecture: str) -> str | None:
        if _encoder(hf_config) is not None or _declared(hf_config) is not None:
            return None
        try:
            architecture_of(hf_config)
        except ValueError as e:
            return str(e)
        return None

    @classmethod
    def shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        encoder = _encoder(hf_config)
        if encoder is not None:
            return _encoder_shape(BertArchConfig.from_hf_config(hf_config, encoder),
                                  tensor_parallel_size)  # fmt: skip
        declared = _declared(hf_config)
        if declared is not None:
            return declared.model_shape(hf_config, tensor_parallel_size)
        arch = ModelArchConfig.from_hf_config(hf_config)
        check_tensor_parallel(arch, tensor_parallel_size)
        model_cls = get_registry("models").get(arch.architecture)
        # A class registered without specs of its own attends as the Llama family does.
        specs = getattr(model_cls, "attention_specs", llama_attention_specs)
        return ModelShape(
            architecture=arch.architecture,
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            num_hidden_layers=arch.num_hidden_layers,
            max_position_embeddings=arch.max_position_embeddings,
            attention=tuple(specs(arch, tensor_parallel_size)),
            config=arch,
            torch_dtype=arch.torch_dtype,
            bos_token_id=arch.bos_token_id,
            eos_token_id=arch.eos_token_id,
        )

    @classmethod
    def model_class(cls, shape: ModelShape) -> Any:
        return get_registry("models").get(shape.architecture)


def _declared(hf_config: dict[str, Any]) -> Any:
    """The class ``register_models`` registered under an architecture the config.json names
    that declares its own shape (``model_shape``), if any (the core's own classes declare none)."""
    registry = get_registry("models")
    known = set(registry.names())
    for name in hf_config.get("architectures") or []:
        if name in known:
            model_cls = registry.get(name)
            if hasattr(model_cls, "model_shape"):
                return model_cls
    return None


def _encoder(hf_config: dict[str, Any]) -> str | None:
    """The BERT-style architecture a config.json names (or its model type implies), if any."""
    for name in hf_config.get("architectures") or []:
        if name in ENCODER_ARCHITECTURES:
            return name
    if not hf_config.get("architectures"):
        by_type = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel", "roberta": "RobertaModel"}
        return by_type.get(str(hf_config.get("model_type")))
    return None


def _encoder_shape(cfg: BertArchConfig, tensor_parallel_size: int) -> ModelShape:
    return ModelShape(
        architecture=cfg.architecture,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        max_position_embeddings=cfg.max_context,
        attention=tuple(encoder_attention_specs(cfg, tensor_parallel_size)),
        config=cfg,
        torch_dtype=cfg.torch_dtype,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )
