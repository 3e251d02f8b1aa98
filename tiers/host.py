"""The host tier: one shared-memory file that engines map by name.

The daemon creates ``<directory>/<name>`` (``/dev/shm`` by default), reserves its pages
with ``posix_fallocate`` (so a full tmpfs is a clear error at start, never a SIGBUS on
first touch) and maps it; an engine process maps the same file with
``SharedSlab.attach(path)`` and reads or writes slots as torch tensor views — the data
path between engine and daemon is a memcpy, never a socket. Both sides map the slab's
pages in when they open it (tiers/prefault.py), so that the first save into a fresh daemon
does not pay a page fault per 4 KiB. An engine that copies
between the slab and a GPU page-locks its own mapping (tiers/device.py says why the
daemon does not).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import InvalidArgument, TierUnavailable
from kvstore.tier_kind import TierKind
from kvstore.tiers.memory import DEFAULT_PAGE_BYTES, MemoryTier
from kvstore.tiers.prefault import Prefault
from kvstore.tiers.slab import Slot

__all__ = ["HostTierConfig", "HostTier", "SharedSlab", "PREFAULT_BUDGET_S"]

# how long opening the tier may spend mapping its pages in before a helper thread takes
# over (the daemon is ready at most this much later): a slab of up to ~2 GiB is warm
# before the daemon serves, a larger one soon after. On a VM whose memory the hypervisor
# backs only at first touch, the pages come in at ~0.6 GB/s, so half a second left a
# 768 MiB slab two thirds cold for the first save (1.5 GB/s instead of 6)
PREFAULT_BUDGET_S = 1.0


@dataclass(frozen=True, slots=True)
class HostTierConfig:
    capacity_bytes: int
    name: str = "kvstore-host"
    directory: Path = Path("/dev/shm")
    page_bytes: int = DEFAULT_PAGE_BYTES
    # reuse a segment left behind by a daemon that crashed instead of refusing to start
    reclaim_stale: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise InvalidArgument(f"host tier capacity_bytes must be a positive integer, got {self.capacity_bytes!r}.")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise InvalidArgument(f"host tier name {self.name!r} must be a plain file name.")

    @property
    def path(self) -> Path:
        return Path(self.directory) / self.name


class SharedSlab:
    """A mapping of a host-tier file, as a flat uint8 tensor; the daemon creates it, an
    engine attaches to it. Closing drops the mapping; only the creator removes the file."""

    def __init__(self, path: Path, mapping: mmap.mmap, owner_fd: int | None) -> None:
        self.path = path
        self._mapping = mapping
        # the creator keeps the file open with an exclusive flock for its whole life: a
        # file whose lock can be taken was left by a process that is gone
        self._owner_fd = owner_fd
        self._prefault: Prefault | None = None
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)

    def prefault(self, budget_s: float, what: str) -> Prefault:
        """Map every page in ahead of first use: within ``budget_s`` now, the rest in the
        background (tiers/prefault.py)."""
        if self._prefault is None:
            self._prefault = Prefault(self._mapping, budget_s, what)
        return self._prefault

    @classmethod
    def create(cls, path: Path, nbytes: int, reclaim_stale: bool = False) -> SharedSlab:
        """A new segment at ``path``. With ``reclaim_stale``, a file left by a daemon that is
        gone (its lock is free) is unlinked first: the segment is always a new file, never
        the old one reused, because engines that outlived that daemon may still map it and
        write into it — into what would now be this daemon's slots."""
        if reclaim_stale:
            cls._unlink_stale(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as exc:
            raise TierUnavailable(
                f"{path} already exists: another daemon is running or one crashed; stop it, or start with stale segments reclaimed."
            ) from exc
        except OSError as exc:
            raise TierUnavailable(f"cannot create the host tier file {path}: {exc.strerror}.") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise TierUnavailable(f"{path} belongs to a live kvstore daemon; give this one another host tier name.") from exc
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise TierUnavailable(
                f"cannot reserve {nbytes} bytes for the host tier in {path.parent}: {exc.strerror}; "
                "lower the host tier capacity or enlarge that filesystem."
            ) from exc
        return cls(path, mapping, owner_fd=fd)

    @staticmethod
    def _unlink_stale(path: Path) -> None:
        """Remove a segment whose creator is gone; refuse one a live daemon holds."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TierUnavailable(f"cannot open the stale host tier file {path}: {exc.strerror}.") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise TierUnavailable(f"{path} belongs to a live kvstore daemon; give this one another host tier name.") from exc
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)

    @classmethod
    def attach(cls, path: Path | str) -> SharedSlab:
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TierUnavailable(f"cannot open the host tier file {path}: {exc.strerror}; is the daemon running?") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
                raise TierUnavailable(f"{path} is not a host tier file (not a regular, non-empty file).")
            mapping = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise TierUnavailable(f"cannot map the host tier file {path}: {exc.strerror}.") from exc
        finally:
            os.close(fd)
        return cls(path, mapping, owner_fd=None)

    def file_problem(self) -> str | None:
        """None while ``path`` names the file this (creating) side maps; else a sentence
        saying that it was removed or replaced: an engine that connects now cannot map it,
        or would map another file than the daemon's."""
        if self._owner_fd is None:
            return None
        mapped = os.fstat(self._owner_fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            named = None
        except OSError as exc:
            return f"The host tier file {self.path} cannot be checked ({exc.strerror}); engines that connect now may not map it."
        if named is not None and (named.st_dev, named.st_ino) == (mapped.st_dev, mapped.st_ino):
            return None
        return (
            f"The host tier file {self.path} was removed or replaced (systemd's RemoveIPC=yes removes a user's /dev/shm files "
            "when it logs out); engines that connect now cannot map the daemon's. Set RemoveIPC=no in logind.conf or run the "
            "daemon as a system user; the daemon recreates the file when the next engine connects, and the blocks the old one "
            "held become misses."
        )

    def share_like(self, other: SharedSlab) -> None:
        """Give this (created) file the group and mode the daemon gave ``other``'s, so that
        the engines allowed to map that one may map this one."""
        assert self._owner_fd is not None and other._owner_fd is not None, "only the creator shares its file"
        info = os.fstat(other._owner_fd)
        try:
            os.fchown(self._owner_fd, -1, info.st_gid)
            os.fchmod(self._owner_fd, stat.S_IMODE(info.st_mode))
        except OSError as exc:
            raise TierUnavailable(f"cannot give {self.path} the group and mode of the file it replaces: {exc.strerror}.") from exc

    def view(self, slot: Slot, nbytes: int | None = None) -> torch.Tensor:
        length = slot.nbytes if nbytes is None else nbytes
        if slot.offset < 0 or slot.offset + length > self.tensor.numel():
            raise InvalidArgument(f"slot {slot} lies outside the {self.tensor.numel()}-byte host slab.")
        return self.tensor[slot.offset : slot.offset + length]

    def close(self, unlink: bool = True) -> None:
        """Drop the mapping; the creator removes the file too, unless ``unlink`` is False
        (the path names another file by now)."""
        if self._prefault is not None:
            self._prefault.stop()
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._mapping.close()
        except BufferError:
            # views handed out earlier still reference the mapping; it goes when they do
            pass
        if self._owner_fd is not None:
            if unlink:
                self.path.unlink(missing_ok=True)
            os.close(self._owner_fd)
            self._owner_fd = None


class HostTier(MemoryTier):
    def __init__(self, config: HostTierConfig) -> None:
        self.config = config
        self.shared = SharedSlab.create(config.path, config.capacity_bytes, config.reclaim_stale)
        self.shared.prefault(PREFAULT_BUDGET_S, "host tier")
        super().__init__(TierKind.HOST, self.shared.tensor, config.page_bytes)

    @property
    def path(self) -> Path:
        return self.shared.path

    def file_problem(self) -> str | None:
        """None while the tier's path names the file it maps; else a sentence (SharedSlab.file_problem)."""
        return self.shared.file_problem()

    def recreate(self) -> None:
        """Map a new file at the tier's path in place of one removed or replaced, keeping the
        slot layout. The old file's bytes stay where they are, for whoever still maps them:
        nothing copies them over, so the caller drops every block and reservation the tier
        held (TierManager.replace_host_slab). A file a live daemon holds at the path is
        never taken over (TierUnavailable, and the tier keeps the file it maps)."""
        old = self.shared
        new = SharedSlab.create(self.config.path, self.config.capacity_bytes, reclaim_stale=True)
        try:
            new.share_like(old)
        except BaseException:
            new.close()
            raise
        new.prefault(PREFAULT_BUDGET_S, "host tier")
        self.shared = new
        # the buffer a memory tier copies through (tiers/memory.py), re-pointed at the new mapping
        self._buffer = new.tensor
        self._cpu_base = new.tensor.data_ptr()
        self._cpu_bytes = memoryview(new.tensor.numpy())
        old.close(unlink=False)

    def close(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._cpu_base = None
        self._cpu_bytes = None
        self.shared.close()
