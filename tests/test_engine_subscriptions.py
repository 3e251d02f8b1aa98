"""The engines of a daemon's configuration (``[[engines]]``), their subscriptions'
lifecycle in the daemon, and how a router sees an engine's GPU cache as its replica's.
A real ZMQ publisher speaking vLLM's wire format stands in for the engine (the
subscriber's own gap, replay and restart handling: test_engine_events.py; a real vLLM:
test_router_http.py)."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import time

import pytest
from vllm_kv_events import VllmPublisher, batch, eventually, publishing, stored

from kvstore.config import ConfigError, RoutingConfig, load_config
from kvstore.engines import EngineSubscriptions
from kvstore.events import BlockStored
from kvstore.hashing import chain_hashes
from kvstore.index.base import NodeInfo, NodeMatch
from kvstore.index.embedded import EmbeddedIndex
from kvstore.index.scoring import Candidate, engine_node_id, replica_of, with_engine_caches
from kvstore.index.sessions import EmbeddedSessionStore
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.router import Router
from kvstore.tier_kind import TierKind

GPU, HOST = TierKind.GPU, TierKind.HOST
BLOCK = 16
NAMESPACE_TOML = """
[engines.namespace]
model_id = "/models/tiny"
num_layers = 2
num_kv_heads = 2
head_dim = 64
dtype = "bfloat16"
block_size = 16
"""
NS = Namespace("/models/tiny", KVLayout(2, 2, 64, BLOCK, "bfloat16", 2, "HND"))


def engines_toml(*entries: str, namespace: str = NAMESPACE_TOML) -> str:
    return '[server]\nnode_id = "host-1"\n' + "".join(f"[[engines]]\n{entry}\n{namespace}" for entry in entries)


def engines_file(tmp_path, endpoint: str):
    """A daemon's configuration file naming one engine, "vllm", publishing at ``endpoint``."""
    path = tmp_path / "engines.toml"
    path.write_text(f'[[engines]]\nname = "vllm"\nendpoint = "{endpoint}"\n{NAMESPACE_TOML}')
    return path


def load(tmp_path, text: str):
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    return load_config(path, environ={}, overrides={"nvme": {"enabled": "false"}, "host": {"capacity_bytes": "64MiB"}})


# ------------------------------------------------------------------ the configuration


def test_engines_are_read_with_the_namespace_they_serve_and_named_after_their_replica(tmp_path):
    config = load(
        tmp_path,
        engines_toml(
            'name = "dp0"\nendpoint = "tcp://127.0.0.1:5557"\nreplay_endpoint = "tcp://127.0.0.1:5558"\ntopic = "kv"',
            'name = "dp1"\nendpoint = "ipc:///run/vllm/kv-events-1"',
        ),
    )
    first, second = config.engines
    assert (first.name, first.subscription.endpoint, first.subscription.replay_endpoint, first.subscription.topic) == (
        "dp0",
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
        "kv",
    )
    # the index names each engine's GPU cache after the replica it serves: this daemon's node
    assert [e.subscription.engine_node_id for e in config.engines] == ["dp0@host-1", "dp1@host-1"]
    assert replica_of(first.subscription.engine_node_id) == "host-1"
    # the namespace the router hashes the same engine's prompts under
    assert first.namespace == second.namespace == NS
    # leases follow [index]
    assert first.subscription.lease_ttl_s == config.index.lease_ttl_s
    assert load(tmp_path, '[server]\nnode_id = "host-1"\n').engines == ()


@pytest.mark.parametrize(
    "entry, words",
    [
        ('endpoint = "tcp://*:5557"', "connects to"),  # vLLM's bind address, not one to connect to
        ('endpoint = "127.0.0.1:5557"', "tcp://host:port"),
        ('endpoint = "tcp://127.0.0.1"', "tcp://host:port"),
        ('endpoint = "tcp://127.0.0.1:5557"\nreplay_endpoint = "http://x"', "engines[0].replay_endpoint"),
        ('name = "a@b"\nendpoint = "tcp://127.0.0.1:5557"', "engines[0].name"),
        ('endpoint = "tcp://127.0.0.1:5557"\nport = 5', "unknown setting engines[0].port"),
        ('name = "vllm"', "engines[0] needs endpoint"),
        ('endpoint = "tcp://127.0.0.1:5557"\ntopic = 5', "engines[0].topic"),
    ],
)
def test_a_bad_engine_entry_is_a_config_error_that_names_it(tmp_path, entry, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load(tmp_path, engines_toml(entry))


def test_engines_need_a_namespace_and_distinct_names(tmp_path):
    with pytest.raises(ConfigError, match=r"engines\[0\].namespace needs"):
        load(tmp_path, engines_toml('endpoint = "tcp://127.0.0.1:5557"', namespace=""))
    with pytest.raises(ConfigError, match=r"engines\[0\].namespace: KVLayout.block_size"):
        load(tmp_path, engines_toml('endpoint = "tcp://127.0.0.1:5557"', namespace=NAMESPACE_TOML.replace("= 16", "= 0")))
    with pytest.raises(ConfigError, match="name 'vllm' twice"):
        load(tmp_path, engines_toml('endpoint = "tcp://127.0.0.1:5557"', 'endpoint = "tcp://127.0.0.1:5567"'))
    with pytest.raises(ConfigError, match=r"\[\[engines\]\]"):
        load(tmp_path, 'engines = "tcp://127.0.0.1:5557"\n')


# ------------------------------------------------ the router sees an engine as its replica


def test_an_engines_gpu_blocks_lead_its_replicas_match():
    daemon = NodeMatch("host-1", (HOST,) * 5)
    engines = [NodeMatch(engine_node_id("dp0", "host-1"), (GPU,) * 3), NodeMatch(engine_node_id("dp1", "host-1"), (GPU,) * 2)]
    other = NodeMatch("host-2", (HOST,) * 4)
    stray = NodeMatch(engine_node_id("dp0", "host-9"), (GPU,) * 6)  # not a candidate's engine
    merged = with_engine_caches([daemon, *engines, other, stray], ["host-1", "host-2", "host-3"])
    assert merged == {"host-1": NodeMatch("host-1", (GPU,) * 3 + (HOST,) * 2), "host-2": other}
    # an engine holding more than its daemon
    longer = with_engine_caches([NodeMatch("host-1", (HOST,)), NodeMatch(engine_node_id("e", "host-1"), (GPU,) * 4)], ["host-1"])
    assert longer == {"host-1": NodeMatch("host-1", (GPU,) * 4)}
    assert replica_of("host-1") is None and replica_of("e@host-1") == "host-1"


def test_the_router_prefers_the_replica_whose_engine_holds_the_prompt_in_gpu():
    prompt = chain_hashes(list(range(8 * BLOCK)), BLOCK)

    async def main():
        index = EmbeddedIndex()
        for node in (NodeInfo("host-1"), NodeInfo("host-2"), NodeInfo(engine_node_id("vllm", "host-2"), kind="engine")):
            await index.register(node, 60)
        for node_id, tier in (("host-1", HOST), ("host-2", HOST), (engine_node_id("vllm", "host-2"), GPU)):
            await index.publish(node_id, [BlockStored(NS.digest, tuple(prompt), None, tier, NS.block_bytes)])
        router = Router(None, index, EmbeddedSessionStore(), RoutingConfig(host_bytes_per_s=1e6, remote_fetch=False))
        candidates = [Candidate("host-1"), Candidate("host-2")]
        decision = await router.route_chain(NS.digest, prompt, 8 * BLOCK, BLOCK, NS.block_bytes, "", candidates)
        assert decision.node_id == "host-2"
        estimates = {e.node_id: e for e in decision.estimates}
        assert estimates["host-2"].load_s == 0 < estimates["host-1"].load_s  # GPU blocks cost nothing to load
        assert estimates["host-1"].cached_tokens == estimates["host-2"].cached_tokens == 8 * BLOCK

    asyncio.run(main())


# ------------------------------------------------ the daemon's subscriptions, start to stop


def subscriptions_for(tmp_path, endpoints: list[str]) -> EngineSubscriptions:
    entries = [f'name = "e{i}"\nendpoint = "{endpoint}"\ntopic = "kv"' for i, endpoint in enumerate(endpoints)]
    config = load(tmp_path, engines_toml(*entries) + "[index]\nlease_ttl_s = 2\nheartbeat_interval_s = 0.5\n")
    return EngineSubscriptions(config.engines, EmbeddedIndex(), retry_s=0.2)


def test_each_engine_is_subscribed_and_reported_until_the_daemon_stops(tmp_path):
    import zmq.asyncio

    prompt = list(range(3 * BLOCK))

    async def main():
        context = zmq.asyncio.Context()
        publishers = [VllmPublisher(context), VllmPublisher(context)]
        engines = subscriptions_for(tmp_path, [p.endpoint for p in publishers])
        index = engines.index
        engines.start()
        try:
            for i, publisher in enumerate(publishers):
                await publisher.handshake(lambda i=i: engines.status()[i]["messages"] > 0)
            await eventually(lambda: all(s["connected"] for s in engines.status()))
            await publishers[1].send(batch([stored([1, 2, 3], None, prompt, BLOCK)]))
            await eventually(lambda: engines.status()[1]["batches"] >= 2)
            await eventually(lambda: len(index.locations.match(NS.digest, chain_hashes(prompt, BLOCK))) == 1)
            assert await index.match(NS.digest, chain_hashes(prompt, BLOCK)) == [NodeMatch("e1@host-1", (GPU,) * 3)]
            first, second = engines.status()
            assert (first["node_id"], first["endpoint"]) == ("e0@host-1", publishers[0].endpoint)
            assert second["gaps"] == 0 and second["blocks"] == 3 and 0 <= second["last_event_age_s"] < 5
            counters = engines.counters()
            assert counters["engine_e1_connected"] == 1 and counters["engine_e1_batches"] >= 2
            assert counters["engine_e1_blocks"] == 3 and counters["engine_e1_last_event_age_ms"] >= 0
            # an engine that goes away is reported as not connected; its blocks stay until its lease or a restart says
            publishers[0].close()
            await eventually(lambda: not engines.status()[0]["connected"])
        finally:
            await asyncio.wait_for(engines.stop(), 5)
            for publisher in publishers[1:]:
                publisher.close()
            context.term()
        assert await index.nodes() == []  # every engine left the index with the daemon
        assert await index.match(NS.digest, chain_hashes(prompt, BLOCK)) == []

    asyncio.run(main())


class FlakyIndex(EmbeddedIndex):
    """Raises what no subscriber expects (a bug, not an outage) at the first registration of one node."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id, self.num_failed = node_id, 0
        self.registered: set[str] = set()

    async def register(self, node: NodeInfo, lease_ttl_s: float) -> bool:
        if node.node_id == self.node_id and not self.num_failed:
            self.num_failed += 1
            raise RuntimeError("the socket broke")
        self.registered.add(node.node_id)
        return await super().register(node, lease_ttl_s)


def test_a_failing_subscription_is_logged_and_started_again_without_stopping_the_others(tmp_path, caplog):
    async def main():
        config = subscriptions_for(tmp_path, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]).configs
        index = FlakyIndex("e0@host-1")
        engines = EngineSubscriptions(config, index, retry_s=0.2)
        with caplog.at_level(logging.ERROR, logger="kvstore.engines"):
            engines.start()
            await eventually(lambda: engines.status()[0]["failures"] == 1)
            # past retry_s a new subscriber registers the engine; the other one never stopped
            await eventually(lambda: index.registered == {"e0@host-1", "e1@host-1"})
        status = engines.status()
        assert status[0]["failures"] == 1 and status[0]["running"] and status[1]["running"] and status[1]["failures"] == 0
        assert "engine e0" in caplog.text and "the socket broke" in caplog.text
        await asyncio.wait_for(engines.stop(), 5)
        assert not any(s["running"] for s in engines.status())
        assert await index.nodes() == []

    asyncio.run(main())


def test_stopping_cuts_the_wait_before_a_failed_subscription_starts_again(tmp_path):
    async def main():
        config = subscriptions_for(tmp_path, ["tcp://127.0.0.1:1"]).configs
        engines = EngineSubscriptions(config, FlakyIndex("e0@host-1"), retry_s=60)
        engines.start()
        await eventually(lambda: engines.status()[0]["failures"] == 1)
        started = time.monotonic()
        await asyncio.wait_for(engines.stop(), 5)
        assert time.monotonic() - started < 1 and not engines.status()[0]["running"]

    asyncio.run(main())


# ------------------------------------------------------- a real daemon, a stand-in engine


def test_a_daemon_subscribes_to_the_engines_of_its_configuration(tmp_path):
    import httpx
    from daemon_harness import daemons

    from kvstore.api.client import connect
    from kvstore.api.v1 import kvstore_pb2 as pb

    prompt = list(range(4 * BLOCK))
    keys = chain_hashes(prompt, BLOCK)

    async def main():
        with publishing() as publisher, daemons(tmp_path) as start:
            config = engines_file(tmp_path, publisher.endpoint)
            daemon = start(node_id="host-7", config=config)
            with connect(daemon.address) as client:

                def counters() -> dict:
                    return dict(client.admin.Stats(pb.StatsRequest()).counters)

                await publisher.handshake(lambda: counters().get("engine_vllm_messages", 0) > 0, timeout_s=20)
                await publisher.send(batch([stored([11, 12, 13, 14], None, prompt, BLOCK)]))

                def matched() -> list:
                    request = pb.MatchRequest(namespace_id=NS.digest, block_hashes=pb.BlockHashes(hashes=keys))
                    return [(n.node_id, n.matched_blocks) for n in client.index.Match(request).nodes]

                await eventually(lambda: matched() == [("vllm@host-7", 4)], timeout_s=10)
                shown = counters()
                assert shown["engine_vllm_connected"] == 1 and shown["engine_vllm_blocks"] == 4 and shown["engine_vllm_gaps"] == 0

            def metrics() -> str:  # refreshed on the daemon's housekeeping tick
                return httpx.get(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=10).text

            await eventually(lambda: 'kvstore_engine_blocks{engine="vllm@host-7"} 4.0' in metrics(), timeout_s=5)
            assert 'kvstore_engine_connected{engine="vllm@host-7"} 1.0' in metrics()
            assert 'kvstore_engine_batches_total{engine="vllm@host-7"}' in metrics()
            status = subprocess.run(
                [sys.executable, "-m", "kvstore", "--address", daemon.address, "status"], capture_output=True, text=True, timeout=60
            )
            assert status.returncode == 0, status.stderr
            assert "engine vllm: connected, 4 GPU blocks indexed" in status.stdout
            assert daemon.stop() == 0
            assert "subscribing to the KV events of engine vllm" in daemon.log()

    asyncio.run(main())


def test_a_daemon_with_a_bad_engine_entry_does_not_start_and_says_which(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(f'[[engines]]\nendpoint = "tcp://*:5557"\n{NAMESPACE_TOML}')
    command = [sys.executable, "-m", "kvstore", "serve", "--config", str(config), "--set", f"server.socket_path={tmp_path}/s.sock"]
    started = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert started.returncode == 2
    assert "engines[0].endpoint is 'tcp://*:5557', an address vLLM binds" in started.stderr
    assert "Traceback" not in started.stderr and not (tmp_path / "s.sock").exists()
