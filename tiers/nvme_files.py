"""The NVMe tier's slot files: preallocated, addressed as one flat range, aligned I/O.

``slots-000.dat``, ``slots-001.dat``, … hold ``file_bytes`` each (a whole number of
pages); a tier offset ``o`` lives in file ``o // file_bytes``. The files are reserved
with ``posix_fallocate`` up front so a later write never finds the disk full; when the
disk cannot hold the capacity asked for, the files keep the whole pages that fit.

I/O is positional (``preadv``/``pwritev``, safe from many threads on one descriptor) and
uses O_DIRECT when the filesystem takes it, so cold KV does not evict the page cache.
O_DIRECT needs every buffer address and length 4 KiB-aligned: a caller's array that is
aligned is read or written in place (zero-copy), its unaligned tail or an unaligned
array goes through a per-thread bounce buffer (an anonymous mmap, hence page-aligned).
A block can move in one call: its slot's data area (the caller's bytes, zero-padded) and
the 4 KiB trailer right after it are the iovecs of one ``pwritev`` or ``preadv``.

``sync`` is a group commit: a caller needs an ``fdatasync`` that started after its writes
returned, and any such call serves every caller waiting for it, so concurrent writers
share one sync instead of queueing one each.

The first slot file carries an exclusive ``flock`` while the files are open: one daemon
per directory (see ``kvstore clean``). The directory is 0700 and the files 0600, also in
the daemon's group mode (engines never read them), and an older run's looser modes are
tightened at open: the files hold every tenant's KV.

Owner: the NVMe tier. Every method but ``close`` may run on several threads at once.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
from pathlib import Path

import numpy as np

from kvstore.errors import TierUnavailable
from kvstore.tiers.slab import round_up

__all__ = ["SlotFiles", "IO_ALIGN"]

logger = logging.getLogger(__name__)

IO_ALIGN = 4096
# slot files hold every tenant's KV: the daemon's user alone reads them
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class SlotFiles:
    def __init__(self, directory: Path, num_pages: int, page_bytes: int, file_bytes: int, direct_io: bool) -> None:
        self.directory = directory
        self.page_bytes = page_bytes
        self.file_bytes = file_bytes
        self.uses_direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.paths: list[Path] = []
        self.zeros = memoryview(mmap.mmap(-1, IO_ALIGN))  # never written to
        self._fds: list[int] = []
        self._group_syncs: list[_GroupSync] = []
        self._closed = False
        self._local = threading.local()  # this thread's header and bounce buffers
        try:
            self.num_pages = self._open(num_pages)
        except TierUnavailable:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise TierUnavailable(
                f"The NVMe tier cannot use {directory} ({exc.strerror or exc}); "
                "point the tier's directory at a writable directory on a local disk."
            ) from exc
        if self.num_pages == 0:
            raise TierUnavailable(
                f"{directory} has no room for even one {page_bytes}-byte page; "
                "free disk space there, or lower the NVMe tier's page_bytes or capacity_bytes."
            )
        if self.num_pages < num_pages:
            logger.warning(
                "The disk under %s is full: the NVMe tier holds %d pages of %d bytes instead of %d.",
                directory,
                self.num_pages,
                page_bytes,
                num_pages,
            )

    def path_of(self, offset: int) -> Path:
        return self.paths[offset // self.file_bytes]

    def header_buffer(self) -> memoryview:
        """This thread's aligned 4 KiB buffer for one header or trailer."""
        buffer = getattr(self._local, "header", None)
        if buffer is None:
            buffer = self._local.header = memoryview(mmap.mmap(-1, IO_ALIGN))
        return buffer

    def write(self, offset: int, buffers: list[memoryview]) -> None:
        """Write ``buffers`` in order at ``offset`` (with O_DIRECT: aligned 4 KiB multiples)."""
        fd, position = self._locate(offset)
        if os.pwritev(fd, buffers, position) != sum(len(buffer) for buffer in buffers):
            raise OSError(errno.EIO, "short write")

    def write_slot(self, offset: int, data: np.ndarray, area_bytes: int, trailer: memoryview | None) -> None:
        """One ``pwritev`` at ``offset``: ``data`` zero-padded to ``area_bytes`` (a 4 KiB
        multiple), then ``trailer`` when given. Bytes go in offset order, so the trailer
        is the last of them."""
        iovecs, direct, bounce = self._area_iovecs(data, area_bytes)
        if bounce is not None:
            tail = data.size - direct
            bounce[:tail] = data[direct:]
            bounce[tail:] = 0
        self.write(offset, iovecs if trailer is None else [*iovecs, trailer])

    def read(self, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order from ``offset`` (with O_DIRECT: aligned 4 KiB multiples)."""
        fd, position = self._locate(offset)
        if os.preadv(fd, buffers, position) != sum(len(buffer) for buffer in buffers):
            raise OSError(errno.EIO, "short read: the slot file is shorter than the tier expects")

    def read_slot(self, offset: int, out: np.ndarray, area_bytes: int, trailer: memoryview | None) -> None:
        """One ``preadv`` at ``offset``: ``out`` and the rest of its ``area_bytes``, then
        ``trailer`` when given."""
        iovecs, direct, bounce = self._area_iovecs(out, area_bytes)
        self.read(offset, iovecs if trailer is None else [*iovecs, trailer])
        if bounce is not None:
            out[direct:] = bounce[: out.size - direct]

    def read_scratch(self, offset: int, nbytes: int) -> np.ndarray:
        """Read ``nbytes`` at ``offset`` into this thread's bounce buffer; valid until this
        thread's next I/O."""
        bounce = self._bounce(round_up(nbytes, IO_ALIGN))
        self.read(offset, [memoryview(bounce)])
        return bounce[:nbytes]

    def sync(self, offset: int) -> None:
        """Return once every write that returned before this call is durable."""
        self._locate(offset)
        self._group_syncs[offset // self.file_bytes].sync()

    def close(self) -> None:
        self._closed = True
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    # -- opening --------------------------------------------------------------------
    def _open(self, num_wanted: int) -> int:
        self._make_private()
        pages_per_file = self.file_bytes // self.page_bytes
        num_pages = 0
        while num_pages < num_wanted:
            path = self.directory / f"slots-{len(self._fds):03d}.dat"
            num_here = min(pages_per_file, num_wanted - num_pages)
            # preallocate through a buffered descriptor: glibc's fallback for filesystems
            # without fallocate writes single bytes, which O_DIRECT refuses
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
            try:
                os.fchmod(fd, FILE_MODE)  # a file an older run left readable to others
                num_fitted = self._preallocate(fd, num_here)
            finally:
                os.close(fd)
            if num_fitted == 0:
                break
            self._fds.append(self._open_for_io(path))
            if len(self._fds) == 1:
                self._lock_directory(self._fds[0])
            self._group_syncs.append(_GroupSync(self._fds[-1]))
            self.paths.append(path)
            num_pages += num_fitted
            if num_fitted < num_here:
                break
        return num_pages

    def _make_private(self) -> None:
        """Create the directory 0700, or tighten one an older run left open to others. Only the
        daemon reads its slot files: engines get their KV through the host slab."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=DIRECTORY_MODE)
        info = self.directory.stat()
        if info.st_uid != os.geteuid() and os.geteuid() != 0:
            raise TierUnavailable(
                f"the NVMe directory {self.directory} is owned by uid {info.st_uid}, not by uid {os.geteuid()} who runs the daemon; "
                "give the daemon a directory of its own (nvme.directory)."
            )
        if stat.S_IMODE(info.st_mode) != DIRECTORY_MODE:
            os.chmod(self.directory, DIRECTORY_MODE)

    def _lock_directory(self, fd: int) -> None:
        """Hold an exclusive ``flock`` on the first slot file for this tier's whole life:
        two daemons on one directory would each own the same slots, and ``kvstore clean``
        tells a directory in use from one left behind by it."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TierUnavailable(
                f"another kvstore daemon uses the NVMe directory {self.directory}; give this one its own nvme.directory."
            ) from None

    def _preallocate(self, fd: int, num_pages: int) -> int:
        """Reserve ``num_pages`` pages; on a full disk, as many whole pages as fit."""
        try:
            os.posix_fallocate(fd, 0, num_pages * self.page_bytes)
            return num_pages
        except OSError as exc:
            if exc.errno not in _DISK_FULL:
                raise
        for page in range(num_pages):
            try:
                os.posix_fallocate(fd, page * self.page_bytes, self.page_bytes)
            except OSError as exc:
                if exc.errno not in _DISK_FULL:
                    raise
                # give back what the failed calls reserved past the last whole page
                if os.fstat(fd).st_size > page * self.page_bytes:
                    os.ftruncate(fd, page * self.page_bytes)
                return page
        return num_pages

    def _open_for_io(self, path: Path) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC
        if self.uses_direct_io and not self._fds:  # the first file decides for all of them
            try:
                fd = os.open(path, flags | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            else:
                if _direct_reads_work(fd):
                    return fd
                os.close(fd)
            # this filesystem refuses O_DIRECT; buffered I/O is slower but correct
            self.uses_direct_io = False
        return os.open(path, flags | (os.O_DIRECT if self.uses_direct_io else 0))

    def _locate(self, offset: int) -> tuple[int, int]:
        if self._closed:
            raise TierUnavailable("This NVMe tier was closed; open a new one on the same directory.")
        file_index, position = divmod(offset, self.file_bytes)
        return self._fds[file_index], position

    def _area_iovecs(self, array: np.ndarray, area_bytes: int) -> tuple[list[memoryview], int, np.ndarray | None]:
        """(iovecs covering ``area_bytes`` from ``array`` on, bytes of ``array`` they use
        in place, the bounce buffer that stands for the rest). O_DIRECT uses the aligned
        prefix of the array in place; buffered I/O the whole array."""
        direct = _aligned_prefix(array) if self.uses_direct_io else array.size
        iovecs = [memoryview(array)[:direct]] if direct else []
        bounce = self._bounce(area_bytes - direct) if direct < area_bytes else None
        if bounce is not None:
            iovecs.append(memoryview(bounce))
        return iovecs, direct, bounce

    def _bounce(self, nbytes: int) -> np.ndarray:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None or bounce.size < nbytes:
            bounce = self._local.bounce = np.frombuffer(mmap.mmap(-1, round_up(nbytes, 1 << 20)), np.uint8)
        return bounce[:nbytes]


class _GroupSync:
    """``fdatasync`` of one file shared among concurrent callers; at most one runs at a time."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._done = threading.Condition()
        # syncs are numbered 1, 2, …; _done guards these three
        self._num_started = 0
        self._num_finished = 0
        self._last_failed = 0

    def sync(self) -> None:
        with self._done:
            # one already running may have started before this caller's writes returned
            wanted = self._num_started + 1
            while self._num_finished < wanted and self._num_started > self._num_finished:
                self._done.wait()
            if self._num_finished >= wanted:
                if self._last_failed >= wanted:
                    # a failed fdatasync may drop dirty pages that the next one then
                    # reports as clean, so a failure from the sync that served this caller
                    # on fails it (a later one's too: rare, and never wrongly durable)
                    raise OSError(errno.EIO, "an fdatasync shared with another writer failed")
                return
            self._num_started = wanted
        failed = True
        try:
            os.fdatasync(self._fd)
            failed = False
        finally:
            with self._done:
                self._num_finished = wanted
                if failed:
                    self._last_failed = wanted
                self._done.notify_all()


def _aligned_prefix(array: np.ndarray) -> int:
    """How many leading bytes of ``array`` O_DIRECT can move in place."""
    if array.ctypes.data % IO_ALIGN:
        return 0
    return array.size - array.size % IO_ALIGN


def _direct_reads_work(fd: int) -> bool:
    # some filesystems accept O_DIRECT at open and fail the first I/O instead
    try:
        os.preadv(fd, [memoryview(mmap.mmap(-1, IO_ALIGN))], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True
