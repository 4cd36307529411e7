"""KV offload in a running engine (CPU tier, tiny random model): with a KV cache too small for a
set of long shared prefixes, greedy output with offload on equals output with it off, token
for token, while the CPU pool serves the hits; afterwards both pools are idle (no block held,
no slot pinned, no copy in flight), also when a request is aborted while it loads. A third
party's medium (blocks in a file on disk, copied by a thread) passes the same test."""

from __future__ import annotations

import random
import tempfile
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.kv_offload import KVTransfers, OffloadMedium
from pagoda.plugins import plugin_registered
from pagoda.request import RequestStatus
from pagoda.spec_decode import Drafts, SpeculativeProposer

NUM_PREFIXES, PREFIX_LEN = 4, 192
IDLE = {"pinned_slots": 0, "storing_slots": 0, "jobs_in_flight": 0, "requests_loading": 0}


def _prefixes() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]


def _engine(model: Path, **offload) -> LLM:
    # 32 usable blocks of 16 tokens: under three of the four 192-token prefixes.
    return LLM(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=33,
        max_num_seqs=4,
        **offload,
    )


def _workload(llm: LLM) -> list[list[int]]:
    """Each prefix with a new question, one request at a time, twice round (each prefix comes
    back after the others pushed it out of the device cache); then all at once."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for rnd in range(2):
        for i, p in enumerate(_prefixes()):
            prompt = {"prompt_token_ids": p + [5 + rnd, 7 + i]}
            outs.append(llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids)
    burst = [{"prompt_token_ids": p + [9, 11 + i]} for i, p in enumerate(_prefixes())]
    outs += [o.outputs[0].token_ids for o in llm.generate(burst, sp, use_tqdm=False)]
    return outs


def _assert_idle(llm: LLM) -> None:
    core = llm.engine.engine_core
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1 and not kv.req_to_blocks
    offload = core.scheduler.offload
    if offload is not None:
        assert offload.idle_figures() == IDLE
        assert core.executor.worker.model_runner.kv_offload.num_in_flight == 0
        assert not core.scheduler.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    llm = _engine(tiny_model)
    outs = _workload(llm)
    _assert_idle(llm)
    return outs


@pytest.mark.parametrize(("policy", "store"), [("lru", "evicted"), ("arc", "full")])
def test_greedy_output_with_offload_equals_without_while_the_cpu_pool_serves_hits(
    tiny_model: Path, reference: list[list[int]], policy: str, store: str
) -> None:
    llm = _engine(tiny_model, cpu_offload_gb=0.01, offload_policy=policy, offload_store=store)
    offload = llm.engine.engine_core.scheduler.offload
    assert _workload(llm) == reference
    stats = offload.stats_total
    # The second round and the burst find every prefix's 12 blocks in the CPU pool, except the
    # one or two the device still holds.
    assert stats.loaded_blocks >= 12 * 4 and stats.cpu_hit_tokens == 16 * stats.loaded_blocks
    assert stats.stored_blocks >= 12 * NUM_PREFIXES
    _assert_idle(llm)


def test_scheduler_stats_carry_the_offload_figures_into_the_pagoda_metrics(
    tiny_model: Path,
) -> None:
    from pagoda.engine.core_proc import _StatsTracker
    from pagoda.engine.metrics import EngineMetrics

    llm = _engine(tiny_model, cpu_offload_gb=0.01)
    tracker = _StatsTracker()
    tracker.core = llm.engine.engine_core
    metrics = EngineMetrics("tiny")
    tracker.make()  # start from zero
    _workload(llm)
    stats = tracker.make()
    metrics.record([], stats)
    text = metrics.render().decode()
    total = llm.engine.engine_core.scheduler.offload.stats_total

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    assert value("pagoda:kv_offload_loaded_blocks_total") == total.loaded_blocks > 0
    assert value("pagoda:kv_offload_stored_blocks_total") == total.stored_blocks > 0
    assert value("pagoda:cpu_prefix_cache_hits_total") == total.cpu_hit_tokens > 0
    gpu_hits = value("pagoda:prefix_cache_hits_total")
    queries = value("pagoda:prefix_cache_queries_total")
    # The split: device hits and CPU hits are separate shares of the same queries.
    assert 0 < (gpu_hits + total.cpu_hit_tokens) / queries <= 1
    assert 0 < value("pagoda:kv_offload_cpu_usage_perc") <= 1


def test_a_request_aborted_while_it_loads_leaves_no_block_or_pin_behind(tiny_model: Path) -> None:
    llm = _engine(tiny_model, cpu_offload_gb=0.01)
    engine, sp = llm.engine, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefixes = _prefixes()
    for i, p in enumerate(prefixes):  # fill the CPU pool: the first prefixes are evicted
        llm.generate({"prompt_token_ids": p + [1, i]}, sp, use_tqdm=False)
    sched = engine.engine_core.scheduler
    engine.add_request("victim", {"prompt_token_ids": prefixes[0] + [2, 2]}, sp)
    engine.add_request("other", {"prompt_token_ids": prefixes[0] + [2, 3]}, sp)
    so = sched.schedule()  # both load the first prefix (each its own copy); nothing computes
    assert set(sched.offload.loading) == {"victim", "other"} and so.kv_transfers.load_cpu
    engine.abort_request(["victim"])
    assert "victim" not in sched.requests and "victim" not in sched.offload.loading
    # The step that ran the loads never came back; run it now, then the rest.
    runner_out = engine.engine_core.executor.execute_model(so)
    sched.update_from_output(so, runner_out)
    while engine.has_unfinished_requests():
        engine.step()
    assert sched.offload.stats_total.loaded_blocks == 24
    assert sched.requests == {} and RequestStatus.FINISHED_ABORTED.is_finished
    _assert_idle(llm)


def test_a_loading_request_waits_and_counts_loaded_tokens_only_once_its_copy_is_done(
    tiny_model: Path,
) -> None:
    llm = _engine(tiny_model, cpu_offload_gb=0.01)
    engine, sp = llm.engine, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prefixes = _prefixes()
    for i, p in enumerate(prefixes):
        llm.generate({"prompt_token_ids": p + [1, i]}, sp, use_tqdm=False)
    core, sched = engine.engine_core, engine.engine_core.scheduler
    engine.add_request("r", {"prompt_token_ids": prefixes[0] + [2, 2]}, sp)
    req = sched.requests["r"]
    so1 = sched.schedule()
    assert "r" not in so1.num_scheduled_tokens and so1.kv_transfers.job_id >= 0
    assert req.num_computed_tokens == 0 and len(so1.kv_transfers.load_gpu) == 12
    out1 = core.executor.execute_model(so1)
    assert out1.kv_offload_done == [so1.kv_transfers.job_id]
    so2 = sched.schedule()  # the copy is done, but the scheduler has not heard yet
    assert "r" not in so2.num_scheduled_tokens and req.num_computed_tokens == 0
    sched.update_from_output(so1, out1)
    assert req.num_computed_tokens == 12 * 16
    sched.update_from_output(so2, core.executor.execute_model(so2))
    so3 = sched.schedule()
    (new,) = so3.scheduled_new_reqs
    assert new.req_id == "r" and new.num_computed_tokens == 12 * 16
    assert so3.num_scheduled_tokens["r"] == 2  # only the tokens past the loaded prefix
    sched.update_from_output(so3, core.executor.execute_model(so3))
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)


class DiskMedium(OffloadMedium):
    """A plugin's medium: the pool in a memory-mapped file, copies in a background thread."""

    def __init__(self, kv_caches: list[torch.Tensor], block_dim: int, num_blocks: int) -> None:
        super().__init__(kv_caches, block_dim, num_blocks)
        shape = (num_blocks, len(self.layers), *self.layers[0].shape[1:])
        self.path = Path(tempfile.mkdtemp()) / "kv-pool.bin"
        self.file = torch.from_numpy(np.memmap(self.path, np.float32, "w+", shape=shape))
        self.thread = ThreadPoolExecutor(1)
        self.jobs: dict[int, Future] = {}

    def submit(self, transfers: KVTransfers) -> None:
        t = transfers
        for job in t.wait_jobs:  # the step reuses blocks these jobs load into
            if job in self.jobs:
                self.jobs[job].result()
        if not t.has_copies:
            return
        idx = torch.tensor(t.store_gpu, dtype=torch.int64)
        # Read now: the step about to run may overwrite these blocks. Written in the thread.
        stored = torch.stack([kv.index_select(0, idx) for kv in self.layers], dim=1)
        self.jobs[t.job_id] = self.thread.submit(self._copy, t, stored)

    def _copy(self, t: KVTransfers, stored: torch.Tensor) -> None:
        self.file[torch.tensor(t.store_cpu, dtype=torch.int64)] = stored
        src = self.file[torch.tensor(t.load_cpu, dtype=torch.int64)]
        dst = torch.tensor(t.load_gpu, dtype=torch.int64)
        for layer, kv in enumerate(self.layers):
            kv.index_copy_(0, dst, src[:, layer])

    def poll(self, wait: bool = False) -> list[int]:
        done = [j for j, f in self.jobs.items() if wait or f.done()]
        for j in done:
            self.jobs.pop(j).result()
        return done

    @property
    def num_in_flight(self) -> int:
        return len(self.jobs)


class DiskPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_offload_mediums(self, register):
        register("disk", DiskMedium)


def test_a_third_party_medium_on_disk_serves_the_same_hits(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    with plugin_registered(DiskPlugin(), "disk-medium"):
        llm = _engine(tiny_model, cpu_offload_gb=0.01, offload_medium="disk")
        medium = llm.engine.engine_core.executor.worker.model_runner.kv_offload
        assert isinstance(medium, DiskMedium)
        assert _workload(llm) == reference
        assert llm.engine.engine_core.scheduler.offload.stats_total.loaded_blocks >= 12 * 4
        assert medium.path.stat().st_size > 0
        _assert_idle(llm)


def _overlapping(llm: LLM) -> LLM:
    """Overlap mode at the tiny model's scale: compute 2 blocks a step (a hit of the 12-block
    prefixes is met from both ends)."""
    llm.engine.engine_core.scheduler.offload.overlap_chunk = 2
    return llm


def test_overlap_mode_gives_the_same_output_computing_part_of_each_hit(
    tiny_model: Path, reference: list[list[int]]
) -> None:
    llm = _overlapping(
        _engine(tiny_model, cpu_offload_gb=0.01, offload_store="full", offload_overlap=True)
    )
    assert _workload(llm) == reference
    stats = llm.engine.engine_core.scheduler.offload.stats_total
    # Each hit of 12 blocks: some loaded, the rest (at least the first chunk) computed.
    assert 0 < stats.loaded_blocks and stats.cpu_hit_tokens == 16 * stats.loaded_blocks
    assert stats.loaded_blocks <= 10 * 8
    _assert_idle(llm)


def test_overlap_computes_a_hits_first_blocks_while_its_last_blocks_load(
    tiny_model: Path,
) -> None:
    llm = _overlapping(_engine(tiny_model, cpu_offload_gb=0.01, offload_overlap=True))
    engine, sp = llm.engine, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prefixes = _prefixes()
    for i, p in enumerate(prefixes):  # the first prefix leaves the device for the CPU pool
        llm.generate({"prompt_token_ids": p + [1, i]}, sp, use_tqdm=False)
    core, sched = engine.engine_core, engine.engine_core.scheduler
    offload = sched.offload
    assert offload.overlap_share == 0.3
    engine.add_request("r", {"prompt_token_ids": prefixes[0] + [2, 2]}, sp)
    req = sched.requests["r"]
    so1 = sched.schedule()
    (new,) = so1.scheduled_new_reqs
    assert new.num_computed_tokens == 0 and so1.num_scheduled_tokens["r"] == 2 * 16
    held = [b.block_id for b in core.kv_cache_manager.req_to_blocks["r"]]
    # A share of 0.3 of the 12-block hit (4 blocks) is computed, 2 a step; the other 8 load
    # in one job from the first step on.
    assert so1.kv_transfers.load_gpu == held[4:12]
    sched.update_from_output(so1, core.executor.execute_model(so1))
    so2 = sched.schedule()  # the load is done (on a CPU, at once); blocks 2 and 3 compute
    assert so2.num_scheduled_tokens["r"] == 2 * 16 and not so2.kv_transfers.has_copies
    assert req.num_computed_tokens == 4 * 16
    sched.update_from_output(so2, core.executor.execute_model(so2))
    so3 = sched.schedule()  # the two ends met: blocks 4 to 11 count as computed
    assert so3.num_scheduled_tokens["r"] == 2 and req.num_computed_tokens == 12 * 16 + 2
    assert offload.stats_total.loaded_blocks == 8 and not offload.overlaps
    # The load was done first while the device still computed: compute less of the next hit.
    assert offload.overlap_share < 0.3
    sched.update_from_output(so3, core.executor.execute_model(so3))
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)


def test_a_request_aborted_while_met_from_both_ends_leaves_no_block_or_pin_behind(
    tiny_model: Path,
) -> None:
    llm = _overlapping(_engine(tiny_model, cpu_offload_gb=0.01, offload_overlap=True))
    engine, sp = llm.engine, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prefixes = _prefixes()
    for i, p in enumerate(prefixes):
        llm.generate({"prompt_token_ids": p + [1, i]}, sp, use_tqdm=False)
    core, sched = engine.engine_core, engine.engine_core.scheduler
    engine.add_request("r", {"prompt_token_ids": prefixes[0] + [2, 2]}, sp)
    so = sched.schedule()
    assert so.kv_transfers.load_gpu and "r" in sched.offload.overlaps
    engine.abort_request(["r"])
    # The 8 slots its load reads stay pinned until the load is done; the rest are free.
    assert not sched.offload.overlaps and sched.offload.idle_figures()["pinned_slots"] == 8
    sched.update_from_output(so, core.executor.execute_model(so))
    engine.add_request("s", {"prompt_token_ids": prefixes[1] + [2, 2]}, sp)
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)


# Prompt -> its greedy continuation without speculation, which the oracle proposer drafts.
_ORACLE: dict[tuple[int, ...], list[int]] = {}


class _OracleProposer(SpeculativeProposer):
    """Drafts the continuation a plain engine produced: every draft is accepted."""

    def propose(self, batch):
        k = self.ctx.num_speculative_tokens
        out = np.full((len(batch), k), -1, dtype=np.int64)
        for i in range(len(batch)):
            prompt = batch.token_ids[batch.rows[i], : batch.num_prompt_tokens[i]].tolist()
            done = int(batch.num_tokens[i] - batch.num_prompt_tokens[i])
            cont = _ORACLE[tuple(prompt)][done : done + k]
            out[i, : len(cont)] = cont
        return Drafts(out)


@hookimpl
def register_spec_proposers(register):
    register("offload_oracle", _OracleProposer)


def test_speculation_with_offload_gives_the_same_output_and_leaves_both_pools_idle(
    tiny_model: Path,
) -> None:
    """Verification writes keys and values for drafts; only accepted tokens' blocks are hashed,
    so the CPU pool stores and serves blocks written by verification steps exactly as a plain
    engine computes them. The second round continues each first-round output, so its hits
    include blocks of tokens that were accepted drafts."""
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = [p + [5, 7 + i] for i, p in enumerate(_prefixes())]

    def workload(llm: LLM) -> list[list[int]]:
        outs = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0] for p in first]
        got = [list(o.outputs[0].token_ids) for o in outs]
        second = [p + o[:32] + [9] for p, o in zip(first, got)]
        for p in second:
            got.append(
                list(
                    llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
                    .outputs[0]
                    .token_ids
                )
            )
        _ORACLE.update({tuple(p): o for p, o in zip(first + second, got)})
        return got

    want = workload(_engine(tiny_model))
    plugin = types.ModuleType("offload_oracle_proposer")
    plugin.PAGODA_PLUGIN_API = 1
    plugin.register_spec_proposers = register_spec_proposers
    spec = {"method": "offload_oracle", "num_speculative_tokens": 3}
    with plugin_registered(plugin):
        llm = _engine(tiny_model, cpu_offload_gb=0.01, speculative_config=spec)
        assert workload(llm) == want
    core = llm.engine.engine_core
    stats = core.scheduler.spec_stats_total
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens > 0, stats
    assert core.scheduler.offload.stats_total.loaded_blocks >= 4 * 12, (
        core.scheduler.offload.stats_total
    )
    _assert_idle(llm)
