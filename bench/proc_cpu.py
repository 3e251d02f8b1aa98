"""CPU seconds that groups of processes spent over a window, from ``/proc``.

A bench names its processes by kind (``{"engine": [pid, …], "daemon": [pid, …]}``); each
pid counts with every process below it (a vLLM API server's engine core, a router's
workers). ``CpuWindow.take()`` reads user + system time of all of them at the start and
at the end; a process that started inside the window counts from zero, one that ended
inside it is lost (its parent's ``cutime`` gets it only once reaped) — a bench's
processes live through its windows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["CpuWindow", "process_tree", "cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK")
_PROC = Path("/proc")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system seconds) of ``pid``, or None once it has gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _parents() -> dict[int, int]:
    parents = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[0]
    return parents


def process_tree(roots: Iterable[int], parents: Mapping[int, int] | None = None) -> set[int]:
    """``roots`` and every process below them."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [pid for pid in roots if pid in parents]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    return {pid: stat[1] for pid in pids if (stat := _stat(pid)) is not None}


class CpuWindow:
    """CPU seconds per kind between ``start()`` and ``take()``."""

    def __init__(self, kinds: Mapping[str, Iterable[int]]) -> None:
        self._roots = {kind: list(pids) for kind, pids in kinds.items()}
        self._start: dict[str, dict[int, float]] = {}

    def _read(self) -> dict[str, dict[int, float]]:
        parents = _parents()
        return {kind: cpu_seconds(process_tree(roots, parents)) for kind, roots in self._roots.items()}

    def start(self) -> None:
        self._start = self._read()

    def take(self) -> dict[str, float]:
        """CPU seconds of each kind since ``start()`` (then the window starts again)."""
        end = self._read()
        spent = {kind: sum(seconds - self._start.get(kind, {}).get(pid, 0.0) for pid, seconds in now.items()) for kind, now in end.items()}
        self._start = end
        return spent
