"""An engine's direct read of blocks from a peer daemon, straight into its own memory.

A remote load through the local daemon crosses memory twice: the daemon receives each
block into its host tier, then the engine copies it out. Where the cores are all busy
moving the bytes (a sender, a receiver and a copier on two cores), that copy was a third
of the load's time: 0.47–0.61× a raw socket in bench.daemon. So ``client.load(…,
allow_remote=True)`` from a TCP peer speaks the peer's fetch conversation itself
(kvstore/transfers/peer_server.py), on a blocking socket of its own, and receives each
block's payload into the engine's tensor it was asked for:

    → CONTROL {"op": "fetch", "namespace", "hashes"}
    ← CONTROL {"count": n, "nbytes"}; n BLOCK frames in chain order; END

The blocks are not copied into this node's tiers: the peer keeps serving them, a second
copy would take fleet capacity from other prefixes, and the engine that asked holds them
in its own cache for the session's next turns.

**Never wrong.** Every header is checked (its own checksum, kind, transfer id, namespace,
and the key, sequence and length of the block asked for at that position) before its
length is trusted, and every payload against the checksum its writer committed, which the
peer sends as is. The count returned is the verified prefix: a failed block ends it, and
nothing after a failed or missing block is counted. Bytes may have landed in destinations
past the count; they are the caller's to overwrite (a recompute does).

**Never fatal.** A peer that cannot be reached, refuses, stalls past the deadline or sends
anything malformed is a shorter hit, logged, never an exception. The deadline covers
connecting and receiving. Nothing writes into the destinations after ``read`` returns: the
receive is this thread's own, not posted to a transport that outlives the call.

**Never unauthenticated.** Where the fleet authenticates its peers, a new connection runs
the same handshake a daemon's does (transport/auth.py) before its first request, as a
``reader``: the daemon hands its engines a reader key derived from the fleet secret, which
lets them fetch and nothing else, and the TLS files it uses (`configure`, from the local
daemon's HELLO). Without TLS, every frame's MAC is checked with the checksum; an engine
that cannot load the TLS files does not read directly (the daemon fetches for it).

Connections: one that ended its conversation cleanly is kept for the next read from that
peer (up to ``max_idle_per_peer``), checked for a hang-up before it is used again; any
other is closed, since bytes still in flight would be read as the next conversation's.

Owner: the thread that calls ``read``; the idle connections are shared under a lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import CorruptBlock, InvalidArgument, KVStoreError, TransferFailed, raise_error
from kvstore.hashing import BlockHash
from kvstore.localproto import pack_hashes
from kvstore.transport.auth import ClientHandshake, PeerAuth, Seal, check_handshake_header, handshake_message, tls_context
from kvstore.transport.base import split_address
from kvstore.transport.tcp import TLS_RECORD_BYTES
from kvstore.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, control_header, decode_control, encode_control

__all__ = ["DirectRead", "PeerReader", "reads_directly"]

logger = logging.getLogger(__name__)

SCHEME = "tcp"
# a receiver waiting for a payload is woken per this many bytes (SO_RCVLOWAT), not per
# segment, as the daemon's TCP channel is (kvstore/transport/tcp.py)
WAKE_BYTES = 1 << 20


def reads_directly(address: str) -> bool:
    """Whether an engine reads from the peer at ``address`` itself (TCP peers; a UCX peer
    is fetched through the local daemon)."""
    return address.startswith(f"{SCHEME}://")


@dataclass(slots=True)
class _Connection:
    sock: socket.socket  # an SSL socket where the fleet uses TLS
    seal: Seal | None  # the MAC and counters of a channel authenticated by a secret alone


@dataclass(frozen=True, slots=True)
class DirectRead:
    num_blocks: int  # the verified prefix, in chain order from the first block asked for
    num_bytes: int
    num_dropped: int  # blocks that arrived and failed their checksum (0 or 1: the first ends the read)


class PeerReader:
    def __init__(self, max_idle_per_peer: int = 2, handshake_timeout_s: float = 3.0) -> None:
        self.max_idle_per_peer = max_idle_per_peer
        self.handshake_timeout_s = handshake_timeout_s
        self.auth = PeerAuth(role="reader")
        self.unusable = ""  # why this engine cannot read peers itself ("": it can)
        self._idle: dict[str, list[_Connection]] = {}
        self._lock = threading.Lock()
        self._transfer_ids = itertools.count(1)
        self._closed = False

    def configure(self, credentials: dict | None) -> None:
        """Take the reader credentials the local daemon handed over at HELLO: ``{"key":
        reader key or None, "tls": [cert, key, ca] or None}``; None: peers authenticate
        nothing. Connections made under other credentials are closed."""
        key, tls = (credentials or {}).get("key"), (credentials or {}).get("tls")
        client_tls, self.unusable = None, ""
        if tls:
            try:
                client_tls = tls_context(*tls, server_side=False)
            except KVStoreError as exc:
                self.unusable = f"this engine cannot load the fleet's TLS files ({exc}); its local daemon fetches for it"
                logger.warning("direct reads from peers are off: %s", self.unusable)
        auth = PeerAuth(key if isinstance(key, bytes) and key else None, None, client_tls, "reader")
        if auth != self.auth:
            self.auth = auth
            with self._lock:
                idle, self._idle = self._idle, {}
            for connections in idle.values():
                for connection in connections:
                    connection.sock.close()

    def reads(self, address: str) -> bool:
        """Whether this engine reads from the peer at ``address`` itself."""
        return reads_directly(address) and not self.unusable

    def read(
        self, address: str, digest: bytes, hashes: Sequence[BlockHash], destinations: Sequence[memoryview], deadline_s: float
    ) -> DirectRead:
        """Receive the blocks of ``hashes`` from the peer at ``address`` into
        ``destinations`` (one writable byte view each, the block's size); returns the
        verified prefix that arrived within ``deadline_s``."""
        if len(destinations) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes were given with {len(destinations)} destinations.")
        if not hashes:
            return DirectRead(0, 0, 0)
        deadline = time.monotonic() + deadline_s
        try:
            connection = self._checkout(address, deadline)
        except KVStoreError as exc:
            logger.info("direct read from %s: %s", address, exc)
            return DirectRead(0, 0, 0)
        with self._lock:
            transfer_id = next(self._transfer_ids)
        fetch = _Fetch(_Stream(connection, address, deadline), transfer_id, digest, hashes, destinations)
        try:
            fetch.run()
        except (KVStoreError, OSError) as exc:
            connection.sock.close()
            if isinstance(exc, OSError):
                exc = TransferFailed(f"the connection to {address} broke: {exc.strerror or exc}.")
            logger.info("direct read from %s: %d of %d blocks verified, then: %s", address, fetch.num_verified, len(hashes), exc)
        except BaseException:
            connection.sock.close()
            raise
        else:
            self._checkin(address, connection)
        return DirectRead(fetch.num_verified, fetch.num_bytes, fetch.num_dropped)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.sock.close()

    # -- connections ------------------------------------------------------------------------
    def _checkout(self, address: str, deadline: float) -> _Connection:
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                connection = idle.pop()
                if _still_open(connection.sock):
                    return connection
                connection.sock.close()  # the peer hung up meanwhile (restarted, or closed idle channels)
        host, port = split_address(address, SCHEME)
        try:
            sock = socket.create_connection((host, port), timeout=max(1e-3, deadline - time.monotonic()))
        except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode
            raise TransferFailed(f"cannot connect to {address}: {getattr(exc, 'strerror', None) or exc}.") from exc
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            return self._authenticate(sock, address, host, min(deadline, time.monotonic() + self.handshake_timeout_s))
        except BaseException:
            sock.close()
            raise

    def _authenticate(self, sock: socket.socket, address: str, host: str, deadline: float) -> _Connection:
        """TLS where the fleet has it, then the handshake as a reader (transport/auth.py)."""
        auth = self.auth
        if auth.client_tls is not None:
            sock = auth.client_tls.wrap_socket(sock, do_handshake_on_connect=False, server_hostname=host)
        connection = _Connection(sock, None)
        stream = _Stream(connection, address, deadline)
        if auth.client_tls is not None:
            stream.tls_handshake()
        handshake = ClientHandshake(auth, auth.client_tls is not None)
        stream.send_message(FrameKind.AUTH, 0, encode_control(handshake.hello()))
        header = stream.header()
        check_handshake_header(header)
        proof, established = handshake.finish(handshake_message(header, stream.payload(header.length), address))
        if auth.key is not None:
            stream.send_message(FrameKind.AUTH, 0, encode_control(proof))
        connection.seal = established.seal
        return connection

    def _checkin(self, address: str, connection: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self.max_idle_per_peer:
                idle.append(connection)
                return
        connection.sock.close()


def _still_open(sock: socket.socket) -> bool:
    """An idle connection has nothing to read: a hang-up or stray bytes (under TLS, any
    record the peer sent meanwhile) retire it."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return not poll.poll(0)


class _Fetch:
    """One fetch conversation: the request, then every block checked as it lands."""

    def __init__(
        self, stream: _Stream, transfer_id: int, digest: bytes, hashes: Sequence[BlockHash], destinations: Sequence[memoryview]
    ) -> None:
        self.stream, self.transfer_id, self.digest = stream, transfer_id, digest
        self.hashes, self.destinations = hashes, destinations
        self.num_verified = self.num_bytes = self.num_dropped = 0

    def run(self) -> None:
        payload = encode_control({"op": "fetch", "namespace": self.digest, "hashes": pack_hashes(list(self.hashes))})
        self.stream.send_message(FrameKind.CONTROL, self.transfer_id, payload)
        reply = self._message(FrameKind.CONTROL)
        count = reply.get("count") if isinstance(reply, dict) else None
        if type(count) is not int or not 0 <= count <= len(self.hashes):
            raise CorruptBlock(f"the peer {self.stream.peer} offered {count!r} blocks of the {len(self.hashes)} asked for.")
        for sequence in range(count):
            header = self._block_header(sequence)
            into = self.destinations[sequence]
            self.stream.recv_into(into)
            try:
                self.stream.verify(header, into)
            except CorruptBlock:
                self.num_dropped += 1
                raise
            self.num_verified += 1
            self.num_bytes += header.length
        self._message(FrameKind.END)

    def _block_header(self, sequence: int) -> FrameHeader:
        header = self.stream.header()
        if header.kind is FrameKind.ERROR:
            self._raise_refusal(header)
        expected = self.destinations[sequence]
        if (
            header.kind is not FrameKind.BLOCK
            or header.transfer_id != self.transfer_id
            or header.namespace != self.digest
            or header.sequence != sequence
            or header.key != self.hashes[sequence]
            or header.length != len(expected)
            or header.num_layers
        ):
            raise CorruptBlock(
                f"the peer {self.stream.peer} sent a {header.kind.name} frame (transfer {header.transfer_id}, "
                f"sequence {header.sequence}, {header.length} bytes) where block {sequence} of transfer "
                f"{self.transfer_id} ({len(expected)} bytes) was due."
            )
        return header

    def _message(self, kind: FrameKind) -> Any:
        header = self.stream.header()
        if header.kind is FrameKind.ERROR:
            self._raise_refusal(header)
        if header.kind is not kind or header.transfer_id != self.transfer_id:
            raise TransferFailed(
                f"expected a {kind.name} frame of transfer {self.transfer_id} from {self.stream.peer}, got {header.kind.name}."
            )
        return decode_control(header, self.stream.verified_payload(header))

    def _raise_refusal(self, header: FrameHeader) -> None:
        refusal = decode_control(header, self.stream.verified_payload(header))
        if not (isinstance(refusal, list) and len(refusal) == 2 and all(isinstance(part, str) for part in refusal)):
            raise TransferFailed(f"the peer {self.stream.peer} refused with a malformed error.")
        raise_error(refusal[0], f"the peer {self.stream.peer} refused: {refusal[1]}")


class _Stream:
    """A non-blocking socket (plain or TLS) read and written in full, each wait bounded by
    one deadline; on a sealed connection, frames are signed and checked as a channel's are."""

    def __init__(self, connection: _Connection, peer: str, deadline: float) -> None:
        self.connection, self.sock, self.peer, self.deadline = connection, connection.sock, peer, deadline
        self.tls = isinstance(self.sock, ssl.SSLSocket)
        self._poll = select.poll()  # not select(): an engine may hold descriptors past 1024
        self._wake_bytes = 1  # the socket's SO_RCVLOWAT
        self._header = bytearray(HEADER_BYTES)

    def tls_handshake(self) -> None:
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN)
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT)
            except ssl.SSLError as exc:
                raise TransferFailed(f"the TLS handshake with {self.peer} failed: {exc.reason or exc}.") from exc

    def send_message(self, kind: FrameKind, transfer_id: int, payload: bytes) -> None:
        header = control_header(kind, transfer_id, payload)
        if self.connection.seal is not None:
            header = self.connection.seal.sign(header, payload)
        self.send(header.pack(), payload)

    def send(self, *parts: bytes) -> None:
        if self.tls:  # an SSL socket does not gather
            parts = (b"".join(parts),)
        views = [memoryview(part) for part in parts]
        while views:
            try:
                sent = self.sock.send(views[0]) if self.tls else self.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                self._wait(select.POLLOUT)
                continue
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN)
                continue
            except ssl.SSLError as exc:
                raise TransferFailed(f"the TLS connection to {self.peer} failed: {exc.reason or exc}.") from exc
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0], sent = views[0][sent:], 0

    def header(self) -> FrameHeader:
        self.recv_into(memoryview(self._header))
        header = FrameHeader.unpack(self._header)
        if self.connection.seal is not None:
            self.connection.seal.check_order(header)
        return header

    def verify(self, header: FrameHeader, payload: memoryview | bytes) -> None:
        header.verify(payload)
        if self.connection.seal is not None:
            self.connection.seal.verify(header, payload)

    def verified_payload(self, header: FrameHeader) -> bytes:
        payload = self.payload(header.length)
        self.verify(header, payload)
        return payload

    def payload(self, length: int) -> bytes:
        data = bytearray(length)
        self.recv_into(memoryview(data))
        return bytes(data)

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view``: take what is there; when nothing is, sleep until WAKE_BYTES (or
        what is left, if less) have come."""
        got = 0
        while got < len(view):
            try:
                count = self.sock.recv_into(view[got:]) if self.tls else self.sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT)
                continue
            except ssl.SSLZeroReturnError:
                count = 0
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                wake_bytes = min(len(view) - got, WAKE_BYTES)
                if self.tls:  # OpenSSL may hold part of the last record already: wake a record sooner
                    wake_bytes = max(1, wake_bytes - TLS_RECORD_BYTES)
                if wake_bytes != self._wake_bytes:
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wake_bytes)
                    self._wake_bytes = wake_bytes
                self._wait(select.POLLIN)
                continue
            except ssl.SSLError as exc:
                raise TransferFailed(f"the TLS connection to {self.peer} failed: {exc.reason or exc}.") from exc
            if not count:
                raise TransferFailed(f"the peer {self.peer} closed the connection {got} bytes into a {len(view)}-byte read.")
            got += count

    def _wait(self, event: int) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransferFailed(f"the deadline passed while waiting for {self.peer}.")
        self._poll.register(self.sock, event)  # registered again: the event asked for changes
        with contextlib.suppress(InterruptedError):
            self._poll.poll(remaining * 1000)
