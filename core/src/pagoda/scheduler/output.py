"""What the scheduler hands to the executor each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the model runner has no state for: scheduled for the first time, or resumed
    after preemption (then ``output_token_ids`` holds what it generated before)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step; their sum is the step's batch size in tokens.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must drop its state for (finished, aborted or preempted) before this step.
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request in ``req_ids``: the tokens sampled this step (empty for a prefill chunk
    # that does not reach the end of the known tokens).
    sampled_token_ids: list[list[int]]


@dataclass(slots=True)
class EngineCoreOutput:
    """Per request per step: the new tokens and, once it ends, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
