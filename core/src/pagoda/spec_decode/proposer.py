"""The proposer contract: what a speculative proposer receives each step and what it returns.

A proposer guesses the next few tokens of each running request (its *drafts*); the target model
scores every draft in the next step's forward and the rejection sampler keeps the longest prefix
the target agrees with, plus one token of its own (``pagoda.sample.rejection``). Output is
the same as without speculation (greedy) or has the same distribution (sampling), whatever the
proposer returns: a bad proposer only costs time.

Life cycle, in the process that runs the model (every worker with several):

1. ``__init__(ctx)``: once, when the model runner is built (before the weights load). ``ctx`` is
   a :class:`ProposerContext`.
2. ``bind_target(target)``: once, after the target's weights loaded and its KV cache was
   allocated, before CUDA graphs are captured (a draft model loads its weights here, shares the
   target's embedding or LM head, and allocates its own cache). ``target`` is a
   :class:`TargetModel`.
3. ``propose(batch)``: once per engine step that sampled tokens, after that step's tokens are on
   the host, for the requests that sampled (a request still prefilling its prompt is not in it).
   Returns :class:`Drafts` for the *next* step. With async scheduling and draft slots
   (below 8 running requests) a proposer without ``needs_hidden_states`` is called only for
   the requests whose next step has draft slots (``max_num_drafts`` is their count), when that
   step is about to launch.
4. ``remove(req_ids)``: when requests finish, are aborted or preempted (their state may go).

Drafts are a suggestion: the core may schedule fewer (token budget, ``max_tokens``, the context
limit, KV cache pressure) or none (a request whose drafts keep being rejected backs off:
``pagoda.scheduler.draft_policy``), or a request that alternates sits a step out before its
drafts are verified. A proposer must not assume its drafts were scheduled; the accepted tokens
reach it as ordinary history in ``batch.token_ids`` at its next call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from pagoda.config import EngineConfig, SpeculativeConfig
from pagoda.model_info import ModelInfo
from pagoda.plugins import get_registry

if TYPE_CHECKING:
    from pydantic import BaseModel

    from pagoda.attention.backend import AttentionBackend


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer learns about the engine once, at construction."""

    config: SpeculativeConfig  # the ``speculative`` section (method, num_speculative_tokens, ...)
    vocab_size: int
    hidden_size: int
    max_num_reqs: int  # rows of ``ProposalBatch.token_ids``
    max_model_len: int
    device: torch.device  # the target model's device
    dtype: torch.dtype  # the target model's dtype (of ``ProposalBatch.hidden_states``)

    @property
    def num_speculative_tokens(self) -> int:
        """k: the most drafts a request takes in a step (``Drafts`` has at most k columns)."""
        return self.config.max_num_drafts

    @property
    def draft_length_given(self) -> bool:
        """Whether the user fixed the draft length (``num_speculative_tokens``); if not, a
        proposer should choose each request's (up to k) from what it measures."""
        return self.config.draft_length_given

    def plugin_settings(self, name: str) -> BaseModel:
        """The proposer's own settings: the ``plugins.<name>`` section checked against the
        model registered with ``register_plugin_settings`` (defaults for what is not given)."""
        return self.config.plugin_settings(name)


@dataclass
class ProposalBatch:
    """The requests to propose for in one call; ``n`` of them, index ``i`` in every array.

    NOTE: ``token_ids`` is the model runner's own persistent array, passed without a copy: read
    it, never write it, and copy what you keep between calls.
    """

    req_ids: list[str]  # [n]
    rows: np.ndarray  # [n] int64: each request's row in ``token_ids``
    token_ids: np.ndarray  # [max_num_reqs, >= max_model_len] int64, host; row r's history
    num_tokens: np.ndarray  # [n] int64: known tokens (prompt + output, this step's included)
    num_prompt_tokens: np.ndarray  # [n] int64
    max_num_drafts: np.ndarray  # [n] int64, >= 1: drafts past this are dropped
    # [n, hidden_size] in ``ctx.dtype`` on ``ctx.device``: the target's last hidden state at the
    # position that produced each request's newest token. Only for ``needs_hidden_states``.
    hidden_states: torch.Tensor | None = None
    # Only for ``needs_hidden_states``: every position the target computed for request i since
    # it last sampled, up to the one that produced its newest token (a prompt's chunks, or the
    # last known token and the accepted drafts), oldest first. Rows ``hidden_loc[i] :
    # hidden_loc[i + 1]`` hold positions ``num_tokens[i] - 1 - m_i .. num_tokens[i] - 2`` (m_i
    # rows; the token each position was followed by is ``token_ids[rows[i], position + 1]``).
    # Each row concatenates the hidden states of ``hidden_state_layers`` in order, or is the
    # final (normed) hidden state when the proposer names no layer. Positions the target did
    # not compute (prefix cache hits, or before a preemption) are not in it.
    new_hidden_states: torch.Tensor | None = None  # [m, hidden_size * max(1, len(layers))]
    hidden_loc: np.ndarray | None = None  # [n + 1] int64, offsets into ``new_hidden_states``
    # What a step with draft slots (one that waits for the step in flight, to be filled from its
    # tokens) costs at this batch size beyond a step without, as the runner measured it, in
    # steps without (0.5: one and a half); None while not measured, or where drafts are not
    # proposed into slots. A proposer that pauses requests may weigh their drafts against it
    # (``pagoda.spec_decode.DraftPause``).
    slot_cost: float | None = None

    def __len__(self) -> int:
        return len(self.req_ids)

    def history(self, i: int) -> np.ndarray:
        """Request ``i``'s tokens so far (a view; for tests and simple proposers)."""
        return self.token_ids[self.rows[i], : self.num_tokens[i]]


@dataclass
class VerifiedBatch:
    """The requests of a step that verified drafts, as the step's launch leaves them: on the
    device, nothing read yet (``SpeculativeProposer.draft_after_verify``). ``n`` requests."""

    req_ids: list[str]  # [n]
    rows: np.ndarray  # [n] int64: rows of the runner's token_ids
    first: np.ndarray  # [n] int64: the position of each request's last known token
    num_rows: np.ndarray  # [n] int64: positions computed from ``first`` on (1 + its drafts)
    # [n, w] int64 on the device: the tokens after positions ``first ..``: the accepted drafts
    # and the target's own token, then -1; ``num_emitted`` [n] of them are valid.
    tokens: torch.Tensor
    num_emitted: torch.Tensor
    # Rows ``hidden_loc[i] : hidden_loc[i + 1]`` hold the hidden states of positions
    # ``first[i] .. first[i] + num_rows[i] - 1`` (as ``ProposalBatch.new_hidden_states``; those
    # past ``num_emitted[i] - 1`` were rejected).
    new_hidden_states: torch.Tensor | None
    hidden_loc: np.ndarray | None
    # For a proposer that ``drafts_on_device`` (no hidden states: the two fields above are
    # None): the runner's token array (``ProposalBatch.token_ids``; read it, never write it),
    # whose rows hold each request's tokens up to ``first`` (inclusive) as the step launched.
    token_ids: np.ndarray | None = None


# ``Drafts.counts`` of at most this many requests runs a row at a time.
_ROWS_IN_PYTHON = 4


@dataclass
class Drafts:
    """A proposer's answer: up to ``k`` draft tokens per request of the batch.

    ``token_ids`` has ``k'`` columns, ``k' <= k`` (``ctx.num_speculative_tokens``), in every
    scheduling mode; the engine refuses more (``ValueError``), and uses at most
    ``ProposalBatch.max_num_drafts[i]`` of row ``i``. ``token_ids[i, :m]`` are request ``i``'s
    drafts, where ``m`` is the count of leading entries that are valid ids (``0 <= id <
    vocab_size``); ``-1`` pads. A row of ``-1`` proposes nothing. ``probs``, if given, is the
    proposer's distribution q at each draft position, [n, k', vocab]
    float32 on the device; without it every draft counts as certain (one-hot q), which is exact
    for a proposer that does not sample its drafts (n-gram, greedy draft models).
    """

    token_ids: np.ndarray  # [n, k'] int64, k' <= k
    probs: torch.Tensor | None = None  # [n, k', vocab] float32 or None

    @staticmethod
    def empty(n: int) -> Drafts:
        return Drafts(np.full((n, 0), -1, dtype=np.int64))

    def counts(
        self, vocab_size: int, max_num_drafts: np.ndarray, k: int | None = None
    ) -> np.ndarray:
        """[n] int64: how many leading drafts of each request are usable ids (capped). With
        ``k`` (``num_speculative_tokens``), more than ``k`` columns is a ``ValueError``."""
        ids = self.token_ids
        if (
            ids.ndim != 2
            or ids.shape[0] != len(max_num_drafts)
            or (k is not None and ids.shape[1] > k)
        ):
            want = f"[{len(max_num_drafts)}, <= {'k' if k is None else k}]"
            if ids.ndim != 2 or ids.shape[0] != len(max_num_drafts):
                raise ValueError(f"a proposer returned drafts of shape {ids.shape}; want {want}")
            raise ValueError(
                f"a proposer returned {ids.shape[1]} draft columns, more than "
                f"speculative.num_speculative_tokens={k}; want {want}"
            )
        if len(ids) <= _ROWS_IN_PYTHON:
            # NOTE: a few requests (batch 1 above all): a row at a time in Python, where the
            # arrays' five numpy calls cost more (this is on the host's critical path when
            # drafts are proposed at launch).
            out = []
            for row, cap in zip(ids.tolist(), max_num_drafts.tolist()):
                n = next((j for j, t in enumerate(row) if not 0 <= t < vocab_size), len(row))
                out.append(min(n, cap))
            return np.array(out, dtype=np.int64)
        ok = (ids >= 0) & (ids < vocab_size)
        leading = np.cumprod(ok, axis=1).sum(axis=1) if ids.shape[1] else np.zeros(len(ids))
        return np.minimum(leading.astype(np.int64), max_num_drafts)


@dataclass(frozen=True)
class TargetModel:
    """The target model and its paged KV cache, for a proposer that runs a draft model beside it
    (``SpeculativeProposer.bind_target``). Read everything; change nothing."""

    model: torch.nn.Module  # the target (``model.model.embed_tokens``, ``compute_logits``, ...)
    num_hidden_layers: int
    attn_backend: type[AttentionBackend]  # the target's attention backend
    num_blocks: int  # blocks of the target's KV cache (a draft's cache can be parallel to it)
    block_size: int
    # The runner's own per-row block tables (row r of ``ProposalBatch.token_ids``): its first
    # ``num_row_blocks[r]`` entries are the row's blocks now; the rest are stale.
    block_table: np.ndarray  # [max_num_reqs, max_blocks_per_req] int32, host
    num_row_blocks: np.ndarray  # [max_num_reqs] int64, host


class SpeculativeProposer(ABC):
    """Base class of proposers; register a subclass with ``register_spec_proposers``.

    Class attributes say what the proposer needs from the core:
    ``needs_hidden_states``: pass ``ProposalBatch.hidden_states`` and ``new_hidden_states``
    (costs a device gather a step).
    ``hidden_state_layers`` (may be set on the instance up to ``bind_target``): the target
    layers whose *input* (the residual stream entering layer ``i``, ``i == num_hidden_layers``:
    the stream after the last layer, before the final norm) ``new_hidden_states``
    concatenates; empty: the final normed hidden state. They come from the forward the target
    ran anyway (no second forward), CUDA graphs included.
    A proposer gets no KV cache of its own from the core in plugin API 1: a draft model keeps its
    own (the target's blocks hold only the target's KV, draft positions included while they are
    verified), for instance a tensor parallel to the target's cache, indexed by the target's
    block tables (``TargetModel``).
    """

    needs_hidden_states: ClassVar[bool] = False
    # ``propose`` reads only the batch's host arrays (token history) and launches and waits for
    # nothing on the device (n-gram, suffix). On CUDA the runner may then launch the next
    # verification before it reads the step in flight and calls ``propose``, the device waiting
    # for the drafts the host writes (``pagoda.worker.late_drafts``). A proposer that sets it
    # and then waits on the device anyway holds the host and the device for that wait's bound
    # (30 s) each step; it must also return no ``probs``. Default False (never late).
    proposes_on_host: ClassVar[bool] = False
    hidden_state_layers: tuple[int, ...] = ()
    # A proposer that reads only history but drafts on the device behind a verification sets
    # this (on the instance, in its constructor): the runner then calls its
    # ``draft_after_verify`` for every step that verified drafts (a ``VerifiedBatch`` with
    # ``token_ids`` and no hidden states) and asks its ``drafts_ahead`` before reading the step
    # in flight, as for a draft model's.
    drafts_on_device: bool = False
    # Requests that will propose nothing before they know this many tokens (a back-off): the
    # runner does not ask for them until then, and keeps their hidden states for that call
    # (``new_hidden_states`` then covers every position since the request was last asked).
    # The proposer sets and clears entries; ``remove`` should drop them.
    resume_at: dict[str, int]

    @classmethod
    def paces_itself(cls, config: SpeculativeConfig) -> bool:
        """Returns whether, under ``config`` (the ``speculative`` section), the proposer drafts
        only what it measured to pay (each request's length from its acceptance and the measured
        cost of a draft token, :class:`pagoda.spec_decode.DraftCost`), so that at batch 1 the
        speculation governor leaves drafting on instead of measuring it in epochs. Called once,
        at start, on the class. Default False."""
        return False

    def __init__(self, ctx: ProposerContext) -> None:
        """Called once per model runner, when it is built: ``ctx`` (a :class:`ProposerContext`)
        holds the speculative section of the configuration, the model's sizes, the device and
        the dtype."""
        self.ctx = ctx
        self.resume_at = {}

    def kv_cache_block_bytes(self, block_size: int) -> int:
        """Called when the target's KV cache is sized (before ``bind_target``), with
        ``cache.block_size`` as ``block_size``. Returns the bytes a draft model will allocate per
        block of the target's cache (a cache parallel to it), so that the cache budget counts
        them; default 0."""
        return 0

    def bind_target(self, target: TargetModel) -> None:  # noqa: B027 (optional to override)
        """Called once, after the target's weights loaded and its KV cache was allocated, before
        CUDA graphs are captured: ``target`` (a :class:`TargetModel`). A draft model loads its
        weights here; a checkpoint that does not fit the target raises, naming the mismatch.
        Returns nothing."""

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> Drafts:
        """Drafts for every request of ``batch`` (see :class:`Drafts`). Called once per step on
        the host, between steps; it should be vectorised over the batch (no Python loop over
        tokens). It may keep per-request state between calls, keyed by ``req_ids``. Returns the
        :class:`Drafts` of the step."""

    def settle(self) -> None:  # noqa: B027 (optional to override)
        """Called by the runner once the step that ``propose``'s drafts were for is launched
        (the device busy with it), and at the start of the next launch, before anything reads
        ``resume_at``: the place for a proposer's bookkeeping of its last call (what it gave,
        its pauses, its timing), off the host's critical path, which runs from reading the step
        in flight to launching the next (at batch 1 every microsecond there is a microsecond of
        the step). A proposer that defers work here also does it at the start of its next
        ``propose`` and ``remove``, where ``settle`` was not called (a caller of its own).
        Returns nothing; the default does nothing."""

    def draft_after_verify(self, batch: VerifiedBatch) -> None:  # noqa: B027 (optional)
        """Called, for a proposer with ``needs_hidden_states`` or ``drafts_on_device``, in the
        launch of a step that verified drafts, right after verification and before the host
        waits for anything:
        ``batch`` (a :class:`VerifiedBatch`) holds the outcome on the device. A draft model
        may start its next drafts here, on the device, so that they run behind the step;
        ``propose`` must still return them (it gets the same requests' rows again when the
        step is read). Returns nothing."""

    def drafts_ahead(
        self, req_ids: list[str], num_tokens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional, for a proposer that drafts in ``draft_after_verify``: the drafts that the
        next ``propose`` is sure to return, all ``k`` of them, for the requests ``req_ids`` of
        the step in flight (whose ``draft_after_verify`` ran, in its launch), before that step
        is read and whatever it accepts. ``num_tokens`` [n]: each request's tokens before
        that step, a lower bound of what ``propose`` will see. Returns ``(on_device, on_host)``,
        both [n, k] int64 (the host copy may be in flight until the step's output is read), or
        None where any request's drafts could differ (then the runner waits for the step).
        With it the runner launches the next verification before reading the step in flight
        (``pagoda.worker.drafts_ahead``). Default None."""
        return None

    def remove(self, req_ids: Iterable[str]) -> None:  # noqa: B027 (optional to override)
        """Forget the requests ``req_ids``: finished, aborted or preempted (their ids may come
        back later, as a resumed request, with the same history). Returns nothing."""


def build_proposer(ctx: ProposerContext) -> SpeculativeProposer | None:
    """The proposer ``ctx.config.method`` names, or None when speculation is off. An unknown
    method raises an error that lists the installed ones."""
    method = ctx.config.method
    if method is None:
        return None
    cls = get_registry("spec_proposers").get(method)
    proposer = cls(ctx)
    if not isinstance(proposer, SpeculativeProposer):
        raise TypeError(
            f"speculative proposer {method!r} built a {type(proposer).__name__}, which is not a "
            "pagoda.spec_decode.SpeculativeProposer"
        )
    return proposer


def proposer_paces_itself(config: SpeculativeConfig) -> bool:
    """``SpeculativeProposer.paces_itself`` of the proposer ``config.method`` names (False for
    none, or for a factory, which tells nothing before it builds)."""
    if config.method is None:
        return False
    target = get_registry("spec_proposers").get(config.method)
    paces = getattr(target, "paces_itself", None)
    return bool(paces(config)) if isinstance(target, type) and callable(paces) else False


def check_speculative(config: EngineConfig, info: ModelInfo) -> None:
    """At start, before any worker: the ``speculative`` section against the model's length, the
    step's token budget and the proposer it names (``SpeculativeConfig.check`` holds the rules).
    An unknown method raises an error that lists the installed ones."""
    method = config.speculative.method
    needs_hidden_states = False
    if method is not None:
        target = get_registry("spec_proposers").get(method)
        # NOTE: a factory (not a class) tells nothing before it builds: taken as history only.
        needs_hidden_states = bool(getattr(target, "needs_hidden_states", False))
    config.speculative.check(
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        max_model_len=info.max_model_len,
        max_num_batched_tokens=info.max_num_batched_tokens,
        needs_hidden_states=needs_hidden_states,
    )
