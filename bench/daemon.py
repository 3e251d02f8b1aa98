"""Engine ↔ daemon: control round trip and data path through a real `kvstore serve`.

    python -m bench.daemon [--quick] [--json] [--remote-fetch-only]

- lookup round trip of 512 block keys over the local protocol, p50/p99 (target: p50 ≤
  100 µs; the same chain each time, as a scheduler looks up a waiting request or the next
  turn of a session; one lookup after another, as a scheduler looks up its waiting
  requests, so the daemon's loop is still polling from its last answer, ``server.spin_us``),
  next to a lookup of a chain the daemon has not seen (every key hashed afresh), the same
  lookup finding the daemon asleep (each 2 ms after the last answer: the loop has stopped
  polling and is woken from epoll), the same lookup by a client that sleeps in recv at
  once (``spin_s`` 0; the default client polls for its answer for up to 200 µs first),
  the same lookup holding the blocks it finds, as the vLLM scheduler's lookup does
  (``LOOKUP_HOLD``, the previous hold released in the same round trip), and through the
  gRPC API (why engines do not use gRPC); beside them, the floor: a round trip of the
  same frame sizes over a Unix socket between two processes doing no work, both ends
  polling, the far end sleeping and the reader polling, or both sleeping (on a VM a
  wakeup on another CPU costs tens of µs each way);
- save (reserve → copy into the shared slab, each block's XXH3-64 taken with the copy →
  commit) and load (lease → copy out → release) GB/s of 1 MiB blocks through the daemon,
  against a single-thread memcpy of the same blocks between private tensors in the same
  run (the save copies on one thread, its checksums taken beside it) and the load also
  against the copy it makes (``tiers.base.copy_all``: a batch of 4 MiB or more is shared
  with a helper thread where the process has a second core; ``load_vs_memcpy`` divides
  by this one); and the save against the same save without the checksums (the same reserve, copy
  and commit, checksums sent as zeros: the save path before blocks carried checksums),
  so the checksums' cost is a ratio of its own; and the first save into a fresh daemon
  (started, ready, then saved into at once by a client that has just connected: pages of
  the shared slab that neither process has touched yet) against the same memcpy
  (``cold_save_vs_memcpy``, target ≥ 0.7);
- event-loop lag while an engine promotes a 100K-token prefix from NVMe (25K with
  ``--quick``) and another engine, in its own process, keeps looking up a cached chain:
  the p99 of how late the daemon's loop ran its 1 ms timer (``kvstore_event_loop_lag_
  seconds``, from the daemon's metrics before and after, interpolated within the bucket
  as Prometheus' ``histogram_quantile`` does), and the other engine's lookup p99 during
  the promotion, next to both with no promotion running;
- remote fetch: an engine's ``load(allow_remote=True)`` on one daemon of blocks that only
  a second daemon holds (over TCP, and UCX where ucxx is installed), all in the timed
  call: the locate round trip to its daemon, then over TCP the engine receives them from
  the peer into its own tensors, each checked against its writer's checksum
  (kvstore/remote_read.py); over UCX the peer streams them into the first daemon's host
  tier and the engine copies them out. Beside it, the same blocks through the daemon over
  either transport (``client.fetch`` into its host tier, then the load's copy out; the
  path every remote load took before 2026-12-04). Against a raw socket moving the same
  bytes between two processes (target ≥ 0.8): one ``sendall`` of everything, and the same 1 MiB blocks as frames with
  kvstore's headers and checksums, each ``sendmsg`` a header and its payload (on loopback
  here the second is the faster: 4.4–4.7 GB/s against 2.4–3.0 in bench.transport), the
  ratio against the faster of the two; the raw sends and each transport's loads take
  turns, best of 5 each (bench.transport's ``RawSocketLink``, its receiver woken per MiB
  as kvstore's is). And against a load of the same blocks once local. ``--remote-fetch-only``
  runs this part alone (the same baseline, the same sizes);
- what peer authentication costs the remote load over TCP: three pairs of daemons, one
  authenticating nothing, one with a fleet secret (the engine reads with the reader key
  its daemon hands it, every frame MAC'd), one with mutual TLS; the engine's loads from
  each take turns with raw sockets moving the same bytes, plain and TLS (bench.
  transport's ``RawTlsLink``: the same TLS context; one ``sendall`` of everything, and the
  1 MiB blocks behind kvstore's header, XXH3 checked; the ratio against the faster), best
  of 9 each (5 with ``--quick``): ``remote_load_mac_vs_plain`` (target ≥ 0.7) and
  ``remote_load_tls_vs_raw_tls`` (target ≥ 0.8), each the ratio of the round with the
  median ratio (its two figures measured in that round; bench.transport's
  ``median_round`` says why), the ratio of the best runs (``…_best``) and the range
  round by round beside, and the CPU time per GB of every process in each run (engine and
  daemons; sender and receiver), which other work on the machine does not shift; and
  the peer connections the loads opened (the engine's and its daemon's to the holder,
  seen in /proc after each load): connections are kept and reused, so one per pair
  (target ≤ 1). It runs with ``--remote-fetch-only`` too.
Every ratio is printed with the two figures it divides. The data path's figures and
their baselines (memcpy, the copy as a load makes it, save with and without checksums,
load) take turns too, best of 5 each: on a VM whose memcpy moves by a third from minute
to minute, a baseline timed apart from what it divides says more about the minute than
about kvstore.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.report import Report, best_in_turns, best_of, gbps, parse_args, timed, timings_in_turns
from kvstore import localproto
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.errors import TransportUnavailable
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.localproto import Op
from kvstore.namespace import Namespace
from kvstore.spawn import DaemonProcess, spawn_daemon
from kvstore.tiers.base import copy_all, copy_bytes
from kvstore.transport.base import split_address
from kvstore.transport.config import TransportConfig
from kvstore.transport.ucx import import_ucxx

MiB = 1024 * 1024
LOOKUP_KEYS = 512
ASLEEP_GAP_S = 0.002  # past the daemon's polling window (server.spin_us, 200 µs by default)
DATA_ROUNDS = 5  # rounds of the data path's figures and baselines, taken in turns
FETCH_ROUNDS = 5  # rounds of each remote fetch and the raw socket, taken in turns
SECURE_ROUNDS = 9  # the same for the loads with peer authentication (without --quick): their spread is shown
# 1 MiB blocks: 16 layers × K,V × 16 tokens × 8 heads × 128 dims × fp16
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16)
NAMESPACE = Namespace("bench/daemon-model", LAYOUT)
# lookups only need keys; 4 KiB blocks keep 512 of them small
LOOKUP_NAMESPACE = Namespace("bench/daemon-lookup", KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16))


def start_daemon(workdir: Path, host_bytes: int, **extra: object) -> DaemonProcess:
    settings = {"server.grpc_port": 0, "server.metrics_port": -1, "host.capacity_bytes": host_bytes, "nvme.enabled": "false", **extra}
    return spawn_daemon(workdir / "kvstore.sock", settings, workdir / "daemon.log")


def save_without_checksums(client: KVStoreClient, digest: bytes, hashes: list, blocks: list[torch.Tensor]) -> int:
    """The save path as it was before blocks carried checksums, as a baseline: the same
    reserve, copy into the slab and commit, with no hashing (the checksums sent as zeros)."""
    pending = client.begin_save(digest, hashes)
    for index, view in zip(pending.indices, pending.views):
        copy_bytes(view, blocks[index])
    return client._run(client._core._commit(pending, [0] * len(pending.views)))


# 64 KiB blocks of 16 tokens (4 layers x K,V x 2 heads x 128 dims x fp16): a 100K-token prefix is 400 MiB
LAG_LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=128, block_size=16)
LAG_NAMESPACE = Namespace("bench/daemon-promotion", LAG_LAYOUT)


def loop_lag(tokens: int) -> dict:
    """The daemon's loop lag and another engine's lookups, idle and while a prefix of
    ``tokens`` tokens is promoted from NVMe."""
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-lag-"))
    num_blocks = tokens // LAG_LAYOUT.block_size
    total = num_blocks * LAG_LAYOUT.block_bytes
    settings = {
        "server.grpc_port": 0, "server.metrics_port": 0, "server.loop_lag_interval_ms": 1,
        "host.capacity_bytes": total + 128 * MiB, "nvme.enabled": "true", "nvme.directory": workdir / "nvme",
        "nvme.capacity_bytes": 2 * total + 256 * MiB,
    }  # fmt: skip
    daemon = spawn_daemon(workdir / "kvstore.sock", settings, workdir / "daemon.log")
    try:
        hashes = chain_hashes(np.arange(num_blocks * LAG_LAYOUT.block_size) + 30_000_000, LAG_LAYOUT.block_size)
        block = torch.empty(LAG_LAYOUT.block_bytes, dtype=torch.uint8).random_(0, 256)
        with KVStoreClient(daemon.state["socket"]) as client:
            digest = client.register_namespace(LAG_NAMESPACE)
            lookup_digest = client.register_namespace(LOOKUP_NAMESPACE)
            for start in range(0, num_blocks, 1024):
                part = hashes[start : start + 1024]
                client.save(digest, part, [block] * len(part), parent_hash=hashes[start - 1] if start else None)
            keys = chain_hashes(np.arange(LOOKUP_KEYS * 16) + 40_000_000, 16)
            client.save(lookup_digest, keys, [torch.zeros(LOOKUP_NAMESPACE.block_bytes, dtype=torch.uint8)] * LOOKUP_KEYS)
        daemon.stop()  # a clean stop moves every block to NVMe
        daemon = spawn_daemon(workdir / "kvstore.sock", settings, workdir / "daemon.log")
        metrics_url = f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics"
        with KVStoreClient(daemon.state["socket"]) as client:
            digest = client.register_namespace(LAG_NAMESPACE)
            assert client.lookup(digest, hashes).num_blocks == num_blocks
            idle = _lag_window(daemon, metrics_url, 2.0, None)
            into = [torch.empty(LAG_LAYOUT.block_bytes, dtype=torch.uint8) for _ in hashes]
            promoting = _lag_window(daemon, metrics_url, None, lambda: client.load(digest, hashes, into))
            assert promoting["loaded"] == num_blocks and all(torch.equal(t, block) for t in into[:: max(1, num_blocks // 64)])
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"tokens": tokens, "prefix_bytes": total, "idle": idle, "promoting": promoting}


def _lag_window(daemon: DaemonProcess, metrics_url: str, seconds: float | None, work) -> dict:
    """Loop-lag p99 and another engine's lookup latencies over ``seconds`` of idling, or
    over the time ``work`` takes."""
    looker = subprocess.Popen(
        [sys.executable, "-m", "bench.daemon", "--look-up", daemon.state["socket"]],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert looker.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    before = _lag_buckets(metrics_url)
    started = time.monotonic()
    loaded = work() if work is not None else time.sleep(seconds)
    ended = time.monotonic()
    after = _lag_buckets(metrics_url)
    looker.stdin.write("stop\n")
    looker.stdin.flush()
    samples = json.loads(looker.stdout.readline())
    looker.wait()
    during = [latency for at, latency in samples if started <= at <= ended] or [latency for _, latency in samples]
    p50, p99 = percentiles(during)
    deltas = [(bound, after[bound] - before.get(bound, 0)) for bound in after]
    return {
        "seconds": ended - started,
        "loop_lag_p99_ms": _histogram_quantile(0.99, deltas) * 1e3,
        "loop_lag_samples": deltas[-1][1],
        "lookup_p50_us": p50 * 1e6,
        "lookup_p99_us": p99 * 1e6,
        "lookups": len(during),
        "loaded": loaded if work is not None else 0,
    }


def _lag_buckets(metrics_url: str) -> dict[float, float]:
    """Cumulative counts of kvstore_event_loop_lag_seconds by upper bound (``le``)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    buckets = {}
    for line in text.splitlines():
        if line.startswith("kvstore_event_loop_lag_seconds_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if bound == "+Inf" else float(bound)] = float(line.rsplit(" ", 1)[1])
    return dict(sorted(buckets.items()))


def _histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in."""
    total = cumulative[-1][1]
    if total <= 0:
        return 0.0
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return lower_bound


def echo(fd: int, request_bytes: int, reply_bytes: int, polling: bool) -> None:
    """The raw round trip's far end: read each request whole and answer it, until the
    socket closes; blocking in recv as a daemon's loop sleeps in epoll, or ``polling`` for
    it as the loop does after an answer (``server.spin_us``)."""
    import socket

    sock, landing, reply = socket.socket(fileno=fd), bytearray(1 << 20), b"r" * reply_bytes
    # polling, the socket stays non-blocking, as a daemon's are: the reader takes each
    # reply before it sends again, so a reply always finds the buffer empty
    sock.setblocking(not polling)
    while True:
        got = 0
        while got < request_bytes:
            try:
                count = sock.recv_into(landing)
            except BlockingIOError:
                continue
            if not count:
                return
            got += count
        sock.sendall(reply)


def raw_round_trips(request_bytes: int, reply_bytes: int, samples: int) -> dict[str, float]:
    """p50 µs of a round trip of the lookup's frame sizes over a Unix socket between two
    processes, with no work at either end: the far end sleeping in recv and the reader
    sleeping, or polling for its answer (as ``KVStoreClient`` does for up to ``spin_s``);
    and both polling (as the client and a daemon that has just answered do)."""
    import socket

    result = {}
    for far_polls, modes in ((False, ("sleeping", "polling")), (True, ("both_polling",))):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        far = subprocess.Popen(
            [sys.executable, "-m", "bench.daemon", "--echo", *map(str, (theirs.fileno(), request_bytes, reply_bytes, int(far_polls)))],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        request, landing = b"q" * request_bytes, bytearray(1 << 20)
        try:
            for mode in modes:
                ours.setblocking(mode == "sleeping")
                times = []
                for _ in range(samples):
                    started = time.perf_counter()
                    ours.sendall(request)
                    got = 0
                    while got < reply_bytes:
                        try:
                            got += ours.recv_into(landing)
                        except BlockingIOError:
                            pass
                    times.append(time.perf_counter() - started)
                result[mode] = percentiles(times)[0] * 1e6
        finally:
            ours.close()
            far.wait(timeout=10)
    return result


def look_up(socket_path: str) -> None:
    """The other engine: look up a cached 512-block chain until told to stop, then print
    every (monotonic time, latency) on one line."""
    import select

    samples = []
    with KVStoreClient(socket_path) as client:
        digest = client.register_namespace(LOOKUP_NAMESPACE)
        keys = chain_hashes(np.arange(LOOKUP_KEYS * 16) + 40_000_000, 16)
        print("ready", flush=True)
        while not select.select([sys.stdin], [], [], 0)[0]:
            started = time.monotonic()
            client.lookup(digest, keys)
            samples.append((started, time.monotonic() - started))
            time.sleep(0.0005)
    print(json.dumps(samples), flush=True)


def remote_fetch(kind: str, total: int, rounds: int) -> dict:
    """Best seconds of a remote load (fetch + copy out), of a raw socket moving the same
    bytes between two processes (one ``sendall`` of everything, and the same blocks as
    frames with kvstore's headers and checksums), and of the same load once local: the
    first three in turns, so that their ratios see one machine."""
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

        def fetched(load: Callable[[], object]) -> Callable[[], float]:
            def run() -> float:
                with connect(daemons[1].state["grpc_address"]) as api:
                    api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=hashes))
                dst.zero_()
                seconds = timed(load)
                assert torch.equal(dst, src), "the remote fetch returned different bytes"
                return seconds

            return run

        def through_daemon() -> None:
            assert reader.fetch(digest, hashes, deadline_s=60, source=source) == num_blocks
            reader.load(digest, hashes, dsts)

        fetch = fetched(lambda: reader.load(digest, hashes, dsts, allow_remote=True, deadline_s=60, source=source))
        with raw_socket(total) as (raw, _):
            fetch_s, through_s, whole_s, framed_s = best_in_turns(
                rounds, [fetch, fetched(through_daemon), lambda: raw(total), lambda: raw(LAYOUT.block_bytes)]
            )
        local_s = best_of(rounds, lambda: timed(lambda: reader.load(digest, hashes, dsts)))
        holder.close()
        reader.close()
    finally:
        for daemon in daemons:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "transport": kind,
        "total_bytes": total,
        "fetch_gbps": gbps(total, fetch_s),
        "through_daemon_gbps": gbps(total, through_s),
        "raw_socket_gbps": gbps(total, min(whole_s, framed_s)),  # the faster of the two
        "raw_one_buffer_gbps": gbps(total, whole_s),
        "raw_framed_gbps": gbps(total, framed_s),
        "local_load_gbps": gbps(total, local_s),
    }


SECURE_MODES = ("plain", "mac", "tls")  # bench.transport.fleet_credentials' ways to authenticate peers


def secure_remote_load(total: int, rounds: int) -> dict:
    """Best seconds, and every round's, of the engine's remote load between two daemons
    that authenticate nothing, that share a fleet secret, and that use mutual TLS, taking
    turns with raw sockets moving the same bytes (plain and TLS); and the connections the
    loads opened to each holder."""
    from bench.transport import cpu_seconds, fleet_credentials

    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-secure-fetch-"))
    (workdir / "credentials").mkdir()
    credentials = fleet_credentials(workdir / "credentials")
    daemons: list[DaemonProcess] = []
    clients: list[KVStoreClient] = []
    num_blocks = total // LAYOUT.block_bytes
    src = torch.empty(total, dtype=torch.uint8).random_(0, 256)
    dst = torch.zeros(total, dtype=torch.uint8)
    srcs, dsts = list(src.view(num_blocks, -1).unbind(0)), list(dst.view(num_blocks, -1).unbind(0))
    hashes = chain_hashes(np.arange(num_blocks * LAYOUT.block_size) + 50_000_000, LAYOUT.block_size)
    connections: dict[str, set] = {mode: set() for mode in SECURE_MODES}  # (who, local port) of each seen
    cpu: dict[str, list[float]] = collections.defaultdict(list)  # CPU seconds of each run, every process in it

    def with_cpu(name: str, run: Callable[[], float], pids: list[int]) -> Callable[[], float]:
        def measured() -> float:
            before = time.process_time() + sum(map(cpu_seconds, pids))
            seconds = run()
            cpu[name].append(time.process_time() + sum(map(cpu_seconds, pids)) - before)
            return seconds

        return measured

    def remote_load(mode: str, reader: KVStoreClient, digest: bytes, holder: DaemonProcess, reading: DaemonProcess) -> Callable[[], float]:
        source = holder.state["transport_address"]
        port = split_address(source, "tcp")[1]

        load = with_cpu(
            mode,
            lambda: timed(lambda: reader.load(digest, hashes, dsts, allow_remote=True, deadline_s=60, source=source)),
            [holder.process.pid, reading.process.pid],
        )

        def run() -> float:
            dst.zero_()
            seconds = load()
            assert torch.equal(dst, src), f"the {mode} remote load returned different bytes"
            for who, pid in (("engine", os.getpid()), ("reading daemon", reading.process.pid)):
                connections[mode] |= {(who, local_port) for local_port in connections_to(pid, port)}
            return seconds

        return run

    try:
        loads = []
        for mode in SECURE_MODES:
            settings = {"transport.kind": "tcp", **{f"transport.{name}": value for name, value in credentials[mode].items()}}
            pair = []
            for name, host_bytes in (("holder", total + 256 * MiB), ("reader", 256 * MiB)):
                (workdir / f"{mode}-{name}").mkdir()
                pair.append(start_daemon(workdir / f"{mode}-{name}", host_bytes, **{"server.node_id": f"bench-{mode}-{name}", **settings}))
                daemons.append(pair[-1])
            holder, reader = KVStoreClient(pair[0].state["socket"]), KVStoreClient(pair[1].state["socket"])
            clients += [holder, reader]
            digest = holder.register_namespace(NAMESPACE)
            reader.register_namespace(NAMESPACE)
            holder.save(digest, hashes, srcs)
            loads.append(remote_load(mode, reader, digest, *pair))
        with raw_socket(total) as (raw_tcp, tcp_sender), raw_socket(total, credentials["tls"]) as (raw_tls, tls_sender):
            raws = [
                with_cpu("raw_tcp_whole", lambda: raw_tcp(total), [tcp_sender]),
                with_cpu("raw_tcp_framed", lambda: raw_tcp(LAYOUT.block_bytes), [tcp_sender]),
                with_cpu("raw_tls_whole", lambda: raw_tls(total), [tls_sender]),
                with_cpu("raw_tls_framed", lambda: raw_tls(LAYOUT.block_bytes), [tls_sender]),
            ]
            timings = timings_in_turns(rounds, loads + raws)
    finally:
        for client in clients:
            client.close()
        for daemon in daemons:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    plain, mac, tls, tcp_whole, tcp_framed, tls_whole, tls_framed = timings
    raw_tls_best = [min(whole, framed) for whole, framed in zip(tls_whole, tls_framed)]
    return {
        "transport": "tcp",
        "total_bytes": total,
        "loads_per_mode": rounds,
        **{f"{mode}_gbps": gbps(total, min(seconds)) for mode, seconds in zip(SECURE_MODES, (plain, mac, tls))},
        "raw_tcp_gbps": gbps(total, min(tcp_whole + tcp_framed)),
        "raw_tls_one_buffer_gbps": gbps(total, min(tls_whole)),
        "raw_tls_framed_gbps": gbps(total, min(tls_framed)),
        "raw_tls_gbps": gbps(total, min(raw_tls_best)),  # the faster of the two
        # seconds of the baseline over the load's, round by round: its throughput ratio
        "mac_vs_plain_rounds": [p / m for p, m in zip(plain, mac)],
        "tls_vs_raw_tls_rounds": [r / t for r, t in zip(raw_tls_best, tls)],
        "seconds_by_round": {"plain": plain, "mac": mac, "tls": tls, "raw_tls": raw_tls_best},
        # CPU time of every process a run used, per GB: unlike throughput, not shifted by other work on the machine
        "cpu_ms_per_gb": {name: statistics.median(seconds) / total * 1e12 for name, seconds in cpu.items()},
        "connections": {
            mode: {who: sum(1 for seen, _ in connections[mode] if seen == who) for who in ("engine", "reading daemon")}
            for mode in SECURE_MODES
        },
    }


def connections_to(pid: int, port: int) -> set[int]:
    """The local ports of the TCP connections process ``pid`` holds open to ``port`` (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def secure_remote_fetches(report: Report, quick: bool) -> None:
    from bench.transport import median_round, spread

    total, rounds = (64 * MiB, FETCH_ROUNDS) if quick else (256 * MiB, SECURE_ROUNDS)
    fetch = secure_remote_load(total, rounds)
    report.results.append({"secure_remote_load": fetch})
    seconds = fetch["seconds_by_round"]
    for name, measured, baseline, target in (("mac_vs_plain", "mac", "plain", ">= 0.7"), ("tls_vs_raw_tls", "tls", "raw_tls", ">= 0.8")):
        measured_s, baseline_s = median_round(seconds[measured], seconds[baseline])
        report.compare(f"remote_load_{name}", gbps(total, measured_s), gbps(total, baseline_s), "GB/s", target)
        report.compare(f"remote_load_{name}_best", fetch[f"{measured}_gbps"], fetch[f"{baseline}_gbps"], "GB/s")
    report.print_table(
        f"remote load with peer authentication, {total // MiB} MiB of 1 MiB blocks held by another daemon (GB/s, best of {rounds} "
        "in turns; plain: no authentication; MAC: a fleet secret, every frame's MAC (AES-256-GCM tag) checked by the engine; "
        "TLS: mutual TLS 1.3; raw: sockets between two processes, the faster of one sendall and 1 MiB frames with kvstore's headers "
        "and checksums; raw tls: the same through TLS with the daemons' certificates; ratios round by round: median [min, max])",
        ["raw tcp", "plain", "MAC", "MAC/plain", "raw tls 1 sendall", "raw tls frames", "TLS", "TLS/faster raw tls"],
        [
            [
                fetch["raw_tcp_gbps"],
                fetch["plain_gbps"],
                fetch["mac_gbps"],
                spread(fetch["mac_vs_plain_rounds"]),
                fetch["raw_tls_one_buffer_gbps"],
                fetch["raw_tls_framed_gbps"],
                fetch["tls_gbps"],
                spread(fetch["tls_vs_raw_tls_rounds"]),
            ]
        ],
    )
    cpu = fetch["cpu_ms_per_gb"]
    report.compare("remote_load_mac_cpu_vs_plain", cpu["mac"], cpu["plain"], "CPU ms/GB")
    report.compare("remote_load_tls_cpu_vs_raw_tls", cpu["tls"], cpu["raw_tls_framed"], "CPU ms/GB")
    columns = ["raw_tcp_whole", "raw_tcp_framed", "plain", "mac", "raw_tls_whole", "raw_tls_framed", "tls"]
    report.print_table(
        "CPU per GB of the remote loads and the raw sockets (ms, every process of the run together: engine, holder and reading "
        "daemon; sender and receiver; median of the rounds)",
        columns,
        [[cpu[name] for name in columns]],
    )
    rows = []
    for mode in SECURE_MODES:
        opened = fetch["connections"][mode]
        report.ratio(f"remote_load_{mode}_connections", opened["engine"], "<= 1")
        rows.append([mode, fetch["loads_per_mode"], opened["engine"], opened["reading daemon"]])
    report.print_table(
        "peer connections the remote loads opened to the holder (each connection seen open after a load, by its local port)",
        ["mode", "loads", "by the engine", "by its daemon"],
        rows,
    )


def cold_save(srcs: list[torch.Tensor], hashes: list, total: int) -> float:
    """Seconds of the first save into a fresh daemon, by a client that has just connected:
    the daemon started (its host tier as large as the main run's), became ready, and the
    save began at once — what a page fault per 4 KiB of the shared slab used to cost."""
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-cold-"))
    daemon = start_daemon(workdir, host_bytes=total + 256 * MiB)
    try:
        with KVStoreClient(daemon.state["socket"]) as client:
            digest = client.register_namespace(NAMESPACE)
            seconds = timed(lambda: client.save(digest, hashes, srcs))
            assert client.lookup(digest, hashes).num_blocks == len(hashes)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return seconds


@contextlib.contextmanager
def raw_socket(total: int, tls: dict[str, str] | None = None) -> Iterator[tuple[Callable[[int], float], int]]:
    """A raw socket to another process (bench.transport's), through TLS with the files
    ``tls`` names, and the sender's pid; each call times ``total`` bytes sent in blocks of
    the size it is given: one ``sendall`` when that is ``total``, else each block behind
    its header (one ``sendmsg``; two ``sendall`` through TLS), checksummed and verified."""
    from bench.transport import RawSocketLink, RawTlsLink

    destination = memoryview(bytearray(total))
    with asyncio.Runner() as runner:
        link = runner.run((RawSocketLink(destination) if tls is None else RawTlsLink(destination, tls)).__aenter__())
        try:
            yield (lambda block_bytes: runner.run(link.run(block_bytes))), link.sender.pid
        finally:
            runner.run(link.__aexit__(None, None, None))


def latency_percentiles(call: Callable[[Any], object], arguments: Iterable[Any]) -> tuple[float, float]:
    """p50 and p99 seconds of ``call(argument)`` for each of ``arguments``, each argument
    made before its call is timed."""
    samples = []
    for argument in arguments:
        started = time.perf_counter()
        call(argument)
        samples.append(time.perf_counter() - started)
    return percentiles(samples)


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _only_flag(parser) -> None:
    parser.add_argument("--remote-fetch-only", action="store_true", help="run only the remote fetches against raw sockets")


def remote_fetches(report: Report, quick: bool) -> None:
    """The remote fetch over every transport installed, against one raw socket."""
    fetch_total = (64 if quick else 256) * MiB
    kinds = ["tcp"]
    try:
        import_ucxx(TransportConfig(kind="ucx"))
        kinds.append("ucx")
    except TransportUnavailable as exc:
        print(f"UCX remote fetch skipped: {exc}")
    rows = []
    for kind in kinds:
        fetch = remote_fetch(kind, fetch_total, FETCH_ROUNDS)
        report.results.append(fetch)
        rows.append(
            [
                fetch["transport"],
                fetch["raw_one_buffer_gbps"],
                fetch["raw_framed_gbps"],
                fetch["fetch_gbps"],
                fetch["through_daemon_gbps"],
                fetch["local_load_gbps"],
                fetch["fetch_gbps"] / fetch["raw_socket_gbps"],
                fetch["fetch_gbps"] / fetch["local_load_gbps"],
            ]
        )
        report.compare(f"remote_fetch_{kind}_vs_raw_socket", fetch["fetch_gbps"], fetch["raw_socket_gbps"], "GB/s", ">= 0.8")
    report.print_table(
        f"remote fetch, {fetch_total // MiB} MiB of 1 MiB blocks held by another daemon "
        "(GB/s; the engine's load: over TCP received into the engine's tensors, over UCX fetched into this daemon and copied out; "
        "through the daemon: fetched into its host tier, then loaded; the raw socket in turns with them, "
        "as one sendall and as frames with kvstore's headers and checksums, the ratio against the faster)",
        [
            "transport",
            "raw, 1 sendall",
            "raw, 1 MiB frames",
            "remote load",
            "through the daemon",
            "local load",
            "remote/faster raw",
            "remote/local",
        ],
        rows,
    )


def main() -> None:
    if sys.argv[1:2] == ["--look-up"]:
        look_up(sys.argv[2])
        return
    if sys.argv[1:2] == ["--echo"]:
        fd, request_bytes, reply_bytes, polling = map(int, sys.argv[2:6])
        echo(fd, request_bytes, reply_bytes, bool(polling))
        return
    args = parse_args(__doc__.splitlines()[0], _only_flag)
    torch.set_num_threads(1)
    if args.remote_fetch_only:
        report = Report("daemon")
        remote_fetches(report, args.quick)
        secure_remote_fetches(report, args.quick)
        report.emit(args.json)
        return
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
        local_p50, local_p99 = latency_percentiles(lambda _: client.lookup(lookup_digest, keys), range(lookups))
        assert client.lookup(lookup_digest, keys).num_blocks == LOOKUP_KEYS
        # a chain the daemon has not seen: 512 keys it holds none of, a new chain each time
        # (all made before the first call, so that the lookups follow each other as the
        # others do), so every key is hashed afresh (a repeated chain reuses the key
        # objects of the last lookup, tiers/catalogue.RecentChains)
        unseen = [[os.urandom(16) for _ in range(LOOKUP_KEYS)] for _ in range(lookups)]
        unseen_p50, unseen_p99 = latency_percentiles(lambda chain: client.lookup(lookup_digest, chain), unseen)
        del unseen
        # a lookup that finds the daemon asleep: each one 2 ms after the last answer, when
        # the daemon's loop has stopped polling (server.spin_us) and sleeps in epoll
        asleep_p50, asleep_p99 = latency_percentiles(
            lambda _: client.lookup(lookup_digest, keys), (time.sleep(ASLEEP_GAP_S) for _ in range(lookups // 2))
        )
        with KVStoreClient(state["socket"], spin_s=0.0) as sleeper:  # sleeps in recv at once
            sleeping_p50, sleeping_p99 = latency_percentiles(lambda _: sleeper.lookup(lookup_digest, keys), range(lookups))
        request_frame = localproto.encode_request(1, Op.LOOKUP, (lookup_digest, localproto.pack_hashes(keys)))
        reply_frame = localproto.encode_reply(1, bytes(LOOKUP_KEYS))
        raw = raw_round_trips(len(request_frame), len(reply_frame), lookups)
        # what the vLLM scheduler sends: the lookup holding what it found, the previous
        # request's hold released in the same round trip
        held: list = []

        def held_lookup(_: int) -> None:
            held[:] = [client.lookup_held([lookup_digest], keys, 30.0, [held[0].hold_id] if held else [])]

        held_p50, held_p99 = latency_percentiles(held_lookup, range(lookups))
        client.release_holds([held[0].hold_id])
        assert held[0].results[0].num_blocks == LOOKUP_KEYS
        with connect(state["grpc_address"]) as api:
            request = pb.LookupRequest(namespace_id=lookup_digest, block_hashes=pb.BlockHashes(hashes=keys))
            grpc_p50, grpc_p99 = latency_percentiles(lambda _: api.store.Lookup(request), range(lookups // 5))

        # data path: distinct blocks, steady state (buffers already touched)
        src = torch.empty(total, dtype=torch.uint8).random_(0, 256)
        dst = torch.zeros(total, dtype=torch.uint8)
        srcs = list(src.view(num_blocks, -1).unbind(0))
        dsts = list(dst.view(num_blocks, -1).unbind(0))
        hashes = chain_hashes(np.arange(num_blocks * LAYOUT.block_size) + 10_000_000, LAYOUT.block_size)
        cold_save_s = cold_save(srcs, hashes, total)

        def memcpy() -> float:
            return timed(lambda: [copy_bytes(d, s) for s, d in zip(srcs, dsts)])

        def memcpy_as_loaded() -> float:  # the copy a load makes: half on a helper thread, where there is a second core
            return timed(lambda: copy_all([(d.data_ptr(), s.data_ptr(), s.numel()) for s, d in zip(srcs, dsts)]))

        def save() -> float:
            with connect(state["grpc_address"]) as api:
                api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=hashes))
            return timed(lambda: client.save(digest, hashes, srcs))

        def save_unchecked() -> float:
            with connect(state["grpc_address"]) as api:
                api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=hashes))
            return timed(lambda: save_without_checksums(client, digest, hashes, srcs))

        def load() -> float:
            dst.zero_()
            seconds = timed(lambda: client.load(digest, hashes, dsts))
            assert torch.equal(dst, src), "the daemon returned different bytes"
            return seconds

        # in turns, so that every figure and the baselines it is divided by see the same
        # machine (the save with checksums last in each round: the load reads what it wrote)
        memcpy_s, load_baseline_s, unchecked_s, save_s, load_s = best_in_turns(
            DATA_ROUNDS, [memcpy, memcpy_as_loaded, save_unchecked, save, load]
        )
        client.close()
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "lookup_keys": LOOKUP_KEYS,
        "local_lookup_p50_us": local_p50 * 1e6,
        "local_lookup_p99_us": local_p99 * 1e6,
        "unseen_lookup_p50_us": unseen_p50 * 1e6,
        "unseen_lookup_p99_us": unseen_p99 * 1e6,
        "asleep_daemon_lookup_p50_us": asleep_p50 * 1e6,
        "asleep_daemon_lookup_p99_us": asleep_p99 * 1e6,
        "sleeping_lookup_p50_us": sleeping_p50 * 1e6,
        "sleeping_lookup_p99_us": sleeping_p99 * 1e6,
        "raw_round_trip_sleeping_p50_us": raw["sleeping"],
        "raw_round_trip_polling_p50_us": raw["polling"],
        "raw_round_trip_both_polling_p50_us": raw["both_polling"],
        "held_lookup_p50_us": held_p50 * 1e6,
        "held_lookup_p99_us": held_p99 * 1e6,
        "grpc_lookup_p50_us": grpc_p50 * 1e6,
        "grpc_lookup_p99_us": grpc_p99 * 1e6,
        "block_bytes": LAYOUT.block_bytes,
        "total_bytes": total,
        "memcpy_gbps": gbps(total, memcpy_s),
        "memcpy_as_loaded_gbps": gbps(total, load_baseline_s),
        "save_gbps": gbps(total, save_s),
        "cold_save_gbps": gbps(total, cold_save_s),
        "save_without_checksums_gbps": gbps(total, unchecked_s),
        "load_gbps": gbps(total, load_s),
    }
    report.results.append(result)
    report.print_table(
        f"lookup of {LOOKUP_KEYS} keys (µs)",
        ["path", "p50", "p99"],
        [
            ["local socket (the client polls for its answer, spin_s 200 µs)", result["local_lookup_p50_us"], result["local_lookup_p99_us"]],
            ["local socket, a chain not seen before (none of it cached)", result["unseen_lookup_p50_us"], result["unseen_lookup_p99_us"]],
            [
                "local socket, the daemon asleep (each lookup 2 ms after the last answer)",
                result["asleep_daemon_lookup_p50_us"],
                result["asleep_daemon_lookup_p99_us"],
            ],
            ["local socket, the client sleeping in recv (spin_s 0)", result["sleeping_lookup_p50_us"], result["sleeping_lookup_p99_us"]],
            ["local socket, holding what it finds (LOOKUP_HOLD)", result["held_lookup_p50_us"], result["held_lookup_p99_us"]],
            ["gRPC", result["grpc_lookup_p50_us"], result["grpc_lookup_p99_us"]],
            ["raw round trip of the same frame sizes, no work, both ends polling", result["raw_round_trip_both_polling_p50_us"], "-"],
            ["raw round trip of the same frame sizes, no work, reader polling", result["raw_round_trip_polling_p50_us"], "-"],
            ["raw round trip of the same frame sizes, no work, both ends sleeping", result["raw_round_trip_sleeping_p50_us"], "-"],
        ],
    )
    report.print_table(
        f"data path, {total // MiB} MiB of 1 MiB blocks (GB/s; baselines: memcpy of the same blocks on one thread, "
        "and as a load copies, its batch shared with a helper thread where there is a second core)",
        ["memcpy", "memcpy as loaded", "save", "first save, fresh daemon", "save w/o checksums", "load"],
        [
            [
                result["memcpy_gbps"],
                result["memcpy_as_loaded_gbps"],
                result["save_gbps"],
                result["cold_save_gbps"],
                result["save_without_checksums_gbps"],
                result["load_gbps"],
            ]
        ],
    )
    report.ratio("lookup_512_p50_us", result["local_lookup_p50_us"], "<= 100")
    report.ratio("lookup_512_p99_us", result["local_lookup_p99_us"])
    report.ratio("unseen_lookup_512_p50_us", result["unseen_lookup_p50_us"])
    report.ratio("asleep_daemon_lookup_512_p50_us", result["asleep_daemon_lookup_p50_us"])
    report.ratio("grpc_lookup_512_p50_us", result["grpc_lookup_p50_us"])
    remote_fetches(report, args.quick)
    secure_remote_fetches(report, args.quick)
    lag = loop_lag(25_000 if args.quick else 100_000)
    report.results.append({"loop_lag": lag})
    report.print_table(
        f"event-loop lag while an engine promotes a {lag['tokens']:,}-token prefix ({lag['prefix_bytes'] // MiB} MiB) from NVMe "
        "and another engine looks up 512 cached keys (lag: p99 lateness of the daemon's 1 ms timer)",
        ["window", "seconds", "loop lag p99 ms", "lookup p50 µs", "lookup p99 µs", "lookups"],
        [
            [name, w["seconds"], w["loop_lag_p99_ms"], w["lookup_p50_us"], w["lookup_p99_us"], w["lookups"]]
            for name, w in (("idle", lag["idle"]), ("promoting", lag["promoting"]))
        ],
    )
    report.ratio("loop_lag_p99_ms_during_promotion", lag["promoting"]["loop_lag_p99_ms"], "<= 20")
    report.ratio("loop_lag_p99_ms_idle", lag["idle"]["loop_lag_p99_ms"])
    report.ratio("lookup_p99_us_during_promotion", lag["promoting"]["lookup_p99_us"])
    report.ratio("lookup_p99_us_idle", lag["idle"]["lookup_p99_us"])
    report.compare("save_vs_memcpy", result["save_gbps"], result["memcpy_gbps"], "GB/s", ">= 0.7")
    report.compare("cold_save_vs_memcpy", result["cold_save_gbps"], result["memcpy_gbps"], "GB/s", ">= 0.7")
    report.compare("save_vs_save_without_checksums", result["save_gbps"], result["save_without_checksums_gbps"], "GB/s", ">= 0.9")
    report.compare("load_vs_memcpy", result["load_gbps"], result["memcpy_as_loaded_gbps"], "GB/s", ">= 0.7")
    report.compare("load_vs_single_thread_memcpy", result["load_gbps"], result["memcpy_gbps"], "GB/s")
    report.emit(args.json)


if __name__ == "__main__":
    main()
