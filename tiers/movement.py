"""Moving blocks between tiers: room on demand, demotion by watermark, promotion for
readers, persisting before a restart, and taking a tier that fails out of service.

Caching is exclusive: a move copies a block into a slot of the destination, then frees
its source slot and updates its catalogue entry in place, so the block is in exactly one
tier before and after. A move is a record (``Move``) that owns its destination slot and
holds its block from the moment its copy starts until ``finish`` applies its outcome, so
nothing else can use the slot or evict the block while NVMe I/O runs in that tier's
thread pool. Moves are finished on the owner's thread: by whoever waits for them, or by
``reap`` when the owner is told that I/O ended (``on_io_done``), so a move whose waiter
went away still finishes.

Outcomes, each the fault of the tier that caused it:

- the copy arrived: the block is in the destination — unless a reader leased it in its
  source tier meanwhile (a demotion of a block a reader picked up mid-copy): then it stays
  where the reader reads it and the copy is discarded;
- the source's bytes failed verification (an NVMe checksum, or host bytes that no longer
  match the checksum their writer committed): the block is dropped, a doubtful block is a
  miss, never data;
- the source could not be read (an NVMe read error): the block is dropped and its slot
  retired (never handed out again); the tier keeps serving its other blocks;
- the destination could not be written (an NVMe write error): that tier is taken out of
  service and the node keeps serving from the tiers above;
- anything else (a block whose metadata a tier cannot record or check): that block alone
  is dropped, a miss; no tier fails for one block, nor do the other blocks of its batch.

``allocate_steps`` makes room in a tier by evicting its policy's victims, each demoted
to the next usable tier down or dropped from the lowest; it waits (yields, see
tiers/steps.py) for the demotions it started, because a victim's slot is free only once
its bytes are out. Nothing here waits on I/O by itself.

Owner: the tier manager's thread (see tiers/manager.py); only ``_io_done`` runs on the
I/O pool's threads: it queues the move for ``reap`` and calls ``on_io_done``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvstore.errors import CorruptBlock, InvalidArgument, KVStoreError, TierUnavailable
from kvstore.events import BlockMoved, EventQueue, RemovalReason
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.catalogue import BlockEntry
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.residency import Residency
from kvstore.tiers.slab import Slot
from kvstore.tiers.stack import TierStack
from kvstore.tiers.steps import Steps

__all__ = ["Mover", "Move", "block_meta"]

logger = logging.getLogger(__name__)

# moves started together by one step of demotion: bounds the futures and slots in flight
MAX_MOVES_PER_STEP = 256


def block_meta(entry: BlockEntry) -> BlockMeta:
    """What a tier records next to a block's bytes (NVMe writes it into the slot header)."""
    parent = None if entry.parent_key is None else entry.parent_key[1]
    return BlockMeta(entry.key[0], entry.key[1], parent, entry.nbytes, entry.checksum)


@dataclass(slots=True, eq=False)
class Move:
    entry: BlockEntry
    src: TierKind
    src_slot: Slot
    dst: TierKind
    dst_slot: Slot
    future: Future = field(repr=False)
    finished: bool = False
    arrived: bool = False  # after finish: the block is in ``dst``


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
        self._in_flight: dict[BlockEntry, Move] = {}
        self._ended: collections.deque[Move] = collections.deque()  # moves whose I/O ended, queued by the I/O threads
        # called from an I/O thread when a move's transfer ends; an owner that does not
        # wait for every move itself (the daemon) uses it to schedule ``reap``
        self.on_io_done: Callable[[], None] | None = None

    # -- moves --------------------------------------------------------------------------
    def in_flight(self, entry: BlockEntry) -> Move | None:
        return self._in_flight.get(entry)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def start(self, entry: BlockEntry, dst: TierKind, dst_slot: Slot) -> Move:
        """Start copying ``entry`` into ``dst_slot`` of ``dst``; the move owns the slot and
        holds the block until ``finish``."""
        assert entry not in self._in_flight, "a block moves once at a time"
        residency = self._residency
        residency.hold(entry)
        residency.set_moving(entry, True)
        try:
            future = self._transfer(entry.tier, entry.slot, dst, dst_slot, block_meta(entry))
        except Exception as exc:  # refused before any I/O: the move's outcome, applied by finish like any other
            future = Future()
            future.set_exception(exc)
        move = Move(entry, entry.tier, entry.slot, dst, dst_slot, future)
        self._in_flight[entry] = move
        if not future.done():
            future.add_done_callback(lambda _, move=move: self._io_done(move))
        return move

    def _io_done(self, move: Move) -> None:  # on an I/O thread
        self._ended.append(move)  # deque appends are atomic; the owner pops them in reap
        callback = self.on_io_done
        if callback is not None:
            callback()

    def wait_in_flight_steps(self) -> Steps[None]:
        """Wait for every move in flight and finish it."""
        moves = list(self._in_flight.values())
        if moves:
            yield [move.future for move in moves]
        for move in moves:
            self.finish(move)

    def reap(self) -> int:
        """Finish every move whose transfer has ended and nobody finished yet; returns how
        many. It costs what has ended, not what is in flight."""
        reaped = 0
        ended = self._ended
        while ended:
            move = ended.popleft()
            if not move.finished:
                self.finish(move)
                reaped += 1
        return reaped

    def finish(self, move: Move) -> bool:
        """Apply the outcome of a move whose transfer has ended (once; later calls return
        the same answer): True when the block is now in the destination."""
        if move.finished:
            return move.arrived
        move.finished = True
        del self._in_flight[move.entry]
        entry, residency, stack = move.entry, self._residency, self._stack
        residency.set_moving(entry, False)
        error = move.future.exception()
        if error is None and residency.is_cached(entry) and entry.num_readers == 0:
            stack.free_quietly(move.src, move.src_slot)
            residency.catalogue.relocate(entry, move.dst, move.dst_slot)
            move.arrived = True
            self._events.append(BlockMoved(entry.key[0], (entry.key[1],), move.src, move.dst))
            direction = "promoted" if move.dst.rank < move.src.rank else "demoted"
            self._counters[f"{direction}_{move.src.value}_to_{move.dst.value}"] += 1
        else:
            stack.free_quietly(move.dst, move.dst_slot)
            if error is None and residency.is_cached(entry):
                # a reader leased it where it was while it was copied: it stays for the reader
                self._counters["moves_undone_for_readers"] += 1
            elif error is not None:
                self._failed(move, error)
        residency.unhold(entry)
        return move.arrived

    def _failed(self, move: Move, error: BaseException) -> None:
        entry, residency = move.entry, self._residency
        if isinstance(error, CorruptBlock):
            self._counters[f"corrupt_{move.src.value}"] += 1
            if residency.is_cached(entry):
                residency.drop(entry, RemovalReason.CORRUPT)
            return
        if isinstance(error, TierUnavailable) and error.tier in (move.src, move.dst):
            failed = error.tier
        elif isinstance(error, (TierUnavailable, OSError)):
            # no tier named: the side that does I/O (memory copies do not fail this way)
            failed = move.dst if not isinstance(self._stack[move.dst], MemoryTier) else move.src
        else:
            self._drop_unmovable(move, error)
            return
        if failed is move.src:
            # this block could not be read back: it is lost and its slot is never reused;
            # the tier's other blocks keep serving
            self._counters[f"read_errors_{move.src.value}"] += 1
            self._counters[f"slots_retired_{move.src.value}"] += 1
            if residency.is_cached(entry):
                residency.drop(entry, RemovalReason.TIER_FAILED, free_slot=False)
        else:
            self._fail_tier(failed)

    def _drop_unmovable(self, move: Move, error: BaseException) -> None:
        """A move that failed for no I/O reason failed for this block's own sake (metadata
        a tier cannot record or check): the block alone is lost, as a doubtful block is a
        miss; both tiers and the other blocks moving with it go on."""
        entry = move.entry
        if isinstance(error, KVStoreError):
            logger.warning(
                "Block %s could not move from %s to %s and is dropped (a miss): %s",
                entry.key[1].hex(),
                move.src.value,
                move.dst.value,
                error,
            )
        else:
            logger.error(
                "Block %s could not move from %s to %s and is dropped (a miss)",
                entry.key[1].hex(),
                move.src.value,
                move.dst.value,
                exc_info=error,
            )
        self._counters[f"unmovable_{move.src.value}"] += 1
        if self._residency.is_cached(entry):
            self._residency.drop(entry, RemovalReason.CORRUPT)

    # -- room -----------------------------------------------------------------------------
    def allocate_steps(self, kind: TierKind, nbytes: int, count: int) -> Steps[list[Slot]]:
        """Up to ``count`` slots in ``kind`` (fewer when nothing more can be evicted),
        evicting victims — demoted to the tier below, or dropped from the lowest — and
        waiting for the demotions that free their slots."""
        tier = self._stack[kind]
        slots: list[Slot] = []
        waited_for_others = False
        try:
            while len(slots) < count:
                free = tier.allocate_many(nbytes, count - len(slots))
                if free:
                    slots += free
                    continue
                waits: list[Move] = []
                evicted = 0
                for _ in range(min(count - len(slots), MAX_MOVES_PER_STEP)):
                    victim = self._residency.victim(kind)
                    if victim is None:
                        break
                    move = self._evict(victim)
                    evicted += 1
                    if move is not None:
                        waits.append(move)
                if waits:
                    yield [move.future for move in waits]
                    for move in waits:
                        self.finish(move)
                    continue
                if evicted:
                    continue
                # nothing evictable is left; moves out of this tier that others started may still free room
                others = [move for move in self._in_flight.values() if move.src is kind]
                if not others or waited_for_others:
                    break
                waited_for_others = True
                yield [move.future for move in others]
                for move in others:
                    self.finish(move)
        except BaseException:
            for slot in slots:
                self._stack.free_quietly(kind, slot)
            raise
        return slots

    def _evict(self, victim: BlockEntry) -> Move | None:
        """Start demoting ``victim`` to the tier below (the move, unless it finished at
        once), or drop it where there is none or no room there."""
        lower = self._stack.below(victim.tier)
        if lower is not None:
            slot = self._allocate_now(lower, victim.nbytes)
            if slot is not None:
                move = self.start(victim, lower, slot)
                if not move.future.done():
                    return move
                if self.finish(move) or not self._residency.is_cached(victim):
                    return None
        if self._residency.is_cached(victim) and victim.evictable:
            self._residency.drop(victim, RemovalReason.CAPACITY)
        return None

    def _allocate_now(self, kind: TierKind, nbytes: int) -> Slot | None:
        """A slot of ``kind`` without waiting: free, or made free by dropping victims (the
        lowest tier's blocks go nowhere else) or by demotions that finish at once."""
        tier = self._stack[kind]
        slot = tier.allocate(nbytes)
        while slot is None:
            victim = self._residency.victim(kind)
            if victim is None:
                return None
            lower = self._stack.below(kind)
            moved = False
            if lower is not None:
                below_slot = self._stack[lower].allocate(victim.nbytes)
                if below_slot is not None:
                    move = self.start(victim, lower, below_slot)
                    if not move.future.done():
                        return None  # would wait: the caller demotes elsewhere or drops instead
                    moved = self.finish(move)
            if not moved and self._residency.is_cached(victim):
                self._residency.drop(victim, RemovalReason.CAPACITY)
            slot = tier.allocate(nbytes)
        return slot

    def start_many(self, entries: list[BlockEntry], dst: TierKind) -> Steps[list[Move]]:
        """Start moving held ``entries`` into ``dst``, as many as room can be made for, in
        order; returns the moves started (finish each once its future is done). An entry
        that another operation started moving, moved or dropped while room was being made
        is left out (its caller finds it in flight, or where it is now)."""
        if not entries:
            return []
        slots = yield from self.allocate_steps(dst, entries[0].nbytes, len(entries))
        moves = []
        for entry, slot in zip(entries, slots):
            if entry in self._in_flight or entry.tier is dst or not self._residency.is_cached(entry):
                self._stack.free_quietly(dst, slot)
            else:
                moves.append(self.start(entry, dst, slot))
        return moves

    def relieve_pressure_steps(self) -> Steps[int]:
        """Demote from every tier above its high watermark to under its low one; returns the
        number of blocks moved."""
        residency = self._residency
        moved = 0
        for kind in self._stack.order[:-1]:
            lower = self._stack.below(kind)
            if kind in self._stack.failed or lower is None:
                continue
            stats = self._stack[kind].stats()
            if stats.used_bytes <= self._high_watermark * stats.capacity_bytes:
                continue
            to_free = stats.used_bytes - self._low_watermark * stats.capacity_bytes
            while to_free > 0:
                victims: list[BlockEntry] = []
                while to_free > 0 and len(victims) < MAX_MOVES_PER_STEP:
                    victim = residency.victim(kind)
                    if victim is None:
                        break
                    residency.hold(victim)
                    residency.set_moving(victim, True)  # its parent may be picked next in this batch
                    victims.append(victim)
                    to_free -= victim.slot.nbytes
                if not victims:
                    break
                for victim in victims:
                    residency.set_moving(victim, False)
                try:
                    moves = self._demote_now(victims, lower)
                    if moves:
                        yield [move.future for move in moves if not move.future.done()]
                    moved += sum(self.finish(move) for move in moves)
                finally:
                    for victim in victims:
                        residency.unhold(victim)
                if len(moves) < len(victims):
                    break  # the tier below is full of blocks that cannot go
        return moved

    def _demote_now(self, entries: list[BlockEntry], lower: TierKind) -> list[Move]:
        """Demotions of held ``entries`` into ``lower``, as far as it has (or can make) room
        without waiting — the lowest tier only drops its own victims."""
        moves = []
        for entry in entries:
            slot = self._allocate_now(lower, entry.nbytes)
            if slot is None:
                break
            moves.append(self.start(entry, lower, slot))
        return moves

    def persist_steps(self, batch: int) -> Steps[int]:
        """Move every block of the tiers above the lowest usable one into it, as far as it
        has room; returns the number of blocks moved."""
        usable = self._stack.usable_kinds
        if len(usable) < 2:
            return 0
        residency = self._residency
        lowest = usable[-1]
        moved = dropped = 0
        for kind in usable[:-1]:
            entries = [e for e in residency.catalogue if e.tier == kind and e.evictable and e not in self._in_flight]
            for start in range(0, len(entries), batch):
                # what changed while earlier chunks were written (moved, dropped, held) is left alone
                chunk = [e for e in entries[start : start + batch] if residency.is_cached(e) and e.evictable and e.tier == kind]
                for entry in chunk:
                    residency.hold(entry)
                try:
                    moves = self._demote_now(chunk, lowest)
                    if moves:
                        yield [move.future for move in moves if not move.future.done()]
                    moved += sum(self.finish(move) for move in moves)
                    dropped += sum(not residency.is_cached(move.entry) for move in moves)
                finally:
                    for entry in chunk:
                        residency.unhold(entry)
        left = sum(1 for e in residency.catalogue if e.tier in usable[:-1])
        if dropped or left:
            logger.warning(
                "%d blocks could not be persisted and will be misses after restart: %d were dropped as they moved "
                "(unreadable, changed since committed, or with metadata %s cannot record), %d stayed in memory "
                "(no room in %s, held by a reader, or %s failed).",
                dropped + left,
                dropped,
                lowest.value,
                left,
                lowest.value,
                lowest.value,
            )
        return moved

    # -- internals ----------------------------------------------------------------------
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
