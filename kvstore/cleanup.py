"""`kvstore clean`: remove what a stopped daemon leaves on its host — the NVMe tier's slot
files (kept on purpose, so that a restart serves them), its host tier's shared-memory file
(left only by a daemon that did not stop cleanly) and a stale socket with its state file.

A daemon is running while its socket answers or while it holds the ``flock`` it takes on
its shared-memory file (tiers/host.py) and on its first NVMe slot file
(tiers/nvme_files.py); either refuses the clean-up. The locks this process takes to check
are held until the files are gone, so a daemon that starts meanwhile cannot take them over
half-removed. Only files named as the tiers name them are removed, never the directory's
other contents.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import DaemonConfig
from kvstore.errors import KVStoreError
from kvstore.paths import state_path_for

__all__ = ["Removed", "remove_leftovers"]


@dataclass(frozen=True, slots=True)
class Removed:
    paths: tuple[Path, ...]
    num_bytes: int


def remove_leftovers(config: DaemonConfig, dry_run: bool = False) -> Removed:
    """Remove a stopped node's files (or, with ``dry_run``, only name them); KVStoreError,
    removing nothing, while its daemon runs."""
    socket_path = Path(config.server.socket_path)
    if _answers(socket_path):
        raise KVStoreError(f"a kvstore daemon is serving on {socket_path}; stop it (SIGTERM) before cleaning up after it.")
    candidates, locked = [config.host.path], [config.host.path]  # locked: the files a live daemon holds a lock on
    if config.nvme is not None:
        directory = Path(config.nvme.directory)
        candidates += sorted(directory.glob("slots-*.dat"))
        locked.append(directory / "slots-000.dat")
    with contextlib.ExitStack() as held:
        for path in locked:
            _lock_or_refuse(held, path)
        present = [path for path in candidates if path.is_file()]
        present += [path for path in (socket_path, state_path_for(socket_path)) if path.exists()]
        num_bytes = sum(path.stat().st_size for path in present)
        if not dry_run:
            for path in present:
                path.unlink(missing_ok=True)
            if config.nvme is not None:
                with contextlib.suppress(OSError):
                    Path(config.nvme.directory).rmdir()  # only when nothing else is in it
    return Removed(tuple(present), num_bytes)


def _answers(socket_path: Path) -> bool:
    if not socket_path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(socket_path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _lock_or_refuse(held: contextlib.ExitStack, path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise KVStoreError(f"cannot open {path} to check that no daemon uses it: {exc.strerror}.") from exc
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise KVStoreError(
            f"a running kvstore daemon holds {path}; stop it before cleaning up (its socket may be configured elsewhere)."
        ) from None
