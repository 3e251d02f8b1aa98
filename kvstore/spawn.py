"""Start `kvstore serve` as a child process and wait until it serves: for the demo,
benchmarks and tests, which all need a real daemon of their own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import DaemonUnavailable
from kvstore.paths import state_path_for

__all__ = ["DaemonProcess", "spawn_daemon"]


@dataclass
class DaemonProcess:
    process: subprocess.Popen
    socket_path: Path
    log_path: Path
    state: dict

    @property
    def grpc_address(self) -> str:
        return self.state["grpc_address"]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout_s)


def serve_command(socket_path: Path, settings: Mapping[str, object], config: Path | None = None) -> list[str]:
    command = [sys.executable, "-m", "kvstore", "serve", "--set", f"server.socket_path={socket_path}"]
    if config is not None:
        command += ["--config", str(config)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    return command


def spawn_daemon(
    socket_path: Path,
    settings: Mapping[str, object],
    log_path: Path,
    timeout_s: float = 60.0,
    prefix: Sequence[str] = (),
    config: Path | None = None,
) -> DaemonProcess:
    """Run `kvstore serve` with ``settings`` (``section.field`` → value) over the file
    ``config``, if given (what ``--set`` cannot say: ``[[engines]]``), and return once
    its state file exists; its output goes to ``log_path``. ``prefix`` wraps the command
    (e.g. ``ip netns exec NAME`` to run it in a network namespace)."""
    state_file = state_path_for(socket_path)
    state_file.unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen([*prefix, *serve_command(socket_path, settings, config)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise DaemonUnavailable(f"kvstore serve exited with {process.returncode}: {log_path.read_text(errors='replace')[-3000:]}")
        if state_file.exists():
            try:
                return DaemonProcess(process, socket_path, log_path, json.loads(state_file.read_text()))
            except ValueError:
                pass  # written but not flushed yet
        if time.monotonic() > deadline:
            process.kill()
            raise DaemonUnavailable(f"kvstore serve did not start within {timeout_s:g} s: {log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)
