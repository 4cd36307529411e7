"""The replay of prompt lookup over known greedy outputs (``pagoda_spec_ngram.replay``) takes
the steps, drafts and accepted tokens that an engine drafting on every step takes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pagoda_spec_ngram.replay import Replay, replay

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights

TINY = Path(__file__).parents[4] / "benchmarks" / "configs" / "tiny-llama"


def test_drafts_that_all_agree_end_the_output_in_one_verification() -> None:
    # The prompt's step samples 1; "1" occurred before, followed by 2 3 4: drafted, accepted,
    # and the bonus token 5 ends the output.
    r = replay([9, 1, 2, 3, 4], [1, 2, 3, 4, 5], k=4, min_n=1, max_n=2)
    assert (r.steps, r.verifications, r.draft_tokens, r.accepted_tokens) == (2, 1, 3, 3)
    assert r.tokens_per_step == 4.0 and r.mean_acceptance_length == 4.0


def test_a_rejected_draft_costs_the_tokens_after_it() -> None:
    # Drafts 2 3 4 meet 2 8: one accepted, 8 is the bonus; then "8" and "2 8" never occurred
    # (no drafts), then "4" did, but one token is left: nothing to draft.
    r = replay([9, 1, 2, 3, 4], [1, 2, 8, 4, 9], k=4, min_n=1, max_n=2)
    assert (r.steps, r.verifications, r.draft_tokens, r.accepted_tokens) == (4, 1, 3, 1)
    assert r.tokens_per_step == pytest.approx(4 / 3)


def test_max_tokens_limits_the_slots_as_the_scheduler_does() -> None:
    # Drafts 2 3 4 5 meet 2 5: the bonus 5 occurred before, followed by 6 7 8 1, which the output
    # goes on with. With max_tokens = 8, that step's slots were given while the first was in
    # flight, counting its 4 slots as accepted: 1 slot, and one step more.
    prompt, out = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 5, 6, 7, 8, 1, 2]
    free = replay(prompt, out, k=4, min_n=1, max_n=1)
    capped = replay(prompt, out, k=4, min_n=1, max_n=1, max_tokens=len(out))
    assert (free.steps, capped.steps) == (3, 4)


@pytest.mark.parametrize("k,lo,hi", [(3, 2, 4), (8, 1, 8)])
def test_the_replay_takes_the_engines_steps(k: int, lo: int, hi: int) -> None:
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    engine = dict(
        model=str(folder), device="cpu", max_model_len=256, kv_cache_memory_bytes=16 << 20
    )
    rng = np.random.default_rng(5)
    prompts = [rng.integers(10, 1000, int(n)).tolist() for n in (9, 30, 17, 4, 23, 12)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def one_at_a_time(llm: LLM) -> list[list[int]]:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        return [list(o.outputs[0].token_ids) for o in outs]

    outputs = one_at_a_time(LLM(**engine, max_num_seqs=1))
    spec = dict(
        method="ngram",
        num_speculative_tokens=k,
        prompt_lookup_min=lo,
        prompt_lookup_max=hi,
        adaptive=False,
    )
    llm = LLM(**engine, max_num_seqs=1, speculative_config=spec)
    scheduler = llm.engine.engine_core.scheduler
    steps, schedule = [0], scheduler.schedule

    def counting():
        so = schedule()
        steps[0] += not so.is_empty
        return so

    scheduler.schedule = counting
    assert one_at_a_time(llm) == outputs
    want = Replay()
    for prompt, output in zip(prompts, outputs):
        want += replay(prompt, output, k, lo, hi, params.max_tokens)
    stats = scheduler.spec_stats_total
    assert want.verifications > 5 and want.accepted_tokens > 0  # the random model repeats itself
    got = (steps[0], stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert got == (want.steps, want.verifications, want.draft_tokens, want.accepted_tokens)
