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

Owner: the NVMe tier. Every method but ``close`` may run on several threads at once.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from kvstore.errors import TierUnavailable
from kvstore.tiers.slab import round_up

__all__ = ["SlotFiles", "IO_ALIGN"]

logger = logging.getLogger(__name__)

IO_ALIGN = 4096
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
        self._closed = False
        self._local = threading.local()  # this thread's header and bounce buffers
        try:
            self.num_pages = self._open(num_pages)
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
                directory, self.num_pages, page_bytes, num_pages,
            )

    def path_of(self, offset: int) -> Path:
        return self.paths[offset // self.file_bytes]

    def header_buffer(self) -> memoryview:
        """This thread's aligned 4 KiB buffer for one header."""
        buffer = getattr(self._local, "header", None)
        if buffer is None:
            buffer = self._local.header = memoryview(mmap.mmap(-1, IO_ALIGN))
        return buffer

    def write(self, offset: int, leading: list[memoryview], data: np.ndarray | None = None) -> None:
        """Write the aligned ``leading`` buffers, then ``data`` padded to 4 KiB, at ``offset``."""
        fd, position = self._locate(offset)
        iovecs = list(leading)
        if data is not None and not self.uses_direct_io:
            iovecs.append(memoryview(data))
        elif data is not None:
            size = data.size
            direct = _aligned_prefix(data)
            if direct:
                iovecs.append(memoryview(data)[:direct])
            if direct < size:
                bounce = self._bounce(round_up(size - direct, IO_ALIGN))
                bounce[: size - direct] = data[direct:]
                bounce[size - direct :] = 0
                iovecs.append(memoryview(bounce))
        expected = sum(len(iovec) for iovec in iovecs)
        if os.pwritev(fd, iovecs, position) != expected:
            raise OSError(errno.EIO, "short write")

    def read(self, offset: int, leading: list[memoryview], out: np.ndarray | None = None) -> None:
        """Fill the aligned ``leading`` buffers, then ``out``, from ``offset``."""
        fd, position = self._locate(offset)
        iovecs = list(leading)
        bounce = None
        direct = 0
        if out is not None and not self.uses_direct_io:
            iovecs.append(memoryview(out))
        elif out is not None:
            direct = _aligned_prefix(out)
            if direct:
                iovecs.append(memoryview(out)[:direct])
            if direct < out.size:
                bounce = self._bounce(round_up(out.size - direct, IO_ALIGN))
                iovecs.append(memoryview(bounce))
        expected = sum(len(iovec) for iovec in iovecs)
        if os.preadv(fd, iovecs, position) != expected:
            raise OSError(errno.EIO, "short read: the slot file is shorter than the tier expects")
        if bounce is not None:
            out[direct:] = bounce[: out.size - direct]

    def read_scratch(self, offset: int, nbytes: int) -> np.ndarray:
        """Read ``nbytes`` at ``offset`` into this thread's bounce buffer; valid until this
        thread's next I/O."""
        bounce = self._bounce(round_up(nbytes, IO_ALIGN))
        self.read(offset, [memoryview(bounce)])
        return bounce[:nbytes]

    def sync(self, offset: int) -> None:
        fd, _ = self._locate(offset)
        os.fdatasync(fd)

    def close(self) -> None:
        self._closed = True
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    # -- opening --------------------------------------------------------------------
    def _open(self, num_wanted: int) -> int:
        self.directory.mkdir(parents=True, exist_ok=True)
        pages_per_file = self.file_bytes // self.page_bytes
        num_pages = 0
        while num_pages < num_wanted:
            path = self.directory / f"slots-{len(self._fds):03d}.dat"
            num_here = min(pages_per_file, num_wanted - num_pages)
            # preallocate through a buffered descriptor: glibc's fallback for filesystems
            # without fallocate writes single bytes, which O_DIRECT refuses
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                num_fitted = self._preallocate(fd, num_here)
            finally:
                os.close(fd)
            if num_fitted == 0:
                break
            self._fds.append(self._open_for_io(path))
            self.paths.append(path)
            num_pages += num_fitted
            if num_fitted < num_here:
                break
        return num_pages

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

    def _bounce(self, nbytes: int) -> np.ndarray:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None or bounce.size < nbytes:
            bounce = self._local.bounce = np.frombuffer(mmap.mmap(-1, round_up(nbytes, 1 << 20)), np.uint8)
        return bounce[:nbytes]


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
