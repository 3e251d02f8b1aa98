"""The `Transport` interface: ordered, reliable message channels between daemons.

    Transport                       opens channels; one per daemon
    ├── TcpTransport   (tcp.py)     asyncio sockets, zero-copy sendall / recv_into
    ├── UcxTransport   (ucx.py)     UCX through ucxx (RDMA, shared memory, TCP underneath)
    └── MemoryTransport (below)     in-process queues, for unit tests of what runs on top

    Channel                         one connection; messages arrive in the order sent
      send(header, payload)         one message; the payload is ``header.length`` bytes
      send_many(frames)             several, pipelined where the transport can
                                    (both return when the payload buffers may be reused:
                                    over UCX, once the peer received them, so a large
                                    send waits for the peer to post its receive)
      secure()                      the TLS handshake, where the channel has TLS
      recv_header()                 the next message's header, already checked
      recv_payload(into)            its payload, received straight into ``into``
      start_payload(into)           the same, returning once the receive is posted: an
                                    awaitable that resolves when the payload has landed
                                    (UCX posts many before any lands; TCP lands it at once)
      verify(header, payload)       its payload checked against the header (and the seal)
      close()

A channel's ``seal`` (transport/auth.py), set once its handshake authenticated the other
end without TLS, signs every frame sent and checks every frame received: ``verify`` is
where a received payload's checksum and MAC are both checked, before anything counts it.
``role`` is what the other end authenticated as (an accepted channel's: "daemon" may ask
for everything, "reader" only to fetch).

A message is a `FrameHeader` (transport/wire.py) followed by its payload. The split
between ``recv_header`` and ``recv_payload`` is what lets a receiver read the key, find
the destination slot it reserved for that block and receive into the slot itself: no
staging copy. One task sends on a channel at a time and one task receives (the owner
of a channel is whoever holds it: `transport/peer.py`).

Addresses are URLs: ``tcp://host:port``, ``ucx://host:port``, ``memory://name``. Errors
are translated at this edge into `TransferFailed` (the peer went away, a deadline passed)
or `CorruptBlock` (a header failed its checks).
"""

from __future__ import annotations

import abc
import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from kvstore.errors import CorruptBlock, InvalidArgument, TransferFailed
from kvstore.transport.auth import PeerAuth
from kvstore.transport.wire import HEADER_BYTES, FrameHeader

if TYPE_CHECKING:
    from kvstore.transport.auth import Seal

__all__ = ["LANDED", "Buffer", "Channel", "Transport", "ChannelHandler", "MemoryTransport", "split_address"]

Buffer = bytes | bytearray | memoryview


class Channel(abc.ABC):
    peer: str = ""  # the remote address, for messages and logs
    seal: Seal | None = None  # set by the handshake where frames carry a MAC
    role: str = "daemon"  # what the other end authenticated as (set by the accepting side's handshake)

    async def secure(self) -> None:  # noqa: B027 (only a TLS channel has anything to do)
        """Complete the channel's TLS handshake, where it has TLS (before any frame)."""

    @property
    def encrypted(self) -> bool:
        """Whether TLS protects this channel (its frames then carry no MAC)."""
        return False

    def verify(self, header: FrameHeader, payload: Buffer) -> None:
        """CorruptBlock unless ``payload`` is what ``header`` announced: its length, the
        checksum and, on a sealed channel, the MAC (bytes changed or forged on the way)."""
        header.verify(payload)
        if self.seal is not None:
            self.seal.verify(header, payload)

    @abc.abstractmethod
    async def send(self, header: FrameHeader, payload: Buffer = b"") -> None: ...

    async def send_many(self, frames: Iterable[tuple[FrameHeader, Buffer]]) -> None:
        """``frames`` may be a generator: it is consumed as the window allows, so a sender
        computes the checksums of later blocks while earlier ones are in flight."""
        for header, payload in frames:
            await self.send(header, payload)

    @abc.abstractmethod
    async def recv_header(self) -> FrameHeader: ...

    @abc.abstractmethod
    async def recv_payload(self, into: memoryview) -> None:
        """Receive the payload of the header just read; ``len(into)`` must equal its length."""

    async def start_payload(self, into: memoryview) -> Awaitable[None]:
        """Start receiving the payload of the header just read into ``into``; the returned
        awaitable (with ``done()`` and ``result()``, and ``add_done_callback`` while not
        done, as a future has) resolves once it has landed. The next ``recv_header`` may come before
        that: a transport that can (UCX) keeps many receives posted, so that the sender's
        payloads land without waiting for the receiver's turn of the event loop. Every
        started payload must be awaited, oldest first, before its buffer is read; a
        channel closed meanwhile fails them, and nothing lands in a buffer after ``close``
        returns."""
        await self.recv_payload(into)
        return LANDED

    async def recv_bytes(self, header: FrameHeader) -> bytes:
        """The payload of a small message (control, error) as bytes, verified."""
        buffer = bytearray(header.length)
        if header.length:
            await self.recv_payload(memoryview(buffer))
        self.verify(header, buffer)
        return bytes(buffer)

    async def discard_payload(self, header: FrameHeader) -> None:
        """Consume a payload nobody will keep (a block that found no slot)."""
        if header.length:
            await self.recv_payload(memoryview(bytearray(header.length)))

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    def touching_buffers(self) -> bool:
        """Whether a send or receive this channel started may still read or fill a buffer."""
        return False

    async def settled(self) -> None:  # noqa: B027 (most channels have nothing to wait for)
        """Return once no send or receive this channel started can still read or fill a
        buffer. Whoever frees buffers a channel used after a broken-off conversation waits
        for this first; it returns at once where every operation ends before its call
        returns (TCP, memory), and waits without bound where one may outlive its caller
        (UCX after a cancel): a slot is never freed on a timer."""


ChannelHandler = Callable[[Channel], Awaitable[None]]


class _Landed:
    """An awaitable that is already done: a payload received before start_payload returned."""

    def done(self) -> bool:
        return True

    def result(self) -> None:
        return None

    def __await__(self):
        return iter(())


LANDED = _Landed()  # what start_payload returns for a payload already received


class Transport(abc.ABC):
    scheme: str = ""
    auth: PeerAuth = PeerAuth()  # how this node and its peers authenticate (none: an in-process transport)

    @abc.abstractmethod
    async def listen(self, host: str, port: int, on_channel: ChannelHandler) -> str:
        """Serve incoming channels with ``on_channel`` (one task each); returns the address
        peers connect to (port 0 picks a free port)."""

    @abc.abstractmethod
    async def connect(self, address: str, timeout_s: float = 5.0) -> Channel: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening and close every channel this transport opened or accepted."""


def split_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise InvalidArgument(f"transport address {address!r} does not start with {prefix}.")
    host, _, port = address[len(prefix) :].rpartition(":")
    # ASCII digits only: str.isdigit() also takes "²" (which int() refuses) and "٣"
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
        raise InvalidArgument(f"transport address {address!r} is not {prefix}host:port with a port in [1, 65535].")
    return host.strip("[]"), int(port)


class _MemoryChannel(Channel):
    """One end of an in-process pipe; the other end's inbox is our outbox."""

    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue, peer: str) -> None:
        self._inbox, self._outbox, self.peer = inbox, outbox, peer
        self._pending: bytes | None = None
        self._closed = False

    async def send(self, header: FrameHeader, payload: Buffer = b"") -> None:
        if self._closed:
            raise TransferFailed(f"the channel to {self.peer} is closed.")
        if len(payload) != header.length:
            raise InvalidArgument(f"a frame announced {header.length} bytes with a {len(payload)}-byte payload.")
        await self._outbox.put((header.pack(), bytes(payload)))

    async def recv_header(self) -> FrameHeader:
        item = await self._inbox.get()
        if item is None:
            self._closed = True
            raise TransferFailed(f"the peer {self.peer} closed the channel.")
        raw, self._pending = item
        if len(raw) != HEADER_BYTES:
            raise CorruptBlock("a memory frame header has the wrong size.")
        return FrameHeader.unpack(raw)

    async def recv_payload(self, into: memoryview) -> None:
        payload, self._pending = self._pending, None
        if payload is None or len(payload) != len(into):
            raise InvalidArgument("recv_payload must follow recv_header with a buffer of the announced length.")
        into[:] = payload

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._outbox.put(None)


class MemoryTransport(Transport):
    """Channels between transports of one process, registered by name."""

    scheme = "memory"
    _listeners: dict[str, MemoryTransport] = {}
    _names = itertools.count(1)

    def __init__(self) -> None:
        self._handler: ChannelHandler | None = None
        self._address = ""
        self._tasks: set[asyncio.Task] = set()
        self._channels: list[_MemoryChannel] = []

    async def listen(self, host: str, port: int, on_channel: ChannelHandler) -> str:
        self._handler = on_channel
        self._address = f"memory://{host}-{port or next(self._names)}"
        self._listeners[self._address] = self
        return self._address

    async def connect(self, address: str, timeout_s: float = 5.0) -> Channel:
        server = self._listeners.get(address)
        if server is None or server._handler is None:
            raise TransferFailed(f"nothing listens at {address}.")
        to_server, to_client = asyncio.Queue(), asyncio.Queue()
        client_end = _MemoryChannel(to_client, to_server, address)
        server_end = _MemoryChannel(to_server, to_client, "memory://client")
        self._channels.append(client_end)
        server._channels.append(server_end)
        task = asyncio.get_running_loop().create_task(server._handler(server_end))
        server._tasks.add(task)
        task.add_done_callback(server._tasks.discard)
        return client_end

    async def close(self) -> None:
        self._listeners.pop(self._address, None)
        for channel in self._channels:
            await channel.close()
        for task in list(self._tasks):
            task.cancel()
        self._channels.clear()
