"""Fault in every page of a shared mapping before its first use.

The first touch of each 4 KiB page of a fresh mapping costs a page fault: for the host
tier's file, the daemon's first touch also zeroes the page that ``posix_fallocate``
reserved (~0.45 s per GiB here, ~1.6 s where the VM's memory is backed by the hypervisor
only at first touch), and each engine's mapping takes its own faults (~0.12 s per GiB) —
a fresh daemon's first save ran at ~2 GB/s against ~10 GB/s once warm.
``madvise(MADV_POPULATE_WRITE)`` (Linux ≥ 5.14) maps the pages in, writable, without
reading or writing a byte of them, so it may run while the mapping is in use: a part
within a time budget where the mapping is opened, the rest on a helper thread, in 64 MiB
steps (the call releases the GIL). A kernel without it leaves the pages to fault on first
use, as before.

Owner: the holder of the mapping (tiers/host.py's ``SharedSlab``), which starts it and
stops it before unmapping; the helper thread holds a buffer export of the mapping, so the
mapping cannot be unmapped under it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

__all__ = ["Prefault"]

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
_STEP = 64 << 20


def _libc_madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()


class Prefault:
    """Populate ``mapping``: within ``budget_s`` here, the rest on a helper thread."""

    def __init__(self, mapping: mmap.mmap, budget_s: float, what: str) -> None:
        self._what = what
        self._size = len(mapping)
        self._export: ctypes.Array | None = (ctypes.c_char * self._size).from_buffer(mapping)
        self._address = ctypes.addressof(self._export)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_populated = 0  # bytes mapped in so far
        self.done = threading.Event()  # set when every page is in, or the work stopped
        started = time.monotonic()
        if self._populate(started + budget_s) and not self._stop.is_set():
            self._thread = threading.Thread(target=self._populate_rest, name=f"kvstore-prefault-{what}", daemon=True)
            self._thread.start()
        else:
            self._finish()

    def stop(self) -> None:
        """Stop at the next step (at most one 64 MiB step away) and let go of the mapping."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _populate_rest(self) -> None:
        try:
            self._populate(None)
        finally:
            self._finish()

    def _populate(self, deadline: float | None) -> bool:
        """Populate step by step; True when stopped by ``deadline`` with pages left."""
        while self.num_populated < self._size and not self._stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return True
            length = min(_STEP, self._size - self.num_populated)
            if _madvise(self._address + self.num_populated, length, _MADV_POPULATE_WRITE) != 0:
                reason = os.strerror(ctypes.get_errno())
                logger.info("pages of the %s are left to fault on first use: madvise(MADV_POPULATE_WRITE): %s", self._what, reason)
                return False
            self.num_populated += length
        return False

    def _finish(self) -> None:
        self._export = None  # the mapping may be unmapped from here on
        self.done.set()
