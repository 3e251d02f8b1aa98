"""Retention: soft pins with a deadline, by block key, within a byte budget.

A coding agent pauses between turns while its tools run. At the end of a turn the router
retains the session's chain on the replica that served it, so that the next turn still
finds it there. A retained block stays evictable: its tier's policy picks it only once
no unretained block is left there (tiers/eviction.py), so retention orders eviction and
never refuses room to a save; picked in a tier with a tier below, it is demoted like any
victim, and only the lowest tier drops it.

Retention is by key, as a lookup hold is: a block stored under a retained key while the
retention lasts (the turn's last blocks, saved as the turn ends; blocks a prefetch
fetches from a peer) is retained as it arrives. A retain extends a key's deadline, never
shortens it. A key past its deadline is forgotten lazily — when eviction looks for a
victim, or at housekeeping — and its block is ordinary cache from then on.

The budget: every retained key counts its namespace's block size, cached or not, and the
total never passes ``max_bytes``, so retention never takes more than that of the cache out
of the LRU order, and the keys it remembers are bounded with it. A key that would pass it
displaces the keys retained (or last extended) longest ago — the chains of sessions whose
last turn is longest over, most likely ended — but never a key of its own call (a chain
longer than the budget keeps its prefix). Refusing the new key instead would keep the
retentions of sessions that are gone and refuse the newest blocks of the ones still
running, the blocks their next turns need. Keys already retained are extended whatever
the budget.

Owner: the tier manager's thread, through tiers/residency.py (which flips
``BlockEntry.retained`` and keeps the eviction policies in step); not thread-safe.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from kvstore.tiers.catalogue import BlockKey

__all__ = ["Retention"]


class Retention:
    def __init__(self, max_bytes: int, clock: Callable[[], float]) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        # key → (deadline, bytes it counts, the retain call that last granted or extended it),
        # the least recently granted first
        self._retained: OrderedDict[BlockKey, tuple[float, int, int]] = OrderedDict()
        # (deadline, key), earliest first; an item whose key was extended (or forgotten)
        # since is stale and skipped when it comes up
        self._deadlines: list[tuple[float, BlockKey]] = []
        self._displaced: list[BlockKey] = []  # given way to newer keys since take_displaced
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._retained)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._retained

    def grant(self, key: BlockKey, nbytes: int, deadline: float, call: int = 0) -> bool:
        """Retain ``key`` until ``deadline`` (or keep its later one), as part of retain call
        ``call``; False, changing nothing, when it is not retained yet and ``nbytes`` more
        would pass the budget even once every key of earlier calls has given way (those
        that do are listed by ``take_displaced``)."""
        held = self._retained.pop(key, None)
        if held is None:
            if not self._make_room(nbytes, call):
                return False
            self.num_bytes += nbytes
        else:
            nbytes = held[1]
            if held[0] >= deadline:
                self._retained[key] = (held[0], nbytes, call)  # extended: the most recent now
                return True
        self._retained[key] = (deadline, nbytes, call)
        heapq.heappush(self._deadlines, (deadline, key))
        if len(self._deadlines) > 4 * len(self._retained) + 1024:  # mostly stale: extended many times
            self._deadlines = [(deadline, key) for key, (deadline, _, _) in self._retained.items()]
            heapq.heapify(self._deadlines)
        return True

    def take_displaced(self) -> list[BlockKey]:
        """The keys that gave way to newer ones since the last call."""
        displaced, self._displaced = self._displaced, []
        return displaced

    def _make_room(self, nbytes: int, call: int) -> bool:
        while self.num_bytes + nbytes > self.max_bytes:
            oldest = next(iter(self._retained.items()), None)
            if oldest is None or oldest[1][2] == call:
                return False
            del self._retained[oldest[0]]  # its deadline's heap item is stale now
            self.num_bytes -= oldest[1][1]
            self._displaced.append(oldest[0])
        return True

    def expire(self) -> list[BlockKey]:
        """Forget the keys whose deadline has passed; returns them."""
        deadlines = self._deadlines
        if not deadlines:
            return []
        now = self._clock()
        expired = []
        while deadlines and deadlines[0][0] <= now:
            deadline, key = heapq.heappop(deadlines)
            held = self._retained.get(key)
            if held is not None and held[0] == deadline:
                del self._retained[key]
                self.num_bytes -= held[1]
                expired.append(key)
        return expired
