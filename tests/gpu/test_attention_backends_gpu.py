"""On a GPU: each attention backend gives the torch reference's greedy tokens on a random-weight
model with Llama-3.1-8B's layer shapes (two layers, bf16), except at near-ties."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.plugins import get_registry

from .gpu_helpers import check_same_or_near_tie

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b" / "config.json"
STEPS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    cfg = json.loads(CONFIG.read_text())
    cfg["num_hidden_layers"] = 2
    folder = tmp_path_factory.mktemp("llama8b-2layers")
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _randomize(llm: LLM) -> torch.nn.Module:
    """Realistically scaled random weights (normal, std 0.02; norms 1), the same in every engine."""
    model = llm.engine.engine_core.executor.worker.model_runner.model
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(
                    torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32)
                    .mul_(0.02)
                    .to(p.dtype)
                )
    return model


def _prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"prompt_token_ids": rng.integers(10, 128000, int(n)).tolist()}
        for n in rng.integers(16, 512, 16)
    ]


def _engine(model_dir: Path, backend: str) -> LLM:
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        attention_backend=backend,
        max_model_len=1024,
        kv_cache_memory_bytes=4 << 30,
    )
    _randomize(llm)
    return llm


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(
        _prompts(),
        SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_backend_greedy_tokens_match_torch_reference(model_dir: Path, backend: str) -> None:
    if backend not in get_registry("attention_backends").names():
        pytest.skip(f"{backend} plugin not installed")
    if find_spec(backend) is None:  # the plugin without its library: nothing of it can run
        pytest.skip(f"{backend} (the library) not installed")
    ref_llm = _engine(model_dir, "torch_native")
    want = _greedy(ref_llm)
    got = _greedy(_engine(model_dir, backend))
    prompts = _prompts()
    for p, w, g in zip(prompts, want, got):
        check_same_or_near_tie(ref_llm, p["prompt_token_ids"], w, g)
    # NOTE: random bf16 weights make flat logits, so ties are common; every divergence above was
    # checked to be one, which is all that greedy parity can ask of a different kernel.
