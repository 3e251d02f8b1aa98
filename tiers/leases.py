"""The read path's leases: the longest cached prefix of a chain, moved into the tier the
reader reads from and held there until the reader releases it.

A leased block is never evicted or moved, so its slot keeps its bytes for as long as the
reader copies out of it. Blocks that cannot be brought into the reader's tier (no room,
or an NVMe read that fails verification) end the prefix: the reader gets fewer blocks,
never a doubtful one.

Owner: the tier manager's thread (see tiers/manager.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator

from kvstore.errors import NotFound
from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.catalogue import BlockEntry
from kvstore.tiers.movement import Mover
from kvstore.tiers.records import LeasedBlock, ReadLease
from kvstore.tiers.residency import Residency
from kvstore.tiers.stack import TierStack

__all__ = ["ReadLeases"]


class ReadLeases:
    def __init__(
        self,
        stack: TierStack,
        residency: Residency,
        mover: Mover,
        counters: collections.Counter[str],
        ids: Iterator[int],
        clock: Callable[[], float],
    ) -> None:
        self._stack = stack
        self._residency = residency
        self._mover = mover
        self._counters = counters
        self._ids = ids  # shared with the reservations: no reservation and lease share an id
        self._clock = clock
        self._held: dict[int, list[BlockEntry]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def acquire(self, namespace: bytes, nbytes: int, kind: TierKind, hashes: Iterable[BlockHash]) -> ReadLease:
        """Lease the longest cached prefix of ``hashes``, moved into ``kind`` first."""
        residency = self._residency
        # never hold more than the tier can take at once: held blocks deeper in the chain
        # would occupy the room that the prefix needs (they stay evictable instead)
        limit = self._stack.capacity_in_blocks(kind, nbytes)
        hits: list[BlockEntry] = []
        for block_hash in hashes:
            entry = residency.catalogue.get((namespace, block_hash))
            if entry is None or len(hits) == limit:
                break
            hits.append(entry)
            residency.hold(entry)
        source_tiers = [entry.tier for entry in hits]
        self._mover.move_many([e for e in hits if e.tier != kind], kind)
        usable = len(hits)
        for index, entry in enumerate(hits):
            if entry.tier != kind or not residency.is_cached(entry):
                usable = index
                break
        now = self._clock()
        for entry in hits[usable:]:
            residency.unhold(entry)
        for entry, source in zip(hits[:usable], source_tiers):
            entry.last_access = now
            self._counters[f"hit_blocks_{source.value}"] += 1
        lease = ReadLease(next(self._ids), namespace, kind, nbytes, tuple(LeasedBlock(e.key[1], e.slot) for e in hits[:usable]))
        self._held[lease.id] = hits[:usable]
        return lease

    def entries(self, lease_id: int) -> list[BlockEntry]:
        """The catalogue entries a lease holds, in chain order."""
        return self._held[lease_id]

    def release(self, lease_id: int) -> None:
        try:
            entries = self._held.pop(lease_id)
        except KeyError:
            raise NotFound(f"lease {lease_id} does not exist; it was released already or never granted.") from None
        for entry in entries:
            self._residency.unhold(entry)
