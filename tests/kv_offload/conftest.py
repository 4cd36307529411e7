from __future__ import annotations

from pathlib import Path

import pytest
import torch

# A random two-layer Llama: milliseconds a step on a CPU, so that prefixes can be long.
TINY_CONFIG = {
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
    """The tiny Llama with weights drawn so that attention is sharp: its greedy output depends
    on tokens far back in the prompt (with the small weights of ``load_format=dummy`` it hardly
    does, and KV loaded wrong from the CPU pool could go unnoticed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagoda.loader.synthetic import synthetic_tokenizer

    folder = tmp_path_factory.mktemp("tiny-offload")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            std = 1.0 if name.startswith(("model.embed", "lm_head")) else p.shape[-1] ** -0.5
            p.normal_(0, 3 * std if ("q_proj" in name or "k_proj" in name) else std)
    model.save_pretrained(folder)
    synthetic_tokenizer(TINY_CONFIG["vocab_size"], TINY_CONFIG["eos_token_id"]).save_pretrained(
        folder
    )
    return folder
