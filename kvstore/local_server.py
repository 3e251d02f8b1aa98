"""The daemon's end of the local protocol (kvstore/localproto.py): one asyncio protocol
per engine connection, each a session on the node.

- **Answers by request id.** A request is answered as soon as it is done; one that waits
  (a promotion from NVMe, a peer) runs as a task while later requests on the same
  connection are served, and its reply names its request. Replies to requests with id 0
  are not sent.
- **Bad input loses nothing.** A frame longer than ``MAX_REQUEST_BYTES`` is refused from
  its length alone and the connection closed (its body is never buffered); a frame that
  does not decode, an unknown op, or arguments that do not fit the op's signature get an
  InvalidArgument reply and the connection keeps serving.
- **Fairness and back-pressure.** A connection's frames are served at most
  ``FRAMES_PER_TURN`` (or ``BYTES_PER_TURN`` of them) per turn of the event loop, so one
  busy client cannot starve the others; a client that does not read its replies stops being read (the transport's
  write buffer is bounded), so its unread answers cannot grow the daemon.
- **Ownership.** The connection's peer process is known (``SO_PEERCRED``, held as a
  pidfd so that a reused pid cannot fool it). When the connection goes, the session is
  closed at once if its process has exited; otherwise its slots stay its own until the
  process exits (DESIGN decision 12): a process that dropped its socket may still be
  copying into or out of them.

Owner: the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from kvstore import localproto
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.localproto import HEADER, MAX_REQUEST_BYTES, OP_NAMES, PROTOCOL_VERSION, Op, checked_args
from kvstore.namespace import Namespace
from kvstore.steps import drive, is_pending
from kvstore.tiers.base import has_spare_core, spare_cpu_now

__all__ = ["LocalServer", "LocalServerProtocol"]

logger = logging.getLogger(__name__)

FRAMES_PER_TURN = 32
BYTES_PER_TURN = 256 * 1024  # a turn ends after this much request data, so one client's big frames do not hold the loop
WRITE_BUFFER_HIGH = 1024 * 1024
_PEERCRED = struct.Struct("3i")
# results that are answers as they are: checked first, since iscoroutine's ABC check costs ~1 µs
_ANSWERS = frozenset({bytes, list, int, type(None)})


class LocalServer:
    """What every connection shares: the node, the slab path, the transfer service, and
    the watch on processes whose sessions outlived their connection."""

    def __init__(self, node, slab_path: str, transfers=None, verify_loads: bool = False, spin_s: float = 0.0) -> None:
        self.node = node
        self.slab_path = slab_path
        self.transfers = transfers  # the TransferService, None where the transport is off
        self.verify_loads = verify_loads
        # how long the loop polls for the next request after an answer (server.spin_us)
        self.spin_s = spin_s if has_spare_core() else 0.0
        self._answered_at = 0.0
        self._polling_since: float | None = None
        self._watched: dict[int, int] = {}  # pidfd of a live process -> its orphaned session
        self._connections: set[LocalServerProtocol] = set()
        self._all_closed = asyncio.Event()

    @property
    def reader_credentials(self) -> dict | None:
        """What an engine authenticates to peers with when it reads their blocks itself: a
        reader key (it may fetch, nothing else; never the fleet key) and the TLS files. Only
        processes that may connect to this socket (the daemon's user, or its group) get it."""
        if self.transfers is None or not self.transfers.auth.required:
            return None
        config = self.transfers.config
        reader = self.transfers.auth.for_reader()
        return {"key": reader.key, "tls": [config.tls_cert, config.tls_key, config.tls_ca] if config.uses_tls else None}

    def protocol(self) -> LocalServerProtocol:
        return LocalServerProtocol(self)

    def answered(self) -> None:
        """An answer went out: keep the loop polling its sockets for ``spin_s`` from now
        rather than sleeping in epoll, so that the engine's next request is read as it
        lands. A callback that puts itself back on the ready queue is the poll: while one
        is ready, the loop (asyncio's or uvloop's) waits on its sockets with a zero
        timeout, and it still runs timers, other connections and I/O threads' callbacks
        on every turn. Only while a CPU of the host is idle (``spare_cpu_now``): where the
        engines keep every core busy, a polling daemon takes one from their compute threads."""
        self._answered_at = now = time.perf_counter()
        if self._polling_since is None and self.spin_s:
            if not spare_cpu_now():  # a poll would take an engine's CPU
                self.node.metrics.poll_skipped()
                return
            self._polling_since = now
            asyncio.get_running_loop().call_soon(self._poll)

    def _poll(self) -> None:
        now = time.perf_counter()
        if now - self._answered_at < self.spin_s:
            # a process waiting for this CPU runs first: the engine, when the scheduler put
            # the daemon on its CPU (a Unix socket wakes its reader on the writer's CPU), is
            # itself polling for the answer just sent, or about to send the next request
            os.sched_yield()
            asyncio.get_running_loop().call_soon(self._poll)
            return
        self.node.metrics.polled(now - self._polling_since)
        self._polling_since = None

    def end_session(self, session: int, pidfd: int | None) -> None:
        """The connection of ``session`` is gone: close the session now if its process is
        gone too or it holds nothing; else once the process exits."""
        if pidfd is None or _exited(pidfd):
            self._close_session(session, pidfd)
            return
        kept = not self.node.close_session(session, owner_gone=False)
        if not kept and not (self.transfers is not None and self.transfers.holds(session)):
            os.close(pidfd)
            return
        self._watched[pidfd] = session
        asyncio.get_running_loop().add_reader(pidfd, self._owner_exited, pidfd)

    def _owner_exited(self, pidfd: int) -> None:
        asyncio.get_running_loop().remove_reader(pidfd)
        self._close_session(self._watched.pop(pidfd), pidfd)

    def _close_session(self, session: int, pidfd: int | None) -> None:
        if pidfd is not None:
            os.close(pidfd)
        if self.transfers is not None:
            self.transfers.close_session(session)
        self.node.close_session(session, owner_gone=True)

    def renew_slab(self, connection: LocalServerProtocol, session: int) -> None:
        """Before an engine is handed the slab's path: when the file there is no longer the
        daemon's (removed or replaced), have it recreated and cut every other connection,
        whose engines map the old file; they reconnect and map the new one."""
        if self.node.check_host_slab() is None:
            return
        ended = self.node.renew_host_slab(session)
        for other in list(self._connections):
            if other is not connection:
                other.abort()
        if self.transfers is not None:
            for ended_session in ended:
                self.transfers.close_session(ended_session)
            # staged in the old file: a consumer that maps the new one would read other bytes
            self.transfers.handoffs.fail_all_incoming("the host tier's file was recreated while it arrived")

    def joined(self, connection: LocalServerProtocol) -> None:
        self._connections.add(connection)
        self._all_closed.clear()

    def left(self, connection: LocalServerProtocol) -> None:
        self._connections.discard(connection)
        if not self._connections:
            self._all_closed.set()

    async def close(self) -> None:
        """The daemon stops: end every connection (no request is served after this, so
        nothing reaches the tiers while they are persisted and closed) and forget the
        watched processes; their sessions are closed with all others."""
        self.spin_s = 0.0  # a poll under way ends on its next turn
        for connection in list(self._connections):
            connection.abort()
        if self._connections:
            await self._all_closed.wait()
        loop = asyncio.get_running_loop()
        for pidfd in list(self._watched):
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self._watched.clear()


class LocalServerProtocol(asyncio.Protocol):
    """One engine connection."""

    def __init__(self, server: LocalServer) -> None:
        self._server = server
        self._node = server.node
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._session = 0
        self._pidfd: int | None = None
        self._tasks: set[asyncio.Task] = set()
        self._reading_paused = False  # by back-pressure or fairness
        self._writing_paused = False
        self._turn_scheduled = False
        self._handlers: dict[int, Callable[..., Any]] = {
            Op.HELLO: self._hello,
            Op.REGISTER: self._register,
            Op.LOOKUP: self._lookup,
            Op.LOOKUP_SHARDS: self._lookup_shards,
            Op.LOOKUP_HOLD: self._lookup_hold,
            Op.HOLD_RELEASE: self._hold_release,
            Op.RESERVE: self._reserve,
            Op.COMMIT: self._commit,
            Op.ABORT: self._abort,
            Op.ACQUIRE: self._acquire,
            Op.RELEASE: self._release,
            Op.FETCH: self._fetch,
            Op.LOCATE: self._locate,
            Op.FETCHED: self._fetched,
            Op.HANDOFF_SEND: self._handoff_send,
            Op.HANDOFF_READY: self._handoff_ready,
            Op.HANDOFF_FINISH: self._handoff_finish,
            Op.HANDOFF_CANCEL: self._handoff_cancel,
            Op.HANDOFF_RECEIVE: self._handoff_receive,
            Op.HANDOFF_WAIT: self._handoff_wait,
            Op.HANDOFF_CLOSE: self._handoff_close,
        }

    # -- the connection ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self._session = self._node.open_session()
        self._pidfd = _peer_pidfd(transport)
        self._server.joined(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for task in self._tasks:
            task.cancel()
        self._server.end_session(self._session, self._pidfd)
        self._pidfd = None
        self._server.left(self)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._schedule_turn()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._serve_turn()

    def _serve_turn(self) -> None:
        self._turn_scheduled = False
        buffer = self._buffer
        served = served_bytes = 0
        while len(buffer) >= 4 and self._transport is not None and not self._writing_paused:
            (length,) = HEADER.unpack_from(buffer)
            if length > MAX_REQUEST_BYTES:
                self._write(
                    localproto.encode_error(
                        0, InvalidArgument(f"a {length}-byte request exceeds the {MAX_REQUEST_BYTES}-byte limit; closing the connection.")
                    )
                )
                buffer.clear()
                self._transport.close()
                return
            if len(buffer) < 4 + length:
                break
            if served >= FRAMES_PER_TURN or served_bytes >= BYTES_PER_TURN:  # let the other connections have the loop
                self._pause_reading()
                self._schedule_turn()
                return
            body = bytes(buffer[4 : 4 + length])
            del buffer[: 4 + length]
            self._serve(body)
            served += 1
            served_bytes += length
        if not self._writing_paused and self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _schedule_turn(self) -> None:
        if not self._turn_scheduled:
            self._turn_scheduled = True
            asyncio.get_running_loop().call_soon(self._serve_turn)

    # -- requests -------------------------------------------------------------------------------
    def _serve(self, body: bytes) -> None:
        started = time.perf_counter()
        request_id, op = 0, 0
        try:
            request_id, op, args = localproto.decode_request(body)
            result = self._handlers[op](*checked_args(op, args))
            if type(result) not in _ANSWERS and (is_pending(result) or asyncio.iscoroutine(result)):  # waits on I/O or a peer
                task = asyncio.ensure_future(self._finish(request_id, op, started, result))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                return
            reply = localproto.encode_reply(request_id, result) if request_id else None
        except Exception as exc:
            if not op and not hasattr(exc, "request_id"):
                # the frame did not decode: its id is unknown, so the error goes out under id 0
                self._write(localproto.encode_error(0, exc))
                return
            request_id = getattr(exc, "request_id", request_id)
            reply = self._error(request_id, op, exc)
        if reply is not None:
            self._write(reply)
        self._observe(op, started)

    async def _finish(self, request_id: int, op: int, started: float, pending) -> None:
        try:
            result = await pending
            reply = localproto.encode_reply(request_id, result) if request_id else None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reply = self._error(request_id, op, exc)
        if reply is not None:
            self._write(reply)
        self._observe(op, started)

    def _error(self, request_id: int, op: int, exc: Exception) -> bytes | None:
        kind, _ = localproto.error_of(exc)
        if kind == "KVStoreError" and not isinstance(exc, KVStoreError):
            logger.error("local request %s failed", OP_NAMES.get(op, op), exc_info=exc)  # the client gets a sentence
        return localproto.encode_error(request_id, exc) if request_id else None

    def _write(self, frame: bytes) -> None:
        if self._transport is not None:
            self._transport.write(frame)
            self._server.answered()

    def _observe(self, op: int, started: float) -> None:
        self._node.metrics.observe(OP_NAMES.get(op, "unknown"), time.perf_counter() - started)

    # -- handlers: each returns the msgpack-able result, steps, or a coroutine ---------------------
    def _hello(self, version: int) -> list:
        if version != PROTOCOL_VERSION:
            raise InvalidArgument(f"client speaks protocol {version}, this daemon {PROTOCOL_VERSION}; upgrade one of them.")
        self._server.renew_slab(self, self._session)
        return [self._server.slab_path, self._node.node_id, PROTOCOL_VERSION, self._server.verify_loads, self._server.reader_credentials]

    def _register(self, fields: list) -> list:
        namespace: Namespace = localproto.namespace_from_wire(fields)
        return [self._node.register_namespace(namespace), namespace.block_bytes]

    def _lookup(self, digest: bytes, chain: bytes) -> bytes:
        return self._node.lookup_ranks(digest, chain)  # the tier ranks are the wire's tier codes

    def _lookup_shards(self, digests: list[bytes], chain: bytes) -> list[bytes]:
        return [self._lookup(digest, chain) for digest in digests]

    def _lookup_hold(self, digests: list[bytes], chain: bytes, hold_s: float, release: list[int] | None = None) -> list:
        hold_id, ranks = self._node.lookup_held(self._session, digests, chain, hold_s, release or ())
        return [hold_id, ranks]

    def _hold_release(self, hold_ids: list[int]) -> None:
        self._node.release_holds(self._session, hold_ids)

    def _reserve(self, digest: bytes, hashes: list, parent: bytes | None = None):
        return _then(self._node.begin_save(self._session, digest, hashes, parent), _placements(hashes))

    def _commit(self, reservation_id: int, num_written: int | None = None, checksums: list[int] | None = None) -> int:
        return self._node.commit_save(self._session, reservation_id, num_written, checksums)

    def _abort(self, reservation_id: int) -> None:
        self._node.abort_save(self._session, reservation_id)

    def _acquire(self, digest: bytes, hashes: list):
        return _then(self._node.begin_load(self._session, digest, hashes), _granted)

    def _release(self, lease_id: int, corrupt_index: int | None = None) -> None:
        self._node.end_load(self._session, lease_id, corrupt_index)

    # -- peers: remote fetch and prefill → decode handoff (kvstore/transfers/service.py) ----------
    def _service(self):
        if self._server.transfers is None:
            raise InvalidArgument('this daemon runs without a transport (transport.kind = "off"); peers cannot be reached.')
        return self._server.transfers

    async def _fetch(self, digest: bytes, hashes: list, deadline_s: float, source: str | None = None) -> int:
        return await self._service().fetch_missing(digest, hashes, deadline_s, source)

    async def _locate(self, digest: bytes, hashes: list, have: int, source: str | None = None, deadline_s: float | None = None) -> list:
        return list(await self._service().locate(digest, hashes, have, source, deadline_s))

    def _fetched(self, num_blocks: int, num_bytes: int, num_dropped: int) -> None:
        self._node.metrics.transferred("in", "fetch", num_blocks, num_bytes)
        if num_dropped:
            self._node.metrics.dropped("checksum", num_dropped)

    async def _handoff_send(self, digest: bytes, hashes: list, parent: bytes | None, transfer_id: str, destination: str) -> list:
        handoff = await self._service().handoff_send(self._session, digest, hashes, parent, transfer_id, destination)
        return [slot.offset for slot in handoff.slots]

    def _handoff_ready(self, transfer_id: str, first_layer: int, num_layers: int) -> None:
        self._service().handoff_layers_ready(self._session, transfer_id, first_layer, num_layers)

    async def _handoff_finish(self, transfer_id: str, timeout_s: float) -> int:
        return await self._service().handoff_finish(self._session, transfer_id, timeout_s)

    def _handoff_cancel(self, transfer_id: str) -> None:
        self._service().handoff_cancel(self._session, transfer_id)

    async def _handoff_receive(self, digest: bytes, transfer_id: str, timeout_s: float) -> list:
        handoff = await self._service().handoff_receive(self._session, digest, transfer_id, timeout_s)
        return [localproto.pack_hashes(handoff.hashes), [slot.offset for slot in handoff.slots], handoff.parent, handoff.ready_layers]

    async def _handoff_wait(self, transfer_id: str, stop_layer: int, timeout_s: float) -> int:
        return await self._service().handoff_wait(self._session, transfer_id, stop_layer, timeout_s)

    def _handoff_close(self, transfer_id: str) -> None:
        self._service().handoff_close(self._session, transfer_id)


def _placements(hashes: list) -> Callable:
    def reply(reservation) -> list:
        index_of = {h: i for i, h in enumerate(hashes)}
        return [reservation.id, [(index_of[b.block_hash], b.slot.offset) for b in reservation.blocks]]

    return reply


def _granted(lease) -> list:
    checksums = localproto.pack_checksums([b.checksum or 0 for b in lease.blocks])
    return [lease.id, [b.slot.offset for b in lease.blocks], checksums]


def _then(steps, reply: Callable):
    """Drive ``steps`` and turn its result into a reply, now or once it is done."""
    result = drive(steps)
    if is_pending(result):

        async def finish():
            return reply(await result)

        return finish()
    return reply(result)


def _peer_pidfd(transport: asyncio.BaseTransport) -> int | None:
    """A pidfd of the process at the other end of a Unix socket, where the kernel tells it."""
    sock = transport.get_extra_info("socket")
    try:
        pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        return os.pidfd_open(pid) if pid > 0 else None
    except (OSError, AttributeError):
        return None  # another pid namespace, or no pidfd support: a closed connection counts as gone


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (a pidfd polls readable then)."""
    ready, _, _ = select.select([pidfd], [], [], 0)
    return bool(ready)
