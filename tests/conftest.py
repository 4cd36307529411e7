from __future__ import annotations

import os

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from pagoda.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> torch.nn.Module:
    """transformers' own model on the GGUF weights (its own GGUF reader), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path):
    from pagoda.loader import convert_gguf, load_tokenizer

    return load_tokenizer(convert_gguf(smollm2_gguf))


def cuda_only() -> pytest.MarkDecorator:
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
