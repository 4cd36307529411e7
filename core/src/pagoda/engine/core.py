"""The engine core: schedule, execute, update. It knows token ids, never text."""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.engine.model_info import ModelInfo
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.plugins import get_registry
from pagoda.plugins.seams import seam
from pagoda.request import Request, RequestStatus
from pagoda.scheduler.output import EngineCoreOutput
from pagoda.scheduler.scheduler import Scheduler


class EngineCore:
    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.info = info
        executor_cls = get_registry("executors").get(config.parallel.executor)
        self.executor = executor_cls(config, info)
        self.num_blocks = self.executor.initialize()
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            info.max_model_len,
        )
        sched_config = config.scheduler.model_copy(
            update={"max_num_batched_tokens": info.max_num_batched_tokens}
        )
        self.scheduler = Scheduler(
            sched_config, config.cache, self.kv_cache_manager, info.max_model_len
        )
        # Plugin seam: None unless a plugin implements on_step_end.
        self._step_end = seam("on_step_end")

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            return []
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self._step_end is not None:  # plugin seam
            self._step_end(
                scheduler_output=scheduler_output, runner_output=runner_output, outputs=outputs
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def shutdown(self) -> None:
        self.executor.shutdown()
