"""Tiers whose slots live in one flat byte tensor, and the capacity-only tier.

``MemoryTier.view()`` returns a zero-copy uint8 view of a slot: engines and the tier
manager copy straight into and out of it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kvstore.errors import BlockSizeMismatch, TierUnavailable
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta, Tier, TierStats, block_checksum, byte_view, copy_all_checksummed, copy_bytes
from kvstore.tiers.slab import SlabAllocator, Slot, even_page_bytes

__all__ = ["MemoryTier", "VirtualTier", "DEFAULT_PAGE_BYTES"]

DEFAULT_PAGE_BYTES = 64 * 1024 * 1024


class _SlabTier(Tier):
    def __init__(self, kind: TierKind, capacity_bytes: int, page_bytes: int) -> None:
        """Pages of at most ``page_bytes`` that divide the capacity (slab.even_page_bytes)."""
        self.kind = kind
        self._slab = SlabAllocator(capacity_bytes, even_page_bytes(capacity_bytes, page_bytes))

    @property
    def slab(self) -> SlabAllocator:
        return self._slab

    def allocate(self, nbytes: int) -> Slot | None:
        return self._slab.allocate(nbytes)

    def allocate_many(self, nbytes: int, count: int) -> list[Slot]:
        return self._slab.allocate_many(nbytes, count)

    def free(self, slot: Slot) -> None:
        self._slab.free(slot)

    def stats(self) -> TierStats:
        return TierStats(self.kind, self._slab.capacity_bytes, self._slab.used_bytes, self._slab.num_used_slots)


class MemoryTier(_SlabTier):
    def __init__(self, kind: TierKind, buffer: torch.Tensor, page_bytes: int = DEFAULT_PAGE_BYTES) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise TierUnavailable("a memory tier needs a flat uint8 buffer.")
        super().__init__(kind, buffer.numel(), page_bytes)
        self._buffer = buffer
        # CPU slots are copied by address: slicing a tensor per block costs more than a
        # quarter of a 256 KiB memcpy's time
        self._cpu_base = buffer.data_ptr() if buffer.device.type == "cpu" else None
        # what the checksums of writes are taken from, sliced per block without a tensor
        self._cpu_bytes = memoryview(buffer.numpy()) if self._cpu_base is not None else None

    @property
    def buffer(self) -> torch.Tensor:
        return self._buffer

    def view(self, slot: Slot, nbytes: int | None = None) -> torch.Tensor:
        """A zero-copy view of the first ``nbytes`` (default: all) of ``slot``."""
        length = slot.nbytes if nbytes is None else nbytes
        return self._buffer[slot.offset : slot.offset + length]

    def write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> None:
        data = _checked_bytes(src, meta)
        if self._cpu_base is not None and data.device.type == "cpu":
            ctypes.memmove(self._cpu_base + slot.offset, data.data_ptr(), meta.nbytes)
        else:
            copy_bytes(self.view(slot, meta.nbytes), data)

    def write_checksummed(self, slots: Sequence[Slot], sources: Sequence[torch.Tensor]) -> list[int]:
        """Copy each source (a flat uint8 tensor of a block's bytes) into its slot and return
        the XXH3-64 of each block. From host memory into host memory the checksums are taken
        beside the copy (``copy_all_checksummed``); otherwise the copy is waited for and the
        bytes are hashed where they are in host memory."""
        for slot, source in zip(slots, sources):
            if source.numel() > slot.nbytes:
                raise BlockSizeMismatch(f"a block of {source.numel()} bytes does not fit a {slot.nbytes}-byte slot.")
        base, landed = self._cpu_base, self._cpu_bytes
        if base is not None and all(source.is_cpu for source in sources):
            return copy_all_checksummed([base + slot.offset for slot in slots], sources)
        checksums = []
        for slot, source in zip(slots, sources):
            target = self.view(slot, source.numel())
            target.copy_(source)  # blocking: the bytes are in place before they are hashed
            checksums.append(block_checksum(target if landed is not None else source.cpu()))
        return checksums

    def read(self, slot: Slot, dst: torch.Tensor, meta: BlockMeta) -> None:
        data = _checked_bytes(dst, meta)
        if self._cpu_base is not None and data.device.type == "cpu":
            ctypes.memmove(data.data_ptr(), self._cpu_base + slot.offset, meta.nbytes)
        else:
            copy_bytes(data, self.view(slot, meta.nbytes))


class VirtualTier(_SlabTier):
    """Slots without bytes: the routing simulator models tiers of hundreds of GB with the
    production allocator, eviction and tier manager, but stores nothing."""

    holds_bytes = False

    def write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> None:
        pass

    def read(self, slot: Slot, dst: torch.Tensor, meta: BlockMeta) -> None:
        raise TierUnavailable("a virtual tier holds no bytes; it exists for capacity simulation only.")


def _checked_bytes(tensor: torch.Tensor, meta: BlockMeta) -> torch.Tensor:
    data = byte_view(tensor)
    if data.numel() != meta.nbytes:
        raise BlockSizeMismatch(f"the block needs {meta.nbytes} bytes but the tensor given holds {data.numel()}.")
    return data
