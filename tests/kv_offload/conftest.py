from __future__ import annotations

import json
from pathlib import Path

import pytest

# A random two-layer Llama: milliseconds a step on a CPU, so that prefixes can be long.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-offload")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return folder
