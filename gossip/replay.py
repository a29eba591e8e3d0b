"""Bounded replay/duplicate cache with a TTL, keyed by anything hashable.

Why bounded: an attacker can send unlimited distinct messages, so the cache
evicts the oldest entry once full and forgets entries after `ttl_s`. Messages
older than the TTL are rejected as expired by the pipeline, so forgetting
them here never lets an old message back in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class ReplayCache:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("replay cache needs max_entries >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._d: OrderedDict[Hashable, tuple[float, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def _expire(self, now: float) -> None:
        # Insertion order == expiry order (every entry gets the same TTL), so pop from the front.
        while self._d:
            key, (expiry, _) = next(iter(self._d.items()))
            if expiry > now:
                break
            del self._d[key]

    def get(self, key: Hashable, now: float, default: Any = None) -> Any:
        self._expire(now)
        hit = self._d.get(key)
        return default if hit is None else hit[1]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._d

    def put(self, key: Hashable, value: Any, now: float) -> None:
        self._expire(now)
        self._d.pop(key, None)
        self._d[key] = (now + self.ttl_s, value)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)
