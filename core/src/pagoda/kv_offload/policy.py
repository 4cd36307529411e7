"""Which block a full CPU pool drops: the eviction-policy interface, LRU, and the registry.

A policy orders the keys (block hashes) the pool holds. The pool tells it of every store
(``insert``) and every hit (``touch``), and asks it for a victim when a store needs room
(``evict``). Keys the pool cannot drop right now (a copy in flight reads or writes them) are
skipped through the ``can_evict`` predicate; the policy keeps them in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable

from pagoda.plugins import get_registry
from pagoda.plugins.errors import PluginError


class OffloadPolicy(ABC):
    """An eviction order over at most ``capacity`` keys. Registered by name through the
    ``register_offload_policies`` hook and chosen with ``cache.offload_policy``."""

    def __init__(self, capacity: int) -> None:
        """``capacity``: how many blocks the pool holds (the policy never holds more)."""
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """``key`` was just stored (it is not held yet; the pool made room first)."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """``key``, held, was hit again (a load, or a store of a block already held)."""

    @abstractmethod
    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        """Choose a held key for which ``can_evict(key)`` is true, forget it and return it;
        None when no held key may go."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Forget the held ``key`` without counting it as an eviction (a reset)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys are held."""

    def __contains__(self, key: Hashable) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError


class LRUPolicy(OffloadPolicy):
    """Least recently used first: one ordered map, oldest at the front."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def evict(self, can_evict: Callable[[Hashable], bool]) -> Hashable | None:
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        return None

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order


def build_policy(name: str, capacity: int) -> OffloadPolicy:
    """The policy registered as ``name``, for a pool of ``capacity`` blocks; an unknown name is
    an error that names ``cache.offload_policy`` and the known policies."""
    try:
        cls = get_registry("offload_policies").get(name)
    except PluginError as e:
        raise ValueError(f"cache.offload_policy={name!r}: {e}") from e
    policy = cls(capacity)
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(
            f"cache.offload_policy={name!r} built {type(policy).__name__}, which is not a "
            "pagoda.kv_offload.OffloadPolicy"
        )
    return policy
