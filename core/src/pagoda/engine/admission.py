"""A batch of requests handed to the engine a step's worth at a time (``LLM``'s batches, the
embedding benchmark)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StepAdmission:
    """A batch's requests handed to the engine a step's worth at a time: ``add(i, request_id)``
    processes request ``i`` (tokenizes and checks its prompt), adds it under ``request_id`` and
    returns its prompt's length; ``ids`` are every request's ids, added or not.

    Processing and adding a request costs the host tens of microseconds (its ids checked and
    copied, its request built): for thousands of prompts, the first step would wait for all of
    them while the device idles. Each ``top_up`` adds requests until those added by the call
    fill a step, its token budget or its ``max_num_seqs`` requests (or none is left): the
    engine's waiting queue never holds less than a full step, so the steps are the ones adding
    the whole batch at once would give (first come, first served), and the first one starts as
    soon as it is full. ``at_once``: every request in the first call (priorities order the
    whole queue).
    """

    def __init__(
        self, engine: Any, count: int, add: Callable[[int, str], int], at_once: bool = False
    ) -> None:
        self.engine = engine
        self.add = add
        self.ids = [engine.new_request_id() for _ in range(count)]
        self.next = 0
        # The step's budgets as the engine runs them (a pooling model's token budget is its own).
        self.tokens = 1 << 62 if at_once else engine.info.max_num_batched_tokens
        self.reqs = count if at_once else engine.config.scheduler.max_num_seqs

    @property
    def added(self) -> list[str]:
        return self.ids[: self.next]

    def top_up(self) -> None:
        tokens = reqs = 0
        try:
            while self.next < len(self.ids) and tokens < self.tokens and reqs < self.reqs:
                tokens += self.add(self.next, self.ids[self.next])
                self.next += 1
                reqs += 1
        except BaseException:
            # A bad prompt, or a request the engine refused (an admission rule, say), takes the
            # batch with it: the requests added before it are aborted (their blocks return), and
            # the error is the caller's, as if every prompt had been checked first.
            self.engine.abort_request(self.added)
            raise
