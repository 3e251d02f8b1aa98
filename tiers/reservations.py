"""The write path's open reservations: slots handed to a writer, not yet visible.

A writer reserves slots for the blocks of a chain that are not cached yet, copies into
them and commits: only then do the blocks enter the catalogue (and the BlockStored event
is appended), so a reader never sees a half-written block. A key under an open
reservation is *pending*: a second writer of the same chain counts it as cached instead
of writing it twice. A reservation not committed by its deadline is reclaimed, so a
crashed writer leaks nothing; its id is remembered for a while, so a late commit gets
ReservationExpired rather than NotFound.

Owner: the tier manager's thread (see tiers/manager.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvstore.errors import CapacityExhausted, InvalidArgument, NotFound, ReservationExpired
from kvstore.events import BlockStored, EventQueue
from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.catalogue import BlockEntry, BlockKey
from kvstore.tiers.movement import Mover
from kvstore.tiers.records import Reservation, ReservedBlock
from kvstore.tiers.residency import Residency
from kvstore.tiers.stack import TierStack

__all__ = ["Reservations"]

_MAX_EXPIRED_IDS = 10_000


class Reservations:
    def __init__(
        self,
        stack: TierStack,
        residency: Residency,
        mover: Mover,
        events: EventQueue,
        counters: collections.Counter[str],
        ids: Iterator[int],
        clock: Callable[[], float],
        ttl_s: float,
    ) -> None:
        self._stack = stack
        self._residency = residency
        self._mover = mover
        self._events = events
        self._counters = counters
        self._ids = ids  # shared with the read leases: no reservation and lease share an id
        self._clock = clock
        self._ttl_s = ttl_s
        self._open: dict[int, Reservation] = {}
        self._pending: dict[BlockKey, int] = {}
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def reserve(
        self, namespace: bytes, nbytes: int, kind: TierKind, hashes: Sequence[BlockHash], parent_hash: BlockHash | None
    ) -> Reservation:
        """Slots in ``kind`` for the blocks of ``hashes`` not cached yet, in chain order;
        the leading blocks that fit when room runs out part-way, CapacityExhausted when
        none fit."""
        self.expire()
        residency = self._residency
        keys = [(namespace, h) for h in hashes]
        get = residency.catalogue.get
        guarded = [e for e in map(get, [(namespace, parent_hash)] + keys) if e is not None]
        now = self._clock()
        for entry in guarded:  # the chain being extended is in use: not evicted to make room for itself
            entry.last_access = now
            residency.hold(entry)
        reserved: list[ReservedBlock] = []
        num_cached = 0
        pending = self._pending
        allocate = self._stack[kind].allocate
        try:
            for index, key in enumerate(keys):
                if get(key) is not None or key in pending:
                    num_cached += 1
                    continue
                slot = allocate(nbytes) or self._mover.allocate(kind, nbytes)
                if slot is None:
                    break
                reserved.append(ReservedBlock(key[1], hashes[index - 1] if index else parent_hash, slot))
        finally:
            for entry in guarded:
                residency.unhold(entry)
        if not reserved and num_cached < len(keys):
            raise CapacityExhausted(
                f"the {kind.value} tier has no room for a {nbytes}-byte block: every resident block is leased or pinned."
            )
        reservation = Reservation(next(self._ids), namespace, kind, nbytes, tuple(reserved), num_cached, self._clock() + self._ttl_s)
        self._open[reservation.id] = reservation
        for block in reserved:
            pending[(namespace, block.block_hash)] = reservation.id
        self._counters["reservations"] += 1
        return reservation

    def commit(self, reservation_id: int, num_written: int | None) -> int:
        """Make the first ``num_written`` (None: all) reserved blocks visible; release the rest."""
        reservation = self._take(reservation_id)
        count = len(reservation.blocks) if num_written is None else num_written
        if not 0 <= count <= len(reservation.blocks):
            self._release_slots(reservation, reservation.blocks)
            raise InvalidArgument(f"num_written must lie in [0, {len(reservation.blocks)}], got {num_written}.")
        now = self._clock()
        namespace, kind = reservation.namespace, reservation.tier
        segment: list[BlockHash] = []
        segment_parent: BlockHash | None = None
        entries: list[BlockEntry] = []
        for block in reservation.blocks[:count]:
            key = (namespace, block.block_hash)
            del self._pending[key]
            parent_key = None if block.parent_hash is None else (namespace, block.parent_hash)
            entries.append(BlockEntry(key, parent_key, kind, block.slot, reservation.nbytes, now))
            # one event per run of blocks that continue each other, as vLLM reports them
            if not segment or block.parent_hash != segment[-1]:
                if segment:
                    self._events.append(BlockStored(namespace, tuple(segment), segment_parent, kind, reservation.nbytes))
                segment, segment_parent = [], block.parent_hash
            segment.append(block.block_hash)
        if segment:
            self._events.append(BlockStored(namespace, tuple(segment), segment_parent, kind, reservation.nbytes))
        self._residency.add(entries)
        self._release_slots(reservation, reservation.blocks[count:])
        self._counters["blocks_stored"] += count
        return count

    def abort(self, reservation_id: int) -> None:
        reservation = self._take(reservation_id)
        self._release_slots(reservation, reservation.blocks)

    def expire(self) -> int:
        """Reclaim reservations whose writer never committed; returns how many."""
        now = self._clock()
        expired = [r for r in self._open.values() if r.deadline <= now]
        for reservation in expired:
            del self._open[reservation.id]
            self._release_slots(reservation, reservation.blocks)
            self._expired[reservation.id] = None
            if len(self._expired) > _MAX_EXPIRED_IDS:
                self._expired.popitem(last=False)
        self._counters["reservations_expired"] += len(expired)
        return len(expired)

    def get(self, reservation_id: int) -> Reservation:
        """An open reservation (NotFound / ReservationExpired otherwise)."""
        reservation = self._open.get(reservation_id)
        if reservation is None:
            self._take(reservation_id)  # raises the precise error
        return reservation

    def _take(self, reservation_id: int) -> Reservation:
        reservation = self._open.pop(reservation_id, None)
        if reservation is not None:
            return reservation
        if reservation_id in self._expired:
            raise ReservationExpired(
                f"reservation {reservation_id} expired after {self._ttl_s}s and its slots were reclaimed; save the blocks again."
            )
        raise NotFound(f"reservation {reservation_id} does not exist; it was committed, aborted or never made.")

    def _release_slots(self, reservation: Reservation, blocks: Iterable[ReservedBlock]) -> None:
        tier = self._stack[reservation.tier]
        for block in blocks:
            self._pending.pop((reservation.namespace, block.block_hash), None)
            tier.free(block.slot)
