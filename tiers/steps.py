"""Tier operations that may wait for I/O, written once for both kinds of owner.

Some operations must wait for an NVMe transfer before they can finish: a promotion for a
reader, the demotion that makes room for a writer. Each of them is a generator of
*steps*: it yields the list of I/O futures it needs finished (from the NVMe tier's
thread pool) and is resumed once they are. Between steps the manager's state is
consistent and its owner may run other operations, so an owner that must keep serving
(the daemon's event loop) awaits the futures (``kvstore.steps.drive``) while a
synchronous owner (tests, the simulator, tools) blocks on them with ``run``.

Whatever an operation holds across a step is held by a record the manager keeps (an
in-flight move owns its destination slot, a hold keeps a block from eviction), so an
operation abandoned at a step (``close()`` on the generator, when its caller went away)
lets go of its holds in ``finally`` and leaves every move to finish on its own.
"""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import Future, wait
from typing import TypeVar

__all__ = ["Steps", "run"]

T = TypeVar("T")
Steps = Generator[list[Future], None, T]


def run(steps: Steps[T]) -> T:
    """Run an operation to its end, blocking on each step's futures."""
    try:
        waits = next(steps)
        while True:
            if waits:
                wait(waits)
            waits = steps.send(None)
    except StopIteration as done:
        return done.value
