"""The read path's leases: the longest cached prefix of a chain, moved into the tier the
reader reads from and held there until the reader releases it.

A leased block is never evicted or moved (a move that was copying it when the lease was
granted leaves it where it is), so its slot keeps its bytes for as long as the reader
copies out of it. Blocks that cannot be brought into the reader's tier (no room, an NVMe
read that fails verification, a block another reader holds in another tier) end the
prefix: the reader gets fewer blocks, never a doubtful one.

Owner: the tier manager's thread (see tiers/manager.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from kvstore.errors import NotFound
from kvstore.events import RemovalReason
from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.catalogue import BlockEntry
from kvstore.tiers.movement import Move, Mover
from kvstore.tiers.records import LeasedBlock, ReadLease
from kvstore.tiers.residency import Residency
from kvstore.tiers.stack import TierStack
from kvstore.tiers.steps import Steps

__all__ = ["ReadLeases"]


class ReadLeases:
    def __init__(
        self,
        stack: TierStack,
        residency: Residency,
        mover: Mover,
        counters: collections.Counter[str],
        new_id: Callable[[], int],
        clock: Callable[[], float],
    ) -> None:
        self._stack = stack
        self._residency = residency
        self._mover = mover
        self._counters = counters
        self._new_id = new_id  # shared with the reservations: no reservation and lease share an id
        self._clock = clock
        self._held: dict[int, list[BlockEntry]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, lease_id: int) -> bool:
        return lease_id in self._held

    def acquire_steps(self, namespace: bytes, nbytes: int, kind: TierKind, hashes: Iterable[BlockHash]) -> Steps[ReadLease]:
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
            if entry.tier != kind and entry.num_readers:
                break  # another reader reads it where it is: it does not move under them
            hits.append(entry)
            residency.hold(entry)
        sources = [entry.tier for entry in hits]
        usable = 0
        try:
            yield from self._bring(hits, kind)
            usable = len(hits)
            for index, entry in enumerate(hits):
                if entry.tier != kind or not residency.is_cached(entry):
                    usable = index
                    break
        finally:
            for entry in hits[usable:]:
                residency.unhold(entry)
        leased = hits[:usable]
        now = self._clock()
        for entry, source in zip(leased, sources):
            entry.last_access = now
            entry.num_readers += 1
            self._counters[f"hit_blocks_{source.value}"] += 1
        lease = ReadLease(self._new_id(), namespace, kind, nbytes, tuple(LeasedBlock(e.key[1], e.slot, e.checksum) for e in leased))
        self._held[lease.id] = leased
        return lease

    def _bring(self, hits: list[BlockEntry], kind: TierKind) -> Steps[None]:
        """Move the held ``hits`` that are not in ``kind`` there, joining moves already on
        their way; each block is moved at most once for this reader."""
        mover = self._mover
        started: set[BlockEntry] = set()
        while True:
            waiting: list[Move] = []
            to_start: list[BlockEntry] = []
            for entry in hits:
                if entry.tier == kind or not self._residency.is_cached(entry):
                    continue
                move = mover.in_flight(entry)
                if move is not None:
                    waiting.append(move)
                elif entry not in started:
                    to_start.append(entry)
            if to_start:
                started.update(to_start)
                waiting += yield from mover.start_many(to_start, kind)
            pending = [move for move in waiting if not move.future.done()]
            if pending:
                yield [move.future for move in pending]
            for move in waiting:
                mover.finish(move)
            if not waiting:
                return

    def entries(self, lease_id: int) -> list[BlockEntry]:
        """The catalogue entries a lease holds, in chain order."""
        return self._held[lease_id]

    def release(self, lease_id: int, corrupt_index: int | None = None) -> None:
        """Let go of a lease. ``corrupt_index``: the reader found that block's bytes do not
        match its checksum, so it is dropped (a miss for everyone from now on)."""
        try:
            entries = self._held.pop(lease_id)
        except KeyError:
            raise NotFound(f"lease {lease_id} does not exist; it was released already or never granted.") from None
        if corrupt_index is not None and 0 <= corrupt_index < len(entries):
            entry = entries[corrupt_index]
            if self._residency.is_cached(entry):
                self._counters[f"corrupt_{entry.tier.value}"] += 1
                self._residency.drop(entry, RemovalReason.CORRUPT)
        for entry in entries:
            entry.num_readers -= 1
            self._residency.unhold(entry)
