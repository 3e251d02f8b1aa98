"""What the network transports share: the frame bookkeeping of a channel, the channels a
transport owns, the tasks that serve accepted ones, and how addresses and payload
buffers are read.

A transport owns every channel it opened or accepted, so that ``Transport.close`` can end
them all (a channel leaves the registry when it closes: its ``close`` calls ``forget``);
an accepted channel is served by the listener's handler in a task of its own
and closed when that handler returns (the handler owns the channel for its lifetime).
The handler sees a channel only once its handshake authenticated the other end
(transport/auth.py); before that, the registry refuses a channel over
``transport.max_peer_channels`` (or over ``max_peer_channels_per_source`` from one host)
at once, and closes one whose handshake has not finished within ``handshake_timeout_s``.
All of it runs on the event loop's thread: the registry has no lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvstore.errors import CorruptBlock, InvalidArgument, KVStoreError, TransferFailed
from kvstore.transport.auth import PeerAuth, RefusalLog, authenticate_client, authenticate_server, source_of
from kvstore.transport.base import Buffer, Channel, ChannelHandler
from kvstore.transport.config import TransportConfig
from kvstore.transport.wire import FrameHeader

__all__ = ["ChannelRegistry", "FramedChannel", "address_of", "byte_view"]

logger = logging.getLogger(__name__)

CLOSE_GRACE_S = 1.0  # how long handlers woken by a closing transport get to finish


def address_of(scheme: str, host: str, port: int) -> str:
    """The URL peers connect to; an IPv6 host is bracketed (``split_address`` strips them)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def byte_view(buffer: Buffer) -> memoryview:
    """``buffer`` as flat bytes without a copy (a tensor's memoryview may be typed or shaped)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise InvalidArgument("a transport payload must be one contiguous buffer.")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class FramedChannel(Channel):
    """A channel's frame bookkeeping: the payload length the last header announced, and
    whether the stream can still be trusted. A corrupt header, or a frame interrupted
    halfway, puts the stream out of step for good: later calls fail rather than read a
    payload as a header."""

    def __init__(self, peer: str, forget: Callable[[Channel], None]) -> None:
        self.peer, self._forget = peer, forget  # forget: the owning registry's
        self._pending_length: int | None = None  # the payload recv_payload must take next
        self._broken = ""  # why the stream is out of step
        self._closed = False

    def _check_usable(self) -> None:
        if self._closed:
            raise TransferFailed(f"the channel to {self.peer} is closed.")
        if self._broken:
            raise TransferFailed(f"the channel to {self.peer} is out of step ({self._broken}); open a new one.")

    def _break(self, reason: str) -> None:
        self._broken = self._broken or reason

    def _signed(self, header: FrameHeader, payload: memoryview) -> FrameHeader:
        """``header`` as it goes out: with its counter and MAC on a sealed channel."""
        return header if self.seal is None else self.seal.sign(header, payload)

    def _outgoing_payload(self, header: FrameHeader, payload: Buffer) -> memoryview:
        view = byte_view(payload)
        if view.nbytes != header.length:
            raise InvalidArgument(f"a frame announced {header.length} bytes with a {view.nbytes}-byte payload.")
        return view

    def _expect_header(self) -> None:
        self._check_usable()
        if self._pending_length:
            raise InvalidArgument("recv_header was called before the previous frame's payload was received.")

    def _accept_header(self, raw: Buffer) -> FrameHeader:
        try:
            header = FrameHeader.unpack(raw)
            if self.seal is not None:
                self.seal.check_order(header)
        except CorruptBlock:
            self._break("a frame header failed its checks")
            raise
        self._pending_length = header.length
        return header

    def _incoming_payload(self, into: memoryview) -> memoryview:
        view = byte_view(into)
        if self._pending_length is None or view.nbytes != self._pending_length:
            raise InvalidArgument("recv_payload must follow recv_header with a buffer of the announced length.")
        return view

    def _mark_closed(self) -> bool:
        """True the first time: the caller then releases what the channel holds."""
        if self._closed:
            return False
        self._closed = True
        self._forget(self)
        return True


class ChannelRegistry:
    """The live channels of one transport, and the handler tasks serving accepted ones once
    they authenticated."""

    def __init__(self, config: TransportConfig, auth: PeerAuth) -> None:
        self.config, self.auth = config, auth
        self.refusals = RefusalLog(auth.on_refused)
        self._channels: set[Channel] = set()
        self._tasks: set[asyncio.Task] = set()
        self._accepted: dict[str, int] = {}  # source host → accepted channels open

    def adopt(self, channel: Channel) -> Channel:
        self._channels.add(channel)
        return channel

    async def connected(self, channel: Channel, timeout_s: float) -> Channel:
        """Adopt a channel this transport opened, once its handshake authenticated the
        peer (transport/auth.py); closed, and the refusal raised, if it did not."""
        self.adopt(channel)
        try:
            await authenticate_client(channel, self.auth, timeout_s)
        except BaseException:
            await channel.close()
            raise
        return channel

    def forget(self, channel: Channel) -> None:
        self._channels.discard(channel)

    def serve(self, channel: Channel, on_channel: ChannelHandler, source: str = "") -> None:
        """Authenticate ``channel`` and run ``on_channel(channel)`` in a task; close the
        channel when it returns. ``source``: the host it came from, for the per-source limit."""
        source = source or source_of(channel.peer)
        total = sum(self._accepted.values())
        if total >= self.config.max_peer_channels or self._accepted.get(source, 0) >= self.config.max_peer_channels_per_source:
            which = "transport.max_peer_channels" if total >= self.config.max_peer_channels else "transport.max_peer_channels_per_source"
            self.refusals.refused(channel.peer, "limit", f"{which} channels are open already")
            asyncio.get_running_loop().create_task(channel.close())
            return
        self._accepted[source] = self._accepted.get(source, 0) + 1
        self.adopt(channel)
        task = asyncio.get_running_loop().create_task(self._serve(channel, on_channel, source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, channel: Channel, on_channel: ChannelHandler, source: str) -> None:
        try:
            established = await authenticate_server(channel, self.auth, self.config.handshake_timeout_s, self.refusals)
            if established is not None:
                channel.role = established.role
                await on_channel(channel)
        except KVStoreError as exc:
            logger.info("the channel from %s ended: %s", channel.peer, exc)
        except Exception:
            logger.exception("the handler of the channel from %s failed", channel.peer)
        finally:
            self._accepted[source] -= 1
            if not self._accepted[source]:
                del self._accepted[source]
            await channel.close()

    async def close(self) -> None:
        """Close every channel, which wakes their handlers with TransferFailed; cancel the
        handlers that have not ended within CLOSE_GRACE_S of that."""
        for channel in list(self._channels):
            await channel.close()
        if not self._tasks:
            return
        _, running = await asyncio.wait(list(self._tasks), timeout=CLOSE_GRACE_S)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
