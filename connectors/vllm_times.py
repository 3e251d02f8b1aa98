"""How long each of vLLM's calls into the connector takes, written where a profiler reads it.

With ``hook_times_dir`` set in ``kv_connector_extra_config``, each connector half (the
scheduler's, each worker's) sums the wall time and the number of calls of every vLLM hook
it serves, on the thread vLLM calls it from, and rewrites
``<dir>/<role>-<pid>.json`` at most once a second and when it closes:

    {"role": "worker", "pid": 1234, "hooks": {"save_kv_layer": {"calls": 80, "seconds": 0.0123}, ...},
     "counters": {...the half's SchedulerCounters / WorkerCounters...}}

A reader takes the difference of two snapshots to get a window's cost (bench.connector_cost).
The file is replaced atomically (written beside it, then renamed), so a reader never sees
half of one. Without the setting nothing is timed or written.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["HookTimes", "timed_hook"]

_WRITE_INTERVAL_S = 1.0
F = TypeVar("F", bound=Callable[..., Any])


class HookTimes:
    def __init__(self, directory: str, role: str, counters: Callable[[], Any]) -> None:
        self._path = Path(directory) / f"{role}-{os.getpid()}.json"
        self._role = role
        self._counters = counters  # the half's counters dataclass, read at each write
        self._calls: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._written_at = 0.0

    def add(self, hook: str, seconds: float) -> None:
        self._calls[hook] = self._calls.get(hook, 0) + 1
        self._seconds[hook] = self._seconds.get(hook, 0.0) + seconds
        now = time.monotonic()
        if now - self._written_at >= _WRITE_INTERVAL_S:
            self.write()

    def write(self) -> None:
        self._written_at = time.monotonic()
        hooks = {hook: {"calls": calls, "seconds": self._seconds[hook]} for hook, calls in self._calls.items()}
        counters = self._counters()
        snapshot = {
            "role": self._role,
            "pid": os.getpid(),
            "hooks": hooks,
            "counters": dataclasses.asdict(counters) if dataclasses.is_dataclass(counters) else {},
        }
        temporary = self._path.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps(snapshot))
            temporary.replace(self._path)
        except OSError:
            pass  # a profiler's file never fails an engine step


def timed_hook(method: F) -> F:
    """Time a connector hook into the instance's ``_hook_times`` (when it has one)."""
    name = method.__name__

    @functools.wraps(method)
    def hook(self, *args: Any, **kwargs: Any) -> Any:
        times: HookTimes | None = self._hook_times
        if times is None:
            return method(self, *args, **kwargs)
        began = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            times.add(name, time.perf_counter() - began)

    return hook  # type: ignore[return-value]
