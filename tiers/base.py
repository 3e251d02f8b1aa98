"""The `Tier` interface: a place that holds block bytes in fixed-size slots.

A tier knows nothing about keys, prefixes or eviction (that is the tier manager's job);
it hands out slots, moves bytes in and out of them, and reports how full it is.

    Tier
    ├── MemoryTier (tiers/memory.py)   slots over a byte tensor; `view()` is zero-copy
    │   ├── HostTier (tiers/host.py)    a shared-memory file other processes map by name
    │   └── HbmTier  (tiers/hbm.py)     a CUDA tensor (a CPU tensor in tests)
    ├── NvmeTier  (tiers/nvme.py)       preallocated slot files with verified headers
    └── VirtualTier (tiers/memory.py)   capacity accounting only, for the routing simulator
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

import torch

from kvstore.hashing import BlockHash
from kvstore.tiers.slab import Slot

__all__ = ["TierKind", "BlockMeta", "Tier", "TierStats"]


class TierKind(str, enum.Enum):
    """Where a block lives, fastest first. GPU is an engine's own prefix cache (reported by
    its KV events, never held by kvstore); REMOTE is a peer daemon's tier."""

    GPU = "gpu"
    HBM = "hbm"
    HOST = "host"
    NVME = "nvme"
    REMOTE = "remote"

    @property
    def rank(self) -> int:
        return _TIER_RANK[self]


_TIER_RANK = {TierKind.GPU: 0, TierKind.HBM: 1, TierKind.HOST: 2, TierKind.NVME: 3, TierKind.REMOTE: 4}


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a tier may record next to a block's bytes (the NVMe tier writes it in the slot
    header so that its catalogue survives a restart)."""

    namespace: bytes
    block_hash: BlockHash
    parent_hash: BlockHash | None
    nbytes: int


@dataclass(frozen=True, slots=True)
class TierStats:
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    num_blocks: int

    @property
    def occupancy(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


class Tier(abc.ABC):
    kind: TierKind

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> Slot | None:
        """A free slot that holds ``nbytes``, or None when the tier is full."""

    @abc.abstractmethod
    def free(self, slot: Slot) -> None:
        """Return a slot; its bytes are no longer valid."""

    @abc.abstractmethod
    def write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> None:
        """Copy ``src`` (a flat uint8 tensor of ``meta.nbytes`` bytes) into ``slot``."""

    @abc.abstractmethod
    def read(self, slot: Slot, dst: torch.Tensor, meta: BlockMeta) -> None:
        """Copy the block in ``slot`` into ``dst`` (flat uint8, ``meta.nbytes`` long).
        Raises CorruptBlock when the stored bytes fail verification."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """Capacity and occupancy right now."""

    def close(self) -> None:
        """Release OS resources; the default holds none."""
