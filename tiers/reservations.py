"""The write path's open reservations: slots handed to a writer, not yet visible.

A writer reserves slots for the blocks of a chain that are not cached yet, copies into
them and commits, with the XXH3-64 of each block's bytes: only then do the blocks enter
the catalogue (and the BlockStored event is appended), so a reader never sees a
half-written block, and from then on every copy of the block out of the daemon's trust
is checked against what its writer committed. A key under an open reservation is
*pending*: a second writer of the same chain counts it as cached instead of writing it
twice.

A reservation belongs to its writer until the writer lets go (commit or abort) or is
provably gone (the daemon's session layer, kvstore/node.py, decides that). One not
committed by its deadline *expires*: its keys stop being pending, so another writer may
store them, but its slots stay reserved — quarantined — because the writer may still be
copying into them; they are freed when the writer commits (refused with
ReservationExpired), aborts, or ``release_expired`` is told it is gone. A timer never
hands a slot to someone else while its old holder might still write it.

Owner: the tier manager's thread (see tiers/manager.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence

from kvstore.errors import CapacityExhausted, InvalidArgument, NotFound, ReservationExpired
from kvstore.events import BlockStored, EventQueue
from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import block_checksum
from kvstore.tiers.catalogue import BlockEntry, BlockKey
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.movement import Mover
from kvstore.tiers.records import Reservation, ReservedBlock
from kvstore.tiers.residency import Residency
from kvstore.tiers.stack import TierStack
from kvstore.tiers.steps import Steps

__all__ = ["Reservations"]


class Reservations:
    def __init__(
        self,
        stack: TierStack,
        residency: Residency,
        mover: Mover,
        events: EventQueue,
        counters: collections.Counter[str],
        new_id: Callable[[], int],
        clock: Callable[[], float],
        ttl_s: float,
    ) -> None:
        self._stack = stack
        self._residency = residency
        self._mover = mover
        self._events = events
        self._counters = counters
        self._new_id = new_id  # shared with the read leases: no reservation and lease share an id
        self._clock = clock
        self._ttl_s = ttl_s
        self._open: dict[int, Reservation] = {}
        self._expired: dict[int, Reservation] = {}  # quarantined: slots held for a writer that may still write
        self._pending: dict[BlockKey, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    @property
    def num_expired(self) -> int:
        return len(self._expired)

    @property
    def quarantined_slots(self) -> int:
        return sum(len(r.blocks) for r in self._expired.values())

    def holds(self, reservation_id: int) -> bool:
        return reservation_id in self._open or reservation_id in self._expired

    def reserve_steps(
        self, namespace: bytes, nbytes: int, kind: TierKind, hashes: Sequence[BlockHash], parent_hash: BlockHash | None
    ) -> Steps[Reservation]:
        """Slots in ``kind`` for the blocks of ``hashes`` not cached yet, in chain order;
        the leading blocks that fit when room runs out part-way, CapacityExhausted when
        none fit."""
        if len(set(hashes)) != len(hashes):
            raise InvalidArgument("a chain names a block more than once; block hashes of one save must be distinct.")
        self.expire()
        residency = self._residency
        keys = [(namespace, h) for h in hashes]
        get = residency.catalogue.get
        pending = self._pending
        reservation_id = self._new_id()
        found = list(map(get, keys))
        if found.count(None) == len(keys) and pending.keys().isdisjoint(keys):  # the usual save: every block is new
            new_indices: Sequence[int] = range(len(keys))
            guarded = []
        else:
            new_indices = [index for index, (key, entry) in enumerate(zip(keys, found)) if entry is None and key not in pending]
            guarded = [entry for entry in found if entry is not None]
        num_cached = len(keys) - len(new_indices)
        parent = get((namespace, parent_hash))
        if parent is not None:
            guarded.append(parent)
        now = self._clock()
        for entry in guarded:  # the chain being extended is in use: not evicted to make room for itself
            entry.last_access = now
            residency.hold(entry)
        for index in new_indices:  # pending from now on, so a writer arriving while room is made skips them
            pending[keys[index]] = reservation_id
        slots = []
        try:
            slots = yield from self._mover.allocate_steps(kind, nbytes, len(new_indices))
        finally:
            for entry in guarded:
                residency.unhold(entry)
            for index in new_indices[len(slots) :]:
                del pending[keys[index]]
        if not slots and new_indices:
            raise CapacityExhausted(
                f"the {kind.value} tier has no room for a {nbytes}-byte block: every resident block is leased or pinned."
            )
        reserved = tuple(
            ReservedBlock(hashes[index], hashes[index - 1] if index else parent_hash, slot) for index, slot in zip(new_indices, slots)
        )
        reservation = Reservation(reservation_id, namespace, kind, nbytes, reserved, num_cached, self._clock() + self._ttl_s)
        self._open[reservation_id] = reservation
        self._counters["reservations"] += 1
        return reservation

    def commit(self, reservation_id: int, num_written: int | None, checksums: Sequence[int | None] | None) -> int:
        """Make the first ``num_written`` (None: all) reserved blocks visible, each with the
        checksum its writer took; release the rest. A malformed call changes nothing.
        ``checksums`` None: the writer is in this process and done, so they are taken from
        the slots now (the daemon's engines always send their own)."""
        reservation = self.get(reservation_id)
        count = len(reservation.blocks) if num_written is None else num_written
        if type(count) is not int or not 0 <= count <= len(reservation.blocks):
            raise InvalidArgument(f"num_written must be an integer in [0, {len(reservation.blocks)}], got {num_written!r}.")
        if checksums is not None and len(checksums) != count:
            raise InvalidArgument(f"{len(checksums)} checksums were given for {count} blocks written.")
        if checksums is None:
            checksums = self._checksums_of(reservation, count)
        del self._open[reservation_id]
        now = self._clock()
        namespace, kind, nbytes = reservation.namespace, reservation.tier, reservation.nbytes
        written = reservation.blocks[:count]
        pending = self._pending
        entries: list[BlockEntry] = []
        parent_key: BlockKey | None = None
        for block, checksum in zip(written, checksums):
            key = (namespace, block.block_hash)
            del pending[key]
            parent_hash = block.parent_hash
            if parent_key is None or parent_key[1] != parent_hash:  # else it continues the block before: that one's key
                parent_key = None if parent_hash is None else (namespace, parent_hash)
            entries.append(BlockEntry(key, parent_key, kind, block.slot, nbytes, now, checksum))
            parent_key = key
        # one event per run of blocks that continue each other, as vLLM reports them
        start = 0
        for end in range(1, count + 1):
            if end == count or written[end].parent_hash != written[end - 1].block_hash:
                segment = tuple(block.block_hash for block in written[start:end])
                self._events.append(BlockStored(namespace, segment, written[start].parent_hash, kind, nbytes))
                start = end
        self._residency.add(entries)
        self._release_slots(reservation, reservation.blocks[count:])
        self._counters["blocks_stored"] += count
        return count

    def abort(self, reservation_id: int) -> None:
        """The writer lets go: its slots are free again (an expired reservation's too)."""
        reservation = self._open.pop(reservation_id, None) or self._expired.pop(reservation_id, None)
        if reservation is None:
            raise NotFound(f"reservation {reservation_id} does not exist; it was committed, aborted or never made.")
        self._release_slots(reservation, reservation.blocks)

    def abort_all(self, kind: TierKind) -> int:
        """Abort every open reservation in ``kind`` (its memory was replaced: what their
        writers copy now lands in no block); returns how many."""
        ids = [reservation.id for reservation in self._open.values() if reservation.tier is kind]
        for reservation_id in ids:
            self.abort(reservation_id)
        return len(ids)

    def release_expired(self, reservation_id: int) -> bool:
        """Free the quarantined slots of an expired reservation whose writer is gone."""
        reservation = self._expired.pop(reservation_id, None)
        if reservation is None:
            return False
        self._release_slots(reservation, reservation.blocks)
        return True

    def expire(self) -> int:
        """Stop keeping the keys of reservations past their deadline pending (another writer
        may store them now); their slots stay quarantined for their writer. Returns how many
        expired."""
        now = self._clock()
        expired = [r for r in self._open.values() if r.deadline <= now]
        for reservation in expired:
            self._quarantine(reservation)
        return len(expired)

    def _quarantine(self, reservation: Reservation) -> None:
        del self._open[reservation.id]
        self._expired[reservation.id] = reservation
        for block in reservation.blocks:
            self._pending.pop((reservation.namespace, block.block_hash), None)
        self._counters["reservations_expired"] += 1

    def get(self, reservation_id: int) -> Reservation:
        """An open reservation (NotFound / ReservationExpired otherwise). Asking about an
        expired one is its writer's late call: its slots are freed, since the writer is
        evidently done with them."""
        reservation = self._open.get(reservation_id)
        if reservation is not None and reservation.deadline <= self._clock():
            self._quarantine(reservation)  # past its deadline, whether or not housekeeping saw it yet
            reservation = None
        if reservation is not None:
            return reservation
        if self.release_expired(reservation_id):
            raise ReservationExpired(
                f"reservation {reservation_id} expired after {self._ttl_s:g}s; other writers may have stored its blocks "
                "since. Nothing was stored; save the blocks again."
            )
        raise NotFound(f"reservation {reservation_id} does not exist; it was committed, aborted or never made.")

    def _checksums_of(self, reservation: Reservation, count: int) -> list[int | None]:
        tier = self._stack[reservation.tier]
        if not isinstance(tier, MemoryTier):
            return [None] * count  # no bytes kept (the simulator's tiers)
        return [block_checksum(tier.view(block.slot, reservation.nbytes)) for block in reservation.blocks[:count]]

    def _release_slots(self, reservation: Reservation, blocks: Iterable[ReservedBlock]) -> None:
        for block in blocks:
            key = (reservation.namespace, block.block_hash)
            if self._pending.get(key) == reservation.id:
                del self._pending[key]
            self._stack.free_quietly(reservation.tier, block.slot)
