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

Drafts found do not always pay either. Where the runner has measured what a step with slots
costs beyond one without (``ProposalBatch.slot_cost``, in plain steps: on an H200 at batch 1 a
step with slots took 2.0 - 2.3 ms against 1.46 - 1.73 for a plain one), a request gains from its
slots only while they bring more accepted tokens than that: a slot step costs ``1 + slot_cost``
plain steps and gives ``1 + accepted``. Each request's accepted drafts a slot step (misses
count 0) are kept as a moving mean (the newest step weighted ``yield_weight``, a proposer's
choice); below the cost it pauses as after misses (1, 2 ... up to
``cost_max_pause`` steps), and a probe whose drafts are accepted lifts the mean over the cost
and ends the pause. On the open prompt set (nothing to copy) slot steps brought 0.35 accepted
tokens each against a cost of about 0.6.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PATIENCE = 3  # proposals in a row with no draft before a request pauses
MAX_PAUSE = 8  # steps between probes at most: a copy that starts is found within that many
# ... for a request whose slot steps do not pay for themselves. One H200, SmolLM2 at batch 1,
# float32, n-gram (benchmarks/README.md, "A prompt's tree in slices"): 16, 32 and 64 gave 0.940,
# 0.970 and 0.988 times no speculation on the open set (fewer probes that wait and find little),
# and 1.593, 1.576 and 1.515 on the copy set (745, 768 and 783 steps: a copy that resumes after
# a stretch of new text is found later).
COST_MAX_PAUSE = 32
YIELD_WEIGHT = 0.5  # of the newest slot step in a request's mean accepted drafts


class DraftPause:
    """The pauses of one proposer's requests, kept in its ``resume_at`` (see the module)."""

    def __init__(
        self,
        resume_at: dict[str, int],
        patience: int = PATIENCE,
        max_pause: int = MAX_PAUSE,
        cost_max_pause: int = COST_MAX_PAUSE,
        yield_weight: float = YIELD_WEIGHT,
    ) -> None:
        self.resume_at = resume_at
        # The newest slot step's weight in a request's mean accepted drafts: the lower, the
        # longer a record of accepted drafts carries a request through steps that accept none.
        self.yield_weight = yield_weight
        self.patience = patience
        self.max_pause = max_pause
        self.cost_max_pause = cost_max_pause
        self._misses: dict[str, tuple[int, int]] = {}  # req_id -> (empty proposals, next pause)
        # req_id -> (tokens known at its last call, whether it paused there)
        self._last: dict[str, tuple[int, bool]] = {}
        self.accepted: dict[str, float] = {}  # req_id -> accepted drafts a slot step (mean)
        self._cost_pause: dict[str, int] = {}  # req_id -> its next pause for the cost

    def update(
        self,
        req_ids: Sequence[str],
        num_tokens: np.ndarray,
        found: np.ndarray,
        slot_cost: float | None = None,
    ) -> None:
        """A call's outcome: request ``i`` (``req_ids[i]``, knowing ``num_tokens[i]`` tokens) got
        a draft where ``found[i]``; ``slot_cost``: ``ProposalBatch.slot_cost`` (None: not
        measured, and only misses pause)."""
        resume = self.resume_at
        if resume:  # (a request asked again has its pause behind it)
            for req_id, n in zip(req_ids, num_tokens.tolist()):
                if resume.get(req_id, n + 1) <= n:
                    del resume[req_id]
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
        self._weigh(req_ids, num_tokens, slot_cost)

    def _weigh(
        self, req_ids: Sequence[str], num_tokens: np.ndarray, slot_cost: float | None
    ) -> None:
        """Each request's accepted drafts a slot step, from the tokens it gained since its last
        call (one a step, and the drafts that step accepted), and the pause of one whose mean
        is below ``slot_cost``."""
        last, mean = self._last, self.accepted
        for i, req_id in enumerate(req_ids):
            n = int(num_tokens[i])
            before = last.get(req_id)
            paused_now = req_id in self.resume_at
            last[req_id] = (n, paused_now)
            if before is None or before[1] or n <= before[0]:
                continue  # (a first call; or steps ran without it since, while it paused)
            got = float(n - before[0] - 1)
            old = mean.get(req_id)
            mean[req_id] = got if old is None else old + self.yield_weight * (got - old)
            if slot_cost is None:
                continue
            if mean[req_id] >= slot_cost:
                self._cost_pause.pop(req_id, None)
                continue
            pause = self._cost_pause.get(req_id, 1)
            resume = n + 1 + pause
            if resume > self.resume_at.get(req_id, 0):
                self.resume_at[req_id] = resume
                last[req_id] = (n, True)
            self._cost_pause[req_id] = min(2 * pause, self.cost_max_pause)

    @property
    def paused(self) -> bool:
        """Whether a request is paused now: the next call may not be the next step's (for a
        proposer timing steps by its calls, :class:`pagoda.spec_decode.DraftCost`)."""
        return bool(self.resume_at)

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._misses.pop(req_id, None)
            self.resume_at.pop(req_id, None)
            self._last.pop(req_id, None)
            self.accepted.pop(req_id, None)
            self._cost_pause.pop(req_id, None)
