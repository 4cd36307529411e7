"""The hidden states a proposer asks for (EAGLE-3's three layers, copied inside the target's
forward) reach it the same whether verification steps run eagerly or as padded verification
graphs (emulated on the CPU: pad rows sit between requests in the copied buffer, and the feed
must skip them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_verify_graph_layout import TINY, eager_verify_graphs

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights

eagle = pytest.importorskip("pagoda_spec_eagle.checkpoint")

K = 3


def _run(folder: Path, head: Path, graphs: bool):
    common = dict(model=str(folder), device="cpu", max_model_len=256, max_num_seqs=8)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    llm = LLM(**common, speculative_config=spec)
    runner = llm.engine.engine_core.executor.worker.model_runner
    if graphs:
        runner.spec.verify_graphs = eager_verify_graphs(runner, K + 1)
    seen = []
    propose = runner.proposer.propose

    def spy(batch):
        seen.append((batch.num_tokens.copy(), batch.hidden_loc.copy(), batch.new_hidden_states))
        return propose(batch)

    runner.proposer.propose = spy
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(10, 300, int(n)).tolist()} for n in (9, 30, 21)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return out, seen, runner


def test_hidden_rows_from_verification_graphs_equal_the_eager_ones(tmp_path: Path) -> None:
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    cfg = eagle.llama_head_config("eagle3", 64, 128, 4, 2, 1024, draft_vocab_size=512)
    eagle.write_head(tmp_path / "head", cfg, eagle.random_head_weights(cfg, 0, std=0.3))
    want, eager_rows, _ = _run(folder, tmp_path / "head", graphs=False)
    got, graph_rows, runner = _run(folder, tmp_path / "head", graphs=True)
    assert runner.spec.verify_graphs.replays > 0
    assert got == want
    assert len(graph_rows) == len(eager_rows) > 3
    for (n_a, loc_a, h_a), (n_b, loc_b, h_b) in zip(eager_rows, graph_rows):
        assert np.array_equal(n_a, n_b) and np.array_equal(loc_a, loc_b)
        assert h_a.shape == h_b.shape and h_a.shape[1] == 3 * 64
        torch.testing.assert_close(h_a, h_b)
