"""Daemons in separate processes moving blocks to each other over TCP and UCX: remote
fetch (from a peer's host and NVMe tiers), prefill → decode handoff, a peer killed
mid-transfer, a frame corrupted on the wire, drain while requests continue, warm-up."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from daemon_harness import daemons
from daemon_harness import eventually as _eventually

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.transport.wire import HEADER_BYTES, encode_control

HERE = Path(__file__).parent
PEER_ENGINE = HERE / "peer_engine.py"
ENGINE = HERE / "engine_proc.py"
pytestmark = pytest.mark.slow


def _kinds():
    kinds = ["tcp"]
    if importlib.util.find_spec("ucxx") is not None:
        kinds.append("ucx")
    else:
        kinds.append(pytest.param("ucx", marks=pytest.mark.skip(reason="ucxx is not installed (pip install 'kvstore[ucx]')")))
    return kinds


@pytest.fixture(params=_kinds())
def kind(request, monkeypatch):
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    return request.param


@pytest.fixture
def fleet(tmp_path, redis, kind):
    settings = {
        "index.backend": redis.url,
        "index.lease_ttl_s": "3",
        "index.heartbeat_interval_s": "0.5",
        "index.publish_interval_s": "0.05",
        "transport.kind": kind,
    }

    with daemons(tmp_path) as start:

        def start_node(node_id: str, **extra) -> object:
            return start(node_id=node_id, extra={**settings, **extra})

        yield start_node


def engine(daemon, *args, script=PEER_ENGINE, timeout=120) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(script), str(daemon.socket), *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=HERE
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def start_engine(daemon, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PEER_ENGINE), str(daemon.socket), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE,
    )


def lines(process: subprocess.Popen, timeout: float = 120) -> list[dict]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def stats(daemon) -> dict:
    with connect(daemon.address) as client:
        response = client.admin.Stats(pb.StatsRequest())
    return {"counters": dict(response.counters), "tiers": {t.tier: t.used_bytes for t in response.tiers}}


def metric(daemon, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#"))


def eventually(check):
    return _eventually(check, timeout_s=15.0)  # three daemons and engines share two cores


def indexed(daemon, node_id: str) -> bool:
    with connect(daemon.address) as client:
        return any(n.node_id == node_id for n in client.index.Nodes(pb.NodesRequest()).nodes)


def test_remote_fetch_from_a_peer_host_tier_and_from_its_nvme_tier(fleet):
    a, b = fleet("a"), fleet("b")
    assert engine(a, "save", 1, 12, script=ENGINE)[0]["stored"] == 12
    assert eventually(lambda: indexed(b, "a"))
    first = engine(b, "fetch", 1, 12)[0]  # b holds nothing: the index names a
    assert first["loaded"] == 12 and first["intact"]
    assert metric(b, "kvstore_transfer_blocks_total") >= 12
    # a restarts: its blocks come back from NVMe; c fetches them from there
    a.stop()
    a.start()
    c = fleet("c")
    assert eventually(lambda: indexed(c, "a"))
    from_nvme = engine(c, "fetch", 1, 12, a.transport_address)[0]
    assert from_nvme["loaded"] == 12 and from_nvme["intact"]


def test_handoff_between_daemons_layer_by_layer(fleet):
    prefill, decode = fleet("prefill"), fleet("decode")
    assert eventually(lambda: indexed(prefill, "decode"))
    consumer = start_engine(decode, "consume", 2, 6, "req-42")
    produced = engine(prefill, "produce", 2, 6, "req-42", "decode", 0.2)  # destination by node id
    consumed = lines(consumer)
    assert produced[-1] == {"stored": 6}
    assert [row["layer"] for row in consumed[:-1]] == [0, 1, 2, 3] and all(row["intact"] for row in consumed[:-1])
    assert consumed[-1] == {"done": True, "blocks": 6, "cached": 6}
    # the prefill node keeps the prefix too; nothing is left staged on either side
    assert engine(prefill, "load", 2, 6, script=ENGINE)[0]["loaded"] == 6
    for daemon in (prefill, decode):
        assert eventually(lambda d=daemon: stats(d)["tiers"][pb.TIER_HOST] == 6 * 32 * 1024)


def test_a_producer_daemon_killed_mid_handoff_fails_the_consumer_and_frees_its_slots(fleet):
    prefill, decode = fleet("prefill"), fleet("decode")
    consumer = start_engine(decode, "consume", 3, 6, "req-7")
    producer = start_engine(prefill, "produce", 3, 6, "req-7", decode.transport_address, 1.0)
    assert json.loads(consumer.stdout.readline()) == {"layer": 0, "intact": True}  # layer 0 crossed
    prefill.stop(signal.SIGKILL)  # while the producer "computes" layer 1
    producer.kill()
    consumed = lines(consumer, timeout=60)
    assert consumed[-1]["error"] == "TransferFailed"
    assert eventually(lambda: stats(decode)["tiers"][pb.TIER_HOST] == 0)


class FlippingProxy:
    """A TCP proxy that flips one byte of the stream from the server at ``offset``."""

    def __init__(self, target: str, offset: int) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.offset = offset
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> str:
        server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def _pipe(self, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.target)

        async def copy(reader, writer, flip: bool) -> None:
            seen = 0
            while data := await reader.read(1 << 16):
                if flip and seen <= self.offset < seen + len(data):
                    data = bytearray(data)
                    data[self.offset - seen] ^= 0xFF
                seen += len(data)
                writer.write(bytes(data))
                await writer.drain()
            writer.close()

        await asyncio.gather(copy(client_reader, server_writer, False), copy(server_reader, client_writer, True), return_exceptions=True)


@pytest.mark.parametrize("kind", ["tcp"], indirect=True)
def test_a_block_corrupted_on_the_wire_is_dropped_and_only_the_verified_prefix_is_stored(fleet):
    a, b = fleet("a"), fleet("b")
    assert engine(a, "save", 4, 8, script=ENGINE)[0]["stored"] == 8
    handshake = HEADER_BYTES + len(encode_control({"nonce": bytes(32)}))  # the daemon's answer to the reader's hello
    block_frame = HEADER_BYTES + 32 * 1024
    reply = HEADER_BYTES + 40  # the fetch reply's header and msgpack payload, roughly
    proxy = FlippingProxy(a.transport_address, handshake + reply + 5 * block_frame + HEADER_BYTES + 100)  # inside block #5's bytes
    fetched = engine(b, "fetch", 4, 8, proxy.address)[0]
    assert fetched["intact"] and fetched["loaded"] in (5, 6)  # never the damaged block, never past it
    assert metric(b, "kvstore_transfer_dropped_blocks_total") == 1


def test_drain_while_requests_continue_moves_blocks_and_sessions(fleet, redis):
    a, b, c = fleet("a"), fleet("b"), fleet("c")
    for seed in range(4):
        assert engine(a, "save", 10 + seed, 8, script=ENGINE)[0]["stored"] == 8
    assert eventually(lambda: indexed(a, "b") and indexed(a, "c"))
    import redis as redis_py

    store = redis_py.Redis.from_url(redis.url)
    store.hset("kvs:s:agent-1", mapping={"node": "a", "moves": 0})  # a session that sticks to a
    store.hset("kvs:s:agent-2", mapping={"node": "b", "moves": 0})
    for key in ("kvs:s:agent-1", "kvs:s:agent-2"):
        store.expire(key, 600)
    stop = threading.Event()
    failures: list[str] = []

    def keep_loading() -> None:
        while not stop.is_set():
            result = engine(a, "load", 10, 8, script=ENGINE)[0]
            if result["loaded"] != 8 or not result["intact"]:
                failures.append(str(result))

    loader = threading.Thread(target=keep_loading)
    loader.start()
    try:
        drained = subprocess.run(
            [sys.executable, "-m", "kvstore", "--address", a.address, "--json", "drain"], capture_output=True, text=True, timeout=120
        )
    finally:
        stop.set()
        loader.join()
    assert drained.returncode == 0, drained.stderr
    report = json.loads(drained.stdout)
    assert report["moved_blocks"] == 32 and report.get("remaining_blocks", 0) == 0
    assert set(report["blocks_by_peer"]) <= {"b", "c"}
    assert failures == []
    for seed in range(4):  # every chain is whole on some peer
        assert max(engine(peer, "load", 10 + seed, 8, script=ENGINE)[0]["loaded"] for peer in (b, c)) == 8
    heir = max(report["blocks_by_peer"], key=report["blocks_by_peer"].get)
    assert report["sessions_moved"] == 1
    assert store.hget("kvs:s:agent-1", "node").decode() == heir
    assert store.hget("kvs:s:agent-2", "node") == b"b"


def test_warm_pulls_shared_prefixes_from_the_fleet(fleet):
    old = fleet("old")
    # two sessions over one 4-block system prompt: seeds share no tokens, so build them here
    shared = subprocess.run([sys.executable, "-c", WARM_SEED, str(old.socket)], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert shared.returncode == 0, shared.stderr
    new = fleet("new")
    assert eventually(lambda: indexed(new, "old"))
    warmed = subprocess.run(
        [sys.executable, "-m", "kvstore", "--address", new.address, "--json", "warm"], capture_output=True, text=True, timeout=120
    )
    assert warmed.returncode == 0, warmed.stderr
    assert json.loads(warmed.stdout)["moved_blocks"] == 4


WARM_SEED = """
import sys
from engine_proc import LAYOUT, NAMESPACE, kv_for
from kvstore.client import KVStoreClient
from kvstore.hashing import chain_hashes
with KVStoreClient(sys.argv[1]) as client:
    digest = client.register_namespace(NAMESPACE)
    for tail in (1, 2):
        tokens = list(range(4 * LAYOUT.block_size)) + [1000 * tail + i for i in range(2 * LAYOUT.block_size)]
        hashes = chain_hashes(tokens, LAYOUT.block_size)
        client.save(digest, hashes, [kv_for(h) for h in hashes])
"""


def test_netns_two_hosts_fetch_over_a_veth_pair(tmp_path):
    """Two daemons in two network namespaces joined by a veth pair, as on two hosts."""
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "add", "kvs-probe"], capture_output=True).returncode != 0:
        pytest.skip("this kernel or user may not create network namespaces (needs root and CAP_NET_ADMIN)")
    subprocess.run(["ip", "netns", "del", "kvs-probe"], check=True)
    tag = f"{os.getpid() % 10000}"
    ns_a, ns_b = f"kvs-a{tag}", f"kvs-b{tag}"
    veth_a, veth_b = f"kva{tag}", f"kvb{tag}"
    setup = [
        ["ip", "netns", "add", ns_a],
        ["ip", "netns", "add", ns_b],
        ["ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b],
        ["ip", "link", "set", veth_a, "netns", ns_a],
        ["ip", "link", "set", veth_b, "netns", ns_b],
        ["ip", "-n", ns_a, "addr", "add", "10.231.0.1/24", "dev", veth_a],
        ["ip", "-n", ns_b, "addr", "add", "10.231.0.2/24", "dev", veth_b],
        ["ip", "-n", ns_a, "link", "set", veth_a, "up"],
        ["ip", "-n", ns_b, "link", "set", veth_b, "up"],
        ["ip", "-n", ns_a, "link", "set", "lo", "up"],
        ["ip", "-n", ns_b, "link", "set", "lo", "up"],
    ]
    try:
        for command in setup:
            subprocess.run(command, check=True, capture_output=True)
        # a peer port on a network address is refused without authentication: this fleet shares a secret
        secret = tmp_path / "peer-secret"
        secret.write_text(os.urandom(32).hex())
        secret.chmod(0o600)
        fleet = {"transport.peer_secret_file": str(secret)}
        with daemons(tmp_path) as start:
            a = start(node_id="host-a", prefix=("ip", "netns", "exec", ns_a), extra={"transport.host": "10.231.0.1", **fleet})
            b = start(node_id="host-b", prefix=("ip", "netns", "exec", ns_b), extra={"transport.host": "10.231.0.2", **fleet})
            assert a.transport_address.startswith("tcp://10.231.0.1:")
            run_in = lambda ns, daemon, *args, script=PEER_ENGINE: subprocess.run(  # noqa: E731
                ["ip", "netns", "exec", ns, sys.executable, str(script), str(daemon.socket), *map(str, args)],
                capture_output=True, text=True, timeout=120, cwd=HERE,
            )  # fmt: skip
            saved = run_in(ns_a, a, "save", 5, 10, script=ENGINE)
            assert saved.returncode == 0, saved.stderr
            fetched = run_in(ns_b, b, "fetch", 5, 10, a.transport_address)
            assert fetched.returncode == 0, fetched.stderr
            result = json.loads(fetched.stdout.splitlines()[-1])
            assert result["loaded"] == 10 and result["intact"]
            # the namespaces really are separate hosts: b cannot reach a's loopback
            unreachable = run_in(ns_b, b, "fetch", 6, 2, "tcp://127.0.0.1:" + a.transport_address.rsplit(":", 1)[1])
            assert json.loads(unreachable.stdout.splitlines()[-1])["loaded"] == 0
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
