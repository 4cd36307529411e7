"""Verification launched ahead (``pagoda.worker.drafts_ahead``): the next verification's inputs
are built on the device from the outcome of the step in flight and its drafts, and the graph
replays before that step is read. On the CPU the verification "graph" here runs the model
eagerly over the runner's buffers (as a replay reads them), and the runner compares each such
step's inputs with those the host builds once the step before is read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from eagle_helpers import TINY_LLAMA, write_random_head
from pagoda_spec_eagle.chain import DenseChain

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.testing.verify_graphs import eager_verify_graphs
from pagoda.worker.greedy_verify_graphs import GreedyVerifyGraphs

ENGINE = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 4, "enable_prefix_caching": False}
K = 3


def _engine(target: str, head: Path | None, tail: bool = True) -> LLM:
    """With ``tail``, all-greedy verifications go through ``GreedyVerifyGraphs`` (run eagerly
    here)."""
    if head is None:
        return LLM(model=target, **ENGINE)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K, "adaptive": False}
    llm = LLM(model=target, **ENGINE, speculative_config=spec)
    runner = eager_verify_graphs(llm)
    spec = runner.spec
    if tail:
        spec.greedy_graphs = GreedyVerifyGraphs(
            runner.model, runner.buffers.input_ids, spec.verify_graphs, graphs=False
        )
    return llm


def _generate(llm: LLM, prompts: list[dict], max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _prompts(n: int) -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"prompt_token_ids": rng.integers(10, 300, 20 + 7 * i).tolist()} for i in range(n)]


@pytest.fixture(scope="module")
def target() -> str:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    return str(folder)


def _zero_norms(llm: LLM) -> None:
    """Target and head pick token 0 always: every draft is accepted."""
    runner = llm.engine.engine_core.executor.worker.model_runner
    with torch.no_grad():
        runner.model.model.norm.weight.zero_()
        runner.proposer.head.norm.weight.zero_()


def test_every_draft_accepted_launches_each_verification_ahead(tmp_path: Path, target: str):
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256)
    llm = _engine(target, head)
    _zero_norms(llm)
    runner = llm.engine.engine_core.executor.worker.model_runner
    out = _generate(llm, _prompts(1))
    assert out == [[0] * 40]
    # 40 tokens, K + 1 a verification: after the prompt's step and the first verification,
    # every verification but the last steps' is launched ahead (the runner checked each
    # one's inputs against the host's).
    assert runner.spec.ahead_launches >= 40 // (K + 1) - 3


def _accepting(tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch, right) -> LLM:
    """An engine whose target and head pick token 0 always, but whose drafts turn to 7 from
    position ``right(call)`` on, for the head's ``call``-th draft: that many are accepted."""
    calls = [0]
    run = DenseChain.run

    def some_wrong(self, b: int) -> torch.Tensor:
        out = run(self, b).clone()
        out[:, right(calls[0]) :] = 7
        calls[0] += 1
        return out

    monkeypatch.setattr(DenseChain, "run", some_wrong)
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256)
    llm = _engine(target, head)
    _zero_norms(llm)
    return llm


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_steps_that_accept_some_drafts_start_the_next_where_they_end(
    tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch, num_prompts: int
):
    """The target picks token 0 always; the head's drafts are 0 up to a point that moves each
    draft (0 to K drafts accepted, by turns), then 7: each verification ahead starts at a
    different offset from the step before."""
    llm = _accepting(tmp_path, target, monkeypatch, lambda call: call % (K + 1))
    runner = llm.engine.engine_core.executor.worker.model_runner
    assert _generate(llm, _prompts(num_prompts)) == [[0] * 40] * num_prompts
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert runner.spec.ahead_launches >= 4


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_random_head_output_is_the_target_s_own(tmp_path: Path, target: str, num_prompts: int):
    reference = _generate(_engine(target, None), _prompts(num_prompts))
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256, std=0.3)
    llm = _engine(target, head)
    runner = llm.engine.engine_core.executor.worker.model_runner
    assert _generate(llm, _prompts(num_prompts)) == reference
    assert runner.spec.ahead_launches > 0


def test_requests_that_end_at_different_steps_keep_their_output(
    tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch
):
    """Requests of different lengths: the steps where one ends or the batch shrinks are not
    launched ahead, and every request's output is the target's own."""
    llm = _accepting(tmp_path, target, monkeypatch, lambda call: 2)  # drafts: 0, 0, then 7
    runner = llm.engine.engine_core.executor.worker.model_runner
    lengths = [13, 40, 27]
    outs = llm.generate(
        _prompts(3),
        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths],
        use_tqdm=False,
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == [[0] * m for m in lengths]
    assert runner.spec.ahead_launches >= 5


def _runner(llm: LLM):
    return llm.engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_greedy_graphs_verify_as_the_eager_sampler(tmp_path: Path, target: str, num_prompts: int):
    """The same engine with all-greedy verifications in ``GreedyVerifyGraphs`` and in the
    sampler and rejection sampler: the same tokens, and the same acceptance."""
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256, std=0.3)
    got = {}
    for tail in (True, False):
        llm = _engine(target, head, tail=tail)
        got[tail] = _generate(llm, _prompts(num_prompts))
        stats = llm.engine.engine_core.scheduler.spec_stats_total
        got[tail, "accepted"] = (stats.num_draft_tokens, stats.num_accepted_tokens)
        tail_runs = _runner(llm).spec.greedy_graphs.replays if tail else 0
        assert (tail_runs > 0) == tail
    assert got[True] == got[False] == _generate(_engine(target, None), _prompts(num_prompts))
    assert got[True, "accepted"] == got[False, "accepted"]


def test_greedy_graphs_take_the_accepted_counts_of_each_step(
    tmp_path: Path, target: str, monkeypatch: pytest.MonkeyPatch
):
    """0 to K drafts accepted by turns, all through ``GreedyVerifyGraphs``: each step's emitted
    tokens, the next step's start (launched ahead) and the proposer's hidden rows follow its
    count."""
    llm = _accepting(tmp_path, target, monkeypatch, lambda call: call % (K + 1))
    runner = _runner(llm)
    assert _generate(llm, _prompts(2)) == [[0] * 40] * 2
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert runner.spec.greedy_graphs.replays >= 10


@pytest.mark.parametrize(
    "setting", [{"logprobs": 2}, {"presence_penalty": 0.5}, {"min_tokens": 20}]
)
def test_steps_the_argmax_alone_does_not_verify_skip_the_greedy_graphs(
    tmp_path: Path, target: str, setting: dict
):
    """Logprobs, a penalty or a minimum length: the sampler verifies (not
    ``GreedyVerifyGraphs``), and the output is the target's own."""
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256, std=0.3)
    params = SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, **setting})
    want = [o.outputs[0] for o in _engine(target, None).generate(_prompts(2), params)]
    llm = _engine(target, head)
    got = [o.outputs[0] for o in llm.generate(_prompts(2), params, use_tqdm=False)]
    assert [list(o.token_ids) for o in got] == [list(o.token_ids) for o in want]
    assert _runner(llm).spec.greedy_graphs.replays == 0
    assert llm.engine.engine_core.scheduler.spec_stats_total.num_draft_tokens > 0
