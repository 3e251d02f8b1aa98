"""The NVMe tier's on-disk format: page headers, slot trailers and payload encoding.

A tier's address space is cut into pages (``page_bytes``); the pages are laid end to end
over the slot files, ``file_bytes`` per file, so a page never straddles two files::

    page  = [page header, 4 KiB][slot][slot] … (unused tail)
    slot  = [stored bytes, zero-padded to the slot's data area][slot trailer, 4 KiB]

The data area is the block's size rounded up to 4 KiB, so a raw block fills it and the
trailer sits at ``slot_offset + slot_bytes - 4096``. The trailer is the slot's commit
record and comes after the bytes it describes, so that one write in offset order puts it
last; and it carries the XXH3-64 of the data area's first 4 KiB (``head_checksum``), so
that a new write cut short over a reused slot, whose first bytes landed and whose trailer
did not, leaves the old trailer invalid at start without a zeroing write first
(``tiers/nvme.py`` says why both matter). A restart reads each trailer with the next
slot's head in one 8 KiB read (the first slot's head comes with the page header).

Both records are fixed little-endian ``struct`` records (never pickle) at the start of a
zero-padded 4 KiB block, and each ends with the XXH3-64 of the bytes before it:

    page header   magic "KVPG", version u16, reserved u16, page_index u64, page_bytes u64,
                  slot_bytes u64 (the size class the page is carved into), seq u64,
                  checksum u64
    slot trailer  magic "KVST", version u16, flags u16, namespace 16s, block_hash 16s,
                  parent_hash 16s (zeros and FLAG_NO_PARENT when None), slot_offset u64,
                  payload_len u64 (original bytes), stored_len u64 (bytes on disk),
                  payload_checksum u64 (XXH3-64 of the original bytes), seq u64,
                  head_checksum u64 (XXH3-64 of the data area's first 4 KiB as written,
                  zero padding included), checksum u64

``slot_offset`` and ``page_index`` name the place the record was written for, so a record
that lands somewhere else (a misdirected write) never validates. ``seq`` orders writes:
when a restart finds the same block twice, the newer copy wins; and a page header takes a
fresh ``seq`` each time its page is carved, so a trailer older than its page header is
left over from an earlier carving.

Payloads are stored raw or, with FLAG_ZSTD, zstd-compressed; FLAG_SHUFFLE2 means the
bytes were shuffled before compression (all low bytes of the 2-byte elements, then all
high bytes), which groups the exponent bytes of fp16/bf16 values so zstd finds them.
Changing any record is a format change: bump FORMAT_VERSION. Version 1 had the slot
record in front of the data, version 2 no head checksum; pages of another version are
ignored at start (their space is carved afresh).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np
import xxhash
import zstandard

from kvstore.errors import InvalidArgument
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.tiers.base import BlockMeta

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "TRAILER_BYTES",
    "HEAD_BYTES",
    "FLAG_ZSTD",
    "FLAG_SHUFFLE2",
    "FLAG_NO_PARENT",
    "SlotTrailer",
    "PageHeader",
    "encode_slot_trailer",
    "decode_slot_trailer",
    "looks_like_slot_trailer",
    "encode_page_header",
    "head_checksum",
    "decode_page_header",
    "newest_copies",
    "PayloadCodec",
]

FORMAT_VERSION = 3
HEADER_BYTES = 4096
TRAILER_BYTES = 4096
HEAD_BYTES = 4096  # the part of a slot's data area its trailer's head_checksum covers

FLAG_ZSTD = 1
FLAG_SHUFFLE2 = 2
FLAG_NO_PARENT = 4

_SLOT_MAGIC = b"KVST"
_PAGE_MAGIC = b"KVPG"
_SLOT = struct.Struct(f"<4sHH{HASH_BYTES}s{HASH_BYTES}s{HASH_BYTES}sQQQQQQ")
_PAGE = struct.Struct("<4sHHQQQQ")
_CHECKSUM = struct.Struct("<Q")
_NO_PARENT = bytes(HASH_BYTES)

Place = TypeVar("Place")


@dataclass(frozen=True, slots=True)
class SlotTrailer:
    meta: BlockMeta
    slot_offset: int
    stored_len: int
    payload_checksum: int
    seq: int
    flags: int
    head_checksum: int

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)

    def fits(self, slot_offset: int, slot_bytes: int) -> bool:
        """Whether this (checksummed) trailer can be that of the slot at ``slot_offset``: it
        names that slot, its block takes ``slot_bytes`` (which rejects a trailer left in the
        page by an earlier size class), and its lengths agree with its flags (raw bytes are
        stored whole, compressed ones shrink)."""
        nbytes = self.meta.nbytes
        if self.slot_offset != slot_offset or nbytes <= 0 or slot_bytes != TRAILER_BYTES + _units(nbytes) * 4096:
            return False
        if self.compressed:
            return 0 < self.stored_len < nbytes
        return self.stored_len == nbytes and not self.flags & FLAG_SHUFFLE2


class PageHeader(NamedTuple):
    page_index: int
    page_bytes: int
    slot_bytes: int
    seq: int


def encode_slot_trailer(trailer: SlotTrailer, out: memoryview) -> None:
    """Write ``trailer`` into the first bytes of ``out`` and zero the rest of it. A hash of
    another length than HASH_BYTES is refused (InvalidArgument): struct would pad or cut
    it silently, and the record would name another block."""
    meta = trailer.meta
    for name, value in (("namespace", meta.namespace), ("block_hash", meta.block_hash), ("parent_hash", meta.parent_hash)):
        if value is not None and len(value) != HASH_BYTES:
            raise InvalidArgument(f"a slot trailer's {name} must be {HASH_BYTES} bytes, got {len(value)}; the block is not recorded.")
    flags = trailer.flags | (FLAG_NO_PARENT if meta.parent_hash is None else 0)
    record = _SLOT.pack(
        _SLOT_MAGIC,
        FORMAT_VERSION,
        flags,
        meta.namespace,
        meta.block_hash,
        _NO_PARENT if meta.parent_hash is None else meta.parent_hash,
        trailer.slot_offset,
        meta.nbytes,
        trailer.stored_len,
        trailer.payload_checksum,
        trailer.seq,
        trailer.head_checksum,
    )
    _write_record(record, out)


def looks_like_slot_trailer(buf: memoryview) -> bool:
    """True when ``buf`` starts with the slot magic, valid or not: something was written there."""
    return bytes(buf[: len(_SLOT_MAGIC)]) == _SLOT_MAGIC


def decode_slot_trailer(buf: memoryview) -> SlotTrailer | None:
    """The trailer in ``buf``, or None when there is none or it is torn or corrupt."""
    record = _checked_record(buf, _SLOT, _SLOT_MAGIC)
    if record is None:
        return None
    _, _, flags, namespace, block_hash, parent, offset, payload_len, stored_len, checksum, seq, head = record
    meta = BlockMeta(
        namespace=namespace,
        block_hash=BlockHash(block_hash),
        parent_hash=None if flags & FLAG_NO_PARENT else BlockHash(parent),
        nbytes=payload_len,
    )
    return SlotTrailer(meta, offset, stored_len, checksum, seq, flags & ~FLAG_NO_PARENT, head)


def head_checksum(stored: np.ndarray) -> int:
    """XXH3-64 of the first 4 KiB a slot's data area gets when ``stored`` (flat uint8) is
    written there zero-padded: what a trailer's ``head_checksum`` must match."""
    head = stored[:HEAD_BYTES]
    if head.size < HEAD_BYTES:
        return xxhash.xxh3_64_intdigest(head.tobytes() + bytes(HEAD_BYTES - head.size))
    return xxhash.xxh3_64_intdigest(head)


def encode_page_header(header: PageHeader, out: memoryview) -> None:
    record = _PAGE.pack(_PAGE_MAGIC, FORMAT_VERSION, 0, header.page_index, header.page_bytes, header.slot_bytes, header.seq)
    _write_record(record, out)


def decode_page_header(buf: memoryview) -> PageHeader | None:
    record = _checked_record(buf, _PAGE, _PAGE_MAGIC)
    if record is None:
        return None
    _, _, _, page_index, page_bytes, slot_bytes, seq = record
    return PageHeader(page_index, page_bytes, slot_bytes, seq)


def newest_copies(found: Iterable[tuple[Place, SlotTrailer]]) -> tuple[list[tuple[Place, SlotTrailer]], list[Place]]:
    """(the newest copy of each block, the places of older copies) among valid trailers."""
    newest: dict[tuple[bytes, bytes], tuple[Place, SlotTrailer]] = {}
    older: list[Place] = []
    for place, trailer in sorted(found, key=lambda copy: copy[1].seq):
        replaced = newest.pop((trailer.meta.namespace, trailer.meta.block_hash), None)
        if replaced is not None:
            older.append(replaced[0])
        newest[(trailer.meta.namespace, trailer.meta.block_hash)] = (place, trailer)
    return list(newest.values()), older


def _write_record(record: bytes, out: memoryview) -> None:
    end = len(record) + _CHECKSUM.size
    out[: len(record)] = record
    out[len(record) : end] = _CHECKSUM.pack(xxhash.xxh3_64_intdigest(record))
    out[end:HEADER_BYTES] = bytes(HEADER_BYTES - end)


def _checked_record(buf: memoryview, layout: struct.Struct, magic: bytes) -> tuple | None:
    raw = bytes(buf[: layout.size + _CHECKSUM.size])
    if len(raw) < layout.size + _CHECKSUM.size or raw[: len(magic)] != magic:
        return None
    (checksum,) = _CHECKSUM.unpack_from(raw, layout.size)
    if checksum != xxhash.xxh3_64_intdigest(raw[: layout.size]):
        return None
    record = layout.unpack_from(raw)
    return record if record[1] == FORMAT_VERSION else None


class PayloadCodec:
    """zstd with a 2-byte shuffle. zstd contexts are not thread-safe, so each I/O thread
    keeps its own."""

    def __init__(self, level: int) -> None:
        self._level = level
        self._local = threading.local()

    def encode(self, payload: np.ndarray) -> tuple[int, np.ndarray]:
        """(flags, stored bytes): compressed when that saves at least one 4 KiB I/O unit,
        since a smaller tail inside the same unit costs a decompression and saves nothing."""
        compressed = self._compressor().compress(_shuffle2(payload))
        if _units(len(compressed)) >= _units(payload.size):
            return 0, payload
        return FLAG_ZSTD | FLAG_SHUFFLE2, np.frombuffer(compressed, dtype=np.uint8)

    def decode(self, flags: int, stored: memoryview, out: np.ndarray) -> bool:
        """Decompress ``stored`` into ``out``; False when it does not decode to exactly
        ``out.size`` bytes."""
        try:
            # the frame's own size field is not covered by any checksum: bound it before
            # zstd allocates what a corrupt frame claims
            if zstandard.frame_content_size(stored) != out.size:
                return False
            raw = self._decompressor().decompress(stored, max_output_size=out.size)
        except zstandard.ZstdError:
            return False
        if len(raw) != out.size:
            return False
        data = np.frombuffer(raw, dtype=np.uint8)
        if flags & FLAG_SHUFFLE2:
            _unshuffle2(data, out)
        else:
            out[:] = data
        return True

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(level=self._level)
        return compressor

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        return decompressor


def _units(nbytes: int) -> int:
    """4 KiB I/O units that ``nbytes`` take."""
    return (nbytes + 4095) // 4096


def _shuffle2(data: np.ndarray) -> np.ndarray:
    half = data.size // 2
    out = np.empty_like(data)
    out[:half] = data[0 : 2 * half : 2]
    out[half : 2 * half] = data[1 : 2 * half : 2]
    out[2 * half :] = data[2 * half :]
    return out


def _unshuffle2(data: np.ndarray, out: np.ndarray) -> None:
    half = data.size // 2
    out[0 : 2 * half : 2] = data[:half]
    out[1 : 2 * half : 2] = data[half : 2 * half]
    out[2 * half :] = data[2 * half :]
