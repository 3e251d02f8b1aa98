"""The engine ↔ daemon control protocol on the local Unix socket: frames and their fields.

Why not gRPC here: an engine asks for the cached prefix of every request it schedules,
and gRPC's Python stack costs ~0.5 ms a round trip before any work is done, more than the
budget for a 512-block lookup. This protocol is a length-prefixed msgpack frame each way,
with no copies of block bytes (those go through the shared-memory slab; only slot
offsets travel here).

Frame: ``uint32 little-endian length ‖ msgpack body``.

    request   [request id, op, arg, …]          request id 0: the client reads no answer
    reply     [request id, 0, result]
    error     [request id, 1, error kind, sentence]

Every reply carries the id of its request, so a client matches answers to questions
whatever order they come in, and a late answer to a call that timed out is recognised
(and what it granted given back) instead of being taken for the next call's. Block
hashes travel as one concatenated bytes string (16 bytes each), checksums as one bytes
string of little-endian uint64 (XXH3-64 of each block), tiers as one byte per block (the
tier's ``TierKind.rank``).

Bounds (DESIGN decision 9): a request frame is at most ``MAX_REQUEST_BYTES`` (a 65,536-
block request is 1 MiB of hashes), its arrays at most ``MAX_ARRAY_LEN`` long (the
largest is a namespace's 13 fields), and every argument is checked against the op's
signature before anything is done; an error sentence is at most ``MAX_SENTENCE_CHARS``
and never echoes more than a few bytes of what it refuses. Decoding costs at most what a
frame of that size holds: ~40 ms for the worst frame (a million nested one-byte
integers), which the server weighs by its size when it shares the loop (kvstore/
local_server.py).

Authorization is the socket's file mode (0600 or 0660): whoever may open it is trusted
like the engine's own process.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError, raise_error
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.layout import KVLayout
from kvstore.namespace import SALT_DIGEST_BYTES, Namespace, SaltDigest
from kvstore.tier_kind import TIER_BY_RANK, TierKind
from kvstore.version import LOCAL_PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_REQUEST_BYTES",
    "MAX_REPLY_BYTES",
    "MAX_SENTENCE_CHARS",
    "HEADER",
    "Op",
    "OP_NAMES",
    "SIGNATURES",
    "TIER_CODES",
    "TIERS_BY_CODE",
    "encode_request",
    "encode_reply",
    "encode_error",
    "decode_request",
    "decode_reply",
    "raise_reply_error",
    "checked_args",
    "error_of",
    "pack_hashes",
    "unpack_hashes",
    "checked_chain",
    "checked_digest",
    "checked_parent",
    "checked_text",
    "checked_count",
    "pack_handles",
    "pack_checksums",
    "unpack_checksums",
    "namespace_to_wire",
    "namespace_from_wire",
    "describe",
]

PROTOCOL_VERSION = LOCAL_PROTOCOL_VERSION
MAX_REQUEST_BYTES = 1024 * 1024 + 64 * 1024  # 65,536 block hashes and the rest of a request
MAX_REPLY_BYTES = 64 * 1024 * 1024
MAX_ARRAY_LEN = 16
MAX_SENTENCE_CHARS = 512
MAX_TEXT_CHARS = 1024
HEADER = struct.Struct("<I")
_CHECKSUM = np.dtype("<u8")


class Op:
    HELLO = 1
    REGISTER = 2
    LOOKUP = 3
    RESERVE = 4
    COMMIT = 5
    ABORT = 6
    ACQUIRE = 7
    RELEASE = 8
    FETCH = 9  # bring missing blocks from a peer (remote load)
    HANDOFF_SEND = 10
    HANDOFF_READY = 11
    HANDOFF_FINISH = 12
    HANDOFF_CANCEL = 13
    HANDOFF_RECEIVE = 14
    HANDOFF_WAIT = 15
    HANDOFF_CLOSE = 16
    LOOKUP_SHARDS = 17  # one lookup for the namespaces of several tensor-parallel ranks
    LOOKUP_HOLD = 18  # LOOKUP_SHARDS that keeps the blocks it reports from eviction until released
    HOLD_RELEASE = 19
    LOCATE = 20  # the peer holding the most of a chain past a prefix, for an engine that reads it itself
    FETCHED = 21  # what an engine read from a peer itself, for this node's transfer metrics


OP_NAMES: dict[int, str] = {value: name.lower() for name, value in vars(Op).items() if name.isupper()}

TIER_CODES: dict[TierKind, int] = {kind: kind.rank for kind in TierKind}
TIERS_BY_CODE: list[TierKind] = list(TIER_BY_RANK)


# -- frames ---------------------------------------------------------------------------------
def _frame(body: list) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def encode_request(request_id: int, op: int, args: Sequence[Any]) -> bytes:
    return _frame([request_id, op, *args])


def encode_reply(request_id: int, result: Any) -> bytes:
    return _frame([request_id, 0, result])


def encode_error(request_id: int, error: BaseException) -> bytes:
    kind, sentence = error_of(error)
    return _frame([request_id, 1, kind, sentence])


def error_of(error: BaseException) -> tuple[str, str]:
    """The (kind, sentence) an error travels as: kvstore's own by name, malformed input as
    InvalidArgument, anything else as an internal error; the sentence bounded."""
    if isinstance(error, KVStoreError):
        kind, sentence = type(error).__name__, str(error)
    elif isinstance(error, (TypeError, ValueError, msgpack.UnpackException)):
        kind, sentence = "InvalidArgument", f"malformed request: {error}."
    else:
        kind, sentence = "KVStoreError", f"internal error serving the request ({type(error).__name__}); the daemon's log has the details."
    if len(sentence) > MAX_SENTENCE_CHARS:
        sentence = sentence[: MAX_SENTENCE_CHARS - 1] + "…"
    return kind, sentence


def decode_request(body: bytes) -> tuple[int, int, list]:
    """(request id, op, args) of a request frame's body; InvalidArgument (carrying the
    request id as ``request_id`` where it could be read) when it is malformed."""
    try:
        request = msgpack.unpackb(
            body,
            raw=False,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_ARRAY_LEN,
            max_str_len=MAX_TEXT_CHARS * 4,
            max_bin_len=MAX_REQUEST_BYTES,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, TypeError or its own errors
        raise InvalidArgument(
            f"a request is one msgpack array [request id, op, args…]; this one does not decode ({type(exc).__name__})."
        ) from None
    if not isinstance(request, list) or len(request) < 2:
        raise InvalidArgument(f"a request is a msgpack array [request id, op, args…], got {describe(request)}.")
    request_id, op = request[0], request[1]
    if type(request_id) is not int or not 0 <= request_id < 1 << 64:
        raise InvalidArgument(f"a request id is an unsigned 64-bit integer, got {describe(request_id)}.")
    if type(op) is not int or op not in OP_NAMES:
        error = InvalidArgument(f"unknown op {describe(op)}; this daemon speaks protocol version {PROTOCOL_VERSION}.")
        error.request_id = request_id  # type: ignore[attr-defined]
        raise error
    return request_id, op, request[2:]


def decode_reply(body: bytes) -> list:
    reply = msgpack.unpackb(body, raw=False)
    if not isinstance(reply, list) or len(reply) < 3 or type(reply[0]) is not int:
        raise InvalidArgument("the daemon sent a reply this client cannot read; client and daemon versions disagree.")
    return reply


def raise_reply_error(reply: list) -> None:
    raise_error(str(reply[2]), str(reply[3]) if len(reply) > 3 else "")


def describe(value: Any) -> str:
    """A short description of a refused value: its type, and its size where it has one —
    never the value itself when it is large."""
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes" if len(value) > 16 else f"bytes {bytes(value).hex() or '(empty)'}"
    if isinstance(value, str):
        return f"a {len(value)}-character string" if len(value) > 32 else f"string {value!r}"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, (bool, int, float)) or value is None:
        return repr(value)[:40]
    return type(value).__name__


# -- fields -----------------------------------------------------------------------------------
def pack_hashes(hashes: Sequence[BlockHash]) -> bytes:
    return b"".join(hashes)


def checked_chain(blob: Any) -> bytes:
    """Block hashes as they travel, checked but left as one bytes string: a lookup probes
    them as they are (``Catalogue.prefix_ranks`` in tiers/catalogue.py), with no object
    per block made here."""
    if not isinstance(blob, bytes) or len(blob) % HASH_BYTES:
        raise InvalidArgument(f"block hashes are one bytes string of {HASH_BYTES} bytes per block, got {describe(blob)}.")
    return blob


def unpack_hashes(blob: Any) -> list[BlockHash]:
    checked_chain(blob)
    # numpy splits in C (4x faster than slicing in a loop on 512 hashes); the void dtype
    # keeps trailing zero bytes, which the bytes-string dtype would strip
    return np.frombuffer(blob, dtype=f"V{HASH_BYTES}").tolist()


def pack_checksums(checksums: Sequence[int]) -> bytes:
    return np.asarray(checksums, dtype=_CHECKSUM).tobytes()


def unpack_checksums(blob: Any) -> list[int]:
    if not isinstance(blob, bytes) or len(blob) % 8:
        raise InvalidArgument(f"checksums are one bytes string of 8 bytes (uint64, little-endian) per block, got {describe(blob)}.")
    return np.frombuffer(blob, dtype=_CHECKSUM).tolist()


def namespace_to_wire(namespace: Namespace) -> list:
    """The 13 fields of a namespace, its tenant salt as the salt's digest: what an engine
    registers and daemons send each other, so that a salt never leaves the engine."""
    layout = namespace.layout
    return [
        namespace.model_id, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
        layout.dtype, layout.kv_planes, layout.inner_order,
        namespace.tp_rank, namespace.tp_size, namespace.pp_rank, namespace.pp_size, namespace.salt_digest,
    ]  # fmt: skip


def namespace_from_wire(fields: Any, salt_in_clear: bool = True) -> Namespace:
    """A namespace from its 13 fields; the last is the tenant salt's digest (bytes) or, where
    ``salt_in_clear`` (an engine of this host registering), the salt itself (a string)."""
    if not isinstance(fields, list) or len(fields) != 13:
        raise InvalidArgument(
            f"a namespace is 13 fields: model, layout (7), tp rank/size, pp rank/size, tenant salt digest; got {describe(fields)}."
        )
    model, layers, heads, head_dim, block_size, dtype, planes, order, tp_rank, tp_size, pp_rank, pp_size, salt = fields
    if isinstance(salt, bytes):
        if len(salt) != SALT_DIGEST_BYTES:
            raise InvalidArgument(f"a namespace's tenant salt digest is {SALT_DIGEST_BYTES} bytes, got {describe(salt)}.")
        salt = SaltDigest(salt)
    elif not (salt_in_clear and isinstance(salt, str)):
        raise InvalidArgument(
            f"a namespace's last field is its tenant salt's {SALT_DIGEST_BYTES}-byte BLAKE3 digest, got {describe(salt)}; "
            "a peer that sends the salt itself runs an older kvstore: upgrade it."
        )
    if not isinstance(model, str) or len(model) > MAX_TEXT_CHARS:
        raise InvalidArgument(f"a namespace's model is a string of at most {MAX_TEXT_CHARS} characters, got {describe(model)}.")
    try:
        layout = KVLayout(layers, heads, head_dim, block_size, dtype, planes, order)
        return Namespace(model, layout, tp_rank, tp_size, pp_rank, pp_size, salt)
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(f"a namespace field has the wrong type ({exc}).") from None


# -- argument checks: what each op takes, checked before the daemon acts on it ---------------------
def _digest(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_BYTES:
        raise InvalidArgument(f"a namespace digest is {HASH_BYTES} bytes, got {describe(value)}.")
    return value


MAX_SHARDS = 64


def _digests(value: Any) -> list[bytes]:
    if not isinstance(value, bytes) or not value or len(value) % HASH_BYTES or len(value) > MAX_SHARDS * HASH_BYTES:
        raise InvalidArgument(
            f"namespace digests are one bytes string of 1 to {MAX_SHARDS} digests of {HASH_BYTES} bytes, got {describe(value)}."
        )
    return [value[i : i + HASH_BYTES] for i in range(0, len(value), HASH_BYTES)]


def _parent(value: Any) -> BlockHash | None:
    if value is not None and (not isinstance(value, bytes) or len(value) != HASH_BYTES):
        raise InvalidArgument(f"the parent hash must be {HASH_BYTES} bytes or nil, got {describe(value)}.")
    return value


def _handle(value: Any) -> int:
    if type(value) is not int or not 0 < value < 1 << 64:
        raise InvalidArgument(f"a lease, reservation or hold id is a positive 64-bit integer, got {describe(value)}.")
    return value


MAX_HOLD_IDS = 4096  # holds one request may release


def pack_handles(handles: Sequence[int]) -> bytes:
    return np.asarray(handles, dtype=_CHECKSUM).tobytes()


def _handles(value: Any) -> list[int]:
    if not isinstance(value, bytes) or len(value) % 8 or len(value) > 8 * MAX_HOLD_IDS:
        raise InvalidArgument(
            f"hold ids are one bytes string of at most {MAX_HOLD_IDS} ids of 8 bytes (uint64, little-endian), got {describe(value)}."
        )
    return [_handle(item) for item in np.frombuffer(value, dtype=_CHECKSUM).tolist()]


def _count(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise InvalidArgument(f"a count must be a non-negative integer, got {describe(value)}.")
    return value


def _count_or_none(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise InvalidArgument(f"a block count must be a non-negative integer or nil, got {describe(value)}.")
    return value


def _index_or_none(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise InvalidArgument(f"a block index must be a non-negative integer or nil, got {describe(value)}.")
    return value


def _checksums_or_none(value: Any) -> list[int] | None:
    return None if value is None else unpack_checksums(value)


def _layer(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 16:
        raise InvalidArgument(f"a layer index or count must be an integer in [0, 65536), got {describe(value)}.")
    return value


def _seconds(value: Any) -> float:
    if type(value) not in (int, float) or not 0 < value <= 86_400:
        raise InvalidArgument(f"a timeout or deadline is a positive number of seconds (at most a day), got {describe(value)}.")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT_CHARS:
        raise InvalidArgument(f"expected a non-empty string of at most {MAX_TEXT_CHARS} characters, got {describe(value)}.")
    return value


def _text_or_none(value: Any) -> str | None:
    return None if value is None else _text(value)


def _seconds_or_none(value: Any) -> float | None:
    return None if value is None else _seconds(value)


def _version(value: Any) -> int:
    if type(value) is not int:
        raise InvalidArgument(f"the protocol version is an integer, got {describe(value)}.")
    return value


def _fields(value: Any) -> list:
    if not isinstance(value, list):
        raise InvalidArgument(f"a namespace is a list of 13 fields, got {describe(value)}.")
    return value


Check = Callable[[Any], Any]

# op → (argument names, their checks); trailing arguments with a default may be left out
SIGNATURES: dict[int, tuple[tuple[str, Check, bool], ...]] = {
    Op.HELLO: (("version", _version, False),),
    Op.REGISTER: (("namespace", _fields, False),),
    Op.LOOKUP: (("namespace digest", _digest, False), ("block hashes", checked_chain, False)),
    Op.LOOKUP_SHARDS: (("namespace digests", _digests, False), ("block hashes", checked_chain, False)),
    Op.LOOKUP_HOLD: (
        ("namespace digests", _digests, False),
        ("block hashes", checked_chain, False),
        ("hold_s", _seconds, False),
        ("hold ids to release", _handles, True),
    ),
    Op.HOLD_RELEASE: (("hold ids to release", _handles, False),),
    Op.RESERVE: (("namespace digest", _digest, False), ("block hashes", unpack_hashes, False), ("parent hash", _parent, True)),
    Op.COMMIT: (("reservation id", _handle, False), ("blocks written", _count_or_none, True), ("checksums", _checksums_or_none, True)),
    Op.ABORT: (("reservation id", _handle, False),),
    Op.ACQUIRE: (("namespace digest", _digest, False), ("block hashes", unpack_hashes, False)),
    Op.RELEASE: (("lease id", _handle, False), ("first block that failed verification", _index_or_none, True)),
    Op.FETCH: (
        ("namespace digest", _digest, False),
        ("block hashes", unpack_hashes, False),
        ("deadline_s", _seconds, False),
        ("source", _text_or_none, True),
    ),
    Op.LOCATE: (
        ("namespace digest", _digest, False),
        ("block hashes", unpack_hashes, False),
        ("blocks already loaded", _count, False),
        ("source", _text_or_none, True),
        ("deadline_s", _seconds_or_none, True),  # what is left of the load's deadline; None: the daemon's own bound
    ),
    Op.FETCHED: (
        ("blocks verified", _count, False),
        ("bytes verified", _count, False),
        ("blocks dropped", _count, False),
    ),
    Op.HANDOFF_SEND: (
        ("namespace digest", _digest, False),
        ("block hashes", unpack_hashes, False),
        ("parent hash", _parent, False),
        ("transfer id", _text, False),
        ("destination", _text, False),
    ),
    Op.HANDOFF_READY: (("transfer id", _text, False), ("first layer", _layer, False), ("number of layers", _layer, False)),
    Op.HANDOFF_FINISH: (("transfer id", _text, False), ("timeout_s", _seconds, False)),
    Op.HANDOFF_CANCEL: (("transfer id", _text, False),),
    Op.HANDOFF_RECEIVE: (("namespace digest", _digest, False), ("transfer id", _text, False), ("timeout_s", _seconds, False)),
    Op.HANDOFF_WAIT: (("transfer id", _text, False), ("stop layer", _layer, False), ("timeout_s", _seconds, False)),
    Op.HANDOFF_CLOSE: (("transfer id", _text, False),),
}


# the same checks, for the requests daemons send each other (kvstore/transfers/peer_requests.py)
checked_digest = _digest
checked_parent = _parent
checked_text = _text
checked_count = _count


def checked_args(op: int, args: list) -> list:
    """``args`` of ``op`` converted by its signature; InvalidArgument naming the first
    argument that does not fit."""
    signature = SIGNATURES[op]
    required = sum(1 for _, _, optional in signature if not optional)
    if not required <= len(args) <= len(signature):
        names = ", ".join(name for name, _, _ in signature)
        raise InvalidArgument(f"{OP_NAMES[op]} takes {names}; got {len(args)} arguments.")
    converted = []
    for (name, check, _), value in zip(signature, args):
        try:
            converted.append(check(value))
        except InvalidArgument as exc:
            raise InvalidArgument(f"{OP_NAMES[op]}: {name}: {exc}") from None
    return converted
