"""Several real daemons publishing to one real Redis: the fleet's block-location index."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import daemons, eventually
from engine_proc import LAYOUT, NAMESPACE

from kvstore.api.client import ApiError, connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.hashing import chain_hashes

ENGINE = Path(__file__).with_name("engine_proc.py")
LEASE_TTL_S = 2.0
pytestmark = pytest.mark.slow


def chain(seed: int, num_blocks: int):
    return chain_hashes([(seed * 7919 + i) % 50_000 for i in range(num_blocks * LAYOUT.block_size)], LAYOUT.block_size)


def save(daemon, seed, num_blocks):
    subprocess.run(
        [sys.executable, str(ENGINE), str(daemon.socket), "save", str(seed), str(num_blocks)], check=True, capture_output=True, timeout=120
    )


def match(daemon, hashes, node_ids=()):
    with connect(daemon.address) as client:
        response = client.index.Match(
            pb.MatchRequest(namespace_id=NAMESPACE.digest, block_hashes=pb.BlockHashes(hashes=hashes), node_ids=list(node_ids))
        )
    return {n.node_id: n.matched_blocks for n in response.nodes}


@pytest.fixture
def fleet(tmp_path, redis):
    settings = {
        "index.backend": redis.url,
        "index.lease_ttl_s": str(LEASE_TTL_S),
        "index.heartbeat_interval_s": "0.4",
        "index.publish_interval_s": "0.05",
    }
    with daemons(tmp_path) as start:
        yield lambda node_id: start(node_id=node_id, extra=settings)


def test_matches_agree_with_what_each_daemon_holds(fleet):
    a, b, c = fleet("node-a"), fleet("node-b"), fleet("node-c")
    save(a, seed=1, num_blocks=20)
    save(b, seed=1, num_blocks=8)  # a prefix of a's chain
    save(b, seed=2, num_blocks=5)
    hashes = chain(1, 24)
    expected = {"node-a": 20, "node-b": 8}
    # any daemon answers for the whole fleet
    assert eventually(lambda: match(c, hashes) == expected), match(c, hashes)
    assert match(a, hashes) == expected
    assert match(b, hashes, node_ids=["node-b", "node-c"]) == {"node-b": 8}
    assert match(a, chain(2, 5)) == {"node-b": 5}
    with connect(a.address) as client:
        response = client.index.Match(pb.MatchRequest(namespace_id=NAMESPACE.digest, block_hashes=pb.BlockHashes(hashes=hashes)))
        assert [(t.tier, t.blocks) for t in response.nodes[0].tier_counts] == [(pb.TIER_HOST, 20)]
        # routing weighs the cached prefix: node-a holds the most
        route = client.index.Route(
            pb.RouteRequest(
                namespace_id=NAMESPACE.digest,
                token_ids=[(1 * 7919 + i) % 50_000 for i in range(20 * 16)],
                session_id="agent-1",
                candidates=[pb.RouteCandidate(node_id=n) for n in ("node-a", "node-b", "node-c")],
            )
        )
    assert route.node_id == "node-a" and route.reason
    assert route.expected_cached_tokens == 20 * 16


def test_a_killed_daemon_disappears_within_its_lease(fleet):
    a, b = fleet("node-a"), fleet("node-b")
    save(a, seed=3, num_blocks=6)
    save(b, seed=3, num_blocks=6)
    hashes = chain(3, 6)
    assert eventually(lambda: match(b, hashes) == {"node-a": 6, "node-b": 6})
    a.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    assert eventually(lambda: match(b, hashes) == {"node-b": 6}, timeout_s=LEASE_TTL_S + 3)
    assert time.monotonic() - killed_at <= LEASE_TTL_S + 3
    # a clean stop leaves the index at once
    b.stop(signal.SIGTERM)
    c = fleet("node-c")
    assert match(c, hashes) == {}


def test_the_index_recovers_after_redis_restarts(fleet, redis):
    a, b = fleet("node-a"), fleet("node-b")
    save(a, seed=4, num_blocks=7)
    hashes = chain(4, 7)
    assert eventually(lambda: match(b, hashes) == {"node-a": 7})
    redis.restart()  # comes back empty: no persistence
    # the daemons keep serving their own blocks meanwhile, then re-publish their catalogues
    assert eventually(lambda: match(b, hashes) == {"node-a": 7}, timeout_s=15)
    save(b, seed=4, num_blocks=3)
    assert eventually(lambda: match(a, hashes) == {"node-a": 7, "node-b": 3})


def test_bad_match_and_route_requests_get_clear_errors(fleet):
    a = fleet("node-a")
    save(a, seed=5, num_blocks=2)
    with connect(a.address) as client:
        cases = [
            (pb.MatchRequest(namespace_id=NAMESPACE.digest, block_hashes=pb.BlockHashes(hashes=[])), "INVALID_ARGUMENT", "empty"),
            (pb.MatchRequest(namespace_id=b"\x07" * 16, token_ids=pb.TokenIds(ids=list(range(64)))), "NOT_FOUND", "not registered"),
            (
                pb.MatchRequest(namespace_id=NAMESPACE.digest, block_hashes=pb.BlockHashes(hashes=[b"x" * 16] * 70_000)),
                "INVALID_ARGUMENT",
                "limit",
            ),
            (pb.MatchRequest(namespace_id=NAMESPACE.digest, block_hashes=pb.BlockHashes(hashes=[b"short"])), "INVALID_ARGUMENT", "16"),
        ]
        for request, code, words in cases:
            with pytest.raises(ApiError) as info:
                client.index.Match(request)
            assert info.value.code == code and words in str(info.value), str(info.value)
        with pytest.raises(ApiError) as info:
            client.index.Route(pb.RouteRequest(namespace_id=NAMESPACE.digest, token_ids=list(range(64))))
        assert info.value.code == "INVALID_ARGUMENT" and "candidate" in str(info.value)
        assert client.admin.Stats(pb.StatsRequest()).num_blocks == 2  # still serving


def test_stats_fleet_shows_hit_rate_per_node_and_its_spread(fleet):
    import json

    a, b = fleet("node-a"), fleet("node-b")
    save(a, seed=6, num_blocks=10)
    subprocess.run([sys.executable, str(ENGINE), str(a.socket), "load", "6", "10"], check=True, capture_output=True)
    subprocess.run([sys.executable, str(ENGINE), str(b.socket), "load", "6", "10"], check=True, capture_output=True)
    assert eventually(lambda: len(match(a, chain(6, 1))) == 1)
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "--address", a.address, "--json", "stats", "--fleet"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    fleet_view = json.loads(result.stdout)
    rates = {n["node_id"]: n["hit_rate"] for n in fleet_view["nodes"]}
    # each loading engine asks one lookup of 10 blocks: all cached on node-a, none on node-b
    assert rates == {"node-a": 1.0, "node-b": 0.0}
    assert fleet_view["fleet_hit_rate"] == 0.5
    assert fleet_view["hit_rate_std"] == 0.5 and fleet_view["hit_rate_cv"] == 1.0
