"""Agent sessions between turns: Admin.Retain and Admin.Prefetch, served by real `kvstore
serve` processes with a small host tier over an NVMe tier (and, for a session that moved,
two daemons sharing a Redis index over the TCP transport); then the request checks, over
an in-process server."""

from __future__ import annotations

import math
import os
import urllib.request

import grpc
import pytest
from daemon_harness import daemons, eventually
from test_grpc_api import HASHES, in_loop, refused, register_and_fill, register_request, serving

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.hashing import chain_hashes

BLOCK_SIZE = 16
LAYOUT = pb.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=BLOCK_SIZE, dtype="float16")  # 32 KiB blocks
BLOCK_BYTES = 32 * 1024
CHAIN = 16  # blocks per session's chain
# a host tier of 64 blocks over an NVMe tier of a few hundred: four sessions fill the host
SMALL = {
    "host.capacity_bytes": "2MiB",
    "host.page_bytes": "1MiB",
    "nvme.capacity_bytes": "16MiB",
    "nvme.page_bytes": "1MiB",
    "nvme.file_bytes": "8MiB",
}
pytestmark = pytest.mark.slow


@pytest.fixture
def start(tmp_path):
    with daemons(tmp_path) as start:
        yield start


def session(seed: int) -> list[bytes]:
    return chain_hashes([seed * 100_000 + i for i in range(CHAIN * BLOCK_SIZE)], BLOCK_SIZE)


def register(client) -> bytes:
    request = pb.RegisterNamespaceRequest(model_id="agent-model", layout=LAYOUT, tp_rank=0, tp_size=1)
    return client.store.RegisterNamespace(request).namespace_id


def save(client, ns: bytes, seed: int) -> list[bytes]:
    """One session's turn saved; never refused, whatever is retained."""
    hashes = session(seed)
    payloads = [os.urandom(BLOCK_BYTES) for _ in hashes]
    assert client.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=hashes, payloads=payloads)).num_stored == CHAIN
    return hashes


def tiers(client, ns: bytes, hashes: list[bytes]) -> list[int]:
    return list(client.store.Lookup(pb.LookupRequest(namespace_id=ns, block_hashes=pb.BlockHashes(hashes=hashes))).tiers)


def counters(client) -> dict[str, int]:
    return dict(client.admin.Stats(pb.StatsRequest()).counters)


def metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


HOST = [pb.TIER_HOST] * CHAIN


def test_a_retained_session_stays_in_memory_and_retained_blocks_are_demoted_never_dropped(start):
    daemon = start(extra=SMALL)
    with connect(daemon.address) as client:
        ns = register(client)
        kept, control = save(client, ns, 1), save(client, ns, 2)  # the two oldest sessions
        retained = client.admin.Retain(pb.RetainRequest(namespace_id=ns, block_hashes=kept, ttl_s=600))
        assert (retained.found_blocks, retained.retained_blocks, retained.ttl_s) == (CHAIN, CHAIN, 600)
        for seed in range(3, 11):  # 128 more blocks through a 64-block host tier
            save(client, ns, seed)
        assert tiers(client, ns, kept) == HOST
        assert tiers(client, ns, control) != HOST  # the same age, not retained: demoted
        # now more is retained than the host tier holds: saves go on, retained blocks move down
        everyone = [kept] + [session(seed) for seed in range(7, 11)]
        for hashes in everyone[1:]:
            client.admin.Retain(pb.RetainRequest(namespace_id=ns, block_hashes=hashes, ttl_s=600))
        assert counters(client)["retained_blocks"] == 5 * CHAIN
        for seed in range(11, 14):
            save(client, ns, seed)
        found = [tiers(client, ns, hashes) for hashes in everyone]
        assert all(len(found_tiers) == CHAIN for found_tiers in found)  # every retained block is still cached
        assert sum(found_tiers.count(pb.TIER_NVME) for found_tiers in found) >= 5 * CHAIN - 64
        stats = counters(client)
        assert stats.get("retained_dropped", 0) == 0 and stats.get("evicted_capacity", 0) == 0
        assert eventually(lambda: metric(daemon, "kvstore_retained_blocks ") == 5 * CHAIN)  # gauges follow housekeeping
        assert metric(daemon, 'kvstore_retain_blocks_total{result="retained"}') == 5 * CHAIN


def test_retention_ends_at_its_deadline(start):
    daemon = start(extra=SMALL)
    with connect(daemon.address) as client:
        ns = register(client)
        kept = save(client, ns, 1)
        assert client.admin.Retain(pb.RetainRequest(namespace_id=ns, block_hashes=kept, ttl_s=1)).retained_blocks == CHAIN
        assert counters(client)["retained_blocks"] == CHAIN
        assert eventually(lambda: counters(client)["retained_blocks"] == 0)  # housekeeping let it go
        for seed in range(2, 10):
            save(client, ns, seed)
        assert tiers(client, ns, kept) != HOST  # ordinary cache again: the oldest, demoted first


def test_prefetch_brings_a_demoted_session_back_into_the_host_tier(start):
    daemon = start(extra=SMALL)
    with connect(daemon.address) as client:
        ns = register(client)
        paused = save(client, ns, 1)
        for seed in range(2, 10):
            save(client, ns, seed)
        before = tiers(client, ns, paused)
        assert len(before) == CHAIN and pb.TIER_NVME in before
        plan = client.admin.Prefetch(pb.PrefetchRequest(namespace_id=ns, block_hashes=paused))
        assert (plan.host_blocks, plan.promoting_blocks) == (before.count(pb.TIER_HOST), before.count(pb.TIER_NVME))
        assert (plan.missing_blocks, plan.fetching_blocks) == (0, 0)
        assert eventually(lambda: tiers(client, ns, paused) == HOST)
        assert eventually(lambda: metric(daemon, 'kvstore_prefetch_blocks_total{result="promoted"}') == plan.promoting_blocks)


def test_prefetch_fetches_what_a_moved_session_left_on_its_previous_replica(start, redis):
    fleet = {
        "index.backend": redis.url,
        "index.lease_ttl_s": "3",
        "index.heartbeat_interval_s": "0.5",
        "index.publish_interval_s": "0.05",
        "transport.kind": "tcp",
    }
    old, new = start(node_id="old", extra={**SMALL, **fleet}), start(node_id="new", extra={**SMALL, **fleet})
    with connect(old.address) as old_client, connect(new.address) as new_client:
        ns = register(old_client)
        assert register(new_client) == ns  # the engine on the new replica registered the same namespace
        moved = save(old_client, ns, 1)
        assert eventually(lambda: any(n.node_id == "old" for n in new_client.index.Nodes(pb.NodesRequest()).nodes))
        gone = new_client.admin.Prefetch(pb.PrefetchRequest(namespace_id=ns, block_hashes=moved, source_node_id="nobody"))
        assert (gone.missing_blocks, gone.fetching_blocks) == (CHAIN, 0)  # a source nobody knows is skipped
        plan = new_client.admin.Prefetch(pb.PrefetchRequest(namespace_id=ns, block_hashes=moved, source_node_id="old"))
        assert (plan.host_blocks, plan.promoting_blocks, plan.missing_blocks, plan.fetching_blocks) == (0, 0, CHAIN, CHAIN)
        assert eventually(lambda: tiers(new_client, ns, moved) == HOST)
        intact = new_client.store.Get(pb.GetRequest(namespace_id=ns, block_hashes=moved)).payloads
        assert list(intact) == list(old_client.store.Get(pb.GetRequest(namespace_id=ns, block_hashes=moved)).payloads)


@in_loop
async def test_retain_and_prefetch_refuse_malformed_requests_with_a_sentence():
    async with serving() as api:  # no transport, no NVMe tier
        ns = await register_and_fill(api)
        admin = api.admin
        retained = await admin.Retain(pb.RetainRequest(namespace_id=ns, block_hashes=HASHES + [bytes(16)], ttl_s=1e9))
        assert (retained.found_blocks, retained.retained_blocks, retained.ttl_s) == (8, 9, 600)
        plan = await admin.Prefetch(pb.PrefetchRequest(namespace_id=ns, block_hashes=HASHES))
        assert (plan.host_blocks, plan.promoting_blocks, plan.missing_blocks, plan.fetching_blocks) == (8, 0, 0, 0)
        bad = grpc.StatusCode.INVALID_ARGUMENT
        for ttl_s in (0.0, -1.0, math.nan, math.inf):
            assert "ttl_s" in await refused(bad, admin.Retain(pb.RetainRequest(namespace_id=ns, block_hashes=HASHES, ttl_s=ttl_s)))
        for call in (admin.Retain, admin.Prefetch):
            request_type = pb.RetainRequest if call is admin.Retain else pb.PrefetchRequest
            extra = {"ttl_s": 10} if call is admin.Retain else {}
            await refused(bad, call(request_type(namespace_id=ns, block_hashes=[b"short"], **extra)))
            await refused(bad, call(request_type(namespace_id=ns, block_hashes=[bytes(16)] * 33, **extra)))  # over the node's limit
            await refused(bad, call(request_type(namespace_id=b"short", block_hashes=HASHES, **extra)))
            await refused(grpc.StatusCode.NOT_FOUND, call(request_type(namespace_id=bytes(16), block_hashes=HASHES, **extra)))
        sentence = await refused(bad, admin.Prefetch(pb.PrefetchRequest(namespace_id=ns, block_hashes=HASHES, source_node_id="peer")))
        assert "transport" in sentence
        await refused(bad, admin.Prefetch(pb.PrefetchRequest(namespace_id=ns, block_hashes=HASHES, source_node_id="x" * 2000)))
        assert (await api.store.RegisterNamespace(register_request())).namespace_id == ns  # still serving


def test_a_node_running_its_most_prefetches_refuses_the_next_before_looking_at_it():
    import asyncio

    from kvstore.errors import CapacityExhausted
    from kvstore.prefetch import MAX_RUNNING, Prefetcher

    async def check() -> None:
        prefetcher = Prefetcher(node=None, transfers=None)  # refused before it reads the node
        running = [asyncio.get_running_loop().create_future() for _ in range(MAX_RUNNING)]
        prefetcher._tasks.update(running)
        with pytest.raises(CapacityExhausted, match=f"{MAX_RUNNING} prefetches are running"):
            await prefetcher.start(b"n" * 16, [b"h" * 16])
        for future in running:
            future.cancel()

    asyncio.run(check())
