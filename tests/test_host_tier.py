import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from kvstore.errors import InvalidArgument, TierUnavailable
from kvstore.hashing import chain_hashes
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.host import HostTier, HostTierConfig, SharedSlab

MiB = 1024 * 1024
PEER = Path(__file__).with_name("shm_peer.py")


def pattern(nbytes, seed):
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def host_tier():
    tier = HostTier(HostTierConfig(capacity_bytes=8 * MiB, name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=2 * MiB))
    yield tier
    tier.close()


class Peer:
    def __init__(self, path):
        self.process = subprocess.Popen([sys.executable, str(PEER), str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"

    def ask(self, *words):
        self.process.stdin.write(" ".join(map(str, words)) + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def close(self):
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0


def test_two_processes_share_the_slab_without_copies(host_tier):
    assert host_tier.kind is TierKind.HOST and host_tier.path.exists()
    mine = host_tier.allocate(300_000)
    theirs = host_tier.allocate(300_000)
    peer = Peer(host_tier.path)
    try:
        # the peer writes into a slot; this process sees the bytes through its own view
        assert peer.ask("write", theirs.offset, 300_000, 7) == "ok"
        assert torch.equal(host_tier.view(theirs, 300_000), pattern(300_000, 7))
        # and the other way round, through the Tier interface
        data = pattern(300_000, 11)
        meta = BlockMeta(b"n" * 16, chain_hashes(list(range(16)), 16)[0], None, 300_000)
        host_tier.write(mine, data, meta)
        assert peer.ask("check", mine.offset, 300_000, 11) == "ok"
        assert peer.ask("check", mine.offset, 300_000, 12) == "bad"
    finally:
        peer.close()
    out = torch.empty(300_000, dtype=torch.uint8)
    host_tier.read(theirs, out, meta)
    assert torch.equal(out, pattern(300_000, 7))


def test_a_leftover_segment_is_refused_unless_reclaimed():
    config = HostTierConfig(capacity_bytes=2 * MiB, name=f"kvstore-test-{uuid.uuid4().hex[:8]}")
    config.path.write_bytes(b"left by a daemon that was killed")  # nobody holds its lock
    try:
        with pytest.raises(TierUnavailable, match="already exists"):
            HostTier(config)
        reclaimed = HostTier(HostTierConfig(capacity_bytes=2 * MiB, name=config.name, reclaim_stale=True))
        assert reclaimed.stats().capacity_bytes == 2 * MiB
        reclaimed.close()
        assert not config.path.exists()
    finally:
        config.path.unlink(missing_ok=True)


def test_close_removes_the_file_and_attach_then_fails():
    tier = HostTier(HostTierConfig(capacity_bytes=2 * MiB, name=f"kvstore-test-{uuid.uuid4().hex[:8]}"))
    view = tier.view(tier.allocate(4096))  # a view still alive must not block close
    path = tier.path
    tier.close()
    assert not path.exists()
    del view
    with pytest.raises(TierUnavailable, match="daemon running"):
        SharedSlab.attach(path)


def test_too_large_a_segment_fails_cleanly(tmp_path):
    small = tmp_path / "small-shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(TierUnavailable, match="lower the host tier capacity"):
            HostTier(HostTierConfig(capacity_bytes=8 * MiB, name="big", directory=small))
        assert not (small / "big").exists()
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_bad_config():
    with pytest.raises(InvalidArgument):
        HostTierConfig(capacity_bytes=0)
    with pytest.raises(InvalidArgument):
        HostTierConfig(capacity_bytes=MiB, name="../etc")
    with pytest.raises(TierUnavailable, match="not a host tier file"):
        SharedSlab.attach("/dev/null")


def test_a_live_owner_cannot_be_reclaimed(host_tier):
    config = host_tier.config
    live = HostTierConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__}, "reclaim_stale": True})
    with pytest.raises(TierUnavailable, match="live kvstore daemon"):
        HostTier(live)
    assert host_tier.path.exists()  # the owner's segment is untouched


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _touch_every_page(tensor: torch.Tensor) -> None:
    tensor[::4096] += 0  # one write per page


def test_opening_the_tier_maps_its_pages_in_and_an_attached_mapping_is_prefaulted_too():
    tier = HostTier(HostTierConfig(capacity_bytes=32 * MiB, name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=2 * MiB))
    try:
        assert tier.shared.prefault(0.5, "host tier").done.wait(10)
        before = _minor_faults()
        _touch_every_page(tier.shared.tensor)
        assert _minor_faults() - before < 32 * MiB // 4096 // 4  # 8192 pages: without the prefault, one fault each
        tier.shared.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        engine = SharedSlab.attach(tier.path)
        try:
            work = engine.prefault(0.0, "engine's mapping")  # all of it on the helper thread
            assert work.done.wait(10) and work.num_populated == 32 * MiB
            before = _minor_faults()
            _touch_every_page(engine.tensor)
            assert _minor_faults() - before < 32 * MiB // 4096 // 4
            assert engine.tensor[:4].tolist() == [1, 2, 3, 4]  # mapped in, not written
        finally:
            engine.close()
    finally:
        tier.close()


def test_a_mapping_closed_while_it_is_prefaulted_stops_the_work_and_unmaps():
    tier = HostTier(HostTierConfig(capacity_bytes=256 * MiB, name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=2 * MiB))
    try:
        engine = SharedSlab.attach(tier.path)
        work = engine.prefault(0.0, "engine's mapping")
        engine.close()  # joins the helper thread, which lets go of the mapping
        assert work.done.is_set() and engine._mapping.closed
    finally:
        tier.close()


@pytest.mark.parametrize(
    "nbytes, count, spare_core",
    [
        (4096, 3, True),  # one chunk
        (256 * 1024, 3, True),  # exactly one
        (1024 * 1024 + 4096, 3, True),  # several and a tail
        (1024 * 1024, 5, True),  # a batch past HELPER_BATCH_BYTES: hashed on the helper thread beside the copy
        (1024 * 1024, 5, False),  # the same on one core: hashed chunk by chunk after each copy
    ],
)
def test_write_checksummed_lands_every_byte_and_returns_the_checksum_of_what_landed(host_tier, nbytes, count, spare_core, monkeypatch):
    import kvstore.tiers.base as base_module
    from kvstore.tiers.base import block_checksum

    monkeypatch.setattr(base_module, "spare_cpu_now", lambda: spare_core)
    slots = [host_tier.allocate(nbytes) for _ in range(count)]
    sources = [pattern(nbytes, seed) for seed in range(count)]
    checksums = host_tier.write_checksummed(slots, sources)
    assert checksums == [block_checksum(source) for source in sources]
    for slot, source in zip(slots, sources):
        assert torch.equal(host_tier.view(slot, nbytes), source)


def _guarded_copies(sizes, seed):
    """A source and a destination buffer with each block's bytes at its own offset and a
    guard byte after each, and the (destination, source, nbytes) copies between them."""
    total = sum(size + 1 for size in sizes)
    source, destination = pattern(total, seed), torch.zeros(total, dtype=torch.uint8)
    copies, offset = [], 0
    for size in sizes:
        copies.append((destination.data_ptr() + offset, source.data_ptr() + offset, size))
        offset += size + 1
    return source, destination, copies


@pytest.mark.parametrize("spare_core", [True, False])
@pytest.mark.parametrize(
    "sizes",
    [
        [4096, 3],  # small: copied here
        [MiB] * 5,  # a batch past HELPER_BATCH_BYTES: half on the helper thread
        [6 * MiB + 7],  # one block: cut in two
        [MiB + 1, 5, 3 * MiB - 11, 4097, 2 * MiB],  # the cut inside a block of odd size
    ],
)
def test_copy_all_lands_every_byte_once_and_nothing_beside(sizes, spare_core, monkeypatch):
    import threading

    import kvstore.tiers.base as base_module

    monkeypatch.setattr(base_module, "spare_cpu_now", lambda: spare_core)
    threads, copied, copy_each = set(), [], base_module._copy_each

    def counted(copies):
        threads.add(threading.current_thread().name)
        copied.extend(nbytes for _, _, nbytes in copies)
        copy_each(copies)

    monkeypatch.setattr(base_module, "_copy_each", counted)
    source, destination, copies = _guarded_copies(sizes, seed=len(sizes))
    base_module.copy_all(copies)
    offset = 0
    for size in sizes:
        assert torch.equal(destination[offset : offset + size], source[offset : offset + size])
        assert destination[offset + size] == 0  # the guard after it
        offset += size + 1
    assert sum(copied) == sum(sizes)  # every byte copied once
    beside = spare_core and sum(sizes) >= base_module.HELPER_BATCH_BYTES
    assert any(name.startswith("kvstore-helper") for name in threads) == beside
    assert len(threads) == (2 if beside else 1)


def test_a_forked_child_copies_with_a_helper_of_its_own(monkeypatch):
    """The parent's helper thread does not exist in a forked child: a child that shared a
    batch of copies or checksums with it would wait forever."""
    import ctypes
    import os
    import time

    import kvstore.tiers.base as base_module

    monkeypatch.setattr(base_module, "spare_cpu_now", lambda: True)
    source, destination, copies = _guarded_copies([MiB] * 5, seed=1)
    blocks = [source[offset : offset + MiB] for offset in range(0, 5 * (MiB + 1), MiB + 1)]
    expected = [base_module.block_checksum(block) for block in blocks]
    base_module.copy_all(copies)  # the parent's helper thread is started
    pid = os.fork()
    if pid == 0:  # the child: no torch calls (its OpenMP pool did not survive the fork either)
        try:
            ctypes.memset(destination.data_ptr(), 0, destination.numel())
            base_module.copy_all(copies)
            same = all(ctypes.string_at(d, n) == ctypes.string_at(s, n) for d, s, n in copies)
            checksums = base_module.copy_all_checksummed([d for d, _, _ in copies], blocks)  # a save's copy
            os._exit(0 if same and checksums == expected else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's copy never finished")
