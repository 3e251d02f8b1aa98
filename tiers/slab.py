"""Slab allocation: fixed-size slots carved from fixed-size pages, one size class per slot size.

The address space of a tier (a shared-memory file, a CUDA tensor, a set of files) is cut
into pages of ``page_bytes``. A page is handed to a size class the first time that class
needs room and carved into equal slots; when every slot of a page is free again the page
goes back to the shared pool, so classes can trade space as the mix of layouts changes.
Allocation and release are O(1) and never fragment: no block ever straddles a page.

Owner: the tier that holds the memory; not thread-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import NamedTuple

from kvstore.errors import InvalidArgument

__all__ = ["Slot", "SlabAllocator", "even_page_bytes", "round_up"]


class Slot(NamedTuple):
    offset: int
    nbytes: int


def round_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def even_page_bytes(capacity_bytes: int, page_bytes: int, alignment: int = 4096) -> int:
    """The largest aligned page size, at most ``page_bytes``, whose pages split
    ``capacity_bytes`` evenly: as many pages as ``page_bytes`` would need, rounded up. A
    slab keeps only whole pages, so 99 MiB in 64 MiB pages would be one page and 35 MiB
    never used; in two pages of 49.5 MiB it is all used."""
    if capacity_bytes <= page_bytes:
        return page_bytes
    num_pages = -(-capacity_bytes // page_bytes)
    return max(capacity_bytes // num_pages // alignment * alignment, alignment)


class _Page:
    __slots__ = ("index", "slot_bytes", "free_offsets", "num_slots")

    def __init__(self, index: int, slot_bytes: int, free_offsets: list[int]) -> None:
        self.index = index
        self.slot_bytes = slot_bytes
        self.free_offsets = free_offsets
        self.num_slots = len(free_offsets)


class _SizeClass:
    __slots__ = ("slot_bytes", "pages_with_room", "num_used")

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        # insertion-ordered set of pages that still have a free slot
        self.pages_with_room: dict[int, _Page] = {}
        self.num_used = 0


class SlabAllocator:
    def __init__(self, capacity_bytes: int, page_bytes: int, alignment: int = 4096, page_header_bytes: int = 0) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"slab alignment must be a power of two, got {alignment}.")
        if page_header_bytes % alignment:
            raise InvalidArgument("a page header must be a whole number of alignment units.")
        page_bytes = round_up(page_bytes, alignment)
        if capacity_bytes < page_bytes:
            page_bytes = capacity_bytes // alignment * alignment
        if page_bytes <= page_header_bytes:
            raise InvalidArgument(f"a tier of {capacity_bytes} bytes is too small for even one {alignment}-byte aligned page.")
        self.alignment = alignment
        self.page_bytes = page_bytes
        self.page_header_bytes = page_header_bytes
        self.num_pages = capacity_bytes // page_bytes
        self.capacity_bytes = self.num_pages * page_bytes
        self._free_pages: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._pages: dict[int, _Page] = {}
        self._classes: dict[int, _SizeClass] = {}
        self._slot_bytes: dict[int, int] = {}  # block size -> slot size, as the hot path asks often
        self.used_bytes = 0

    # -- sizing ---------------------------------------------------------------------
    def slot_bytes_for(self, nbytes: int) -> int:
        cached = self._slot_bytes.get(nbytes)
        if cached is not None:
            return cached
        if nbytes <= 0:
            raise InvalidArgument(f"a block must have at least one byte, got {nbytes}.")
        slot_bytes = round_up(nbytes, self.alignment)
        if slot_bytes > self.page_bytes - self.page_header_bytes:
            raise InvalidArgument(
                f"a block of {nbytes} bytes does not fit in this tier's {self.page_bytes}-byte pages; "
                "raise page_bytes in the tier configuration."
            )
        self._slot_bytes[nbytes] = slot_bytes
        return slot_bytes

    def can_allocate(self, nbytes: int) -> bool:
        size_class = self._classes.get(self.slot_bytes_for(nbytes))
        return bool(self._free_pages) or (size_class is not None and bool(size_class.pages_with_room))

    @property
    def num_used_slots(self) -> int:
        return sum(c.num_used for c in self._classes.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def page_of(self, offset: int) -> int:
        return offset // self.page_bytes

    def page_slot_bytes(self, page_index: int) -> int | None:
        """The slot size a page is carved into, or None while the page is free."""
        page = self._pages.get(page_index)
        return None if page is None else page.slot_bytes

    def slots_per_page(self, slot_bytes: int) -> int:
        return (self.page_bytes - self.page_header_bytes) // slot_bytes

    # -- allocation -----------------------------------------------------------------
    def allocate(self, nbytes: int) -> Slot | None:
        slots = self.allocate_many(nbytes, 1)
        return slots[0] if slots else None

    def allocate_many(self, nbytes: int, count: int) -> list[Slot]:
        """Up to ``count`` slots (fewer when the slab is full): the ones ``count`` calls of
        ``allocate`` would hand out, in that order, taken a page's worth at a time."""
        slot_bytes = self.slot_bytes_for(nbytes)
        size_class = self._classes.get(slot_bytes)
        if size_class is None:
            size_class = self._classes[slot_bytes] = _SizeClass(slot_bytes)
        offsets: list[int] = []
        while len(offsets) < count:
            if not size_class.pages_with_room:
                if not self._free_pages:
                    break
                self._carve(self._free_pages.pop(), size_class, used_offsets=())
            page = next(iter(size_class.pages_with_room.values()))
            free = page.free_offsets
            start = max(0, len(free) - (count - len(offsets)))
            offsets += free[: start - 1 if start else None : -1]  # from the end, as pop() would
            del free[start:]
            if not free:
                del size_class.pages_with_room[page.index]
        size_class.num_used += len(offsets)
        self.used_bytes += len(offsets) * slot_bytes
        return list(map(Slot, offsets, itertools.repeat(slot_bytes, len(offsets))))

    def free(self, slot: Slot) -> None:
        page = self._pages.get(self.page_of(slot.offset))
        if page is None or page.slot_bytes != slot.nbytes:
            raise InvalidArgument(f"slot {slot} was not allocated by this slab.")
        size_class = self._classes[slot.nbytes]
        page.free_offsets.append(slot.offset)
        size_class.num_used -= 1
        self.used_bytes -= slot.nbytes
        if len(page.free_offsets) == page.num_slots:
            size_class.pages_with_room.pop(page.index, None)
            del self._pages[page.index]
            self._free_pages.append(page.index)
        elif len(page.free_offsets) == 1:
            size_class.pages_with_room[page.index] = page

    def restore_page(self, page_index: int, slot_bytes: int, used_offsets: Iterable[int]) -> list[Slot]:
        """Re-create a page's state after a restart: carve it and mark ``used_offsets`` taken."""
        if page_index in self._pages or not 0 <= page_index < self.num_pages:
            raise InvalidArgument(f"page {page_index} cannot be restored: it is in use or out of range.")
        self._free_pages.remove(page_index)
        slot_bytes = self.slot_bytes_for(slot_bytes)
        size_class = self._classes.get(slot_bytes)
        if size_class is None:
            size_class = self._classes[slot_bytes] = _SizeClass(slot_bytes)
        used = set(used_offsets)
        page = self._carve(page_index, size_class, used_offsets=used)
        size_class.num_used += len(used)
        self.used_bytes += len(used) * slot_bytes
        if not page.free_offsets:
            del size_class.pages_with_room[page_index]
        return [Slot(offset, slot_bytes) for offset in sorted(used)]

    def _carve(self, page_index: int, size_class: _SizeClass, used_offsets: Iterable[int]) -> _Page:
        base = page_index * self.page_bytes + self.page_header_bytes
        count = self.slots_per_page(size_class.slot_bytes)
        offsets = [base + i * size_class.slot_bytes for i in range(count)]
        used = set(used_offsets)
        if not used.issubset(offsets):
            raise InvalidArgument(f"offsets {sorted(used - set(offsets))} are not slot boundaries of page {page_index}.")
        # reversed so that pop() hands out the lowest offsets first
        page = _Page(page_index, size_class.slot_bytes, [o for o in reversed(offsets) if o not in used])
        page.num_slots = count
        self._pages[page_index] = page
        size_class.pages_with_room[page_index] = page
        return page
