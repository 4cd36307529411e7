"""Verification steps padded to k + 1 tokens a request, as the CUDA graphs of verification
replay them, give the same greedy tokens as without speculation. On a CPU the graph is stood in
for by an eager forward over the same padded buffers (``DecodeGraphs._pad`` included), so the
layout (pad tokens after each request's real ones, their keys and values in block 0, lengths
that let real tokens see nothing of the pads) is checked without CUDA."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import torch

from pagoda import LLM, SamplingParams
from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.layer import set_forward_context
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.worker.cuda_graph import DecodeGraphs
from pagoda.worker.greedy_verify_graphs import GreedyVerifyGraphs

TINY = Path(__file__).parents[2] / "benchmarks" / "configs" / "tiny-llama"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


class EagerVerifyGraphs(DecodeGraphs):
    """DecodeGraphs whose 'replay' runs the model eagerly on the padded persistent buffers
    (sequence lengths included: ``_pad`` writes the padding's)."""

    def capture(self) -> float:
        self._arange = torch.arange(self.max_batch + 1, dtype=torch.int32)
        self._arange_np = np.arange(self.max_batch + 1)
        return 0.0

    def run(self, common: CommonAttentionMetadata, b: int) -> torch.Tensor:
        r, n, q = self.buffers, common.num_reqs, self.query_len
        self._pad(n, b)
        padded = CommonAttentionMetadata(
            num_reqs=b,
            num_actual_tokens=b * q,
            max_query_len=q,
            max_seq_len=self.max_model_len,
            query_start_loc=r.query_start_loc[: b + 1],
            seq_lens=r.seq_lens[:b],
            block_table=r.block_table[:b],
            slot_mapping=r.slot_mapping[: b * q],
            query_start_loc_cpu=np.arange(b + 1) * q,
            # NOTE: a captured graph reads the lengths on the device (a verification launched
            # ahead has only a bound of them on the host).
            seq_lens_cpu=r.seq_lens[:b].numpy().astype(np.int64),
            block_size=r.block_size,
        )
        with set_forward_context(self.attn_backend.build_metadata(padded)):
            out = self.model(r.input_ids[: b * q], r.positions[: b * q])
        self.replays += 1
        return out[: n * q]


def eager_verify_graphs(runner, query_len: int) -> EagerVerifyGraphs:
    """Stand-ins for ``runner``'s verification graphs, captured (nothing to capture)."""
    graphs = EagerVerifyGraphs(
        runner.model, runner.attn_backend, runner.buffers, runner.max_model_len, query_len
    )
    graphs.capture()
    return graphs


def _greedy_without_speculation(extra: tuple[list[int], ...] = ()) -> tuple:
    """The engines' arguments, the prompts (three random, a repeated phrase, then ``extra``),
    the sampling parameters and the greedy output without speculation."""
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    common = dict(model=str(folder), device="cpu", max_model_len=256, max_num_seqs=8)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(10, 300, int(n)).tolist()} for n in (5, 40, 17)]
    prompts += [{"prompt_token_ids": ids} for ids in ([7, 8, 9, 10] * 6, *extra)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**common).generate(prompts, params, use_tqdm=False)]
    return common, prompts, params, want


def test_padded_verification_steps_keep_greedy_output() -> None:
    common, prompts, params, want = _greedy_without_speculation()
    llm = LLM(**common, speculative_config=SPEC)
    runner = llm.engine.engine_core.executor.worker.model_runner
    runner.spec.verify_graphs = eager_verify_graphs(runner, SPEC["num_speculative_tokens"] + 1)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runner.spec.verify_graphs.replays > 0
    assert llm.engine.engine_core.scheduler.spec_stats_total.num_accepted_tokens > 0
    assert got == want


def test_greedy_graphs_verify_padded_steps_and_keep_greedy_output() -> None:
    # Requests that verify fewer than k drafts (a match near the history's end, a request's
    # own length chosen by the proposer) are verified by the greedy graphs over the padded
    # rows, not by the eager sampler.
    common, prompts, params, want = _greedy_without_speculation(([5, 6] * 3 + [11, 12, 13] * 5,))
    llm = LLM(**common, speculative_config=SPEC)
    runner = llm.engine.engine_core.executor.worker.model_runner
    spec = runner.spec
    k = SPEC["num_speculative_tokens"]
    spec.verify_graphs = eager_verify_graphs(runner, k + 1)
    tail = spec.greedy_graphs = GreedyVerifyGraphs(
        runner.model, runner.buffers.input_ids, spec.verify_graphs, graphs=False
    )
    counts = []
    run = tail.run

    def counted(hidden, n, num_drafts=None):
        counts.append(None if num_drafts is None else num_drafts.tolist())
        return run(hidden, n, num_drafts)

    tail.run = counted
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tail.replays == len(counts) > 0
    assert any(min(c) < k for c in counts), counts  # padded steps went through them


def test_a_runner_with_graphs_goes_with_its_engine_without_a_collection() -> None:
    """The runner holds its graphs, which hold its buffers and its model but never the runner:
    were there a cycle back to it, the runner (its KV cache: on a GPU most of the device) would
    outlive its dropped engine until the interpreter's next full garbage collection."""
    folder, _ = ensure_random_weights(TINY, 0, torch.device("cpu"))
    llm = LLM(model=str(folder), device="cpu", max_model_len=256, speculative_config=SPEC)
    runner = llm.engine.engine_core.executor.worker.model_runner
    runner.spec.verify_graphs = eager_verify_graphs(runner, SPEC["num_speculative_tokens"] + 1)
    llm.generate([{"prompt_token_ids": [7, 8, 9, 10] * 6}], SamplingParams(max_tokens=8))
    gone = weakref.ref(runner)
    gc.disable()
    try:
        del llm, runner
        assert gone() is None
    finally:
        gc.enable()
