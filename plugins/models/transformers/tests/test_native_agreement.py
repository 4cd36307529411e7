"""The Llama family through the transformers impl agrees with the core's native impl on the same
checkpoint, within 1e-5, through the same paged scenario."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tf_parity import build_ours, hf_config_dict, hf_model, run_scenario, save

from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.loader import ModelArchConfig, iter_safetensors
from pagoda.models.llama import LlamaForCausalLM


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_transformers_impl_agrees_with_native(model_type: str, tmp_path: Path) -> None:
    hf = hf_model(model_type)
    folder = save(hf, tmp_path)
    native = LlamaForCausalLM(
        ModelArchConfig.from_hf_config(hf_config_dict(folder)), TorchNativeBackend
    )
    native.load_weights(iter_safetensors(folder))
    vocab = hf.config.vocab_size
    ours = run_scenario(build_ours(folder), vocab)
    theirs = run_scenario(native.eval(), vocab)
    for a, b in zip(ours, theirs, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=0)
