"""``pagoda.worker.warm_steps``: the start-up's steps over a cached context are the steps the
module note names (each query length over one block and over the longest context, its tokens'
slots in the blocks its table names), they leave the step buffers' block table as they found it,
and they change nothing a request then sees (greedy tokens equal a fresh engine's)."""

from __future__ import annotations

from pathlib import Path

from pagoda import LLM, SamplingParams
from pagoda.worker import warm_steps

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "tiny-llama"


def _engine() -> LLM:
    return LLM(
        model=str(CONFIG), load_format="dummy", device="cpu", dtype="float32", max_model_len=256
    )


def _runner(llm: LLM):
    return llm.engine.engine_core.executor.worker.model_runner


def test_each_query_length_runs_over_one_block_and_the_longest_context() -> None:
    llm = _engine()
    runner = _runner(llm)
    backend = runner.attn_backend
    seen = []

    class Recording(backend):  # the backend's own metadata, each step's shape noted
        @classmethod
        def build_metadata(cls, common):
            bt = common.block_table.cpu().numpy()
            slots = common.slot_mapping.cpu().numpy()
            seq = int(common.seq_lens_cpu[0])
            q = common.num_actual_tokens
            pos = range(seq - q, seq)
            bs = common.block_size
            assert list(slots) == [int(bt[0, p // bs]) * bs + p % bs for p in pos]
            assert 0 not in bt[0, : -(-seq // bs)]  # never the null block
            seen.append((q, seq - q))
            return backend.build_metadata(common)

    num_blocks = runner.kv_caches[0].shape[1]
    steps, _ = warm_steps.warm_context_steps(
        runner.model, Recording, runner.buffers, runner.max_model_len, num_blocks
    )
    bs = runner.block_size
    longest = min(256, (num_blocks - 1) * bs)
    want = [
        (q, c)
        for q in warm_steps.QUERY_LENS
        for c in dict.fromkeys((bs, longest - q))
        if 1 <= c and c + q <= longest
    ]
    assert seen == want and steps == len(want)
    assert not runner.buffers.block_table.any()


def test_a_request_after_them_sees_what_a_fresh_engine_gives() -> None:
    prompt = {"prompt_token_ids": list(range(20, 90))}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    fresh = _engine()
    want = fresh.generate(prompt, greedy)[0].outputs[0].token_ids
    warmed = _engine()
    runner = _runner(warmed)
    warm_steps.warm_context_steps(
        runner.model,
        runner.attn_backend,
        runner.buffers,
        runner.max_model_len,
        runner.kv_caches[0].shape[1],
    )
    assert warmed.generate(prompt, greedy)[0].outputs[0].token_ids == want


def test_a_cache_of_few_blocks_gets_no_step_past_them() -> None:
    """With 4 blocks of 16 slots (the null block and 3), only steps that fit 48 tokens run."""
    llm = _engine()
    runner = _runner(llm)
    backend = runner.attn_backend
    seen = []

    class Recording(backend):
        @classmethod
        def build_metadata(cls, common):
            seen.append(int(common.seq_lens_cpu[0]))
            return backend.build_metadata(common)

    steps, _ = warm_steps.warm_context_steps(
        runner.model, Recording, runner.buffers, runner.max_model_len, 4
    )
    bs = runner.block_size
    assert steps == len(seen) > 0
    assert max(seen) <= 3 * bs


def test_the_lm_head_is_warmed_for_each_row_count_in_order_within_its_arithmetic() -> None:
    import torch

    shapes = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        shapes.append((tuple(h.shape), h.dtype))
        return h.new_zeros(h.shape[0], 10)

    # 2 * 4 * 10 = 80 per row: counts 1 to 4 add up to 800, count 5 would pass it
    warmed, _ = warm_steps.warm_logits_rows(
        compute_logits, 4, 10, 9, torch.float16, torch.device("cpu"), max_flops=800
    )
    assert warmed == 4
    assert shapes == [((n, 4), torch.float16) for n in (1, 2, 3, 4)]
    shapes.clear()
    warmed, _ = warm_steps.warm_logits_rows(
        compute_logits, 4, 10, 3, torch.float16, torch.device("cpu"), max_flops=1e9
    )
    assert warmed == 3 and [s[0][0] for s in shapes] == [1, 2, 3]


def test_the_rows_a_step_may_score_count_each_requests_drafts_within_the_budget() -> None:
    assert warm_steps.logits_rows(256, 8192) == 256
    assert warm_steps.logits_rows(256, 8192, 8) == 256 * 9
    assert warm_steps.logits_rows(256, 1024, 8) == 1024


def test_a_cpu_engine_warms_no_row_counts() -> None:
    # (the stall it avoids is a GPU library's; a CPU start-up pays nothing for it)
    assert _runner(_engine()).logits_rows_warmed == 0
