"""The tier manager: where each block lives, and what moves when.

Tiers are ordered fastest first (HBM, host, NVMe). A block lives in exactly one tier at a
time (exclusive caching: promotion and demotion move it, so capacity adds up). Writers
reserve slots, copy into them and commit; readers acquire a lease on the longest cached
prefix of a chain, which first moves every block of it into the tier they read from
(NVMe reads verify checksums; a block that fails is dropped and the hit ends there).

Room is made on demand and by watermark: when a tier is above its high watermark its
eviction policy's victims move to the next tier down until it is under the low one;
the lowest tier drops its victims. A block under a read lease, a pin or a move is never
a victim. Reservations that are not committed in time are reclaimed, so a crashed writer
leaks nothing. Every change appends a BlockStored / BlockMoved / BlockRemoved event.

Owner: one thread (the daemon's event loop, a simulator, a test). NVMe transfers run in
that tier's I/O pool but the manager waits for them, so its state is never shared.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch

from kvstore.errors import (
    BlockSizeMismatch,
    CapacityExhausted,
    CorruptBlock,
    InvalidArgument,
    NotFound,
    ReservationExpired,
    TierUnavailable,
    UnknownNamespace,
)
from kvstore.events import BlockMoved, BlockRemoved, BlockStored, EventQueue, RemovalReason
from kvstore.hashing import BlockHash
from kvstore.namespace import Namespace
from kvstore.tiers.base import BlockMeta, Tier, TierKind, TierStats, byte_view
from kvstore.tiers.catalogue import BlockEntry, BlockKey, Catalogue
from kvstore.tiers.eviction import POLICIES, EvictionPolicy, make_policy
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.records import BlockInfo, EvictResult, LeasedBlock, ReadLease, ReservedBlock, Reservation
from kvstore.tiers.slab import Slot

__all__ = [
    "TierManagerConfig",
    "TierManager",
    "Reservation",
    "ReservedBlock",
    "ReadLease",
    "LeasedBlock",
    "BlockInfo",
    "EvictResult",
]


_IS_ENTRY = functools.partial(operator.is_not, None)
_TIER_OF = operator.attrgetter("tier")


@dataclass(frozen=True, slots=True)
class TierManagerConfig:
    eviction_policy: str = "leaf-first-lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    reservation_ttl_s: float = 30.0
    # demote right after a commit that crossed the high watermark; a daemon that runs
    # demotion in the background turns this off
    demote_on_commit: bool = True
    max_events: int = 1_000_000

    def __post_init__(self) -> None:
        if self.eviction_policy not in POLICIES:
            raise InvalidArgument(f"eviction_policy {self.eviction_policy!r} is not one of {sorted(POLICIES)}.")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise InvalidArgument(
                f"watermarks must satisfy 0 < low < high <= 1, got low={self.low_watermark}, high={self.high_watermark}."
            )
        if self.reservation_ttl_s <= 0:
            raise InvalidArgument(f"reservation_ttl_s must be positive, got {self.reservation_ttl_s}.")


@dataclass(slots=True)
class _Move:
    entry: BlockEntry
    src: TierKind
    src_slot: Slot
    dst_slot: Slot
    future: Future = field(repr=False)


class TierManager:
    def __init__(
        self,
        config: TierManagerConfig,
        tiers: Sequence[Tier],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not tiers:
            raise InvalidArgument("a tier manager needs at least one tier.")
        kinds = [tier.kind for tier in tiers]
        if len(set(kinds)) != len(kinds):
            raise InvalidArgument(f"each tier kind may appear once, got {[k.value for k in kinds]}.")
        self.config = config
        self._clock = clock
        self._tiers: dict[TierKind, Tier] = {t.kind: t for t in sorted(tiers, key=lambda t: t.kind.rank)}
        self._order: list[TierKind] = list(self._tiers)
        self._policies: dict[TierKind, EvictionPolicy] = {k: make_policy(config.eviction_policy) for k in self._order}
        self._failed: set[TierKind] = set()
        self.catalogue = Catalogue(self._reclassify)
        self.events = EventQueue(config.max_events)
        self.counters: collections.Counter[str] = collections.Counter()
        self._namespaces: dict[bytes, Namespace | None] = {}
        self._block_bytes: dict[bytes, int] = {}
        self._ids = itertools.count(1)
        self._reservations: dict[int, Reservation] = {}
        self._pending: dict[BlockKey, int] = {}
        self._expired: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._leases: dict[int, tuple[ReadLease, list[BlockEntry]]] = {}
        for tier in tiers:
            recovered = getattr(tier, "recovered", None)
            if recovered is not None:
                self._adopt_recovered(tier, recovered())

    # -- namespaces -----------------------------------------------------------------
    def register_namespace(self, namespace: Namespace) -> None:
        """Make a namespace known (idempotent). Its block size must fit every tier."""
        for tier in self._tiers.values():
            slab = getattr(tier, "slab", None)
            if slab is not None:
                slab.slot_bytes_for(namespace.block_bytes)
        known = self._block_bytes.get(namespace.digest)
        if known is not None and known != namespace.block_bytes:
            raise InvalidArgument(f"namespace {namespace.id} is already known with {known}-byte blocks.")
        self._namespaces[namespace.digest] = namespace
        self._block_bytes[namespace.digest] = namespace.block_bytes

    def namespaces(self) -> dict[bytes, Namespace | None]:
        """Known namespaces by digest; None where only recovered blocks name it."""
        return dict(self._namespaces)

    def block_bytes(self, namespace: bytes) -> int:
        try:
            return self._block_bytes[namespace]
        except KeyError:
            raise UnknownNamespace(f"namespace {namespace.hex()} is not registered on this node.") from None

    # -- lookups ----------------------------------------------------------------------
    def lookup(self, namespace: bytes, hashes: Iterable[BlockHash]) -> list[TierKind]:
        """The tier of each block of the longest cached prefix of ``hashes``."""
        self.block_bytes(namespace)
        # every step runs in C (zip, map, takewhile, attrgetter): this is the hot path of
        # every engine request, ~5x faster than the same walk as a Python loop
        keys = zip(itertools.repeat(namespace), hashes)
        entries = itertools.takewhile(_IS_ENTRY, map(self.catalogue.get, keys))
        return list(map(_TIER_OF, entries))

    # -- write path -------------------------------------------------------------------
    def reserve(
        self,
        namespace: bytes,
        hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None = None,
        tier: TierKind | None = None,
    ) -> Reservation:
        """Slots for the blocks of ``hashes`` not cached yet, in chain order.

        When room runs out part-way, the reservation covers the leading blocks that fit (a
        shorter prefix is still useful); CapacityExhausted only when none fit.
        """
        nbytes = self.block_bytes(namespace)
        kind = self._usable_kind(tier)
        self.expire_reservations()
        keys = [(namespace, h) for h in hashes]
        guarded = [e for e in map(self.catalogue.get, [(namespace, parent_hash)] + keys) if e is not None]
        now = self._clock()
        for entry in guarded:  # the chain being extended is in use: not evicted to make room for itself
            entry.last_access = now
            self._hold(entry)
        reserved: list[ReservedBlock] = []
        num_cached = 0
        get = self.catalogue.get
        allocate = self._tiers[kind].allocate
        try:
            for index, key in enumerate(keys):
                if get(key) is not None or key in self._pending:
                    num_cached += 1
                    continue
                slot = allocate(nbytes) or self._allocate(kind, nbytes)
                if slot is None:
                    break
                reserved.append(ReservedBlock(key[1], hashes[index - 1] if index else parent_hash, slot))
        finally:
            for entry in guarded:
                self._unhold(entry)
        if not reserved and num_cached < len(keys):
            raise CapacityExhausted(
                f"the {kind.value} tier has no room for a {nbytes}-byte block: every resident block is leased or pinned."
            )
        reservation = Reservation(next(self._ids), namespace, kind, nbytes, tuple(reserved), num_cached, self._clock() + self.config.reservation_ttl_s)
        self._reservations[reservation.id] = reservation
        for block in reserved:
            self._pending[(namespace, block.block_hash)] = reservation.id
        self.counters["reservations"] += 1
        return reservation

    def commit(self, reservation_id: int, num_written: int | None = None) -> int:
        """Make the first ``num_written`` (default: all) reserved blocks visible; release the rest."""
        reservation = self._take_reservation(reservation_id)
        count = len(reservation.blocks) if num_written is None else num_written
        if not 0 <= count <= len(reservation.blocks):
            self._release_slots(reservation, reservation.blocks)
            raise InvalidArgument(f"num_written must lie in [0, {len(reservation.blocks)}], got {num_written}.")
        now = self._clock()
        namespace, kind = reservation.namespace, reservation.tier
        policy = self._policies[kind]
        segment: list[BlockHash] = []
        segment_parent: BlockHash | None = None
        entries: list[BlockEntry] = []
        for block in reservation.blocks[:count]:
            key = (namespace, block.block_hash)
            del self._pending[key]
            parent_key = None if block.parent_hash is None else (namespace, block.parent_hash)
            entry = BlockEntry(key, parent_key, kind, block.slot, reservation.nbytes, now)
            self.catalogue.insert(entry)
            entries.append(entry)
            if not segment or block.parent_hash != segment[-1]:
                if segment:
                    self.events.append(BlockStored(namespace, tuple(segment), segment_parent, kind, reservation.nbytes))
                segment, segment_parent = [], block.parent_hash
            segment.append(block.block_hash)
        if segment:
            self.events.append(BlockStored(namespace, tuple(segment), segment_parent, kind, reservation.nbytes))
        # into the policy once the whole chain is linked: each block joins its final group
        # (interior, or leaf for the chain's tail) instead of entering as a leaf and moving
        # when its child arrives
        for entry in entries:
            policy.insert(entry)
        self._release_slots(reservation, reservation.blocks[count:])
        self.counters["blocks_stored"] += count
        if self.config.demote_on_commit:
            self.relieve_pressure()
        return count

    def abort(self, reservation_id: int) -> None:
        reservation = self._take_reservation(reservation_id)
        self._release_slots(reservation, reservation.blocks)

    def expire_reservations(self) -> int:
        """Reclaim reservations whose writer never committed; returns how many."""
        now = self._clock()
        expired = [r for r in self._reservations.values() if r.deadline <= now]
        for reservation in expired:
            del self._reservations[reservation.id]
            self._release_slots(reservation, reservation.blocks)
            self._expired[reservation.id] = None
            if len(self._expired) > 10_000:
                self._expired.popitem(last=False)
        self.counters["reservations_expired"] += len(expired)
        return len(expired)

    def reservation(self, reservation_id: int) -> Reservation:
        """An open reservation (NotFound / ReservationExpired otherwise)."""
        reservation = self._reservations.get(reservation_id)
        if reservation is None:
            self._take_reservation(reservation_id)  # raises the precise error
        return reservation

    def reservation_slots(self, reservation: Reservation) -> list[torch.Tensor]:
        """Writable views of a reservation's slots (memory tiers only)."""
        tier = self._tiers[reservation.tier]
        if not isinstance(tier, MemoryTier):
            raise InvalidArgument(f"the {reservation.tier.value} tier cannot be written through views.")
        return [tier.view(block.slot, reservation.nbytes) for block in reservation.blocks]

    def put(self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None = None) -> int:
        """Reserve, copy and commit a chain of blocks; returns how many were new."""
        if len(blocks) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes were given with {len(blocks)} blocks.")
        nbytes = self.block_bytes(namespace)
        data = {h: byte_view(b) for h, b in zip(hashes, blocks)}
        for block_hash, view in data.items():
            if view.numel() != nbytes:
                raise BlockSizeMismatch(f"block {block_hash.hex()} has {view.numel()} bytes; its namespace's blocks have {nbytes}.")
        # in chunks that leave the tier room to demote while the chain is written
        chunk = max(1, self._capacity_in_blocks(self._usable_kind(None), nbytes) // 4)
        stored = 0
        for start in range(0, len(hashes), chunk):
            reservation = self.reserve(namespace, hashes[start : start + chunk], hashes[start - 1] if start else parent_hash)
            tier = self._tiers[reservation.tier]
            try:
                for block in reservation.blocks:
                    tier.write(block.slot, data[block.block_hash], BlockMeta(namespace, block.block_hash, block.parent_hash, nbytes))
            except BaseException:
                self.abort(reservation.id)
                raise
            stored += self.commit(reservation.id)
        return stored

    # -- staging (transfers) ------------------------------------------------------------
    def allocate_staging(self, namespace: bytes, count: int) -> list[Slot]:
        """``count`` slots of the top memory tier that belong to no block yet: a handoff
        lands there layer by layer and its reader reads there before the blocks are stored
        (staging slots are neither leased nor evictable; their owner frees them). All or CapacityExhausted."""
        nbytes = self.block_bytes(namespace)
        kind = self._usable_kind(None)
        slots: list[Slot] = []
        for _ in range(count):
            slot = self._allocate(kind, nbytes)
            if slot is None:
                self.free_staging(slots)
                raise CapacityExhausted(f"the {kind.value} tier has no room to stage {count} blocks of {nbytes} bytes.")
            slots.append(slot)
        return slots

    def staging_views(self, namespace: bytes, slots: Sequence[Slot]) -> list[torch.Tensor]:
        nbytes = self.block_bytes(namespace)
        tier = self._tiers[self._usable_kind(None)]
        if not isinstance(tier, MemoryTier):
            raise InvalidArgument(f"the {tier.kind.value} tier cannot stage transfers.")
        return [tier.view(slot, nbytes) for slot in slots]

    def free_staging(self, slots: Iterable[Slot]) -> None:
        kind = self._usable_kind(None)
        for slot in slots:
            self._free_quietly(kind, slot)

    # -- read path --------------------------------------------------------------------
    def acquire(self, namespace: bytes, hashes: Iterable[BlockHash], tier: TierKind | None = None) -> ReadLease:
        """Lease the longest cached prefix of ``hashes``, moved into ``tier`` first (default:
        the top tier). Blocks that cannot be moved or fail verification end the prefix."""
        nbytes = self.block_bytes(namespace)
        kind = self._usable_kind(tier)
        # never hold more than the tier can take at once: held blocks deeper in the chain
        # would occupy the room that the prefix needs (they stay evictable instead)
        limit = self._capacity_in_blocks(kind, nbytes)
        hits: list[BlockEntry] = []
        for block_hash in hashes:
            entry = self.catalogue.get((namespace, block_hash))
            if entry is None or len(hits) == limit:
                break
            hits.append(entry)
            self._hold(entry)
        source_tiers = [entry.tier for entry in hits]
        self._move_many([e for e in hits if e.tier != kind], kind)
        usable = len(hits)
        for index, entry in enumerate(hits):
            if entry.tier != kind or not self._is_cached(entry):
                usable = index
                break
        now = self._clock()
        for entry in hits[usable:]:
            self._unhold(entry)
        for entry, source in zip(hits[:usable], source_tiers):
            entry.last_access = now
            self.counters[f"hit_blocks_{source.value}"] += 1
        lease = ReadLease(next(self._ids), namespace, kind, nbytes, tuple(LeasedBlock(e.key[1], e.slot) for e in hits[:usable]))
        self._leases[lease.id] = (lease, hits[:usable])
        return lease

    def lease_views(self, lease: ReadLease) -> list[torch.Tensor]:
        tier = self._tiers[lease.tier]
        if not isinstance(tier, MemoryTier):
            raise InvalidArgument(f"the {lease.tier.value} tier cannot be read through views.")
        return [tier.view(block.slot, lease.nbytes) for block in lease.blocks]

    def release(self, lease_id: int) -> None:
        try:
            _, entries = self._leases.pop(lease_id)
        except KeyError:
            raise NotFound(f"lease {lease_id} does not exist; it was released already or never granted.") from None
        for entry in entries:
            self._unhold(entry)

    def get(self, namespace: bytes, block_hash: BlockHash, out: torch.Tensor) -> bool:
        """Copy one cached block into ``out``; False on a miss."""
        lease = self.acquire(namespace, [block_hash])
        try:
            if not lease.blocks:
                return False
            entry = self._leases[lease.id][1][0]
            self._tiers[lease.tier].read(lease.blocks[0].slot, byte_view(out), self._meta(entry))
            return True
        finally:
            self.release(lease.id)

    # -- control ----------------------------------------------------------------------
    def pin(self, namespace: bytes, hashes: Iterable[BlockHash]) -> int:
        """Keep blocks from eviction until unpinned; returns how many were found."""
        count = 0
        for entry in self._entries_for(namespace, hashes):
            if entry.evictable:
                self._policies[entry.tier].remove(entry)
            entry.pinned = True
            count += 1
        return count

    def unpin(self, namespace: bytes, hashes: Iterable[BlockHash]) -> int:
        count = 0
        for entry in self._entries_for(namespace, hashes):
            if entry.pinned:
                entry.pinned = False
                if entry.evictable:
                    self._policies[entry.tier].insert(entry)
                count += 1
        return count

    def evict(
        self,
        namespace: bytes | None = None,
        hashes: Iterable[BlockHash] | None = None,
        tier: TierKind | None = None,
        idle_for_s: float | None = None,
    ) -> EvictResult:
        """Drop the blocks that match every filter given (none given: all blocks)."""
        if hashes is not None:
            if namespace is None:
                raise InvalidArgument("evicting by hash needs the namespace the hashes belong to.")
            candidates = list(self._entries_for(namespace, hashes))
        else:
            candidates = [e for e in self.catalogue if namespace is None or e.key[0] == namespace]
        now = self._clock()
        evicted = skipped = 0
        for entry in candidates:
            if tier is not None and entry.tier != tier:
                continue
            if idle_for_s is not None and now - entry.last_access < idle_for_s:
                continue
            if not entry.evictable:
                skipped += 1
                continue
            self._drop(entry, RemovalReason.EXPLICIT)
            evicted += 1
        return EvictResult(evicted, skipped)

    def relieve_pressure(self) -> int:
        """Demote from every tier above its high watermark to under its low one; returns the
        number of blocks moved."""
        moved = 0
        for index, kind in enumerate(self._order[:-1]):
            lower = self._next_usable(index)
            if kind in self._failed or lower is None:
                continue
            slab_stats = self._tiers[kind].stats()
            if slab_stats.used_bytes <= self.config.high_watermark * slab_stats.capacity_bytes:
                continue
            target = self.config.low_watermark * slab_stats.capacity_bytes
            victims: list[BlockEntry] = []
            to_free = slab_stats.used_bytes - target
            policy = self._policies[kind]
            while to_free > 0:
                victim = policy.victim()
                if victim is None:
                    break
                self._hold(victim)
                self._set_moving(victim, True)
                victims.append(victim)
                to_free -= victim.slot.nbytes
            done = self._move_many(victims, lower)
            for victim in victims:
                self._unhold(victim)
            moved += len(done)
        return moved

    def persist(self, batch: int = 256) -> int:
        """Move every block of the tiers above the lowest one into it, as far as it has room
        (before a planned restart: only the lowest, persistent tier survives one). Returns
        the number of blocks moved."""
        usable = self.tier_kinds
        if len(usable) < 2:
            return 0
        lowest = usable[-1]
        moved = 0
        for kind in usable[:-1]:
            entries = [e for e in self.catalogue if e.tier == kind and e.evictable]
            for start in range(0, len(entries), batch):
                chunk = entries[start : start + batch]
                for entry in chunk:
                    self._hold(entry)
                moved += len(self._move_many(chunk, lowest))
                for entry in chunk:
                    self._unhold(entry)
        return moved

    # -- inspection -------------------------------------------------------------------
    def tier(self, kind: TierKind) -> Tier:
        return self._tiers[kind]

    @property
    def tier_kinds(self) -> list[TierKind]:
        return [k for k in self._order if k not in self._failed]

    def tier_stats(self) -> list[TierStats]:
        return [self._tiers[k].stats() for k in self._order]

    @property
    def failed_tiers(self) -> set[TierKind]:
        return set(self._failed)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def blocks(self, namespace: bytes | None = None, tier: TierKind | None = None) -> Iterator[BlockInfo]:
        for e in self.catalogue:
            if (namespace is None or e.key[0] == namespace) and (tier is None or e.tier == tier):
                parent = None if e.parent_key is None else e.parent_key[1]
                yield BlockInfo(e.key[0], e.key[1], parent, e.tier, e.nbytes, e.stored_at, e.last_access, e.pinned, e.num_leases)

    def close(self) -> None:
        for tier in self._tiers.values():
            tier.close()

    # -- internals --------------------------------------------------------------------
    def _usable_kind(self, tier: TierKind | None) -> TierKind:
        if tier is None:
            for kind in self._order:
                if kind not in self._failed:
                    return kind
            raise TierUnavailable("every tier of this node has failed; restart the daemon after fixing the cause.")
        if tier not in self._tiers:
            raise InvalidArgument(f"this node has no {tier.value} tier; it has {[k.value for k in self._order]}.")
        if tier in self._failed:
            raise TierUnavailable(f"the {tier.value} tier has failed and is not used until the daemon restarts.")
        return tier

    def _capacity_in_blocks(self, kind: TierKind, nbytes: int) -> int:
        tier = self._tiers[kind]
        slab = getattr(tier, "slab", None)
        slot_bytes = slab.slot_bytes_for(nbytes) if slab is not None else nbytes
        return max(1, tier.stats().capacity_bytes // slot_bytes)

    def _next_usable(self, index: int) -> TierKind | None:
        for kind in self._order[index + 1 :]:
            if kind not in self._failed:
                return kind
        return None

    def _entries_for(self, namespace: bytes, hashes: Iterable[BlockHash]) -> Iterator[BlockEntry]:
        self.block_bytes(namespace)
        for block_hash in hashes:
            entry = self.catalogue.get((namespace, block_hash))
            if entry is not None:
                yield entry

    def _reclassify(self, entry: BlockEntry) -> None:
        if entry.evictable:
            self._policies[entry.tier].reclassify(entry)

    def _hold(self, entry: BlockEntry) -> None:
        if entry.evictable:
            self._policies[entry.tier].remove(entry)
        entry.num_leases += 1

    def _unhold(self, entry: BlockEntry) -> None:
        entry.num_leases -= 1
        if not entry.evictable or not self._is_cached(entry):
            return
        if entry.tier in self._failed:
            self._drop(entry, RemovalReason.TIER_FAILED)
        else:
            self._policies[entry.tier].insert(entry)

    def _is_cached(self, entry: BlockEntry) -> bool:
        return self.catalogue.get(entry.key) is entry

    def _take_reservation(self, reservation_id: int) -> Reservation:
        reservation = self._reservations.pop(reservation_id, None)
        if reservation is not None:
            return reservation
        if reservation_id in self._expired:
            raise ReservationExpired(
                f"reservation {reservation_id} expired after {self.config.reservation_ttl_s}s and its slots were "
                "reclaimed; save the blocks again."
            )
        raise NotFound(f"reservation {reservation_id} does not exist; it was committed, aborted or never made.")

    def _release_slots(self, reservation: Reservation, blocks: Iterable[ReservedBlock]) -> None:
        tier = self._tiers[reservation.tier]
        for block in blocks:
            self._pending.pop((reservation.namespace, block.block_hash), None)
            tier.free(block.slot)

    def _allocate(self, kind: TierKind, nbytes: int) -> Slot | None:
        """A slot in ``kind``, evicting (demoting or dropping) its victims until one frees."""
        tier = self._tiers[kind]
        slot = tier.allocate(nbytes)
        while slot is None:
            victim = self._policies[kind].victim()
            if victim is None:
                return None
            self._demote_or_drop(victim)
            slot = tier.allocate(nbytes)
        return slot

    def _demote_or_drop(self, entry: BlockEntry) -> None:
        lower = self._next_usable(self._order.index(entry.tier))
        if lower is not None:
            self._hold(entry)
            moved = self._move_many([entry], lower)
            self._unhold(entry)
            if moved or not self._is_cached(entry):
                return
        self._drop(entry, RemovalReason.CAPACITY)

    def _drop(self, entry: BlockEntry, reason: RemovalReason) -> None:
        if entry.evictable:
            self._policies[entry.tier].remove(entry)
        self.catalogue.remove(entry)
        self._free_quietly(entry.tier, entry.slot)
        self.events.append(BlockRemoved(entry.key[0], (entry.key[1],), entry.tier, reason))
        self.counters[f"evicted_{reason.value}"] += 1

    def _free_quietly(self, kind: TierKind, slot: Slot) -> None:
        try:
            self._tiers[kind].free(slot)
        except TierUnavailable:
            # the slot's header could not be cleared; its bytes still match its key, so a
            # restart that recovers it serves correct data
            self.counters[f"free_errors_{kind.value}"] += 1

    def _move_many(self, entries: list[BlockEntry], dst: TierKind) -> set[BlockEntry]:
        """Move held entries into ``dst`` with their transfers in flight together; returns
        those that arrived. A corrupt source drops the block; a failed destination tier is
        taken out of service."""
        for entry in entries:
            self._set_moving(entry, True)
        moves: list[_Move] = []
        for entry in entries:
            slot = self._allocate(dst, entry.nbytes)
            if slot is None:
                break
            future = self._transfer(entry.tier, entry.slot, dst, slot, self._meta(entry))
            moves.append(_Move(entry, entry.tier, entry.slot, slot, future))
        arrived: set[BlockEntry] = set()
        moved_hashes: dict[tuple[bytes, TierKind], list[BlockHash]] = {}
        for move in moves:
            error = move.future.exception()
            if error is None:
                self._free_quietly(move.src, move.src_slot)
                move.entry.tier, move.entry.slot = dst, move.dst_slot
                arrived.add(move.entry)
                moved_hashes.setdefault((move.entry.key[0], move.src), []).append(move.entry.key[1])
                direction = "promoted" if dst.rank < move.src.rank else "demoted"
                self.counters[f"{direction}_{move.src.value}_to_{dst.value}"] += 1
                continue
            self._free_quietly(dst, move.dst_slot)
            if isinstance(error, CorruptBlock):
                self.counters[f"corrupt_{move.src.value}"] += 1
                self._drop(move.entry, RemovalReason.CORRUPT)
            elif isinstance(error, (TierUnavailable, OSError)):
                self._fail_tier(dst)
            else:
                raise error
        for (namespace, src), hashes in moved_hashes.items():
            self.events.append(BlockMoved(namespace, tuple(hashes), src, dst))
        for entry in entries:
            self._set_moving(entry, False)
        return arrived

    @staticmethod
    def _meta(entry: BlockEntry) -> BlockMeta:
        parent = None if entry.parent_key is None else entry.parent_key[1]
        return BlockMeta(entry.key[0], entry.key[1], parent, entry.nbytes)

    def _set_moving(self, entry: BlockEntry, moving: bool) -> None:
        entry.moving = moving
        if entry.parent is not None:
            self._reclassify(entry.parent)

    def _transfer(self, src: TierKind, src_slot: Slot, dst: TierKind, dst_slot: Slot, meta: BlockMeta) -> Future:
        src_tier, dst_tier = self._tiers[src], self._tiers[dst]
        if not (src_tier.holds_bytes and dst_tier.holds_bytes):
            done: Future = Future()
            done.set_result(None)
            return done
        if isinstance(src_tier, MemoryTier):
            return dst_tier.submit_write(dst_slot, src_tier.view(src_slot, meta.nbytes), meta)
        if isinstance(dst_tier, MemoryTier):
            return src_tier.submit_read(src_slot, dst_tier.view(dst_slot, meta.nbytes), meta)
        raise InvalidArgument(f"no path moves a block from {src.value} to {dst.value} directly.")

    def _fail_tier(self, kind: TierKind) -> None:
        """Stop using a tier after an I/O failure; its blocks are dropped (they may be
        unreadable) and the node keeps serving from the tiers above."""
        if kind in self._failed:
            return
        self._failed.add(kind)
        self.counters[f"tier_failed_{kind.value}"] += 1
        for entry in [e for e in self.catalogue if e.tier == kind and e.evictable]:
            self._drop(entry, RemovalReason.TIER_FAILED)

    def _adopt_recovered(self, tier: Tier, recovered: Iterable[tuple[Slot, BlockMeta, int]]) -> None:
        now = self._clock()
        policy = self._policies[tier.kind]
        for slot, meta, _checksum in recovered:
            key = (meta.namespace, meta.block_hash)
            known = self._block_bytes.setdefault(meta.namespace, meta.nbytes)
            if known != meta.nbytes or key in self.catalogue:
                tier.free(slot)
                continue
            self._namespaces.setdefault(meta.namespace, None)
            parent_key = None if meta.parent_hash is None else (meta.namespace, meta.parent_hash)
            entry = BlockEntry(key, parent_key, tier.kind, slot, meta.nbytes, now)
            self.catalogue.insert(entry)
            policy.insert(entry)
            self.events.append(BlockStored(meta.namespace, (meta.block_hash,), meta.parent_hash, tier.kind, meta.nbytes))
            self.counters["blocks_recovered"] += 1
