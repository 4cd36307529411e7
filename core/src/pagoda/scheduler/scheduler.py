"""The scheduler: each step, every request's computed tokens catch up with its known tokens.

There are no prefill and decode phases. A request with many uncomputed tokens (a new prompt, a
resumed one) gets as many as the token budget allows, possibly over several steps (chunked
prefill); a request with one (the token sampled last step) is decoding. Prefix-cache hits and
preemption (recompute from scratch) only move ``num_computed_tokens``.

NOTE: ``num_computed_tokens`` is advanced at the end of ``schedule()``, by the tokens scheduled
in that step; the request data sent to the runner carries the value from before the step.

A step that computes all of a request's tokens samples one more; until its output comes back
that token is a placeholder (``Request.num_output_placeholders``) that counts as known. With
async scheduling the engine schedules step N+1 before step N's output is back, so a decoding
request is scheduled for the token step N is still sampling, and the runner takes its id from
the device. A request that step N ends was scheduled once more for nothing: that token is dropped.

Speculative decoding follows the same rule: a decoding request's drafts (``Request.spec_token_ids``)
are scheduled after its last known token, so ``num_scheduled_tokens`` counts them and the KV cache
manager gives them slots; ``num_computed_tokens`` advances over them, and ``update_from_output``
rolls it back by the drafts the rejection sampler refused (``_apply_drafts``), so rejected tokens
leave no computed KV behind, no block with one of them is ever hashed into the prefix cache
(hashing reads only the request's own tokens below ``num_computed_tokens``), and blocks that hold
only rejected positions go back to the pool at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_cache.block_pool import KVCacheBlock
from pagoda.kv_cache.manager import KVCacheManager, cdiv
from pagoda.plugins.seams import check_admission, seam
from pagoda.request import Request, RequestStatus
from pagoda.scheduler.draft_policy import DraftBackoff, DraftPolicy
from pagoda.scheduler.encoder_cache import EncoderCacheManager
from pagoda.scheduler.spec_governor import SpeculationGovernor, is_decode_step
from pagoda.spec_decode.metrics import SpecDecodingStats
from pagoda.step import (
    DRAFT_SLOT,
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from pagoda.structured_output.manager import StructuredOutputManager

#: Pooling prompts computed whole by one step leave no keys and values behind unless the prefix
#: cache admits them (``KVCacheManager.admits_pooled_prompt``; ``SchedulerOutput.kv_unread``).
#: False: every prompt's blocks are stored and cached, as generation's are (read per step, for
#: an A/B).
SKIP_UNREAD_KV = True


def _priority_key(request: Request) -> tuple[int, float]:
    """Smaller is served first and preempted last."""
    return request.priority, request.arrival_time


class _FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class _PriorityQueue:
    """Ordered by (priority, arrival_time); a preempted request returns to its own place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*_priority_key(request), next(self._seq), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap))


@dataclass
class _Step:
    """What one ``schedule()`` call has decided so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    new_blocks: dict[str, list[KVCacheBlock]] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    spec: dict[str, list[int]] = field(default_factory=dict)  # req_id -> drafts scheduled
    encoder_budget: int = 0  # image tokens the encoder may still compute this step
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # req_id -> images

    def add(self, req: Request, n: int, blocks: list[KVCacheBlock], is_new: bool) -> None:
        (self.new_reqs if is_new else self.cached_reqs).append(req)
        self.num_scheduled[req.request_id] = n
        self.new_blocks[req.request_id] = blocks
        self.budget -= n

    def drop(self, req: Request) -> None:
        n = self.num_scheduled.pop(req.request_id, None)
        if n is None:
            return
        self.budget += n
        del self.new_blocks[req.request_id]
        self.spec.pop(req.request_id, None)
        self.encoder_inputs.pop(req.request_id, None)
        (self.new_reqs if req in self.new_reqs else self.cached_reqs).remove(req)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        *,
        structured_output: StructuredOutputManager | None = None,
        drafts: DraftPolicy | None = None,
        spec_governor: SpeculationGovernor | None = None,
        max_loras: int | None = None,
        batch_queue: bool = False,
        encoder_cache: EncoderCacheManager | None = None,
    ) -> None:
        """``structured_output`` compiles grammars (None: requests with one are refused);
        ``drafts`` is how drafts are scheduled (``pagoda.scheduler.draft_policy``; None:
        speculation is off); ``spec_governor`` turns drafting off for the batch while it does
        not pay (None: drafts every step). ``batch_queue``: the engine keeps several steps in
        flight (pipeline parallelism): a request whose sampled token is still in flight sits
        out until it is back, and each scheduled request carries its new output tokens
        (``CachedRequestData.new_token_ids``) for the stages that do not sample.
        ``encoder_cache``: a multimodal model's encoder outputs held between steps (None: the
        model takes text only, and a request with images is refused)."""
        self.num_preemptions_total = 0
        chunked = scheduler_config.enable_chunked_prefill
        budget = scheduler_config.max_num_batched_tokens
        if budget is None:
            budget = 2048 if chunked else max(2048, max_model_len)
        if not chunked and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}"
                " with chunked prefill disabled: long prompts could never be scheduled; raise"
                " max_num_batched_tokens or enable chunked prefill"
            )
        if cache_config.block_size != kv_cache_manager.block_size:
            raise ValueError(
                f"cache block_size={cache_config.block_size} differs from the KV cache"
                f" manager's {kv_cache_manager.block_size}"
            )
        usable = kv_cache_manager.num_blocks - 1
        if cdiv(max_model_len, kv_cache_manager.block_size) > usable:
            raise ValueError(
                f"the KV cache holds {usable * kv_cache_manager.block_size} tokens, fewer than"
                f" max_model_len={max_model_len}: one long request could never finish; lower"
                " max_model_len or give the KV cache more memory"
            )
        self.max_model_len = max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        # Read by the built-in admission rule (``pagoda.builtin_plugin.admit_request``).
        self.max_waiting_requests = scheduler_config.max_waiting_requests
        self.max_num_batched_tokens = budget
        self.enable_chunked_prefill = chunked
        self.policy = scheduler_config.policy
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = _PriorityQueue() if self.policy == "priority" else _FCFSQueue()
        self.running: list[Request] = []
        # Sent with the next SchedulerOutput so the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Plugin seam: None unless a plugin implements admit_request.
        self._admit_hook = seam("admit_request")
        # Leader id -> the samples that wait for its prompt's blocks (see Request.prefill_leader).
        self.parked: dict[str, list[Request]] = {}
        # Structured output: requests whose compile failed, for the next outputs.
        self.structured_output = structured_output
        self.grammar_errors: list[EngineCoreOutput] = []
        # KV offload: requests loading from the CPU pool wait there, not in ``waiting``.
        self.offload = kv_cache_manager.offload
        # Speculative decoding: drafts verified since the last ``make_spec_stats`` (and ever);
        # k drafts a request at most (0: off). A request with a step in flight gets k draft
        # slots that the runner fills, or sits a step out (``pagoda.scheduler.draft_policy``).
        self.spec_stats = SpecDecodingStats()
        self.spec_stats_total = SpecDecodingStats()
        self.num_spec_tokens = 0 if drafts is None else drafts.num_spec_tokens
        self.draft_backoff = DraftBackoff() if drafts is None else drafts.backoff()
        # Speculation alternates from this many running requests on (None: never); whether
        # this step alternates; the requests whose last proposal had drafts.
        self.spec_alternate_from = None if drafts is None else drafts.alternate_from
        self._alternate = False
        self._proposing: set[str] = set()
        # Whether this step drafts: the governor (None: always) turns drafting off for the
        # batch while it does not pay (``pagoda.scheduler.spec_governor``).
        self.spec_governor = spec_governor
        self._drafting = True
        self.batch_queue = batch_queue
        # The pooling requests whose prompt the last ``schedule`` completes: ``after_launch``
        # returns their blocks (found by ``schedule``, which visits each scheduled request
        # anyway, so that a generation step never walks its requests for them).
        self._pooling_ending: list[Request] = []
        # LoRA: adapters the runner holds at once (None: LoRA off). The running requests never
        # use more distinct adapters, so no step does; waiting ones that would wait their turn.
        self.max_loras = max_loras
        self._lora_held: list[Request] = []
        self._lora_active: set[int] | None = None  # this step's adapters, once counted
        # Multimodal: image tokens the encoder may compute in one step, and its outputs' cache.
        self.encoder_cache = encoder_cache
        self.encoder_budget = scheduler_config.max_num_encoder_input_tokens or budget

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already scheduled; request ids must be unique")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty; it needs at least one token")
        if request.is_pooling and n > self.max_model_len:
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens, more than max_model_len="
                f"{self.max_model_len}"
            )
        if not request.is_pooling and n >= self.max_model_len:
            raise ValueError(
                f"request {rid!r}: the prompt has {n} tokens, max_model_len={self.max_model_len}"
                " leaves no room for output; the prompt must be shorter than max_model_len"
            )
        if request.mm_inputs is not None:
            self._check_images(request)
        if self._admit_hook is not None:  # plugin seam: may raise RequestRejectedError
            check_admission(self._admit_hook, request, self)
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError(f"request {rid!r}: this engine has no structured output")
            self.structured_output.submit(request)  # compiles off the loop; waits till ready
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        leader = self.requests.get(request.prefill_leader or "")
        kv = self.kv_cache_manager
        if (
            leader is not None
            and leader.num_computed_tokens < leader.num_prompt_tokens
            and kv.enable_caching
            and (n - 1) // kv.block_size > 0
        ):
            self.parked.setdefault(leader.request_id, []).append(request)
        else:
            self.waiting.add(request)

    def _check_images(self, request: Request) -> None:
        cache = self.encoder_cache
        if cache is None:
            raise ValueError(f"request {request.request_id!r}: this model takes no images")
        for f in request.mm_inputs.features:
            limit = min(self.encoder_budget, cache.capacity)
            if f.length > limit:
                raise ValueError(
                    f"request {request.request_id!r}: an image of {f.length} tokens is more than"
                    f" the encoder takes in one step ({limit}: max_num_encoder_input_tokens and"
                    " encoder_cache_size); send a smaller image or raise them"
                )

    def _plan_images(self, req: Request, start: int, num_new: int, step: _Step) -> int:
        """``num_new`` cut before the first image the encoder cannot compute this step (a
        request whose placeholders are all computed is not asked: see the callers)."""
        num_new, todo = self.encoder_cache.plan(req, start, num_new, step.encoder_budget)
        step.encoder_inputs[req.request_id] = todo
        return num_new

    def _commit_images(self, req: Request, start: int, num_new: int, step: _Step) -> None:
        """The images planned for ``req`` are this step's: referenced, or encoded."""
        todo = step.encoder_inputs.pop(req.request_id, None)
        if todo is None:
            return  # nothing planned: no image ahead
        step.encoder_budget -= self.encoder_cache.commit(req, start, num_new, todo)
        if todo:
            step.encoder_inputs[req.request_id] = todo

    def _unpark(self, leader: Request) -> None:
        """The leader's prompt is computed (or it ended): its samples join the queue's front."""
        samples = self.parked.pop(leader.request_id, None)
        if samples is None:
            return
        self.kv_cache_manager.cache_computed_blocks(leader)
        for req in reversed(samples):
            self.waiting.add_preempted(req)

    def after_launch(self, scheduler_output: SchedulerOutput) -> None:
        """Host work that waits until the step it scheduled runs on the device: the prefix
        cache's block hashes of the requests it admitted (their lookup hashed only as far as
        their hit), and the blocks of the pooling requests the step ends.

        A pooling request whose prompt the step completes ends with the step, whatever its
        output: its blocks go back now, while the device runs the step, not once the output is
        read (for an embedding batch's last step, host time after the device's last kernel).
        A later step that takes them runs after this one on the device, so the step's keys and
        values are written (and cached blocks read) first. Not where another reader may still
        want them behind the step: KV offload's transfers, pipeline stages' batches in flight.
        The output's ``_release`` finds them returned."""
        kv = self.kv_cache_manager
        for new in scheduler_output.scheduled_new_reqs:
            req = self.requests.get(new.req_id)
            if req is not None:
                kv.hash_blocks(req)
        ending, self._pooling_ending = self._pooling_ending, []
        if self.offload is not None or self.batch_queue:
            return
        for req in ending:
            if (
                self.requests.get(req.request_id) is req
                and req.status == RequestStatus.RUNNING
                and req.request_id in scheduler_output.num_scheduled_tokens
            ):
                kv.free(req)

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        step = _Step(budget=self.max_num_batched_tokens, encoder_budget=self.encoder_budget)
        self.draft_backoff.tick()
        gov = self.spec_governor
        self._drafting = gov is None or gov.drafting(len(self.running))
        self._alternate = self._alternates()
        # (where steps alternate, the placeholders from which a request may sit out: one with a
        # step in flight, and with drafting off only one whose step in flight verifies drafts)
        sits_from = 1 if self._drafting else 2

        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            known = req.num_tokens + req.num_output_placeholders
            if self.offload is not None and self.offload.overlaps:  # KV offload, overlap mode
                known = self.offload.compute_limit(req, known)
            num_new = min(
                known - req.num_computed_tokens,
                step.budget,
                self.max_model_len - req.num_computed_tokens,
            )
            if (
                num_new <= 0
                or self._ends_before(req, known)
                or (
                    self._alternate
                    and req.num_output_placeholders >= sits_from
                    and self._sits_out(req)
                )
                or (self.batch_queue and req.num_output_placeholders)  # its token is in flight
            ):
                i += 1
                continue
            mm = req.mm_inputs
            if mm is not None and req.num_computed_tokens < mm.end:  # images ahead
                num_new = self._plan_images(req, req.num_computed_tokens, num_new, step)
                if num_new <= 0:
                    i += 1
                    continue
            drafts = self._drafts_to_schedule(req, known, step.budget) if self._drafting else []
            blocks = kv.allocate_slots(req, num_new + len(drafts))
            if blocks is None and drafts:  # short of blocks: verify no drafts before preempting
                drafts = []
                blocks = kv.allocate_slots(req, num_new)
            while blocks is None:
                victim = self._pick_victim()
                pos = self.running.index(victim)
                self._preempt(victim, step)
                if victim is req:
                    break
                if pos < i:
                    i -= 1
                blocks = kv.allocate_slots(req, num_new)
            if blocks is None:
                break
            step.add(req, num_new + len(drafts), blocks, is_new=False)
            self._commit_images(req, req.num_computed_tokens, num_new, step)
            if drafts:
                step.spec[req.request_id] = drafts
            i += 1

        if not step.preempted:
            self._schedule_waiting(step)

        new_data = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                pooling_params=r.pooling_params,
                lora_request=r.lora_request,
                mm_inputs=r.mm_inputs,
            )
            for r in step.new_reqs
        ]
        cached_data = [
            CachedRequestData(
                req_id=r.request_id,
                new_block_ids=[b.block_id for b in step.new_blocks[r.request_id]],
                num_computed_tokens=r.num_computed_tokens,
                block_offset=kv.num_held_blocks(r.request_id) - len(step.new_blocks[r.request_id]),
                new_token_ids=self._new_outputs(r) if self.batch_queue else [],
            )
            for r in step.cached_reqs
        ]
        finished, self.finished_req_ids = self.finished_req_ids | step.preempted, set()
        if gov is not None and not self.running:
            gov.idle()  # NOTE: not when every running request sits this step out
        elif gov is not None and step.new_reqs:
            gov.admit(len(step.new_reqs))
        for r in self.running:
            r.spec_token_ids = []  # consumed: scheduled now (``step.spec``) or dropped
        ending = self._pooling_ending = []
        # Whether a pooling prompt computed whole may leave no keys and values behind: its
        # blocks go back at the launch (``after_launch``), nobody else reads them behind the
        # step, and the prefix cache does not admit them.
        transient = SKIP_UNREAD_KV and self.offload is None and not self.batch_queue
        unread = transient
        for r in itertools.chain(step.new_reqs, step.cached_reqs):
            whole = r.num_computed_tokens == 0
            r.num_computed_tokens += step.num_scheduled[r.request_id]
            if r.mm_inputs is not None:
                self.encoder_cache.release_computed(r)
            if r.is_pooling:
                # It samples nothing: its prompt's last chunk gives its pooler output.
                if r.num_computed_tokens >= r.num_tokens:
                    ending.append(r)
                    if transient and whole and not kv.admits_pooled_prompt(r):
                        r.caches_prefix = False
                unread = unread and not r.caches_prefix
                continue
            unread = False
            if r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders:
                # This step samples the next token, and may emit every draft before it.
                r.num_output_placeholders += 1 + len(step.spec.get(r.request_id, ()))
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=step.spec,
            kv_transfers=None if self.offload is None else self.offload.build_step(),
            propose_drafts=self._drafting,
            # NOTE: by the requests running after this step's admissions, whose next steps the
            # runner's proposals after this one feed (the first step of a batch is its prompts').
            alternate_drafts=self._alternates(),
            scheduled_encoder_inputs={
                rid: todo for rid, todo in step.encoder_inputs.items() if rid in step.num_scheduled
            },
            free_encoder_ids=[] if self.encoder_cache is None else self.encoder_cache.take_freed(),
            kv_unread=unread and bool(step.num_scheduled),
        )

    @staticmethod
    def _new_outputs(req: Request) -> list[int]:
        """The output tokens from ``num_computed_tokens`` (or the prompt's end) on."""
        return req.output_token_ids[max(req.num_computed_tokens - req.num_prompt_tokens, 0) :]

    def _alternates(self) -> bool:
        """Whether speculation alternates with the requests running now
        (``DraftPolicy.alternate_from``)."""
        return (
            self.spec_alternate_from is not None and len(self.running) >= self.spec_alternate_from
        )

    def _sits_out(self, req: Request) -> bool:
        """Alternating async speculation: a decoding request whose step in flight verifies
        drafts waits for it; one whose plain step is in flight, and whose last proposal had
        drafts, waits once so that its next step verifies fresh drafts. (Asked only where steps
        alternate, for a request with a step in flight, and with drafting off only for one with
        a verification in flight: ``schedule`` checks all three first.)"""
        if req.num_output_placeholders > 1:
            return True
        rid = req.request_id
        # NOTE: it sits out only if it may verify drafts in the step after this one.
        return rid in self._proposing and self.draft_backoff.allows(rid, len(self.running), ahead=1)

    def _drafts_to_schedule(self, req: Request, known: int, budget: int) -> list[int]:
        """The part of ``req``'s drafts this step can verify: only for a request whose one
        uncomputed token is its last (decoding), within the token budget and the context, and
        never more than ``max_tokens`` lets it emit (a step emits at most drafts + 1 tokens).

        A request with a step in flight (async scheduling) gets draft slots (``-1``) instead,
        which the runner fills once that step's tokens are known; ``known`` then counts every
        draft in flight as accepted, so the limits here are conservative. (Asked only while the
        batch drafts: ``schedule`` checks ``_drafting`` first.)"""
        if known - req.num_computed_tokens != 1 or not self.num_spec_tokens:
            return []
        if not self.draft_backoff.allows(req.request_id, len(self.running)):
            return []
        if req.num_output_placeholders:
            if self._alternate or req.sampling_params.structured_outputs is not None:
                return []
            drafts = [DRAFT_SLOT] * self.num_spec_tokens
        else:
            drafts = req.spec_token_ids
        limit = min(len(drafts), budget - 1, self.max_model_len - known)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - (known - req.num_prompt_tokens) - 1)
        return drafts[: max(limit, 0)]

    def _schedule_waiting(self, step: _Step) -> None:
        """Schedule waiting requests; those whose grammar is still compiling stay in the queue
        and do not hold up the ones behind them."""
        held = self._hold_grammar_waiters()
        try:
            if self.offload is not None and self.offload.ready:
                self._schedule_loaded(step)
            self._schedule_ready_waiting(step)
        finally:
            for req in reversed(self._lora_held):
                self.waiting.add_preempted(req)
            self._lora_held, self._lora_active = [], None
            for req in reversed(held):
                self.waiting.add_preempted(req)

    def _hold_grammar_waiters(self) -> list[Request]:
        """Take out of the queue the requests whose grammar is not compiled yet; fail those
        whose compile failed or timed out."""
        so = self.structured_output
        if so is None or not so.num_pending:
            return []
        held: list[Request] = []
        for req in [r for r in self.waiting if r.sampling_params.structured_outputs is not None]:
            try:
                if so.poll(req):
                    continue
                self.waiting.remove(req)
                held.append(req)
            except ValueError as e:
                self.waiting.remove(req)
                req.status = RequestStatus.FINISHED_ERROR
                req.stop_reason = str(e)
                self._release(req)
                self.grammar_errors.append(
                    EngineCoreOutput(req.request_id, [], "error", req.stop_reason)
                )
        return held

    def take_grammar_errors(self) -> list[EngineCoreOutput]:
        """The outputs of requests failed since the last call (finish reason ``error``)."""
        errors, self.grammar_errors = self.grammar_errors, []
        return errors

    def _schedule_ready_waiting(self, step: _Step) -> None:
        kv = self.kv_cache_manager
        while self.waiting and step.budget > 0:
            req = self.waiting.peek()
            if req.request_id in step.preempted:
                break  # pushed out by a better request this step; not back in the same step
            if not self._lora_fits(req):  # its adapter waits for a free slot
                self._lora_held.append(self.waiting.pop())
                continue
            if len(self.running) >= self.max_num_seqs:
                if self._preempt_worse_than(req, step):
                    continue
                break
            hit_blocks: list[KVCacheBlock] = []
            num_hit = 0
            # NOTE: a pooler that reads every prompt token's hidden state skips the prefix
            # cache (its hit's tokens would not be computed); its blocks are still cached.
            if req.num_computed_tokens == 0 and req.reads_prefix_cache:
                hit_blocks, num_hit = kv.get_computed_blocks(req)
                if (
                    self.offload is not None
                    and self.enable_chunked_prefill  # overlap computes the hit in chunks
                    and self.offload.try_overlap(req, kv, hit_blocks, num_hit)
                ):
                    self._start_overlap(req, num_hit, step)
                    continue
                if self.offload is not None and self.offload.try_load(req, kv, hit_blocks, num_hit):
                    self.waiting.pop()  # its prompt's blocks load from the CPU pool meanwhile
                    continue
            num_new = req.num_tokens - req.num_computed_tokens - num_hit
            if not self.enable_chunked_prefill and num_new > step.budget:
                break
            num_new = min(num_new, step.budget)
            mm = req.mm_inputs
            if mm is not None and req.num_computed_tokens + num_hit < mm.end:  # images ahead
                num_new = self._plan_images(req, req.num_computed_tokens + num_hit, num_new, step)
                if num_new <= 0:
                    break  # its next image waits for the encoder's budget or cache
            blocks = kv.allocate_slots(req, num_new, hit_blocks, num_hit)
            while blocks is None and self._preempt_worse_than(req, step):
                blocks = kv.allocate_slots(req, num_new, hit_blocks, num_hit)
            if blocks is None:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens += num_hit
            self.running.append(req)
            step.add(req, num_new, blocks, is_new=True)
            self._commit_images(req, req.num_computed_tokens, num_new, step)

    def _start_overlap(self, req: Request, num_hit: int, step: _Step) -> None:
        """Run a request whose CPU-pool hit is met from both ends (KV offload's overlap mode):
        it holds blocks for its whole prompt; this step computes the hit's first chunk."""
        self.waiting.pop()
        req.status = RequestStatus.RUNNING
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.num_computed_tokens += num_hit
        self.running.append(req)
        limit = self.offload.compute_limit(req, req.num_tokens)
        blocks = self.kv_cache_manager.req_to_blocks[req.request_id]
        step.add(req, min(limit - req.num_computed_tokens, step.budget), blocks, is_new=True)

    def _schedule_loaded(self, step: _Step) -> None:
        """Schedule the requests whose CPU-pool load is done, first: they hold blocks for their
        whole prompt already, so they need only a seat and the token budget."""
        for req in list(self.offload.ready):
            if step.budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if not self._lora_fits(req):
                continue
            num_new = req.num_tokens - req.num_computed_tokens
            if not self.enable_chunked_prefill and num_new > step.budget:
                return
            num_new = min(num_new, step.budget)
            blocks = self.kv_cache_manager.allocate_slots(req, num_new)
            if blocks is None:
                return
            self.offload.ready.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.add(req, num_new, blocks, is_new=True)

    def _ends_before(self, req: Request, known: int) -> bool:
        """Whether the tokens still being sampled for ``req`` surely end it (max_tokens or
        max_model_len), so that scheduling it again would compute a token nobody gets."""
        if not req.num_output_placeholders:
            return False
        max_tokens = req.sampling_params.max_tokens
        n_out = known - req.num_prompt_tokens
        return (max_tokens is not None and n_out >= max_tokens) or known >= self.max_model_len

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt_worse_than(self, req: Request, step: _Step) -> bool:
        """Under the priority policy, preempt the worst running request if it ranks strictly
        below ``req``; say whether one was preempted."""
        if self.policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=_priority_key)
        if _priority_key(victim) <= _priority_key(req):
            return False
        self._preempt(victim, step)
        return True

    def _preempt(self, req: Request, step: _Step) -> None:
        self.running.remove(req)
        step.drop(req)
        if self.offload is not None:
            self.offload.drop(req)  # met from both ends: its loads in flight
        self.kv_cache_manager.free(req)
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # what is in flight for it is dropped
        req.spec_token_ids = []
        self.draft_backoff.forget(req.request_id)
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_preempted(req)
        step.preempted.add(req.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        if model_runner_output.kv_offload_done and self.offload is not None:
            for req in self.offload.finish_jobs(model_runner_output.kv_offload_done):
                self.kv_cache_manager.cache_computed_blocks(req)  # the loaded blocks
        sampled = dict(zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids))
        scheduled_drafts = scheduler_output.scheduled_spec_decode_tokens
        proposed = model_runner_output.draft_token_ids
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        accepted = 0  # draft tokens accepted this step (for the speculation governor)
        step_tokens = 0  # tokens emitted this step (for the speculation governor)
        failed = model_runner_output.failed_requests
        # (which requests proposed drafts, where steps alternate: nothing to record in a step
        # that proposed none after one that proposed none)
        track_proposing = self.spec_alternate_from is not None and bool(proposed or self._proposing)
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # ended or preempted since it was scheduled: its token is dropped
            if failed and req_id in failed:  # the runner could not serve it: it ends alone
                req.status = RequestStatus.FINISHED_ERROR
                req.stop_reason = failed[req_id]
                any_finished = True
                self._release(req)
                outputs.append(EngineCoreOutput(req_id, [], "error", req.stop_reason))
                continue
            if req.is_pooling:
                pooled = model_runner_output.pooler_output.get(req_id)
                if pooled is not None:  # its prompt is computed: it ends with its output
                    req.status = RequestStatus.FINISHED_STOPPED
                    any_finished = True
                    self._release(req)
                    outputs.append(
                        EngineCoreOutput(
                            request_id=req_id,
                            new_token_ids=[],
                            finish_reason=req.status.finish_reason,
                            num_cached_tokens=max(req.num_cached_tokens, 0),
                            pooling_output=pooled,
                        )
                    )
                continue
            new_token_ids: list[int] = []
            tokens = sampled.get(req_id, ())
            drafts = scheduled_drafts.get(req_id)
            emitted = 1 + len(drafts) if drafts else len(tokens)  # as ``schedule`` counted
            req.num_output_placeholders = max(req.num_output_placeholders - emitted, 0)
            if drafts:
                filled = model_runner_output.draft_counts.get(req_id, len(drafts))
                self._apply_drafts(req, len(drafts), filled, len(tokens) - 1)
                accepted += max(len(tokens) - 1, 0)
            for token in tokens:
                req.output_token_ids.append(token)
                new_token_ids.append(token)
                if self._check_stop(req, token):
                    break
            step_tokens += len(new_token_ids)
            if drafts and not req.is_finished:
                # Blocks past the known tokens (and the step in flight) held only rejected drafts.
                self.kv_cache_manager.trim(req, max(req.num_tokens, req.num_computed_tokens))
            if req_id in proposed and not req.is_finished:
                self.set_drafts(req, proposed[req_id])
            if track_proposing and tokens:
                if req_id in proposed:
                    self._proposing.add(req_id)
                else:
                    self._proposing.discard(req_id)
            if new_token_ids and req_id in self.parked:
                self._unpark(req)
            if req.is_finished:
                any_finished = True
                self._release(req)
            prompt_logprobs = model_runner_output.prompt_logprobs.get(req_id)
            new_logprobs = model_runner_output.logprobs.get(req_id)
            if new_logprobs is not None and len(new_token_ids) < len(tokens):  # cut at a stop
                k = new_logprobs.token_ids.shape[1] - 1
                new_logprobs = new_logprobs.select(0, len(new_token_ids), k)
            if new_token_ids or req.is_finished or prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        finish_reason=req.status.finish_reason,
                        stop_reason=req.stop_reason,
                        num_cached_tokens=max(req.num_cached_tokens, 0),
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=prompt_logprobs,
                    )
                )
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if self.spec_governor is not None:
            clean = is_decode_step(
                scheduler_output.total_num_scheduled_tokens,
                len(scheduler_output.num_scheduled_tokens),
                scheduled_drafts,
                len(scheduler_output.scheduled_new_reqs),
            )
            by_request = None
            if self.spec_governor.counts_requests:
                by_request = {r.request_id: 0 for r in self.running}
                for o in outputs:
                    by_request[o.request_id] = len(o.new_token_ids)
            self.spec_governor.observe(step_tokens, len(self.running), clean, accepted, by_request)
        return outputs

    def _apply_drafts(
        self, req: Request, num_scheduled: int, num_drafts: int, num_accepted: int
    ) -> None:
        """Roll ``num_computed_tokens`` back over the drafts the rejection sampler refused and
        the draft slots the runner left empty.

        NOTE (for grammar backends and other draft-aware state): this is where the accepted
        count of a step is known; ``num_accepted`` of the ``num_drafts`` verified drafts (of
        ``num_scheduled`` drafts or slots) were accepted, and the step emitted
        ``num_accepted + 1`` tokens (before stop checks).
        """
        num_accepted = max(num_accepted, 0)
        req.num_computed_tokens -= num_scheduled - num_accepted
        self.draft_backoff.observe(req.request_id, num_drafts, num_accepted)
        if num_drafts:
            self.spec_stats.observe(num_drafts, num_accepted)
            self.spec_stats_total.observe(num_drafts, num_accepted)

    def set_drafts(self, req: Request, drafts: list[int]) -> None:
        """Attach the proposer's drafts to ``req`` for its next step.

        NOTE (for grammar backends): the place to validate or cut drafts before they are
        scheduled. Drafts are dropped when the request has a step in flight whose output is not
        back yet (async scheduling): they were proposed for a position already being computed,
        and its next step gets draft slots that the runner fills from fresher drafts.
        A request with a grammar (structured output) gets none for now: its matcher advances one
        token a step and its bitmask covers one position.
        """
        stale = req.num_output_placeholders or req.sampling_params.structured_outputs is not None
        req.spec_token_ids = [] if stale else drafts

    def make_spec_stats(self) -> SpecDecodingStats | None:
        """Drafts verified since the last call, then reset; None if there were none."""
        if not self.spec_stats.num_drafts:
            return None
        stats, self.spec_stats = self.spec_stats, SpecDecodingStats()
        return stats

    def _check_stop(self, req: Request, token: int) -> bool:
        """Set the finished status if ``token``, just appended, ends the request."""
        sp = req.sampling_params
        stop_ids = sp.stop_token_ids or ()
        if req.num_output_tokens >= sp.min_tokens:
            # all_stop_token_ids holds the model's EOS ids besides the user's stop tokens.
            is_eos = token == req.eos_token_id or (
                token in sp.all_stop_token_ids and token not in stop_ids
            )
            # NOTE: a grammar ends only with EOS, which then stops despite ignore_eos.
            if is_eos and (not sp.ignore_eos or sp.structured_outputs is not None):
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in stop_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if (
            sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens
        ) or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _release(self, req: Request) -> None:
        if self.structured_output is not None:
            self.structured_output.forget(req.request_id)
        self._unpark(req)
        self.draft_backoff.forget(req.request_id)
        self._proposing.discard(req.request_id)
        if self.offload is not None:
            self.offload.drop(req)  # met from both ends: its loads in flight
        self.kv_cache_manager.free(req)
        if self.encoder_cache is not None:
            self.encoder_cache.release_all(req)
        del self.requests[req.request_id]
        self.finished_req_ids.add(req.request_id)

    def finish_requests(
        self,
        req_ids: str | Iterable[str],
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> None:
        """End requests from outside (abort, stop string); unknown or finished ids are ignored."""
        if not finished_status.is_finished:
            raise ValueError(f"finished_status={finished_status!r} is not a finished status")
        for rid in (req_ids,) if isinstance(req_ids, str) else req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            parked = self.parked.get(req.prefill_leader or "", [])
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req in parked:
                parked.remove(req)
            elif self.offload is not None and self.offload.drop(req):
                pass  # it was loading from the CPU pool, or loaded
            else:
                self.waiting.remove(req)
            req.status = finished_status
            self._release(req)

    def _lora_fits(self, req: Request) -> bool:
        """Whether ``req`` may start running: it needs no adapter, or one that a running
        request uses, or there is a slot for one more (``lora.max_loras``)."""
        if self.max_loras is None or req.lora_request is None:
            return True
        active = self._lora_active
        if active is None:  # counted once a step; admitted adapters join it
            active = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
            self._lora_active = active
        lora_id = req.lora_request.lora_int_id
        if lora_id not in active:
            if len(active) >= self.max_loras:
                return False
            active.add(lora_id)
        return True

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The names of the adapters of the running requests, and of the waiting ones."""
        running = {r.lora_name for r in self.running if r.lora_request is not None}
        waiting = {r.lora_name for r in self.waiting if r.lora_request is not None}
        return sorted(running), sorted(waiting - running)

    @property
    def num_waiting(self) -> int:
        loading = 0 if self.offload is None else self.offload.num_waiting
        return len(self.waiting) + sum(len(p) for p in self.parked.values()) + loading

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_num_unfinished_requests(self) -> int:
        return self.num_waiting + len(self.running)

    def has_unfinished_requests(self) -> bool:
        # KV offload: copies still in flight need steps that wait for them.
        busy = self.offload is not None and self.offload.busy
        return self.get_num_unfinished_requests() > 0 or busy

    def has_finished_requests(self) -> bool:
        """Whether finished ids still wait to reach the runner with the next schedule()."""
        return bool(self.finished_req_ids)
