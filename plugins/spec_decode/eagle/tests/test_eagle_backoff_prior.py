"""A head whose drafts miss on every text (a random head) pauses drafting for each request; a
new request starts from the pause the last one reached (after two probes), not from the ramp
1, 2, 4 .., so such a head drafts a few times a request, not a dozen; greedy output is the
same either way, and a head whose drafts land starts every request drafting."""

from __future__ import annotations

from pathlib import Path

import torch
from eagle_helpers import TINY_LLAMA, write_random_head
from pagoda_spec_eagle.proposer import _Backoff

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights

ENGINE = {"device": "cpu", "max_model_len": 512, "max_num_seqs": 1}


def test_later_requests_of_a_missing_head_draft_less(tmp_path: Path) -> None:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    prompts = [{"prompt_token_ids": list(range(20 + i, 45 + i))} for i in range(4)]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    plain = LLM(model=str(folder), **ENGINE)
    want = [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    plain.engine.shutdown()
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256, std=0.3)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(folder), **ENGINE, speculative_config=spec)
    sched = llm.engine.engine_core.scheduler
    proposer = llm.engine.engine_core.executor.worker.model_runner.proposer
    calls = []
    draft = proposer._draft

    def counted(batch, sel, *args):
        calls.append(len(sel))
        return draft(batch, sel, *args)

    proposer._draft = counted  # the head's drafting runs (on the host's schedule)
    drafts = []
    for p, w in zip(prompts, want):
        before = len(calls)
        got = llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == w
        drafts.append(len(calls) - before)
    assert sched.spec_stats_total.num_accepted_tokens == 0  # the head never lands a draft
    assert proposer.start_pause == 64
    assert drafts[0] >= 8  # the first request ramps its pause up: 1, 2, 4 .. 64
    assert all(n <= 6 for n in drafts[1:]), drafts  # later ones: two probes, then every 64


def test_a_landing_draft_brings_the_start_back_to_drafting_every_step() -> None:
    st = _Backoff(start_pause=64)
    assert st.should_draft(10)  # first probe
    st.drafted(torch.tensor([7]).numpy(), 10)
    st.score(torch.tensor(list(range(10)) + [7]).numpy(), 11)  # the target's token 10 was 7
    assert st.misses == 0 and st.pause == 1
