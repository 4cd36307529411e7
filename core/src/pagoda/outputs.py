"""What ``LLM.generate`` and the pooling calls (``LLM.embed``, ...) return, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """One token's log probability under the model's own distribution (before any sampling
    setting changed it), its rank in that distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob, the chosen (or prompt) token first, then the top k by rank.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n`` of them when ``SamplingParams.n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None  # one per token, when asked for
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when asked for

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # One per prompt token when asked for; the first is None (nothing precedes it).
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's name): ``data`` is a float32 numpy array, an embedding
    ``[dims]``, a classifier's ``[labels]``, or ``[prompt tokens, dims]`` for token embeddings."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """What ``LLM.encode`` returns for one prompt; ``LLM.embed``/``classify``/``score`` return
    its typed views below."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None


class EmbeddingOutput:
    """One embedding: ``data`` as the engine made it (a float32 numpy array, or the sequence
    given), and ``embedding`` (vLLM's list of floats), made from it when first read.

    NOTE: the list is not made up front: a thousand Python floats a prompt cost the host more
    than the device's step of that prompt's tokens (made, then walked by the collector and
    freed), and a caller that takes the array (``data``, as sentence-transformers returns)
    pays none of it."""

    __slots__ = ("data", "_list")

    def __init__(self, embedding: Any) -> None:
        self.data = embedding
        self._list = embedding if isinstance(embedding, list) else None

    @property
    def embedding(self) -> list[float]:
        if self._list is None:
            self._list = self.data.tolist()
        return self._list

    @property
    def hidden_size(self) -> int:
        return len(self.data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EmbeddingOutput):
            return NotImplemented
        return self.embedding == other.embedding

    __hash__ = None  # type: ignore[assignment]  # (mutable, compared by value: as a dataclass)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(embedding={self.embedding!r})"


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """``probs``: the classifier's probabilities (softmax; its raw logits when the request's
    ``activation`` is off)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
