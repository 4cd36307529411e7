"""What crosses between the scheduler and the workers in one step: the scheduler output, the
KV copies it asks for, and the runner output that comes back.

A leaf: the scheduler, the worker, the executors, KV offload and plugins all read these types,
so this module imports nothing of Pagoda's above the request and its sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagoda.lora_request import LoRARequest
from pagoda.multimodal_inputs import MultiModalInputs
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass
class KVTransfers:
    """One step's copies between the device KV cache and the CPU pool, as one job.

    Stores run before loads (a load may fill a block whose old contents a store of the same job
    saves). ``job_id`` is -1 when the step brings no new copy and only carries waits; a job's
    id comes back in ``ModelRunnerOutput.kv_offload_done`` once all of its copies are done.
    """

    job_id: int = -1
    store_gpu: list[int] = field(default_factory=list)  # device block ids, copied out ...
    store_cpu: list[int] = field(default_factory=list)  # ... into these CPU pool slots
    load_cpu: list[int] = field(default_factory=list)  # CPU pool slots, copied in ...
    load_gpu: list[int] = field(default_factory=list)  # ... into these device block ids
    # This step's forward overwrites blocks that this job's stores read: it waits for them.
    stores_first: bool = False
    # Earlier jobs whose copies touch blocks this step reuses: its forward waits for them.
    wait_jobs: list[int] = field(default_factory=list)

    @property
    def has_copies(self) -> bool:
        return bool(self.store_gpu or self.load_cpu)


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
    # A pooling request: the runner pools its prompt's hidden states instead of sampling.
    pooling_params: PoolingParams | None = None
    # The adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # Its images: the runner encodes them when ``SchedulerOutput.scheduled_encoder_inputs`` says.
    mm_inputs: MultiModalInputs | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Where ``new_block_ids`` start in the request's block list: the blocks the runner holds past
    # it were returned (speculative decoding frees blocks that held only rejected drafts).
    block_offset: int = -1
    # Pipeline parallelism only: its output tokens from ``num_computed_tokens`` on (or from the
    # prompt's end): the stages that do not sample learn them here.
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step; their sum is the step's batch size in tokens.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must drop its state for (finished, aborted or preempted) before this step.
    finished_req_ids: set[str] = field(default_factory=set)
    # req_id -> the draft tokens scheduled for it (speculative decoding); they are the last
    # ``len(drafts)`` of its ``num_scheduled_tokens`` and follow its last known token. All -1:
    # draft slots that the runner fills (``is_draft_slots``; ``pagoda.worker.draft_slots``).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV offload: this step's copies between the device and the CPU pool (and waits), if any.
    kv_transfers: KVTransfers | None = None
    # Speculative decoding: whether the runner proposes drafts after this step (false while
    # the governor has drafting off: ``pagoda.scheduler.spec_governor``).
    propose_drafts: bool = True
    # Alternating async speculation this step (``pagoda.scheduler.draft_policy``): the runner
    # proposes once the step's output is read, for the step after the one its requests sit out.
    alternate_drafts: bool = False
    # Multimodal: req_id -> indices of its images (``mm_inputs.features``) whose encoder output
    # the runner computes this step, before the forward; and the image hashes whose outputs it
    # drops first (the scheduler's encoder cache evicted them).
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_ids: list[str] = field(default_factory=list)
    # No later step reads the keys and values this step computes: every request it schedules
    # is a pooling prompt it computes whole whose blocks the prefix cache does not keep
    # (``Request.caches_prefix``). Layers that attend over the step's own keys and values then
    # skip storing them (``pagoda.attention.layer.Attention.stores_kv``).
    kv_unread: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


#: A draft slot in ``SchedulerOutput.scheduled_spec_decode_tokens``: a draft the runner fills.
DRAFT_SLOT = -1


def is_draft_slots(draft_ids: list[int]) -> bool:
    """Whether scheduled drafts are slots for the runner to fill (``DRAFT_SLOT`` placeholders)."""
    return bool(draft_ids) and draft_ids[0] == DRAFT_SLOT


@dataclass(slots=True)
class LogprobsArrays:
    """Logprobs of some positions of one request: row i is one position, column 0 the token
    that came (sampled, or the next prompt token), then the top k tokens by rank."""

    token_ids: np.ndarray  # [positions, 1 + k] int64
    logprobs: np.ndarray  # [positions, 1 + k] float32
    ranks: np.ndarray  # [positions] int64: the rank of column 0's token (1 = most likely)

    def select(self, start: int, stop: int, k: int) -> LogprobsArrays:
        """Positions ``[start, stop)``, with the chosen token and the top ``k``."""
        pos, cols = slice(start, stop), slice(0, k + 1)
        return LogprobsArrays(self.token_ids[pos, cols], self.logprobs[pos, cols], self.ranks[pos])


@dataclass(slots=True)
class PromptLogprobs:
    """Prompt logprobs computed in one step: ``start`` is the position of the first predicting
    token, so row i holds the logprobs of prompt token ``start + 1 + i``."""

    start: int
    arrays: LogprobsArrays


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request in ``req_ids``: the tokens sampled this step (empty for a prefill chunk
    # that does not reach the end of the known tokens). With drafts: the accepted drafts, then
    # one token of the target's (so ``len - 1`` drafts were accepted).
    sampled_token_ids: list[list[int]]
    # For the requests that asked (``logprobs``/``prompt_logprobs``), by request id.
    logprobs: dict[str, LogprobsArrays] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding: req_id -> the proposer's drafts for the request's next step.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> how many of its draft slots the runner filled (and verified) this step.
    draft_counts: dict[str, int] = field(default_factory=dict)
    # KV offload: the transfer jobs (``KVTransfers.job_id``) whose copies are done.
    kv_offload_done: list[int] = field(default_factory=list)
    # Pooling requests whose prompt this step finished: req_id -> the pooler's output (float32;
    # [dims], [labels], or [prompt tokens, dims] for token embeddings).
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)
    # Requests the runner could not serve this step, and why (an adapter whose files are gone
    # since the request came in): the scheduler ends them with an error, nothing else.
    failed_requests: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """Per request per step: the new tokens and, once it ends, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: LogprobsArrays | None = None  # one row per new token, when asked for
    new_prompt_logprobs: PromptLogprobs | None = None
    pooling_output: np.ndarray | None = None  # a pooling request's result, when it finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
