"""The tiers of one node, fastest first, and which of them have failed.

A tier that fails (an I/O error on NVMe) stays in the stack, so its stats are still
reported, but nothing is placed in it again until the daemon restarts: *usable* below
means not failed. ``failed`` is a frozenset that is replaced, never mutated, so a caller
may keep reading it without a copy.

Owner: the tier manager's thread (see tiers/manager.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence

import torch

from kvstore.errors import InvalidArgument, TierUnavailable
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import Tier
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.slab import Slot

__all__ = ["TierStack"]


class TierStack:
    def __init__(self, tiers: Sequence[Tier], counters: collections.Counter[str]) -> None:
        if not tiers:
            raise InvalidArgument("a tier manager needs at least one tier.")
        kinds = [tier.kind for tier in tiers]
        if len(set(kinds)) != len(kinds):
            raise InvalidArgument(f"each tier kind may appear once, got {[k.value for k in kinds]}.")
        self._tiers: dict[TierKind, Tier] = {t.kind: t for t in sorted(tiers, key=lambda t: t.kind.rank)}
        self.order: list[TierKind] = list(self._tiers)
        self.failed: frozenset[TierKind] = frozenset()
        self._counters = counters

    def __getitem__(self, kind: TierKind) -> Tier:
        return self._tiers[kind]

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers.values())

    @property
    def usable_kinds(self) -> list[TierKind]:
        return [k for k in self.order if k not in self.failed]

    def usable(self, tier: TierKind | None) -> TierKind:
        """``tier`` if this node has it and it works; None: the fastest tier that works."""
        if tier is None:
            for kind in self.order:
                if kind not in self.failed:
                    return kind
            raise TierUnavailable("every tier of this node has failed; restart the daemon after fixing the cause.")
        if tier not in self._tiers:
            raise InvalidArgument(f"this node has no {tier.value} tier; it has {[k.value for k in self.order]}.")
        if tier in self.failed:
            raise TierUnavailable(f"the {tier.value} tier has failed and is not used until the daemon restarts.", tier=tier)
        return tier

    def below(self, kind: TierKind) -> TierKind | None:
        """The next usable tier down from ``kind``, where its blocks are demoted to."""
        for lower in self.order[self.order.index(kind) + 1 :]:
            if lower not in self.failed:
                return lower
        return None

    def mark_failed(self, kind: TierKind) -> bool:
        """Take ``kind`` out of service; False when it was already."""
        if kind in self.failed:
            return False
        self.failed = self.failed | {kind}
        return True

    def capacity_in_blocks(self, kind: TierKind, nbytes: int) -> int:
        tier = self._tiers[kind]
        slab = getattr(tier, "slab", None)
        slot_bytes = slab.slot_bytes_for(nbytes) if slab is not None else nbytes
        return max(1, tier.stats().capacity_bytes // slot_bytes)

    def free_quietly(self, kind: TierKind, slot: Slot) -> None:
        try:
            self._tiers[kind].free(slot)
        except TierUnavailable:
            # the slot's header could not be cleared; its bytes still match its key, so a
            # restart that recovers it serves correct data
            self._counters[f"free_errors_{kind.value}"] += 1

    def views(self, kind: TierKind, slots: Iterable[Slot], nbytes: int, refusal: str) -> list[torch.Tensor]:
        """Zero-copy views of the first ``nbytes`` of each slot; a tier without addressable
        memory (NVMe, virtual) refuses with "the <kind> tier <refusal>."."""
        tier = self._tiers[kind]
        if not isinstance(tier, MemoryTier):
            raise InvalidArgument(f"the {kind.value} tier {refusal}.")
        return [tier.view(slot, nbytes) for slot in slots]
