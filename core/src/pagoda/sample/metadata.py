"""Per-step sampling settings of the rows that sample, as tensors on the model's device.

Every optional field is None when no row of the step uses that feature, so a feature nobody asked
for costs nothing; ``SamplingMetadata.greedy()`` is the all-greedy fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagoda.step import LogprobsArrays


class LogitsMask(Protocol):
    """A mask the sampler applies to the processed float32 logits of the step's sampling rows,
    in place or not, before any other processing (structured output's grammar bitmask)."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class Penalties:
    presence: torch.Tensor  # [n] float32 (OpenAI: subtracted once from every output token)
    frequency: torch.Tensor  # [n] float32 (OpenAI: subtracted once per occurrence in the output)
    repetition: torch.Tensor  # [n] float32 (transformers: over prompt and output tokens)
    output_counts: torch.Tensor  # [n, vocab] float32: occurrences of each token in the output
    prompt_mask: torch.Tensor  # [n, vocab] bool: tokens present in the prompt


@dataclass
class SamplingMetadata:
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None  # [n] float32; greedy rows hold 1.0
    greedy_mask: torch.Tensor | None = None  # [n] bool; None when all greedy or all random
    top_k: torch.Tensor | None = None  # [n] int64, vocab size where a row has no top-k
    max_top_k: int = 0  # the largest top-k of a row that has one (a host int: no device sync)
    top_p: torch.Tensor | None = None  # [n] float32, 1.0 where disabled
    min_p: torch.Tensor | None = None  # [n] float32, 0.0 where disabled
    # [n] float64 in [0, 1): each random row's draw; seeded rows' come from (seed, position).
    uniform: torch.Tensor | None = None
    max_num_logprobs: int | None = None  # the largest ``logprobs`` k of a row that asked
    allowed_mask: torch.Tensor | None = None  # [n, vocab] bool: True where a token is not allowed
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (row, token) pairs set to -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (row, token, bias)
    penalties: Penalties | None = None
    req_ids: list[str] | None = None  # the request of each row, for logits processors
    # Structured output: the step's token bitmask of the constrained rows.
    grammar: LogitsMask | None = None

    @classmethod
    def greedy(cls) -> SamplingMetadata:
        return cls(all_greedy=True, all_random=False)

    @property
    def plain(self) -> bool:
        """Whether the rows draw from the model's logits as they are: no row asks for logprobs,
        and no setting masks, biases, penalises or filters them (greedy rows take the argmax,
        random rows draw at their temperature). Every fast path reads this, and only this, about
        the settings: the one-kernel draw (``Sampler``), a step of greedy rows built with no
        metadata (``SamplingRows.plain``), the greedy verification graphs.

        NOTE: a new setting that acts on the logits is an optional field above, named here."""
        return (
            self.max_num_logprobs is None
            and self.top_k is None
            and self.top_p is None
            and self.min_p is None
            and self.allowed_mask is None
            and self.banned is None
            and self.logit_bias is None
            and self.penalties is None
            and self.grammar is None
        )


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [n, 1 + k] int64: column 0 the chosen token, then the top k
    logprobs: torch.Tensor  # [n, 1 + k] float32
    ranks: torch.Tensor  # [n] int64: the rank of the chosen token (1 = most likely)

    @staticmethod
    def cat(parts: list[LogprobsTensors]) -> LogprobsTensors:
        return LogprobsTensors(
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.ranks for p in parts]),
        )

    def to_host(self) -> LogprobsTensors:
        """Copies on the host, started without waiting (pinned when on CUDA); read them only
        after the device has passed this point (an event)."""
        return LogprobsTensors(
            *(t.to("cpu", non_blocking=True) for t in (self.token_ids, self.logprobs, self.ranks))
        )

    def to_arrays(self) -> LogprobsArrays:
        return LogprobsArrays(
            self.token_ids.cpu().numpy(), self.logprobs.cpu().numpy(), self.ranks.cpu().numpy()
        )


@dataclass(slots=True)
class SamplerOutput:
    sampled: torch.Tensor  # [n] int64
    logprobs: LogprobsTensors | None  # when some row asked for ``logprobs``
