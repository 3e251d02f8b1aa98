"""The kvstore.v1 gRPC API, served by a real aio server over a real Node and host tier,
called through real channels on loopback with the generated stubs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import uuid
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.api.client import ApiError, connect
from kvstore.api.server import create_grpc_server
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.config import IndexConfig, RoutingConfig, ServerConfig
from kvstore.errors import NotFound
from kvstore.hashing import chain_hashes
from kvstore.index.base import NodeInfo
from kvstore.index.embedded import EmbeddedIndex
from kvstore.index.sessions import EmbeddedSessionStore
from kvstore.layout import KVLayout
from kvstore.metrics import Metrics
from kvstore.namespace import Namespace
from kvstore.node import Limits, Node
from kvstore.publisher import IndexPublisher
from kvstore.router import Router
from kvstore.tiers.host import HostTier, HostTierConfig
from kvstore.tiers.manager import TierManager, TierManagerConfig

KiB = 1024
BLOCK_SIZE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE, dtype="float16")
BLOCK_BYTES = LAYOUT.block_bytes  # 1 KiB, in a 4 KiB slot
LIMITS = Limits(max_blocks_per_request=32, max_tokens_per_request=32 * BLOCK_SIZE, max_inline_bytes=64 * KiB, max_page_size=100)
NODE_ID = "node-a"
TOKENS = list(range(1000, 1000 + 8 * BLOCK_SIZE))  # eight full blocks
HASHES = chain_hashes(TOKENS, BLOCK_SIZE)
PAYLOADS = [os.urandom(BLOCK_BYTES) for _ in HASHES]
UNKNOWN_HASH = bytes(range(16))


def in_loop(test):
    """Run an ``async def`` test on a fresh event loop (no pytest-asyncio here)."""

    @functools.wraps(test)  # pytest reads the fixtures the test asks for through __wrapped__
    def run(**fixtures):
        asyncio.run(asyncio.wait_for(test(**fixtures), timeout=30))

    return run


@dataclass
class Api:
    node: Node
    port: int
    channel: grpc.aio.Channel
    store: pb_grpc.StoreStub
    index: pb_grpc.IndexStub
    admin: pb_grpc.AdminStub
    publisher: IndexPublisher  # step() sends the node's block events to the embedded index
    sessions: EmbeddedSessionStore


@contextlib.asynccontextmanager
async def serving(host_bytes: int = 1024 * KiB, token: str = ""):
    host = HostTier(HostTierConfig(capacity_bytes=host_bytes, name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=64 * KiB))
    manager = TierManager(TierManagerConfig(), [host])
    node = Node(NODE_ID, manager, Metrics(), LIMITS)
    config = ServerConfig(grpc_host="127.0.0.1", grpc_port=0, metrics_port=-1, auth_token=token, node_id=NODE_ID)
    index, sessions = EmbeddedIndex(), EmbeddedSessionStore()
    server, port = create_grpc_server(node, Router(node, index, sessions, RoutingConfig()), config)
    publisher = IndexPublisher(index, NodeInfo(NODE_ID), manager, IndexConfig())
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Api(
            node, port, channel, pb_grpc.StoreStub(channel), pb_grpc.IndexStub(channel), pb_grpc.AdminStub(channel), publisher, sessions
        )
    finally:
        await channel.close()
        await server.stop(None)
        manager.close()


def register_request() -> pb.RegisterNamespaceRequest:
    layout = pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK_SIZE, dtype="float16")
    return pb.RegisterNamespaceRequest(model_id="tiny-llama", layout=layout, tp_rank=0, tp_size=1)


async def register_and_fill(api: Api, hashes=HASHES, payloads=PAYLOADS) -> bytes:
    registered = await api.store.RegisterNamespace(register_request())
    put = await api.store.Put(pb.PutRequest(namespace_id=registered.namespace_id, block_hashes=hashes, payloads=payloads))
    assert put.num_stored == len(hashes)
    return registered.namespace_id


async def refused(code: grpc.StatusCode, call) -> str:
    """Await ``call``, which must fail with ``code`` and a sentence; returns the sentence."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    details = caught.value.details()
    assert len(details) > 20 and details.rstrip().endswith((".", ")")), details
    return details


async def still_serving(api: Api, namespace_id: bytes) -> None:
    found = await api.store.Lookup(pb.LookupRequest(namespace_id=namespace_id, block_hashes=pb.BlockHashes(hashes=HASHES)))
    assert found.matched_blocks == len(HASHES)


@in_loop
async def test_store_round_trip():
    async with serving() as api:
        registered = await api.store.RegisterNamespace(register_request())
        assert registered.namespace_id == Namespace("tiny-llama", LAYOUT).digest
        assert registered.block_bytes == BLOCK_BYTES
        ns = registered.namespace_id

        put = await api.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=HASHES, payloads=PAYLOADS))
        assert put.num_stored == 8
        again = await api.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=HASHES, payloads=PAYLOADS))
        assert again.num_stored == 0

        by_tokens = await api.store.Lookup(pb.LookupRequest(namespace_id=ns, token_ids=pb.TokenIds(ids=TOKENS + [7, 7])))
        assert by_tokens.matched_blocks == 8 and by_tokens.matched_tokens == 8 * BLOCK_SIZE
        assert list(by_tokens.tiers) == [pb.TIER_HOST] * 8
        assert [(c.tier, c.blocks) for c in by_tokens.tier_counts] == [(pb.TIER_HOST, 8)]

        broken = HASHES[:5] + [UNKNOWN_HASH] + HASHES[6:]
        by_hashes = await api.store.Lookup(pb.LookupRequest(namespace_id=ns, block_hashes=pb.BlockHashes(hashes=broken)))
        assert by_hashes.matched_blocks == 5 and by_hashes.matched_tokens == 5 * BLOCK_SIZE

        got = await api.store.Get(pb.GetRequest(namespace_id=ns, block_hashes=HASHES))
        assert list(got.payloads) == PAYLOADS
        partial = await api.store.Get(pb.GetRequest(namespace_id=ns, block_hashes=HASHES[:3] + [UNKNOWN_HASH]))
        assert list(partial.payloads) == PAYLOADS[:3]
        assert api.node.stats().num_leases == 0  # Get released what it leased

        # a chain continued from a cached parent
        more_tokens = TOKENS + list(range(5000, 5000 + 2 * BLOCK_SIZE))
        tail = chain_hashes(more_tokens, BLOCK_SIZE)[8:]
        tail_payloads = [os.urandom(BLOCK_BYTES) for _ in tail]
        put = await api.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=tail, parent_hash=HASHES[-1], payloads=tail_payloads))
        assert put.num_stored == 2
        longer = await api.store.Lookup(pb.LookupRequest(namespace_id=ns, token_ids=pb.TokenIds(ids=more_tokens)))
        assert longer.matched_blocks == 10


@in_loop
async def test_match_answers_for_this_node():
    async with serving() as api:
        ns = await register_and_fill(api, HASHES[:6], PAYLOADS[:6])
        await api.publisher.step()
        match = await api.index.Match(pb.MatchRequest(namespace_id=ns, token_ids=pb.TokenIds(ids=TOKENS)))
        assert len(match.nodes) == 1
        node = match.nodes[0]
        assert (node.node_id, node.matched_blocks, node.matched_tokens) == (NODE_ID, 6, 6 * BLOCK_SIZE)
        assert [(c.tier, c.blocks) for c in node.tier_counts] == [(pb.TIER_HOST, 6)]

        by_hashes = await api.index.Match(
            pb.MatchRequest(namespace_id=ns, block_hashes=pb.BlockHashes(hashes=HASHES[:2]), node_ids=[NODE_ID, "node-b"])
        )
        assert [(n.node_id, n.matched_blocks) for n in by_hashes.nodes] == [(NODE_ID, 2)]
        elsewhere = await api.index.Match(pb.MatchRequest(namespace_id=ns, token_ids=pb.TokenIds(ids=TOKENS), node_ids=["node-b"]))
        assert list(elsewhere.nodes) == []


@in_loop
async def test_route_prefers_the_node_holding_the_prefix_and_keeps_sessions_sticky():
    async with serving() as api:
        ns = await register_and_fill(api, HASHES[:6], PAYLOADS[:6])
        await api.publisher.step()
        idle = pb.RouteCandidate(node_id="node-b")
        here = pb.RouteCandidate(node_id=NODE_ID, load=pb.NodeLoad(queued_tokens=0, active_requests=0))
        first = await api.index.Route(pb.RouteRequest(namespace_id=ns, token_ids=TOKENS, session_id="s1", candidates=[idle, here]))
        assert first.node_id == NODE_ID and first.expected_cached_tokens == 6 * BLOCK_SIZE
        assert first.expected_cost_s >= 0 and first.reason
        # the session now sticks to this node even when node-b looks as good
        affinity = await api.sessions.get("s1")
        assert affinity is not None and affinity.node_id == NODE_ID
        # a dead sticky node (not among the candidates) moves the session, and the move is recorded
        moved = await api.index.Route(pb.RouteRequest(namespace_id=ns, token_ids=TOKENS, session_id="s1", candidates=[idle]))
        assert moved.node_id == "node-b" and "moved" in moved.reason.lower()
        assert (await api.sessions.moves())[0]["to"] == "node-b"


@in_loop
async def test_stats_list_blocks_evict_pin_unpin():
    async with serving() as api:
        ns = await register_and_fill(api)
        stats = await api.admin.Stats(pb.StatsRequest())
        assert (stats.node_id, stats.num_blocks, stats.num_namespaces, stats.num_leases) == (NODE_ID, 8, 1, 0)
        assert [t.tier for t in stats.tiers] == [pb.TIER_HOST]
        assert stats.tiers[0].num_blocks == 8 and stats.tiers[0].used_bytes == 8 * 4 * KiB
        assert 0 < stats.tiers[0].occupancy < 1 and list(stats.failed_tiers) == []
        assert stats.counters["blocks_stored"] == 8

        first = await api.admin.ListBlocks(pb.ListBlocksRequest(namespace_id=ns, page_size=5))
        assert len(first.blocks) == 5 and first.total == 8 and first.next_page_token
        second = await api.admin.ListBlocks(pb.ListBlocksRequest(namespace_id=ns, page_size=5, page_token=first.next_page_token))
        assert len(second.blocks) == 3 and second.total == 8 and second.next_page_token == ""
        listed = [b.block_hash for b in (*first.blocks, *second.blocks)]
        assert sorted(listed) == sorted(HASHES)
        block = next(b for b in first.blocks if b.block_hash == HASHES[1])
        assert (block.namespace_id, block.parent_hash, block.tier, block.nbytes) == (ns, HASHES[0], pb.TIER_HOST, BLOCK_BYTES)
        assert block.age_s >= 0 and block.idle_s >= 0 and not block.pinned and block.leases == 0
        assert (await api.admin.ListBlocks(pb.ListBlocksRequest(tier=pb.TIER_HOST))).total == 8
        assert (await api.admin.ListBlocks(pb.ListBlocksRequest(tier=pb.TIER_NVME))).total == 0
        assert (await api.admin.ListBlocks(pb.ListBlocksRequest(min_idle_s=3600))).total == 0

        assert (await api.admin.Pin(pb.PinRequest(namespace_id=ns, block_hashes=HASHES[:4] + [UNKNOWN_HASH]))).count == 4
        pinned = await api.admin.ListBlocks(pb.ListBlocksRequest(namespace_id=ns))
        assert {b.block_hash for b in pinned.blocks if b.pinned} == set(HASHES[:4])

        by_hash = await api.admin.Evict(pb.EvictRequest(namespace_id=ns, block_hashes=HASHES[6:]))
        assert (by_hash.evicted, by_hash.skipped) == (2, 0)
        idle = await api.admin.Evict(pb.EvictRequest(min_idle_s=3600))
        assert (idle.evicted, idle.skipped) == (0, 0)
        by_namespace = await api.admin.Evict(pb.EvictRequest(namespace_id=ns))
        assert (by_namespace.evicted, by_namespace.skipped) == (2, 4)

        assert (await api.admin.Unpin(pb.UnpinRequest(namespace_id=ns, block_hashes=HASHES))).count == 4
        everything = await api.admin.Evict(pb.EvictRequest(all=True))
        assert (everything.evicted, everything.skipped) == (4, 0)
        assert (await api.admin.Stats(pb.StatsRequest())).num_blocks == 0


@in_loop
async def test_bad_requests_are_refused_and_the_server_keeps_serving():
    async with serving() as api:
        ns = await register_and_fill(api)
        store, admin, index = api.store, api.admin, api.index
        short_hash = HASHES[0][:15]
        cases = [
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: store.Lookup(pb.LookupRequest(namespace_id=ns, block_hashes=pb.BlockHashes(hashes=[HASHES[0], short_hash]))),
            ),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: store.Put(pb.PutRequest(namespace_id=ns, block_hashes=[short_hash], payloads=[PAYLOADS[0]])),
            ),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: store.Put(
                    pb.PutRequest(namespace_id=ns, block_hashes=[UNKNOWN_HASH], parent_hash=short_hash, payloads=[PAYLOADS[0]])
                ),
            ),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: store.Put(pb.PutRequest(namespace_id=ns, block_hashes=[UNKNOWN_HASH], payloads=[b"x" * 10])),
            ),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: store.Put(pb.PutRequest(namespace_id=ns, block_hashes=[UNKNOWN_HASH], payloads=[]))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: store.Get(pb.GetRequest(namespace_id=ns, block_hashes=[UNKNOWN_HASH] * 33))),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: store.Lookup(pb.LookupRequest(namespace_id=ns, token_ids=pb.TokenIds(ids=[1] * (33 * BLOCK_SIZE)))),
            ),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: store.Lookup(pb.LookupRequest(namespace_id=ns[:3], token_ids=pb.TokenIds(ids=TOKENS))),
            ),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: store.Lookup(pb.LookupRequest(namespace_id=ns))),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: store.RegisterNamespace(
                    pb.RegisterNamespaceRequest(
                        model_id="m", layout=pb.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float13")
                    )
                ),
            ),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: store.RegisterNamespace(pb.RegisterNamespaceRequest(model_id="m"))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.ListBlocks(pb.ListBlocksRequest(tier=pb.TIER_UNSPECIFIED))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.ListBlocks(pb.ListBlocksRequest(page_size=101))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.ListBlocks(pb.ListBlocksRequest(page_token="not-a-token"))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Evict(pb.EvictRequest(tier=pb.TIER_UNSPECIFIED))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Evict(pb.EvictRequest(tier=99))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Evict(pb.EvictRequest())),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Evict(pb.EvictRequest(block_hashes=HASHES))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Evict(pb.EvictRequest(namespace_id=ns, all=True))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Evict(pb.EvictRequest(min_idle_s=-1))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Pin(pb.PinRequest(namespace_id=ns, block_hashes=[UNKNOWN_HASH] * 33))),
            (
                grpc.StatusCode.NOT_FOUND,
                lambda: store.Lookup(pb.LookupRequest(namespace_id=UNKNOWN_HASH, token_ids=pb.TokenIds(ids=TOKENS))),
            ),
            (
                grpc.StatusCode.NOT_FOUND,
                lambda: store.Lookup(pb.LookupRequest(namespace_id=UNKNOWN_HASH, block_hashes=pb.BlockHashes(hashes=HASHES))),
            ),
            (grpc.StatusCode.NOT_FOUND, lambda: store.Get(pb.GetRequest(namespace_id=UNKNOWN_HASH, block_hashes=HASHES))),
            (grpc.StatusCode.NOT_FOUND, lambda: index.Match(pb.MatchRequest(namespace_id=UNKNOWN_HASH, token_ids=pb.TokenIds(ids=TOKENS)))),
            (grpc.StatusCode.NOT_FOUND, lambda: admin.Pin(pb.PinRequest(namespace_id=UNKNOWN_HASH, block_hashes=HASHES))),
            (grpc.StatusCode.NOT_FOUND, lambda: admin.Evict(pb.EvictRequest(namespace_id=UNKNOWN_HASH))),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: index.Route(pb.RouteRequest(namespace_id=ns, token_ids=TOKENS))),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: index.Route(
                    pb.RouteRequest(namespace_id=ns, token_ids=TOKENS, candidates=[pb.RouteCandidate(node_id=NODE_ID)] * 2)
                ),
            ),
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                lambda: index.Match(pb.MatchRequest(namespace_id=ns, block_hashes=pb.BlockHashes(hashes=[]))),
            ),
            (grpc.StatusCode.INVALID_ARGUMENT, lambda: admin.Drain(pb.DrainRequest(target_node_ids=["node-b"]))),  # no transport here
        ]
        sentences = []
        for code, call in cases:
            sentences.append(await refused(code, call()))
            await still_serving(api, ns)
        assert "16" in sentences[0] and "limit" in sentences[5] and "limit" in sentences[6]
        assert "TIER_UNSPECIFIED" in sentences[11] and "empty" in sentences[-2] and "transport" in sentences[-1]
        assert api.node.stats().num_blocks == 8  # no refused request changed anything


@in_loop
async def test_put_into_a_full_tier_of_pinned_blocks_is_resource_exhausted():
    async with serving(host_bytes=64 * KiB) as api:  # sixteen 4 KiB slots
        tokens = list(range(16 * BLOCK_SIZE))
        hashes = chain_hashes(tokens, BLOCK_SIZE)
        ns = await register_and_fill(api, hashes, [os.urandom(BLOCK_BYTES) for _ in hashes])
        assert (await api.admin.Pin(pb.PinRequest(namespace_id=ns, block_hashes=hashes))).count == 16
        sentence = await refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            api.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=[UNKNOWN_HASH], payloads=[PAYLOADS[0]])),
        )
        assert "pinned" in sentence
        found = await api.store.Lookup(pb.LookupRequest(namespace_id=ns, token_ids=pb.TokenIds(ids=tokens)))
        assert found.matched_blocks == 16


@in_loop
async def test_unexpected_errors_are_internal_and_logged_and_latency_is_observed(caplog):
    async with serving() as api:
        ns = await register_and_fill(api)

        def broken_stats():
            raise RuntimeError("a bug")

        api.node.stats = broken_stats
        with caplog.at_level(logging.ERROR, logger="kvstore.api.servicers"):
            sentence = await refused(grpc.StatusCode.INTERNAL, api.admin.Stats(pb.StatsRequest()))
        assert any(record.exc_info and "a bug" in str(record.exc_info[1]) for record in caplog.records)
        assert "RuntimeError" in sentence and "a bug" not in sentence
        del api.node.stats
        assert (await api.admin.Stats(pb.StatsRequest())).num_blocks == 8
        await still_serving(api, ns)
        registry = api.node.metrics.registry
        assert registry.get_sample_value("kvstore_request_seconds_count", {"rpc": "Store.Lookup"}) == 1
        assert registry.get_sample_value("kvstore_request_seconds_count", {"rpc": "Admin.Stats"}) == 2


@in_loop
async def test_bearer_token_auth():
    async with serving(token="s3cret") as api:
        await refused(grpc.StatusCode.UNAUTHENTICATED, api.admin.Stats(pb.StatsRequest()))
        await refused(grpc.StatusCode.UNAUTHENTICATED, api.admin.Stats(pb.StatsRequest(), metadata=[("authorization", "Bearer s3creT")]))
        await refused(grpc.StatusCode.UNAUTHENTICATED, api.admin.Stats(pb.StatsRequest(), metadata=[("authorization", "s3cret")]))
        stats = await api.admin.Stats(pb.StatsRequest(), metadata=[("authorization", "Bearer s3cret")])
        assert stats.node_id == NODE_ID

        health = health_pb2_grpc.HealthStub(api.channel)
        for service in ("", "kvstore.v1.Store", "kvstore.v1.Index", "kvstore.v1.Admin"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        reflection = reflection_pb2_grpc.ServerReflectionStub(api.channel)
        names = set()
        async for answer in reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
            names |= {s.name for s in answer.list_services_response.service}
        assert {"kvstore.v1.Store", "kvstore.v1.Index", "kvstore.v1.Admin", "grpc.health.v1.Health"} <= names


@in_loop
async def test_blocking_client_helper():
    async with serving(token="s3cret") as api:
        address = f"127.0.0.1:{api.port}"

        def use_the_client():
            with connect(address, token="s3cret", timeout=5) as client:
                assert client.health() == "SERVING"
                ns = client.store.RegisterNamespace(register_request()).namespace_id
                client.store.Put(pb.PutRequest(namespace_id=ns, block_hashes=HASHES, payloads=PAYLOADS))
                assert client.admin.Stats(pb.StatsRequest()).num_blocks == 8
                found = client.store.Lookup(pb.LookupRequest(namespace_id=ns, token_ids=pb.TokenIds(ids=TOKENS)))
                assert found.matched_blocks == 8
                with pytest.raises(ApiError) as missing:
                    client.store.Lookup(pb.LookupRequest(namespace_id=UNKNOWN_HASH, token_ids=pb.TokenIds(ids=TOKENS)))
                assert missing.value.code == "NOT_FOUND" and "not registered" in str(missing.value)
            with connect(address, token="wrong", timeout=5) as client:
                assert client.health() == "SERVING"  # open without a valid token
                with pytest.raises(ApiError) as refused_call:
                    client.admin.Stats(pb.StatsRequest())
                assert refused_call.value.code == "UNAUTHENTICATED" and "token" in str(refused_call.value)

        # the server runs on this loop, so the blocking client runs in a thread
        await asyncio.to_thread(use_the_client)

    def call_a_stopped_server():
        with connect(address, timeout=2) as client:
            with pytest.raises(ApiError) as unreachable:
                client.admin.Stats(pb.StatsRequest())
            assert unreachable.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and address in str(unreachable.value)

    await asyncio.to_thread(call_a_stopped_server)


@in_loop
async def test_a_request_that_does_not_parse_is_invalid_argument_and_logs_no_traceback(caplog):
    async with serving() as api:
        ns = await register_and_fill(api)
        for method in ("/kvstore.v1.Store/Lookup", "/kvstore.v1.Index/Route", "/kvstore.v1.Admin/ListBlocks"):
            call = api.channel.unary_unary(method)  # bytes in, bytes out
            for body in (b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\xff\xff\xff\x0f", b"\x80"):
                sentence = await refused(grpc.StatusCode.INVALID_ARGUMENT, call(body))
                assert method.rsplit("/", 1)[1] in sentence
            await still_serving(api, ns)
        assert not [r for r in caplog.records if r.exc_info], "a malformed request is the caller's mistake, not the daemon's"


@in_loop
async def test_a_status_sentence_is_bounded_whatever_the_error_echoes():
    async with serving() as api:
        ns = await register_and_fill(api)

        def echoing_evict(*args):
            raise NotFound("no live peer among " + ", ".join(f"node-{i:05d}" for i in range(10_000)) + ".")  # 100 KB the caller sent

        api.node.evict = echoing_evict
        sentence = await refused(grpc.StatusCode.NOT_FOUND, api.admin.Evict(pb.EvictRequest(all=True)))
        assert sentence.startswith("no live peer among node-00000") and len(sentence) <= 1024
        await still_serving(api, ns)


@in_loop
async def test_drain_and_warm_node_ids_are_bounded_like_matchs():
    async with serving() as api:
        ns = await register_and_fill(api)
        admin = api.admin
        for ids in (["n"] * 4097, ["x" * 1025]):
            for call in (admin.Drain(pb.DrainRequest(target_node_ids=ids)), admin.Warm(pb.WarmRequest(source_node_ids=ids))):
                sentence = await refused(grpc.StatusCode.INVALID_ARGUMENT, call)
                assert "limit" in sentence and "transport" not in sentence  # checked before anything else
        await still_serving(api, ns)


@in_loop
async def test_a_page_token_this_node_cannot_have_issued_is_refused():
    async with serving() as api:
        ns = await register_and_fill(api)
        for token in ("-3", "+3", " 3", "3 ", "٣", "1_0", "0x3", "3.0"):
            await refused(grpc.StatusCode.INVALID_ARGUMENT, api.admin.ListBlocks(pb.ListBlocksRequest(page_size=3, page_token=token)))
        first = await api.admin.ListBlocks(pb.ListBlocksRequest(page_size=3))
        second = await api.admin.ListBlocks(pb.ListBlocksRequest(page_size=3, page_token=first.next_page_token))
        assert first.next_page_token == "3" and len(second.blocks) == 3 and second.blocks[0] != first.blocks[0]
        await still_serving(api, ns)
