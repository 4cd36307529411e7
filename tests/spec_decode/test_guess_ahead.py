"""Verifications launched ahead with drafts a history proposer guessed
(``SpeculativeProposer.guess_ahead``, ``pagoda.worker.drafts_ahead``): while a step that verifies
drafts is in flight, n-gram and suffix guess the next step's drafts as if it accepts them all,
and the next verification is built on the device and launched before the step is read. On a CPU
the verification "graphs" run eagerly over the runner's buffers
(``pagoda.testing.verify_graphs``), and the runner compares each launch's inputs with those the
host builds once the step before is read. Output is the target's own whether guesses hold or not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.testing.verify_graphs import eager_verify_graphs

TINY_LLAMA = Path(__file__).parents[2] / "benchmarks" / "configs" / "tiny-llama"
ENGINE = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 4, "enable_prefix_caching": False}
K = 3
METHODS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": K, "adaptive": False},
}


@pytest.fixture(scope="module")
def target() -> str:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    return str(folder)


def _prompts(n: int) -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"prompt_token_ids": rng.integers(10, 300, 20 + 7 * i).tolist()} for i in range(n)]


def _generate(llm: LLM, prompts: list[dict], max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _engine(target: str, method: str | None, zero_norm: bool = False):
    if method is None:
        llm = LLM(model=target, **ENGINE)
        runner = llm.engine.engine_core.executor.worker.model_runner
    else:
        llm = LLM(model=target, **ENGINE, speculative_config=METHODS[method])
        runner = eager_verify_graphs(llm)
    if zero_norm:  # the target picks token 0 always: every draft of zeros is accepted
        with torch.no_grad():
            runner.model.model.norm.weight.zero_()
    return llm, runner


@pytest.mark.parametrize("method", list(METHODS))
def test_guessed_drafts_that_hold_launch_each_verification_ahead(target: str, method: str):
    llm, runner = _engine(target, method, zero_norm=True)
    assert _generate(llm, _prompts(1)) == [[0] * 40]
    # After the prompt's step, the first steps that find the repetition and the first
    # verification, nearly every verification is launched ahead of the step before it.
    assert runner.spec.ahead_launches >= 40 // (K + 1) - 4, runner.spec.ahead_launches


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("num_prompts", [1, 3])
def test_output_is_the_target_s_own_with_guesses_ahead(target: str, method: str, num_prompts):
    reference = _generate(_engine(target, None)[0], _prompts(num_prompts))
    llm, runner = _engine(target, method)
    assert _generate(llm, _prompts(num_prompts)) == reference


@pytest.mark.parametrize("method", list(METHODS))
def test_wrong_guesses_are_rejected_and_cost_only_their_step(
    target: str, method: str, monkeypatch: pytest.MonkeyPatch
):
    """Every guess is wrong (the token after the drafts, and the drafts, are 7 where the target
    picks 0): each verification launched ahead accepts nothing and adds the target's token."""
    llm, runner = _engine(target, method, zero_norm=True)
    cls = type(runner.spec.proposer)
    guess = cls.guess_ahead

    def wrong(self, batch):
        got = guess(self, batch)
        return None if got is None else np.where(got >= 0, 7, got)

    monkeypatch.setattr(cls, "guess_ahead", wrong)
    assert _generate(llm, _prompts(2)) == [[0] * 40] * 2
    assert runner.spec.ahead_launches > 0
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    # A guess whose premise failed (the step before did not sample the guessed token) is not
    # guessed from again: at most every other verification is launched ahead.
    assert runner.spec.ahead_launches <= stats.num_drafts // 2 + 2, (
        runner.spec.ahead_launches,
        stats.num_drafts,
    )


def test_guesses_are_not_built_on_guesses_that_failed(target: str, monkeypatch):
    """The target picks token 0 always, the proposer's own drafts are zeros, and its guesses
    guess the right token after the drafts but wrong drafts after it (7s). A guess made while a
    wrong guess is in flight would be built on those 7s; with the premise checked, each
    verification after a wrong guess waits and drafts zeros again, so half the steps accept
    everything."""
    llm, runner = _engine(target, "ngram", zero_norm=True)
    cls = type(runner.spec.proposer)
    guess = cls.guess_ahead
    seen = []

    def wrong_after_first(self, batch):
        got = guess(self, batch)
        if got is None:
            return None
        seen.append(batch.token_ids[batch.rows, batch.num_tokens - 1].tolist())
        return np.where(got[:, :1] >= 0, np.where(np.arange(got.shape[1]) == 0, got, 7), got)

    monkeypatch.setattr(cls, "guess_ahead", wrong_after_first)
    assert _generate(llm, _prompts(1)) == [[0] * 40]
    assert runner.spec.ahead_launches > 0
    # No guess was asked from a history that ends with a failed guess's drafts.
    assert all(t != [7] for t in seen), seen


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_only_the_method_set_launches_ahead_too(target: str, method: str):
    """At the defaults (the proposer chooses each request's draft length, up to 8): the steps
    whose drafts fill all 8 slots launch ahead, and the output is the target's own."""
    llm = LLM(model=target, **ENGINE, speculative_config={"method": method})
    runner = eager_verify_graphs(llm)
    with torch.no_grad():
        runner.model.model.norm.weight.zero_()
    assert _generate(llm, _prompts(2), 60) == [[0] * 60] * 2
    assert runner.spec.ahead_launches > 0
