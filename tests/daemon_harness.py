"""Start and stop real `kvstore serve` processes for tests."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.spawn import serve_command, spawn_daemon


@dataclass
class Daemon:
    workdir: Path
    node_id: str
    token: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # more --set settings
    prefix: tuple[str, ...] = ()  # wraps the command, e.g. ("ip", "netns", "exec", "ns1")
    config: Path | None = None  # a TOML file under the --set settings (for what they cannot say: [[engines]])
    process: subprocess.Popen | None = None
    state: dict = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.workdir / "kvstore.sock"

    @property
    def shm_name(self) -> str:
        """Unique per daemon: test runs in other checkouts may reuse the same node ids."""
        return f"kvstore-test-{self.node_id}-{self.workdir.name}"

    @property
    def state_file(self) -> Path:
        return Path(str(self.socket) + ".json")

    @property
    def address(self) -> str:
        return self.state["grpc_address"]

    @property
    def transport_address(self) -> str:
        return self.state["transport_address"]

    def settings(self) -> dict[str, str]:
        settings = {
            "server.grpc_port": "0",
            "server.metrics_port": "0",
            "server.node_id": self.node_id,
            "server.drain_timeout_s": "2",
            "host.capacity_bytes": "64MiB",
            "host.page_bytes": "4MiB",
            "host.name": self.shm_name,
            "nvme.directory": str(self.workdir / "nvme"),
            "nvme.capacity_bytes": "128MiB",
            "nvme.page_bytes": "4MiB",
            "nvme.file_bytes": "64MiB",
        }
        if self.token:
            settings["server.auth_token"] = self.token
        return {**settings, **self.extra}

    def command(self) -> list[str]:
        return serve_command(self.socket, self.settings(), self.config)

    def start(self, timeout_s: float = 30.0) -> Daemon:
        spawned = spawn_daemon(
            self.socket, self.settings(), self.workdir / f"daemon-{self.node_id}.log", timeout_s, self.prefix, self.config
        )
        self.process, self.state = spawned.process, spawned.state
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        return self.process.wait(timeout=timeout_s)

    def log(self) -> str:
        path = self.workdir / f"daemon-{self.node_id}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def new_daemon(tmp_path: Path, **kwargs) -> Daemon:
    workdir = tmp_path / f"node-{uuid.uuid4().hex[:6]}"
    workdir.mkdir()
    return Daemon(workdir=workdir, node_id=kwargs.pop("node_id", f"n{uuid.uuid4().hex[:6]}"), **kwargs)


@contextlib.contextmanager
def daemons(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start daemons with ``start(**Daemon fields)``; all are killed at exit and their
    shared-memory files removed (a killed daemon cannot remove its own)."""
    started: list[Daemon] = []

    def start(**kwargs) -> Daemon:
        daemon = new_daemon(tmp_path, **kwargs).start()
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            daemon.stop(signal.SIGKILL)
            Path(f"/dev/shm/{daemon.shm_name}").unlink(missing_ok=True)


def eventually(check, timeout_s: float = 10.0):
    """Poll ``check`` until it returns something truthy or ``timeout_s`` passes; returns its
    last value (daemons publish to the index and free slots asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)
