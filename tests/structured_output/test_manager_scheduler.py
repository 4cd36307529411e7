"""The structured-output manager with the scheduler, on a fake grammar backend (no model): a
request waits for its grammar without holding up others, compiled grammars are cached by their
constraint, and a compile that fails or outlasts the timeout fails that request alone."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pagoda.config import CacheConfig, EngineConfig, SchedulerConfig
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    apply_token_bitmask,
)
from pagoda.structured_output.manager import StructuredOutputManager


class _Compiled(CompiledGrammar):
    def new_matcher(self, max_rollback_tokens: int = 0) -> GrammarMatcher:
        raise NotImplementedError


class GatedBackend(GrammarBackend):
    """Compiles when the test opens the gate; a regex of "fail" fails to compile."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.compiles = 0

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        pass

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        self.gate.wait(10)
        self.compiles += 1
        if params.regex == "fail":
            raise ValueError("invalid or unsupported regex: fail")
        return _Compiled()


_Compiled.backend = GatedBackend


def _setup(timeout_s: float = 30.0) -> tuple[Scheduler, StructuredOutputManager, GatedBackend]:
    config = EngineConfig(structured_output={"compile_timeout_s": timeout_s})
    manager = StructuredOutputManager(config, SimpleNamespace())
    backend = GatedBackend()
    manager._backend = backend
    kv = KVCacheManager(64, 16, True, 256)
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), kv, 256, structured_output=manager)
    return scheduler, manager, backend


def _request(rid: str, regex: str | None = None) -> Request:
    so = None if regex is None else StructuredOutputsParams(regex=regex)
    return Request(rid, [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs=so), 2)


def _scheduled(scheduler: Scheduler) -> set[str]:
    return set(scheduler.schedule().num_scheduled_tokens)


def test_request_waits_for_its_grammar_without_holding_up_the_queue() -> None:
    scheduler, manager, backend = _setup()
    scheduler.add_request(_request("constrained", "a+"))
    scheduler.add_request(_request("free"))
    assert _scheduled(scheduler) == {"free"}
    assert scheduler.num_waiting == 1
    backend.gate.set()
    manager.wait(5)
    assert _scheduled(scheduler) == {"constrained", "free"}
    manager.shutdown()


def test_equal_constraints_compile_once_and_count_cache_hits() -> None:
    scheduler, manager, backend = _setup()
    backend.gate.set()
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", "[0-9]+"))
    scheduler.add_request(_request("other", "[a-z]+"))
    manager.wait(5)
    while manager.num_pending:
        manager.wait(5)
        scheduler.schedule()
    assert backend.compiles == 2
    times, queries, hits = manager.take_stats()
    assert (queries, hits, len(times)) == (4, 2, 2)
    manager.shutdown()


def test_failed_compile_fails_that_request_alone_with_its_reason() -> None:
    scheduler, manager, backend = _setup()
    backend.gate.set()
    scheduler.add_request(_request("bad", "fail"))
    scheduler.add_request(_request("free"))
    manager.wait(5)
    assert _scheduled(scheduler) == {"free"}
    (err,) = scheduler.take_grammar_errors()
    assert err.request_id == "bad" and err.finish_reason == "error"
    assert "invalid or unsupported regex" in err.stop_reason
    assert "bad" not in scheduler.requests and scheduler.num_waiting == 0
    manager.shutdown()


def test_compile_past_the_timeout_fails_the_request_and_frees_the_engine() -> None:
    scheduler, manager, backend = _setup(timeout_s=0.2)
    scheduler.add_request(_request("slow", "a+"))
    assert _scheduled(scheduler) == set()
    time.sleep(0.3)
    scheduler.add_request(_request("free"))
    assert _scheduled(scheduler) == {"free"}
    (err,) = scheduler.take_grammar_errors()
    assert err.request_id == "slow" and "compile_timeout_s=0.2" in err.stop_reason
    assert manager.num_pending == 0 and "slow" not in scheduler.requests
    backend.gate.set()
    manager.shutdown()


def test_aborting_a_request_that_waits_for_its_grammar_forgets_it() -> None:
    scheduler, manager, backend = _setup()
    scheduler.add_request(_request("c", "a+"))
    scheduler.schedule()
    scheduler.finish_requests("c")
    assert manager.num_pending == 0 and scheduler.requests == {}
    assert scheduler.requests.get("c") is None
    backend.gate.set()
    manager.shutdown()


def test_grammar_end_stops_a_request_even_with_ignore_eos() -> None:
    params = SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    assert 2 in params.resolve(None, 100, {2}).all_stop_token_ids
    assert 2 not in SamplingParams(ignore_eos=True).resolve(None, 100, {2}).all_stop_token_ids


def test_reference_bitmask_application_sets_refused_tokens_to_minus_infinity() -> None:
    logits = torch.zeros(3, 40)
    bitmask = torch.full((3, 2), -1, dtype=torch.int32)
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 3  # row 1 allows token 3 only
    bitmask[1, 1] = 1 << 1  # and token 33
    apply_token_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 33]


def test_structured_outputs_params_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="at least one choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json='{"b": 1, "a": 2}').key() == (
        StructuredOutputsParams(json={"a": 2, "b": 1}).key()
    )
