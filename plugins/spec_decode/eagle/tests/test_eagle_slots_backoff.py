"""With draft slots (every step at batch 1), a head whose drafts miss pauses drafting
(``SpeculativeProposer.resume_at``), and the runner then launches the steps with slots without
waiting for the step in flight (the slots stay empty): a random head costs plain decode steps,
not a host wait each, and greedy output is unchanged."""

from __future__ import annotations

from pathlib import Path

import torch
from eagle_helpers import TINY_LLAMA, write_random_head

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.config import SpeculativeConfig
from pagoda.worker import draft_slots

ENGINE = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 1}


def test_paused_requests_slots_do_not_wait_for_the_step_in_flight(
    tmp_path: Path, monkeypatch
) -> None:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    prompt = [{"prompt_token_ids": list(range(20, 45))}]
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(folder), **ENGINE).generate(prompt, params, use_tqdm=False)
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256, std=0.3)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    if "adaptive" in SpeculativeConfig.model_fields:  # the drafts' own back-off, no governor
        spec["adaptive"] = False
    llm = LLM(model=str(folder), **ENGINE, speculative_config=spec)
    runner = llm.engine.engine_core.executor.worker.model_runner
    skipped, reads = [], []
    paused = draft_slots.paused

    def spy_paused(*args) -> bool:
        skipped.append(paused(*args))
        return skipped[-1]

    read = runner.in_flight.read_all

    def spy_read() -> None:
        reads.append(1)
        read()

    monkeypatch.setattr(draft_slots, "paused", spy_paused)
    runner.in_flight.read_all = spy_read
    got = llm.generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert sum(skipped) > 40  # launches with slots that did not wait
    assert len(reads) < 30  # of about 80 steps
