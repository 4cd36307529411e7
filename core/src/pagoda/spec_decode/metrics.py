"""Counts of drafts and accepted tokens, as vLLM reports them (``pagoda:spec_decode_*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodingStats:
    """Drafts verified over some steps: per request and step one *draft* of up to k tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at each position was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        self.accepted_per_pos = [a + b for a, b in zip(mine, theirs)]

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step emits per draft: accepted drafts plus the target's own
        (vLLM's "mean acceptance length"; 1.0 means nothing was accepted)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_metrics(self) -> dict[str, Any]:
        """The counters under the names ``/metrics`` gives them (a Prometheus counter's name
        ends in ``_total``; there each also carries the ``model_name`` label). The per-position
        counts are a list, index = position (``/metrics``: one series per ``position`` label)."""
        return {
            "pagoda:spec_decode_num_drafts_total": self.num_drafts,
            "pagoda:spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "pagoda:spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "pagoda:spec_decode_num_accepted_tokens_per_pos_total": list(self.accepted_per_pos),
        }

    def summary(self) -> str:
        """One line for a person: mean acceptance length, acceptance rate, per position."""
        if not self.num_drafts:
            return "SpecDecoding metrics: no drafts verified"
        per_pos = ", ".join(f"{n / self.num_drafts:.3f}" for n in self.accepted_per_pos)
        return (
            f"SpecDecoding metrics: Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} "
            f"tokens in {self.num_drafts} drafts, Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {100 * self.acceptance_rate:.1f}%"
        )
