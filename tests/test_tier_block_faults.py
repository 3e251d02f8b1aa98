"""One block's bad metadata fails that block only: the tier manager refuses it where it
enters, and a block that got in below that check is dropped when it moves, while the NVMe
tier and the other blocks of the batch keep going (a real host tier over a real NVMe tier)."""

import logging

import pytest
import torch

# the node of tests/test_manager_nvme.py: a host tier of 8 blocks over an NVMe tier
# directory that outlives it; here started with no demotion on commit (the test decides
# when blocks move)
from test_manager_nvme import LAYOUT, NS, MiB, Node, block, node  # noqa: E402,F401 (node: a fixture)

from kvstore.errors import InvalidArgument
from kvstore.events import BlockRemoved, RemovalReason
from kvstore.hashing import chain_hashes
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig
from kvstore.tiers.nvme_format import TRAILER_BYTES, SlotTrailer, decode_slot_trailer, encode_slot_trailer
from kvstore.tiers.steps import run

QUIET = {"demote_on_commit": False}


def write_unchecked(n: Node, hashes: list[bytes], data: list[torch.Tensor], parent: bytes | None) -> None:
    """Store a chain below the manager's metadata checks (as a caller that skipped them
    would): reserve through the write path's own collaborator, copy, commit."""
    nbytes = LAYOUT.block_bytes
    reservation = run(n.manager._reservations.reserve_steps(NS, nbytes, TierKind.HOST, hashes, parent))
    for view, tensor in zip(n.manager.reservation_slots(reservation), data):
        view.copy_(tensor)
    n.manager.commit(reservation.id)


def test_malformed_hashes_are_refused_where_they_enter_the_manager(node):
    n = node(**QUIET)
    good = chain_hashes(list(range(2 * 16)), 16)
    with pytest.raises(InvalidArgument, match="parent"):
        n.manager.reserve(NS, good, parent_hash=b"abc")
    with pytest.raises(InvalidArgument, match="hash"):
        n.manager.reserve(NS, [good[0], b"short"])
    with pytest.raises(InvalidArgument, match="parent"):
        n.manager.put(NS, good, [block(1), block(2)], parent_hash=bytes(17))
    # nothing was reserved or stored, and a well-formed save still works
    assert n.manager.num_reservations == 0 and len(n.manager.catalogue) == 0
    assert n.manager.put(NS, good, [block(1), block(2)]) == 2


def test_a_block_with_a_bad_parent_is_dropped_on_demotion_and_its_neighbours_survive_a_restart(node, caplog):
    first = node(**QUIET)
    before = chain_hashes(list(range(3 * 16)), 16)
    bad = chain_hashes(list(range(1000, 1000 + 16)), 16)
    after = chain_hashes(list(range(2000, 2000 + 3 * 16)), 16)
    data = {h: block(i) for i, h in enumerate(before + bad + after)}
    first.manager.put(NS, before, [data[h] for h in before])
    write_unchecked(first, bad, [data[h] for h in bad], parent=b"abc")  # a 3-byte parent the NVMe record cannot hold
    first.manager.put(NS, after, [data[h] for h in after])
    assert len(first.manager.catalogue) == 7

    with caplog.at_level(logging.WARNING):
        moved = first.manager.persist()
    assert moved == 6
    assert first.manager.failed_tiers == set()
    assert first.manager.lookup(NS, bad) == []
    assert first.manager.lookup(NS, before) == [TierKind.NVME] * 3 and first.manager.lookup(NS, after) == [TierKind.NVME] * 3
    removed = [e for e in first.manager.events.drain() if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.reason) for e in removed] == [((bad[0],), RemovalReason.CORRUPT)]
    assert first.manager.counters["evicted_corrupt"] == 1
    assert first.host.stats().num_blocks == 0  # its host slot is free again
    assert "1 blocks could not be persisted and will be misses after restart" in caplog.text
    first.close()

    second = node(**QUIET)
    assert second.manager.counters["blocks_recovered"] == 6
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    for h in before + after:
        assert second.manager.get(NS, h, out) and torch.equal(out, data[h])
    assert second.manager.lookup(NS, bad) == []


def test_a_bad_block_in_a_watermark_demotion_fails_only_itself(node):
    n = node(**QUIET)
    bad = chain_hashes(list(range(3000, 3000 + 16)), 16)
    write_unchecked(n, bad, [block(49)], parent=bytes(5))  # the oldest block: the first victim
    hashes = chain_hashes(list(range(7 * 16)), 16)
    data = [block(50 + i) for i in range(7)]
    n.manager.put(NS, hashes, data)
    assert n.host.stats().num_blocks == 8
    assert n.manager.relieve_pressure() >= 1  # 8 of 8 slots used: above the high watermark
    assert n.manager.failed_tiers == set()
    assert n.manager.lookup(NS, bad) == []
    assert TierKind.NVME in n.manager.lookup(NS, hashes)
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    for h, d in zip(hashes, data):
        assert n.manager.get(NS, h, out) and torch.equal(out, d)


def test_a_block_whose_record_cannot_be_read_back_is_dropped_on_promotion_and_the_host_tier_keeps_serving(node):
    n = node(**QUIET)
    hashes = chain_hashes(list(range(3 * 16)), 16)
    data = [block(70 + i) for i in range(3)]
    n.manager.put(NS, hashes, data)
    assert n.manager.persist() == 3
    # the catalogue's parent of the middle block becomes one the NVMe record never had
    entry = n.manager.catalogue.get((NS, hashes[1]))
    entry.parent_key = (NS, b"xyz")
    lease = n.manager.acquire(NS, hashes)
    assert len(lease.blocks) == 1  # the hit ends before the block whose metadata is doubtful
    assert torch.equal(n.manager.lease_views(lease)[0], data[0])
    n.manager.release(lease.id)
    assert n.manager.failed_tiers == set()
    assert n.manager.tier_kinds == [TierKind.HOST, TierKind.NVME]
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    assert n.manager.get(NS, hashes[2], out) and torch.equal(out, data[2])


def test_an_nvme_write_with_bad_metadata_is_refused_without_touching_the_tier(tmp_path):
    nvme = NvmeTier(NvmeTierConfig(directory=tmp_path, capacity_bytes=4 * MiB, page_bytes=MiB, file_bytes=2 * MiB))
    try:
        slot = nvme.allocate(LAYOUT.block_bytes)
        with pytest.raises(InvalidArgument):
            nvme.write(slot, block(1), BlockMeta(NS, bytes(16), b"abc", LAYOUT.block_bytes))
        assert nvme.num_write_errors == 0
    finally:
        nvme.close()


def test_a_trailer_is_never_written_for_hashes_of_another_length():
    """struct's "16s" pads a short value and cuts a long one: the record would name another block."""
    good = bytes(range(16))
    buffer = memoryview(bytearray(TRAILER_BYTES))
    for meta in (
        BlockMeta(good, good, b"abc", 4096),
        BlockMeta(good, bytes(17), None, 4096),
        BlockMeta(bytes(15), good, good, 4096),
    ):
        with pytest.raises(InvalidArgument):
            encode_slot_trailer(SlotTrailer(meta, 0, 4096, 0, 1, 0, 0), buffer)
    encode_slot_trailer(SlotTrailer(BlockMeta(good, good, good, 4096), 0, 4096, 0, 1, 0, 0), buffer)
    assert decode_slot_trailer(buffer).meta == BlockMeta(good, good, good, 4096)
