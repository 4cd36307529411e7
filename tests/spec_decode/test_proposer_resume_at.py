"""A proposer's back-off through ``resume_at``: the runner does not ask it for a request until
the request knows that many tokens, and keeps the request's hidden states meanwhile, so that
the call after a pause receives every position computed since the last call (the same rows, in
the same order, as a proposer asked every step)."""

from __future__ import annotations

import numpy as np
import torch
from test_verify_graph_layout import TINY

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.spec_decode import Drafts, ProposalBatch, SpeculativeProposer
from pagoda.testing import plugin_registered

PAUSE = 5


class _Spy(SpeculativeProposer):
    """Drafts nothing; keeps every row it receives, by request, from position 0 on."""

    needs_hidden_states = True
    pause = 0

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.ends: dict[str, int] = {}
        self.calls = 0  # requests asked

    def propose(self, batch: ProposalBatch) -> Drafts:
        self.calls += len(batch)
        m = np.diff(batch.hidden_loc)
        for i, req_id in enumerate(batch.req_ids):
            first = int(batch.num_tokens[i]) - 1 - int(m[i])
            assert self.ends.get(req_id, 0) == first, "a gap in the hidden states"
            self.ends[req_id] = first + int(m[i])
            rows = batch.new_hidden_states[batch.hidden_loc[i] : batch.hidden_loc[i + 1]]
            self.rows.setdefault(req_id, []).append(rows.clone())
            if self.pause:
                self.resume_at[req_id] = int(batch.num_tokens[i]) + self.pause
        return Drafts.empty(len(batch))


class _Pausing(_Spy):
    pause = PAUSE


class _Plugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_spec_proposers(self, register) -> None:
        register("spy-every-step", _Spy)
        register("spy-pausing", _Pausing)


def _run(method: str):
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    with plugin_registered(_Plugin(), "pagoda-test-resume-at"):
        llm = LLM(
            model=str(folder), device="cpu", max_model_len=256, max_num_seqs=4,
            max_num_batched_tokens=32,
            speculative_config={"method": method, "num_speculative_tokens": 2,
                                "adaptive": False},  # every step drafts: no governor
        )  # fmt: skip
        rng = np.random.default_rng(2)
        prompts = [{"prompt_token_ids": rng.integers(10, 300, n).tolist()} for n in (7, 40, 19)]
        params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    proposer = llm.engine.engine_core.executor.worker.model_runner.proposer
    by_prompt = {o.request_id: i for i, o in enumerate(outs)}
    rows = {by_prompt[r]: torch.cat(parts) for r, parts in proposer.rows.items()}
    return [o.outputs[0].token_ids for o in outs], rows, proposer


def test_a_paused_request_is_not_asked_and_gets_every_row_after():
    want, every, asked = _run("spy-every-step")
    got, paused, pausing = _run("spy-pausing")
    assert got == want
    assert pausing.calls < asked.calls / 2
    assert sorted(paused) == sorted(every) == [0, 1, 2]
    for i in every:
        # Every position but the ones after the last call (still kept by the runner).
        n = len(paused[i])
        assert n > len(every[i]) - PAUSE - 1
        torch.testing.assert_close(paused[i], every[i][:n])
