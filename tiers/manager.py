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

``TierManager`` is the one public face of this; it knows the namespaces, answers
lookups and composes one collaborator per concern, each in its own module:

- ``TierStack`` (tiers/stack.py): the tiers in order and which have failed;
- ``Residency`` (tiers/residency.py): the catalogue and the eviction policies in step —
  holds, pins, retention (tiers/retention.py), drops;
- ``Mover`` (tiers/movement.py): room on demand, demotion, promotion, persisting,
  failing a tier;
- ``Reservations`` (tiers/reservations.py): the write path's open reservations;
- ``ReadLeases`` (tiers/leases.py): the read path's leases;
- ``LookupHolds`` (tiers/holds.py): blocks a lookup reported, kept from eviction until
  their reader loads them.

They share the manager's event queue and counters and call each other only downwards in
that list (the two paths use the mover and residency, never each other).

Operations that may wait for NVMe I/O (reserve, acquire, put, demotion, persisting)
come in two forms: ``*_steps`` generators (tiers/steps.py), which an owner that must keep
serving drives without blocking (the daemon awaits each step's futures), and plain
methods that run the same steps blocking, for synchronous owners.

Handles (reservation, lease and hold ids) are random 63-bit integers, never a counter, so one
cannot be guessed from another.

Owner: one thread (the daemon's event loop, a simulator, a test) owns the manager and
with it every collaborator. NVMe transfers run in that tier's I/O pool; their outcome
is applied on the owner's thread (``reap``, or whoever waits for it), so its state is
never shared.
"""

from __future__ import annotations

import collections
import math
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import BlockSizeMismatch, CapacityExhausted, InvalidArgument, TierUnavailable, UnknownNamespace
from kvstore.events import BlockStored, EventQueue, RemovalReason
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.namespace import Namespace
from kvstore.tier_kind import TIER_BY_RANK, TierKind
from kvstore.tiers.base import BlockMeta, Tier, TierStats, block_checksum, byte_view
from kvstore.tiers.catalogue import BlockEntry, RecentChains
from kvstore.tiers.eviction import POLICIES
from kvstore.tiers.holds import LookupHolds
from kvstore.tiers.host import HostTier
from kvstore.tiers.leases import ReadLeases
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.movement import Mover, block_meta
from kvstore.tiers.records import BlockInfo, EvictResult, LeasedBlock, ReadLease, Reservation, ReservedBlock, RetainResult
from kvstore.tiers.reservations import Reservations
from kvstore.tiers.residency import Residency
from kvstore.tiers.retention import Retention
from kvstore.tiers.slab import Slot
from kvstore.tiers.stack import TierStack
from kvstore.tiers.steps import Steps, run

__all__ = [
    "TierManagerConfig",
    "TierManager",
    "Reservation",
    "ReservedBlock",
    "ReadLease",
    "LeasedBlock",
    "BlockInfo",
    "EvictResult",
    "RetainResult",
]


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
    # retention (``retain``, tiers/retention.py): the longest a retain may last (longer asks
    # are cut to it), and the share of the node's capacity (every tier's, at start) that
    # retained blocks may take; 0 turns retention off
    max_retain_s: float = 600.0
    max_retained_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.eviction_policy not in POLICIES:
            raise InvalidArgument(f"eviction_policy {self.eviction_policy!r} is not one of {sorted(POLICIES)}.")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise InvalidArgument(f"watermarks must satisfy 0 < low < high <= 1, got low={self.low_watermark}, high={self.high_watermark}.")
        if self.reservation_ttl_s <= 0:
            raise InvalidArgument(f"reservation_ttl_s must be positive, got {self.reservation_ttl_s}.")
        if not 0 < self.max_retain_s <= 86_400:
            raise InvalidArgument(f"max_retain_s must lie in (0, 86400] seconds, got {self.max_retain_s}.")
        if not 0.0 <= self.max_retained_fraction <= 1.0:
            raise InvalidArgument(f"max_retained_fraction must lie in [0, 1], got {self.max_retained_fraction}.")


class TierManager:
    def __init__(
        self,
        config: TierManagerConfig,
        tiers: Sequence[Tier],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.events = EventQueue(config.max_events)
        self.counters: collections.Counter[str] = collections.Counter()
        self._clock = clock
        self._stack = TierStack(tiers, self.counters)
        capacity = sum(tier.stats().capacity_bytes for tier in tiers)
        retention = Retention(int(capacity * config.max_retained_fraction), clock)
        self._residency = Residency(self._stack, config.eviction_policy, self.events, self.counters, retention)
        self.catalogue = self._residency.catalogue
        self._mover = Mover(self._stack, self._residency, self.events, self.counters, config.high_watermark, config.low_watermark)
        self._reservations = Reservations(
            self._stack, self._residency, self._mover, self.events, self.counters, self._new_id, clock, config.reservation_ttl_s
        )
        self._leases = ReadLeases(self._stack, self._residency, self._mover, self.counters, self._new_id, clock)
        self._holds = LookupHolds(self._residency, self._new_id, clock)
        self._recent_chains = RecentChains()  # lookups reuse the key objects of recent chains' shared prefixes
        self._namespaces: dict[bytes, Namespace | None] = {}
        self._block_bytes: dict[bytes, int] = {}
        for tier in tiers:
            recovered = getattr(tier, "recovered", None)
            if recovered is not None:
                self._adopt_recovered(tier, recovered())

    # -- namespaces -----------------------------------------------------------------
    def register_namespace(self, namespace: Namespace) -> None:
        """Make a namespace known (idempotent). Its block size must fit every tier."""
        for tier in self._stack:
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

    def namespace(self, digest: bytes) -> Namespace | None:
        """The namespace of ``digest``, None where it is unknown or only recovered blocks name it."""
        return self._namespaces.get(digest)

    def forget_namespace(self, digest: bytes) -> bool:
        """Forget a registered namespace no cached block names, freeing its table entry;
        False, changing nothing, where a block still does."""
        # the catalogue's per-namespace index of cached blocks (tiers/catalogue.py) answers without a scan
        if self._namespaces.get(digest) is None or self.catalogue._ranks.get(digest):
            return False
        del self._namespaces[digest], self._block_bytes[digest]
        return True

    def block_bytes(self, namespace: bytes) -> int:
        try:
            return self._block_bytes[namespace]
        except KeyError:
            raise UnknownNamespace(f"namespace {namespace.hex()} is not registered on this node.") from None

    # -- lookups ----------------------------------------------------------------------
    def lookup(self, namespace: bytes, hashes: Iterable[BlockHash]) -> list[TierKind]:
        """The tier of each block of the longest cached prefix of ``hashes``."""
        hashes = list(hashes)
        lengths = list(map(len, hashes))
        if lengths.count(HASH_BYTES) != len(lengths):  # a hash of another length is cached nowhere: the prefix ends before it
            hashes = hashes[: next(i for i, n in enumerate(lengths) if n != HASH_BYTES)]
        return list(map(TIER_BY_RANK.__getitem__, self.lookup_ranks(namespace, b"".join(hashes))))

    def lookup_ranks(self, namespace: bytes, chain: bytes) -> bytes:
        """``lookup`` of a chain given as its 16-byte block hashes concatenated (as the local
        protocol carries it): the rank (``TierKind.rank``) of each block's tier, one byte
        per block. The hot path of every engine request: no object per block."""
        return self.catalogue.prefix_ranks(namespace, self._chain_keys([namespace], chain))

    def lookup_held(self, namespaces: Sequence[bytes], chain: bytes, ttl_s: float) -> tuple[int, list[bytes]]:
        """``lookup_ranks`` of ``chain`` in each of ``namespaces``, and ``hold_prefixes`` of
        what each found, with the chain split (and its keys hashed) once: the hold's id (0:
        nothing held) and the ranks per namespace."""
        keys = self._chain_keys(namespaces, chain)
        ranks = [self.catalogue.prefix_ranks(namespace, keys) for namespace in namespaces]
        return self._holds.take([(namespace, len(found)) for namespace, found in zip(namespaces, ranks)], keys, ttl_s), ranks

    def hold_prefixes(self, prefixes: Sequence[tuple[bytes, int]], chain: bytes, ttl_s: float) -> int:
        """Keep the first ``length`` blocks of ``chain`` in each ``(namespace, length)`` of
        ``prefixes`` from eviction for ``ttl_s`` or until ``release_hold``; the hold's id,
        0 when nothing was held (tiers/holds.py)."""
        return self._holds.take(prefixes, self._chain_keys([namespace for namespace, _ in prefixes], chain), ttl_s)

    def _chain_keys(self, namespaces: Sequence[bytes], chain: bytes) -> Sequence[bytes]:
        for namespace in namespaces:
            self.block_bytes(namespace)  # registered, or NotFound
        if len(chain) % HASH_BYTES:
            raise InvalidArgument(f"a chain is a whole number of {HASH_BYTES}-byte block hashes, got {len(chain)} bytes.")
        return self._recent_chains.keys(chain)

    def release_hold(self, hold_id: int) -> None:
        self._holds.release(hold_id)

    def expire_holds(self) -> list[int]:
        """Release the holds past their deadline; their ids."""
        return self._holds.expire()

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    # -- write path (tiers/reservations.py) -------------------------------------------
    def reserve_steps(
        self,
        namespace: bytes,
        hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None = None,
        tier: TierKind | None = None,
    ) -> Steps[Reservation]:
        """Slots for the blocks of ``hashes`` not cached yet, in chain order.

        When room runs out part-way, the reservation covers the leading blocks that fit (a
        shorter prefix is still useful); CapacityExhausted only when none fit.
        """
        nbytes = self.block_bytes(namespace)
        _check_chain_metadata(hashes, parent_hash)
        kind = self._stack.usable(tier)
        return (yield from self._reservations.reserve_steps(namespace, nbytes, kind, hashes, parent_hash))

    def reserve(
        self, namespace: bytes, hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None, tier: TierKind | None = None
    ) -> Reservation:
        return run(self.reserve_steps(namespace, hashes, parent_hash, tier))

    def commit(self, reservation_id: int, num_written: int | None = None, checksums: Sequence[int | None] | None = None) -> int:
        """Make the first ``num_written`` (default: all) reserved blocks visible, each with
        the XXH3-64 its writer took (``checksums``, one per block written; None: taken from
        the slots now); release the rest."""
        count = self._reservations.commit(reservation_id, num_written, checksums)
        if self.config.demote_on_commit:
            run(self._mover.relieve_pressure_steps())
        return count

    def abort(self, reservation_id: int) -> None:
        self._reservations.abort(reservation_id)

    def expire_reservations(self) -> int:
        """Stop holding the keys of reservations past their deadline (their slots stay
        quarantined for their writer); returns how many expired."""
        return self._reservations.expire()

    def release_expired(self, reservation_id: int) -> bool:
        """Free the quarantined slots of an expired reservation whose writer is gone."""
        return self._reservations.release_expired(reservation_id)

    def holds_reservation(self, reservation_id: int) -> bool:
        """Whether ``reservation_id`` is open, or expired with its slots still quarantined."""
        return self._reservations.holds(reservation_id)

    def reservation(self, reservation_id: int) -> Reservation:
        """An open reservation (NotFound / ReservationExpired otherwise)."""
        return self._reservations.get(reservation_id)

    def reservation_slots(self, reservation: Reservation) -> list[torch.Tensor]:
        """Writable views of a reservation's slots (memory tiers only)."""
        slots = [block.slot for block in reservation.blocks]
        return self._stack.views(reservation.tier, slots, reservation.nbytes, "cannot be written through views")

    def put_steps(
        self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None = None
    ) -> Steps[int]:
        """Reserve, copy and commit a chain of blocks (the manager is their writer here, so
        it takes their checksums: into a memory tier, as it copies); returns how many were new."""
        if len(blocks) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes were given with {len(blocks)} blocks.")
        nbytes = self.block_bytes(namespace)
        data = list(map(byte_view, blocks))
        for block_hash, view in zip(hashes, data):
            if view.numel() != nbytes:
                raise BlockSizeMismatch(f"block {block_hash.hex()} has {view.numel()} bytes; its namespace's blocks have {nbytes}.")
        position: dict[BlockHash, int] = {}
        # in chunks that leave the tier room to demote while the chain is written
        chunk = max(1, self._stack.capacity_in_blocks(self._stack.usable(None), nbytes) // 4)
        stored = 0
        for start in range(0, len(hashes), chunk):
            parent = hashes[start - 1] if start else parent_hash
            reservation = yield from self.reserve_steps(namespace, hashes[start : start + chunk], parent)
            tier = self._stack[reservation.tier]
            if reservation.num_cached == 0:  # the leading blocks of the chunk, in order
                views = data[start : start + len(reservation.blocks)]
            else:
                position = position or {h: i for i, h in enumerate(hashes)}
                views = [data[position[block.block_hash]] for block in reservation.blocks]
            try:
                if isinstance(tier, MemoryTier):
                    checksums = tier.write_checksummed([block.slot for block in reservation.blocks], views)
                else:
                    for block, view in zip(reservation.blocks, views):
                        tier.write(block.slot, view, BlockMeta(namespace, block.block_hash, block.parent_hash, nbytes))
                    checksums = [block_checksum(view) if tier.holds_bytes else None for view in views]
            except BaseException:
                self.abort(reservation.id)
                raise
            stored += self.commit(reservation.id, None, checksums)
        return stored

    def put(
        self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None = None
    ) -> int:
        return run(self.put_steps(namespace, hashes, blocks, parent_hash))

    # -- staging (transfers) ------------------------------------------------------------
    def allocate_staging_steps(self, namespace: bytes, count: int) -> Steps[list[Slot]]:
        """``count`` slots of the top memory tier that belong to no block yet: a handoff
        lands there layer by layer and its reader reads there before the blocks are stored
        (staging slots are neither leased nor evictable; their owner frees them). All or CapacityExhausted."""
        nbytes = self.block_bytes(namespace)
        kind = self._stack.usable(None)
        slots = yield from self._mover.allocate_steps(kind, nbytes, count)
        if len(slots) < count:
            self.free_staging(slots)
            raise CapacityExhausted(f"the {kind.value} tier has no room to stage {count} blocks of {nbytes} bytes.")
        return slots

    def allocate_staging(self, namespace: bytes, count: int) -> list[Slot]:
        return run(self.allocate_staging_steps(namespace, count))

    def staging_views(self, namespace: bytes, slots: Sequence[Slot]) -> list[torch.Tensor]:
        nbytes = self.block_bytes(namespace)
        return self._stack.views(self._stack.usable(None), slots, nbytes, "cannot stage transfers")

    def free_staging(self, slots: Iterable[Slot]) -> None:
        kind = self._stack.usable(None)
        for slot in slots:
            self._stack.free_quietly(kind, slot)

    # -- read path (tiers/leases.py) ----------------------------------------------------
    def acquire_steps(self, namespace: bytes, hashes: Iterable[BlockHash], tier: TierKind | None = None) -> Steps[ReadLease]:
        """Lease the longest cached prefix of ``hashes``, moved into ``tier`` first (default:
        the top tier). Blocks that cannot be moved or fail verification end the prefix."""
        nbytes = self.block_bytes(namespace)
        kind = self._stack.usable(tier)
        return (yield from self._leases.acquire_steps(namespace, nbytes, kind, hashes))

    def acquire(self, namespace: bytes, hashes: Iterable[BlockHash], tier: TierKind | None = None) -> ReadLease:
        return run(self.acquire_steps(namespace, hashes, tier))

    def lease_views(self, lease: ReadLease) -> list[torch.Tensor]:
        """Views of a lease's blocks where they are now. A lease whose blocks were dropped
        under it (its tier's memory was replaced) has none: its slots hold other bytes."""
        if self._leases.holds(lease.id) and not all(map(self._residency.is_cached, self._leases.entries(lease.id))):
            raise TierUnavailable(f"the blocks of lease {lease.id} were dropped from the {lease.tier.value} tier; treat them as misses.")
        slots = [block.slot for block in lease.blocks]
        return self._stack.views(lease.tier, slots, lease.nbytes, "cannot be read through views")

    def release(self, lease_id: int, corrupt_index: int | None = None) -> None:
        """Let go of a lease; ``corrupt_index`` names a block its reader found corrupt (it is dropped)."""
        self._leases.release(lease_id, corrupt_index)

    def holds_lease(self, lease_id: int) -> bool:
        return self._leases.holds(lease_id)

    def get(self, namespace: bytes, block_hash: BlockHash, out: torch.Tensor) -> bool:
        """Copy one cached block into ``out``; False on a miss."""
        lease = self.acquire(namespace, [block_hash])
        try:
            if not lease.blocks:
                return False
            entry = self._leases.entries(lease.id)[0]
            self._stack[lease.tier].read(lease.blocks[0].slot, byte_view(out), block_meta(entry))
            return True
        finally:
            self.release(lease.id)

    # -- control ----------------------------------------------------------------------
    def pin(self, namespace: bytes, hashes: Iterable[BlockHash]) -> int:
        """Keep blocks from eviction until unpinned; returns how many were found."""
        return self._residency.pin(self._entries_for(namespace, hashes))

    def unpin(self, namespace: bytes, hashes: Iterable[BlockHash]) -> int:
        return self._residency.unpin(self._entries_for(namespace, hashes))

    def retain(self, namespace: bytes, hashes: Sequence[BlockHash], ttl_s: float) -> RetainResult:
        """Keep the blocks of ``hashes`` for ``ttl_s`` (at most ``config.max_retain_s``): a
        soft pin (tiers/retention.py). Retained blocks are evicted only when a tier has no
        other block to give, demoted to the tier below where there is one, and a block
        stored under a retained key before the deadline is retained too. In order, as far
        as the budget (``config.max_retained_fraction``) goes; a later deadline of a key
        already retained is kept."""
        nbytes = self.block_bytes(namespace)
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise InvalidArgument(f"ttl_s must be a number of seconds above 0 (at most {self.config.max_retain_s:g}), got {ttl_s}.")
        granted = min(ttl_s, self.config.max_retain_s)
        keys = [(namespace, block_hash) for block_hash in hashes]
        num_found, num_retained = self._residency.retain(keys, nbytes, self._clock() + granted)
        return RetainResult(num_found, num_retained, granted)

    def expire_retention(self) -> int:
        """End the retentions past their deadline (eviction does so too, as it picks);
        returns how many keys were let go."""
        return self._residency.expire_retention()

    @property
    def num_retained(self) -> int:
        """Block keys retained now, their blocks cached here or not (yet)."""
        return len(self._residency.retention)

    @property
    def retained_bytes(self) -> int:
        """What the retained keys count against the budget (their namespaces' block sizes)."""
        return self._residency.retention.num_bytes

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
            candidates = list(dict.fromkeys(self._entries_for(namespace, hashes)))  # a hash named twice is one block
        else:
            candidates = [e for e in self.catalogue if namespace is None or e.key[0] == namespace]
        now = self._clock()
        evicted = skipped = 0
        for entry in candidates:
            if tier is not None and entry.tier != tier:
                continue
            if idle_for_s is not None and now - entry.last_access < idle_for_s:
                continue
            if not entry.evictable or self._residency.lookup_held(entry):
                skipped += 1
                continue
            self._residency.drop(entry, RemovalReason.EXPLICIT)
            evicted += 1
        return EvictResult(evicted, skipped)

    def relieve_pressure_steps(self) -> Steps[int]:
        """Demote from every tier above its high watermark to under its low one; returns the
        number of blocks moved."""
        return (yield from self._mover.relieve_pressure_steps())

    def relieve_pressure(self) -> int:
        return run(self.relieve_pressure_steps())

    def persist_steps(self, batch: int = 256) -> Steps[int]:
        """Move every block of the tiers above the lowest one into it, as far as it has room
        (before a planned restart: only the lowest, persistent tier survives one). Returns
        the number of blocks moved."""
        return (yield from self._mover.persist_steps(batch))

    def persist(self, batch: int = 256) -> int:
        return run(self.persist_steps(batch))

    # -- the host tier's file ---------------------------------------------------------------
    def host_slab_problem(self) -> str | None:
        """None while the host tier's path names the file it maps (or there is no host
        tier); else a sentence saying it was removed or replaced."""
        tier = self._host_tier()
        return None if tier is None else tier.file_problem()

    def replace_host_slab(self) -> int:
        """Give the host tier a new file at its path, dropping every block it held (copying
        the old file's bytes over would stall the owner's thread for the whole slab, while
        engines that still map it may write into it) and aborting its open reservations
        (their writers copy into the old file).
        Leases already granted read the old mapping, which stays until they are released.
        Returns the number of blocks dropped; when the file cannot be made
        (TierUnavailable), nothing changed. The caller then ends the sessions of engines
        that map the old file, before they are handed slots of the new one."""
        tier = self._host_tier()
        if tier is None:
            return 0
        self.wait_moves()  # a promotion under way lands in the old mapping
        tier.recreate()  # first: when it fails, nothing changed
        self._reservations.abort_all(tier.kind)
        dropped = [entry for entry in self.catalogue if entry.tier is tier.kind]
        for entry in dropped:
            self._residency.drop(entry, RemovalReason.TIER_FAILED)
        self.counters["host_slab_recreated"] += 1
        return len(dropped)

    def _host_tier(self) -> HostTier | None:
        return next((tier for tier in self._stack if isinstance(tier, HostTier)), None)

    # -- I/O completion ---------------------------------------------------------------------
    def wait_moves(self) -> None:
        """Block until every move in flight has ended and apply their outcomes (before a
        synchronous owner takes over from an asynchronous one, e.g. at shutdown)."""
        while self._mover.num_in_flight:
            run(self._mover.wait_in_flight_steps())

    def reap(self) -> int:
        """Apply the outcome of every move whose NVMe transfer has ended; returns how many."""
        return self._mover.reap()

    def on_io_done(self, callback: Callable[[], None] | None) -> None:
        """Have ``callback`` called (from an I/O thread) whenever a move's transfer ends, so
        that an owner that does not wait for every move itself can ``reap`` on its thread."""
        self._mover.on_io_done = callback

    # -- inspection -------------------------------------------------------------------
    def tier(self, kind: TierKind) -> Tier:
        return self._stack[kind]

    @property
    def tier_kinds(self) -> list[TierKind]:
        return self._stack.usable_kinds

    def tier_stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self._stack]

    @property
    def failed_tiers(self) -> set[TierKind]:
        return set(self._stack.failed)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    @property
    def quarantined_slots(self) -> int:
        """Slots of expired reservations kept for writers that may still write them."""
        return self._reservations.quarantined_slots

    @property
    def num_moves_in_flight(self) -> int:
        return self._mover.num_in_flight

    def blocks(self, namespace: bytes | None = None, tier: TierKind | None = None) -> Iterator[BlockInfo]:
        for e in self.catalogue:
            if (namespace is None or e.key[0] == namespace) and (tier is None or e.tier == tier):
                parent = None if e.parent_key is None else e.parent_key[1]
                yield BlockInfo(e.key[0], e.key[1], parent, e.tier, e.nbytes, e.stored_at, e.last_access, e.pinned, e.num_leases)

    def close(self) -> None:
        for tier in self._stack:
            tier.close()

    # -- internals --------------------------------------------------------------------
    def _new_id(self) -> int:
        """A handle nobody can guess: random, above 2**32, unused by any reservation, lease or hold."""
        while True:
            handle = secrets.randbits(63)
            if handle > 1 << 32 and not any(kind.holds(handle) for kind in (self._reservations, self._leases, self._holds)):
                return handle

    def _entries_for(self, namespace: bytes, hashes: Iterable[BlockHash]) -> Iterator[BlockEntry]:
        self.block_bytes(namespace)
        for block_hash in hashes:
            entry = self.catalogue.get((namespace, block_hash))
            if entry is not None:
                yield entry

    def _adopt_recovered(self, tier: Tier, recovered: Iterable[tuple[Slot, BlockMeta, int]]) -> None:
        """Catalogue what a persistent tier found in its slots at start; a block whose
        namespace is known with another block size, or that is cached already, is freed."""
        now = self._clock()
        for slot, meta, checksum in recovered:
            key = (meta.namespace, meta.block_hash)
            known = self._block_bytes.setdefault(meta.namespace, meta.nbytes)
            if known != meta.nbytes or key in self.catalogue:
                tier.free(slot)
                continue
            self._namespaces.setdefault(meta.namespace, None)
            parent_key = None if meta.parent_hash is None else (meta.namespace, meta.parent_hash)
            self._residency.add([BlockEntry(key, parent_key, tier.kind, slot, meta.nbytes, now, checksum)])
            self.events.append(BlockStored(meta.namespace, (meta.block_hash,), meta.parent_hash, tier.kind, meta.nbytes))
            self.counters["blocks_recovered"] += 1


def _check_chain_metadata(hashes: Sequence[BlockHash], parent_hash: BlockHash | None) -> None:
    """Refuse a chain whose hashes a tier could not record: checked where blocks enter, so
    that malformed metadata is the caller's error now, never a tier's failure later. On
    every save: the lengths are counted in C, not looped over."""
    if parent_hash is not None and len(parent_hash) != HASH_BYTES:
        raise InvalidArgument(f"parent_hash must be None or {HASH_BYTES} bytes, got {len(parent_hash)} bytes.")
    lengths = list(map(len, hashes))
    if lengths.count(HASH_BYTES) != len(lengths):
        index = next(i for i, n in enumerate(lengths) if n != HASH_BYTES)
        raise InvalidArgument(f"block hash {index} of the chain must be {HASH_BYTES} bytes, got {lengths[index]} bytes.")
