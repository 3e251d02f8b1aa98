"""TCP transport: asyncio over raw non-blocking sockets, without staging copies.

A frame goes out as one gathered ``sendmsg`` of its header and its payload (``send_many``
gathers many frames into each call, so a window of blocks costs a few system calls and
never a concatenation of payloads); a payload comes in by ``recvmsg_into`` straight into
the caller's buffer, which is the destination slot, and the same call takes the start of
the next header into the header buffer.

Readiness waits are this module's own (``add_reader`` / ``add_writer`` futures) rather
than ``loop.sock_recv_into``: closing a socket does not wake a task parked in the loop's
``sock_*`` calls, and ``close`` must wake a blocked receiver. A channel whose stream may
be out of step (a corrupt header, a receive or send cancelled halfway through a frame)
is marked broken: every later call fails rather than read a payload as a header.

With TLS (``transport.tls_cert``, ``tls_key``, ``tls_ca``) a channel's socket is wrapped in
Python's ``ssl`` and the same frames go through it (`_TlsChannel`): a gathered write
becomes one TLS write per large payload and one per run of small parts, a scattered read
one per record, since TLS frames bytes in records of its own. Every channel, with TLS or
not, authenticates before its first request (transport/auth.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterable

from kvstore.errors import InvalidArgument, TransferFailed
from kvstore.transport.auth import PeerAuth
from kvstore.transport.base import Buffer, Channel, ChannelHandler, Transport, split_address
from kvstore.transport.config import TransportConfig
from kvstore.transport.serving import ChannelRegistry, FramedChannel, address_of
from kvstore.transport.wire import HEADER_BYTES, FrameHeader

__all__ = ["TcpTransport"]

logger = logging.getLogger(__name__)

IOV_MAX = os.sysconf("SC_IOV_MAX")
# a receiver waiting for a large payload is woken per this many bytes (SO_RCVLOWAT), not
# per segment: each wake-up costs an event-loop turn
WAKE_BYTES = 1 << 20
# a gathered write stops at this much payload, so that the first bytes leave before the
# sender has checksummed a whole window (which stalled the stream per window); measured
# on loopback, 1 MiB (one write per 1 MiB block against the receiver's 1 MiB SO_RCVLOWAT)
# halved the throughput, 4 MiB kept it and smoothed the arrivals
GATHER_BYTES = 4 << 20
LISTEN_BACKLOG = 128


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay for headers and control frames. The buffer sizes stay
    with the kernel's autotuning (net.ipv4.tcp_[rw]mem), which outgrows any fixed size a
    socket could ask for without privileges; setting SO_RCVBUF would switch it off."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _TcpChannel(FramedChannel):
    def __init__(self, sock: socket.socket, peer: str, frames_per_write: int, forget: Callable[[Channel], None]) -> None:
        super().__init__(peer, forget)
        self._sock = sock
        self._fd = sock.fileno()  # what the loop watches; valid until close
        self._frames_per_write = min(frames_per_write, IOV_MAX // 2)
        self._loop = asyncio.get_running_loop()
        self._waiters: set[asyncio.Future] = set()  # readiness waits that close must wake
        self._header = bytearray(HEADER_BYTES)
        self._header_bytes = 0  # how much of the next header is already in self._header
        self._wake_bytes = 1  # the socket's SO_RCVLOWAT

    # -- sending ---------------------------------------------------------------------
    async def send(self, header: FrameHeader, payload: Buffer = b"") -> None:
        await self.send_many([(header, payload)])

    async def send_many(self, frames: Iterable[tuple[FrameHeader, Buffer]]) -> None:
        """Gathered writes of up to ``transport.window_blocks`` frames, or GATHER_BYTES of
        payload, each: a frame's header (and checksum) is made just before its write, so
        the bytes of the frames before it are already on their way meanwhile. The first
        write is one frame, so that the receiver starts while the rest are checksummed."""
        frames = iter(frames)
        limit = 1
        while True:
            views: list[memoryview] = []
            count = payload_bytes = 0
            for header, payload in frames:
                payload_view = self._outgoing_payload(header, payload)
                views.append(memoryview(self._signed(header, payload_view).pack()))
                if header.length:
                    views.append(payload_view)
                count, payload_bytes = count + 1, payload_bytes + header.length
                if count == limit or payload_bytes >= GATHER_BYTES:
                    break
            if not views:
                return
            await self._write(views)
            limit = self._frames_per_write

    async def _write(self, views: list[memoryview]) -> None:
        self._check_usable()
        index, progressed = 0, False
        try:
            while index < len(views):
                try:
                    sent = self._sock.sendmsg(views[index:])
                except (BlockingIOError, InterruptedError):
                    await self._ready(self._loop.add_writer, self._loop.remove_writer)
                    continue
                except OSError as exc:
                    raise self._failure(exc) from exc
                progressed = True
                while sent:
                    if sent >= views[index].nbytes:
                        sent -= views[index].nbytes
                        index += 1
                    else:
                        views[index], sent = views[index][sent:], 0
        except BaseException:
            if progressed and index < len(views):
                self._break("a send stopped in the middle of a frame")
            raise

    # -- receiving -------------------------------------------------------------------
    async def recv_header(self) -> FrameHeader:
        self._expect_header()
        header_view = memoryview(self._header)
        while self._header_bytes < HEADER_BYTES:  # progress is kept: a cancelled wait loses nothing
            count = await self._receive([header_view[self._header_bytes :]], HEADER_BYTES - self._header_bytes)
            if count == 0:
                self._break("the peer closed the connection")
                if self._header_bytes == 0:
                    raise TransferFailed(f"the peer {self.peer} closed the channel.")
                raise TransferFailed(f"the peer {self.peer} closed the connection {self._header_bytes} bytes into a frame header.")
            self._header_bytes += count
        self._header_bytes = 0
        return self._accept_header(self._header)

    async def recv_payload(self, into: memoryview) -> None:
        """Receive into ``into``; what arrives beyond it is the next header, read by the same
        system call into the header buffer (payload bytes are never staged)."""
        view = self._incoming_payload(into)
        header_view = memoryview(self._header)
        got, total = 0, view.nbytes
        try:
            while got < total:
                count = await self._receive([view[got:], header_view[self._header_bytes :]], min(total - got, WAKE_BYTES))
                if count == 0:
                    self._break("the peer closed the connection")
                    raise TransferFailed(
                        f"the peer {self.peer} closed the connection {got} bytes into a {total}-byte payload; the frame was dropped."
                    )
                beyond = max(0, got + count - total)
                got += count - beyond
                self._header_bytes += beyond
        except BaseException:
            if got < total:
                self._break("a receive stopped in the middle of a payload")
            raise
        self._pending_length = None

    async def _receive(self, buffers: list[memoryview], wake_bytes: int) -> int:
        """One scattered read; when nothing is there, wait until ``wake_bytes`` are."""
        self._check_usable()
        while True:
            try:
                return self._sock.recvmsg_into(buffers)[0]
            except (BlockingIOError, InterruptedError):
                self._wake_at(wake_bytes)
                await self._ready(self._loop.add_reader, self._loop.remove_reader)
            except OSError as exc:
                raise self._failure(exc) from exc

    # -- plumbing --------------------------------------------------------------------
    def _wake_at(self, nbytes: int) -> None:
        """Be woken when ``nbytes`` have arrived (or the peer closes), not at every segment."""
        if nbytes != self._wake_bytes:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self._wake_bytes = nbytes

    async def _ready(self, watch: Callable, unwatch: Callable) -> None:
        # by descriptor: given the socket object, the loop formats its repr (two system
        # calls) into an exception it swallows, on every add and on every remove of one
        # it does not watch
        waiter = self._loop.create_future()
        watch(self._fd, _wake, waiter)
        self._waiters.add(waiter)
        try:
            await waiter
        finally:
            self._waiters.discard(waiter)
            if not self._closed:
                unwatch(self._fd)

    def _failure(self, exc: OSError) -> TransferFailed:
        self._break("the connection broke")
        return TransferFailed(f"the connection to {self.peer} broke: {exc.strerror or exc}.")

    async def close(self) -> None:
        if not self._mark_closed():
            return
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(TransferFailed(f"the channel to {self.peer} was closed."))
        self._sock.close()


class _TlsChannel(_TcpChannel):
    """A TCP channel through TLS: ``secure`` runs the TLS handshake, writes and reads go
    through the SSL socket (which neither gathers nor scatters)."""

    @property
    def encrypted(self) -> bool:
        return True

    def _wake_at(self, nbytes: int) -> None:
        """OpenSSL may already hold part of the record that ends a payload: fewer bytes
        than the payload still to come may be left to arrive, so wake a record sooner."""
        super()._wake_at(max(1, nbytes - TLS_RECORD_BYTES))

    async def secure(self) -> None:
        while True:
            try:
                self._sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self._ready(self._loop.add_reader, self._loop.remove_reader)
            except ssl.SSLWantWriteError:
                await self._ready(self._loop.add_writer, self._loop.remove_writer)
            except (ssl.SSLError, OSError) as exc:
                self._break("the TLS handshake failed")
                raise TransferFailed(f"the TLS handshake with {self.peer} failed: {getattr(exc, 'reason', None) or exc}.") from exc

    async def _write(self, views: list[memoryview]) -> None:
        """Small parts (headers, control payloads) are joined into one TLS write; a large
        payload goes as it is (the SSL socket cuts it into records)."""
        self._check_usable()
        pending: list[memoryview] = []
        small = bytearray()
        for view in views:
            if view.nbytes < SMALL_WRITE_BYTES:
                small += view
                continue
            if small:
                pending.append(memoryview(bytes(small)))
                small.clear()
            pending.append(view)
        if small:
            pending.append(memoryview(bytes(small)))
        progressed = False
        try:
            for view in pending:
                sent = 0
                while sent < view.nbytes:
                    try:
                        sent += self._sock.send(view[sent:])
                        progressed = True
                    except ssl.SSLWantWriteError:
                        await self._ready(self._loop.add_writer, self._loop.remove_writer)
                    except ssl.SSLWantReadError:
                        await self._ready(self._loop.add_reader, self._loop.remove_reader)
                    except (ssl.SSLError, OSError) as exc:
                        raise self._failure(exc) from exc
        except BaseException:
            if progressed:
                self._break("a send stopped in the middle of a frame")
            raise

    async def _receive(self, buffers: list[memoryview], wake_bytes: int) -> int:
        """One read into the first buffer (decrypted bytes already held count first)."""
        self._check_usable()
        while True:
            try:
                return self._sock.recv_into(buffers[0])
            except ssl.SSLWantReadError:
                self._wake_at(wake_bytes)
                await self._ready(self._loop.add_reader, self._loop.remove_reader)
            except ssl.SSLWantWriteError:
                await self._ready(self._loop.add_writer, self._loop.remove_writer)
            except ssl.SSLZeroReturnError:
                return 0
            except (ssl.SSLError, OSError) as exc:
                raise self._failure(exc) from exc

    def _failure(self, exc: OSError) -> TransferFailed:
        self._break("the connection broke")
        return TransferFailed(f"the TLS connection to {self.peer} broke: {getattr(exc, 'reason', None) or exc.strerror or exc}.")


# parts below this size are joined into one TLS write
SMALL_WRITE_BYTES = 16 << 10
# the most a TLS record occupies on the wire: its header, 16 KiB of data, and what the cipher adds
TLS_RECORD_BYTES = 5 + (16 << 10) + 256


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TcpTransport(Transport):
    """Channels over TCP connections; one listening socket per transport."""

    scheme = "tcp"

    def __init__(self, config: TransportConfig, auth: PeerAuth | None = None) -> None:
        self._config = config
        self.auth = PeerAuth.from_config(config) if auth is None else auth
        self._registry = ChannelRegistry(config, self.auth)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None

    async def listen(self, host: str, port: int, on_channel: ChannelHandler) -> str:
        if self._listener is not None:
            raise InvalidArgument("this TCP transport is already listening.")
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setblocking(False)
            listener.bind((host, port))
            listener.listen(LISTEN_BACKLOG)
        except OSError as exc:
            listener.close()
            raise InvalidArgument(
                f"cannot listen for peers on {host}:{port}: {exc.strerror or exc}; set transport.host / transport.port."
            ) from exc
        self._listener = listener
        self._accepting = asyncio.get_running_loop().create_task(self._accept(listener, on_channel))
        return address_of(self.scheme, host, listener.getsockname()[1])

    async def _accept(self, listener: socket.socket, on_channel: ChannelHandler) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, remote = await loop.sock_accept(listener)
            except OSError as exc:
                # out of descriptors, or a connection reset before it was accepted: the
                # listener itself is fine, so try again shortly
                logger.warning("accepting a peer connection failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            tune(conn)
            peer = address_of(self.scheme, remote[0], remote[1])
            channel = self._channel(conn, peer, server_side=True)
            self._registry.serve(channel, on_channel, remote[0])

    def _channel(self, sock: socket.socket, peer: str, server_side: bool, server_hostname: str | None = None) -> _TcpChannel:
        context = self.auth.server_tls if server_side else self.auth.client_tls
        if context is None:
            return _TcpChannel(sock, peer, self._config.window_blocks, self._registry.forget)
        wrapped = context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False, server_hostname=server_hostname)
        return _TlsChannel(wrapped, peer, self._config.window_blocks, self._registry.forget)

    async def connect(self, address: str, timeout_s: float = 5.0) -> Channel:
        host, port = split_address(address, self.scheme)
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout_s)
        except (OSError, UnicodeError, asyncio.TimeoutError) as exc:  # UnicodeError: a name IDNA cannot encode (a label over 63)
            raise TransferFailed(f"cannot resolve the peer address {address}: {exc}.") from exc
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            tune(sock)
            await asyncio.wait_for(loop.sock_connect(sock, sockaddr), timeout_s)
        except asyncio.TimeoutError as exc:
            sock.close()
            raise TransferFailed(f"connecting to {address} timed out after {timeout_s:g} s.") from exc
        except OSError as exc:
            sock.close()
            raise TransferFailed(f"cannot connect to {address}: {exc.strerror or exc}.") from exc
        except BaseException:
            sock.close()
            raise
        return await self._registry.connected(self._channel(sock, address, server_side=False, server_hostname=host), timeout_s)

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        await self._registry.close()
