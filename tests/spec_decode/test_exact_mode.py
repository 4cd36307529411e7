"""Exact mode: with ``model.batch_invariant: true`` speculative decoding is allowed, and greedy
tokens and their logprobs are bit-identical to the same engine's without speculation (each
verification row is computed as the one-token decode row it stands for), on SmolLM2 (CPU,
float32), 16 prompts in one batch, for n-gram (drafts often accepted), suffix (likewise) and
a random EAGLE head (drafts rejected: every verification row past the first is thrown away)."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from pagoda import LLM, SamplingParams

BASE = {"max_model_len": 384, "kv_cache_memory_bytes": 64 << 20, "batch_invariant": True}
MAX_TOKENS = 12


def _prompts(tokenizer) -> list[list[int]]:
    """8 ask to repeat source code given in the prompt (drafts accepted), 8 to continue prose
    (drafts mostly refused)."""
    funcs = [textwrap.dedent, textwrap.indent, textwrap.shorten, textwrap.wrap]
    funcs += [inspect.getsource, inspect.cleandoc, inspect.getdoc, inspect.isclass]
    out = []
    for i, fn in enumerate(funcs):
        src = tokenizer.encode(inspect.getsource(fn), add_special_tokens=False)[: 20 + 3 * i]
        lead = tokenizer.encode("Repeat this code exactly:\n", add_special_tokens=False)
        out.append(lead + src + [198] + lead[:2])
    topics = ["the sea", "a city at night", "bread", "winter", "a library", "rain", "trains"]
    for topic in [*topics, "mountains"]:
        out.append(tokenizer.encode(f"A short story about {topic}:", add_special_tokens=False))
    return out


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[dict]]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = []
    for o in outs:
        c = o.outputs[0]
        lps = [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs]
        got.append((list(c.token_ids), lps))
    return got


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    return _prompts(smollm2_tokenizer)


@pytest.fixture(scope="module")
def reference(prompts) -> list[tuple[list[int], list[dict]]]:
    return _run(LLM(**BASE), prompts)


def _random_eagle_head(folder) -> str:
    ckpt = pytest.importorskip("pagoda_spec_eagle.checkpoint")
    cfg = ckpt.llama_head_config("eagle3", 576, 1536, 9, 3, 49152, draft_vocab_size=4096)
    ckpt.write_head(folder, cfg, ckpt.random_head_weights(cfg, seed=3, std=0.2))
    return str(folder)


@pytest.mark.parametrize("method", ["ngram", "suffix", "eagle3"])
def test_exact_mode_greedy_tokens_and_logprobs_equal_those_without_speculation(
    method, prompts, reference, tmp_path
) -> None:
    # (drafting every step: with 16 requests the governor would start with a plain epoch, and
    # these 12-token answers could end before its first probe)
    spec: dict = {"method": method, "adaptive": False}
    if method == "eagle3":
        spec.update(model=_random_eagle_head(tmp_path / "head"), num_speculative_tokens=3)
    else:
        pytest.importorskip(f"pagoda_spec_{method}")
    llm = LLM(**BASE, speculative_config=spec)
    got = _run(llm, prompts)
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_draft_tokens > 0  # verification rows were computed
    if method != "eagle3":
        assert stats.num_accepted_tokens > 0
    for i, (want, have) in enumerate(zip(reference, got)):
        assert have[0] == want[0], f"prompt {i}: tokens part"
        assert have[1] == want[1], f"prompt {i}: logprobs part"
