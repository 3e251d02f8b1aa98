"""Where a daemon listens and leaves its state file; light enough for the CLI to import
without the tiers (and torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvstore.errors import DaemonUnavailable

__all__ = ["default_socket_path", "default_cache_dir", "state_path_for", "read_state"]


def default_socket_path() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvstore-{os.getuid()}"
    return Path(runtime) / "kvstore.sock"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore"


def state_path_for(socket_path: Path) -> Path:
    return Path(str(socket_path) + ".json")


def read_state(socket_path: Path) -> dict:
    """What a running daemon wrote at start: pid, socket, grpc address, metrics port."""
    try:
        return json.loads(state_path_for(socket_path).read_text())
    except (OSError, ValueError) as exc:
        raise DaemonUnavailable(f"no kvstore daemon state at {state_path_for(socket_path)}; is `kvstore serve` running?") from exc
