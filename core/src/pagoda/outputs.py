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


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


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
