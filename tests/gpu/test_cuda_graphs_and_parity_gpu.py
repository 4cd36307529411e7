"""On a GPU: decode steps replayed from CUDA graphs give the eager engine's greedy tokens, and a
random-weight Qwen3-0.6B in bf16 gives transformers' greedy tokens on the same weights (first 32
tokens of 16 prompts), except at near-ties."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams

from .gpu_helpers import check_same_or_near_tie, near_tie, scale_random_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(10, vocab - 10, int(n)).tolist() for n in rng.integers(8, 300, 16)]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3-0.6B's architecture with transformers' own random initialisation, saved once."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagoda.loader.synthetic import synthetic_tokenizer

    folder = tmp_path_factory.mktemp("qwen3-random")
    cfg = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    synthetic_tokenizer(cfg["vocab_size"], cfg["eos_token_id"]).save_pretrained(folder)
    return folder


def test_qwen3_greedy_matches_transformers_in_bf16(qwen3_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = _prompts(151936)
    llm = LLM(
        model=str(qwen3_dir), dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=8 << 30
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    del llm
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.bfloat16).cuda().eval()
    exact = 0
    for p, o in zip(prompts, outs):
        got = o.outputs[0].token_ids
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
            )[0, len(p) :].tolist()
        if got == want:
            exact += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.inference_mode():
            logits = hf(torch.tensor([p + want[:i]], device="cuda")).logits[0, -1]
        assert near_tie(logits), f"diverges from transformers at token {i}, not at a near-tie"
    print(f"{exact} of 16 prompts identical for 32 tokens")


def _installed(backend: str) -> bool:
    """The backend's plugin and the library it runs on (a plugin without its library cannot
    run, and the engine would fail at selection)."""
    from importlib.util import find_spec

    from pagoda.plugins import get_registry

    return backend in get_registry("attention_backends").names() and find_spec(backend) is not None


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_cuda_graph_decode_matches_eager(qwen3_dir: Path, backend: str) -> None:
    if not _installed(backend):
        pytest.skip(f"the {backend} attention plugin or its library is not installed")
    prompts = [{"prompt_token_ids": p} for p in _prompts(151936)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    common = dict(
        model=str(qwen3_dir),
        dtype="bfloat16",
        max_model_len=1024,
        attention_backend=backend,
        kv_cache_memory_bytes=8 << 30,
        max_num_seqs=32,
    )
    graphed = LLM(**common)
    runner = graphed.engine.engine_core.executor.worker.model_runner
    assert runner.decode_graphs is not None and runner.graph_capture_s > 0
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    assert runner.decode_graphs.replays >= 31  # every decode step of the batch replayed
    del graphed
    eager = LLM(enforce_eager=True, **common)
    assert eager.engine.engine_core.executor.worker.model_runner.decode_graphs is None
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    # Same kernels, but cuBLAS may pick another algorithm for a padded batch: ties may flip.
    for p, g, w in zip(prompts, got, want):
        check_same_or_near_tie(eager, p["prompt_token_ids"], w, g)


def test_decode_steps_wait_for_the_device_only_for_the_sampled_ids(qwen3_dir: Path) -> None:
    """Steady decoding makes no synchronizing CUDA call (torch's sync debug mode raises on
    one); the host waits only on each step's event, after the next step is launched."""
    llm = LLM(
        model=str(qwen3_dir),
        dtype="bfloat16",
        max_model_len=1024,
        attention_backend="triton",
        kv_cache_memory_bytes=4 << 30,
        max_num_seqs=32,
    )
    prompts = [{"prompt_token_ids": p} for p in _prompts(151936)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    for _ in range(4):  # prefill and the first decodes, outside the check
        engine.step()
    runner = engine.engine_core.executor.worker.model_runner
    waits = []
    original = torch.cuda.Event.synchronize

    def counted(event):
        waits.append(event)
        return original(event)

    torch.cuda.Event.synchronize = counted
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Event.synchronize = original
    assert runner.decode_graphs.replays >= 16
    assert len(waits) <= steps  # one wait per step at most


def _piecewise_engine(model_dir: Path, limit: int, **kw) -> LLM:
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype="float32",
        max_model_len=2048,
        kv_cache_memory_bytes=2 << 30,
        piecewise_graph_max_tokens=limit,
        **kw,
    )
    scale_random_weights(llm, 0.05)
    return llm


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b"])
def test_piecewise_graphs_give_the_eager_steps_logprobs(name: str, tmp_path: Path) -> None:
    """Steps with prompt tokens replayed as graphs between eager attention calls give the eager
    engine's prompt logprobs and greedy tokens (float32). Two requests at a time: a prompt's
    step mixes with the other's decodes; steps past the graphs' limit (two prompts at once, the
    long prompt's chunks) run eagerly in the same engine."""
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    prompts = _prompts(cfg["vocab_size"])[:8]  # 146, 157, 228, 285, 18, 50, 248, 285 tokens
    prompts.append(np.random.default_rng(2).integers(10, 1000, 1100).tolist())
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    kw = {"max_num_batched_tokens": 512, "max_num_seqs": 2}
    graphed = _piecewise_engine(tmp_path, 256, **kw)
    runner = graphed.engine.engine_core.executor.worker.model_runner
    assert runner.piecewise is not None and runner.piecewise.max_tokens == 256
    eager_steps, forward = [], runner.model.forward

    def counted(*args, **kwargs):
        eager_steps.append(args[0].shape[0])
        return forward(*args, **kwargs)

    runner.model.forward = counted
    got = graphed.generate(requests, params, use_tqdm=False)
    replays = runner.piecewise.replays
    graphed.engine.shutdown()
    del graphed, runner
    assert replays >= 4 and eager_steps and min(eager_steps) > 256, (replays, eager_steps)
    eager = _piecewise_engine(tmp_path, 0, **kw)
    assert eager.engine.engine_core.executor.worker.model_runner.piecewise is None
    want = eager.generate(requests, params, use_tqdm=False)
    for p, g, w in zip(prompts, got, want):
        gl = [next(iter(d.values())).logprob for d in g.prompt_logprobs[1:]]
        wl = [next(iter(d.values())).logprob for d in w.prompt_logprobs[1:]]
        np.testing.assert_allclose(gl, wl, atol=2e-3, rtol=0)
        check_same_or_near_tie(eager, p, w.outputs[0].token_ids, g.outputs[0].token_ids)
    eager.engine.shutdown()
