"""While the speculation governor has drafting off, a draft head is not asked (its drafts would
be scheduled nowhere, and a catch-up draft costs several plain steps); the target's hidden
states wait in the runner's feed, at most ``HiddenFeed.max_hold`` positions a request, and the
head catches up on them once drafting is back on. Greedy output is unchanged throughout."""

from __future__ import annotations

from pathlib import Path

import torch
from eagle_helpers import TINY_LLAMA, write_random_head
from pagoda_spec_eagle.proposer import EagleProposer

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights

ENGINE = {"device": "cpu", "max_model_len": 512, "max_num_seqs": 1, "async_scheduling": True}


class _Switch:
    """A governor stand-in: drafting on for ``on`` steps, then off for the rest."""

    fixed = False

    def __init__(self, on: int) -> None:
        self.on, self.steps = on, 0

    def drafting(self, num_running: int) -> bool:
        self.steps += 1
        return self.steps <= self.on

    def observe(self, *args, **kwargs) -> None: ...

    def admit(self, num_requests: int) -> None: ...

    def idle(self) -> None: ...


def test_a_head_is_not_asked_while_drafting_is_off(tmp_path: Path, monkeypatch) -> None:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    prompt = [{"prompt_token_ids": list(range(20, 60))}]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(folder), **ENGINE).generate(prompt, params, use_tqdm=False)
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(model=str(folder), **ENGINE, speculative_config=spec)
    core = llm.engine.engine_core
    core.scheduler.spec_governor = _Switch(on=30)
    runner = core.executor.worker.model_runner
    feed = runner.hidden_feed
    asked, held = [], []
    propose = EagleProposer.propose

    def spy_propose(self, batch):
        asked.append(core.scheduler.spec_governor.steps)
        return propose(self, batch)

    monkeypatch.setattr(EagleProposer, "propose", spy_propose)
    hold = feed.hold

    def spy_hold(*args, **kwargs) -> None:
        hold(*args, **kwargs)
        held.append(max((n for _, _, n in feed.pending.values()), default=0))

    feed.hold = spy_hold
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert asked and max(asked) <= 32, asked  # asked while drafting was on (a step's lag)
    assert len(held) > 150 and max(held) == feed.max_hold  # bounded while off
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1
