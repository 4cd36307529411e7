"""Serving metrics: Prometheus series under ``pagoda:`` (vLLM's names where vLLM has the series),
and a periodic log line.

Fed by ``AsyncLLM``'s output loop: request timings are taken in the API process; the scheduler's
state (running, waiting, KV cache usage, prefix cache, queue times), the tokens of each step and
the evicted prefix-cache blocks (observed through the ``on_step_end`` and ``on_blocks_evicted``
seams) come with engine outputs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagoda.spec_decode.metrics import SpecDecodingStats
from pagoda.step import EngineCoreOutput
from pagoda.wire import SchedulerStats

logger = logging.getLogger("pagoda.metrics")

prometheus_client.disable_created_metrics()

# vLLM's buckets.
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_COMPILE_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0]
_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]


_ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


@dataclass(slots=True)
class _SeqTimes:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None


class EngineMetrics:
    """The series of one model's engine. With ``num_engines`` data-parallel cores, the
    scheduler's gauges are their sums (KV usage: their mean) and counters add up every core's
    events; ``pagoda:engine_*`` series with an ``engine`` label give each core's own."""

    def __init__(self, model_name: str, log_interval: float = 10.0, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            h = Histogram(name, doc, list(labels), buckets=buckets, registry=self.registry)
            return h.labels(**labels)

        self.running = gauge("pagoda:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("pagoda:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("pagoda:kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.prefix_queries = counter(
            "pagoda:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("pagoda:prefix_cache_hits", "Prompt tokens found cached.")
        self.evicted_blocks = counter(
            "pagoda:prefix_cache_evicted_blocks",
            "Prefix-cached KV blocks evicted (handed to other requests).",
        )
        self.preemptions = counter("pagoda:num_preemptions", "Requests preempted.")
        # KV offload (cache.cpu_offload_gb): the CPU pool behind the device's prefix cache.
        self.cpu_prefix_hits = counter(
            "pagoda:cpu_prefix_cache_hits",
            "Prompt tokens found in the KV offload CPU pool past the device's prefix-cache hit"
            " (over pagoda:prefix_cache_queries: the CPU share of the hit rate).",
        )
        self.offload_stored = counter(
            "pagoda:kv_offload_stored_blocks", "KV blocks copied to the CPU pool."
        )
        self.offload_loaded = counter(
            "pagoda:kv_offload_loaded_blocks", "KV blocks loaded back from the CPU pool."
        )
        self.cpu_usage = gauge(
            "pagoda:kv_offload_cpu_usage_perc", "KV offload CPU pool usage (1 = full)."
        )
        self.grammar_compile = histogram(
            "pagoda:structured_output_compile_seconds",
            "Time to compile one structured-output grammar (off the engine loop).",
            _COMPILE_BUCKETS,
        )
        self.grammar_queries = counter(
            "pagoda:structured_output_cache_queries",
            "Constrained requests looked up in the compiled-grammar cache.",
        )
        self.grammar_hits = counter(
            "pagoda:structured_output_cache_hits",
            "Constrained requests whose grammar was cached (or already compiling).",
        )
        self.encoder_queries = counter(
            "pagoda:encoder_cache_queries",
            "Images that scheduled requests looked up in the encoder cache (multimodal models).",
        )
        self.encoder_hits = counter(
            "pagoda:encoder_cache_hits",
            "Images whose encoder output was held already (computed for another request).",
        )
        self.prompt_tokens = counter("pagoda:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("pagoda:generation_tokens", "Generated tokens.")
        self.ttft = histogram(
            "pagoda:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "pagoda:inter_token_latency_seconds", "Time between output steps.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "pagoda:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "pagoda:iteration_tokens_total",
            "Tokens computed by one engine step.",
            _ITERATION_TOKENS_BUCKETS,
        )
        self.queue_time = histogram(
            "pagoda:request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS
        )
        # Speculative decoding (vLLM's names); per position: how often its draft was accepted.
        self.spec_drafts = counter(
            "pagoda:spec_decode_num_drafts", "Drafts verified (one per request per step)."
        )
        self.spec_draft_tokens = counter(
            "pagoda:spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "pagoda:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_per_pos = Counter(
            "pagoda:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._success = Counter(
            "pagoda:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        # LoRA (vLLM's series): the adapters running and waiting, as labels of one series whose
        # value is when they were last seen.
        self.lora_info = Gauge(
            "pagoda:lora_requests_info",
            "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        self._lora_labels: tuple[str, str, str] | None = None
        self._engines = _EngineSeries(self.registry, model_name, num_engines)
        self._seqs: dict[str, _SeqTimes] = {}
        self._log = _PeriodicLog(log_interval)

    def add_sequences(self, seq_ids: list[str], num_prompt_tokens: int, arrival: float) -> None:
        for seq_id in seq_ids:
            self._seqs[seq_id] = _SeqTimes(arrival, num_prompt_tokens)

    def end_sequences(self, seq_ids: list[str], reason: str) -> None:
        """Sequences that ended outside the engine core (aborted, or a stop string here)."""
        now = time.monotonic()
        for seq_id in seq_ids:
            t = self._seqs.pop(seq_id, None)
            if t is not None:
                self._end(t, reason, now)

    def _end(self, t: _SeqTimes, reason: str, now: float) -> None:
        if reason != "abort":
            self.e2e.observe(now - t.arrival)
        self._success.labels(self._model_name, reason).inc()

    def engine_stopped(self, engine: int) -> None:
        """A data-parallel core is gone: its gauges drop out of the sums."""
        self._engines.stopped(engine)
        self._set_state()

    def _set_state(self) -> None:
        state = self._engines.summed()
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        self.kv_usage.set(state.kv_cache_usage)
        self._log.stats = state

    def record(
        self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None, engine: int = 0
    ) -> None:
        now = time.monotonic()
        for out in outputs:
            t = self._seqs.get(out.request_id)
            if t is None:
                continue
            if out.new_token_ids:
                if t.first_token is None:
                    t.first_token = now
                    self.ttft.observe(now - t.arrival)
                    self.prompt_tokens.inc(t.num_prompt_tokens)
                    self._log.prompt_tokens += t.num_prompt_tokens
                else:
                    self.itl.observe(now - t.last_token)  # type: ignore[operator]
                t.last_token = now
                self.generation_tokens.inc(len(out.new_token_ids))
                self._log.generation_tokens += len(out.new_token_ids)
            if out.pooling_output is not None:  # a pooling request's prompt, computed
                self.prompt_tokens.inc(t.num_prompt_tokens)
                self._log.prompt_tokens += t.num_prompt_tokens
            if out.finish_reason is not None:
                del self._seqs[out.request_id]
                self._end(t, out.finish_reason, now)
        if stats is not None:
            self._engines.record(engine, stats)
            self._set_state()
            self.prefix_queries.inc(stats.prefix_cache_queries)
            self.prefix_hits.inc(stats.prefix_cache_hits)
            self.preemptions.inc(stats.num_preemptions)
            self.evicted_blocks.inc(stats.evicted_blocks)
            if stats.max_lora:
                self._record_lora(stats)
            self.cpu_prefix_hits.inc(stats.cpu_prefix_cache_hits)
            self.offload_stored.inc(stats.offload_stored_blocks)
            self.offload_loaded.inc(stats.offload_loaded_blocks)
            self.cpu_usage.set(stats.cpu_cache_usage)
            for q in stats.queue_times:
                self.queue_time.observe(q)
            for n in stats.iteration_tokens:
                self.iteration_tokens.observe(n)
            for s in stats.grammar_compile_times:
                self.grammar_compile.observe(s)
            self.grammar_queries.inc(stats.grammar_cache_queries)
            self.grammar_hits.inc(stats.grammar_cache_hits)
            self.encoder_queries.inc(stats.encoder_cache_queries)
            self.encoder_hits.inc(stats.encoder_cache_hits)
            self._log.prefix_queries += stats.prefix_cache_queries
            self._log.prefix_hits += stats.prefix_cache_hits
            self._log.cpu_prefix_hits += stats.cpu_prefix_cache_hits
            if stats.spec_num_drafts:
                self._record_spec(stats)

    def _record_lora(self, stats: SchedulerStats) -> None:
        labels = (
            str(stats.max_lora),
            ",".join(stats.waiting_lora_adapters),
            ",".join(stats.running_lora_adapters),
        )
        if self._lora_labels is not None and self._lora_labels != labels:
            self.lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def _record_spec(self, stats: SchedulerStats) -> None:
        self.spec_drafts.inc(stats.spec_num_drafts)
        self.spec_draft_tokens.inc(stats.spec_num_draft_tokens)
        self.spec_accepted_tokens.inc(stats.spec_num_accepted_tokens)
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            self._spec_per_pos.labels(self._model_name, str(pos)).inc(n)
        self._log.spec.merge(
            SpecDecodingStats(
                stats.spec_num_drafts,
                stats.spec_num_draft_tokens,
                stats.spec_num_accepted_tokens,
                list(stats.spec_accepted_per_pos),
            )
        )

    def log(self) -> None:
        """Write the periodic log line if the interval has passed and something happened."""
        self._log.maybe_log()

    @property
    def log_interval(self) -> float:
        return self._log.interval

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class _EngineSeries:
    """Each data-parallel core's latest scheduler state; its own series when there are more
    than one core (``engine`` label: the core's index)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_engines: int) -> None:
        self.latest: list[SchedulerStats | None] = [None] * num_engines
        self.up = [True] * num_engines
        self.labeled = num_engines > 1
        if not self.labeled:
            return
        names = ["model_name", "engine"]

        def per_engine(kind: type, name: str, doc: str) -> list:
            metric = kind(name, doc, names, registry=registry)
            return [metric.labels(model_name, str(i)) for i in range(num_engines)]

        self.running = per_engine(Gauge, "pagoda:engine_num_requests_running",
                                  "Requests in the running batch of one engine core.")  # fmt: skip
        self.waiting = per_engine(Gauge, "pagoda:engine_num_requests_waiting",
                                  "Requests waiting in one engine core.")  # fmt: skip
        self.kv_usage = per_engine(Gauge, "pagoda:engine_kv_cache_usage_perc",
                                   "KV cache usage of one engine core (1 = full).")  # fmt: skip
        self.prefix_hits = per_engine(Counter, "pagoda:engine_prefix_cache_hits",
                                      "Prompt tokens found cached in one engine core.")  # fmt: skip
        self.alive = per_engine(Gauge, "pagoda:engine_up",
                                "1 while an engine core runs, 0 once it has stopped.")  # fmt: skip
        for g in self.alive:
            g.set(1)

    def record(self, engine: int, stats: SchedulerStats) -> None:
        if not self.up[engine]:
            return
        self.latest[engine] = stats
        if self.labeled:
            self.running[engine].set(stats.num_running)
            self.waiting[engine].set(stats.num_waiting)
            self.kv_usage[engine].set(stats.kv_cache_usage)
            self.prefix_hits[engine].inc(stats.prefix_cache_hits)

    def stopped(self, engine: int) -> None:
        self.up[engine] = False
        self.latest[engine] = None
        if self.labeled:
            self.alive[engine].set(0)
            for series in (self.running, self.waiting, self.kv_usage):
                series[engine].set(0)

    def summed(self) -> SchedulerStats:
        """Running and waiting over the live cores; KV usage their mean."""
        live = [s for s in self.latest if s is not None]
        usage = sum(s.kv_cache_usage for s in live) / len(live) if live else 0.0
        return SchedulerStats(
            sum(s.num_running for s in live), sum(s.num_waiting for s in live), usage
        )


class _PeriodicLog:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last = time.monotonic()
        self.stats: SchedulerStats | None = None
        self.prompt_tokens = self.generation_tokens = 0
        self.prefix_queries = self.prefix_hits = self.cpu_prefix_hits = 0
        self.spec = SpecDecodingStats()
        self._was_idle = True

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last
        if elapsed < self.interval:
            return
        s = self.stats
        idle = (s is None or s.num_running + s.num_waiting == 0) and not self.generation_tokens
        if not (idle and self._was_idle):
            hit = 100 * self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
            cpu_hit = 100 * self.cpu_prefix_hits / max(self.prefix_queries, 1)
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%%s",
                self.prompt_tokens / elapsed,
                self.generation_tokens / elapsed,
                s.num_running if s else 0,
                s.num_waiting if s else 0,
                100 * (s.kv_cache_usage if s else 0.0),
                hit,
                f" (+{cpu_hit:.1f}% from CPU)" if self.cpu_prefix_hits else "",
            )
            if self.spec.num_drafts:
                self._log_spec(elapsed)
        self._was_idle = idle
        self.spec = SpecDecodingStats()
        self.last = now
        self.prompt_tokens = self.generation_tokens = 0
        self.prefix_queries = self.prefix_hits = self.cpu_prefix_hits = 0

    def _log_spec(self, elapsed: float) -> None:
        spec = self.spec
        per_pos = ", ".join(f"{n / spec.num_drafts:.3f}" for n in spec.accepted_per_pos)
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            spec.mean_acceptance_length,
            spec.num_accepted_tokens / elapsed,
            spec.num_draft_tokens / elapsed,
            spec.num_accepted_tokens,
            spec.num_draft_tokens,
            per_pos,
            100 * spec.acceptance_rate,
        )
