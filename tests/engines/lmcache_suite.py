"""kvstore's LMCache remote-storage plugin inside LMCache's real storage stack.

LMCache builds its ``LocalCPUBackend`` and a ``RemoteBackend`` for the plugin named in
``remote_storage_plugins`` (``CreateStorageBackends``, as its cache engine does on CPU),
and the plugin talks to a real `kvstore serve`. Chunks are real LMCache memory objects
allocated from the CPU backend; the tests drive the RemoteBackend's own put, contains
and get paths on LMCache's event loop.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends
from test_manager_nvme import flip_a_byte_of

from kvstore.client import KVStoreClient
from kvstore.connectors.engine_keys import engine_key_hash
from kvstore.connectors.lmcache import KVStoreRemoteConnector

LAYERS, CHUNK, HEADS, HEAD_DIM = 4, 256, 2, 64
MODEL = "tiny-llama"


def metadata(worker_id: int = 0, world_size: int = 1, model: str = MODEL) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )


class Engine:
    """LMCache's storage side of one engine process: its event loop, its CPU backend and
    the RemoteBackend of the plugin, built from an LMCache config."""

    def __init__(self, socket: Path, meta: LMCacheMetadata, **settings) -> None:
        config = LMCacheEngineConfig.from_dict({
            "chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 0.1, "lmcache_instance_id": "kvstore-test",
            "remote_storage_plugins": ["kvstore"],
            "extra_config": {
                "remote_storage_plugin.kvstore.module_path": "kvstore.connectors.lmcache",
                "remote_storage_plugin.kvstore.class_name": "KVStoreRemoteConnector",
                "remote_storage_plugin.kvstore.socket_path": str(socket),
            },
            **settings,
        })  # fmt: skip
        self.meta = meta
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        backends = CreateStorageBackends(config, meta, self.loop)
        self.cpu, self.remote = backends["LocalCPUBackend"], backends["RemoteBackend-kvstore"]

    def key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey(self.meta.model_name, self.meta.world_size, self.meta.worker_id, chunk_hash, torch.bfloat16)

    def chunk(self, seed: int):
        memory_obj = self.cpu.allocate(self.meta.get_shapes(), self.meta.get_dtypes())
        memory_obj.tensor.copy_(torch.randn(memory_obj.tensor.shape, generator=torch.Generator().manual_seed(seed)))
        return memory_obj

    def put(self, keys, chunks) -> None:
        """LMCache's store path: submit, drop this side's references; wait until stored."""
        self.remote.batched_submit_put_task(keys, chunks)
        for memory_obj in chunks:
            memory_obj.ref_count_down()
        deadline = time.monotonic() + 60
        while self.remote.batched_contains(keys) < len(keys):
            assert time.monotonic() < deadline, "the puts did not land within a minute"
            time.sleep(0.01)

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def close(self) -> None:
        if self.loop.is_running():
            self.remote.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture
def engine():
    started: list[Engine] = []

    def start(socket: Path, meta: LMCacheMetadata | None = None, **settings) -> Engine:
        started.append(Engine(socket, meta or metadata(), **settings))
        return started[-1]

    yield start
    for e in started:
        e.close()


def contents(chunks) -> list[torch.Tensor]:
    return [c.tensor.clone() for c in chunks]


def test_the_plugin_is_selected_by_lmcache_config(daemon, engine):
    e = engine(daemon().socket)
    assert isinstance(e.remote.connection.getWrappedConnector(), KVStoreRemoteConnector)
    assert e.remote.batched_contains([e.key(1)]) == 0 and not e.remote.contains(e.key(1))


def test_chunks_round_trip_through_every_get_path(daemon, engine):
    e = engine(daemon().socket)
    keys = [e.key(100 + i) for i in range(6)]
    chunks = [e.chunk(i) for i in range(6)]
    expected = contents(chunks)
    e.put(keys, chunks)

    assert e.remote.batched_contains(keys) == 6 and e.remote.contains(keys[3])
    assert e.run(e.remote.batched_async_contains("lookup-1", keys)) == 6
    got = e.remote.batched_get_blocking(keys)
    assert all(torch.equal(g.tensor, x) for g, x in zip(got, expected))
    assert torch.equal(e.remote.get_blocking(keys[4]).tensor, expected[4])
    prefetched = e.run(e.remote.batched_get_non_blocking("lookup-1", keys[:3]))
    assert [torch.equal(g.tensor, x) for g, x in zip(prefetched, expected)] == [True] * 3
    for memory_obj in got + prefetched:
        memory_obj.ref_count_down()


def test_kvstore_holds_each_chunk_layer_major(daemon, engine):
    d = daemon()
    e = engine(d.socket)
    key, chunk = e.key(7), e.chunk(7)
    expected = chunk.tensor.view(2, LAYERS, CHUNK, HEADS, HEAD_DIM).transpose(0, 1).contiguous()  # [layer, K/V, token, head, dim]
    e.put([key], [chunk])
    namespace = e.remote.connection.getWrappedConnector().store.namespace
    with KVStoreClient(d.socket) as client:
        digest = client.register_namespace(namespace)
        stored = torch.empty(namespace.block_bytes, dtype=torch.uint8)
        assert client.load(digest, [engine_key_hash(key.to_string())], [stored]) == 1
    assert torch.equal(stored.view(torch.bfloat16).view(expected.shape), expected)


def test_an_absent_key_is_a_miss_and_ends_the_prefix(daemon, engine):
    e = engine(daemon().socket)
    keys = [e.key(200), e.key(201), e.key(202)]
    chunks = [e.chunk(200), e.chunk(202)]
    first = contents(chunks)[0]
    e.put([keys[0], keys[2]], chunks)
    assert e.remote.batched_contains(keys) == 1 and not e.remote.contains(keys[1])
    got = e.remote.batched_get_blocking(keys)
    assert torch.equal(got[0].tensor, first) and got[1] is None and got[2] is None
    assert e.remote.get_blocking(keys[1]) is None
    assert (
        e.run(e.remote.batched_get_non_blocking("lookup-2", keys))
        and len(e.run(e.remote.batched_get_non_blocking("lookup-3", keys[1:]))) == 0
    )


def test_a_corrupted_chunk_is_a_miss_not_wrong_data(daemon, engine):
    d = daemon()
    e = engine(d.socket)
    keys = [e.key(300 + i) for i in range(3)]
    chunks = [e.chunk(300 + i) for i in range(3)]
    expected = contents(chunks)
    e.put(keys, chunks)
    e.close()
    assert d.stop(signal.SIGTERM) == 0  # a clean stop moves every block to the NVMe tier
    stored_bytes = expected[1].view(2, LAYERS, CHUNK, HEADS, HEAD_DIM).transpose(0, 1).contiguous().view(torch.uint8).reshape(-1)
    flip_a_byte_of(d.workdir / "nvme", stored_bytes)
    d.start()

    e = engine(d.socket)
    got = e.remote.batched_get_blocking(keys)
    assert torch.equal(got[0].tensor, expected[0])
    assert got[1] is None and got[2] is None  # the corrupt chunk is a miss, and so is what follows it
    assert e.remote.batched_contains(keys) == 1  # the daemon dropped the corrupt block on the read


def test_chunks_are_scoped_by_model_and_worker(daemon, engine):
    d = daemon()
    e = engine(d.socket, metadata(worker_id=0, world_size=2))
    e.put([e.key(400)], [e.chunk(400)])
    assert engine(d.socket, metadata(worker_id=0, world_size=2)).remote.contains(e.key(400))
    other_worker = engine(d.socket, metadata(worker_id=1, world_size=2))
    assert not other_worker.remote.contains(other_worker.key(400))
    other_model = engine(d.socket, metadata(worker_id=0, world_size=2, model="another-model"))
    assert not other_model.remote.contains(other_model.key(400))


def test_a_daemon_that_went_away_makes_gets_miss_and_puts_fail_quietly(daemon, engine):
    d = daemon()
    e = engine(d.socket)
    e.put([e.key(500)], [e.chunk(500)])
    d.stop(signal.SIGKILL)
    assert e.remote.batched_get_blocking([e.key(500)]) == [None]
    assert not e.remote.contains(e.key(500)) and e.remote.batched_contains([e.key(500)]) == 0
    e.remote.batched_submit_put_task([e.key(501)], [e.chunk(501)])  # logged, not raised
    d.start()  # back: the plugin's client reconnects by itself and registers its namespace again
    deadline = time.monotonic() + 15
    while not e.remote.contains(e.key(502)) and time.monotonic() < deadline:
        e.remote.batched_submit_put_task([e.key(502)], [e.chunk(502)])  # refused until it has reconnected
        time.sleep(0.3)
    assert e.remote.batched_get_blocking([e.key(502)])[0] is not None


def test_partial_chunks_are_refused_with_a_sentence(daemon, engine, caplog):
    e = engine(daemon().socket, save_unfull_chunk=True)
    assert e.remote.connection is None  # LMCache keeps running without the plugin
    assert any("stores full chunks only" in record.getMessage() for record in caplog.records)
