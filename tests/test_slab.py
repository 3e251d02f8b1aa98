import pytest

from kvstore.errors import InvalidArgument
from kvstore.tiers.slab import SlabAllocator, Slot

MiB = 1024 * 1024


def test_slots_are_aligned_distinct_and_reused():
    slab = SlabAllocator(4 * MiB, MiB)
    slots = [slab.allocate(300_000) for _ in range(12)]
    assert all(s is not None and s.offset % 4096 == 0 and s.nbytes == 303_104 for s in slots)
    assert len({s.offset for s in slots}) == 12
    assert slab.allocate(300_000) is None  # 3 slots per 1 MiB page, 4 pages
    slab.free(slots[5])
    assert slab.allocate(300_000) == slots[5]
    assert slab.used_bytes == 12 * 303_104


def test_size_classes_share_pages_and_return_empty_pages():
    slab = SlabAllocator(2 * MiB, MiB)
    small = [slab.allocate(4096) for _ in range(256)]  # fills page 0
    assert all(s is not None for s in small)
    big = slab.allocate(MiB)
    assert big is not None and slab.allocate(MiB) is None and slab.allocate(4096) is None
    for slot in small:
        slab.free(slot)
    assert slab.page_slot_bytes(0) is None  # the empty page went back to the pool
    assert slab.allocate(MiB) is not None


def test_no_slot_straddles_a_page():
    slab = SlabAllocator(3 * MiB, MiB)
    slots = []
    while (slot := slab.allocate(400 * 1024)) is not None:
        slots.append(slot)
    for slot in slots:
        assert slot.offset // MiB == (slot.offset + slot.nbytes - 1) // MiB
    assert len(slots) == 6


def test_page_header_space_is_skipped():
    slab = SlabAllocator(2 * MiB, MiB, page_header_bytes=4096)
    slot = slab.allocate(8192)
    assert slot.offset == 4096


def test_restore_page_marks_used_slots():
    slab = SlabAllocator(2 * MiB, MiB)
    restored = slab.restore_page(1, 256 * 1024, [MiB, MiB + 512 * 1024])
    assert restored == [Slot(MiB, 262144), Slot(MiB + 524288, 262144)]
    fresh = {slab.allocate(256 * 1024).offset for _ in range(2)}
    assert fresh == {MiB + 256 * 1024, MiB + 768 * 1024}


def test_errors():
    slab = SlabAllocator(MiB, MiB)
    with pytest.raises(InvalidArgument):
        slab.allocate(0)
    with pytest.raises(InvalidArgument):
        slab.allocate(2 * MiB)
    with pytest.raises(InvalidArgument):
        slab.free(Slot(0, 4096))


def test_allocate_many_hands_out_what_allocate_would_and_stops_when_full():
    one_by_one, batched = SlabAllocator(4 * MiB, MiB), SlabAllocator(4 * MiB, MiB)
    expected = [one_by_one.allocate(300_000) for _ in range(7)]
    assert batched.allocate_many(300_000, 7) == expected  # across pages, lowest offsets first
    assert batched.used_bytes == one_by_one.used_bytes
    rest = batched.allocate_many(300_000, 10)
    assert len(rest) == 5 and batched.allocate(300_000) is None  # 12 slots in all, each handed out once
    assert len({s.offset for s in expected + rest}) == 12
    for slot in rest:
        batched.free(slot)
    assert batched.allocate_many(300_000, 0) == []
    assert sorted(batched.allocate_many(300_000, 5)) == sorted(rest)  # freed slots are handed out again
    assert batched.used_bytes == 12 * 303_104


def test_a_memory_tier_uses_its_whole_capacity_when_pages_do_not_divide_it():
    """A 99 MiB host tier with the default 64 MiB pages used to be one 64 MiB page: a
    third of what it was given, without a word. Its pages now divide it evenly (none
    larger than asked), so its blocks fill all but a sliver of it."""
    from kvstore.tier_kind import TierKind
    from kvstore.tiers.memory import DEFAULT_PAGE_BYTES, VirtualTier

    MiB = 1024 * 1024
    block_bytes = 1 * MiB + 4096  # not a divisor of any page: each page strands less than one slot
    for capacity in (99 * MiB, 64 * MiB + 4096, 200 * MiB, 3 * DEFAULT_PAGE_BYTES):
        tier = VirtualTier(TierKind.HOST, capacity, DEFAULT_PAGE_BYTES)
        assert tier.slab.page_bytes <= DEFAULT_PAGE_BYTES
        slots = tier.allocate_many(block_bytes, capacity // block_bytes + 1)
        stranded = capacity - len(slots) * block_bytes
        assert 0 <= stranded < tier.slab.num_pages * (block_bytes + 4096), (capacity, len(slots))
        assert tier.stats().capacity_bytes >= capacity - tier.slab.num_pages * 4096
