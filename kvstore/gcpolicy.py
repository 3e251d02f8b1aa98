"""The daemon's garbage collector: pauses bounded by what changed, not by what it holds.

A daemon keeps a few Python objects per cached block (its catalogue entry, its slot, the
set of its children), so CPython's full collection — which walks every tracked object,
and runs whenever a quarter of the long-lived objects is new, i.e. every time a quarter
of the catalogue has turned over — stops the event loop for a time that grows with the
cache: ~190 ms at 50K blocks on this machine, seconds at the half a million blocks of a
terabyte NVMe tier. Every engine's lookup waits that long (and one slower than its
``daemon_timeout_s`` is a miss).

``GcPolicy`` moves every object that survives a full collection into the permanent
generation (``gc.freeze``), so the next full collection walks only what arrived since;
young collections are untouched. The objects of a block never need the collector: the
catalogue unlinks an entry from its parent and children when it drops the block, so
refcounting frees it (tests/test_gcpolicy.py checks it). What freezing can keep alive is
cyclic garbage among objects that were frozen while alive — a connection's objects, a
long request's — so every ``full_interval_s`` (``server.gc_full_interval_s``, default an
hour; 0: never) the policy thaws everything and runs one full collection: one pause of
the old length an hour instead of one per quarter turnover. ``-1`` keeps CPython's own
policy (its pauses are still measured).

Pauses are exported by generation as ``kvstore_gc_pause_seconds`` and the frozen count
as ``kvstore_gc_frozen_objects``, as counted at the last whole-heap collection: counting
the frozen objects walks them all (``gc.get_freeze_count``: ~20 ms for two million, which
the daemon's loop would pay at every metrics refresh).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

__all__ = ["GcPolicy"]


class GcPolicy:
    def __init__(
        self,
        full_interval_s: float = 3600.0,
        observe_pause: Callable[[int, float], None] | None = None,
        freeze: bool = True,  # False: CPython's own policy, its pauses still observed
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if full_interval_s < 0:
            raise ValueError(f"full_interval_s must not be negative, got {full_interval_s}.")
        self._full_interval_s = full_interval_s
        self._observe = observe_pause
        self._freeze = freeze
        self._clock = clock
        self._started = 0.0
        self._installed = False
        self._frozen = 0
        self._collecting_all = False
        self._last_full = clock()
        self.full_collections = 0

    def install(self) -> None:
        """Collect, freeze what is left (the imports, the configuration, the tiers opened
        at start), and freeze again after every full collection from now on."""
        if self._installed:
            return
        if self._freeze:
            gc.collect()
            gc.freeze()
            self._frozen = gc.get_freeze_count()  # once, beside the collection's own walk of the heap
        gc.callbacks.append(self._on_collection)
        self._installed = True
        self._last_full = self._clock()

    def uninstall(self) -> None:
        if not self._installed:
            return
        gc.callbacks.remove(self._on_collection)
        if self._freeze:
            gc.unfreeze()
            self._frozen = 0
        self._installed = False

    @property
    def frozen_objects(self) -> int:
        """Objects frozen, as counted at the last whole-heap collection (at install, then
        every ``full_interval_s``): ``gc.get_freeze_count`` walks every frozen object, so it
        is called only where the heap is walked anyway. Objects frozen after a
        generation-2 collection since then are not counted: listing them
        (``gc.get_objects``) would add a third to that collection's pause."""
        return self._frozen

    def housekeeping(self) -> bool:
        """Run the periodic whole-heap collection when it is due; True if it ran."""
        if not (self._installed and self._freeze) or self._full_interval_s == 0 or self._clock() - self._last_full < self._full_interval_s:
            return False
        self.full_collection()
        return True

    def full_collection(self) -> None:
        """Thaw everything, collect it all (cyclic garbage among objects frozen while they
        were alive), and freeze the survivors again."""
        gc.unfreeze()
        self._collecting_all = True  # the callback leaves the freeze and its count to this method
        try:
            gc.collect()
        finally:
            self._collecting_all = False
        gc.freeze()
        self._frozen = gc.get_freeze_count()
        self._last_full = self._clock()
        self.full_collections += 1

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._observe is not None:
            self._observe(info["generation"], time.perf_counter() - self._started)
        if self._freeze and info["generation"] == 2 and not self._collecting_all:
            gc.freeze()
