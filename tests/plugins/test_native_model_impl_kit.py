"""The model-impl kit (``pagoda.testing.ModelImplSuite``) on the core's ``native`` impl: tiny
Llama, Qwen3 and Mistral (a sliding window shorter than the kit's prompts) configs, each against
transformers' model of the same weights; and negative controls: a model that ignores positions,
and one that takes a step's flat batch for one request, each fail the kit's check for it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.native import NativeModelImpl
from pagoda.models.shape import ModelShape
from pagoda.testing import ModelImplSuite
from pagoda.testing.model_impl import (
    ModelReference,
    build_impl_model,
    check_chunked_matches_one_step,
    check_packed_matches_alone,
    random_weights_,
)

_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**_TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen3": {
        **_TINY,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 32,  # wider than hidden / heads, as Qwen3's are
        "tie_word_embeddings": True,
    },
    "mistral_window": {
        **_TINY,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 8,  # the kit's prompts are longer: the window bites
    },
}


def hf_reference(config: dict[str, Any], seed: int = 0) -> ModelReference:
    """transformers' model of ``config`` with the kit's random weights, and its logits."""
    cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    random_weights_(model, seed)

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokens]), use_cache=False).logits[0]

    return ModelReference(model.state_dict(), logits)


class TestNativeModelImpl(ModelImplSuite):
    impl_name = "native"
    configs = CONFIGS

    def reference(self, name: str) -> ModelReference | None:
        return hf_reference(self.configs[name])


class _IgnoresPositions(LlamaForCausalLM):
    """Numbers the step's tokens from 0: right for a whole prompt in one step only."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids, torch.arange(len(input_ids)))


class _OneRequestPerStep(LlamaForCausalLM):
    """Takes the flat batch for one request: positions run on from the step's first token, so
    a second request in the step reads the first's positions (right when a step has one)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids, positions[0] + torch.arange(len(input_ids)))


def _broken(model_cls: type[LlamaForCausalLM]) -> tuple[ModelShape, torch.nn.Module]:
    class Broken(NativeModelImpl):
        @classmethod
        def model_class(cls, shape: ModelShape) -> Any:
            return model_cls

    return build_impl_model(Broken, CONFIGS["llama"])


def test_a_model_that_ignores_positions_fails_the_chunked_check() -> None:
    shape, model = _broken(_IgnoresPositions)
    with pytest.raises(AssertionError, match=r"chunks and decodes .* vs one step"):
        check_chunked_matches_one_step(shape, model)


def test_a_model_that_takes_a_step_for_one_request_fails_the_packed_check() -> None:
    shape, model = _broken(_OneRequestPerStep)
    check_chunked_matches_one_step(shape, model)  # one request per step: nothing to see
    with pytest.raises(AssertionError, match=r"request 1 of 3 packed in one batch vs alone"):
        check_packed_matches_alone(shape, model)
