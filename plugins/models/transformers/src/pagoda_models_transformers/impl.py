"""``transformers``: any decoder-only causal LM of the installed transformers, built from its own
modeling code, with attention through Pagoda's paged KV cache."""

from __future__ import annotations

from typing import Any

from pagoda.models.impl import ModelImpl, named_architecture
from pagoda.models.shape import ModelShape

# NOTE: transformers' modeling code (seconds to import) is imported by the methods that need it,
# not here: an engine whose model another impl serves resolves this class to read its priority
# and never asks it more.


class TransformersModelImpl(ModelImpl):
    """Serves what transformers' causal-LM classes build, whose every layer's attention goes
    through ``ALL_ATTENTION_FUNCTIONS`` and fits an attention spec; below ``native`` (100),
    which keeps the architectures it has."""

    priority = 50

    @classmethod
    def supports(cls, hf_config: dict[str, Any], architecture: str) -> str | None:
        from pagoda_models_transformers.probe import Refusal, probe

        try:
            probe(hf_config, architecture)
        except Refusal as e:
            return str(e)
        return None

    @classmethod
    def shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        from pagoda_models_transformers.model import TransformersModelConfig
        from pagoda_models_transformers.probe import probe
        from pagoda_models_transformers.tensor_parallel import probe_sharded

        arch = named_architecture(hf_config)
        unsplit = probe(hf_config, arch)
        tp = tensor_parallel_size
        # Split by the model's own tensor-parallel plan: each rank's heads, read from
        # transformers' forward of the split model.
        probed = unsplit if tp == 1 else probe_sharded(hf_config, arch, tp)
        text = probed.config.get_text_config()
        max_pos = getattr(text, "max_position_embeddings", None)
        if not max_pos:
            raise ValueError(f"{arch}: config.json names no max_position_embeddings")
        return ModelShape(
            architecture=arch or probed.model_class.__name__,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_hidden_layers=text.num_hidden_layers,
            max_position_embeddings=int(max_pos),
            attention=probed.specs,
            config=TransformersModelConfig(
                hf_config=dict(hf_config),
                architecture=arch,
                attention_modules=probed.module_names,
                specs=probed.specs,
                sinks=probed.sinks,
                tensor_parallel_size=tp,
                unsplit_specs=unsplit.specs if tp > 1 else (),
            ),
            torch_dtype=str(
                hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
            ).removeprefix("torch."),
            bos_token_id=text.bos_token_id,
            eos_token_id=text.eos_token_id,
        )

    @classmethod
    def model_class(cls, shape: ModelShape) -> Any:
        from pagoda_models_transformers.model import TransformersCausalLM

        return TransformersCausalLM
