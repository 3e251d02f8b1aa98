"""Where a daemon listens, leaves its state file and keeps its gRPC token, and whether a
local process may trust what it finds there; light enough for the CLI to import without
the tiers (and torch).

On a host shared by several users, whoever owns a socket's directory decides who answers
on that socket: another user who creates ``/tmp/kvstore-<uid>`` first could serve the
engines of ``<uid>`` (and receive their KV). So a directory, a state file or a token file
is trusted only where its owner is this process's user or root and nobody else can write
it; a client also trusts a directory of another user whose group it shares (the daemon's
group mode, ``server.socket_mode = 0o660``), except the default one, which is named after
this process's uid and can only be its own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import stat
from pathlib import Path

from kvstore.errors import DaemonUnavailable, KVStoreError

__all__ = [
    "default_socket_path",
    "default_cache_dir",
    "default_token_path",
    "state_path_for",
    "read_state",
    "write_state",
    "check_daemon_dir",
    "check_client_path",
    "token_for",
    "is_loopback",
    "generated_token",
    "load_or_create_token",
]

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_TOKEN_BYTES = 32


def default_socket_path() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or _fallback_runtime_dir()
    return Path(runtime) / "kvstore.sock"


def _fallback_runtime_dir() -> str:
    return f"/tmp/kvstore-{os.getuid()}"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore"


def default_token_path() -> Path:
    """The file that holds the gRPC token a daemon generated (``server.auth_token_file``)."""
    return default_cache_dir() / "grpc-token"


def state_path_for(socket_path: Path) -> Path:
    return Path(str(socket_path) + ".json")


# -- trust ------------------------------------------------------------------------------
def check_daemon_dir(directory: Path, mode: int, gid: int | None = None) -> None:
    """Create ``directory`` with ``mode`` (and group ``gid``) where it is absent; refuse one
    that another user owns or that others can write: whoever can replace a socket there
    answers the engines in the daemon's place."""
    try:
        directory.mkdir(parents=True, mode=mode)
    except FileExistsError:
        pass  # judged below, whoever made it
    else:
        os.chmod(directory, mode)  # mkdir's mode passes through the umask
        if gid is not None:
            os.chown(directory, -1, gid)
    problem = _untrusted(directory, own_only=True)
    if problem:
        raise KVStoreError(problem)


def check_client_path(path: Path, what: str) -> None:
    """DaemonUnavailable, saying why, unless ``path`` (a daemon's socket or state file) and
    its directory are trusted by this process: a daemon there may be anyone's."""
    own_only = path.parent == Path(_fallback_runtime_dir())
    problem = _untrusted(path.parent, own_only) or (_untrusted(path, own_only) if path.exists() else None)
    if problem:
        raise DaemonUnavailable(f"not trusting the kvstore {what} {path}: {problem}")


def _untrusted(path: Path, own_only: bool) -> str | None:
    """Why ``path`` is not trusted, or None."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot inspect {path} ({exc.strerror}); check its permissions."
    me = os.geteuid()
    shared_group = not own_only and info.st_gid in {os.getegid(), *os.getgroups()}
    if info.st_uid not in (me, 0) and not shared_group:
        return (
            f"{path} is owned by uid {info.st_uid}, not by uid {me} who runs kvstore; another user may have created it to "
            f"take over the daemon's socket: remove it (as root) or configure server.socket_path in a directory of your own."
        )
    # a socket's write bit is leave to connect, not to replace it; a sticky bit (/tmp) does
    # not help a directory: another user may create the name first
    if info.st_mode & _WRITABLE_BY_OTHERS and not stat.S_ISSOCK(info.st_mode):
        return (
            f"{path} (mode {oct(stat.S_IMODE(info.st_mode))}) is writable by other users, who could replace the daemon's socket "
            f"or state: run `chmod go-w {path}` or configure server.socket_path in a private directory."
        )
    return None


# -- state file -------------------------------------------------------------------------
def write_state(socket_path: Path, state: dict, mode: int, gid: int | None = None) -> None:
    """Write the state file whole (a reader never sees half of it) with ``mode`` and, where
    given, group ``gid``."""
    path = state_path_for(socket_path)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
        os.write(fd, json.dumps(state).encode())
    finally:
        os.close(fd)
    os.replace(partial, path)


def read_state(socket_path: Path) -> dict:
    """What a running daemon wrote at start: pid, socket, grpc address, metrics port."""
    path = state_path_for(socket_path)
    check_client_path(path, "state file")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DaemonUnavailable(f"no kvstore daemon state at {path}; is `kvstore serve` running?") from exc


# -- gRPC token -------------------------------------------------------------------------
def token_for(address: str, token_file: Path | None = None) -> str:
    """The token a client sends to the daemon at ``address`` (``host:port``) when it was
    given none: ``$KVSTORE_TOKEN``, else, to a daemon on this host only, the one a daemon
    of this user generated (in ``token_file``, the default one where None). A daemon
    elsewhere never learns it: it would let that host's owner into this host's daemon."""
    return os.environ.get("KVSTORE_TOKEN") or (generated_token(token_file) if is_loopback(address) else "")


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def generated_token(token_file: Path | None = None) -> str:
    """The token in ``token_file`` (the default one where None) where this user or root
    owns it, else none."""
    path = token_file or default_token_path()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as file:
        if os.fstat(fd).st_uid not in (os.geteuid(), 0):
            return ""  # another user's file holds no secret of this one's daemons
        return file.read(4096).decode("ascii", "replace").strip()


def load_or_create_token(path: Path) -> str:
    """The token in ``path``; where there is none, a new random one, written there 0600 in
    one step (daemons starting together all end up with the first one written)."""
    check_daemon_dir(path.parent, 0o700)
    for _attempt in range(2):
        token = _read_own_token(path)
        if token:
            return token
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (secrets.token_urlsafe(_TOKEN_BYTES) + "\n").encode())
        finally:
            os.close(fd)
        try:
            os.link(partial, path)  # fails where another daemon wrote one first: that one wins
        except FileExistsError:
            pass
        finally:
            os.unlink(partial)
    raise KVStoreError(f"the gRPC token file {path} is empty; remove it so that the daemon writes a new one.")


def _read_own_token(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise KVStoreError(f"cannot read the gRPC token file {path} ({exc.strerror}); fix its permissions or remove it.") from exc
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise KVStoreError(
                f"the gRPC token file {path} is owned by uid {info.st_uid}, not by uid {os.geteuid()} who runs the daemon; "
                "remove it, or set server.auth_token."
            )
        if stat.S_IMODE(info.st_mode) != 0o600:  # an older or hand-made file: others may not read it from now on
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o600)
        return file.read(4096).decode("ascii", "replace").strip()
