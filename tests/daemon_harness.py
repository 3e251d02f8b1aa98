"""Start and stop real `kvstore serve` processes for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MiB = 1024 * 1024


@dataclass
class Daemon:
    workdir: Path
    node_id: str
    token: str = ""
    extra: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    state: dict = field(default_factory=dict)

    @property
    def socket(self) -> Path:
        return self.workdir / "kvstore.sock"

    @property
    def state_file(self) -> Path:
        return Path(str(self.socket) + ".json")

    @property
    def address(self) -> str:
        return self.state["grpc_address"]

    def command(self) -> list[str]:
        settings = {
            "server.socket_path": str(self.socket),
            "server.grpc_port": "0",
            "server.metrics_port": "0",
            "server.node_id": self.node_id,
            "server.drain_timeout_s": "2",
            "host.capacity_bytes": "64MiB",
            "host.page_bytes": "4MiB",
            "host.name": f"kvstore-test-{self.node_id}",
            "nvme.directory": str(self.workdir / "nvme"),
            "nvme.capacity_bytes": "128MiB",
            "nvme.page_bytes": "4MiB",
            "nvme.file_bytes": "64MiB",
        }
        if self.token:
            settings["server.auth_token"] = self.token
        args = [sys.executable, "-m", "kvstore", "serve"]
        for key, value in settings.items():
            args += ["--set", f"{key}={value}"]
        return args + self.extra

    def start(self, timeout_s: float = 30.0) -> "Daemon":
        self.state_file.unlink(missing_ok=True)
        log = open(self.workdir / f"daemon-{self.node_id}.log", "ab")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with {self.process.returncode}: {self.log()}")
            if self.state_file.exists():
                try:
                    self.state = json.loads(self.state_file.read_text())
                    return self
                except ValueError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"kvstore serve did not start in {timeout_s}s: {self.log()}")

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
