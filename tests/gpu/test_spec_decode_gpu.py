"""On a GPU: greedy output with n-gram speculation equals greedy output without it on a
random-weight Qwen3-0.6B in bf16 (except at near-ties), with decode CUDA graphs still replayed
for the steps that verify no drafts and verification steps (k + 1 tokens a request, padded)
replayed from their own graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams

from .gpu_helpers import check_same_or_near_tie, save_random_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_random_qwen3(tmp_path_factory.mktemp("qwen3-random-spec"))


def _prompts() -> list[list[int]]:
    """Half random, half a random phrase said three times (something for n-gram to find)."""
    rng = np.random.default_rng(2)
    out = []
    for i in range(24):
        if i % 2:
            out.append(rng.integers(10, 150_000, int(rng.integers(16, 200))).tolist())
        else:
            phrase = rng.integers(10, 150_000, int(rng.integers(6, 40))).tolist()
            out.append(phrase * 3 + phrase[:3])
    return out


def _engine_args(folder: Path, **more) -> dict:
    """Both engines' arguments (bf16, an explicit cache: two engines share the device)."""
    common = dict(model=str(folder), dtype="bfloat16", max_model_len=1024)
    return {**common, "kv_cache_memory_bytes": 4 << 30, **more}


def test_greedy_with_ngram_speculation_matches_without_and_graphs_replay(qwen3_dir: Path):
    common = _engine_args(qwen3_dir, max_num_seqs=32)
    prompts = _prompts()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ids = [{"prompt_token_ids": p} for p in prompts]
    off = LLM(**common)
    on = None
    try:
        want = [o.outputs[0].token_ids for o in off.generate(ids, params, use_tqdm=False)]
        on = LLM(**common, speculative_config=SPEC)
        _check(on, off, prompts, ids, params, want)
    finally:  # the tier runs on in this process: both engines give the device back
        off.engine.shutdown()
        if on is not None:
            on.engine.shutdown()


def _check(on, off, prompts, ids, params, want) -> None:
    runner = on.engine.engine_core.executor.worker.model_runner
    assert runner.decode_graphs is not None
    got = [o.outputs[0].token_ids for o in on.generate(ids, params, use_tqdm=False)]
    stats = on.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert runner.decode_graphs.replays > 0  # steps without drafts still replay graphs
    assert runner.spec.verify_graphs is not None and runner.spec.verify_graphs.replays > 0
    for p, g, w in zip(prompts, got, want):
        check_same_or_near_tie(off, p, w, g)
    # A few requests at a time too (small graph buckets: plain and verification steps
    # alternate), their verifications replayed by the greedy graphs, those of fewer than k
    # drafts included (their rows padded).
    tail = runner.spec.greedy_graphs
    assert tail is not None
    counts, run = [], tail.run

    def counted(hidden, n, num_drafts=None):
        got = run(hidden, n, num_drafts)
        if got is not None:
            counts.append(None if num_drafts is None else num_drafts.tolist())
        return got

    tail.run = counted
    single = [o.outputs[0].token_ids for o in on.generate(ids[:4], params, use_tqdm=False)]
    for p, g, w in zip(prompts[:4], single, want[:4]):
        check_same_or_near_tie(off, p, w, g)
    k = SPEC["num_speculative_tokens"]
    assert counts and any(c is not None and min(c) < k for c in counts), counts


def test_ngram_drafts_on_the_device_launch_ahead_and_match_without(qwen3_dir: Path):
    # ``plugins.ngram.device_drafts`` on the Triton backend (its verification graphs replay as
    # captured): one request at a time, each verification's next drafts looked up on the device
    # and the next verification launched before the step in flight is read.
    common = _engine_args(qwen3_dir, max_num_seqs=4, attention_backend="triton")
    prompts = _prompts()[:6]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ids = [{"prompt_token_ids": p} for p in prompts]
    off = LLM(**common)
    on = None
    try:
        want = [off.generate([i], params, use_tqdm=False)[0].outputs[0].token_ids for i in ids]
        on = LLM(
            **common,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4},
            plugins={"ngram": {"device_drafts": True}},
        )
        got = [on.generate([i], params, use_tqdm=False)[0].outputs[0].token_ids for i in ids]
        runner = on.engine.engine_core.executor.worker.model_runner
        assert runner.spec.ahead_launches > 0
        for p, g, w in zip(prompts, got, want):
            check_same_or_near_tie(off, p, w, g)
    finally:
        off.engine.shutdown()
        if on is not None:
            on.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_history_drafts_written_after_the_read_launch_ahead_and_match_without(
    qwen3_dir: Path, method: str
):
    # A proposer that reads only history, at its defaults (each request's own draft length)
    # on the Triton backend: the next verification is launched before the step in flight is
    # read, and waits on the device for the drafts the host writes once it has read that step
    # (``pagoda.worker.late_drafts``). The runner checks each such step's inputs against those
    # the host builds (the rows of requests with fewer than k drafts included).
    common = _engine_args(qwen3_dir, max_num_seqs=4, attention_backend="triton")
    prompts = _prompts()[:8]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ids = [{"prompt_token_ids": p} for p in prompts]
    off = LLM(**common)
    on = None
    try:
        want = [o.outputs[0].token_ids for o in off.generate(ids, params, use_tqdm=False)]
        on = LLM(**common, speculative_config={"method": method})
        runner = on.engine.engine_core.executor.worker.model_runner
        late = runner.spec.late
        assert late is not None
        runner.spec.check_ahead = True
        counts, release = [], late.release

        def counted(req_ids, proposals):
            counts.extend(len(proposals.get(r, ())) for r in req_ids)
            release(req_ids, proposals)

        late.release = counted
        got = [on.generate([i], params, use_tqdm=False)[0].outputs[0].token_ids for i in ids[:4]]
        got += [o.outputs[0].token_ids for o in on.generate(ids[4:], params, use_tqdm=False)]
        late.check()
        assert late.launches > 0 and len(counts) >= late.launches and late.timeouts == 0
        k = runner.spec.num_spec_tokens
        assert any(c < k for c in counts) and any(c > 0 for c in counts), counts
        for p, g, w in zip(prompts, got, want):
            check_same_or_near_tie(off, p, w, g)
    finally:
        off.engine.shutdown()
        if on is not None:
            on.engine.shutdown()
