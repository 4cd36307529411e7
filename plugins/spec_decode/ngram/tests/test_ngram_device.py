"""``ngram_drafts_device``: the device's prompt lookup gives the host's match lengths and drafts
(``ngram_drafts``: longest match, then one followed by k known tokens, then the most recent),
for histories of few distinct tokens (many matches of every length), short histories, and
windows wider than the history."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pagoda_spec_ngram.device import ngram_drafts_device
from pagoda_spec_ngram.proposer import ngram_drafts, ngram_match

from pagoda import LLM, SamplingParams
from pagoda.testing.verify_graphs import eager_verify_graphs
from pagoda.worker.greedy_verify_graphs import GreedyVerifyGraphs


@pytest.mark.parametrize(("min_n", "max_n", "k"), [(1, 8, 8), (2, 5, 4), (3, 3, 2), (1, 1, 6)])
@pytest.mark.parametrize("vocab", [3, 12])
def test_device_lookup_is_the_hosts(min_n: int, max_n: int, k: int, vocab: int) -> None:
    rng = np.random.default_rng(min_n * 100 + max_n * 10 + k + vocab)
    width = 48
    for n in (1, 3, 9):  # (the host matches up to 4 requests by byte search, more vectorised)
        for _ in range(20):
            tokens = rng.integers(0, vocab, (n, width)).astype(np.int64)
            num = rng.integers(1, width + 1, n).astype(np.int64)
            rows = np.arange(n, dtype=np.int64)
            want = ngram_drafts(tokens, rows, num, min_n, max_n, k)
            _, want_match = ngram_match(tokens, rows, num, min_n, max_n, k)
            drafts, match = ngram_drafts_device(
                torch.from_numpy(tokens), torch.from_numpy(num), min_n, max_n, k
            )
            assert np.array_equal(match.numpy(), want_match), (tokens, num)
            assert np.array_equal(drafts.numpy(), want), (tokens, num)


def test_a_repeated_phrase_drafts_what_followed_it() -> None:
    phrase = [5, 6, 7, 8, 9, 10, 11]
    hist = torch.tensor([phrase + phrase[:3] + [0] * 6])
    drafts, match = ngram_drafts_device(hist, torch.tensor([10]), 1, 8, 4)
    assert match.tolist() == [3] and drafts.tolist() == [[8, 9, 10, 11]]
    # Nothing earlier ends with the last token: no drafts.
    drafts, match = ngram_drafts_device(torch.tensor([[1, 2, 3, 4]]), torch.tensor([4]), 1, 8, 4)
    assert match.tolist() == [0] and drafts.tolist() == [[-1] * 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_lookup_replays_from_a_cuda_graph() -> None:
    # Nothing in it waits for the host or depends on the data's values for its shapes: one
    # capture serves every step of the same window and batch.
    n, width, k = 4, 64, 8
    hist = torch.zeros(n, width, dtype=torch.int64, device="cuda")
    num = torch.ones(n, dtype=torch.int64, device="cuda")
    ngram_drafts_device(hist, num, 1, 8, k)  # warm-up, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drafts, match = ngram_drafts_device(hist, num, 1, 8, k)
    rng = np.random.default_rng(0)
    for _ in range(10):
        tokens = rng.integers(0, 4, (n, width)).astype(np.int64)
        lens = rng.integers(1, width + 1, n).astype(np.int64)
        hist.copy_(torch.from_numpy(tokens))
        num.copy_(torch.from_numpy(lens))
        graph.replay()
        rows = np.arange(n, dtype=np.int64)
        assert np.array_equal(drafts.cpu().numpy(), ngram_drafts(tokens, rows, lens, 1, 8, k))
        assert np.array_equal(match.cpu().numpy(), ngram_match(tokens, rows, lens, 1, 8, k)[1])


def _tiny() -> str:
    from pagoda.bench.random_weights import ensure_random_weights

    tiny = Path(__file__).parents[4] / "benchmarks" / "configs" / "tiny-llama"
    folder, _ = ensure_random_weights(tiny, 0, torch.device("cpu"))
    return str(folder)


@pytest.mark.parametrize("tail", [False, True])
def test_device_drafts_launch_verifications_ahead_and_keep_greedy_output(tail: bool) -> None:
    # ``plugins.ngram.device_drafts``: each verification's next drafts are looked up on the
    # device, and the next verification launches before the step in flight is read. On the
    # CPU the verification "graph" runs the model eagerly over the runner's buffers, and the
    # runner compares each launch's inputs with those the host builds once the step is read
    # (it raises where they differ). Greedy output is that of no speculation.
    engine = dict(model=_tiny(), device="cpu", max_model_len=256, max_num_seqs=4)
    rng = np.random.default_rng(7)
    phrase = rng.integers(10, 300, 9).tolist()
    prompts = [{"prompt_token_ids": phrase * 4}, {"prompt_token_ids": [5, 6, 7] * 8}]
    prompts.append({"prompt_token_ids": rng.integers(10, 300, 30).tolist()})
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**engine).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(**engine, speculative_config=spec, plugins={"ngram": {"device_drafts": True}})
    runner = eager_verify_graphs(llm)
    if tail:
        runner.spec.greedy_graphs = GreedyVerifyGraphs(
            runner.model, runner.buffers.input_ids, runner.spec.verify_graphs, graphs=False
        )
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert got == want
    assert runner.spec.ahead_launches > 0
    assert llm.engine.engine_core.scheduler.spec_stats_total.num_accepted_tokens > 0


def test_without_the_setting_nothing_launches_ahead() -> None:
    llm = LLM(model=_tiny(), device="cpu", max_model_len=256, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    runner = eager_verify_graphs(llm)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7] * 8}], params, use_tqdm=False)
    assert runner.spec.verify_graphs.replays > 0 and runner.spec.ahead_launches == 0
