"""Per-request pooling settings (embeddings, classification, scores), with vLLM's names.

A pooling request runs its prompt through the model and returns what a pooler makes of the
prompt's hidden states instead of sampling tokens. The engine fills in what only the model knows
(``resolve``): the pooling type and the defaults of the model's pooling config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: What a pooling request asks for. ``embed``: one vector per prompt; ``token_embed``: one per
#: prompt token (late interaction); ``classify``: the sequence classification head's outputs;
#: ``score``: a cross-encoder's relevance of a pair (its one label).
POOLING_TASKS = ("embed", "token_embed", "classify", "score")

#: How a prompt's hidden states become one vector: its last token, its first (CLS), the mean over
#: its tokens; ``ALL`` keeps every token's.
POOLING_TYPES = ("LAST", "CLS", "MEAN", "ALL")


@dataclass
class PoolingParams:
    """vLLM's names: ``task``, ``dimensions`` (Matryoshka truncation of an embedding),
    ``normalize`` (L2, for embeddings; None: the model's default), ``activation`` (softmax over a
    classifier's labels, sigmoid for a single-label score; None: on), ``truncate_prompt_tokens``
    (keep the prompt's last k tokens; -1: as many as the model takes). Invalid values raise
    ``ValueError`` naming the field."""

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Filled in by ``resolve`` (the engine): the pooling the model's config asks for this task.
    pooling_type: str = ""

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(
                f"PoolingParams.task={self.task!r}: want one of {', '.join(POOLING_TASKS)}"
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise ValueError(f"PoolingParams.dimensions={self.dimensions!r}: want an int >= 1")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens={t!r}: want -1 or an int >= 1")
        if self.pooling_type and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"PoolingParams.pooling_type={self.pooling_type!r}")

    def with_task(self, task: str) -> PoolingParams:
        """A copy for ``task`` (the entry point's: ``LLM.embed`` asks ``embed``); a different task
        already set is an error naming both."""
        if self.task is not None and self.task != task:
            raise ValueError(f"PoolingParams.task={self.task!r}, but this call asks for {task!r}")
        return dataclasses.replace(self, task=task)

    @property
    def needs_every_token(self) -> bool:
        """Whether the pooler reads the hidden state of every prompt token (all but ``LAST``):
        such a request cannot take a prefix-cache hit, whose tokens it would not see."""
        return self.pooling_type != "LAST"
