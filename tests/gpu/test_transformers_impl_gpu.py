"""On a GPU, the transformers model impl (``pagoda-models-transformers``): Qwen3-0.6B's shape on
random bf16 weights gives the native impl's first 32 greedy tokens on 16 prompts (except at
near-ties) with decode steps replayed from CUDA graphs; a Gemma-3-1B-shaped model serves its
whole 32k context (window layers keep every block); a tiny Gemma 2 (windows and soft-caps on
alternate layers) gives transformers' tokens through each GPU backend that computes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.plugins import get_registry

from .gpu_helpers import check_same_or_near_tie, save_random_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        "transformers" not in get_registry("model_impls").names(),
        reason="the pagoda-models-transformers plugin is not installed",
    ),
]

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
#: How far below transformers' best logit (bf16) an engine's greedy token may be.
BF16_SLACK = 0.05


def _prompts(vocab: int, n: int = 16, longest: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(10, vocab - 10, int(k)).tolist() for k in rng.integers(8, longest, n)]


def test_qwen3_through_the_plugin_gives_the_native_tokens(tmp_path: Path) -> None:
    folder = save_random_qwen3(tmp_path)
    prompts = [{"prompt_token_ids": p} for p in _prompts(151936)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    common = dict(model=str(folder), dtype="bfloat16", max_model_len=1024, max_num_seqs=32)
    common.update(kv_cache_memory_bytes=8 << 30)
    plugin = LLM(model_impl="transformers", **common)
    assert plugin.engine.info.model_impl == "transformers"
    runner = plugin.engine.engine_core.executor.worker.model_runner
    # Built under the CUDA device, the fused norms, MLPs and rotary still replace transformers'.
    layers = plugin.engine.info.shape.num_hidden_layers
    assert runner.model.fused == {"rms_norm": 4 * layers + 1, "gated_mlp": layers, "rotary": 1}
    got = [o.outputs[0].token_ids for o in plugin.generate(prompts, params, use_tqdm=False)]
    if runner.decode_graphs is not None:  # the backend captures: the HF forward must too
        assert runner.decode_graphs.replays >= 31
    graphs = runner.decode_graphs is not None
    del plugin, runner
    native = LLM(model_impl="native", **common)
    want = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False)]
    exact = sum(g == w for g, w in zip(got, want))
    for p, g, w in zip(prompts, got, want):
        check_same_or_near_tie(native, p["prompt_token_ids"], w, g)
    print(f"{exact} of 16 prompts identical for 32 tokens (decode graphs: {graphs})")
    assert graphs, "the plugin's decode steps did not run as CUDA graphs"


def test_a_gemma3_1b_shape_serves_its_whole_32k_context() -> None:
    """Five of every six layers slide over 512 keys; the context is max_position_embeddings,
    not the window, and a prompt that fills it decodes."""
    llm = LLM(
        model=str(CONFIGS / "gemma3-1b"),
        load_format="dummy",
        dtype="bfloat16",
        max_num_seqs=4,
        kv_cache_memory_bytes=4 << 30,
    )
    info = llm.engine.info
    assert info.model_impl == "transformers" and info.max_model_len == 32768
    windows = [s.sliding_window for s in info.shape.attention]
    assert windows.count(512) == 22 and windows.count(None) == 4
    prompt = np.random.default_rng(0).integers(10, 262000, 32768 - 16).tolist()
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 16
    assert len(out[0].prompt_token_ids) + 16 == 32768


def _gemma2_dir(folder: Path) -> Path:
    """A tiny Gemma 2 whose windows (16 keys, every other layer) and soft-caps matter."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from pagoda.loader.synthetic import synthetic_tokenizer

    config = Gemma2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=16,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0, max_position_embeddings=1024,
        query_pre_attn_scalar=64, eos_token_id=1, bos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # sharp attention: the soft-cap bites, the window shows
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8)
    model.save_pretrained(folder)
    synthetic_tokenizer(512, 1).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_gemma2_windows_and_softcaps_match_transformers(tmp_path: Path, backend: str) -> None:
    from importlib.util import find_spec

    from transformers import AutoModelForCausalLM

    if backend not in get_registry("attention_backends").names() or find_spec(backend) is None:
        pytest.skip(f"the {backend} attention plugin or its library is not installed")
    folder = _gemma2_dir(tmp_path)
    prompts = _prompts(512, n=8, longest=120)
    llm = LLM(
        model=str(folder), dtype="bfloat16", max_model_len=512, attention_backend=backend,
        kv_cache_memory_bytes=1 << 30,
    )  # fmt: skip
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    del llm
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, attn_implementation="eager"
    )  # eager: the attention that computes the soft-cap
    hf = hf.cuda().eval()
    exact = 0
    for p, o in zip(prompts, outs):
        got = list(o.outputs[0].token_ids)
        # Teacher-forced on the engine's tokens: each is transformers' choice, or within bf16
        # rounding of it (4 layers of sharp, capped attention in bf16 move logits by ~1e-2;
        # a dropped window or cap moves them by far more: the CPU tests in float32 show it).
        with torch.inference_mode():
            logits = hf(torch.tensor([p + got], device="cuda")).logits[0, len(p) - 1 : -1]
        logits = logits.float()
        best = logits.max(-1).values
        chosen = logits.gather(1, torch.tensor(got, device="cuda")[:, None])[:, 0]
        assert float((best - chosen).max()) <= BF16_SLACK, (
            f"a token {float((best - chosen).max()):.3f} below transformers' best logit"
        )
        exact += int(torch.equal(logits.argmax(-1).cpu(), torch.tensor(got)))
    print(f"{backend}: {exact} of {len(prompts)} prompts are transformers' greedy tokens")
