"""Cache-aware scale-down: the pure scoring (kvstore/cache_value.py) and ranking
(kvstore/scaledown.py), then a node's measurement against an embedded index shared by
in-process nodes (kvstore/cache_meter.py) with the production tier managers. Real daemons:
tests/test_drain_plan.py."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from kvstore.api import convert
from kvstore.api.cache_values import cache_value_from_proto
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.cache_meter import CacheValueMeter, measure
from kvstore.cache_value import MAX_HALF_LIFE_S, CacheValue, check_half_life, node_value, reuse_weight, unique_keys
from kvstore.chains import Chain
from kvstore.errors import IndexUnavailable, InvalidArgument
from kvstore.events import BlockStored
from kvstore.hashing import chain_hashes
from kvstore.index.base import NodeInfo
from kvstore.index.embedded import EmbeddedIndex
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.scaledown import Standing, cheapest, plan_document, rank, reason
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.records import BlockInfo

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")
NAMESPACE = Namespace("test/scaledown", LAYOUT)
NS = NAMESPACE.digest
BLOCK = LAYOUT.block_bytes


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


# -- the weight -------------------------------------------------------------------------
def test_a_blocks_weight_halves_every_half_life_and_a_pinned_block_counts_whole():
    assert reuse_weight(0.0, 60.0) == 1.0
    assert reuse_weight(60.0, 60.0) == pytest.approx(0.5)
    assert reuse_weight(180.0, 60.0) == pytest.approx(0.125)
    assert reuse_weight(-5.0, 60.0) == 1.0  # a clock read before the block's last access
    assert reuse_weight(3600.0, 60.0, pinned=True) == 1.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, MAX_HALF_LIFE_S * 2, True, "60"])
def test_a_half_life_must_be_a_positive_number_of_seconds(bad):
    with pytest.raises(InvalidArgument, match="half_life_s"):
        check_half_life(bad)


def test_a_cache_value_request_takes_the_nodes_half_life_for_zero_and_refuses_nonsense():
    assert convert.half_life(pb.CacheValueRequest(), 600.0) == 600.0
    assert convert.half_life(pb.CacheValueRequest(half_life_s=30.0), 600.0) == 30.0
    for bad in (-1.0, math.nan, math.inf, MAX_HALF_LIFE_S + 1):
        with pytest.raises(InvalidArgument, match="half_life_s"):
            convert.half_life(pb.CacheValueRequest(half_life_s=bad), 600.0)


# -- which blocks are unique -------------------------------------------------------------
def test_a_block_is_unique_where_no_other_daemon_holds_it_with_its_prefix():
    root = Chain(NS, None, (key(1), key(2), key(3), key(4)), 4 * BLOCK)
    under_shared = Chain(NS, key(2), (key(10), key(11)), 2 * BLOCK)  # below key(2), which a peer holds
    under_unique = Chain(NS, key(4), (key(20), key(21)), 2 * BLOCK)  # below key(4), which only this node holds
    other_namespace = Chain(b"o" * 16, None, (key(1),), BLOCK)
    unique = unique_keys([root, under_shared, under_unique, other_namespace], [2, 1, 2, 0])
    assert unique == {(NS, key(3)), (NS, key(4)), (NS, key(11)), (NS, key(20)), (NS, key(21)), (b"o" * 16, key(1))}
    with pytest.raises(InvalidArgument, match="held lengths"):
        unique_keys([root], [])


def block(n: int, idle_s: float, parent: int | None = None, pinned: bool = False, nbytes: int = BLOCK) -> BlockInfo:
    now = 1000.0
    return BlockInfo(NS, key(n), None if parent is None else key(parent), TierKind.HOST, nbytes, 0.0, now - idle_s, pinned, 0)


def test_a_nodes_value_weighs_its_unique_blocks_alone_by_idle_time():
    blocks = [block(1, 0.0), block(2, 60.0, 1), block(3, 120.0, 2), block(4, 600.0, 3, pinned=True), block(5, 0.0)]
    unique = {(NS, key(2)), (NS, key(3)), (NS, key(4))}
    value = node_value("n", blocks, unique, 1000.0, 60.0, num_peers=2)
    assert value == CacheValue("n", BLOCK * (0.5 + 0.25 + 1.0), 3 * BLOCK, 3, 5 * BLOCK, 5, 2, 60.0)


# -- the ranking ------------------------------------------------------------------------
def figure(node_id: str, value_bytes: float, num_peers: int = 2) -> CacheValue:
    return CacheValue(node_id, value_bytes, int(value_bytes) + 10, 1, 100_000, 10, num_peers, 600.0)


def test_the_plan_ranks_known_nodes_cheapest_first_and_never_chooses_an_unknown_one():
    ranked = rank(
        [
            Standing("c", "h:3", figure("c", 5_000.0)),
            Standing("ghost", error="DEADLINE_EXCEEDED: did not answer"),
            Standing("a", "h:1", figure("a", 0.0)),
            Standing("b", "h:2", figure("b", 70_000.0)),
            Standing("d", "h:4", figure("d", 5_000.0)),  # ties go by node id
        ]
    )
    assert [s.node_id for s in ranked] == ["a", "c", "d", "b", "ghost"]
    assert cheapest(ranked).node_id == "a"
    sentence = reason(ranked)
    assert sentence.startswith("a is the cheapest to lose: 0 B of weighted cache") and "4.9 KiB for c, the next" in sentence
    assert "ghost (DEADLINE_EXCEEDED: did not answer)" in sentence
    nobody = rank([Standing("ghost", error="gone")])
    assert cheapest(nobody) is None and reason(nobody).startswith("no node's cache value is known")
    assert cheapest(rank([])) is None and reason([]) == "the index lists no daemon."


def test_live_sessions_make_the_node_they_stick_to_dearer():
    quiet, busy = Standing("a", value=figure("a", 100.0), live_bytes=0), Standing("b", value=figure("b", 60.0), live_bytes=80)
    assert [s.node_id for s in rank([quiet, busy])] == ["a", "b"]  # 100 against 60 + 80
    assert [s.node_id for s in rank([quiet, Standing("b", value=figure("b", 60.0))])] == ["b", "a"]  # sessions not known


def test_the_plan_document_lists_every_node_and_notes_nodes_that_see_no_peer():
    ranked = rank([Standing("a", "h:1", figure("a", 10.4, num_peers=0), live_bytes=5), Standing("x", "h:9", error="refused")])
    document = plan_document(ranked, 30.0)
    assert document["cheapest"] == "a" and document["half_life_s"] == 30.0
    assert document["nodes"][0] | {"half_life_s": 600.0} == {
        "node_id": "a",
        "address": "h:1",
        "known": True,
        "cost_bytes": 15,
        "value_bytes": 10,
        "unique_bytes": 20,
        "unique_blocks": 1,
        "total_bytes": 100_000,
        "total_blocks": 10,
        "num_peers": 0,
        "half_life_s": 600.0,
        "live_bytes": 5,
    }
    assert document["nodes"][1] == {"node_id": "x", "address": "h:9", "known": False, "error": "refused"}
    assert len(document["notes"]) == 1 and document["notes"][0].startswith("a sees no other daemon in its index")


def test_a_daemons_answer_that_cannot_be_its_figure_is_refused():
    answer = pb.CacheValueResponse(node_id="a", value_bytes=10.0, unique_bytes=20, unique_blocks=1, total_bytes=40, total_blocks=2)
    assert cache_value_from_proto(answer, "a").value_bytes == 10.0
    with pytest.raises(InvalidArgument, match="answers as node 'a'"):
        cache_value_from_proto(answer, "b")
    for bad in (30.0, -1.0, math.nan):
        with pytest.raises(InvalidArgument, match="weighted bytes"):
            cache_value_from_proto(pb.CacheValueResponse(node_id="a", value_bytes=bad, unique_bytes=20, total_bytes=40), "a")


# -- a node measured against an index it shares -------------------------------------------
def manager(with_nvme: bool = False) -> TierManager:
    tiers = [MemoryTier(TierKind.HOST, torch.zeros(64 * BLOCK, dtype=torch.uint8), page_bytes=4 * BLOCK)]
    if with_nvme:
        tiers.append(MemoryTier(TierKind.NVME, torch.zeros(64 * BLOCK, dtype=torch.uint8), page_bytes=4 * BLOCK))
    tier_manager = TierManager(TierManagerConfig(), tiers)
    tier_manager.register_namespace(NAMESPACE)
    return tier_manager


def data(n: int) -> list[torch.Tensor]:
    return [torch.full((BLOCK,), i + 1, dtype=torch.uint8) for i in range(n)]


def test_a_node_counts_the_chains_no_other_daemon_holds_whole_and_an_engines_copy_is_none():
    async def main():
        index = EmbeddedIndex()
        a, b = manager(), manager(with_nvme=True)
        for name in ("a", "b"):
            await index.register(NodeInfo(name, grpc_address=f"{name}:1"), 60)
        await index.register(NodeInfo("vllm@b", kind="engine"), 60)
        shared = chain_hashes(list(range(4 * 16)), 16)
        own = chain_hashes(list(range(4 * 16)) + [7] * 32, 16)[4:]  # a's two blocks below the shared prefix
        tailless = chain_hashes(list(range(5000, 5000 + 3 * 16)), 16)  # a holds it whole, b without its first block
        a.put(NS, shared, data(4))
        a.put(NS, own, data(2), parent_hash=shared[-1])
        a.put(NS, tailless, data(3))
        b.put(NS, shared, data(4))
        b.put(NS, tailless[1:], data(2), parent_hash=tailless[0])
        b.persist()  # b's copies live on its NVMe tier: a copy all the same
        assert {info.tier for info in b.blocks()} == {TierKind.NVME}
        await index.publish("a", a.events.drain())
        await index.publish("b", b.events.drain())
        engine_copy = BlockStored(NS, tuple(own), shared[-1], TierKind.GPU, BLOCK)
        await index.publish("vllm@b", [BlockStored(NS, tuple(shared), None, TierKind.GPU, BLOCK), engine_copy])

        value = await measure(a, index, "a", 600.0)
        assert (value.unique_blocks, value.unique_bytes, value.total_blocks, value.num_peers) == (5, 5 * BLOCK, 9, 1)
        assert 0.99 * 5 * BLOCK < value.value_bytes <= 5 * BLOCK  # stored just now
        assert (await measure(b, index, "b", 600.0)).unique_blocks == 0  # its tailless blocks are orphans there: worth nothing
        await index.leave("b")
        alone = await measure(a, index, "a", 600.0)
        assert (alone.unique_blocks, alone.num_peers) == (9, 0)

    asyncio.run(asyncio.wait_for(main(), 30))


class SilentIndex(EmbeddedIndex):
    async def nodes(self):
        raise IndexUnavailable("the index at redis://nowhere does not answer.")


def test_the_metric_is_absent_rather_than_zero_while_the_index_does_not_answer():
    async def main():
        a = manager()
        a.put(NS, chain_hashes(list(range(32)), 16), data(2))
        index = EmbeddedIndex()
        meter = CacheValueMeter(a, index, "a", 600.0, 30.0)
        await meter.refresh()
        families = {family.name: family.samples[0].value for family in meter.collect()}
        assert families["kvstore_unique_cache_bytes"] == 2 * BLOCK
        assert 0.99 * 2 * BLOCK < families["kvstore_unique_cache_value_bytes"] <= 2 * BLOCK
        meter.index = SilentIndex()
        await meter.refresh()
        assert list(meter.collect()) == []
        meter.index = index
        await meter.refresh()
        assert len(list(meter.collect())) == 2

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize(
    "args, said",
    [
        (["--plan", "--auto"], "not both"),
        (["--half-life", "5"], "--half-life goes with --plan or --auto"),
        (["--plan", "--half-life", "-1"], "half_life_s must be"),
        (["--plan", "--to", "b"], "--plan drains nothing"),
        (["--auto", "--key", "sk-x"], "--key goes with --router"),
    ],
)
def test_drain_refuses_plan_options_that_do_not_go_together_before_asking_anyone(args, said):
    from click.testing import CliRunner

    from kvstore.cli import main

    result = CliRunner().invoke(main, ["--address", "127.0.0.1:1", "drain", *args])  # nobody listens there
    assert result.exit_code == 2 and said in result.output, result.output
