"""The NVMe tier: block bytes in preallocated slot files that survive a restart.

The files (``tiers/nvme_files.py``) hold pages of ``page_bytes`` laid end to end. A page
starts with a 4 KiB page header naming the slot size it is carved into; a slot holds the
stored bytes, zero-padded to 4 KiB, then a 4 KiB trailer that describes them (records in
``tiers/nvme_format.py``).

The trailer is the commit record: one that validates must describe bytes that were
completely written, wherever the process is killed. So it goes after them:

- by default, in one ``pwritev`` of [stored bytes, trailer] at the slot's offset: one I/O
  per block, like a raw write (a second, random 4 KiB write per block costs more than a
  256 KiB block's own bytes). A killed call leaves a prefix of its bytes, and the trailer
  is their end: with O_DIRECT the task waits uninterruptibly for what it submitted, so
  SIGKILL lands once the I/O is done; buffered, the kernel copies into the page cache in
  offset order and checks for a fatal signal only between pages. A power loss may keep a
  trailer over bytes that never reached the disk (the page cache and the device reorder
  writes), yet they are never served: every read checks the trailer against the caller's
  ``BlockMeta`` and the payload against its XXH3-64, and raises CorruptBlock (a miss).
- with ``sync_writes``: (1) the stored bytes, (2) ``fdatasync``, shared by concurrent
  writers, (3) the trailer, so that after a power loss too a valid trailer lies only over
  durable bytes. Nothing syncs after step 3: the newest blocks may be lost, as misses.

A reused slot still holds its last block's trailer until the new one lands. The trailer
names the XXH3-64 of its slot's first 4 KiB, which the new write replaces first, so a
write killed partway leaves an old trailer that no longer matches its slot's head, and a
restart drops it: by default a reused slot is one write too, with no zeroing first. (A
new block whose first 4 KiB equal the old one's is caught at its first read instead, by
the payload checksum: a miss, never data.) With ``sync_writes`` the old trailer is zeroed
before the new bytes are written, and that zeroing is synced with them, so that after a
power loss no old trailer lies over them either.

``free`` returns the slot at once and zeroes its trailer in the I/O pool (the owner
never waits on the disk), so a freed block is not resurrected. A slot allocated again
before its zeroing ran skips it: the next write voids the old trailer (with
``sync_writes`` it zeroes it first, itself), so a full tier that churns makes one write
per block, not two; until that write lands, a crash may bring the old block back, whole
(its trailer and bytes untouched) and checked by every read as any block is. If the
zeroing fails, the slot's next write stands in for it too.
A page header is written (and synced with ``sync_writes``) before the first slot of each
carving of its page, with a fresh ``seq``; a restart takes only trailers newer than
their page header, so none from an earlier carving comes back.

Threads: ``allocate``, ``free`` and ``stats`` belong to the owner (the tier manager);
``write`` and ``read`` may run at once on distinct slots, from the tier's own pool
(``submit_write`` / ``submit_read``) or any other thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvstore.errors import BlockSizeMismatch, CorruptBlock, InvalidArgument, TierUnavailable
from kvstore.hashing import HASH_BYTES
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta, Tier, TierStats
from kvstore.tiers.nvme_files import IO_ALIGN, SlotFiles
from kvstore.tiers.nvme_format import (
    HEADER_BYTES,
    TRAILER_BYTES,
    PageHeader,
    PayloadCodec,
    SlotTrailer,
    decode_page_header,
    decode_slot_trailer,
    encode_page_header,
    encode_slot_trailer,
    head_checksum,
    looks_like_slot_trailer,
    newest_copies,
)
from kvstore.tiers.slab import SlabAllocator, Slot, round_up

__all__ = ["NvmeTierConfig", "NvmeTier"]

logger = logging.getLogger(__name__)

# Linux moves at most 2 GiB - 4 KiB per read or write call; a slot must fit in one.
_MAX_PAGE_BYTES = 1 << 30

_DONE = object()  # no zeroing pending for a slot

# (slot, meta, XXH3-64 of the payload) for each block found intact at start
Recovered = tuple[Slot, BlockMeta, int]


@dataclass(frozen=True, slots=True)
class NvmeTierConfig:
    """``capacity_bytes`` and ``file_bytes`` are used in whole pages (rounded down); a
    block must fit in one page with its 4 KiB slot trailer and the page's 4 KiB header.

    ``sync_writes`` trades put throughput for power-loss durability. Off (the default),
    a block is one write, data then trailer, and a killed process never leaves a trailer
    that validates at start over incomplete bytes (but for a new block whose first 4 KiB
    equal the old one's, which its first read rejects); a power loss may, and reads then
    reject the block as corrupt (a miss), since the cache can always recompute it. On,
    each block's bytes are synced before its trailer is written (three I/Os, the sync
    shared by concurrent writers), so a trailer that survives a power loss describes
    bytes that did too."""

    directory: Path
    capacity_bytes: int
    page_bytes: int = 64 << 20
    file_bytes: int = 1 << 30
    compression: str = "none"
    compression_level: int = 3
    direct_io: bool = True
    sync_writes: bool = False
    io_threads: int = 4
    verify_on_start: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)):
            raise InvalidArgument("NvmeTierConfig.directory must be a filesystem path.")
        object.__setattr__(self, "directory", Path(self.directory))
        for name in ("capacity_bytes", "page_bytes", "file_bytes", "compression_level", "io_threads"):
            if type(getattr(self, name)) is not int:
                raise InvalidArgument(f"NvmeTierConfig.{name} must be an integer, got {getattr(self, name)!r}.")
        for name in ("direct_io", "sync_writes", "verify_on_start"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"NvmeTierConfig.{name} must be true or false, got {getattr(self, name)!r}.")
        if self.page_bytes % IO_ALIGN or not 3 * IO_ALIGN <= self.page_bytes <= _MAX_PAGE_BYTES:
            raise InvalidArgument(
                f"NvmeTierConfig.page_bytes must be a multiple of {IO_ALIGN} between "
                f"{3 * IO_ALIGN} and {_MAX_PAGE_BYTES}, got {self.page_bytes}."
            )
        if self.capacity_bytes < self.page_bytes:
            raise InvalidArgument(
                f"NvmeTierConfig.capacity_bytes ({self.capacity_bytes}) must hold at least one page of "
                f"{self.page_bytes} bytes; raise capacity_bytes or lower page_bytes."
            )
        if self.file_bytes < self.page_bytes:
            raise InvalidArgument(f"NvmeTierConfig.file_bytes must be at least page_bytes ({self.page_bytes}).")
        if self.compression not in ("none", "zstd"):
            raise InvalidArgument(f"NvmeTierConfig.compression must be 'none' or 'zstd', got {self.compression!r}.")
        if not 1 <= self.compression_level <= 22:
            raise InvalidArgument(f"NvmeTierConfig.compression_level must lie in [1, 22], got {self.compression_level}.")
        if not 1 <= self.io_threads <= 256:
            raise InvalidArgument(f"NvmeTierConfig.io_threads must lie in [1, 256], got {self.io_threads}.")


class NvmeTier(Tier):
    kind = TierKind.NVME

    def __init__(self, config: NvmeTierConfig) -> None:
        self.config = config
        self.page_bytes = config.page_bytes
        # whole pages per file, so that no page straddles two files
        self.file_bytes = config.file_bytes // config.page_bytes * config.page_bytes
        self.requested_capacity_bytes = config.capacity_bytes // config.page_bytes * config.page_bytes
        self.num_blocks = 0
        self.num_recovered = 0
        self.num_dropped_at_start = 0
        self.num_corrupt = 0
        self.num_write_errors = 0
        self.num_read_errors = 0
        self.num_refused = 0  # writes of bytes that no longer matched their committed checksum
        self.bytes_in = 0
        self.bytes_stored = 0
        # _lock guards the allocator, the counters, _next_seq, _uncleared and _clearing;
        # _page_header_lock serialises page-header writes, which hold it across an fdatasync
        self._lock = threading.Lock()
        self._page_header_lock = threading.Lock()
        self._codec = PayloadCodec(config.compression_level)
        self._files = SlotFiles(
            config.directory,
            self.requested_capacity_bytes // self.page_bytes,
            self.page_bytes,
            self.file_bytes,
            config.direct_io,
        )
        self.uses_direct_io = self._files.uses_direct_io
        self.capacity_bytes = self._files.num_pages * self.page_bytes
        self.sized_down = self.capacity_bytes < self.requested_capacity_bytes
        self._allocator = SlabAllocator(self.capacity_bytes, self.page_bytes, alignment=IO_ALIGN, page_header_bytes=HEADER_BYTES)
        # page index -> the slot size its on-disk page header names
        self._page_header_slot_bytes: dict[int, int] = {}
        self._next_seq = 1
        # slots whose trailer may still validate for a block freed or dropped
        self._uncleared: set[Slot] = set()
        # freed slots whose trailer is not zeroed yet: None while queued, an Event while it runs
        self._clearing: dict[Slot, threading.Event | None] = {}
        self._pending_clears: set[Future] = set()
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-nvme")
        try:
            self._recovered = self._rebuild()
        except BaseException:
            self.close()
            raise

    # -- the Tier interface ---------------------------------------------------------
    @property
    def slot_paths(self) -> list[Path]:
        """The slot files this tier holds open."""
        return list(self._files.paths)

    def slot_bytes_for(self, nbytes: int) -> int:
        """Slot bytes a block of ``nbytes`` takes: the payload rounded up to 4 KiB plus its
        trailer. Compression shrinks reads, never the slot (slots are allocated first)."""
        if nbytes <= 0:
            raise InvalidArgument(f"a block must have at least one byte, got {nbytes}.")
        return self._allocator.slot_bytes_for(TRAILER_BYTES + nbytes)

    def can_allocate(self, nbytes: int) -> bool:
        slot_bytes = self.slot_bytes_for(nbytes)
        with self._lock:
            return self._allocator.can_allocate(slot_bytes)

    def allocate(self, nbytes: int) -> Slot | None:
        slot_bytes = self.slot_bytes_for(nbytes)
        with self._lock:
            slot = self._allocator.allocate(slot_bytes)
            if slot is not None:
                self.num_blocks += 1
                if not self.config.sync_writes and self._clearing.get(slot, _DONE) is None:
                    # freed and taken again before its zeroing ran: the new block's write voids
                    # the old trailer (its head checksum), so the zeroing is one I/O saved
                    del self._clearing[slot]
                    self._uncleared.add(slot)
        return slot

    def free(self, slot: Slot) -> None:
        """Return a slot at once; its trailer is zeroed in the I/O pool (so a freed block never
        comes back after a restart) without the owner waiting on the disk. A write that gets
        the slot before that zeroing ran does it first, itself."""
        self._check_slot(slot)
        with self._lock:
            self._allocator.free(slot)
            self.num_blocks -= 1
            self._clearing[slot] = None
        try:
            future = self._executor.submit(self._clear_freed, slot)
        except RuntimeError:  # the pool is shut down: the tier is closing
            self._clear_freed(slot)
            return
        with self._lock:
            self._pending_clears.add(future)
        future.add_done_callback(self._clear_done)

    def wait_freed(self) -> None:
        """Wait until the trailer of every slot freed so far is zeroed (or its failure noted)."""
        with self._lock:
            pending = list(self._pending_clears)
        wait(pending)

    def _clear_done(self, future: Future) -> None:
        with self._lock:
            self._pending_clears.discard(future)

    def _clear_freed(self, slot: Slot) -> None:
        with self._lock:
            if self._clearing.get(slot, _DONE) is not None:
                return  # a write took the slot and zeroed its trailer first
            done = threading.Event()
            self._clearing[slot] = done
        try:
            if not self._clear_trailer(slot):
                # the block may come back after a restart; every read still verifies it
                with self._lock:
                    self.num_write_errors += 1
                logger.warning("Could not clear the NVMe slot trailer of %d in %s.", slot.offset, self._files.path_of(slot.offset))
        finally:
            with self._lock:
                if self._clearing.get(slot) is done:
                    del self._clearing[slot]
            done.set()

    def _must_clear_before_write(self, slot: Slot) -> bool:
        """Whether the slot's old trailer may still validate, so that a write must zero it
        before its bytes land; waits for a zeroing already under way."""
        while True:
            with self._lock:
                state = self._clearing.get(slot, _DONE)
                if state is _DONE:
                    return slot in self._uncleared
                if state is None:  # freed, not zeroed yet: this write does it
                    del self._clearing[slot]
                    return True
            state.wait()

    def write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> None:
        """Write a block; with ``meta.checksum`` set (a demotion), bytes that no longer match
        the checksum their writer committed are refused (CorruptBlock) before any I/O."""
        payload = _flat_bytes(src, meta, "src")
        self._check_slot(slot, meta)
        checksum = xxhash.xxh3_64_intdigest(payload)
        if meta.checksum is not None and checksum != meta.checksum:
            with self._lock:
                self.num_refused += 1
            raise CorruptBlock(
                f"block {meta.block_hash.hex()} changed since it was committed (its checksum no longer matches); it is not written."
            )
        flags, stored = self._codec.encode(payload) if self.config.compression == "zstd" else (0, payload)
        trailer_offset = slot.offset + slot.nbytes - TRAILER_BYTES
        try:
            # before this block's seq is taken: a restart takes only trailers newer than their page header
            self._write_page_header(slot)
            uncleared = self._must_clear_before_write(slot)
            with self._lock:
                seq = self._next_seq
                self._next_seq += 1
            if uncleared and self.config.sync_writes:
                # the fdatasync below makes this durable before the new trailer is written;
                # without sync_writes the head checksum voids the old trailer instead
                self._files.write(trailer_offset, [self._files.zeros])
            trailer = self._files.header_buffer()
            encode_slot_trailer(SlotTrailer(meta, slot.offset, stored.size, checksum, seq, flags, head_checksum(stored)), trailer)
            if self.config.sync_writes:
                self._files.write_slot(slot.offset, stored, round_up(stored.size, IO_ALIGN), None)
                self._files.sync(slot.offset)
                self._files.write(trailer_offset, [trailer])
            else:
                # zstd output is zero-padded up to the trailer so the trailer still follows
                # in the same call: compression shrinks reads, not this write
                self._files.write_slot(slot.offset, stored, trailer_offset - slot.offset, trailer)
        except OSError as exc:
            with self._lock:
                self.num_write_errors += 1
            self._clear_trailer(slot)
            raise TierUnavailable(
                f"Writing a block to {self._files.path_of(slot.offset)} failed ({exc.strerror or exc}); "
                "check that disk's health and free space.",
                tier=TierKind.NVME,
            ) from exc
        with self._lock:
            self._uncleared.discard(slot)
            self.bytes_in += payload.size
            self.bytes_stored += stored.size

    def read(self, slot: Slot, dst: torch.Tensor, meta: BlockMeta) -> None:
        out = _flat_bytes(dst, meta, "dst")
        self._check_slot(slot, meta)
        try:
            problem = self._read_verified(slot, out, meta)
        except OSError as exc:
            with self._lock:
                self.num_read_errors += 1
            raise TierUnavailable(
                f"Reading a block from {self._files.path_of(slot.offset)} failed ({exc.strerror or exc}); check that disk's health.",
                tier=TierKind.NVME,
            ) from exc
        if problem is not None:
            # dst may be memory an engine maps: leave zeros there, never unverified bytes
            out.fill(0)
            with self._lock:
                self.num_corrupt += 1
            raise CorruptBlock(f"The block in NVMe slot {slot.offset} {problem}; treat it as a miss and free the slot.")

    def submit_write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> Future[None]:
        return self._executor.submit(self.write, slot, src, meta)

    def submit_read(self, slot: Slot, dst: torch.Tensor, meta: BlockMeta) -> Future[None]:
        return self._executor.submit(self.read, slot, dst, meta)

    def recovered(self) -> list[Recovered]:
        """Blocks whose slot trailer verified at start (and their bytes, with
        verify_on_start), as (slot, meta, payload XXH3-64), by offset. Reads verify anyway."""
        return list(self._recovered)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(self.kind, self.capacity_bytes, self._allocator.used_bytes, self.num_blocks)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._files.close()

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- rebuild --------------------------------------------------------------------
    def _rebuild(self) -> list[Recovered]:
        try:
            scans = list(self._executor.map(self._scan_page, range(self._allocator.num_pages)))
        except OSError as exc:
            raise TierUnavailable(
                f"Reading the NVMe tier's records in {self.config.directory} failed ({exc.strerror or exc}); "
                "check that disk's health, or move the directory aside to start empty.",
                tier=TierKind.NVME,
            ) from exc
        found: list[tuple[Slot, SlotTrailer]] = []
        dropped: list[Slot] = []
        for page_index, page, in_page, unusable in scans:
            if page is not None:
                self._page_header_slot_bytes[page_index] = page.slot_bytes
                self._next_seq = max(self._next_seq, page.seq + 1)
            found += in_page
            dropped += unusable
        self._next_seq = max([self._next_seq] + [trailer.seq + 1 for _, trailer in found])
        newest, older = newest_copies(found)
        dropped += older
        # zero what is dropped, so that it cannot come back once the copy kept is freed
        for slot in dropped:
            self._clear_trailer(slot)
        offsets_by_page: dict[int, list[int]] = defaultdict(list)
        for slot, _ in newest:
            offsets_by_page[slot.offset // self.page_bytes].append(slot.offset)
        for page_index, offsets in offsets_by_page.items():
            self._allocator.restore_page(page_index, self._page_header_slot_bytes[page_index], offsets)
        self.num_dropped_at_start = len(dropped)
        self.num_blocks = self.num_recovered = len(newest)
        return sorted((slot, trailer.meta, trailer.payload_checksum) for slot, trailer in newest)

    def _scan_page(self, page_index: int) -> tuple[int, PageHeader | None, list[tuple[Slot, SlotTrailer]], list[Slot]]:
        """(page, its header if valid, slots with a valid trailer, slots to drop). One read
        per slot: the page header comes with the first slot's head, each trailer with the
        next slot's head (slots lie end to end after the page header)."""
        scratch = memoryview(mmap.mmap(-1, 3 * IO_ALIGN))  # aligned, as O_DIRECT needs
        record, heads = scratch[:IO_ALIGN], (scratch[IO_ALIGN : 2 * IO_ALIGN], scratch[2 * IO_ALIGN :])
        self._files.read(page_index * self.page_bytes, [record, heads[0]])
        page = decode_page_header(record)
        if page is None or page.page_index != page_index or page.page_bytes != self.page_bytes:
            return page_index, None, [], []
        slot_bytes = page.slot_bytes
        if slot_bytes % IO_ALIGN or not 2 * IO_ALIGN <= slot_bytes <= self.page_bytes - HEADER_BYTES:
            return page_index, None, [], []
        found: list[tuple[Slot, SlotTrailer]] = []
        unusable: list[Slot] = []
        first = page_index * self.page_bytes + HEADER_BYTES
        num_slots = self._allocator.slots_per_page(slot_bytes)
        for index in range(num_slots):
            offset = first + index * slot_bytes
            slot = Slot(offset, slot_bytes)
            head, next_head = heads[index % 2], heads[(index + 1) % 2]
            self._files.read(offset + slot_bytes - TRAILER_BYTES, [record, next_head] if index + 1 < num_slots else [record])
            trailer = decode_slot_trailer(record)
            if trailer is None:
                if looks_like_slot_trailer(record):  # torn or corrupt, not merely empty
                    unusable.append(slot)
                continue
            if (
                not trailer.fits(offset, slot_bytes)
                or trailer.seq <= page.seq
                # a later write into this slot began and never got to its own trailer
                or head_checksum(np.frombuffer(head, np.uint8)) != trailer.head_checksum
                or (
                    self.config.verify_on_start
                    and self._read_verified(slot, np.empty(trailer.meta.nbytes, np.uint8), trailer.meta) is not None
                )
            ):
                unusable.append(slot)
                continue
            found.append((slot, trailer))
        return page_index, page, found, unusable

    # -- slots and verification -----------------------------------------------------
    def _check_slot(self, slot: Slot, meta: BlockMeta | None = None) -> None:
        page_index, within = divmod(slot.offset, self.page_bytes)
        if self._allocator.page_slot_bytes(page_index) != slot.nbytes or (within - HEADER_BYTES) % slot.nbytes:
            raise InvalidArgument(f"{slot} is not a slot of this NVMe tier.")
        if meta is None:
            return
        if (
            len(meta.namespace) != HASH_BYTES
            or len(meta.block_hash) != HASH_BYTES
            or (meta.parent_hash is not None and len(meta.parent_hash) != HASH_BYTES)
        ):
            raise InvalidArgument(f"A block's namespace and hashes are {HASH_BYTES} bytes each; got {meta}.")
        if self.slot_bytes_for(meta.nbytes) != slot.nbytes:
            raise BlockSizeMismatch(
                f"A {meta.nbytes}-byte block takes a {self.slot_bytes_for(meta.nbytes)}-byte slot, not "
                f"{slot.nbytes}; allocate its slot with allocate(meta.nbytes)."
            )

    def _read_verified(self, slot: Slot, out: np.ndarray, meta: BlockMeta) -> str | None:
        """Read the block in ``slot`` into ``out``; None when it verified, else what was wrong."""
        trailer_buffer = self._files.header_buffer()
        area_bytes = slot.nbytes - TRAILER_BYTES
        # a raw payload fills the area before its trailer, so one read fetches both;
        # with compression on, the trailer says how much to read
        data_read = self.config.compression == "none"
        if data_read:
            self._files.read_slot(slot.offset, out, area_bytes, trailer_buffer)
        else:
            self._files.read(slot.offset + area_bytes, [trailer_buffer])
        trailer = decode_slot_trailer(trailer_buffer)
        if trailer is None:
            return "has no valid trailer (never written, torn, or overwritten)"
        if trailer.meta != meta:
            return f"holds another block ({trailer.meta.block_hash.hex()}) than the one asked for"
        if not trailer.fits(slot.offset, slot.nbytes):
            return "has a trailer whose lengths do not fit the slot"
        if trailer.compressed:
            stored = self._files.read_scratch(slot.offset, trailer.stored_len)
            if not self._codec.decode(trailer.flags, memoryview(stored), out):
                return "does not decompress to its recorded length"
        elif not data_read:
            self._files.read_slot(slot.offset, out, area_bytes, None)
        if xxhash.xxh3_64_intdigest(out) != trailer.payload_checksum:
            return "failed its checksum"
        return None

    def _write_page_header(self, slot: Slot) -> None:
        page_index = slot.offset // self.page_bytes
        if self._page_header_slot_bytes.get(page_index) == slot.nbytes:
            return
        with self._page_header_lock:
            if self._page_header_slot_bytes.get(page_index) == slot.nbytes:
                return
            with self._lock:
                seq = self._next_seq
                self._next_seq += 1
            buffer = self._files.header_buffer()
            encode_page_header(PageHeader(page_index, self.page_bytes, slot.nbytes, seq), buffer)
            self._files.write(page_index * self.page_bytes, [buffer])
            if self.config.sync_writes:
                self._files.sync(page_index * self.page_bytes)
            self._page_header_slot_bytes[page_index] = slot.nbytes

    def _clear_trailer(self, slot: Slot) -> bool:
        """Zero the slot's trailer; when that fails, remember to before its next write."""
        try:
            self._files.write(slot.offset + slot.nbytes - TRAILER_BYTES, [self._files.zeros])
        except OSError:
            with self._lock:
                self._uncleared.add(slot)
            return False
        with self._lock:
            self._uncleared.discard(slot)
        return True


def _flat_bytes(tensor: torch.Tensor, meta: BlockMeta, name: str) -> np.ndarray:
    if (
        not isinstance(tensor, torch.Tensor)
        or tensor.dtype != torch.uint8
        or tensor.device.type != "cpu"
        or tensor.dim() != 1
        or not tensor.is_contiguous()
    ):
        raise InvalidArgument(f"{name} must be a flat, contiguous torch.uint8 CPU tensor.")
    if tensor.numel() != meta.nbytes:
        raise BlockSizeMismatch(f"{name} holds {tensor.numel()} bytes but the block has {meta.nbytes}.")
    return tensor.numpy()
