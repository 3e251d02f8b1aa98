"""Event-driven UCX progress on the asyncio loop: kvstore's ``event`` progress mode.

ucxx progresses its worker in one of two ways, and each costs a daemon something:

    thread      a progress thread, plus a notifier thread that hands each batch of
                completions to the event loop: idle it sleeps, but every completion
                crosses two threads (on a 2-core host: 0.5-0.7x the throughput below)
    blocking    progress on the event loop, but its epoll reader is never re-armed and
                awaited requests poll: a core stays busy while any receive is posted,
                which a daemon's peer channels always have

``EventProgress`` keeps the worker on the loop and idles: the worker's epoll descriptor is
an asyncio reader; a round progresses the worker until it has nothing left, completes the
requests it watches (a future each, set on the loop: no thread hand-off), and then either
goes round again (for SPIN_S after the last work: a transfer in flight is polled, as
blocking mode would) or arms the worker and lets the loop sleep until UCX signals. Posting
a request starts a round, so nothing waits for an event that only progress would cause;
a tick every TICK_S covers what ucxx posts on its own (connection set-up, close).

ucxx itself runs in its ``blocking`` mode (no progress thread, no futures); ``install``
makes its contexts start an ``EventProgress`` for a loop where they would start their own
blocking progress. The descriptor, ``progress`` and ``arm`` are ucxx's worker API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

__all__ = ["EventProgress", "install", "progress_for", "close_all"]

logger = logging.getLogger(__name__)

SPIN_S = 0.002  # measured on loopback: 0.5 ms gave 0.6x the throughput, 2 ms all of it
TICK_S = 0.1  # what ucxx posts on its own is progressed within this (an idle worker costs 2% of a core at 0.01)

_progress: dict[asyncio.AbstractEventLoop, EventProgress] = {}


class EventProgress:
    """Progress of one ucxx worker on one event loop. Owner: that loop's thread."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._worker, self._loop = worker, loop
        self._watched: dict[Any, asyncio.Future] = {}  # request -> its completion
        self._scheduled = False
        self._last_work = 0.0
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        loop.add_reader(self._fd, self.kick)
        self._timer = loop.call_later(TICK_S, self._tick)
        self.kick()

    def watch(self, request: Any) -> asyncio.Future:
        """A future that resolves when ``request`` completes (with ucxx's exception when it
        failed)."""
        future = self._loop.create_future()
        self._watched[request] = future
        self.kick()
        return future

    def kick(self) -> None:
        """Run a round soon (once, however often it is asked)."""
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._round)

    def _round(self) -> None:
        self._scheduled = False
        worked = False
        while self._worker.progress():
            worked = True
        if self._watched:
            for request in [r for r in self._watched if r.completed]:
                worked = True
                future = self._watched.pop(request)
                if future.done():
                    continue
                try:
                    request.check_error()
                except Exception as exc:  # ucxx's, translated by whoever awaits it
                    future.set_exception(exc)
                else:
                    future.set_result(None)
        now = time.monotonic()
        if worked:
            self._last_work = now
        # arm() is False while UCX still has events to hand out: go round again then too
        if now - self._last_work < SPIN_S or not self._worker.arm():
            self.kick()

    def _tick(self) -> None:
        self.kick()
        self._timer = self._loop.call_later(TICK_S, self._tick)

    def close(self) -> None:
        """Stop progressing; requests still watched are cancelled (their channels are
        closed by now: nothing waits on them that would otherwise be woken)."""
        self._timer.cancel()
        self._loop.remove_reader(self._fd)
        for future in self._watched.values():
            future.cancel()
        self._watched.clear()


def install(ucxx: Any) -> None:
    """Have ucxx start an ``EventProgress`` for each event loop it progresses on."""
    context_class = ucxx._lib_async.application_context.ApplicationContext
    if getattr(context_class.continuous_ucx_progress, "kvstore_event_progress", False):
        return
    tasks = ucxx._lib_async.application_context.ProgressTasks
    get_event_loop = ucxx._lib_async.utils.get_event_loop

    def continuous_ucx_progress(self: Any, event_loop: asyncio.AbstractEventLoop | None = None) -> None:
        loop = event_loop if event_loop is not None else get_event_loop()
        if loop not in tasks:
            tasks[loop] = _progress[loop] = EventProgress(self.worker, loop)

    continuous_ucx_progress.kvstore_event_progress = True  # type: ignore[attr-defined]
    context_class.continuous_ucx_progress = continuous_ucx_progress


def progress_for(loop: asyncio.AbstractEventLoop) -> EventProgress | None:
    return _progress.get(loop)


def close_all() -> None:
    """Stop every loop's progress (before ucxx's context is reset)."""
    for progress in _progress.values():
        progress.close()
    _progress.clear()
