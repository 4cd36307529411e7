"""Data parallelism's router: which of several engine cores takes a new request.

Each core is a replica with its own KV cache. A request goes to the core with the least load:
the sequences it holds (sent and not finished: running, waiting, or on their way), then its KV
cache usage (from its latest stats). With prefix caching on, a prompt whose leading blocks were
sent to a core before goes back to that core (its blocks are likely still cached there) unless
that core holds more than ``affinity_slack`` sequences beyond the least loaded one: affinity
saves prefill, the load cap keeps one hot prefix from piling its traffic onto one core.

The coordinator keeps no engine state of its own: the client tells it what it sent, what
finished and what died. It is plain Python, tested without an engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Sequences a core that holds the prompt's prefix may carry beyond the least loaded core and
# still take the request. NOTE: -1 turns affinity off (no core holds fewer than the least).
AFFINITY_SLACK = 4


@dataclass(slots=True)
class CoreLoad:
    sequences: int = 0  # sent and not finished
    kv_usage: float = 0.0  # fraction of the core's KV blocks in use, at its latest stats
    alive: bool = True
    routed: int = 0  # requests sent to it since the start


class DPCoordinator:
    """Routes requests over ``num_cores`` cores by load and, if ``block_size`` is given
    (prefix caching on), by prefix; remembers at most ``max_prefixes`` block hashes."""

    def __init__(
        self,
        num_cores: int,
        block_size: int | None,
        max_prefixes: int = 1 << 16,
        affinity_slack: int = AFFINITY_SLACK,
    ) -> None:
        self.cores = [CoreLoad() for _ in range(num_cores)]
        self.block_size = block_size
        self.max_prefixes = max_prefixes
        self.affinity_slack = affinity_slack
        # Chained hash of a prompt's first k full blocks -> the core it was sent to last,
        # least recently used first.
        self._prefixes: OrderedDict[int, int] = OrderedDict()

    def route(self, prompt_token_ids: list[int]) -> int:
        """The core for a new request; records the prompt's prefix there. Raises
        ``RuntimeError`` when no core is alive."""
        alive = [i for i, c in enumerate(self.cores) if c.alive]
        if not alive:
            raise RuntimeError("no engine core is alive")
        least = min(alive, key=lambda i: (self.cores[i].sequences, self.cores[i].kv_usage, i))
        hashes = self._block_hashes(prompt_token_ids)
        chosen = least
        holder = self._holder(hashes)
        if holder is not None and self.cores[holder].alive:
            if self.cores[holder].sequences <= self.cores[least].sequences + self.affinity_slack:
                chosen = holder
        for h in hashes:
            self._prefixes[h] = chosen
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)
        self.cores[chosen].routed += 1
        return chosen

    def _block_hashes(self, token_ids: list[int]) -> list[int]:
        if self.block_size is None:
            return []
        size, parent, out = self.block_size, 0, []
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, *token_ids[start : start + size]))
            out.append(parent)
        return out

    def _holder(self, hashes: list[int]) -> int | None:
        """The core the longest known prefix of ``hashes`` went to."""
        for h in reversed(hashes):
            core = self._prefixes.get(h)
            if core is not None:
                return core
        return None

    def started(self, core: int, sequences: int = 1) -> None:
        self.cores[core].sequences += sequences

    def finished(self, core: int, sequences: int = 1) -> None:
        c = self.cores[core]
        c.sequences = max(0, c.sequences - sequences)

    def kv_usage(self, core: int, usage: float) -> None:
        self.cores[core].kv_usage = usage

    def died(self, core: int) -> None:
        """A core is gone: no request goes there again, and no prefix points at it."""
        self.cores[core] = CoreLoad(alive=False, routed=self.cores[core].routed)
        for h in [h for h, c in self._prefixes.items() if c == core]:
            del self._prefixes[h]

    @property
    def routed(self) -> list[int]:
        """Requests sent to each core since the start."""
        return [c.routed for c in self.cores]
