"""The cached blocks of a node and which of them may be evicted: the catalogue and one
eviction policy per tier, kept in step.

Invariant: a block is in its tier's policy exactly when it is cached and evictable (no
lease, hold or pin), in the group its children, reachability and retention say. Every
change of a block's holds, pin, children, reachability or retention goes through here so
that the invariant holds. A hold is how the rest of the manager keeps a block from being
picked while it works on it (a read lease, a move, the chain a reservation extends);
``unhold`` drops the block instead of returning it to its policy when its tier failed
meanwhile, so a failed tier's blocks all go once nobody holds them.
Lookup holds (``hold_keys``) are kept by key beside the policies and become holds only
when eviction reaches a held block. Retained keys (tiers/retention.py) are kept beside
them too; a cached block's ``retained`` flag follows its key's retention, which expires
here as eviction looks for a victim (and at ``expire_retention``).

A block dropped while held (it failed verification, its tier failed) leaves the
catalogue at once, so nobody new finds it, but its slot is freed only when its last
holder lets go: a reader may still be copying out of it.

Owner: the tier manager's thread (see tiers/manager.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from kvstore.events import BlockRemoved, EventQueue, RemovalReason
from kvstore.tier_kind import TierKind
from kvstore.tiers.catalogue import BlockEntry, BlockKey, Catalogue
from kvstore.tiers.eviction import make_policy
from kvstore.tiers.retention import Retention
from kvstore.tiers.stack import TierStack

__all__ = ["Residency"]


class Residency:
    def __init__(
        self, stack: TierStack, eviction_policy: str, events: EventQueue, counters: collections.Counter[str], retention: Retention
    ) -> None:
        self._stack = stack
        self._policies = {kind: make_policy(eviction_policy) for kind in stack.order}
        self._events = events
        self._counters = counters
        self.catalogue = Catalogue(self._reclassify)
        self.retention = retention
        self._retain_calls = 0  # retain calls so far: a key never gives way to another of its own call
        self._doomed: set[BlockEntry] = set()
        self._lookup_held: dict[bytes, dict[bytes, int]] = {}  # namespace → block hash → lookup holds on it
        self._holders: dict[bytes, int] = {}  # namespace → hold_keys calls not yet released
        # reached by eviction while lookup-held (a key dropped and stored again: both entries)
        self._picked_while_held: dict[tuple[bytes, bytes], list[BlockEntry]] = {}

    def add(self, entries: Sequence[BlockEntry]) -> None:
        """Cache new blocks. They join their policies once all of them are linked: each
        block of a chain enters its final group (interior, or leaf for the chain's tail)
        instead of entering as a leaf and moving when its child arrives."""
        self.catalogue.insert_chain(entries)
        retention = self.retention
        if retention:  # a block stored under a retained key is retained as it arrives
            for entry in entries:
                entry.retained = entry.key in retention
        for entry in entries:
            self._policies[entry.tier].insert(entry)

    def victim(self, kind: TierKind) -> BlockEntry | None:
        """The block that ``kind``'s policy would evict next, if any may be. A block a
        lookup holds (``hold_keys``) is passed over: from then on it is held like any other
        until the last lookup hold on it ends."""
        self.expire_retention()
        policy = self._policies[kind]
        while True:
            entry = policy.victim()
            if entry is None or not self.lookup_held(entry):
                return entry
            self.hold(entry)  # out of the policy
            self._picked_while_held.setdefault(entry.key, []).append(entry)

    def hold_keys(self, namespace: bytes, keys: Sequence[bytes]) -> None:
        """Keep the blocks ``keys`` of ``namespace`` from being picked (a lookup hold,
        tiers/holds.py). Lazy: nothing changes until eviction reaches one of them, so a
        hold costs a counter per block, not a policy update."""
        counts = self._lookup_held.get(namespace)
        if counts is None:  # the usual case: no other hold in this namespace
            self._lookup_held[namespace] = dict.fromkeys(keys, 1)  # a chain's keys are distinct
            self._holders[namespace] = 1
            return
        self._holders[namespace] += 1
        for key in keys:
            counts[key] = counts.get(key, 0) + 1

    def release_keys(self, namespace: bytes, keys: Sequence[bytes]) -> None:
        counts, picked = self._lookup_held.get(namespace), self._picked_while_held
        if counts is None:
            return
        self._holders[namespace] -= 1
        if not self._holders[namespace]:  # the last hold in this namespace: every count ends at once
            del self._lookup_held[namespace], self._holders[namespace]
            for key in [key for key in picked if key[0] == namespace] if picked else ():
                for entry in picked.pop(key):
                    self.unhold(entry)
            return
        for key in keys:
            remaining = counts.get(key, 0) - 1  # (a chain that repeats a key was counted once)
            if remaining > 0:
                counts[key] = remaining
                continue
            counts.pop(key, None)
            if picked:
                for entry in picked.pop((namespace, key), ()):
                    self.unhold(entry)
        if not counts:
            del self._lookup_held[namespace], self._holders[namespace]

    def retain(self, keys: Sequence[BlockKey], nbytes: int, deadline: float) -> tuple[int, int]:
        """Retain ``keys`` (``nbytes`` each) until ``deadline``, in order, as far as the
        retention budget goes: how many of them are cached, and how many are retained."""
        num_found = num_retained = 0
        self._retain_calls += 1
        for key in keys:
            entry = self.catalogue.get(key)
            num_found += entry is not None
            if not self.retention.grant(key, nbytes, deadline, self._retain_calls):
                continue
            num_retained += 1
            if entry is not None and not entry.retained:
                entry.retained = True
                self._reclassify(entry)
        displaced = self.retention.take_displaced()  # the longest-retained keys gave way to these
        self._counters["retained_displaced"] += len(displaced)
        self._release_retention(displaced)
        return num_found, num_retained

    def expire_retention(self) -> int:
        """End the retention of the keys past their deadline; returns how many."""
        expired = self.retention.expire()
        self._release_retention(expired)
        return len(expired)

    def _release_retention(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            entry = self.catalogue.get(key)
            if entry is not None and entry.retained:
                entry.retained = False
                self._reclassify(entry)

    def lookup_held(self, entry: BlockEntry) -> bool:
        held = self._lookup_held.get(entry.key[0])
        return held is not None and entry.key[1] in held

    def hold(self, entry: BlockEntry) -> None:
        if entry.evictable:
            self._policies[entry.tier].remove(entry)
        entry.num_leases += 1

    def unhold(self, entry: BlockEntry) -> None:
        entry.num_leases -= 1
        if entry.num_leases:
            return
        if not self.is_cached(entry):
            if entry in self._doomed:  # dropped while held: its slot goes with the last holder
                self._doomed.remove(entry)
                self._stack.free_quietly(entry.tier, entry.slot)
            return
        if entry.pinned:
            return
        if entry.tier in self._stack.failed:
            self.drop(entry, RemovalReason.TIER_FAILED)
        else:
            self._policies[entry.tier].insert(entry)

    def drop(self, entry: BlockEntry, reason: RemovalReason, free_slot: bool = True) -> None:
        """Remove a cached block; its slot is freed now, or by its last holder's ``unhold``
        (never, with ``free_slot`` False: a slot that could not be read back is retired)."""
        if entry.evictable:
            self._policies[entry.tier].remove(entry)
        self.catalogue.remove(entry)
        if free_slot:
            if entry.num_leases:
                self._doomed.add(entry)
            else:
                self._stack.free_quietly(entry.tier, entry.slot)
        self._events.append(BlockRemoved(entry.key[0], (entry.key[1],), entry.tier, reason))
        self._counters[f"evicted_{reason.value}"] += 1
        if entry.retained and reason is RemovalReason.CAPACITY:  # retention lost: nothing else was left to evict
            self._counters["retained_dropped"] += 1

    @property
    def num_doomed(self) -> int:
        """Blocks dropped while held whose slots wait for their holders."""
        return len(self._doomed)

    def set_moving(self, entry: BlockEntry, moving: bool) -> None:
        """A block on its way out of its tier stops counting as a child there, so its
        parent may be picked next in the same batch."""
        entry.moving = moving
        if entry.parent is not None:
            self._reclassify(entry.parent)

    def pin(self, entries: Iterable[BlockEntry]) -> int:
        count = 0
        for entry in entries:
            if entry.evictable:
                self._policies[entry.tier].remove(entry)
            entry.pinned = True
            count += 1
        return count

    def unpin(self, entries: Iterable[BlockEntry]) -> int:
        count = 0
        for entry in entries:
            if entry.pinned:
                entry.pinned = False
                if entry.evictable:
                    self._policies[entry.tier].insert(entry)
                count += 1
        return count

    def is_cached(self, entry: BlockEntry) -> bool:
        """False once ``entry`` was dropped (it may still be held by whoever took it)."""
        return self.catalogue.get(entry.key) is entry

    def _reclassify(self, entry: BlockEntry) -> None:
        if entry.evictable:
            self._policies[entry.tier].reclassify(entry)
