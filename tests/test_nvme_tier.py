"""The NVMe tier against real files: round trips, restarts, corruption, torn writes,
the write order, a full disk, failing writes and concurrent I/O."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvstore.errors import BlockSizeMismatch, CorruptBlock, InvalidArgument, TierUnavailable
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig
from kvstore.tiers.slab import Slot

WRITER = Path(__file__).with_name("nvme_tier_writer.py")
REPO_ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = b"n" * 16
MiB = 1 << 20


def make_config(directory: Path, **overrides) -> NvmeTierConfig:
    settings = dict(capacity_bytes=32 * MiB, page_bytes=2 * MiB, file_bytes=8 * MiB)
    settings.update(overrides)
    return NvmeTierConfig(directory, **settings)


def make_block(index: int, nbytes: int) -> tuple[BlockMeta, torch.Tensor]:
    data = torch.from_numpy(np.random.default_rng(index).integers(0, 256, nbytes, dtype=np.uint8))
    block_hash = xxhash.xxh3_128_digest(b"block %d" % index)
    parent = None if index == 0 else xxhash.xxh3_128_digest(b"block %d" % (index - 1))
    return BlockMeta(NAMESPACE, block_hash, parent, nbytes), data


def aligned_tensor(nbytes: int) -> torch.Tensor:
    """A uint8 tensor whose memory starts on a page boundary, as a host-tier slot does."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def unaligned_tensor(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes + 1, dtype=torch.uint8)[1:]


def put(tier: NvmeTier, index: int, nbytes: int) -> tuple[Slot, BlockMeta, torch.Tensor]:
    meta, data = make_block(index, nbytes)
    slot = tier.allocate(nbytes)
    assert slot is not None
    tier.write(slot, data, meta)
    return slot, meta, data


def read_back(tier: NvmeTier, slot: Slot, meta: BlockMeta) -> torch.Tensor:
    out = torch.empty(meta.nbytes, dtype=torch.uint8)
    tier.read(slot, out, meta)
    return out


def trailer_offset(slot: Slot) -> int:
    return slot.offset + slot.nbytes - 4096


def flip_byte(tier: NvmeTier, offset: int) -> None:
    """Corrupt the byte at a tier offset by writing the file directly, not through the tier."""
    path = tier.config.directory / f"slots-{offset // tier.file_bytes:03d}.dat"
    with open(path, "r+b") as file:
        file.seek(offset % tier.file_bytes)
        value = file.read(1)[0]
        file.seek(offset % tier.file_bytes)
        file.write(bytes([value ^ 0xFF]))


SIZES = (1, 100, 4096, 4097, 65_536, 300_000, MiB - 8192)


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("buffers", ["fresh", "aligned", "unaligned"])
def test_blocks_of_several_size_classes_round_trip(tmp_path, direct_io, buffers):
    make_tensor = {"fresh": lambda n: torch.empty(n, dtype=torch.uint8), "aligned": aligned_tensor, "unaligned": unaligned_tensor}[buffers]
    with NvmeTier(make_config(tmp_path, direct_io=direct_io)) as tier:
        assert tier.kind is TierKind.NVME
        written = []
        for index, nbytes in enumerate(SIZES * 2):
            meta, data = make_block(index, nbytes)
            src = make_tensor(nbytes)
            src.copy_(data)
            slot = tier.allocate(nbytes)
            assert slot.nbytes == tier.slot_bytes_for(nbytes) == 4096 + -(-nbytes // 4096) * 4096
            tier.write(slot, src, meta)
            written.append((slot, meta, data))
        for slot, meta, data in written:
            dst = make_tensor(meta.nbytes)
            tier.read(slot, dst, meta)
            assert torch.equal(dst, data)
        stats = tier.stats()
        assert stats.num_blocks == len(written)
        assert stats.used_bytes == sum(slot.nbytes for slot, _, _ in written)
        assert len({slot.offset for slot, _, _ in written}) == len(written)


def filesystem_takes_direct_io(directory: Path) -> bool:
    path = directory / "probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    try:
        os.pwritev(fd, [memoryview(mmap.mmap(-1, 4096))], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def test_direct_io_is_used_where_the_filesystem_takes_it(tmp_path):
    direct = NvmeTier(make_config(tmp_path / "a"))
    buffered = NvmeTier(make_config(tmp_path / "b", direct_io=False))
    with direct, buffered:
        assert buffered.uses_direct_io is False
        assert direct.uses_direct_io is filesystem_takes_direct_io(tmp_path)
        assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [f"slots-{i:03d}.dat" for i in range(4)]


def test_restart_recovers_exactly_the_blocks_written(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        written = [put(tier, index, SIZES[index % len(SIZES)]) for index in range(20)]
        used = tier.stats().used_bytes
    with NvmeTier(make_config(tmp_path)) as tier:
        recovered = tier.recovered()
        assert {(slot, meta) for slot, meta, _ in recovered} == {(slot, meta) for slot, meta, _ in written}
        checksums = {meta.block_hash: checksum for _, meta, checksum in recovered}
        for slot, meta, data in written:
            assert checksums[meta.block_hash] == xxhash.xxh3_64_intdigest(data.numpy())
            assert torch.equal(read_back(tier, slot, meta), data)
        assert (tier.num_recovered, tier.num_dropped_at_start) == (20, 0)
        assert tier.stats().used_bytes == used and tier.stats().num_blocks == 20
        # new slots never land on a recovered one
        taken = {slot.offset for slot, _, _ in written}
        while (slot := tier.allocate(65_536)) is not None:
            assert slot.offset not in taken


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_restart_reads_each_slot_once_with_the_next_slots_head(tmp_path, monkeypatch, direct_io):
    """The head checksum costs no extra read at start: each trailer is read with the head
    of the slot after it, the first slot's head with the page header."""
    config = make_config(tmp_path, direct_io=direct_io)
    with NvmeTier(config) as tier:
        written = [put(tier, index, 200_000) for index in range(3)]
        slot_bytes = written[0][0].nbytes
    slots_per_page = (config.page_bytes - 4096) // slot_bytes
    calls = record_io(monkeypatch)
    with NvmeTier(config) as tier:
        assert [entry[:2] for entry in tier.recovered()] == [(slot, meta) for slot, meta, _ in written]
    reads = sorted(call[1:3] for call in calls if call[0] == "read")  # (position in its file, bytes)
    if direct_io:
        reads.remove((0, 4096))  # opening the first file probes whether O_DIRECT reads work there
    pages = config.capacity_bytes // config.page_bytes
    # every page: its header with the first slot's head; the others hold no header
    assert sorted(read for read in reads if read[0] % config.page_bytes == 0) == sorted(
        (page * config.page_bytes % config.file_bytes, 8192) for page in range(pages)
    )
    trailers = [((index + 1) * slot_bytes, 8192 if index + 1 < slots_per_page else 4096) for index in range(slots_per_page)]
    assert [read for read in reads if read[0] % config.page_bytes] == trailers  # then each trailer with the next head


def test_freed_blocks_do_not_come_back_after_restart(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        written = [put(tier, index, 100_000) for index in range(6)]
        for slot, _, _ in written[::2]:
            tier.free(slot)
        assert tier.stats().num_blocks == 3
    with NvmeTier(make_config(tmp_path)) as tier:
        assert [meta for _, meta, _ in tier.recovered()] == [meta for _, meta, _ in written[1::2]]


def test_a_page_whose_blocks_were_all_freed_is_free_after_restart(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        slot, _, _ = put(tier, 0, 500_000)
        tier.free(slot)
    with NvmeTier(make_config(tmp_path)) as tier:
        assert tier.recovered() == [] and tier.stats().used_bytes == 0
        # the page can now serve another size class, and that survives a restart too
        slot, meta, data = put(tier, 1, 5_000)
        assert slot.offset // tier.page_bytes == 0
    with NvmeTier(make_config(tmp_path)) as tier:
        assert tier.recovered()[0][:2] == (slot, meta)
        assert torch.equal(read_back(tier, slot, meta), data)


def fail_clearing(real_pwritev, trailer_at: int | None = None):
    """A pwritev that fails the write of a zeroed 4 KiB trailer (at ``trailer_at``, or anywhere)."""

    def pwritev(fd, buffers, offset):
        if len(buffers) == 1 and not any(buffers[0]) and trailer_at in (None, offset):
            raise OSError(errno.EIO, "Input/output error")
        return real_pwritev(fd, buffers, offset)

    return pwritev


def free_leaving_its_trailer(tier: NvmeTier, slot: Slot, monkeypatch) -> None:
    """Free ``slot`` with the zeroing of its trailer failing: the old block's trailer stays on disk."""
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwritev", fail_clearing(os.pwritev))
        tier.free(slot)
        tier.wait_freed()


class Crash(BaseException):
    """Stands for the process dying: nothing after it runs, no cleanup handler catches it."""


def crash_after_half_of_a_block_write(real_pwritev, cut=lambda total: total // 2 // 4096 * 4096):
    """A pwritev that, for a block write (more than 4 KiB), writes the first ``cut(total)``
    of its bytes (by default half, in whole 4 KiB pages) and dies: what a kill that cuts a
    buffered write short leaves."""
    prefix = runpy.run_path(str(WRITER))["prefix"]

    def pwritev(fd, buffers, offset):
        total = sum(len(buffer) for buffer in buffers)
        if total <= 4096:
            return real_pwritev(fd, buffers, offset)
        real_pwritev(fd, prefix(buffers, cut(total)), offset)
        raise Crash()

    return pwritev


def test_a_trailer_left_by_an_earlier_size_class_is_not_resurrected(tmp_path, monkeypatch):
    with NvmeTier(make_config(tmp_path)) as tier:
        first, _, _ = put(tier, 0, 200_000)
        second, _, _ = put(tier, 1, 200_000)
        assert second.offset == first.offset + 204_800
        tier.free(first)
        tier.wait_freed()  # a freed slot's trailer is zeroed in the I/O pool
        with monkeypatch.context() as patch:
            patch.setattr(os, "pwritev", fail_clearing(os.pwritev, trailer_offset(second)))
            tier.free(second)  # its trailer stays on disk
            tier.wait_freed()
        assert tier.num_write_errors == 1
        # the page now serves half-size slots: the fourth one's trailer lies on the stale one
        slot, meta, _ = put(tier, 2, 98_304)
        assert (slot.offset, slot.nbytes) == (first.offset, 102_400)
        assert trailer_offset(Slot(first.offset + 3 * 102_400, 102_400)) == trailer_offset(second)
    with NvmeTier(make_config(tmp_path)) as tier:
        assert [entry[:2] for entry in tier.recovered()] == [(slot, meta)]
        assert tier.num_dropped_at_start == 1


CUTS = {"half": lambda total: total // 2 // 4096 * 4096, "first-4k": lambda total: 4096, "all-but-trailer": lambda total: total - 4096}


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("sync_writes", [False, True])
def test_a_reused_slot_whose_trailer_could_not_be_cleared_never_shows_the_old_block(tmp_path, monkeypatch, sync_writes, cut):
    config = make_config(tmp_path, sync_writes=sync_writes)
    with NvmeTier(config) as tier:
        slot, _, _ = put(tier, 0, 50_000)
        free_leaving_its_trailer(tier, slot, monkeypatch)
        assert tier.allocate(50_000) == slot
        meta, data = make_block(1, 50_000)
        with monkeypatch.context() as patch, pytest.raises(Crash):
            patch.setattr(os, "pwritev", crash_after_half_of_a_block_write(os.pwritev, CUTS[cut]))
            tier.write(slot, data, meta)  # some of the new bytes lie under the old trailer
    with NvmeTier(config) as tier:
        assert tier.recovered() == []
        # without sync_writes the old trailer is still there, and its head checksum voids it
        assert tier.num_dropped_at_start == (0 if sync_writes else 1)


def test_a_stale_trailer_never_comes_back_when_its_page_is_carved_again(tmp_path, monkeypatch):
    with NvmeTier(make_config(tmp_path)) as tier:
        slot, _, _ = put(tier, 0, 200_000)
        free_leaving_its_trailer(tier, slot, monkeypatch)
        # the empty page now serves 12 KiB slots, none of whose trailers lies on the stale one
        other, _, _ = put(tier, 1, 8_000)
        assert other.offset == slot.offset and 204_800 % other.nbytes
        tier.free(other)
    # after a restart no one remembers the stale trailer; the page is carved back into
    # 200 KiB slots and a write to the same slot dies halfway
    with NvmeTier(make_config(tmp_path)) as tier:
        assert tier.recovered() == [] and tier.num_dropped_at_start == 0
        assert tier.allocate(200_000) == slot
        meta, data = make_block(2, 200_000)
        with monkeypatch.context() as patch, pytest.raises(Crash):
            patch.setattr(os, "pwritev", crash_after_half_of_a_block_write(os.pwritev))
            tier.write(slot, data, meta)
    with NvmeTier(make_config(tmp_path)) as tier:
        assert tier.recovered() == []
        assert tier.num_dropped_at_start == 1  # older than its page header


def test_a_flipped_data_byte_fails_the_read(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        slot, meta, _ = put(tier, 0, 200_000)
        flip_byte(tier, slot.offset + 12_345)
        dst = torch.full((meta.nbytes,), 7, dtype=torch.uint8)
        with pytest.raises(CorruptBlock, match="checksum"):
            tier.read(slot, dst, meta)
        assert tier.num_corrupt == 1
        assert not dst.any(), "unverified bytes were left in the caller's buffer"


def test_reading_a_slot_as_another_block_fails(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        slot, _, _ = put(tier, 0, 10_000)
        other, _ = make_block(1, 10_000)
        with pytest.raises(CorruptBlock, match="another block"):
            read_back(tier, slot, other)
        never_written = tier.allocate(10_000)
        with pytest.raises(CorruptBlock, match="no valid trailer"):
            read_back(tier, never_written, other)
        assert tier.num_corrupt == 2


def test_a_flipped_trailer_byte_is_dropped_at_restart(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        written = [put(tier, index, 50_000) for index in range(3)]
        flip_byte(tier, trailer_offset(written[1][0]) + 40)
    with NvmeTier(make_config(tmp_path)) as tier:
        assert [meta for _, meta, _ in tier.recovered()] == [written[0][1], written[2][1]]
        assert tier.num_dropped_at_start == 1
    with NvmeTier(make_config(tmp_path)) as tier:
        assert tier.num_dropped_at_start == 0  # the dropped trailer was cleared


def test_verify_on_start_drops_blocks_whose_data_is_corrupt(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        written = [put(tier, index, 50_000) for index in range(3)]
        flip_byte(tier, written[0][0].offset + 49_999)
    with NvmeTier(make_config(tmp_path)) as tier:
        assert tier.num_recovered == 3  # trailers alone cannot tell
    with NvmeTier(make_config(tmp_path, verify_on_start=True)) as tier:
        assert [meta for _, meta, _ in tier.recovered()] == [written[1][1], written[2][1]]
        assert tier.num_dropped_at_start == 1


def test_the_newest_copy_of_a_block_written_twice_wins(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        meta, data = make_block(0, 30_000)
        first, second = tier.allocate(30_000), tier.allocate(30_000)
        tier.write(second, data, meta)
        tier.write(first, data, meta)
    with NvmeTier(make_config(tmp_path)) as tier:
        assert [entry[0] for entry in tier.recovered()] == [first]
        assert tier.num_dropped_at_start == 1


@pytest.mark.parametrize("sync_writes", [False, True])
def test_zstd_with_shuffle_round_trips_fp16_and_counts_the_ratio(tmp_path, sync_writes):
    config = make_config(tmp_path, compression="zstd", sync_writes=sync_writes)
    fp16 = torch.randn(128 * 1024, generator=torch.Generator().manual_seed(0)).half().view(torch.uint8)
    noise = make_block(99, 200_000)[1]
    blocks = {"fp16": fp16, "zeros": torch.zeros(300_000, dtype=torch.uint8), "odd": fp16[:100_001].clone()}
    with NvmeTier(config) as tier:
        written = {}
        for index, (name, data) in enumerate(blocks.items()):
            meta = make_block(index, data.numel())[0]
            slot = tier.allocate(meta.nbytes)
            tier.write(slot, data, meta)
            written[name] = (slot, meta)
            if name == "fp16":
                # zstd alone gets ~1.09 on such bytes; the shuffle is what lifts it to ~1.18
                assert tier.bytes_in / tier.bytes_stored > 1.14
        assert tier.bytes_in / tier.bytes_stored > 1.2
        for name, (slot, meta) in written.items():
            assert torch.equal(read_back(tier, slot, meta), blocks[name])
        # incompressible bytes are stored raw
        before = tier.bytes_stored
        noise_meta = make_block(99, 200_000)[0]
        noise_slot = tier.allocate(200_000)
        tier.write(noise_slot, noise, noise_meta)
        assert tier.bytes_stored - before == 200_000
    written["noise"] = (noise_slot, noise_meta)
    blocks["noise"] = noise
    # compressed blocks stay readable when the tier reopens without compression
    with NvmeTier(make_config(tmp_path)) as tier:
        assert tier.num_recovered == 4
        for name, (slot, meta) in written.items():
            assert torch.equal(read_back(tier, slot, meta), blocks[name])


def test_a_corrupt_compressed_block_fails_the_read(tmp_path):
    with NvmeTier(make_config(tmp_path, compression="zstd")) as tier:
        slot = tier.allocate(300_000)
        meta = make_block(0, 300_000)[0]
        tier.write(slot, torch.zeros(300_000, dtype=torch.uint8), meta)
        flip_byte(tier, slot.offset + 5)
        with pytest.raises(CorruptBlock):
            read_back(tier, slot, meta)


def parse_writer_output(lines: list[str]) -> tuple[set[int], int, set[int]]:
    """(blocks committed and not freed, the block that was being written, the block whose
    free may have been done without its line being printed)."""
    ops = [(op, int(index)) for op, index in (line.split() for line in lines if line != "full")]
    written = {index for op, index in ops if op == "w"}
    committed = written - {index for op, index in ops if op == "f"}
    last_op, last_index = ops[-1]
    maybe_freed = {last_index - 2} if last_op == "w" and last_index % 5 == 4 else set()
    return committed, max(written) + 1, maybe_freed


def check_recovery(directory: Path, committed: set[int], uncertain: set[int]) -> None:
    """Every committed block comes back intact; nothing else does, but for ``uncertain``
    ones, and those that come back are intact too."""
    writer = runpy.run_path(str(WRITER))
    index_by_hash = {writer["block_hash"](index): index for index in range(max(committed | uncertain) + 10)}
    with NvmeTier(writer["config"](directory)) as tier:
        recovered = {index_by_hash[meta.block_hash]: (slot, meta) for slot, meta, _ in tier.recovered()}
        assert committed - uncertain <= recovered.keys() <= committed | uncertain
        for index, (slot, meta) in recovered.items():
            expected_meta, expected_data = writer["block"](index)
            assert meta == expected_meta
            assert torch.equal(read_back(tier, slot, meta), expected_data)


def start_writer(directory: Path, mode: str, *crash: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(directory), mode, *crash],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


@pytest.mark.parametrize("mode", ["nosync", "sync"])
def test_a_killed_writer_leaves_every_committed_block_and_nothing_torn(tmp_path, mode):
    process = start_writer(tmp_path, mode)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line.strip())
            if len(lines) >= 120:
                break
        assert process.poll() is None and "full" not in lines, "the writer stopped before it could be killed"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        lines += process.stdout.read().splitlines()
    finally:
        process.kill()
        process.wait()
    assert len(lines) >= 120, process.stderr.read()
    committed, in_flight, maybe_freed = parse_writer_output(lines)
    # the kill may land after a call returned and before its line was printed
    check_recovery(tmp_path, committed, {in_flight} | maybe_freed)


@pytest.mark.parametrize(
    "crash",
    [
        # sync_writes: the block's bytes are written and not yet synced, or the crash
        # falls before a data write, a trailer write, a cleared trailer or a page header
        ("sync", "before", "fdatasync", "40"),
        *(("sync", "before", "pwritev", str(count)) for count in range(100, 104)),
        ("sync", "cut", "30", "half"),
        # the default: one write per block, cut short inside its bytes or just before
        # its trailer, as a kill can cut a buffered write; or a crash between blocks
        ("nosync", "cut", "30", "half"),
        ("nosync", "cut", "31", "all-but-last-4k"),
        ("nosync", "cut", "32", "all-but-last-4k"),
        ("nosync", "before", "pwritev", "100"),
    ],
    ids="-".join,
)
def test_a_crash_inside_the_write_order_loses_only_the_block_being_written(tmp_path, crash):
    process = start_writer(tmp_path, *crash)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == runpy.run_path(str(WRITER))["CRASH_EXIT_STATUS"], stderr
    committed, _, _ = parse_writer_output(stdout.splitlines())
    # the crash comes inside or before a call, so whatever had returned was printed, and
    # the block in flight must not come back
    check_recovery(tmp_path, committed, uncertain=set())


def test_a_directory_that_is_a_file_is_refused_with_advice(tmp_path):
    path = tmp_path / "not-a-directory"
    path.write_text("")
    with pytest.raises(TierUnavailable, match="writable directory"):
        NvmeTier(make_config(path))


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 2 MiB filesystem, to fill up."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_sizes_the_tier_down_to_whole_pages(tiny_tmpfs):
    config = make_config(tiny_tmpfs, capacity_bytes=16 * MiB, page_bytes=512 * 1024, file_bytes=MiB)
    with NvmeTier(config) as tier:
        assert tier.sized_down and tier.requested_capacity_bytes == 16 * MiB
        assert 0 < tier.capacity_bytes <= 2 * MiB and tier.capacity_bytes % tier.page_bytes == 0
        assert tier.stats().capacity_bytes == tier.capacity_bytes
        written = [put(tier, index, 100_000) for index in range(3)]
        for slot, meta, data in written:
            assert torch.equal(read_back(tier, slot, meta), data)
        capacity = tier.capacity_bytes
    with NvmeTier(config) as tier:
        assert tier.capacity_bytes == capacity and tier.num_recovered == 3


def test_a_disk_without_room_for_one_page_is_refused_with_advice(tiny_tmpfs):
    with pytest.raises(TierUnavailable, match="no room for even one"):
        NvmeTier(make_config(tiny_tmpfs, capacity_bytes=8 * MiB, page_bytes=4 * MiB))


@pytest.mark.parametrize(
    "sync_writes, failing",
    [(False, "every write"), (False, "the trailer write"), (True, "every write"), (True, "the trailer write"), (True, "the sync")],
)
def test_a_failed_write_leaves_no_valid_trailer(tmp_path, monkeypatch, sync_writes, failing):
    real_pwritev = os.pwritev

    def pwritev(fd, buffers, offset):
        if failing == "every write" or (failing == "the trailer write" and bytes(buffers[-1][:4]) == b"KVST"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    def fdatasync(fd):
        raise OSError(errno.EIO, "Input/output error")

    config = make_config(tmp_path, sync_writes=sync_writes)
    with NvmeTier(config) as tier:
        kept = put(tier, 0, 70_000)
        meta, data = make_block(1, 70_000)
        slot = tier.allocate(70_000)
        with monkeypatch.context() as patch:
            patch.setattr(os, "pwritev", pwritev)
            if failing == "the sync":
                patch.setattr(os, "fdatasync", fdatasync)
            with pytest.raises(TierUnavailable, match="check that disk") as caught:
                tier.write(slot, data, meta)
        assert isinstance(caught.value.__cause__, OSError)
        assert tier.num_write_errors == 1
        with pytest.raises(CorruptBlock):
            read_back(tier, slot, meta)
        # the failure did not stick: the slot takes the block once the disk works again
        tier.write(slot, data, meta)
        assert torch.equal(read_back(tier, slot, meta), data)
        tier.free(slot)
    with NvmeTier(config) as tier:
        assert [entry[:2] for entry in tier.recovered()] == [kept[:2]]


def record_io(monkeypatch) -> list[tuple]:
    """Patch os.pwritev, os.preadv and os.fdatasync to log ("write", position, bytes, ends
    with a trailer), ("read", position, bytes, address of the first buffer) and ("sync",)."""
    calls: list[tuple] = []
    real_pwritev, real_preadv, real_fdatasync = os.pwritev, os.preadv, os.fdatasync

    def pwritev(fd, buffers, offset):
        calls.append(("write", offset, sum(len(b) for b in buffers), bytes(buffers[-1][:4]) == b"KVST"))
        return real_pwritev(fd, buffers, offset)

    def preadv(fd, buffers, offset):
        address = np.frombuffer(buffers[0], np.uint8).ctypes.data
        calls.append(("read", offset, sum(len(b) for b in buffers), address))
        return real_preadv(fd, buffers, offset)

    def fdatasync(fd):
        calls.append(("sync",))
        return real_fdatasync(fd)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return calls


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("nbytes", [100_000, 262_144])
def test_a_block_is_one_write_that_ends_with_its_trailer(tmp_path, monkeypatch, direct_io, nbytes):
    with NvmeTier(make_config(tmp_path, direct_io=direct_io)) as tier:
        assert tier.config.sync_writes is False
        put(tier, 0, nbytes)  # writes the page header
        meta, data = make_block(1, nbytes)
        src = aligned_tensor(nbytes)
        src.copy_(data)
        slot = tier.allocate(nbytes)
        calls = record_io(monkeypatch)
        tier.write(slot, src, meta)
        assert calls == [("write", slot.offset, slot.nbytes, True)]
        # a read is one preadv too, straight into the caller's buffer
        dst = aligned_tensor(nbytes)
        tier.read(slot, dst, meta)
        assert calls[1:] == [("read", slot.offset, slot.nbytes, dst.data_ptr())]
        assert torch.equal(dst, data)


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_reused_slot_is_one_write_even_while_its_old_trailer_is_on_disk(tmp_path, monkeypatch, direct_io):
    """Without sync_writes, a slot freed and taken again before its trailer was zeroed (or
    whose zeroing failed) gets no zeroing write first: the new block is still one write,
    and the old trailer is voided by the new bytes at the slot's head."""
    with NvmeTier(make_config(tmp_path, direct_io=direct_io)) as tier:
        slot, old_meta, _ = put(tier, 0, 100_000)
        free_leaving_its_trailer(tier, slot, monkeypatch)
        assert tier.allocate(100_000) == slot
        meta, data = make_block(1, 100_000)
        calls = record_io(monkeypatch)
        tier.write(slot, data, meta)
        assert calls == [("write", slot.offset, slot.nbytes, True)]
        assert torch.equal(read_back(tier, slot, meta), data)
        with pytest.raises(CorruptBlock):
            read_back(tier, slot, old_meta)
    with NvmeTier(make_config(tmp_path, direct_io=direct_io)) as tier:
        assert [entry[:2] for entry in tier.recovered()] == [(slot, meta)]


def test_a_slot_taken_again_before_its_zeroing_ran_is_written_once(tmp_path, monkeypatch):
    config = make_config(tmp_path, io_threads=1)
    with NvmeTier(config) as tier:
        slot, old_meta, _ = put(tier, 0, 100_000)
        gate = threading.Event()
        tier._executor.submit(gate.wait)  # holds the one I/O thread: the zeroing waits behind it
        calls = record_io(monkeypatch)
        tier.free(slot)
        assert tier.allocate(100_000) == slot
        gate.set()
        tier.wait_freed()  # the zeroing's turn comes before the write, and it is skipped
        meta, data = make_block(1, 100_000)
        tier.write(slot, data, meta)
        assert calls == [("write", slot.offset, slot.nbytes, True)]  # no zeroing, by the pool or by the write
        with pytest.raises(CorruptBlock):
            read_back(tier, slot, old_meta)
    with NvmeTier(config) as tier:
        assert [entry[:2] for entry in tier.recovered()] == [(slot, meta)]


def test_a_slot_taken_again_and_freed_unwritten_is_still_zeroed(tmp_path):
    config = make_config(tmp_path, io_threads=1)
    with NvmeTier(config) as tier:
        slot, _, _ = put(tier, 0, 100_000)
        gate = threading.Event()
        tier._executor.submit(gate.wait)
        tier.free(slot)
        assert tier.allocate(100_000) == slot  # its zeroing is skipped: a write would void the trailer
        tier.free(slot)  # but none came
        gate.set()
        tier.wait_freed()
    with NvmeTier(config) as tier:
        assert tier.recovered() == [] and tier.num_dropped_at_start == 0


def test_sync_writes_syncs_the_bytes_before_the_trailer_is_written(tmp_path, monkeypatch):
    with NvmeTier(make_config(tmp_path, sync_writes=True)) as tier:
        calls = record_io(monkeypatch)
        slot, _, _ = put(tier, 0, 100_000)
        page_header = [("write", 0, 4096, False), ("sync",)]
        assert calls == page_header + [
            ("write", slot.offset, slot.nbytes - 4096, False),
            ("sync",),
            ("write", trailer_offset(slot), 4096, True),
        ]


def test_concurrent_synced_writes_share_their_fdatasync_calls(tmp_path, monkeypatch):
    real_fdatasync = os.fdatasync
    syncs: list[int] = []

    def slow_fdatasync(fd):
        syncs.append(fd)
        time.sleep(0.05)  # long enough that writers pile up behind a running sync
        real_fdatasync(fd)

    with NvmeTier(make_config(tmp_path, sync_writes=True, io_threads=8)) as tier:
        put(tier, 0, 10_000)
        blocks = [make_block(index, 10_000) for index in range(1, 33)]
        slots = [tier.allocate(10_000) for _ in blocks]
        monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
        for future in [tier.submit_write(slot, data, meta) for slot, (meta, data) in zip(slots, blocks)]:
            future.result(timeout=30)
        assert len(syncs) <= len(blocks) // 2
        for slot, (meta, data) in zip(slots, blocks):
            assert torch.equal(read_back(tier, slot, meta), data)


def test_concurrent_submits_on_distinct_slots(tmp_path):
    with NvmeTier(make_config(tmp_path, io_threads=4, capacity_bytes=64 * MiB)) as tier:
        blocks = [make_block(index, (32 + index % 3 * 50) * 1024) for index in range(64)]
        slots = [tier.allocate(meta.nbytes) for meta, _ in blocks]
        futures = [tier.submit_write(slot, data, meta) for slot, (meta, data) in zip(slots, blocks)]
        for future in futures:
            future.result(timeout=30)
        outputs = [torch.empty(meta.nbytes, dtype=torch.uint8) for meta, _ in blocks]

        async def read_all() -> None:
            await asyncio.gather(
                *(asyncio.wrap_future(tier.submit_read(slot, out, meta)) for slot, out, (meta, _) in zip(slots, outputs, blocks))
            )

        asyncio.run(read_all())
        for out, (_, data) in zip(outputs, blocks):
            assert torch.equal(out, data)


def test_misuse_is_refused_with_a_sentence(tmp_path):
    with NvmeTier(make_config(tmp_path)) as tier:
        meta, data = make_block(0, 10_000)
        slot = tier.allocate(10_000)
        with pytest.raises(BlockSizeMismatch):
            tier.write(slot, data[:9_000], meta)
        with pytest.raises(BlockSizeMismatch, match="allocate"):
            tier.write(tier.allocate(50_000), data, meta)
        with pytest.raises(InvalidArgument, match="not a slot"):
            tier.write(Slot(slot.offset + 4096, slot.nbytes), data, meta)
        with pytest.raises(InvalidArgument, match="uint8"):
            tier.write(slot, data.view(torch.int16), meta)
    with pytest.raises(TierUnavailable, match="closed"):
        tier.write(slot, data, meta)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"page_bytes": 5000}, "page_bytes"),
        ({"capacity_bytes": MiB}, "capacity_bytes"),
        ({"file_bytes": MiB}, "file_bytes"),
        ({"compression": "lz4"}, "compression"),
        ({"compression_level": 0}, "compression_level"),
        ({"io_threads": 0}, "io_threads"),
        ({"direct_io": 1}, "direct_io"),
    ],
)
def test_config_names_the_bad_field(tmp_path, overrides, field):
    with pytest.raises(InvalidArgument, match=f"NvmeTierConfig.{field}"):
        make_config(tmp_path, **overrides)


def test_a_second_tier_on_the_same_directory_is_refused_until_the_first_closes(tmp_path):
    # two owners of the same slot files would hand out the same slots twice
    first = NvmeTier(make_config(tmp_path))
    try:
        with pytest.raises(TierUnavailable, match="another kvstore daemon uses the NVMe directory"):
            NvmeTier(make_config(tmp_path))
    finally:
        first.close()
    NvmeTier(make_config(tmp_path)).close()


def test_the_default_capacity_is_a_tenth_of_free_disk_and_at_most_64_gib(tmp_path):
    import shutil

    from kvstore.config import _default_nvme_capacity

    free = shutil.disk_usage(tmp_path).free
    capacity = _default_nvme_capacity(tmp_path / "nvme")
    assert capacity <= min(free // 10, 64 << 30) and capacity >= min(free // 10, 64 << 30) - (64 << 20)
    # the slot files of a previous run count as free space, so a restart keeps its size
    (tmp_path / "nvme").mkdir()
    with open(tmp_path / "nvme" / "slots-000.dat", "wb") as leftover:
        os.posix_fallocate(leftover.fileno(), 0, 256 * MiB)
    assert abs(_default_nvme_capacity(tmp_path / "nvme") - capacity) <= 64 << 20
