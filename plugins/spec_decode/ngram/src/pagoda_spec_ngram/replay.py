"""What n-gram settings would give on a workload, without a model: replay the proposer over
greedy outputs already generated.

Under greedy decoding a verification step accepts the longest prefix of the drafts that equals
the tokens the model produces anyway, plus the model's own next token. Given a request's prompt
and its greedy output, the step-by-step behaviour of prompt lookup is therefore fixed: each step
proposes from the history so far, accepts as far as the drafts agree with the output, and moves
on. Replaying that takes milliseconds, so ``num_speculative_tokens``, ``prompt_lookup_min`` and
``prompt_lookup_max`` can be chosen for a workload from one generation without speculation
(``benchmarks/ngram_settings.py``). The replay takes the steps that an engine drafting on every
step takes at batch 1 (draft slots, with ``adaptive: false``), one request at a time; at larger
batches it is the drafts' side of the trade only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagoda_spec_ngram.proposer import ngram_drafts


@dataclass
class Replay:
    output_tokens: int = 0
    steps: int = 0  # engine steps, the prompt's (one, unchunked) included
    verifications: int = 0  # steps that scored drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def __iadd__(self, other: Replay) -> Replay:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        return self

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per engine step after the prompt's (1.0: speculation gains nothing)."""
        decode = self.steps - (self.output_tokens > 0)
        return (self.output_tokens - (self.output_tokens > 0)) / decode if decode else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step emits, its bonus token included (as the engine reports)."""
        return 1 + self.accepted_tokens / self.verifications if self.verifications else 0.0


def replay(
    prompt: Sequence[int],
    output: Sequence[int],
    k: int,
    min_n: int,
    max_n: int,
    max_tokens: int | None = None,
) -> Replay:
    """The steps prompt lookup takes to produce ``output`` (greedy) after ``prompt``, with at
    most ``max_tokens`` output tokens allowed."""
    r = Replay(output_tokens=len(output))
    if not output:
        return r
    hist = np.zeros((1, len(prompt) + len(output)), dtype=np.int64)
    hist[0, : len(prompt)] = prompt
    hist[0, len(prompt) :] = output
    row = np.zeros(1, dtype=np.int64)
    done = 1  # the prompt's step samples the first token
    r.steps = 1
    # The scheduler gives a step its draft slots while the step before is in flight, counting
    # that step's slots as accepted: near max_tokens it gives fewer than the output left allows.
    before, slots = 0, 0  # the step in flight's tokens before it, and its draft slots
    while done < len(output):
        limit = k if max_tokens is None else min(k, max_tokens - (before + 1 + slots) - 1)
        before, slots = done, max(limit, 0)
        # Drafts past the output's end are not replayed: the request ends within this step.
        cap = min(slots, len(output) - done - 1)
        drafts = np.zeros(0, dtype=np.int64)
        if cap > 0:
            known = np.array([len(prompt) + done], dtype=np.int64)
            found = ngram_drafts(hist, row, known, min_n, max_n, k, np.array([cap]))[0]
            drafts = found[found >= 0]
        agree = drafts == np.asarray(output[done : done + len(drafts)])
        accepted = len(drafts) if agree.all() else int(agree.argmin())
        r.steps += 1
        if len(drafts):
            r.verifications += 1
            r.draft_tokens += len(drafts)
            r.accepted_tokens += accepted
        done += accepted + 1
    return r
