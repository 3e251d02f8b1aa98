"""The engine ↔ daemon control protocol on the local Unix socket.

Why not gRPC here: an engine asks for the cached prefix of every request it schedules,
and gRPC's Python stack costs ~0.5 ms a round trip before any work is done, more than the
200 µs budget for a 512-block lookup. This protocol is a length-prefixed msgpack frame
each way, served by an ``asyncio.Protocol`` on the daemon's loop: no HTTP/2, no
per-call threads, no copies of block bytes (those go through the shared-memory slab;
only slot offsets travel here).

Frame: ``uint32 little-endian length ‖ msgpack body``. A request body is
``[op, arg, …]``; a reply is ``[0, result]`` or ``[1, error kind, sentence]``. Requests
on one connection are served in order; an op sent with ``NO_REPLY`` gets no answer (the
client does not wait for a release it cannot act on). Block hashes travel as one
concatenated bytes string (16 bytes each), tiers as one byte per block.

Authorization is the socket's file mode (0600 or 0660): whoever may open it is trusted
like the engine's own process. Every size and count is still bounded by the node's
``Limits`` and every frame by ``MAX_FRAME_BYTES``.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import struct
import time
from collections.abc import Awaitable
from typing import Any

import msgpack
import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError, raise_error
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind
from kvstore.version import LOCAL_PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "Op",
    "TIER_CODES",
    "encode_frame",
    "pack_hashes",
    "unpack_hashes",
    "namespace_to_wire",
    "namespace_from_wire",
    "raise_remote_error",
    "LocalServerProtocol",
]

PROTOCOL_VERSION = LOCAL_PROTOCOL_VERSION
MAX_FRAME_BYTES = 64 * 1024 * 1024
HEADER = struct.Struct("<I")
logger = logging.getLogger(__name__)


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
    NO_REPLY = 0x100  # or-ed into an op: the client does not read an answer


TIER_CODES: dict[TierKind, int] = {kind: index for index, kind in enumerate(TierKind)}
TIERS_BY_CODE: list[TierKind] = list(TierKind)
_CODE_BY_VALUE: dict[str, int] = {kind.value: code for kind, code in TIER_CODES.items()}
_VALUE = operator.attrgetter("_value_")


def encode_frame(body: Any) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def pack_hashes(hashes: list[BlockHash]) -> bytes:
    return b"".join(hashes)


def unpack_hashes(blob: bytes) -> list[BlockHash]:
    if not isinstance(blob, bytes) or len(blob) % HASH_BYTES:
        raise InvalidArgument(f"block hashes must be a multiple of {HASH_BYTES} bytes.")
    # numpy splits in C (4x faster than slicing in a loop on 512 hashes); the void dtype
    # keeps trailing zero bytes, which the bytes-string dtype would strip
    return np.frombuffer(blob, dtype=f"V{HASH_BYTES}").tolist()


def namespace_to_wire(namespace: Namespace) -> list:
    layout = namespace.layout
    return [
        namespace.model_id, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size,
        layout.dtype, layout.kv_planes, layout.inner_order,
        namespace.tp_rank, namespace.tp_size, namespace.pp_rank, namespace.pp_size, namespace.tenant_salt,
    ]  # fmt: skip


def namespace_from_wire(fields: list) -> Namespace:
    if not isinstance(fields, list) or len(fields) != 13:
        raise InvalidArgument("a namespace is 13 fields: model, layout (7), tp rank/size, pp rank/size, tenant salt.")
    model, layers, heads, head_dim, block_size, dtype, planes, order, tp_rank, tp_size, pp_rank, pp_size, salt = fields
    layout = KVLayout(layers, heads, head_dim, block_size, dtype, planes, order)
    return Namespace(model, layout, tp_rank, tp_size, pp_rank, pp_size, salt)


def raise_remote_error(kind: str, sentence: str) -> None:
    raise_error(kind, sentence)


class LocalServerProtocol(asyncio.Protocol):
    """One engine connection: a session on the node, closed (leases released,
    reservations aborted) when the connection goes."""

    def __init__(self, node, slab_path: str, transfers=None) -> None:
        self._node = node
        self._slab_path = slab_path
        self._transfers = transfers  # the TransferService, None where the transport is off
        self._tail: asyncio.Future | None = None  # the last reply still being computed
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._session = 0
        self._handlers = {
            Op.HELLO: self._hello,
            Op.REGISTER: self._register,
            Op.LOOKUP: self._lookup,
            Op.RESERVE: self._reserve,
            Op.COMMIT: self._commit,
            Op.ABORT: self._abort,
            Op.ACQUIRE: self._acquire,
            Op.RELEASE: self._release,
            Op.FETCH: self._fetch,
            Op.HANDOFF_SEND: self._handoff_send,
            Op.HANDOFF_READY: self._handoff_ready,
            Op.HANDOFF_FINISH: self._handoff_finish,
            Op.HANDOFF_CANCEL: self._handoff_cancel,
            Op.HANDOFF_RECEIVE: self._handoff_receive,
            Op.HANDOFF_WAIT: self._handoff_wait,
            Op.HANDOFF_CLOSE: self._handoff_close,
        }

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._session = self._node.open_session()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transfers is not None:
            self._transfers.close_session(self._session)
        self._node.close_session(self._session)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= 4:
            (length,) = HEADER.unpack_from(buffer)
            if length > MAX_FRAME_BYTES:
                self._reply(Op.HELLO, [1, "InvalidArgument", f"a {length}-byte frame exceeds the {MAX_FRAME_BYTES}-byte limit."])
                self._transport.close()
                return
            if len(buffer) < 4 + length:
                return
            body = bytes(buffer[4 : 4 + length])
            del buffer[: 4 + length]
            self._serve(body)

    def _serve(self, body: bytes) -> None:
        started = time.perf_counter()
        op = 0
        try:
            request = msgpack.unpackb(body, raw=False)
            if not isinstance(request, list) or not request or not isinstance(request[0], int):
                raise InvalidArgument("a request is a msgpack array starting with an op code.")
            op = request[0]
            handler = self._handlers.get(op & ~Op.NO_REPLY)
            if handler is None:
                raise InvalidArgument(f"unknown op {op}; this daemon speaks protocol version {PROTOCOL_VERSION}.")
            result = handler(*request[1:])
            if asyncio.iscoroutine(result):  # waits on a peer: answered when done
                self._queue_reply(op, started, pending=result)
                return
            reply: list = [0, result]
        except Exception as exc:
            reply = _error_reply(exc)
        if self._tail is not None and not self._tail.done() and not op & Op.NO_REPLY:
            self._queue_reply(op, started, reply=reply)  # behind an answer still being computed
            return
        self._reply(op, reply)
        self._node.metrics.observe(_OP_NAMES.get(op & ~Op.NO_REPLY, "unknown"), time.perf_counter() - started)

    def _queue_reply(self, op: int, started: float, pending: Awaitable | None = None, reply: list | None = None) -> None:
        """Replies leave in request order even when some wait on peers."""
        previous = self._tail

        async def finish() -> None:
            nonlocal reply
            if pending is not None:
                try:
                    reply = [0, await pending]
                except Exception as exc:
                    reply = _error_reply(exc)
            if previous is not None:
                await asyncio.wait([previous])
            self._reply(op, reply)
            self._node.metrics.observe(_OP_NAMES.get(op & ~Op.NO_REPLY, "unknown"), time.perf_counter() - started)

        self._tail = asyncio.ensure_future(finish())

    def _reply(self, op: int, reply: list) -> None:
        if not op & Op.NO_REPLY and self._transport is not None:
            self._transport.write(encode_frame(reply))

    # -- handlers: each returns the msgpack-able result ------------------------------------
    def _hello(self, version: int) -> list:
        if version != PROTOCOL_VERSION:
            raise InvalidArgument(f"client speaks protocol {version}, this daemon {PROTOCOL_VERSION}; upgrade one of them.")
        return [self._slab_path, self._node.node_id, PROTOCOL_VERSION]

    def _register(self, fields: list) -> list:
        namespace = namespace_from_wire(fields)
        return [self._node.register_namespace(namespace), namespace.block_bytes]

    def _lookup(self, digest: bytes, blob: bytes) -> bytes:
        tiers = self._node.lookup(digest, unpack_hashes(blob))
        # keyed by the members' plain string values: hashing an Enum member runs Python code
        return bytes(map(_CODE_BY_VALUE.__getitem__, map(_VALUE, tiers)))

    def _reserve(self, digest: bytes, blob: bytes, parent: bytes | None) -> list:
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != HASH_BYTES):
            raise InvalidArgument(f"the parent hash must be {HASH_BYTES} bytes or nil.")
        hashes = unpack_hashes(blob)
        reservation = self._node.begin_save(self._session, digest, hashes, parent)
        index_of = {h: i for i, h in enumerate(hashes)}
        return [reservation.id, [(index_of[b.block_hash], b.slot.offset) for b in reservation.blocks]]

    def _commit(self, reservation_id: int, num_written: int | None) -> int:
        return self._node.commit_save(self._session, reservation_id, num_written)

    def _abort(self, reservation_id: int) -> None:
        self._node.abort_save(self._session, reservation_id)

    def _acquire(self, digest: bytes, blob: bytes) -> list:
        lease = self._node.begin_load(self._session, digest, unpack_hashes(blob))
        return [lease.id, [b.slot.offset for b in lease.blocks]]

    def _release(self, lease_id: int) -> None:
        self._node.end_load(self._session, lease_id)

    # -- peers: remote fetch and prefill → decode handoff (kvstore/transfers/service.py) ----------
    def _service(self):
        if self._transfers is None:
            raise InvalidArgument('this daemon runs without a transport (transport.kind = "off"); peers cannot be reached.')
        return self._transfers

    async def _fetch(self, digest: bytes, blob: bytes, deadline_s: float, source: str | None = None) -> int:
        return await self._service().fetch_missing(digest, unpack_hashes(blob), _positive(deadline_s, "deadline_s"), source)

    async def _handoff_send(self, digest: bytes, blob: bytes, parent: bytes | None, transfer_id: str, destination: str) -> list:
        handoff = await self._service().handoff_send(self._session, digest, unpack_hashes(blob), parent, transfer_id, destination)
        return [slot.offset for slot in handoff.slots]

    def _handoff_ready(self, transfer_id: str, first_layer: int, num_layers: int) -> None:
        self._service().handoff_layers_ready(self._session, transfer_id, first_layer, num_layers)

    async def _handoff_finish(self, transfer_id: str, timeout_s: float) -> int:
        return await self._service().handoff_finish(self._session, transfer_id, _positive(timeout_s, "timeout_s"))

    def _handoff_cancel(self, transfer_id: str) -> None:
        self._service().handoff_cancel(self._session, transfer_id)

    async def _handoff_receive(self, digest: bytes, transfer_id: str, timeout_s: float) -> list:
        handoff = await self._service().handoff_receive(self._session, digest, transfer_id, _positive(timeout_s, "timeout_s"))
        return [pack_hashes(handoff.hashes), [slot.offset for slot in handoff.slots], handoff.parent, handoff.ready_layers]

    async def _handoff_wait(self, transfer_id: str, stop_layer: int, timeout_s: float) -> int:
        return await self._service().handoff_wait(self._session, transfer_id, stop_layer, _positive(timeout_s, "timeout_s"))

    def _handoff_close(self, transfer_id: str) -> None:
        self._service().handoff_close(self._session, transfer_id)


def _positive(value: float, name: str) -> float:
    if not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(f"{name} must be a positive number of seconds, got {value!r}.")
    return float(value)


def _error_reply(exc: Exception) -> list:
    if isinstance(exc, KVStoreError):
        return [1, type(exc).__name__, str(exc)]
    if isinstance(exc, (TypeError, ValueError, msgpack.UnpackException)):
        return [1, "InvalidArgument", f"malformed request: {exc}."]
    logger.error("local request failed", exc_info=exc)  # the daemon keeps serving; the client gets a sentence
    return [1, "KVStoreError", f"internal error serving the request: {exc}."]


_OP_NAMES = {
    Op.HELLO: "hello",
    Op.REGISTER: "register",
    Op.LOOKUP: "lookup",
    Op.RESERVE: "reserve",
    Op.COMMIT: "commit",
    Op.ABORT: "abort",
    Op.ACQUIRE: "acquire",
    Op.RELEASE: "release",
    Op.FETCH: "fetch",
    Op.HANDOFF_SEND: "handoff_send",
    Op.HANDOFF_READY: "handoff_ready",
    Op.HANDOFF_FINISH: "handoff_finish",
    Op.HANDOFF_CANCEL: "handoff_cancel",
    Op.HANDOFF_RECEIVE: "handoff_receive",
    Op.HANDOFF_WAIT: "handoff_wait",
    Op.HANDOFF_CLOSE: "handoff_close",
}
