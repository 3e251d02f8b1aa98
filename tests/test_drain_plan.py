"""Cache-aware scale-down with real daemons sharing a real Redis index: `kvstore drain
--plan` ranks them by the cache each would take with it, `--auto` drains the cheapest and
its chains arrive at the peer, the daemons export their figure, a daemon that does not
answer is listed as unknown; the router's ``GET /kvstore/drain-plan`` weighs the live
sessions it placed (in process, over ASGI, against the same kind of fleet)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest
from daemon_harness import daemons
from daemon_harness import eventually as _eventually

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.gateway.app import build_app
from kvstore.gateway.auth import ApiKeys
from kvstore.gateway.config import ReplicaConfig, RouterConfig
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

pytestmark = pytest.mark.slow

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
NAMESPACE = Namespace("/models/tiny", LAYOUT)
BLOCK = LAYOUT.block_bytes
SHARED = list(range(0, 2 * 16))  # on a and b
HOT = list(range(9000, 9000 + 3 * 16))  # b's alone, read just before each plan
IDLE = list(range(3000, 3000 + 4 * 16))  # c's alone, never read again: bigger than HOT, worth less


@pytest.fixture
def fleet(tmp_path, redis):
    settings = {
        "index.backend": redis.url,
        "index.lease_ttl_s": "30",  # a stopped daemon stays listed: the plan must say it does not answer
        "index.heartbeat_interval_s": "0.5",
        "index.publish_interval_s": "0.05",
        "transport.kind": "tcp",
        "server.cache_value_interval_s": "0.5",
    }
    with daemons(tmp_path) as start:
        yield lambda node_id: start(node_id=node_id, extra=settings)


def eventually(check):
    return _eventually(check, timeout_s=20.0)  # three daemons share two cores


def put(daemon, tokens: list[int]) -> list[bytes]:
    hashes = chain_hashes(tokens, LAYOUT.block_size)
    with connect(daemon.address) as client:
        layout = pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
        registered = client.store.RegisterNamespace(pb.RegisterNamespaceRequest(model_id=NAMESPACE.model_id, layout=layout))
        assert registered.namespace_id == NAMESPACE.digest and registered.block_bytes == BLOCK
        payloads = [os.urandom(BLOCK) for _ in hashes]
        assert client.store.Put(pb.PutRequest(namespace_id=NAMESPACE.digest, block_hashes=hashes, payloads=payloads)).num_stored
    return hashes


def read(daemon, hashes: list[bytes]) -> int:
    """Blocks of the chain ``daemon`` serves; reading them makes them recently used."""
    with connect(daemon.address) as client:
        return len(client.store.Get(pb.GetRequest(namespace_id=NAMESPACE.digest, block_hashes=hashes)).payloads)


def holders(daemon, hashes: list[bytes]) -> dict[str, int]:
    with connect(daemon.address) as client:
        request = pb.MatchRequest(namespace_id=NAMESPACE.digest, block_hashes=pb.BlockHashes(hashes=hashes))
        return {m.node_id: m.matched_blocks for m in client.index.Match(request).nodes}


def listed(daemon) -> set[str]:
    with connect(daemon.address) as client:
        return {n.node_id for n in client.index.Nodes(pb.NodesRequest()).nodes}


def kv(daemon, *args: str, as_json: bool = True) -> subprocess.CompletedProcess:
    flags = ["--json"] if as_json else []
    command = [sys.executable, "-m", "kvstore", "--address", daemon.address, *flags, "drain", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def metric(daemon, name: str) -> float | None:
    """The value of an unlabelled metric, None where the daemon does not export it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=5).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split(" ")[0] == name]
    return values[0] if values else None


def test_the_plan_ranks_nodes_by_unique_recent_cache_and_auto_drains_the_cheapest(fleet):
    a, b, c = fleet("a"), fleet("b"), fleet("c")
    idle = put(c, IDLE)
    idle_since = time.monotonic()
    shared = put(a, SHARED)
    assert put(b, SHARED) == shared
    assert eventually(lambda: listed(a) >= {"a", "b", "c"} and holders(a, shared) == {"a": 2, "b": 2} and holders(a, idle) == {"c": 4})
    time.sleep(max(0.0, 4.0 - (time.monotonic() - idle_since)))  # IDLE: idle 4 half-lives of 1 s at least
    hot = put(b, HOT)
    assert eventually(lambda: holders(a, hot) == {"b": 3})

    assert read(b, hot) == 3
    planned = kv(a, "--plan", "--half-life", "1", "--timeout", "10")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    nodes = {n["node_id"]: n for n in plan["nodes"]}
    # a's blocks are all on b too; c holds more unique bytes than b, but long unused
    assert [n["node_id"] for n in plan["nodes"]] == ["a", "c", "b"], plan
    assert plan["cheapest"] == "a" and plan["reason"].startswith("a is the cheapest to lose")
    assert (nodes["a"]["unique_blocks"], nodes["a"]["total_blocks"], nodes["a"]["cost_bytes"]) == (0, 2, 0)
    assert (nodes["c"]["unique_bytes"], nodes["b"]["unique_bytes"], nodes["b"]["total_blocks"]) == (4 * BLOCK, 3 * BLOCK, 5)
    assert all(n["num_peers"] == 2 and n["live_bytes"] is None and n["half_life_s"] == 1.0 for n in plan["nodes"])

    table = kv(a, "--plan", "--half-life", "1", as_json=False)
    assert table.returncode == 0, table.stderr
    rows = [line.split()[0] for line in table.stdout.splitlines()[1:4]]
    assert rows == ["a", "c", "b"] and "a is the cheapest to lose" in table.stdout

    # the daemons export their own figure (the default 10-minute half-life: HOT counts about whole)
    assert eventually(lambda: metric(b, "kvstore_unique_cache_bytes") == 3 * BLOCK and metric(a, "kvstore_unique_cache_bytes") == 0)
    assert 2.9 * BLOCK < metric(b, "kvstore_unique_cache_value_bytes") <= 3 * BLOCK
    assert metric(a, "kvstore_unique_cache_value_bytes") == 0

    c.process.send_signal(signal.SIGSTOP)  # listed in the index, answering nothing
    try:
        stalled = kv(a, "--plan", "--half-life", "1", "--timeout", "2")
    finally:
        c.process.send_signal(signal.SIGCONT)
    assert stalled.returncode == 0, stalled.stderr
    plan = json.loads(stalled.stdout)
    assert [(n["node_id"], n["known"]) for n in plan["nodes"]] == [("a", True), ("b", True), ("c", False)]
    assert "DEADLINE_EXCEEDED" in plan["nodes"][2]["error"] or "did not answer" in plan["nodes"][2]["error"]
    assert plan["cheapest"] == "a" and "not known, so never chosen: c" in plan["reason"]

    a.stop()  # leaves the index: b and c remain, and shared is b's alone now
    assert eventually(lambda: listed(b) == {"b", "c"})
    assert read(b, hot) == 3
    drained = kv(b, "--auto", "--half-life", "1")
    assert drained.returncode == 0, drained.stderr
    report = json.loads(drained.stdout)
    assert report["drained"] == "c" and report["address"] == c.address and report["reason"].startswith("c is the cheapest to lose")
    assert report["report"]["moved_blocks"] == 4 and report["report"]["blocks_by_peer"] == {"b": 4}
    assert read(b, idle) == 4  # c's chain arrived whole at its peer


def test_the_routers_plan_weighs_the_live_sessions_it_placed_and_is_guarded(fleet, redis):
    a, b = fleet("a"), fleet("b")
    small = put(a, SHARED)  # a: two blocks of its own
    big = put(b, HOT)  # b: three
    assert eventually(lambda: listed(a) >= {"a", "b"} and holders(a, small) == {"a": 2} and holders(a, big) == {"b": 3})
    key = "sk-operator-0123456789abcdef"
    replicas = (
        ReplicaConfig("http://127.0.0.1:1", "a"),
        ReplicaConfig("http://127.0.0.1:2", "b"),
        ReplicaConfig("http://127.0.0.1:3", "ghost"),  # configured, its daemon never started
    )
    config = RouterConfig(replicas=replicas, namespace=NAMESPACE, index=redis.url, api_keys=ApiKeys(((_digest(key), "ops"),)))
    app = build_app(config)
    gateway = app.state.gateway

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as router:
            assert (await router.get("/kvstore/drain-plan")).status_code == 401
            headers = {"authorization": f"Bearer {key}"}
            for query, param in (("half_life_s=-1", "half_life_s"), ("half_life_s=soon", "half_life_s"), ("timeout_s=0", "timeout_s")):
                refused = await router.get(f"/kvstore/drain-plan?{query}", headers=headers)
                assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text

            quiet = (await router.get("/kvstore/drain-plan", headers=headers)).json()
            assert [n["node_id"] for n in quiet["nodes"]] == ["a", "b", "ghost"] and quiet["cheapest"] == "a"
            assert quiet["nodes"][2]["known"] is False and "not in the index" in quiet["nodes"][2]["error"]
            assert quiet["nodes"][0]["live_bytes"] == 0

            # an agent's 4-block context lives on a: a now costs 2 + 4 blocks against b's 3
            context = list(range(20_000, 20_000 + 4 * 16))
            gateway.live.record("agent-1", "a", chain_hashes(context, 16), len(context), time.monotonic())
            busy = (await router.get("/kvstore/drain-plan?half_life_s=600", headers=headers)).json()
            assert [n["node_id"] for n in busy["nodes"]] == ["b", "a", "ghost"] and busy["cheapest"] == "b"
            assert busy["nodes"][1]["live_bytes"] == 4 * BLOCK and busy["half_life_s"] == 600.0
        await gateway.client.aclose()
        await gateway.index.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def _digest(key: str) -> bytes:
    import hashlib

    return hashlib.sha256(key.encode()).digest()
