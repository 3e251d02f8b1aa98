"""Real `kvstore serve` processes, real engine client processes, the real gRPC API."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import daemons

from kvstore.api.client import ApiError, connect
from kvstore.api.v1 import kvstore_pb2 as pb

ENGINE = Path(__file__).with_name("engine_proc.py")
pytestmark = pytest.mark.slow


def engine(daemon, mode, seed, num_blocks):
    result = subprocess.run(
        [sys.executable, str(ENGINE), str(daemon.socket), mode, str(seed), str(num_blocks)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def stats(daemon, token=""):
    with connect(daemon.address, token=token or None) as client:
        return client.admin.Stats(pb.StatsRequest())


@pytest.fixture
def daemon(tmp_path):
    with daemons(tmp_path) as start:
        yield start


def test_two_engine_processes_share_blocks(daemon):
    d = daemon()
    assert engine(d, "save", seed=1, num_blocks=40) == {"stored": 40}
    assert engine(d, "save", seed=1, num_blocks=40) == {"stored": 0}  # already cached
    assert engine(d, "load", seed=1, num_blocks=40) == {"loaded": 40, "intact": True, "lookup": 40}
    assert engine(d, "load", seed=2, num_blocks=10) == {"loaded": 0, "intact": True, "lookup": 0}
    s = stats(d)
    assert s.num_blocks == 40 and s.num_sessions == 0 and s.num_leases == 0


def test_clean_stop_and_restart_serve_blocks_from_nvme(daemon):
    d = daemon()
    engine(d, "save", seed=3, num_blocks=50)
    shm = Path(d.state["host_slab"])
    assert shm.exists() and d.socket.exists()
    assert d.stop(signal.SIGTERM) == 0
    assert not d.socket.exists() and not shm.exists() and not d.state_file.exists()
    d.start()
    s = stats(d)
    assert s.num_blocks == 50 and s.counters["blocks_recovered"] == 50
    assert engine(d, "load", seed=3, num_blocks=50) == {"loaded": 50, "intact": True, "lookup": 50}


def test_a_killed_engine_leaks_no_lease(daemon):
    d = daemon()
    engine(d, "save", seed=4, num_blocks=8)
    holder = subprocess.Popen([sys.executable, str(ENGINE), str(d.socket), "hold", "4", "8"], stdout=subprocess.PIPE, text=True)
    assert json.loads(holder.stdout.readline()) == {"held": 8}
    assert stats(d).num_leases == 1
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 10
    while stats(d).num_leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(d).num_leases == 0 and stats(d).num_sessions == 0


def test_a_killed_daemon_leaves_a_stale_socket_that_the_next_start_reclaims(daemon):
    d = daemon()
    engine(d, "save", seed=5, num_blocks=4)
    shm = Path(d.state["host_slab"])
    d.stop(signal.SIGKILL)
    assert d.socket.exists() and shm.exists()
    d.start()
    assert stats(d).node_id == d.node_id
    assert engine(d, "save", seed=6, num_blocks=4) == {"stored": 4}


def test_a_second_daemon_on_a_live_socket_refuses_to_start(daemon, tmp_path):
    d = daemon()
    twin = subprocess.run(d.command(), capture_output=True, text=True, timeout=60)
    assert twin.returncode != 0
    assert "another kvstore daemon is serving" in twin.stderr
    assert stats(d).node_id == d.node_id  # the first one is untouched


def test_bad_requests_get_clear_codes_and_the_daemon_keeps_serving(daemon):
    d = daemon()
    engine(d, "save", seed=7, num_blocks=4)
    namespace = bytes.fromhex(
        json.loads(
            subprocess.run(
                [sys.executable, "-m", "kvstore", "--address", d.address, "--json", "ls"], capture_output=True, text=True, check=True
            ).stdout
        )["blocks"][0]["namespace"]
    )
    with connect(d.address) as client:
        cases = [
            (pb.LookupRequest(namespace_id=namespace, block_hashes=pb.BlockHashes(hashes=[b"x" * 15])), "INVALID_ARGUMENT"),
            (pb.LookupRequest(namespace_id=namespace, block_hashes=pb.BlockHashes(hashes=[b"x" * 16] * 70_000)), "INVALID_ARGUMENT"),
            (pb.LookupRequest(namespace_id=b"\x01" * 16, block_hashes=pb.BlockHashes(hashes=[b"x" * 16])), "NOT_FOUND"),
            (pb.LookupRequest(namespace_id=b"short", block_hashes=pb.BlockHashes(hashes=[b"x" * 16])), "INVALID_ARGUMENT"),
        ]
        for request, code in cases:
            with pytest.raises(ApiError) as info:
                client.store.Lookup(request)
            assert info.value.code == code and len(str(info.value)) > 20
        assert client.admin.Stats(pb.StatsRequest()).num_blocks == 4
    # garbage on the local socket gets an error frame, not a dead daemon
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(d.socket))
        raw.sendall(struct.pack("<I", 3) + b"\xc1\xc1\xc1")
        length = struct.unpack("<I", raw.recv(4))[0]
        assert b"InvalidArgument" in raw.recv(length)
    assert engine(d, "load", seed=7, num_blocks=4)["loaded"] == 4


def test_auth_is_enforced_when_a_token_is_configured(daemon):
    d = daemon(token="s3cret-token")
    with connect(d.address) as client:
        with pytest.raises(ApiError) as info:
            client.admin.Stats(pb.StatsRequest())
        assert info.value.code == "UNAUTHENTICATED"
        assert client.health() == "SERVING"  # health checks stay open for load balancers
    with connect(d.address, token="wrong") as client:
        with pytest.raises(ApiError):
            client.admin.Stats(pb.StatsRequest())
    assert stats(d, token="s3cret-token").node_id == d.node_id
    cli = [sys.executable, "-m", "kvstore", "--address", d.address, "--json", "stats"]
    assert subprocess.run(cli, capture_output=True, text=True).returncode == 4
    ok = subprocess.run(cli, capture_output=True, text=True, env=dict(os.environ, KVSTORE_TOKEN="s3cret-token"))
    assert ok.returncode == 0 and json.loads(ok.stdout)["node_id"] == d.node_id


def test_metrics_endpoint_counts_hits_misses_and_occupancy(daemon):
    import urllib.request

    d = daemon()
    engine(d, "save", seed=8, num_blocks=12)
    engine(d, "load", seed=8, num_blocks=12)
    engine(d, "load", seed=9, num_blocks=5)  # a miss
    time.sleep(0.6)  # one housekeeping tick refreshes the tier gauges
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.state['metrics_port']}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    hits = sum(v for k, v in samples.items() if k.startswith("kvstore_lookup_blocks_total{") and 'result="hit"' in k)
    misses = sum(v for k, v in samples.items() if k.startswith("kvstore_lookup_blocks_total{") and 'result="miss"' in k)
    assert hits >= 12 and misses >= 5
    assert samples['kvstore_tier_blocks{tier="host"}'] == 12
    assert samples["kvstore_stored_blocks_total"] == 12
    assert any(k.startswith("kvstore_request_seconds_count{") and 'rpc="lookup"' in k for k in samples)


def test_the_async_client_saves_and_loads(daemon):
    import asyncio

    import torch
    from engine_proc import NAMESPACE, kv_for

    from kvstore.client import AsyncKVStoreClient
    from kvstore.hashing import chain_hashes

    d = daemon()
    hashes = chain_hashes(list(range(10 * 16)), 16)

    async def scenario():
        client = await AsyncKVStoreClient.connect(d.socket)
        digest = await client.register_namespace(NAMESPACE)
        assert await client.save(digest, hashes, [kv_for(h) for h in hashes]) == 10
        found = await client.lookup(digest, hashes)
        into = [torch.empty_like(kv_for(h)) for h in hashes]
        loaded = await client.load(digest, hashes, into)
        await client.close()
        return found.num_blocks, loaded, all(torch.equal(t, kv_for(h)) for t, h in zip(into, hashes))

    assert asyncio.run(scenario()) == (10, 10, True)
