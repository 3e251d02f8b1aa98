"""The NVMe tier: block bytes in preallocated slot files that survive a restart.

The tier's files (``tiers/nvme_files.py``) hold pages of ``page_bytes`` laid end to end.
Each page starts with a 4 KiB page header naming the slot size it is carved into; each
slot is a 4 KiB slot header followed by the stored bytes padded to 4 KiB. The records
are described in ``tiers/nvme_format.py``.

Write order for one block, and why the header goes last:

1. one ``pwritev`` puts a zeroed slot header and the stored bytes into the slot, so
   whatever header an earlier occupant left is gone before any new byte lands;
2. ``fdatasync`` (``sync_writes``) makes those bytes durable;
3. the slot header is written last.

A process killed anywhere before step 3 completes leaves a zero or torn header, which
fails its checksum, so the restart drops the slot: a header that validates always
describes bytes that reached the file. Before the first slot of a newly assigned page is
written, its page header is written and synced, so a restart knows where that page's
slot headers are. ``free`` zeroes the slot header so a freed block is not resurrected.
Nothing syncs after step 3: a power loss may lose the newest blocks (a miss), never
expose torn bytes, because every read checks the header against the caller's
``BlockMeta`` and the payload against its XXH3-64.

Threads: ``allocate``, ``free`` and ``stats`` belong to the owner (the tier manager);
``write`` and ``read`` may run at once on distinct slots, from the tier's own pool
(``submit_write`` / ``submit_read``) or any other thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvstore.errors import BlockSizeMismatch, CorruptBlock, InvalidArgument, TierUnavailable
from kvstore.hashing import HASH_BYTES
from kvstore.tiers.base import BlockMeta, Tier, TierKind, TierStats
from kvstore.tiers.nvme_files import IO_ALIGN, SlotFiles
from kvstore.tiers.nvme_format import (
    HEADER_BYTES,
    PageHeader,
    PayloadCodec,
    SlotHeader,
    decode_page_header,
    decode_slot_header,
    encode_page_header,
    encode_slot_header,
    looks_like_slot_header,
)
from kvstore.tiers.slab import SlabAllocator, Slot

__all__ = ["NvmeTierConfig", "NvmeTier"]

logger = logging.getLogger(__name__)

# Linux moves at most 2 GiB - 4 KiB per read or write call; a slot must fit in one.
_MAX_PAGE_BYTES = 1 << 30

# (slot, meta, XXH3-64 of the payload) for each block found intact at start
Recovered = tuple[Slot, BlockMeta, int]


@dataclass(frozen=True, slots=True)
class NvmeTierConfig:
    """``capacity_bytes`` and ``file_bytes`` are used in whole pages (rounded down); a
    block must fit in one page with its 4 KiB slot header and the page's 4 KiB header.
    ``sync_writes`` syncs each block's bytes before its header is written: without it a
    crash of the machine (not of the process) may leave a header over bytes that never
    reached the disk, which reads then reject as corrupt."""

    directory: Path
    capacity_bytes: int
    page_bytes: int = 64 << 20
    file_bytes: int = 1 << 30
    compression: str = "none"
    compression_level: int = 3
    direct_io: bool = True
    sync_writes: bool = True
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
                f"NvmeTierConfig.page_bytes must be a multiple of {IO_ALIGN} between {3 * IO_ALIGN} and "
                f"{_MAX_PAGE_BYTES}, got {self.page_bytes}."
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
            raise InvalidArgument(
                f"NvmeTierConfig.compression_level must lie in [1, 22], got {self.compression_level}."
            )
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
        self.bytes_in = 0
        self.bytes_stored = 0
        # _lock guards the allocator, the counters and _next_seq; _page_header_lock
        # serialises page-header writes, which hold it across an fdatasync
        self._lock = threading.Lock()
        self._page_header_lock = threading.Lock()
        self._codec = PayloadCodec(config.compression_level)
        self._files = SlotFiles(
            config.directory, self.requested_capacity_bytes // self.page_bytes, self.page_bytes,
            self.file_bytes, config.direct_io,
        )
        self.uses_direct_io = self._files.uses_direct_io
        self.capacity_bytes = self._files.num_pages * self.page_bytes
        self.sized_down = self.capacity_bytes < self.requested_capacity_bytes
        self._allocator = SlabAllocator(
            self.capacity_bytes, self.page_bytes, alignment=IO_ALIGN, page_header_bytes=HEADER_BYTES
        )
        # page index -> the slot size its on-disk page header names
        self._page_header_slot_bytes: dict[int, int] = {}
        self._next_seq = 1
        self._executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-nvme")
        try:
            self._recovered = self._rebuild()
        except BaseException:
            self.close()
            raise

    # -- the Tier interface ---------------------------------------------------------
    def slot_bytes_for(self, nbytes: int) -> int:
        """Slot bytes a block of ``nbytes`` takes: its header plus the payload rounded up
        to 4 KiB. Compression shrinks the I/O, never the slot (slots are allocated first)."""
        if nbytes <= 0:
            raise InvalidArgument(f"a block must have at least one byte, got {nbytes}.")
        return self._allocator.slot_bytes_for(HEADER_BYTES + nbytes)

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
        return slot

    def free(self, slot: Slot) -> None:
        self._check_slot(slot)
        if not self._zero_header(slot):
            # the block may come back after a restart; every read still verifies it
            with self._lock:
                self.num_write_errors += 1
            logger.warning(
                "Could not clear the NVMe slot header at %d in %s.", slot.offset, self._files.path_of(slot.offset)
            )
        with self._lock:
            self._allocator.free(slot)
            self.num_blocks -= 1

    def write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> None:
        payload = _flat_bytes(src, meta, "src")
        self._check_slot(slot, meta)
        checksum = xxhash.xxh3_64_intdigest(payload)
        flags, stored = self._codec.encode(payload) if self.config.compression == "zstd" else (0, payload)
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
        try:
            self._write_page_header(slot)
            self._files.write(slot.offset, [self._files.zeros], stored)
            if self.config.sync_writes:
                self._files.sync(slot.offset)
            header = self._files.header_buffer()
            encode_slot_header(SlotHeader(meta, slot.offset, stored.size, checksum, seq, flags), header)
            self._files.write(slot.offset, [header])
        except OSError as exc:
            with self._lock:
                self.num_write_errors += 1
            self._zero_header(slot)
            raise TierUnavailable(
                f"Writing a block to {self._files.path_of(slot.offset)} failed ({exc.strerror or exc}); "
                "check that disk's health and free space."
            ) from exc
        with self._lock:
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
                f"Reading a block from {self._files.path_of(slot.offset)} failed ({exc.strerror or exc}); "
                "check that disk's health."
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
        """Blocks whose slot header verified at start (and their bytes, with
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
                f"Reading the NVMe tier's headers in {self.config.directory} failed ({exc.strerror or exc}); "
                "check that disk's health, or move the directory aside to start empty."
            ) from exc
        newest: dict[tuple[bytes, bytes], tuple[Slot, SlotHeader]] = {}
        dropped: list[Slot] = []
        for page_index, page_slot_bytes, found, unusable in scans:
            if page_slot_bytes is not None:
                self._page_header_slot_bytes[page_index] = page_slot_bytes
            dropped += unusable
            for slot, header in found:
                self._next_seq = max(self._next_seq, header.seq + 1)
                key = (header.meta.namespace, header.meta.block_hash)
                kept = newest.get(key)
                if kept is not None and kept[1].seq > header.seq:
                    dropped.append(slot)
                    continue
                if kept is not None:
                    dropped.append(kept[0])
                newest[key] = (slot, header)
        # zero what is dropped, so that it cannot come back once the copy kept is freed
        for slot in dropped:
            self._zero_header(slot)
        offsets_by_page: dict[int, list[int]] = defaultdict(list)
        for slot, _ in newest.values():
            offsets_by_page[slot.offset // self.page_bytes].append(slot.offset)
        for page_index, offsets in offsets_by_page.items():
            self._allocator.restore_page(page_index, self._page_header_slot_bytes[page_index], offsets)
        self.num_dropped_at_start = len(dropped)
        self.num_blocks = self.num_recovered = len(newest)
        recovered = [(slot, header.meta, header.payload_checksum) for slot, header in newest.values()]
        return sorted(recovered, key=lambda entry: entry[0].offset)

    def _scan_page(self, page_index: int) -> tuple[int, int | None, list[tuple[Slot, SlotHeader]], list[Slot]]:
        """(page, slot size its header names, slots with a valid header, slots to drop)."""
        buffer = self._files.header_buffer()
        self._files.read(page_index * self.page_bytes, [buffer])
        page = decode_page_header(buffer)
        if page is None or page.page_index != page_index or page.page_bytes != self.page_bytes:
            return page_index, None, [], []
        slot_bytes = page.slot_bytes
        if slot_bytes % IO_ALIGN or not 2 * IO_ALIGN <= slot_bytes <= self.page_bytes - HEADER_BYTES:
            return page_index, None, [], []
        found: list[tuple[Slot, SlotHeader]] = []
        unusable: list[Slot] = []
        first = page_index * self.page_bytes + HEADER_BYTES
        for offset in range(first, first + self._allocator.slots_per_page(slot_bytes) * slot_bytes, slot_bytes):
            slot = Slot(offset, slot_bytes)
            self._files.read(offset, [buffer])
            header = decode_slot_header(buffer)
            if header is None:
                if looks_like_slot_header(buffer):  # torn or corrupt, not merely empty
                    unusable.append(slot)
                continue
            if not self._fits(header, slot) or (
                self.config.verify_on_start
                and self._read_verified(slot, np.empty(header.meta.nbytes, np.uint8), header.meta) is not None
            ):
                unusable.append(slot)
                continue
            found.append((slot, header))
        return page_index, slot_bytes, found, unusable

    # -- slots and verification -----------------------------------------------------
    def _check_slot(self, slot: Slot, meta: BlockMeta | None = None) -> None:
        page_index, within = divmod(slot.offset, self.page_bytes)
        if self._allocator.page_slot_bytes(page_index) != slot.nbytes or (within - HEADER_BYTES) % slot.nbytes:
            raise InvalidArgument(f"{slot} is not a slot of this NVMe tier.")
        if meta is None:
            return
        if len(meta.namespace) != HASH_BYTES or len(meta.block_hash) != HASH_BYTES or (
            meta.parent_hash is not None and len(meta.parent_hash) != HASH_BYTES
        ):
            raise InvalidArgument(f"A block's namespace and hashes are {HASH_BYTES} bytes each; got {meta}.")
        if self.slot_bytes_for(meta.nbytes) != slot.nbytes:
            raise BlockSizeMismatch(
                f"A {meta.nbytes}-byte block takes a {self.slot_bytes_for(meta.nbytes)}-byte slot, not "
                f"{slot.nbytes}; allocate its slot with allocate(meta.nbytes)."
            )

    def _fits(self, header: SlotHeader, slot: Slot) -> bool:
        """Whether a checksummed header is plausible for ``slot``; this also rejects a
        header left under the page by an earlier size class."""
        if header.slot_offset != slot.offset or not header.is_consistent():
            return False
        try:
            return self.slot_bytes_for(header.meta.nbytes) == slot.nbytes
        except InvalidArgument:
            return False

    def _read_verified(self, slot: Slot, out: np.ndarray, meta: BlockMeta) -> str | None:
        """Read the block in ``slot`` into ``out``; None when it verified, else what was wrong."""
        header_buffer = self._files.header_buffer()
        # an uncompressed payload sits right after its header, so one read fetches both;
        # with compression on, the header says how much to read
        data_read = self.config.compression == "none"
        self._files.read(slot.offset, [header_buffer], out if data_read else None)
        header = decode_slot_header(header_buffer)
        if header is None:
            return "has no valid header (never written, torn, or overwritten)"
        if header.meta != meta:
            return f"holds another block ({header.meta.block_hash.hex()}) than the one asked for"
        if not self._fits(header, slot):
            return "has a header whose lengths do not fit the slot"
        if header.compressed:
            stored = self._files.read_scratch(slot.offset + HEADER_BYTES, header.stored_len)
            if not self._codec.decode(header.flags, memoryview(stored), out):
                return "does not decompress to its recorded length"
        elif not data_read:
            self._files.read(slot.offset + HEADER_BYTES, [], out)
        if xxhash.xxh3_64_intdigest(out) != header.payload_checksum:
            return "failed its checksum"
        return None

    def _write_page_header(self, slot: Slot) -> None:
        page_index = slot.offset // self.page_bytes
        if self._page_header_slot_bytes.get(page_index) == slot.nbytes:
            return
        with self._page_header_lock:
            if self._page_header_slot_bytes.get(page_index) == slot.nbytes:
                return
            buffer = self._files.header_buffer()
            encode_page_header(PageHeader(page_index, self.page_bytes, slot.nbytes), buffer)
            self._files.write(page_index * self.page_bytes, [buffer])
            if self.config.sync_writes:
                self._files.sync(page_index * self.page_bytes)
            self._page_header_slot_bytes[page_index] = slot.nbytes

    def _zero_header(self, slot: Slot) -> bool:
        try:
            self._files.write(slot.offset, [self._files.zeros])
        except OSError:
            return False
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
