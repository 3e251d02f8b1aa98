"""The processes of the chaos run, each restartable in place: a Redis server, kvstore
daemons (same workdir, NVMe directory, host-tier name and transport port across
restarts, so NVMe blocks are recovered and peers find the node where it was), engine
processes (a new stats file per life) and the attacker (one life); and the fleet's peer
credentials (``FleetCredentials``: a secret file, and with TLS a CA and a certificate for
loopback, plus what the attacker holds instead).

Daemon starts do not block: ``begin_start`` spawns `kvstore serve` and ``poll`` reports
when its state file has appeared, so the fault driver keeps its own schedule while a
daemon comes back. Owner: the driver's thread.
"""

from __future__ import annotations

import json
import os
import secrets
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

__all__ = ["ChaosDaemon", "EngineProcess", "AttackerProcess", "FleetCredentials", "free_port", "REPO_ROOT"]

REPO_ROOT = Path(__file__).resolve().parents[1]


def _python_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def _private_file(path: Path, write) -> str:
    write(path)
    path.chmod(0o600)
    return str(path)


class FleetCredentials:
    """A fleet secret in a 0600 file and, with ``tls``, a fleet CA (trustme) with one
    certificate for 127.0.0.1 that every daemon presents; and the attacker's: a secret of
    the right length that is not the fleet's, and a certificate from a CA of its own."""

    def __init__(self, directory: Path, tls: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.secret_file = _private_file(directory / "peer-secret", lambda p: p.write_text(secrets.token_hex(32)))
        self.wrong_secret = secrets.token_hex(32)
        self.tls: dict[str, str] = {}
        self.stranger_cert = self.stranger_key = ""
        if tls:
            import trustme  # only a run with --tls needs it

            fleet, stranger = trustme.CA(), trustme.CA()
            node, other = fleet.issue_cert("127.0.0.1", "localhost"), stranger.issue_cert("127.0.0.1", "localhost")
            self.tls = {
                "transport.tls_cert": _private_file(directory / "node.pem", node.cert_chain_pems[0].write_to_path),
                "transport.tls_key": _private_file(directory / "node.key", node.private_key_pem.write_to_path),
                "transport.tls_ca": _private_file(directory / "ca.pem", fleet.cert_pem.write_to_path),
            }
            self.stranger_cert = _private_file(directory / "stranger.pem", other.cert_chain_pems[0].write_to_path)
            self.stranger_key = _private_file(directory / "stranger.key", other.private_key_pem.write_to_path)

    @property
    def mode(self) -> str:
        return "secret+tls" if self.tls else "secret"

    def daemon_settings(self) -> dict[str, str]:
        return {"transport.peer_secret_file": self.secret_file, **self.tls}


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
        env = _python_env()
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


class AttackerProcess:
    """The attacker (bench/chaos_attacker.py): one life, which ends by itself."""

    def __init__(self, directory: Path, settings: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.stats_path = directory / "attacker.jsonl"
        self.log_path = directory / "attacker.log"
        self.stop_path = directory / "stop"
        self.settings = {**settings, "stats_path": str(self.stats_path), "stop_path": str(self.stop_path)}
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.chaos_attacker", json.dumps(self.settings)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=_python_env(),
            )

    def finish(self, timeout_s: float) -> int | None:
        """Ask it to stop and wait; its exit status, or None when it had to be killed."""
        self.stop_path.touch()
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def record(self) -> dict:
        """Its last stats line ({} when it wrote none)."""
        last: dict = {}
        for line in self.stats_path.read_text().splitlines() if self.stats_path.exists() else ():
            try:
                last = json.loads(line)
            except ValueError:
                continue  # a line cut short
        return last

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
