"""The processes of the chaos run, each restartable in place: a Redis server, kvstore
daemons (same workdir, NVMe directory, host-tier name and transport port across
restarts, so NVMe blocks are recovered and peers find the node where it was) and engine
processes (a new stats file per life).

Daemon starts do not block: ``begin_start`` spawns `kvstore serve` and ``poll`` reports
when its state file has appeared, so the fault driver keeps its own schedule while a
daemon comes back. Owner: the driver's thread.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import TierUnavailable
from kvstore.paths import state_path_for
from kvstore.spawn import serve_command

__all__ = ["ChaosDaemon", "EngineProcess", "free_port", "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ChaosDaemon:
    """One `kvstore serve`; ``settings`` are its --set values, the same for every life."""

    name: str
    workdir: Path
    settings: dict[str, object]
    process: subprocess.Popen | None = None
    state: dict = field(default_factory=dict)
    lives: int = 0
    starting_since: float | None = None

    @property
    def socket(self) -> Path:
        return self.workdir / "kvstore.sock"

    @property
    def log_path(self) -> Path:
        return self.workdir / "daemon.log"

    @property
    def nvme_dir(self) -> Path:
        return Path(str(self.settings["nvme.directory"]))

    @property
    def grpc_address(self) -> str:
        return self.state["grpc_address"]

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def begin_start(self) -> None:
        state_path_for(self.socket).unlink(missing_ok=True)
        self.state = {}
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== chaos: start #{self.lives + 1} of {self.name} at {time.time():.3f}\n".encode())
            self.process = subprocess.Popen(serve_command(self.socket, self.settings), stdout=log, stderr=subprocess.STDOUT)
        self.lives += 1
        self.starting_since = time.monotonic()

    def poll(self, timeout_s: float = 60.0) -> bool:
        """True once the daemon serves; raises when it exited or took too long to start."""
        if self.starting_since is None:
            return True
        if self.process.poll() is not None:
            raise TierUnavailable(f"{self.name}: kvstore serve exited with {self.process.returncode} at start: {self.log_tail()}")
        state_file = state_path_for(self.socket)
        if state_file.exists():
            try:
                self.state = json.loads(state_file.read_text())
            except ValueError:
                return False  # written but not flushed yet
            self.starting_since = None
            return True
        if time.monotonic() - self.starting_since > timeout_s:
            self.process.kill()
            raise TierUnavailable(f"{self.name}: kvstore serve did not start within {timeout_s:g} s: {self.log_tail()}")
        return False

    def start(self, timeout_s: float = 60.0) -> ChaosDaemon:
        self.begin_start()
        while not self.poll(timeout_s):
            time.sleep(0.05)
        return self

    def signal(self, signum: int) -> None:
        if self.alive():
            self.process.send_signal(signum)

    def wait(self, timeout_s: float) -> int | None:
        """The exit status, or None when it is still running after ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


class EngineProcess:
    """One engine (bench/chaos_engine.py); every start is a new life with its own stats file."""

    def __init__(self, engine_id: int, directory: Path, settings: dict) -> None:
        self.engine_id = engine_id
        self.directory = directory
        self.settings = settings
        self.lives = 0
        self.process: subprocess.Popen | None = None
        self.stats_paths: list[Path] = []

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready(self) -> bool:
        """Alive and past its start: its signal handlers are installed once it has written a
        stats line (a SIGUSR1 before that would kill it)."""
        return self.alive() and self.stats_paths[-1].exists() and self.stats_paths[-1].stat().st_size > 0

    def start(self) -> None:
        self.lives += 1
        stats_path = self.directory / f"engine-{self.engine_id}-{self.lives}.jsonl"
        self.stats_paths.append(stats_path)
        settings = {**self.settings, "engine_id": self.engine_id, "incarnation": self.lives, "stats_path": str(stats_path)}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        with open(self.directory / f"engine-{self.engine_id}-{self.lives}.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.chaos_engine", json.dumps(settings)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=env,
            )

    def signal(self, signum: int) -> None:
        if self.alive():
            self.process.send_signal(signum)

    def kill(self) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        path = self.directory / f"engine-{self.engine_id}-{self.lives}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""
