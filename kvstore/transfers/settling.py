"""Slots a broken-off transfer may still touch, freed only once it cannot.

A receive that UCX keeps posted after its caller gave up (a deadline, a bad frame) could
still land in its slot; a send could still read one. Whoever ends such a transfer hands
the freeing of its slots here: it runs at once where the channel touches no buffer any
more (always on TCP, and on UCX once every request ended), else when the channel says it
has settled — never on a timer (DESIGN decision 12). Until then the slots stay with the
transfer that took them, counted in ``num_waiting``.

Owner: the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvstore.transport.base import Channel

__all__ = ["Settling"]

logger = logging.getLogger(__name__)


class Settling:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_waiting(self) -> int:
        """Transfers whose slots wait for their channel to settle."""
        return len(self._tasks)

    def release_after(self, channel: Channel | None, release: Callable[[], None]) -> None:
        """Run ``release`` (which frees slots ``channel`` read or filled) once ``channel``
        can no longer touch them."""
        if channel is None or not channel.touching_buffers:
            release()
            return
        logger.warning("a transfer with %s broke off with requests in flight; its slots are freed once they end", channel.peer)
        task = asyncio.get_running_loop().create_task(self._release(channel, release))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, channel: Channel, release: Callable[[], None]) -> None:
        await channel.settled()
        release()

    def close(self) -> None:
        """The daemon stops: the tiers and their slots go with it."""
        for task in self._tasks:
            task.cancel()
