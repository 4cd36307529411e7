"""Adaptive replacement (ARC, Megiddo and Modha): recency and frequency, balanced by what the
pool regrets having dropped.

Held keys sit in T1 (seen once since they came in) or T2 (hit again). B1 and B2 remember keys
recently dropped from T1 and T2 (their "ghosts", no data). Storing a key that is a ghost of B1
means T1 was too small: its target size ``p`` grows; a ghost of B2 shrinks it. Victims come from
T1 while it is over its target, else from T2, least recently used first. A one-off scan of new
prefixes thus passes through T1 without pushing out the prefixes that keep coming back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from pagoda.kv_offload.policy import OffloadPolicy


class ARCPolicy(OffloadPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.p = 0.0  # target size of T1

    def insert(self, key: Hashable) -> None:
        c = self.capacity
        if key in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        # Ghosts: T1 + B1 at most c, everything at most 2c.
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def touch(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        order = (self.t1, self.t2) if len(self.t1) > self.p or not self.t2 else (self.t2, self.t1)
        for held in order:
            for key in held:
                if can_evict(key):
                    del held[key]
                    (self.b1 if held is self.t1 else self.b2)[key] = None
                    return key
        return None

    def remove(self, key: Hashable) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2
