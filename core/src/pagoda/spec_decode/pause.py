"""Pauses for requests a proposer finds nothing to draft for.

With async scheduling a step with draft slots waits for the step in flight before it launches,
so that the proposer can draft from its tokens (``pagoda.worker.draft_slots``); a step whose
slots then stay empty gave up the host-device overlap for nothing. On an H200 (SmolLM2 at batch
1, the open prompt set) 1,676 of 1,713 steps had slots and 450 had drafts: 1.68 ms a step where
plain steps, each launched while the last ran, took 1.18. A proposer that knows it will draft
nothing for a request says so through ``SpeculativeProposer.resume_at``, and the runner then
launches without waiting and is not asked for that request until then.

:class:`DraftPause` keeps those entries for proposers whose drafts come from the history alone
(n-gram, suffix): after ``patience`` proposals in a row found no draft for a request, it pauses
1, 2, 4 ... up to ``max_pause`` steps between probes; a draft found ends the pause.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PATIENCE = 3  # proposals in a row with no draft before a request pauses
MAX_PAUSE = 8  # steps between probes at most: a copy that starts is found within that many


class DraftPause:
    """The pauses of one proposer's requests, kept in its ``resume_at`` (see the module)."""

    def __init__(
        self, resume_at: dict[str, int], patience: int = PATIENCE, max_pause: int = MAX_PAUSE
    ) -> None:
        self.resume_at = resume_at
        self.patience = patience
        self.max_pause = max_pause
        self._misses: dict[str, tuple[int, int]] = {}  # req_id -> (empty proposals, next pause)

    def update(self, req_ids: Sequence[str], num_tokens: np.ndarray, found: np.ndarray) -> None:
        """A call's outcome: request ``i`` (``req_ids[i]``, knowing ``num_tokens[i]`` tokens) got
        a draft where ``found[i]``."""
        misses = self._misses
        for i in np.flatnonzero(~found).tolist():
            req_id = req_ids[i]
            count, pause = misses.get(req_id, (0, 1))
            count += 1
            if count >= self.patience:
                # Not asked again before ``pause`` more steps have added a token each.
                self.resume_at[req_id] = int(num_tokens[i]) + 1 + pause
                pause = min(2 * pause, self.max_pause)
            misses[req_id] = (count, pause)
        if misses:
            for i in np.flatnonzero(found).tolist():
                if misses.pop(req_ids[i], None) is not None:
                    self.resume_at.pop(req_ids[i], None)

    @property
    def paused(self) -> bool:
        """Whether a request is paused now: the next call may not be the next step's (for a
        proposer timing steps by its calls, :class:`pagoda.spec_decode.DraftCost`)."""
        return bool(self.resume_at)

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._misses.pop(req_id, None)
            self.resume_at.pop(req_id, None)
