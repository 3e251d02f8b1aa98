"""Moving blocks between tiers: room on demand, demotion by watermark, promotion for
readers, persisting before a restart, and taking a tier that fails out of service.

Caching is exclusive: a move copies a block into a slot of the destination, frees its
source slot and updates its catalogue entry in place, so the block is in exactly one tier
before and after. ``allocate`` makes room in a tier by evicting its policy's victims,
each demoted to the next usable tier down (which may make room there the same way) or
dropped from the lowest. ``relieve_pressure`` demotes from every tier above its high
watermark until it is under its low one. A move whose source fails verification drops
that block (a doubtful block is a miss, never data); one whose destination fails an I/O
takes that tier out of service, and the node keeps serving from the tiers above.

The entries given to ``move_many`` are held by the caller (tiers/residency.py), so none of
them is picked as a victim to make room for another.

Owner: the tier manager's thread (see tiers/manager.py). NVMe transfers run in that
tier's I/O pool, but ``move_many`` waits for every transfer it started before it returns,
so no state here is shared with the pool.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvstore.errors import CorruptBlock, InvalidArgument, TierUnavailable
from kvstore.events import BlockMoved, EventQueue, RemovalReason
from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.catalogue import BlockEntry
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.residency import Residency
from kvstore.tiers.slab import Slot
from kvstore.tiers.stack import TierStack

__all__ = ["Mover", "block_meta"]


def block_meta(entry: BlockEntry) -> BlockMeta:
    """What a tier records next to a block's bytes (NVMe writes it into the slot header)."""
    parent = None if entry.parent_key is None else entry.parent_key[1]
    return BlockMeta(entry.key[0], entry.key[1], parent, entry.nbytes)


@dataclass(slots=True)
class _Move:
    entry: BlockEntry
    src: TierKind
    src_slot: Slot
    dst_slot: Slot
    future: Future = field(repr=False)


class Mover:
    def __init__(
        self,
        stack: TierStack,
        residency: Residency,
        events: EventQueue,
        counters: collections.Counter[str],
        high_watermark: float,
        low_watermark: float,
    ) -> None:
        self._stack = stack
        self._residency = residency
        self._events = events
        self._counters = counters
        self._high_watermark = high_watermark
        self._low_watermark = low_watermark

    def allocate(self, kind: TierKind, nbytes: int) -> Slot | None:
        """A slot in ``kind``, evicting (demoting or dropping) its victims until one frees."""
        tier = self._stack[kind]
        slot = tier.allocate(nbytes)
        while slot is None:
            victim = self._residency.victim(kind)
            if victim is None:
                return None
            self._demote_or_drop(victim)
            slot = tier.allocate(nbytes)
        return slot

    def move_many(self, entries: list[BlockEntry], dst: TierKind) -> set[BlockEntry]:
        """Move held entries into ``dst`` with their transfers in flight together; returns
        those that arrived. A corrupt source drops the block; a failed destination tier is
        taken out of service."""
        residency = self._residency
        for entry in entries:
            residency.set_moving(entry, True)
        moves: list[_Move] = []
        for entry in entries:
            slot = self.allocate(dst, entry.nbytes)
            if slot is None:
                break
            future = self._transfer(entry.tier, entry.slot, dst, slot, block_meta(entry))
            moves.append(_Move(entry, entry.tier, entry.slot, slot, future))
        arrived: set[BlockEntry] = set()
        moved_hashes: dict[tuple[bytes, TierKind], list[BlockHash]] = {}
        for move in moves:
            error = move.future.exception()
            if error is None:
                self._stack.free_quietly(move.src, move.src_slot)
                move.entry.tier, move.entry.slot = dst, move.dst_slot
                arrived.add(move.entry)
                moved_hashes.setdefault((move.entry.key[0], move.src), []).append(move.entry.key[1])
                direction = "promoted" if dst.rank < move.src.rank else "demoted"
                self._counters[f"{direction}_{move.src.value}_to_{dst.value}"] += 1
                continue
            self._stack.free_quietly(dst, move.dst_slot)
            if isinstance(error, CorruptBlock):
                self._counters[f"corrupt_{move.src.value}"] += 1
                residency.drop(move.entry, RemovalReason.CORRUPT)
            elif isinstance(error, (TierUnavailable, OSError)):
                self._fail_tier(dst)
            else:
                raise error
        for (namespace, src), hashes in moved_hashes.items():
            self._events.append(BlockMoved(namespace, tuple(hashes), src, dst))
        for entry in entries:
            residency.set_moving(entry, False)
        return arrived

    def relieve_pressure(self) -> int:
        """Demote from every tier above its high watermark to under its low one; returns the
        number of blocks moved."""
        residency = self._residency
        moved = 0
        for kind in self._stack.order[:-1]:
            lower = self._stack.below(kind)
            if kind in self._stack.failed or lower is None:
                continue
            slab_stats = self._stack[kind].stats()
            if slab_stats.used_bytes <= self._high_watermark * slab_stats.capacity_bytes:
                continue
            target = self._low_watermark * slab_stats.capacity_bytes
            victims: list[BlockEntry] = []
            to_free = slab_stats.used_bytes - target
            while to_free > 0:
                victim = residency.victim(kind)
                if victim is None:
                    break
                residency.hold(victim)
                residency.set_moving(victim, True)
                victims.append(victim)
                to_free -= victim.slot.nbytes
            done = self.move_many(victims, lower)
            for victim in victims:
                residency.unhold(victim)
            moved += len(done)
        return moved

    def persist(self, batch: int) -> int:
        """Move every block of the tiers above the lowest usable one into it, as far as it
        has room; returns the number of blocks moved."""
        usable = self._stack.usable_kinds
        if len(usable) < 2:
            return 0
        residency = self._residency
        lowest = usable[-1]
        moved = 0
        for kind in usable[:-1]:
            entries = [e for e in residency.catalogue if e.tier == kind and e.evictable]
            for start in range(0, len(entries), batch):
                chunk = entries[start : start + batch]
                for entry in chunk:
                    residency.hold(entry)
                moved += len(self.move_many(chunk, lowest))
                for entry in chunk:
                    residency.unhold(entry)
        return moved

    def _demote_or_drop(self, entry: BlockEntry) -> None:
        lower = self._stack.below(entry.tier)
        if lower is not None:
            self._residency.hold(entry)
            moved = self.move_many([entry], lower)
            self._residency.unhold(entry)
            if moved or not self._residency.is_cached(entry):
                return
        self._residency.drop(entry, RemovalReason.CAPACITY)

    def _transfer(self, src: TierKind, src_slot: Slot, dst: TierKind, dst_slot: Slot, meta: BlockMeta) -> Future:
        src_tier, dst_tier = self._stack[src], self._stack[dst]
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
        unreadable) and the node keeps serving from the tiers above. Held blocks go when
        their holder lets go (Residency.unhold)."""
        if not self._stack.mark_failed(kind):
            return
        self._counters[f"tier_failed_{kind.value}"] += 1
        for entry in [e for e in self._residency.catalogue if e.tier == kind and e.evictable]:
            self._residency.drop(entry, RemovalReason.TIER_FAILED)
