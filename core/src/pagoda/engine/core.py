"""The engine core: schedule, execute, update. It knows token ids, never text."""

from __future__ import annotations

import time
from collections import deque

from pagoda.config import EngineConfig, SchedulerConfig
from pagoda.executor.base import PendingOutput, executor_name
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.kv_offload import build_offload_manager
from pagoda.lora.support import check_lora
from pagoda.model_info import ModelInfo
from pagoda.models.pipeline import check_pipeline_parallel
from pagoda.multimodal.model import is_multimodal
from pagoda.plugins import get_registry
from pagoda.plugins.seams import seam
from pagoda.request import Request, RequestStatus
from pagoda.scheduler.draft_policy import draft_policy
from pagoda.scheduler.encoder_cache import EncoderCacheManager
from pagoda.scheduler.scheduler import Scheduler
from pagoda.scheduler.spec_governor import build_governor
from pagoda.spec_decode.proposer import check_speculative, proposer_paces_itself
from pagoda.step import EngineCoreOutput, SchedulerOutput
from pagoda.structured_output.manager import StructuredOutputManager, register_manager


class EngineCore:
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        start = time.perf_counter()
        # Pipeline stages: a split or a feature they cannot serve fails here, before anything.
        check_pipeline_parallel(config, info.shape, info.model_impl, info.pooler is not None)
        # KV offload's CPU pool (None: off); a bad policy name fails here, before any loading.
        offload = build_offload_manager(config, info)
        check_speculative(config, info)  # before any worker starts
        if config.speculative.method is not None and is_multimodal(info):
            raise ValueError(
                f"speculative.method={config.speculative.method!r}: speculative decoding does not"
                f" serve a model that reads images ({info.shape.architecture}) yet"
            )
        check_lora(config, info)
        executor_cls = get_registry("executors").get(executor_name(config.parallel))
        self.executor = executor_cls(config, info)
        self.num_blocks = self.executor.initialize()
        # Seconds per start-up phase, and the whole of it (``engine_core_s``).
        self.startup_times = dict(self.executor.startup_times)
        self.startup_times["engine_core_s"] = time.perf_counter() - start
        # NOTE: an encoder's prompt runs whole in one step and attends to every token of it, so
        # neither chunked prefill nor a prefix-cache hit applies (``ModelInfo.bidirectional``).
        whole = info.bidirectional
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching and not whole,
            info.max_model_len,
            offload,
        )
        update: dict[str, object] = {"max_num_batched_tokens": info.max_num_batched_tokens}
        if whole:
            update["enable_chunked_prefill"] = False
        sched_config = config.scheduler.model_copy(update=update)
        # Structured output: grammars compile in its threads; this process's runner finds them.
        self.structured_output = StructuredOutputManager(config, info)
        register_manager(config, self.structured_output)
        drafts = draft_policy(config)
        self.scheduler = Scheduler(
            sched_config,
            config.cache,
            self.kv_cache_manager,
            info.max_model_len,
            structured_output=self.structured_output,
            drafts=drafts,
            spec_governor=build_governor(
                config.speculative,
                self_paced=proposer_paces_itself(config.speculative),
                plain_first_from=None if drafts is None else drafts.alternate_from,
            ),
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            batch_queue=config.parallel.pipeline_parallel_size > 1,
            encoder_cache=_encoder_cache(sched_config, info),
        )
        # Plugin seam: None unless a plugin implements on_step_end.
        self._step_end = seam("on_step_end")
        self.async_scheduling = config.scheduler.async_scheduling
        # The step launched last whose output is not read yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        # Pipeline parallelism: up to one step in flight per stage, oldest first (vLLM's batch
        # queue; None: off), and the most there ever were at once.
        pp = config.parallel.pipeline_parallel_size
        self.batch_queue_size = pp
        self._batches: deque[tuple[SchedulerOutput, PendingOutput]] | None = (
            deque() if pp > 1 else None
        )
        self.max_batches_in_flight = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and run one step; the outputs of the requests it advanced.

        With async scheduling the step is launched before the previous one's output is read,
        and this returns the previous step's outputs: the host schedules and prepares step N+1
        while the device runs step N.
        """
        if self._batches is not None:
            return self._step_with_batch_queue(self._batches)
        outputs: list[EngineCoreOutput] = []
        so = self.scheduler.schedule()
        if so.is_empty and self._in_flight is None and self.structured_output.num_pending:
            self.structured_output.wait(0.05)  # nothing runs: wait for a grammar, do not spin
        launched = None
        if not so.is_empty or so.finished_req_ids or so.kv_transfers is not None:
            launched = (so, self.executor.launch(so))
            self.scheduler.after_launch(so)
        previous, self._in_flight = self._in_flight, None
        if previous:
            outputs += self._finish(*previous)
        if launched is not None:
            if self.async_scheduling and not so.is_empty:
                self._in_flight = launched
            else:  # NOTE: a step that only drops finished requests has nothing to overlap
                outputs += self._finish(*launched)
        if self.scheduler.grammar_errors:
            outputs += self.scheduler.take_grammar_errors()
        return outputs

    def _step_with_batch_queue(
        self, batches: deque[tuple[SchedulerOutput, PendingOutput]]
    ) -> list[EngineCoreOutput]:
        """Pipeline parallelism: launch the next batch while earlier ones are in flight in the
        stages; read the oldest once the queue is full or nothing new could be scheduled.

        The scheduler leaves out the requests whose sampled token is in flight, so each batch
        holds other requests (or the next chunks of prompts), and the stages overlap.
        """
        outputs: list[EngineCoreOutput] = []
        launched = drain = False
        if len(batches) < self.batch_queue_size:
            preemptions = self.scheduler.num_preemptions_total
            so = self.scheduler.schedule()
            if not so.is_empty or so.finished_req_ids or so.kv_transfers is not None:
                batches.append((so, self.executor.launch(so)))
                self.scheduler.after_launch(so)
                launched = not so.is_empty
                running = sum(not b.is_empty for b, _ in batches)
                self.max_batches_in_flight = max(self.max_batches_in_flight, running)
            elif not batches and self.structured_output.num_pending:
                self.structured_output.wait(0.05)  # nothing runs: wait for a grammar
            # NOTE: a request preempted now may be in an earlier batch still in flight: every
            # batch is read before it can be scheduled again, so that their token is dropped.
            drain = self.scheduler.num_preemptions_total != preemptions
        if drain:
            while batches:
                outputs += self._finish(*batches.popleft())
        elif batches and (not launched or len(batches) >= self.batch_queue_size):
            outputs += self._finish(*batches.popleft())
        if self.scheduler.grammar_errors:
            outputs += self.scheduler.take_grammar_errors()
        return outputs

    def _finish(
        self, scheduler_output: SchedulerOutput, pending: PendingOutput
    ) -> list[EngineCoreOutput]:
        runner_output = pending.get()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self._step_end is not None:  # plugin seam
            self._step_end(
                scheduler_output=scheduler_output, runner_output=runner_output, outputs=outputs
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        # NOTE: a step still in flight once every request ended holds only dropped tokens; the
        # next step() reads it (or nothing ever needs to).
        return self.scheduler.has_unfinished_requests()

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.structured_output.shutdown()
        register_manager(self.config, None)


def _encoder_cache(config: SchedulerConfig, info: ModelInfo) -> EncoderCacheManager | None:
    """A multimodal model's encoder cache, sized ``encoder_cache_size`` tokens (default: the
    step's encoder budget, itself the step's token budget by default); None for a text model."""
    if not is_multimodal(info):
        return None
    budget = config.max_num_encoder_input_tokens or config.max_num_batched_tokens
    return EncoderCacheManager(config.encoder_cache_size or budget)
