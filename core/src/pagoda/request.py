"""A request as the engine core sees it: token ids that computed tokens catch up with."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagoda.lora_request import LoRARequest
from pagoda.multimodal_inputs import MultiModalInputs
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # failed alone (its grammar did not compile); ``stop_reason`` says why

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence in the engine core.

    NOTE: ``num_computed_tokens`` catches up with ``num_tokens`` (prompt plus output); that single
    rule covers prefill, chunked prefill, decode, prefix-cache hits and resumption after preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens being sampled by steps that ran but whose output the scheduler has not seen yet
    # (with async scheduling, the next step is scheduled before the last one's output is back).
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Block hashes of this request's full blocks, filled lazily by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    # Another sample of the same prompt (n > 1) that prefills it: this one waits until that
    # prompt is computed, then takes its full blocks from the prefix cache.
    prefill_leader: str | None = None
    # Speculative decoding: draft tokens for the next step, set by ``Scheduler.set_drafts`` from
    # the proposer's output and consumed (scheduled, in part or not at all) by the next
    # ``schedule()``. They are not tokens of the request: ``num_tokens`` does not count them.
    spec_token_ids: list[int] = field(default_factory=list)
    # A pooling request (embeddings, scores): its prompt is computed, its pooler's output is its
    # one result, and it ends there; ``sampling_params`` is then unused.
    pooling_params: PoolingParams | None = None
    # The adapter it runs with (None: the base model); its name is part of the prefix-cache key.
    lora_request: LoRARequest | None = None
    # The prompt's images: placeholder ranges, hashes, encoder inputs (None: text only).
    mm_inputs: MultiModalInputs | None = None
    # Whether its computed blocks enter the prefix cache (and are hashed for it). False for a
    # pooling prompt computed whole by one step whose blocks the KV cache manager does not
    # admit (``KVCacheManager.admits_pooled_prompt``): no later step reads its keys and values.
    caches_prefix: bool = True

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a prefix-cache hit may skip computing its prompt's first tokens: not for a
        pooling request whose pooler reads every prompt token's hidden state (as vLLM)."""
        return self.pooling_params is None or not self.pooling_params.needs_every_token
