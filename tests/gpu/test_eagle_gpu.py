"""On a GPU: greedy output with an EAGLE-3 or EAGLE head (random values, published layouts)
equals greedy output without speculation on a random-weight Qwen3-0.6B in bf16 (except at
near-ties), with the target's decode and verification CUDA graphs replayed (the head's hidden
states are copied inside the graphs), all-greedy verifications of small batches replayed from
their graphs too (``GreedyVerifyGraphs``, checked against the same operations run eagerly) and the
head's own drafts replayed from its graphs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams

from .gpu_helpers import CONFIGS, check_same_or_near_tie, save_random_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
eagle = pytest.importorskip("pagoda_spec_eagle.checkpoint")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_random_qwen3(tmp_path_factory.mktemp("qwen3-random-eagle"))


COMMON = dict(dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=2 << 30, max_num_seqs=8)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [rng.integers(10, 150_000, int(rng.integers(8, 300))).tolist() for _ in range(8)]


PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(qwen3_dir: Path):
    off = LLM(model=str(qwen3_dir), **COMMON)
    ids = [{"prompt_token_ids": p} for p in _prompts()]
    yield off, [o.outputs[0].token_ids for o in off.generate(ids, PARAMS, use_tqdm=False)]
    off.engine.shutdown()


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_greedy_with_an_eagle_head_matches_without_on_cuda(
    qwen3_dir: Path, reference, tmp_path, kind
):
    off, want = reference
    cfg = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    dv = 32000 if kind == "eagle3" else None
    head_cfg = eagle.llama_head_config(kind, h, 3 * h, 16, 8, vocab, head_dim=128,
                                       draft_vocab_size=dv)  # fmt: skip
    d2t = 4 * torch.arange(dv) - torch.arange(dv) if dv else None  # every fourth target id
    eagle.write_head(tmp_path / kind, head_cfg, eagle.random_head_weights(head_cfg, 0, d2t))
    prompts = _prompts()
    ids = [{"prompt_token_ids": p} for p in prompts]
    spec = {"method": kind, "model": str(tmp_path / kind), "num_speculative_tokens": 4}
    on = LLM(model=str(qwen3_dir), **COMMON, speculative_config=spec)
    try:
        _check(on, off, prompts, ids, want)
    finally:
        on.engine.shutdown()


def _cross_check_tail(runner) -> list[int]:
    """Each greedy verification replayed as a graph (``GreedyVerifyGraphs``) is also computed
    eagerly on the same rows, before the replay, and must give the same tokens, counts and rows;
    the batch sizes it verified."""
    tail = runner.spec.greedy_graphs
    assert tail is not None and tail.graphs
    run, seen = tail.run, []

    def checked(hidden, n, num_drafts=None):
        eager = None
        if hidden.shape[0] == n * tail.q:  # (the counts the replay reads, set first)
            if num_drafts is None:
                tail._num_drafts[:n].fill_(tail.q - 1)
            else:
                tail._num_drafts[:n].copy_(num_drafts)
            eager = tail._compute(hidden, n)
        got = run(hidden, n, num_drafts)
        if got is not None:
            names = ("tokens", "num_emitted", "last_token", "last_hidden")
            for name, a, b in zip(names, (got.tokens, got.num_emitted, got.last_token,
                                          got.last_hidden), eager):  # fmt: skip
                assert torch.equal(a, b), f"the greedy graphs' {name} differ from eager"
            seen.append(n)
        return got

    tail.run = checked
    return seen


def _check(on, off, prompts, ids, want) -> None:
    runner = on.engine.engine_core.executor.worker.model_runner
    tail_batches = _cross_check_tail(runner)
    got = [o.outputs[0].token_ids for o in on.generate(ids, PARAMS, use_tqdm=False)]
    assert on.engine.engine_core.scheduler.spec_stats_total.num_draft_tokens > 0
    assert tail_batches, "no greedy verification went through the greedy graphs"
    assert runner.spec.verify_graphs is not None and runner.spec.verify_graphs.replays > 0
    for p, g, w in zip(prompts, got, want):
        check_same_or_near_tie(off, p, w, g)
    # One request at a time: decoding steps draft through the fixed-shape CUDA graph.
    chain = runner.proposer.chain
    assert chain is not None and chain.graphs
    replays = chain.replays
    single = [o.outputs[0].token_ids for o in on.generate(ids[:2], PARAMS, use_tqdm=False)]
    for p, g, w in zip(prompts[:2], single, want[:2]):
        check_same_or_near_tie(off, p, w, g)
    assert chain.replays > replays


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_verifications_launched_ahead_build_the_inputs_the_host_would(
    qwen3_dir: Path, tmp_path, monkeypatch, num_prompts
):
    """With the Triton backend the next verification's inputs are built on the device and its
    graph replays before the step in flight is read (``pagoda.worker.drafts_ahead``). Both final
    norms are zero, so target and head pick token 0; the head's drafts turn wrong from a point
    that moves each draft (0 to 4 accepted, by turns). The runner checks each such step's
    inputs (ids, positions, slots, lengths) against those the host builds after the read."""
    from pagoda_spec_eagle.chain import DenseChain

    calls = [0]
    run = DenseChain.run

    def some_wrong(self, b):
        out = run(self, b).clone()
        out[:, calls[0] % 5 :] = 7
        calls[0] += 1
        return out

    monkeypatch.setattr(DenseChain, "run", some_wrong)
    cfg = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    head_cfg = eagle.llama_head_config("eagle3", h, 3 * h, 16, 8, vocab, head_dim=128,
                                       draft_vocab_size=32000)  # fmt: skip
    d2t = torch.zeros(32000, dtype=torch.int64)  # draft id d is target id d
    eagle.write_head(tmp_path / "h", head_cfg, eagle.random_head_weights(head_cfg, 0, d2t))
    spec = {"method": "eagle3", "model": str(tmp_path / "h"), "num_speculative_tokens": 4,
            "adaptive": False}  # fmt: skip
    on = LLM(model=str(qwen3_dir), **COMMON, attention_backend="triton", speculative_config=spec)
    try:
        runner = on.engine.engine_core.executor.worker.model_runner
        runner.spec.check_ahead = True
        with torch.no_grad():
            runner.model.model.norm.weight.zero_()
            runner.proposer.head.norm.weight.zero_()
        ids = [{"prompt_token_ids": p} for p in _prompts()[:num_prompts]]
        got = [o.outputs[0].token_ids for o in on.generate(ids, PARAMS, use_tqdm=False)]
        assert got == [[0] * PARAMS.max_tokens] * num_prompts
        stats = on.engine.engine_core.scheduler.spec_stats_total
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert runner.spec.ahead_launches >= 3
    finally:
        on.engine.shutdown()
