"""The model-impl kit (``pagoda.testing.ModelImplSuite``) on the transformers impl: tiny Gemma 2
(soft-capped attention and logits, alternating windows), Gemma 3 (a global layer in six, q/k
norms), Qwen3-MoE (experts) and gpt-oss (sinks, windows, experts) configs, each against
transformers' own model of the same weights. gpt-oss's plan splits only its embedding and LM
head: every size above one is refused, and its refusal names the one size that fits."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from pagoda_models_transformers.tiny import build_hf_model, tiny_config

from pagoda.testing import ModelImplSuite
from pagoda.testing.model_impl import ModelReference, random_weights_

TYPES = ("gemma2", "gemma3_text", "qwen3_moe", "gpt_oss")


def _config(model_type: str) -> transformers.PretrainedConfig:
    cfg = tiny_config(model_type)
    if cfg is None:
        raise RuntimeError(f"no tiny config for {model_type}")
    return cfg


class TestTransformersModelImpl(ModelImplSuite):
    impl_name = "transformers"
    configs: dict[str, dict[str, Any]] = {t: _config(t).to_dict() for t in TYPES}

    def reference(self, name: str) -> ModelReference | None:
        model = build_hf_model(_config(name))
        random_weights_(model)

        def logits(tokens: list[int]) -> torch.Tensor:
            with torch.no_grad():
                return model(torch.tensor([tokens]), use_cache=False).logits[0]

        return ModelReference(model.state_dict(), logits)
