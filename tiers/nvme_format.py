"""The NVMe tier's on-disk format: page headers, slot headers and payload encoding.

A tier's address space is cut into pages (``page_bytes``); the pages are laid end to end
over the slot files, ``file_bytes`` per file, so a page never straddles two files::

    page  = [page header, 4 KiB][slot][slot] … (unused tail)
    slot  = [slot header, 4 KiB][stored bytes, padded to 4 KiB]

Both headers are fixed little-endian ``struct`` records (never pickle) at the start of a
zero-padded 4 KiB block, and each ends with the XXH3-64 of the bytes before it:

    page header  magic "KVPG", version u16, reserved u16, page_index u64, page_bytes u64,
                 slot_bytes u64 (the size class the page is carved into), checksum u64
    slot header  magic "KVSB", version u16, flags u16, namespace 16s, block_hash 16s,
                 parent_hash 16s (zeros and FLAG_NO_PARENT when None), slot_offset u64,
                 payload_len u64 (original bytes), stored_len u64 (bytes on disk),
                 payload_checksum u64 (XXH3-64 of the original bytes), seq u64,
                 checksum u64

``slot_offset`` and ``page_index`` name the place the header was written for, so a header
that lands somewhere else (a misdirected write) never validates. ``seq`` orders writes:
when a restart finds the same block twice, the newer copy wins.

Payloads are stored raw or, with FLAG_ZSTD, zstd-compressed; FLAG_SHUFFLE2 means the
bytes were shuffled before compression (all low bytes of the 2-byte elements, then all
high bytes), which groups the exponent bytes of fp16/bf16 values so zstd finds them.
Changing any record is a format change: bump FORMAT_VERSION.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash
import zstandard

from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.tiers.base import BlockMeta

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "FLAG_ZSTD",
    "FLAG_SHUFFLE2",
    "FLAG_NO_PARENT",
    "SlotHeader",
    "PageHeader",
    "encode_slot_header",
    "decode_slot_header",
    "looks_like_slot_header",
    "encode_page_header",
    "decode_page_header",
    "PayloadCodec",
]

FORMAT_VERSION = 1
HEADER_BYTES = 4096

FLAG_ZSTD = 1
FLAG_SHUFFLE2 = 2
FLAG_NO_PARENT = 4

_SLOT_MAGIC = b"KVSB"
_PAGE_MAGIC = b"KVPG"
_SLOT = struct.Struct(f"<4sHH{HASH_BYTES}s{HASH_BYTES}s{HASH_BYTES}sQQQQQ")
_PAGE = struct.Struct("<4sHHQQQ")
_CHECKSUM = struct.Struct("<Q")
_NO_PARENT = bytes(HASH_BYTES)


@dataclass(frozen=True, slots=True)
class SlotHeader:
    meta: BlockMeta
    slot_offset: int
    stored_len: int
    payload_checksum: int
    seq: int
    flags: int

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)

    def is_consistent(self) -> bool:
        """Lengths agree with the flags: raw bytes are stored whole, compressed ones shrink."""
        if self.meta.nbytes <= 0 or self.stored_len <= 0:
            return False
        if self.compressed:
            return self.stored_len < self.meta.nbytes
        return self.stored_len == self.meta.nbytes and not self.flags & FLAG_SHUFFLE2


class PageHeader(NamedTuple):
    page_index: int
    page_bytes: int
    slot_bytes: int


def encode_slot_header(header: SlotHeader, out: memoryview) -> None:
    """Write ``header`` into the first bytes of ``out`` and zero the rest of it."""
    meta = header.meta
    flags = header.flags | (FLAG_NO_PARENT if meta.parent_hash is None else 0)
    record = _SLOT.pack(
        _SLOT_MAGIC,
        FORMAT_VERSION,
        flags,
        meta.namespace,
        meta.block_hash,
        _NO_PARENT if meta.parent_hash is None else meta.parent_hash,
        header.slot_offset,
        meta.nbytes,
        header.stored_len,
        header.payload_checksum,
        header.seq,
    )
    _write_record(record, out)


def looks_like_slot_header(buf: memoryview) -> bool:
    """True when ``buf`` starts with the slot magic, valid or not: something was written there."""
    return bytes(buf[: len(_SLOT_MAGIC)]) == _SLOT_MAGIC


def decode_slot_header(buf: memoryview) -> SlotHeader | None:
    """The header in ``buf``, or None when there is none or it is torn or corrupt."""
    record = _checked_record(buf, _SLOT, _SLOT_MAGIC)
    if record is None:
        return None
    _, _, flags, namespace, block_hash, parent, offset, payload_len, stored_len, checksum, seq = record
    meta = BlockMeta(
        namespace=namespace,
        block_hash=BlockHash(block_hash),
        parent_hash=None if flags & FLAG_NO_PARENT else BlockHash(parent),
        nbytes=payload_len,
    )
    return SlotHeader(meta, offset, stored_len, checksum, seq, flags & ~FLAG_NO_PARENT)


def encode_page_header(header: PageHeader, out: memoryview) -> None:
    record = _PAGE.pack(_PAGE_MAGIC, FORMAT_VERSION, 0, header.page_index, header.page_bytes, header.slot_bytes)
    _write_record(record, out)


def decode_page_header(buf: memoryview) -> PageHeader | None:
    record = _checked_record(buf, _PAGE, _PAGE_MAGIC)
    if record is None:
        return None
    _, _, _, page_index, page_bytes, slot_bytes = record
    return PageHeader(page_index, page_bytes, slot_bytes)


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
    return (nbytes + HEADER_BYTES - 1) // HEADER_BYTES


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
