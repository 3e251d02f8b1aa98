"""Talking to a peer daemon over a `Channel`: requests, replies, block streams, a pool.

A conversation on a channel is one transfer at a time: a CONTROL request, a CONTROL (or
ERROR) reply, then BLOCK frames in the direction the request names, closed by an END
each way where the protocol asks for one (transport/service.py has the requests).
Channels that finish a conversation cleanly go back to the pool for the next transfer to
that peer; a channel that broke off mid-stream (a deadline, a bad frame) is closed,
because the bytes still in flight would be read as the next conversation's.

Blocks go out ``window`` frames per ``send_many`` so that many are in flight (the
transport pipelines them), and come in straight into the caller's destination buffer:
the receiver reads the header, picks the slot reserved for that block, receives into it
and verifies the checksum before anything commits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Sequence

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

__all__ = ["leading", "send_control", "send_error", "recv_message", "request", "send_blocks", "recv_block_into", "buffer_of", "ChannelPool"]

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
    blocks: Sequence[tuple[int, bytes, Buffer]],
    window: int,
    first_layer: int = 0,
    num_layers: int = 0,
) -> None:
    """Stream ``(sequence, key, payload)`` blocks, ``window`` frames per pipelined batch."""
    for start in range(0, len(blocks), window):
        frames = [
            (block_header(transfer_id, namespace, key, payload, sequence, first_layer, num_layers), payload)
            for sequence, key, payload in blocks[start : start + window]
        ]
        await channel.send_many(frames)


async def recv_block_into(channel: Channel, header: FrameHeader, into: memoryview) -> None:
    """Receive the payload of a BLOCK header into ``into`` and verify it (CorruptBlock)."""
    if header.length != len(into):
        raise CorruptBlock(f"block {header.key.hex()} arrived with {header.length} bytes where {len(into)} were expected.")
    await channel.recv_payload(into)
    header.verify(into)


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

