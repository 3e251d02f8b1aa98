"""A peer's conversation that stops making progress is broken off.

A peer that asks for blocks and stops reading, or reserves slots and stops sending, would
keep what it took for as long as it keeps the connection. ``Watched`` is the channel a
conversation runs on: every frame sent or received, and every payload that lands, pushes
the conversation's deadline ``idle_s`` further; when a deadline passes, the conversation
is cancelled, and it gives back what it holds as it always does when a channel breaks
(its slots freed once the channel settled, kvstore/transfers/settling.py). A slow peer
that keeps moving is never cut off; only one that stands still is.

Owner: the daemon's event loop; one per conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable, Iterator
from typing import Any

from kvstore.transport.base import Buffer, Channel
from kvstore.transport.wire import FrameHeader

__all__ = ["Watched"]


class Watched:
    """``channel`` for one conversation under ``deadline`` (an entered ``asyncio.timeout``),
    which each step of progress moves ``idle_s`` ahead."""

    def __init__(self, channel: Channel, deadline: asyncio.Timeout, idle_s: float) -> None:
        self.channel, self._deadline, self.idle_s = channel, deadline, idle_s
        self.progressed()

    def __getattr__(self, name: str) -> Any:  # peer, touching_buffers, settled, close, verify…
        return getattr(self.channel, name)

    def allow_idle(self, idle_s: float) -> None:
        """A conversation whose peer may rightly pause longer (a producer computing layers)."""
        self.idle_s = idle_s
        self.progressed()

    def progressed(self, _: object = None) -> None:
        # a payload may land after its conversation ended, when the deadline is spent
        with contextlib.suppress(RuntimeError):
            if not self._deadline.expired():
                self._deadline.reschedule(asyncio.get_running_loop().time() + self.idle_s)

    async def send(self, header: FrameHeader, payload: Buffer = b"") -> None:
        await self.channel.send(header, payload)
        self.progressed()

    async def send_many(self, frames: Iterable[tuple[FrameHeader, Buffer]]) -> None:
        def counted() -> Iterator[tuple[FrameHeader, Buffer]]:
            for frame in frames:
                yield frame
                self.progressed()  # the transport took the previous frame: the window moved

        await self.channel.send_many(counted())
        self.progressed()

    async def recv_header(self) -> FrameHeader:
        header = await self.channel.recv_header()
        self.progressed()
        return header

    async def recv_bytes(self, header: FrameHeader) -> bytes:
        payload = await self.channel.recv_bytes(header)
        self.progressed()
        return payload

    async def discard_payload(self, header: FrameHeader) -> None:
        await self.channel.discard_payload(header)
        self.progressed()

    async def start_payload(self, into: memoryview) -> Awaitable[None]:
        landing = await self.channel.start_payload(into)
        if landing.done():
            self.progressed()
        else:
            landing.add_done_callback(self.progressed)
        return landing
