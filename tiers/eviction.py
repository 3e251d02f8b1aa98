"""Which resident block of a tier goes first when the tier needs room.

A policy sees only the blocks of one tier that may be evicted right now (not leased,
not pinned); the tier manager (tiers/residency.py) inserts and removes them as that
changes. Blocks are duck-typed: a policy reads ``block.key``, ``block.last_access``,
``block.is_tier_leaf`` (no cached child in this tier or a faster one) and
``block.reachable`` (every ancestor is cached, so a prefix lookup can reach it).

Why prefix-aware: a lookup walks a chain from its first block and stops at the first
miss, so a block whose ancestor is gone can never be hit (an *orphan*), and evicting an
interior block strands every descendant. ``LeafFirstLRU`` therefore evicts orphans
first, then leaves, and interior blocks only when a tier holds nothing else — always
least-recently-used first within each group. A block whose last child left becomes a
leaf; it joins the leaves at the head when it was used no later than the current head
(the usual case: a chain's blocks are used together, so trimming a cold chain carries on
up that chain instead of jumping to the tails of hotter ones), else at the tail.
Leaf-ness is per tier: a host block whose children were demoted to NVMe is a host leaf,
so demotion also proceeds from the tails of chains. ``LRU`` ignores structure; it is the
baseline the simulator compares against.

Retention (``block.retained``, a soft pin with a deadline, tiers/retention.py): every
policy picks a retained block only once no unretained candidate of the tier is left, so
retention orders eviction but never refuses room. ``LeafFirstLRU`` keeps retained leaves
and retained interior blocks in two more groups after the interior ones; a retained
orphan stays with the orphans (no lookup can reach it, so keeping it protects nothing).
A block whose retention ends joins its group as a block whose last child left does
(above): by when it was last used, not as if it had just been.

Owner: the tier manager; not thread-safe.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from kvstore.errors import InvalidArgument

__all__ = ["Evictable", "EvictionPolicy", "LRU", "LeafFirstLRU", "make_policy", "POLICIES"]


class Evictable(Protocol):
    key: Hashable
    last_access: float
    is_tier_leaf: bool
    reachable: bool
    retained: bool


class EvictionPolicy(abc.ABC):
    @abc.abstractmethod
    def insert(self, block: Evictable) -> None:
        """``block`` became a candidate (newly resident, or its lease/pin ended)."""

    @abc.abstractmethod
    def remove(self, block: Evictable) -> None:
        """``block`` stopped being a candidate (evicted, moved, leased or pinned)."""

    @abc.abstractmethod
    def touch(self, block: Evictable) -> None:
        """``block`` was used; it becomes the most recently used of its group."""

    @abc.abstractmethod
    def reclassify(self, block: Evictable) -> None:
        """``block``'s children, reachability or retention changed; its group may have changed."""

    @abc.abstractmethod
    def victim(self) -> Any | None:
        """The candidate to evict next, or None when there is none."""

    @abc.abstractmethod
    def __len__(self) -> int: ...


class LRU(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, Evictable] = OrderedDict()
        self._retained: OrderedDict[Hashable, Evictable] = OrderedDict()  # picked once ``_order`` is empty

    def _members(self, block: Evictable) -> OrderedDict[Hashable, Evictable]:
        return self._retained if block.retained else self._order

    def insert(self, block: Evictable) -> None:
        self._members(block)[block.key] = block

    def remove(self, block: Evictable) -> None:
        if self._order.pop(block.key, None) is None:
            self._retained.pop(block.key, None)

    def touch(self, block: Evictable) -> None:
        members = self._members(block)
        if block.key in members:
            members.move_to_end(block.key)

    def reclassify(self, block: Evictable) -> None:
        members = self._members(block)
        if block.key in members:
            return
        other = self._order if members is self._retained else self._retained
        if other.pop(block.key, None) is not None:
            _join(members, block)

    def victim(self) -> Evictable | None:
        for members in (self._order, self._retained):
            if members:
                return next(iter(members.values()))
        return None

    def __len__(self) -> int:
        return len(self._order) + len(self._retained)


def _join(members: OrderedDict[Hashable, Evictable], block: Evictable) -> None:
    """Add ``block`` to ``members`` (LRU first) by when it was last used: at the head when
    that was no later than the head's, else at the tail."""
    head = next(iter(members.values()), None)
    members[block.key] = block
    if head is not None and block.last_access <= head.last_access:
        members.move_to_end(block.key, last=False)


# in the order victims are taken; a retained group is its unretained one plus _RETAINED
_ORPHAN, _LEAF, _INTERIOR, _RETAINED_LEAF, _RETAINED_INTERIOR = 0, 1, 2, 3, 4
_RETAINED = _RETAINED_LEAF - _LEAF


class LeafFirstLRU(EvictionPolicy):
    def __init__(self) -> None:
        self._groups: tuple[OrderedDict[Hashable, Evictable], ...] = tuple(OrderedDict() for _ in range(_RETAINED_INTERIOR + 1))
        self._group_of: dict[Hashable, int] = {}

    @staticmethod
    def _group(block: Evictable) -> int:
        if not block.reachable:
            return _ORPHAN
        group = _LEAF if block.is_tier_leaf else _INTERIOR
        return group + _RETAINED if block.retained else group

    def insert(self, block: Evictable) -> None:
        group = self._group(block)
        self._group_of[block.key] = group
        self._groups[group][block.key] = block

    def _regroup(self, block: Evictable, group: int) -> None:
        self._group_of[block.key] = group
        _join(self._groups[group], block)

    def remove(self, block: Evictable) -> None:
        group = self._group_of.pop(block.key, None)
        if group is not None:
            del self._groups[group][block.key]

    def touch(self, block: Evictable) -> None:
        group = self._group_of.get(block.key)
        if group is not None:
            self._groups[group].move_to_end(block.key)

    def reclassify(self, block: Evictable) -> None:
        old = self._group_of.get(block.key)
        if old is None:
            return
        new = self._group(block)
        if new != old:
            del self._groups[old][block.key]
            self._regroup(block, new)

    def victim(self) -> Evictable | None:
        for group in self._groups:
            if group:
                return next(iter(group.values()))
        return None

    def __len__(self) -> int:
        return len(self._group_of)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"leaf-first-lru": LeafFirstLRU, "lru": LRU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}.") from None
