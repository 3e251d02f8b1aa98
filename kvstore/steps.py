"""Running tier operations that may wait for NVMe I/O (tiers/steps.py) on the daemon's
event loop without ever blocking it.

``drive(steps)`` runs an operation up to its first step that really waits: most finish
there (a reserve with free slots, a lease of host blocks) and their result comes back at
once, with no task or coroutine made. Otherwise it returns a coroutine that awaits each
step's I/O futures and resumes the operation on the loop's thread. If that coroutine is
cancelled (its caller went away), the operation is closed at its step: it lets go of its
holds, and the I/O already started finishes on its own (the tier manager reaps it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import TypeVar

from kvstore.tiers.steps import Steps

__all__ = ["drive", "run_steps", "is_pending"]

T = TypeVar("T")


class _Pending:
    """An operation stopped at a step that waits; awaiting it runs it to the end."""

    __slots__ = ("steps", "waits")

    def __init__(self, steps: Steps, waits: list[Future]) -> None:
        self.steps, self.waits = steps, waits

    def __await__(self):
        return _finish(self.steps, self.waits).__await__()


def drive(steps: Steps[T]) -> T | Awaitable[T]:
    """The operation's result if it finishes without waiting, else an awaitable of it."""
    try:
        waits = next(steps)
        while not _pending(waits):
            waits = steps.send(None)
    except StopIteration as done:
        return done.value
    return _Pending(steps, waits)


async def run_steps(steps: Steps[T]) -> T:
    """The operation's result, awaited (for callers that are coroutines anyway)."""
    result = drive(steps)
    return await result if isinstance(result, _Pending) else result


def is_pending(result: object) -> bool:
    return isinstance(result, _Pending)


def _outcome_seen(waiting: asyncio.Future) -> None:
    if not waiting.cancelled():
        waiting.exception()


def _pending(waits: list[Future]) -> bool:
    return any(not future.done() for future in waits)


async def _finish(steps: Steps[T], waits: list[Future]) -> T:
    try:
        while True:
            pending = [asyncio.wrap_future(future) for future in waits if not future.done()]
            for waiting in pending:  # the operation reads the outcome from the I/O future itself
                waiting.add_done_callback(_outcome_seen)
            if pending:
                await asyncio.wait(pending)
            waits = steps.send(None)
    except StopIteration as done:
        return done.value
    except BaseException:
        steps.close()
        raise
