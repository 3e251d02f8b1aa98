"""Talking to a peer daemon over a `Channel`: requests, replies, block streams, a pool.

A conversation on a channel is one transfer at a time: a CONTROL request, a CONTROL (or
ERROR) reply, then BLOCK frames in the direction the request names, closed by an END
each way where the protocol asks for one (kvstore/transfers/service.py has the requests).
Channels that finish a conversation cleanly go back to the pool for the next transfer to
that peer; a channel that broke off mid-stream (a deadline, a bad frame) is closed,
because the bytes still in flight would be read as the next conversation's.

Blocks go out through one ``send_many`` per stream, which keeps ``window`` frames in
flight, and come in straight into the caller's destination buffer: the receiver reads
the header, picks the slot reserved for that block, starts the receive into it (`Landing`
keeps up to ``window`` of them posted) and verifies each checksum once its payload has
landed, before anything commits it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch

from kvstore.errors import CorruptBlock, InvalidArgument, KVStoreError, TransferFailed, raise_error
from kvstore.transport.base import Buffer, Channel, Transport
from kvstore.transport.wire import (
    FrameHeader,
    FrameKind,
    block_header,
    control_header,
    decode_control,
    encode_control,
)

__all__ = ["leading", "send_control", "send_error", "recv_message", "request", "send_blocks", "Landing", "buffer_of", "ChannelPool"]

logger = logging.getLogger(__name__)


def buffer_of(view: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 tensor (a slot in shared memory)."""
    return memoryview(view.numpy()).cast("B")


def leading(order: Sequence[int], verified: set[int]) -> int:
    """How many entries of ``order``, from the first, are in ``verified``: the prefix of a
    chain that can be committed (a block after a missing one would be unreachable)."""
    count = 0
    for seq in order:
        if seq not in verified:
            break
        count += 1
    return count


async def send_control(channel: Channel, transfer_id: int, message: dict[str, Any], kind: FrameKind = FrameKind.CONTROL) -> None:
    payload = encode_control(message)
    await channel.send(control_header(kind, transfer_id, payload), payload)


async def send_error(channel: Channel, transfer_id: int, error: KVStoreError) -> None:
    payload = encode_control([type(error).__name__, str(error)])
    with contextlib.suppress(KVStoreError, OSError):
        await channel.send(control_header(FrameKind.ERROR, transfer_id, payload), payload)


async def recv_message(channel: Channel, expect: FrameKind = FrameKind.CONTROL) -> Any:
    """The next message, which must be of kind ``expect``; an ERROR from the peer is raised
    as the error it names."""
    header = await channel.recv_header()
    if header.kind is FrameKind.ERROR:
        kind, sentence = decode_control(header, await channel.recv_bytes(header))
        raise_error(kind, f"the peer {channel.peer} refused: {sentence}")
    if header.kind is not expect:
        raise TransferFailed(f"expected a {expect.name} frame from {channel.peer}, got {header.kind.name}.")
    return decode_control(header, await channel.recv_bytes(header))


async def request(channel: Channel, transfer_id: int, message: dict[str, Any]) -> Any:
    await send_control(channel, transfer_id, message)
    return await recv_message(channel)


async def send_blocks(
    channel: Channel,
    transfer_id: int,
    namespace: bytes,
    blocks: Sequence[tuple[int, bytes, Buffer, int | None]],
    first_layer: int = 0,
    num_layers: int = 0,
) -> None:
    """Stream ``(sequence, key, payload, checksum)`` blocks; the transport keeps its window
    of frames in flight. A block sent with the checksum its writer committed is checked by
    the receiver against those bytes; one with None is checksummed when the window has
    room for it."""
    await channel.send_many(
        (block_header(transfer_id, namespace, key, payload, sequence, first_layer, num_layers, checksum), payload)
        for sequence, key, payload, checksum in blocks
    )


class Landing:
    """Block payloads started on a channel and not yet verified, oldest first.

    ``start`` posts the receive of a BLOCK header's payload into its slot and returns once
    at most ``window`` are outstanding. As the oldest land (whether or not the caller is
    waiting on the channel meanwhile) their checksums are checked, in order, and
    ``landed(header, ok)`` is called, ok False for a block whose bytes failed it; what
    ``landed`` raises, or a receive that failed, is raised by the next ``start`` or
    ``finish``. ``finish`` waits for every started payload."""

    def __init__(self, channel: Channel, window: int, landed: Callable[[FrameHeader, bool], None]) -> None:
        self.channel, self.window, self.landed = channel, window, landed
        self._pending: collections.deque[tuple[FrameHeader, memoryview, Any]] = collections.deque()
        self._error: BaseException | None = None

    async def start(self, header: FrameHeader, into: memoryview) -> None:
        if header.length != len(into):
            raise CorruptBlock(f"block {header.key.hex()} arrived with {header.length} bytes where {len(into)} were expected.")
        self._raise_error()
        landing = await self.channel.start_payload(into)
        self._pending.append((header, into, landing))
        if not landing.done():
            landing.add_done_callback(self._settle)
        self._settle()
        await self._wait(self.window)

    async def finish(self) -> None:
        await self._wait(0)

    async def _wait(self, keep: int) -> None:
        while len(self._pending) > keep and self._error is None:
            await asyncio.wait([self._pending[0][2]])
            self._settle()
        self._raise_error()

    def _settle(self, _: object = None) -> None:
        """Verify the payloads that have landed, oldest first, up to the first still out."""
        while self._pending and self._error is None and self._pending[0][2].done():
            header, into, landing = self._pending.popleft()
            try:
                landing.result()
                ok = True
                try:
                    self.channel.verify(header, into)
                except CorruptBlock as exc:
                    logger.warning("dropped a block from %s: %s", self.channel.peer, exc)
                    ok = False
                self.landed(header, ok)
            except BaseException as exc:  # kept for the caller's next start or finish
                self._error = exc

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error


class ChannelPool:
    """Idle channels per peer address, reused one conversation at a time.

    Owner: the daemon's event loop.
    """

    def __init__(self, transport: Transport, connect_timeout_s: float, max_idle_per_peer: int = 4) -> None:
        self.transport = transport
        self.connect_timeout_s = connect_timeout_s
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[str, list[Channel]] = {}
        self._open: set[Channel] = set()

    @contextlib.asynccontextmanager
    async def channel(self, address: str) -> AsyncIterator[Channel]:
        """A channel to ``address`` for one conversation; it returns to the pool only when
        the conversation ends without an exception."""
        channel = await self.checkout(address)
        try:
            yield channel
        except BaseException:
            await self.discard(channel)
            raise
        self.checkin(address, channel)

    async def checkout(self, address: str) -> Channel:
        idle = self._idle.get(address)
        if idle:
            return idle.pop()
        try:
            channel = await self.transport.connect(address, self.connect_timeout_s)
        except InvalidArgument:
            raise
        except KVStoreError as exc:
            raise TransferFailed(f"cannot reach the peer at {address}: {exc}") from exc
        self._open.add(channel)
        return channel

    def checkin(self, address: str, channel: Channel) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) < self.max_idle_per_peer:
            idle.append(channel)
        else:
            asyncio.get_running_loop().create_task(self.discard(channel))

    async def discard(self, channel: Channel) -> None:
        self._open.discard(channel)
        for idle in self._idle.values():
            if channel in idle:
                idle.remove(channel)
        with contextlib.suppress(Exception):
            await channel.close()

    async def close(self) -> None:
        for channel in list(self._open):
            await self.discard(channel)
        self._idle.clear()
