"""Engine ↔ daemon: control round trip and data path through a real `kvstore serve`.

    python -m bench.daemon [--quick] [--json]

- lookup round trip of 512 block keys over the local protocol, p50/p99 (target: p50 ≤
  200 µs), next to the same lookup through the gRPC API (why engines do not use gRPC);
- save (reserve → copy into the shared slab → commit) and load (lease → copy out →
  release) GB/s of 1 MiB blocks through the daemon, against a single-thread memcpy of the
  same blocks between private tensors in the same run;
- remote fetch: an engine's ``load(allow_remote=True)`` on one daemon of blocks that only
  a second daemon holds (over TCP, and UCX where ucxx is installed): the peer streams them
  into the first daemon's host tier, which then copies them out to the engine, all in the
  timed call. Against the same bytes as one raw socket ``sendall`` between two processes,
  and against a load of the same blocks once local.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.report import Report, best_of, gbps, parse_args, timed
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.errors import TransportUnavailable
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.spawn import DaemonProcess, spawn_daemon
from kvstore.tiers.base import copy_bytes
from kvstore.transport.config import TransportConfig
from kvstore.transport.ucx import import_ucxx

MiB = 1024 * 1024
LOOKUP_KEYS = 512
# 1 MiB blocks: 16 layers × K,V × 16 tokens × 8 heads × 128 dims × fp16
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16)
NAMESPACE = Namespace("bench/daemon-model", LAYOUT)
# lookups only need keys; 4 KiB blocks keep 512 of them small
LOOKUP_NAMESPACE = Namespace("bench/daemon-lookup", KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16))


def start_daemon(workdir: Path, host_bytes: int, **extra: object) -> DaemonProcess:
    settings = {"server.grpc_port": 0, "server.metrics_port": -1, "host.capacity_bytes": host_bytes, "nvme.enabled": "false", **extra}
    return spawn_daemon(workdir / "kvstore.sock", settings, workdir / "daemon.log")


def remote_fetch(kind: str, total: int, repeats: int) -> dict:
    """Best seconds of a remote load (fetch + copy out) and of the same load once local."""
    workdir = Path(tempfile.mkdtemp(prefix=f"kvstore-bench-fetch-{kind}-"))
    daemons = []
    try:
        for name in ("holder", "reader"):
            (workdir / name).mkdir()
            daemons.append(start_daemon(workdir / name, total + 256 * MiB, **{"server.node_id": f"bench-{name}", "transport.kind": kind}))
        holder, reader = (KVStoreClient(d.state["socket"]) for d in daemons)
        digest = holder.register_namespace(NAMESPACE)
        reader.register_namespace(NAMESPACE)
        num_blocks = total // LAYOUT.block_bytes
        src = torch.empty(total, dtype=torch.uint8).random_(0, 256)
        dst = torch.zeros(total, dtype=torch.uint8)
        hashes = chain_hashes(np.arange(num_blocks * LAYOUT.block_size) + 20_000_000, LAYOUT.block_size)
        holder.save(digest, hashes, list(src.view(num_blocks, -1).unbind(0)))
        dsts = list(dst.view(num_blocks, -1).unbind(0))
        source = daemons[0].state["transport_address"]

        def fetch() -> float:
            with connect(daemons[1].state["grpc_address"]) as api:
                api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=hashes))
            dst.zero_()
            seconds = timed(lambda: reader.load(digest, hashes, dsts, allow_remote=True, deadline_s=60, source=source))
            assert torch.equal(dst, src), "the remote fetch returned different bytes"
            return seconds

        fetch_s = best_of(repeats, fetch)
        local_s = best_of(repeats, lambda: timed(lambda: reader.load(digest, hashes, dsts)))
        holder.close()
        reader.close()
    finally:
        for daemon in daemons:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"transport": kind, "fetch_gbps": gbps(total, fetch_s), "local_load_gbps": gbps(total, local_s)}


def raw_socket_seconds(total: int, repeats: int) -> float:
    """One ``sendall`` of ``total`` bytes from another process, best of ``repeats``."""
    from bench.transport import RawSocketLink

    async def run() -> float:
        async with RawSocketLink(memoryview(bytearray(total))) as link:
            return min([await link.run(total) for _ in range(repeats)])

    return asyncio.run(run())


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    total = (128 if args.quick else 512) * MiB
    num_blocks = total // LAYOUT.block_bytes
    lookups = 1_000 if args.quick else 5_000
    report = Report("daemon")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-daemon-"))
    daemon = start_daemon(workdir, host_bytes=total + 256 * MiB)
    state = daemon.state
    try:
        client = KVStoreClient(state["socket"])
        digest = client.register_namespace(NAMESPACE)

        # control round trip: 512 cached keys
        lookup_digest = client.register_namespace(LOOKUP_NAMESPACE)
        keys = chain_hashes(np.arange(LOOKUP_KEYS * 16), 16)
        client.save(lookup_digest, keys, [torch.zeros(LOOKUP_NAMESPACE.block_bytes, dtype=torch.uint8)] * LOOKUP_KEYS)
        samples = []
        for _ in range(lookups):
            started = time.perf_counter()
            found = client.lookup(lookup_digest, keys)
            samples.append(time.perf_counter() - started)
        assert found.num_blocks == LOOKUP_KEYS
        local_p50, local_p99 = percentiles(samples)
        grpc_samples = []
        with connect(state["grpc_address"]) as api:
            request = pb.LookupRequest(namespace_id=lookup_digest, block_hashes=pb.BlockHashes(hashes=keys))
            for _ in range(lookups // 5):
                started = time.perf_counter()
                api.store.Lookup(request)
                grpc_samples.append(time.perf_counter() - started)
        grpc_p50, grpc_p99 = percentiles(grpc_samples)

        # data path: distinct blocks, steady state (buffers already touched)
        src = torch.empty(total, dtype=torch.uint8).random_(0, 256)
        dst = torch.zeros(total, dtype=torch.uint8)
        srcs = list(src.view(num_blocks, -1).unbind(0))
        dsts = list(dst.view(num_blocks, -1).unbind(0))
        hashes = chain_hashes(np.arange(num_blocks * LAYOUT.block_size) + 10_000_000, LAYOUT.block_size)

        def memcpy() -> float:
            return timed(lambda: [copy_bytes(d, s) for s, d in zip(srcs, dsts)])

        baseline = best_of(3, memcpy)
        dst.zero_()

        def save() -> float:
            with connect(state["grpc_address"]) as api:
                api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=hashes))
            return timed(lambda: client.save(digest, hashes, srcs))

        save_s = best_of(3, save)
        load_s = best_of(3, lambda: timed(lambda: client.load(digest, hashes, dsts)))
        assert torch.equal(dst, src), "the daemon returned different bytes"
        client.close()
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "lookup_keys": LOOKUP_KEYS,
        "local_lookup_p50_us": local_p50 * 1e6,
        "local_lookup_p99_us": local_p99 * 1e6,
        "grpc_lookup_p50_us": grpc_p50 * 1e6,
        "grpc_lookup_p99_us": grpc_p99 * 1e6,
        "block_bytes": LAYOUT.block_bytes,
        "total_bytes": total,
        "memcpy_gbps": gbps(total, baseline),
        "save_gbps": gbps(total, save_s),
        "load_gbps": gbps(total, load_s),
    }
    report.results.append(result)
    report.print_table(
        f"lookup of {LOOKUP_KEYS} keys (µs)",
        ["path", "p50", "p99"],
        [
            ["local socket", result["local_lookup_p50_us"], result["local_lookup_p99_us"]],
            ["gRPC", result["grpc_lookup_p50_us"], result["grpc_lookup_p99_us"]],
        ],
    )
    report.print_table(
        f"data path, {total // MiB} MiB of 1 MiB blocks (GB/s; baseline: single-thread memcpy of the same blocks)",
        ["memcpy", "save", "load", "save/memcpy", "load/memcpy"],
        [
            [
                result["memcpy_gbps"],
                result["save_gbps"],
                result["load_gbps"],
                result["save_gbps"] / result["memcpy_gbps"],
                result["load_gbps"] / result["memcpy_gbps"],
            ]
        ],
    )
    report.ratio("lookup_512_p50_us", result["local_lookup_p50_us"], "<= 200")
    report.ratio("lookup_512_p99_us", result["local_lookup_p99_us"])
    report.ratio("grpc_lookup_512_p50_us", result["grpc_lookup_p50_us"])
    fetch_total = (64 if args.quick else 256) * MiB
    raw_gbps = gbps(fetch_total, raw_socket_seconds(fetch_total, 7))
    kinds = ["tcp"]
    try:
        import_ucxx(TransportConfig(kind="ucx"))
        kinds.append("ucx")
    except TransportUnavailable as exc:
        print(f"UCX remote fetch skipped: {exc}")
    fetches = [remote_fetch(kind, fetch_total, 3) for kind in kinds]
    rows = []
    for fetch in fetches:
        fetch.update(total_bytes=fetch_total, raw_socket_gbps=raw_gbps)
        report.results.append(fetch)
        rows.append(
            [
                fetch["transport"],
                raw_gbps,
                fetch["fetch_gbps"],
                fetch["local_load_gbps"],
                fetch["fetch_gbps"] / raw_gbps,
                fetch["fetch_gbps"] / fetch["local_load_gbps"],
            ]
        )
        report.ratio(f"remote_fetch_{fetch['transport']}_vs_raw_socket", fetch["fetch_gbps"] / raw_gbps)
    report.print_table(
        f"remote fetch, {fetch_total // MiB} MiB of 1 MiB blocks held by another daemon "
        "(GB/s; the engine's load: fetch into this daemon, then copy out)",
        ["transport", "raw socket", "remote load", "local load", "remote/raw", "remote/local"],
        rows,
    )
    report.ratio("save_vs_memcpy", result["save_gbps"] / result["memcpy_gbps"], ">= 0.7")
    report.ratio("load_vs_memcpy", result["load_gbps"] / result["memcpy_gbps"], ">= 0.7")
    report.emit(args.json)


if __name__ == "__main__":
    main()
