from __future__ import annotations

import os

# Nothing in the tests may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when it is first imported. Without CUDA every kernel test runs
# under its interpreter, so ask for it here, before any test module is collected: a GPU module
# collected first that imports triton would otherwise leave the CPU kernel tests without it
# (each fails with "Cannot call @triton.jit'd outside of the scope of a kernel"). The engine's
# ops still take the torch path on a CPU unless PAGODA_TRITON_ON_CPU asks too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture
def residual_added_in_epilogue(monkeypatch) -> list[int]:
    """Every output and down projection of the native Llama family added into the residual in
    place (``pagoda.ops.linear_add_``'s path, which a GPU takes for large steps), forced on
    every step on any device; the list of each such projection's rows, in order."""
    from pagoda.models import llama

    added: list[int] = []

    def always(residual, x, weight):
        residual.addmm_(x, weight.t())
        added.append(x.shape[0])
        return True

    monkeypatch.setattr(llama, "linear_add_", always)
    return added
