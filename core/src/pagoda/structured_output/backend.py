"""The grammar-backend contract: what a structured-output plugin implements.

A backend is registered by name through ``register_grammar_backends``. The engine core builds
one instance per engine process (on the first constrained request) and compiles each request's
constraint with it in a thread pool; the model runner asks each compiled grammar for a matcher
per request and fills one token bitmask for the batch each step.

The bitmask layout is fixed by the core (the one xgrammar and vLLM use): ``int32`` of shape
``[rows, ceil(vocab_size / 32)]``; bit ``j`` of word ``i`` set means token ``32 * i + j`` is
allowed. A row of all ones (``-1``) allows everything. See ``docs/plugins.md``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pagoda.config import StructuredOutputConfig
    from pagoda.sampling_params import StructuredOutputsParams


def bitmask_width(vocab_size: int) -> int:
    """Words of 32 bits per bitmask row."""
    return (vocab_size + 31) // 32


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used by one thread at a time (the runner's)."""

    @abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance over ``tokens`` (ids, in order). Returns True if all were accepted; False at
        the first one refused (the ones before it stay accepted)."""

    @abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """Returns how many leading ``tokens`` the grammar accepts from here; the state is left
        unchanged (checks draft tokens)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most the ``max_rollback_tokens`` the
        matcher was made with). Returns nothing."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (CPU ``int32``, the
        core's layout). Returns nothing."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Returns whether the grammar has accepted its end (a stop token): nothing may
        follow."""


class CompiledGrammar(ABC):
    """A constraint compiled against the model's vocabulary: immutable, shared by every
    request with an equal constraint (the core caches it by ``StructuredOutputsParams.key()``)
    and by the threads that read it."""

    #: The backend class that compiled it (its class methods fill and apply bitmasks).
    backend: type[GrammarBackend]

    @abstractmethod
    def new_matcher(self, max_rollback_tokens: int = 0) -> GrammarMatcher:
        """Returns a new matcher at the start of the grammar, able to roll back
        ``max_rollback_tokens`` tokens."""

    def memory_bytes(self) -> int:
        """Returns the approximate size in bytes, for the cache's accounting; 0 if unknown."""
        return 0


class GrammarBackend(ABC):
    """Compiles constraints for one vocabulary; registered through ``register_grammar_backends``.

    ``__init__(tokenizer, vocab_size, stop_token_ids, config)``: the model's Hugging Face
    tokenizer, the number of logits columns (at least the tokenizer's vocabulary), the ids that
    end a request (EOS and the model's other end-of-turn ids: a grammar ends only with one of
    them) and the ``structured_output`` configuration section. A subclass's ``__init__`` must
    call ``super().__init__(tokenizer, vocab_size, stop_token_ids, config)``: the core and the
    conformance kit read ``self.tokenizer``, ``self.vocab_size``, ``self.stop_token_ids`` and
    ``self.config``. A backend need not support every kind of constraint: ``validate`` refuses
    one it does not with a ``ValueError`` naming it, and the kit skips that kind.
    """

    #: Preference when ``structured_output.backend`` is ``auto``: the highest wins.
    priority: ClassVar[int] = 0

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: StructuredOutputConfig,
    ) -> None:
        """Build the backend for one vocabulary: ``tokenizer`` (the model's Hugging Face
        tokenizer), ``vocab_size`` (the logits width), ``stop_token_ids`` (the ids a grammar
        may end with) and ``config`` (the ``structured_output`` section)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.config = config

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the problem if ``params`` is invalid or unsupported (a bad
        schema, regex or grammar); returns None otherwise. Called at admission, in the process
        that takes requests, with no tokenizer: it must be quick (parse, do not compile)."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Returns ``params`` compiled for this vocabulary (a :class:`CompiledGrammar`). Runs in
        the core's compile threads, several at once; may take long (the core gives up after
        ``compile_timeout_s``). Raises ``ValueError`` naming the problem for a constraint it
        cannot compile."""

    @classmethod
    def fill_bitmasks(
        cls, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` for ``matchers[i]``, every row of one step at once
        (a backend may use threads); other rows are left alone. Returns nothing. The default
        calls each matcher in turn."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    @classmethod
    def accept_batch(cls, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        """Advance each of ``matchers`` over its token in ``tokens``. Returns one bool each:
        whether the token was accepted. The default calls each matcher in turn."""
        return [m.accept_tokens((t,)) for m, t in zip(matchers, tokens)]

    @classmethod
    def apply_bitmask(cls, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """For each row ``r`` in ``rows``, set ``logits[r, t]`` to -inf for every token ``t``
        that ``bitmask[r]`` does not allow, in place; returns nothing. ``logits``: ``[n, vocab]``
        float32 and ``bitmask``: ``[n, words]`` int32, both on the logits' device; other rows are
        left alone. The default is :func:`apply_token_bitmask`."""
        apply_token_bitmask(logits, bitmask, rows)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The reference way to apply a bitmask, in torch on any device: unpack the rows' words
    into a boolean ``[len(rows), vocab]`` mask and fill -inf where a bit is clear."""
    vocab = logits.shape[-1]
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    all_rows = len(rows) == logits.shape[0]
    idx = None if all_rows else torch.tensor(rows, dtype=torch.int64).to(logits.device)
    words = bitmask[: logits.shape[0]] if all_rows else bitmask[idx]
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [k, words, 32]
    refused = bits.reshape(words.shape[0], -1)[:, :vocab] == 0
    if all_rows:
        logits.masked_fill_(refused, float("-inf"))
    else:
        logits[idx] = logits[idx].masked_fill_(refused, float("-inf"))
