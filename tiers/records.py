"""What the tier manager hands out and reports: reservations, read leases, block
listings, eviction results. Boundary values: callers hold them, only the manager makes
them."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.slab import Slot

__all__ = ["ReservedBlock", "Reservation", "LeasedBlock", "ReadLease", "BlockInfo", "EvictResult", "RetainResult"]


# Per-block records are plain slotted dataclasses (not frozen): one is made per block on
# the save and load paths, and a frozen dataclass's __init__ costs twice as much.
@dataclass(slots=True)
class ReservedBlock:
    block_hash: BlockHash
    parent_hash: BlockHash | None
    slot: Slot


@dataclass(frozen=True, slots=True)
class Reservation:
    id: int
    namespace: bytes
    tier: TierKind
    nbytes: int
    blocks: tuple[ReservedBlock, ...]  # new blocks to write, in chain order
    num_cached: int  # blocks of the request that were already cached (or being written)
    deadline: float


@dataclass(slots=True)
class LeasedBlock:
    block_hash: BlockHash
    slot: Slot
    checksum: int | None  # XXH3-64 its writer committed: a reader may verify what it copies


@dataclass(frozen=True, slots=True)
class ReadLease:
    id: int
    namespace: bytes
    tier: TierKind
    nbytes: int
    blocks: tuple[LeasedBlock, ...]  # the longest cached prefix, in chain order


@dataclass(frozen=True, slots=True)
class BlockInfo:
    namespace: bytes
    block_hash: BlockHash
    parent_hash: BlockHash | None
    tier: TierKind
    nbytes: int
    stored_at: float
    last_access: float
    pinned: bool
    num_leases: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    num_evicted: int
    num_skipped: int  # matched but leased, pinned or moving


@dataclass(frozen=True, slots=True)
class RetainResult:
    num_found: int  # blocks named that are cached here now
    num_retained: int  # keys named that are retained now (fewer than named: the budget is full)
    ttl_s: float  # the retention granted: as asked, or cut to the manager's maximum
