"""The transport's wire format: one fixed binary header per message, then its payload.

    offset size field
    0      4    magic b"KVST"
    4      1    version (WIRE_VERSION)
    5      1    kind: CONTROL (msgpack payload), BLOCK (block bytes), ERROR (msgpack), END,
                AUTH (the handshake every channel starts with: transport/auth.py)
    6      2    flags (reserved, 0)
    8      8    transfer id: every message of one fetch, push or handoff carries it
    16     16   namespace digest
    32     16   block key (chain hash); zeros for non-block messages
    48     4    payload length in bytes
    52     2    first layer of the payload
    54     2    number of layers in the payload (0: the whole block)
    56     4    sequence: the block's position in its transfer
    60     8    XXH3-64 of the payload
    68     8    counter: how many frames the sender sent on this channel before this one
    76     16   MAC: the AES-256-GCM tag of bytes 0…75 and the payload under the channel's
                session key, on a channel sealed by a fleet secret without TLS; zeros otherwise
    92     4    XXH32 of bytes 0…91 (a torn or forged header is refused before its
                length is trusted)

All integers little-endian; 96 bytes in all. No pickle: control and error payloads are
msgpack. A receiver checks the header checksum, the magic, the version and the length
bound before it posts a receive of ``length`` bytes, and the payload checksum before the
block is committed: a frame that fails any check is dropped and counted, never stored.
The checksum guards against corruption, the MAC against a forger: XXH3 is no MAC, so on
a channel that TLS does not protect a block counts only once its MAC verified too, and a
counter out of order (a replayed, dropped or reordered frame) breaks the channel.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from kvstore.errors import CorruptBlock, InvalidArgument

__all__ = [
    "WIRE_VERSION",
    "HEADER_BYTES",
    "MAX_PAYLOAD_BYTES",
    "MAX_CONTROL_BYTES",
    "NO_KEY",
    "NO_MAC",
    "MAC_BYTES",
    "FrameKind",
    "FrameHeader",
    "block_header",
    "control_header",
    "encode_control",
    "decode_control",
    "payload_checksum",
]

MAGIC = b"KVST"
WIRE_VERSION = 2
MAX_PAYLOAD_BYTES = 1 << 30  # a block larger than 1 GiB is a bug, not a workload
# the largest request or reply: a hot-chain list of ~1M blocks; the handshake before it
# allows far less (transport/auth.py), so an unauthenticated peer cannot make a daemon
# set aside more than a few KiB
MAX_CONTROL_BYTES = 16 << 20
NO_KEY = bytes(16)
MAC_BYTES = 16
NO_MAC = bytes(MAC_BYTES)
_SIGNED = struct.Struct("<4sBBHQ16s16sIHHIQQ")  # what the MAC covers, with the payload
_CHECK = struct.Struct("<I")  # after the MAC: the header's own checksum
HEADER_BYTES = _SIGNED.size + MAC_BYTES + _CHECK.size
assert HEADER_BYTES == 96


class FrameKind(enum.IntEnum):
    CONTROL = 1  # a request or reply: msgpack map
    BLOCK = 2  # block bytes (a whole block, or a layer range of it)
    ERROR = 3  # msgpack [error kind, sentence]; ends the transfer it names
    END = 4  # the sender has nothing more for this transfer; msgpack summary
    AUTH = 5  # a handshake message (transport/auth.py): before it completes, nothing else is served


@dataclass(frozen=True, slots=True)
class FrameHeader:
    kind: FrameKind
    transfer_id: int
    namespace: bytes = NO_KEY
    key: bytes = NO_KEY
    length: int = 0
    first_layer: int = 0
    num_layers: int = 0
    sequence: int = 0
    checksum: int = 0
    counter: int = 0
    mac: bytes = NO_MAC

    def signed_part(self) -> bytes:
        """The header's bytes that a frame's MAC covers (all but the MAC and the check)."""
        return _SIGNED.pack(
            MAGIC, WIRE_VERSION, self.kind, 0, self.transfer_id, self.namespace, self.key,
            self.length, self.first_layer, self.num_layers, self.sequence, self.checksum, self.counter,
        )  # fmt: skip

    def pack(self) -> bytes:
        body = self.signed_part() + self.mac
        return body + _CHECK.pack(xxhash.xxh32_intdigest(body))

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> FrameHeader:
        """Parse and check a header; CorruptBlock if anything about it is wrong."""
        if len(data) != HEADER_BYTES:
            raise CorruptBlock(f"a frame header is {HEADER_BYTES} bytes, got {len(data)}.")
        body = bytes(data[: HEADER_BYTES - _CHECK.size])
        (check,) = _CHECK.unpack_from(data, HEADER_BYTES - _CHECK.size)
        if xxhash.xxh32_intdigest(body) != check:
            raise CorruptBlock("a frame header failed its checksum; the stream is out of step or corrupt.")
        fields = _SIGNED.unpack_from(body)
        magic, version, kind, _flags, transfer_id, namespace, key, length, first, count, sequence, checksum, counter = fields
        mac = body[_SIGNED.size :]
        if magic != MAGIC:
            raise CorruptBlock(f"a frame started with {magic!r}, not {MAGIC!r}; the peer is not a kvstore transport.")
        if version != WIRE_VERSION:
            raise CorruptBlock(f"the peer speaks transport wire version {version}, this node {WIRE_VERSION}; upgrade one of them.")
        try:
            kind = FrameKind(kind)
        except ValueError:
            raise CorruptBlock(f"unknown frame kind {kind}.") from None
        bound = MAX_PAYLOAD_BYTES if kind is FrameKind.BLOCK else MAX_CONTROL_BYTES
        if length > bound:
            raise CorruptBlock(f"a {kind.name} frame announced {length} bytes, over the {bound}-byte bound.")
        return cls(kind, transfer_id, namespace, key, length, first, count, sequence, checksum, counter, mac)

    def verify(self, payload: bytes | bytearray | memoryview) -> None:
        """CorruptBlock unless ``payload`` is the bytes this header announced."""
        if len(payload) != self.length:
            raise CorruptBlock(f"a frame announced {self.length} bytes but {len(payload)} arrived.")
        if payload_checksum(payload) != self.checksum:
            raise CorruptBlock(f"block {self.key.hex()} failed its checksum in transit; it was dropped.")


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def block_header(
    transfer_id: int,
    namespace: bytes,
    key: bytes,
    payload: bytes | bytearray | memoryview,
    sequence: int,
    first_layer: int = 0,
    num_layers: int = 0,
    checksum: int | None = None,
) -> FrameHeader:
    """A BLOCK frame's header. ``checksum``: the XXH3-64 the block's writer committed, sent
    as is, so that bytes changed since are refused by the receiver; None: taken now."""
    checksum = payload_checksum(payload) if checksum is None else checksum
    return FrameHeader(FrameKind.BLOCK, transfer_id, namespace, key, len(payload), first_layer, num_layers, sequence, checksum)


def encode_control(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def control_header(kind: FrameKind, transfer_id: int, payload: bytes, namespace: bytes = NO_KEY) -> FrameHeader:
    return FrameHeader(kind, transfer_id, namespace, NO_KEY, len(payload), checksum=payload_checksum(payload))


def decode_control(header: FrameHeader, payload: bytes) -> Any:
    """Verify and decode a CONTROL, ERROR or END payload."""
    header.verify(payload)
    try:
        return msgpack.unpackb(payload, raw=False, max_bin_len=MAX_CONTROL_BYTES, max_str_len=1 << 20)
    except (ValueError, msgpack.UnpackException) as exc:
        raise InvalidArgument(f"a {header.kind.name} frame's payload is not valid msgpack: {exc}.") from exc
