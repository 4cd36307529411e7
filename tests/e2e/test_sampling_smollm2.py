"""Sampling settings end to end on SmolLM2: logprobs and prompt logprobs against transformers'
log-softmax (chunked prefill on), seeded requests in mixed batches, n > 1 sharing its prompt's
blocks, and penalties and bad words on the real model."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.outputs import PositionLogprobs

BUDGET = 32  # tokens per step: every prompt here is prefilled in several chunks
PASSAGE = (
    "The history of the city begins with a small fishing village on the river bank. Over the "
    "centuries, merchants arrived from distant lands, bringing spices, silk and new ideas. The "
    "village grew into a town, and the town into a city with bridges and markets. "
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=BUDGET)


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' fp32 logits: row t is the distribution of token t + 1."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_position(entry: PositionLogprobs, token: int, ref: torch.Tensor, k: int) -> None:
    """The token's logprob within 1e-4, its rank right up to ties within 1e-4, and the top k."""
    got = entry[token]
    assert abs(got.logprob - ref[token].item()) < 1e-4
    lo = 1 + int((ref > got.logprob + 1e-4).sum())
    hi = int((ref >= got.logprob - 1e-4).sum())
    assert lo <= got.rank <= hi, (got.rank, lo, hi)
    top = ref.topk(k)
    rest = {t: lp for t, lp in entry.items() if t != token or lp.rank <= k}
    assert sorted(rest) == sorted(top.indices.tolist())
    for rank, (t, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert abs(entry[t].logprob - value) < 1e-4 and entry[t].rank == rank


def test_logprobs_and_prompt_logprobs_match_transformers(llm: LLM, hf_smollm2) -> None:
    tok = llm.get_tokenizer()
    prompt = tok.encode(PASSAGE * 2)[:70]  # three chunks of prefill
    assert len(prompt) == 70
    greedy = SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=3)
    # Sampling with settings that change the logits: logprobs stay the model's own.
    sampled = SamplingParams(
        max_tokens=6, temperature=0.8, seed=3, logprobs=2, repetition_penalty=1.5, top_k=20
    )
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [greedy, sampled])
    for out, k in zip(outs, (5, 2)):
        gen = out.outputs[0]
        ref = _hf_logprobs(hf_smollm2, prompt + gen.token_ids)
        assert len(gen.logprobs) == len(gen.token_ids) == 6
        for i, (token, entry) in enumerate(zip(gen.token_ids, gen.logprobs)):
            _check_position(entry, token, ref[len(prompt) - 1 + i], k)
        total = sum(e[t].logprob for t, e in zip(gen.token_ids, gen.logprobs))
        assert gen.cumulative_logprob == pytest.approx(total)
    assert all(
        e[t].rank == 1 for t, e in zip(outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs)
    )
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(prompt) and prompt_lps[0] is None
    ref = _hf_logprobs(hf_smollm2, prompt)
    for j in range(1, len(prompt)):
        _check_position(prompt_lps[j], prompt[j], ref[j - 1], 3)
    assert outs[1].prompt_logprobs is None


def _seeded(llm: LLM, others: list[SamplingParams], index: int) -> list[int]:
    target = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    params = list(others)
    params.insert(index, target)
    prompts = [f"Story number {i}: once upon a time" for i in range(len(params))]
    prompts[index] = "Tell me about the sea."
    return llm.generate(prompts, params, use_tqdm=False)[index].outputs[0].token_ids


def test_seeded_request_gives_the_same_tokens_alone_and_in_mixed_batches(llm: LLM) -> None:
    def other(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=3 + i, temperature=1.0, seed=i if i % 2 else None)

    alone = _seeded(llm, [], 0)
    assert _seeded(llm, [other(1), other(2)], 2) == alone
    assert _seeded(llm, [other(i) for i in range(5)], 0) == alone
    assert _seeded(llm, [SamplingParams(max_tokens=4, temperature=0), other(3)], 1) == alone


def test_n4_with_a_seed_prefills_the_prompt_once_and_shares_its_blocks(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = tok.encode("A different passage. " + PASSAGE * 3)[:100]  # 6 full blocks, then 4
    assert len(prompt) == 100
    core = llm.engine.engine_core
    scheduler, kv = core.scheduler, core.kv_cache_manager
    scheduled: dict[str, int] = {}
    peak = 0
    original = scheduler.schedule

    def schedule():
        nonlocal peak
        out = original()
        for rid, n in out.num_scheduled_tokens.items():
            scheduled[rid] = scheduled.get(rid, 0) + n
        peak = max(peak, core.num_blocks - 1 - kv.num_free_blocks)
        return out

    scheduler.schedule = schedule
    try:
        params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    finally:
        scheduler.schedule = original
    samples = out.outputs
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert all(len(s.token_ids) == 8 and s.finish_reason == "length" for s in samples)
    assert len({tuple(s.token_ids) for s in samples}) > 1
    # Prompt tokens computed: all 100 once, then only the 4 after the shared full blocks.
    computed = {rid: n - 7 for rid, n in scheduled.items()}  # less 7 decode steps
    assert sorted(computed.values()) == [4, 4, 4, 100]
    assert peak == 6 + 4  # the shared full blocks, and one block per sample for the rest
    # Sharing changed nothing: sample i equals a lone request seeded seed + i.
    alone = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i, ignore_eos=True)
        for i in range(4)
    ]
    lone = llm.generate([{"prompt_token_ids": prompt}] * 4, alone, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in lone] == [s.token_ids for s in samples]


def test_greedy_repetition_penalty_matches_transformers_generate(llm: LLM, hf_smollm2) -> None:
    prompt = llm.get_tokenizer().encode("Repeat after me: apple apple apple apple")
    params = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.4)
    got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    with torch.inference_mode():
        want = hf_smollm2.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.4,
        )[0, len(prompt) :].tolist()
    assert got == want


def test_bad_words_keep_a_word_out_of_the_output(llm: LLM) -> None:
    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=8, temperature=0)
    assert "Paris" in llm.generate(prompt, greedy)[0].outputs[0].text
    banned = SamplingParams(max_tokens=8, temperature=0, bad_words=["Paris"])
    assert "Paris" not in llm.generate(prompt, banned)[0].outputs[0].text
