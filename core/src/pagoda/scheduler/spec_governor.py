"""When drafting pays: a measured, per-batch-size switch for speculation.

A verification step costs more than a decode step (more tokens, the rejection sampler, the
proposer's host work) and, with alternating async drafts, a request whose drafts are in flight
sits a step out. Whether that buys tokens depends on the hardware, the model, the batch size and
the workload: at batch 1 a good proposer multiplies tokens per second, while at a large batch
whose step cost is mostly fixed (host-bound) the extra steps lose. No threshold fits every case,
so :class:`SpeculationGovernor` measures.

It runs the engine in *epochs* of a few steps, each with drafting on or off for the whole batch,
and measures what each yields: tokens emitted per second of wall time between step ends, per
running request (so that epochs of one batch-size bucket compare fairly as requests come and
go), kept as an exponential moving average per mode and per bucket of running requests (powers of
two). After a switch to drafting the first ``settle_steps`` are not measured (with alternating
drafts the pipeline needs a few steps to fill), after a switch to plain steps the first two.
The scheduler also reports the draft tokens each step accepted: a verification forward never
costs less than a plain step, so drafting's rate is capped at plain's times the tokens a request
emits per forward (1 + accepted drafts), and drafting that accepts (almost) nothing loses every
tie whatever the clock showed. From plain steps, drafting must measure ``draft_margin`` faster to
be chosen: what a switch to it costs (its settling steps, a batch left uneven) is not measured.
Nor does drafting win on the mean alone: the scheduler reports each request's tokens, and the
rate of drafting's slower requests (the ``floor_quantile`` of the per-request rates) must be
within ``slowdown`` of plain's. Drafting that speeds requests whose drafts are accepted up and
slows the others down (a verification costs more than a plain step, and where steps alternate
a request whose drafts are rejected sits every other step out) makes those others slower than
without speculation, which the governor is there to prevent; in a batch whose requests end
together the slowest decide when it ends.
The mode with the higher rate is exploited; the other is probed for one epoch now and then, at
intervals that double while a probe confirms the choice (up to ``max_explore`` epochs) and shrink
back when a probe overturns it, so a workload that changes is followed and a settled one pays
little for probing. A probe of the losing mode costs what that mode loses, so probes are also
spaced far enough apart that their cost stays within ``probe_budget`` of the time (a probe of a
mode that loses 40% waits some 30 epochs; one of a near tie, a few), once each mode has been
measured twice. While drafting is off, it is probed again as soon as the batch has turned over
(as many requests admitted as are running): a new workload may draft well. Those probes back
off too: each that finds drafting still losing doubles the turnovers the next one waits for
(up to ``max_turnovers``); one that finds it winning brings it back to every turnover. At batch 1
every request is a turnover, and a proposer that never pays (a random draft head) would
otherwise pay a drafting epoch on every request.

A bucket that has measured nothing starts drafting (the user asked for it), except from
``plain_first_from`` running requests on (where steps alternate: a plain epoch first, then a
drafting probe that can be cut short against it, see ``_clearly_losing``), and unless the nearest
larger bucket that measured both modes found drafting losing: a batch draining from a size where
drafting lost runs plain, and probes drafting only as often as after a confirmed choice. (Its
last requests are the ones that decide when the batch ends; drafting by default there, with
alternating drafts sitting each drafting request out a step, added steps to the batch's end.)

Steps that are not pure decoding (a prompt chunk, an idle gap) are not measured, nor are stalls
(a step more than ``stall`` times an epoch's median), nor a disturbed epoch: one whose median
step is more than ``disturbance`` times what that mode's steps took in the bucket before (each
step of it slowed, by the host busy elsewhere, not a few): it is measured again in the same mode,
and counts only if the next one is as slow (then the workload changed). Turning drafting
off never changes what is sampled: the output is the same either way (lossless), only sooner or
later. ``speculative.disable_by_batch_size`` (vLLM's knob) turns drafting off outright from that
many running requests on, unmeasured.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.config import SpeculativeConfig


@dataclass(slots=True)
class _Bucket:
    """What is known about one batch-size bucket."""

    rate: dict[bool, float] = field(default_factory=dict)  # mode -> tokens/s a request (EMA)
    # Drafting's tokens per forward a request ran in (EMA; 1 + accepted drafts per verification,
    # as the epoch measured it): the most drafting could gain on plain steps.
    gain: float | None = None
    # Drafting's rate of its slower requests (EMA; see ``_Epoch.floor``): a request that sits
    # out steps or has its drafts rejected is slowed while others speed up.
    floor: float | None = None
    epochs: dict[bool, int] = field(default_factory=dict)  # mode -> epochs measured
    best: bool = True  # drafting on until measured otherwise: the user asked for it
    explore_every: int = 0  # exploit epochs between probes of the other mode
    since_probe: int = 0
    admitted_at_probe: int = 0  # the governor's ``admitted`` when drafting was last measured
    turnovers: int = 1  # batch turnovers before drafting is probed again (see the module's note)
    inherited: bool = False  # plain from a larger bucket: drafting's first probe waits its turn
    # Drafting's last probe was cut short, clearly losing (``_clearly_losing``): the choice
    # counts as confirmed (probes spaced by their cost, the next turnover probe waits longer).
    clear_loss: bool = False
    step: dict[bool, float] = field(default_factory=dict)  # mode -> median step seconds (EMA)
    disturbed: bool = False  # its last epoch was left out as disturbed (see the module's note)


@dataclass(slots=True)
class _Epoch:
    bucket: int
    on: bool
    turnover: bool = False  # a probe of drafting because the batch turned over
    steps: int = 0  # step ends seen since the epoch began (settling ones included)
    measured: int = 0
    # Each measured step: (seconds, tokens emitted, requests running).
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    # Each measured step's tokens by request (every request running, 0 for one that sat it
    # out), where the scheduler gave them; None where it did not.
    by_request: list[dict[str, int] | None] = field(default_factory=list)
    accepted: int = 0  # draft tokens accepted in the measured steps
    cut: bool = False  # ended early, clearly losing (``_clearly_losing``)

    def gain(self) -> float | None:
        """Tokens emitted per forward a request ran in (see ``SpeculationGovernor.observe``);
        None when no request ran one."""
        emitted = sum(n for _, n, _ in self.samples)
        return emitted / (emitted - self.accepted) if emitted > self.accepted else None

    def median_step(self) -> float:
        return sorted(dt for dt, _, _ in self.samples)[len(self.samples) // 2]

    def floor(self, stall: float, median: float, quantile: float) -> float | None:
        """Tokens per second of the epoch's slower requests: the ``quantile`` of the per-request
        rates of those running through at least half of the kept steps' time (stalls left out
        as in :meth:`rate`); None without per-request counts or with fewer than two such
        requests. In plain steps every request emits one token a step and this is the mean; in
        drafting steps a request whose drafts are rejected emits about one (none in a step it
        sits out) while the step costs more."""
        limit = stall * median
        tokens: dict[str, int] = {}
        seconds: dict[str, float] = {}
        total = 0.0
        for (dt, _, _), counts in zip(self.samples, self.by_request):
            if dt > limit:
                continue
            if counts is None:
                return None
            total += dt
            for req_id, n in counts.items():
                tokens[req_id] = tokens.get(req_id, 0) + n
                seconds[req_id] = seconds.get(req_id, 0.0) + dt
        rates = sorted(tokens[r] / s for r, s in seconds.items() if s > 0 and s >= 0.5 * total)
        if len(rates) < 2:
            return None
        return rates[min(int(quantile * len(rates)), len(rates) - 1)]

    def rate(self, stall: float, median: float) -> float:
        """Tokens per second a running request, leaving out stalls: steps slower than ``stall``
        times the ``median`` step (another process, a collector pause), which say nothing about
        either mode."""
        limit = stall * median
        kept = [(dt, n, r) for dt, n, r in self.samples if dt <= limit]
        seconds = sum(dt * r for dt, _, r in kept)
        return sum(n for _, n, _ in kept) / seconds if seconds > 0 else 0.0


class SpeculationGovernor:
    """Decides each step whether the batch drafts (:meth:`drafting`, at schedule time) from
    what it measured at step ends (:meth:`observe`). ``clock`` returns seconds (injectable for
    tests)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        epoch_steps: int = 8,
        settle_steps: int = 4,
        min_explore: int = 3,
        max_explore: int = 32,
        max_turnovers: int = 16,
        probe_budget: float = 0.02,
        margin: float = 0.02,
        draft_margin: float = 0.1,
        alpha: float = 0.5,
        stall: float = 3.0,
        disturbance: float = 2.0,
        slowdown: float = 0.05,
        floor_quantile: float = 0.1,
        cut_short: float = 0.75,
        cut_early: float = 0.5,
        plain_first_from: int | None = None,
        disable_by_batch_size: int | None = None,
        fixed: bool = False,
        self_paced_below: int = 0,
    ) -> None:
        if epoch_steps < 1 or settle_steps < 0 or not 1 <= min_explore <= max_explore:
            raise ValueError("governor: epoch_steps >= 1, settle_steps >= 0, 1 <= min <= max")
        if probe_budget <= 0:
            raise ValueError("governor: probe_budget > 0")
        self.clock = clock
        self.epoch_steps = epoch_steps
        self.settle_steps = settle_steps
        self.min_explore = min_explore
        self.max_explore = max_explore
        self.max_turnovers = max_turnovers
        self.probe_budget = probe_budget
        self.margin = margin
        self.draft_margin = draft_margin
        self.alpha = alpha
        self.stall = stall
        self.disturbance = disturbance
        # Drafting is chosen only where its slower requests (the ``floor_quantile`` of the
        # requests' rates) are at most ``slowdown`` slower than plain steps would run them.
        self.slowdown = slowdown
        self.floor_quantile = floor_quantile
        self.cut_short = cut_short
        self.cut_early = cut_early
        # A bucket whose every size is at least this many running requests starts with a plain
        # epoch and probes drafting next (see ``_start``); None: every bucket starts drafting.
        self.plain_first_from = plain_first_from
        self.disable_by_batch_size = disable_by_batch_size
        # Fixed: only ``disable_by_batch_size`` decides; nothing is measured.
        self.fixed = fixed
        # Below this many running requests drafting stays on, unmeasured: the proposer paces
        # itself (``SpeculativeProposer.paces_itself``).
        self.self_paced_below = self_paced_below
        self.buckets: dict[int, _Bucket] = {}
        self.epoch: _Epoch | None = None
        self._last_end: float | None = None
        # Requests admitted so far, and the running count at the last step end.
        self.admitted = 0
        self._running = 0
        # Epochs run in each mode (for reports and tests).
        self.epochs = {True: 0, False: 0}
        # The last epochs measured, oldest first: (bucket, drafting, tokens/s a request, median
        # step seconds, steps kept, drafting's tokens per forward or None, counted: False for a
        # disturbed epoch left out), for reports (``benchmarks/spec_decode.py``).
        self.history: deque[tuple[int, bool, float, float, int, float | None, bool]] = deque(
            maxlen=512
        )

    @staticmethod
    def bucket_of(num_running: int) -> int:
        """Buckets of running requests: 1, 2-3, 4-7, 8-15, ..."""
        return max(num_running, 1).bit_length()

    def drafting(self, num_running: int) -> bool:
        """Whether the step being scheduled, with ``num_running`` requests running, drafts."""
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return False
        if self.fixed or num_running < self.self_paced_below:
            return True
        b = self.bucket_of(num_running)
        if self.epoch is None or self.epoch.bucket != b:
            self._begin(b, self._start(b))
        return self.epoch.on

    @property
    def counts_requests(self) -> bool:
        """Whether :meth:`observe` reads each request's tokens (``by_request``): in drafting
        epochs only (plain steps emit a token a request; only drafting's slower requests are
        measured), so that a plain step at a large batch spares the scheduler building them."""
        return self.epoch is not None and self.epoch.on

    def observe(
        self,
        num_tokens: int,
        num_running: int,
        clean: bool = True,
        accepted: int = 0,
        by_request: dict[str, int] | None = None,
    ) -> None:
        """A step ended, having emitted ``num_tokens`` with ``num_running`` requests running,
        ``accepted`` of them draft tokens the verification accepted (each request that ran in
        the step emitted one token besides those); ``clean``: it was pure decoding (no prompt
        tokens), so its time is comparable. ``by_request``: the tokens each request running
        emitted (0 for one that sat the step out), for drafting's slower requests."""
        now = self.clock()
        last, self._last_end = self._last_end, now
        epoch = self.epoch
        if epoch is None:
            return
        epoch.steps += 1
        # NOTE: a switch to plain steps settles once the step in flight ended (2 steps); drafts
        # may need ``settle_steps`` to be proposed, scheduled and verified.
        settle = self.settle_steps if epoch.on else min(self.settle_steps, 2)
        if last is None or not clean or epoch.steps <= settle or num_running < 1:
            return
        epoch.measured += 1
        self._running = num_running
        epoch.samples.append((now - last, num_tokens, num_running))
        epoch.by_request.append(by_request)
        epoch.accepted += accepted
        if epoch.measured >= self.epoch_steps:
            self._end(epoch)
        elif self._clearly_losing(epoch):
            epoch.cut = True
            self._end(epoch)

    def _clearly_losing(self, epoch: _Epoch) -> bool:
        """A drafting epoch ends at half its steps where its slower requests already run below
        ``cut_short`` of plain's measured rate, and after two measured steps where they run
        below ``cut_early`` of it: what the rest of such a probe would measure cannot overturn
        the choice, and each of its steps costs (random prompts at batch 64 on an H200: a
        12-step drafting probe cost some 12% of a 130-step batch, the sat-out steps of the
        requests whose drafts were rejected included; cut at half, its slower requests ran at a
        quarter of plain's rate, and its 4 measured steps at 5.9 ms against plain's 1.7 were
        still 8% of the first batch)."""
        if not epoch.on or epoch.measured < 2:
            return False
        half = epoch.measured >= max(self.epoch_steps // 2, 2)
        if not half and epoch.measured > 2:
            return False  # (judged at two measured steps, then at half)
        plain = self._bucket(epoch.bucket).rate.get(False)
        if plain is None:
            return False
        median = epoch.median_step()
        floor = epoch.floor(self.stall, median, self.floor_quantile)
        if floor is None:
            return False
        return floor < (self.cut_short if half else self.cut_early) * plain

    def admit(self, num_requests: int) -> None:
        """``num_requests`` requests joined the batch (new, or resumed after preemption)."""
        self.admitted += num_requests

    def idle(self) -> None:
        """Nothing ran: the next step's end is not measured from the last one's."""
        self._last_end = None

    def _bucket(self, b: int) -> _Bucket:
        got = self.buckets.get(b)
        if got is None:
            got = self.buckets[b] = _Bucket(explore_every=self.min_explore)
        return got

    def _start(self, b: int) -> bool:
        """The mode a bucket's epoch starts in: its choice, or, while it has measured nothing,
        plain where the nearest larger bucket measured drafting losing (a batch draining from
        where drafting lost: its laggards would otherwise draft by default, in the last steps
        that decide when the batch ends). Drafting is then probed as after a confirmed choice."""
        bucket = self._bucket(b)
        if bucket.rate:
            return bucket.best
        larger = [k for k, v in self.buckets.items() if k > b and len(v.rate) == 2]
        if larger and not self.buckets[min(larger)].best:
            bucket.best, bucket.inherited = False, True
            bucket.admitted_at_probe = self.admitted
        elif self.plain_first_from is not None and 1 << (b - 1) >= self.plain_first_from:
            # NOTE: where steps alternate a first drafting epoch has no plain rate to be cut
            # short against, and runs whole whatever it measures; plain first, drafting is
            # probed right after (unmeasured), against it.
            bucket.best = False
        return bucket.best

    def _begin(self, b: int, on: bool, turnover: bool = False) -> None:
        self.epoch = _Epoch(b, on, turnover)
        self.epochs[on] += 1
        if on:
            self._bucket(b).admitted_at_probe = self.admitted

    def _end(self, epoch: _Epoch) -> None:
        bucket = self._bucket(epoch.bucket)
        median = epoch.median_step()
        rate = epoch.rate(self.stall, median)
        gain = epoch.gain() if epoch.on else None
        disturbed = self._disturbed(bucket, epoch.on, median)
        self.history.append(
            (epoch.bucket, epoch.on, rate, median, len(epoch.samples), gain, not disturbed)
        )
        if disturbed:  # measure the same mode again (see the module's note)
            bucket.disturbed = True
            self._begin(epoch.bucket, epoch.on, epoch.turnover)
            return
        bucket.disturbed = False
        old = bucket.step.get(epoch.on)
        bucket.step[epoch.on] = median if old is None else old + self.alpha * (median - old)
        old = bucket.rate.get(epoch.on)
        bucket.rate[epoch.on] = rate if old is None else old + self.alpha * (rate - old)
        if gain is not None:
            old = bucket.gain
            bucket.gain = gain if old is None else old + self.alpha * (gain - old)
        floor = epoch.floor(self.stall, median, self.floor_quantile) if epoch.on else None
        if floor is not None:
            old = bucket.floor
            bucket.floor = floor if old is None else old + self.alpha * (floor - old)
        bucket.epochs[epoch.on] = bucket.epochs.get(epoch.on, 0) + 1
        probed = epoch.on != bucket.best
        winner = self._winner(bucket)
        if epoch.on:
            bucket.clear_loss = epoch.cut
        if probed:
            if winner == bucket.best:  # the choice holds: probe less often
                bucket.explore_every = min(2 * bucket.explore_every, self.max_explore)
                if epoch.turnover or epoch.cut:
                    bucket.turnovers = min(2 * bucket.turnovers, self.max_turnovers)
            else:
                bucket.explore_every = self.min_explore
                bucket.turnovers = 1
            bucket.since_probe = 0
        else:
            bucket.since_probe += 1
            if winner != bucket.best:  # the exploited mode fell below the other's last rate
                bucket.explore_every = self.min_explore
                bucket.turnovers = 1
                bucket.since_probe = 0
        bucket.best = winner
        bucket.explore_every = max(bucket.explore_every, self._spacing(bucket))
        other = not bucket.best
        unmeasured = other not in bucket.rate and not bucket.inherited
        probe = unmeasured or bucket.since_probe >= bucket.explore_every
        # NOTE: drafting pays by workload (how often drafts are right): once the batch has
        # turned over since drafting was last measured, it is measured again.
        turned_over = (
            self.admitted - bucket.admitted_at_probe >= max(self._running, 1) * bucket.turnovers
        )
        by_turnover = not probe and other and turned_over and bucket.since_probe >= 1
        self._begin(epoch.bucket, other if probe or by_turnover else bucket.best, by_turnover)

    def _disturbed(self, bucket: _Bucket, on: bool, median: float) -> bool:
        """Whether an epoch whose median step took ``median`` seconds is left out: its mode was
        measured twice in the bucket, its steps took more than ``disturbance`` times as long as
        there, and the bucket's epoch before was not itself left out. (Random Qwen3-0.6B at batch
        64 on an H100: one epoch of plain steps at 9.7 ms among dozens at 2.5 - 3.9 ms turned
        drafting on for the rest of the run, which ended at 0.70 of plain steps' throughput.)"""
        known = bucket.step.get(on)
        return (
            known is not None
            and bucket.epochs.get(on, 0) >= 2
            and not bucket.disturbed
            and median > self.disturbance * known
        )

    def _spacing(self, bucket: _Bucket) -> int:
        """The fewest exploit epochs between probes for which a probe's cost (its epoch, settling
        steps included, at the losing mode's rate) stays within ``probe_budget`` of the time.
        Only once each mode was measured twice: one epoch that ran slow for reasons of its own
        (the host busy elsewhere) must not hold a wrong choice for dozens of epochs; except a
        drafting probe cut short, its slower requests clearly below plain's rate (a busy host
        slows every request alike; sat-out steps and rejected drafts slow some)."""
        if self._futile(bucket):  # a probe can only find that the workload changed
            return self.max_explore
        measured = min(bucket.epochs.get(True, 0), bucket.epochs.get(False, 0))
        if measured < 2 and not (measured and bucket.clear_loss):
            return self.min_explore
        rates = self._rates(bucket)
        if not bucket.best:  # drafting is probed: what a switch to it costs counts against it
            rates[True] /= 1 + self.draft_margin
        best, other = rates[bucket.best], rates[not bucket.best]
        if best <= 0:
            return self.min_explore
        loss = max(0.0, 1.0 - other / best)  # the fraction of a probe's time it loses
        probe = (self.epoch_steps + self.settle_steps) / self.epoch_steps  # in exploit epochs
        epochs = math.ceil(probe * loss / self.probe_budget)
        return min(self.max_explore, max(self.min_explore, epochs))

    def _futile(self, bucket: _Bucket) -> bool:
        """Drafting accepted too little to pay, whatever its epochs measured: each request's
        forward in a verification step costs at least a plain step's and emitted ``gain`` tokens
        (a step a request sits out emits none), so drafting is at most ``gain`` times as fast as
        plain steps. Below ``1 + margin`` (a draft head or workload whose drafts are rejected,
        or a proposer backing off on its own) plain steps win any tie the clock would show."""
        return bucket.gain is not None and bucket.gain <= 1 + self.margin

    def _winner(self, bucket: _Bucket) -> bool:
        """The mode with the higher rate; the current choice keeps ties within ``margin``, and
        plain steps keep drafting out unless it measured ``draft_margin`` faster: a drafting
        epoch does not measure what switching to it costs (its settling steps, and a batch left
        uneven, whose last requests then finish in emptier steps), which at a large batch where
        the modes are close is what decides (random Qwen3-0.6B at batch 64 on an H100: drafting
        epochs within 10% of plain ones, the run 15% slower with them)."""
        best, other = bucket.best, not bucket.best
        if other not in bucket.rate or best not in bucket.rate:
            return best
        if self._futile(bucket):
            return False
        rates = self._rates(bucket)
        margin = self.draft_margin if other else self.margin
        return other if rates[other] > rates[best] * (1 + margin) else best

    def _rates(self, bucket: _Bucket) -> dict[bool, float]:
        """Each mode's rate, drafting's capped at ``gain`` times plain's (see ``_futile``): a
        drafting epoch that measured more ran while the host or device sped up; and at its
        slower requests' rate over ``1 - slowdown``: drafting that speeds some requests up by
        slowing others down (those whose drafts are rejected, sitting steps out where steps
        alternate) does not win, whatever the mean (random prompts at batch 64 on an H200:
        drafting epochs at 1.6 times plain's mean rate, the batches 0.83 of plain's speed, their
        end set by the requests it slowed)."""
        rates = dict(bucket.rate)
        if bucket.gain is not None and False in rates and True in rates:
            rates[True] = min(rates[True], rates[False] * bucket.gain)
        if bucket.floor is not None and True in rates:
            rates[True] = min(rates[True], bucket.floor / (1 - self.slowdown))
        return rates


def is_decode_step(num_tokens: int, num_reqs: int, drafts: dict[str, list[int]], new: int) -> bool:
    """Whether a step of ``num_tokens`` tokens over ``num_reqs`` requests computed only each
    request's next token and its drafts (no prompt chunk, no new request), so that its time
    measures decoding."""
    return not new and num_tokens == num_reqs + (sum(map(len, drafts.values())) if drafts else 0)


def build_governor(
    config: SpeculativeConfig, self_paced: bool = False, plain_first_from: int | None = None
) -> SpeculationGovernor | None:
    """The governor ``speculative`` asks for: measured (``adaptive``), with vLLM's
    ``disable_by_batch_size`` on top; None when drafting runs every step, or never (no
    ``method``). ``self_paced``: the proposer drafts only what it measured to pay
    (``SpeculativeProposer.paces_itself``), so at batch 1 drafting is left on: there the
    governor's epochs (a request's content changes within them) cost more than they saved (the
    copy set on a 2-core CPU: 1.39x with them, 1.66x without, benchmarks/README.md).
    ``plain_first_from``: the batch size from which steps alternate
    (``DraftPolicy.alternate_from``), where a bucket starts with a plain epoch."""
    if config.method is None or (not config.adaptive and config.disable_by_batch_size is None):
        return None
    if not config.adaptive:  # the threshold alone: never measured, never probed
        return SpeculationGovernor(disable_by_batch_size=config.disable_by_batch_size, fixed=True)
    return SpeculationGovernor(
        disable_by_batch_size=config.disable_by_batch_size,
        self_paced_below=2 if self_paced else 0,
        plain_first_from=plain_first_from,
    )
