"""On a GPU, exact mode: with ``model.batch_invariant: true`` greedy tokens and logprobs with
n-gram, suffix and a random EAGLE-3 head are bit-identical to the same engine's without
speculation, on SmolLM2 (16 prompts in one batch, CUDA graphs on: decode, verification and
greedy-verification graphs hold the invariant kernels), in bfloat16, and in float32 for n-gram.
Without exact mode bf16 verification rows may part from decode rows at near-ties (issue 44)."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from pagoda import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BASE = {
    "max_model_len": 512,
    "max_num_seqs": 16,
    "kv_cache_memory_bytes": 1 << 30,
    "batch_invariant": True,
    "device": "cuda",
}
MAX_TOKENS = 32


def _prompts(tokenizer) -> list[list[int]]:
    """8 that repeat source code they give (drafts accepted), 8 that continue prose."""
    funcs = [textwrap.dedent, textwrap.indent, textwrap.shorten, textwrap.wrap]
    funcs += [inspect.getsource, inspect.cleandoc, inspect.getdoc, inspect.isclass]
    lead = tokenizer.encode("Repeat this code exactly:\n", add_special_tokens=False)
    out = []
    for i, fn in enumerate(funcs):
        src = tokenizer.encode(inspect.getsource(fn), add_special_tokens=False)[: 40 + 8 * i]
        out.append(lead + src + [198] + lead[:2])
    for topic in ["the sea", "a city", "bread", "winter", "a library", "rain", "trains", "snow"]:
        out.append(tokenizer.encode(f"A short story about {topic}:", add_special_tokens=False))
    return out


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def _random_eagle3_head(folder) -> str:
    ckpt = pytest.importorskip("pagoda_spec_eagle.checkpoint")
    cfg = ckpt.llama_head_config("eagle3", 576, 1536, 9, 3, 49152, draft_vocab_size=4096)
    ckpt.write_head(folder, cfg, ckpt.random_head_weights(cfg, seed=3, std=0.2))
    return str(folder)


@pytest.mark.parametrize(
    "dtype,methods",
    [("bfloat16", ["ngram", "suffix", "eagle3"]), ("float32", ["ngram"])],
)
def test_exact_mode_speculation_is_bit_identical_on_the_gpu(
    dtype, methods, smollm2_tokenizer, tmp_path
) -> None:
    prompts = _prompts(smollm2_tokenizer)
    reference = _run(LLM(**BASE, dtype=dtype), prompts)
    for method in methods:
        # (drafting every step: the governor would start 16 requests with a plain epoch)
        spec: dict = {"method": method, "adaptive": False}
        if method == "eagle3":
            spec.update(model=_random_eagle3_head(tmp_path / "head"), num_speculative_tokens=3)
        else:
            pytest.importorskip(f"pagoda_spec_{method}")
        llm = LLM(**BASE, dtype=dtype, speculative_config=spec)
        got = _run(llm, prompts)
        stats = llm.engine.engine_core.scheduler.spec_stats_total
        assert stats.num_draft_tokens > 0, method
        for i, (want, have) in enumerate(zip(reference, got)):
            assert have[0] == want[0], f"{method}, prompt {i}: tokens part"
            assert have[1] == want[1], f"{method}, prompt {i}: logprobs part"
        del llm
        torch.cuda.empty_cache()
