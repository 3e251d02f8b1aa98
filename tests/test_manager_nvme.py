"""The tier manager over a real host tier (shared memory) and a real NVMe tier (files)."""

import uuid
from pathlib import Path

import pytest
import torch

from kvstore.errors import TierUnavailable
from kvstore.events import BlockRemoved, RemovalReason
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.host import HostTier, HostTierConfig
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig

MiB = 1024 * 1024
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 16 KiB blocks
NAMESPACE = Namespace("nvme-test-model", LAYOUT)
NS = NAMESPACE.digest


def block(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class Node:
    """A host tier of 8 blocks over an NVMe tier directory that outlives it."""

    def __init__(self, directory: Path, **config):
        self.host = HostTier(
            HostTierConfig(capacity_bytes=8 * LAYOUT.block_bytes, name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=64 * 1024)
        )
        self.nvme = NvmeTier(NvmeTierConfig(directory=directory, capacity_bytes=4 * MiB, page_bytes=MiB, file_bytes=2 * MiB))
        self.manager = TierManager(TierManagerConfig(**config), [self.host, self.nvme])
        self.manager.register_namespace(NAMESPACE)

    def close(self):
        self.manager.close()


@pytest.fixture
def node(tmp_path):
    nodes = []

    def start(**config):
        nodes.append(Node(tmp_path / "nvme", **config))
        return nodes[-1]

    yield start
    for n in nodes:
        n.close()


def flip_a_byte_of(directory: Path, data: torch.Tensor) -> None:
    """Corrupt the stored copy of ``data`` in the slot files, wherever the format puts it:
    a byte past the slot's first 4 KiB where the block has one, so that a restart keeps the
    block (its trailer's head checksum still matches) and its first read fails its checksum."""
    needle = data[:4096].numpy().tobytes()
    flipped = 4096 + 100 if data.numel() > 4096 + 100 else 100
    for path in sorted(directory.glob("*.dat")):
        content = bytearray(path.read_bytes())
        at = content.find(needle)
        if at >= 0:
            content[at + flipped] ^= 0xFF
            path.write_bytes(bytes(content))
            return
    raise AssertionError("the block's bytes were not found in the slot files")


def test_demoted_blocks_survive_a_restart_with_their_prefix_tree(node, tmp_path):
    first = node(high_watermark=0.9, low_watermark=0.5)
    hashes = chain_hashes(list(range(12 * 16)), 16)
    data = [block(i) for i in range(12)]
    first.manager.put(NS, hashes, data)
    tiers = first.manager.lookup(NS, hashes)
    assert len(tiers) == 12 and TierKind.NVME in tiers
    assert first.manager.persist() > 0
    first.close()

    second = node()
    assert second.manager.counters["blocks_recovered"] == 12
    assert second.manager.lookup(NS, hashes) == [TierKind.NVME] * 12
    # the prefix tree came back from the parent hashes in the slot headers
    entry = second.manager.catalogue.get((NS, hashes[5]))
    assert entry.reachable and entry.parent.key == (NS, hashes[4]) and entry.num_children == 1
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    for h, d in zip(hashes, data):
        assert second.manager.get(NS, h, out) and torch.equal(out, d)


def test_a_corrupt_nvme_block_is_a_miss_and_is_dropped(node, tmp_path):
    n = node(high_watermark=1.0)
    hashes = chain_hashes(list(range(4 * 16)), 16)
    data = [block(100 + i) for i in range(4)]
    n.manager.put(NS, hashes, data)
    n.manager.persist()
    flip_a_byte_of(tmp_path / "nvme", data[2])
    n.manager.events.drain()
    lease = n.manager.acquire(NS, hashes)
    assert len(lease.blocks) == 2  # the hit ends before the corrupt block
    assert all(torch.equal(v, d) for v, d in zip(n.manager.lease_views(lease), data))
    n.manager.release(lease.id)
    removed = [e for e in n.manager.events.drain() if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.reason) for e in removed] == [((hashes[2],), RemovalReason.CORRUPT)]
    assert len(n.manager.lookup(NS, hashes)) == 2
    assert n.manager.counters["corrupt_nvme"] == 1


def test_a_failing_disk_takes_the_nvme_tier_out_and_memory_keeps_serving(node, monkeypatch):
    n = node(high_watermark=0.9, low_watermark=0.5)

    def broken_write(*args, **kwargs):
        raise TierUnavailable("simulated: writing a block failed (No space left on device)")

    monkeypatch.setattr(n.nvme, "write", broken_write)
    hashes = chain_hashes(list(range(20 * 16)), 16)
    data = [block(200 + i) for i in range(20)]
    n.manager.put(NS, hashes[:8], data[:8])  # crosses the watermark: demotion fails
    assert n.manager.failed_tiers == {TierKind.NVME}
    assert n.manager.tier_kinds == [TierKind.HOST]
    # the store keeps serving from memory: more puts evict (drop) instead of demoting
    n.manager.put(NS, hashes[8:], data[8:], parent_hash=hashes[7])
    tail = [h for h in hashes if n.manager.lookup(NS, [h]) != []]
    assert tail, "the host tier should still hold blocks"
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    index = hashes.index(tail[-1])
    assert n.manager.get(NS, tail[-1], out) and torch.equal(out, data[index])
    assert all(b.tier is TierKind.HOST for b in n.manager.blocks())
