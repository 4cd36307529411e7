"""Tiny random Llama-family models on disk (safetensors and a synthetic tokenizer), for tensor
parallelism on CPU ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# The vocabulary is odd, so that the last rank's share of the vocabulary is padded.
_BASE = dict(
    vocab_size=1001,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
TINY = {
    # One KV head: at two ranks it is replicated, not split.
    "llama": dict(model_type="llama", num_key_value_heads=1, tie_word_embeddings=False),
    # Two KV heads, split; q/k norms; the LM head tied to the embedding.
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}


def build_tiny(folder: Path, kind: str) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagoda.loader.synthetic import synthetic_tokenizer

    extra = dict(TINY[kind])
    config = AutoConfig.for_model(extra.pop("model_type"), **_BASE, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms, so that the norms matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    synthetic_tokenizer(_BASE["vocab_size"], _BASE["eos_token_id"]).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return {k: build_tiny(tmp_path_factory.mktemp(f"tiny-{k}"), k) for k in TINY}
