"""The embedded index: the pure `BlockLocations` core, then `EmbeddedIndex` (leases) and
`EmbeddedSessionStore` over a fake clock."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvstore.errors import CapacityExhausted, InvalidArgument, NotFound
from kvstore.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, RemovalReason
from kvstore.hashing import chain_hashes
from kvstore.index.base import NodeInfo, NodeMatch
from kvstore.index.embedded import EmbeddedIndex
from kvstore.index.locations import BlockLocations
from kvstore.index.sessions import EmbeddedSessionStore
from kvstore.tier_kind import TierKind

GPU, HBM, HOST, NVME, REMOTE = TierKind.GPU, TierKind.HBM, TierKind.HOST, TierKind.NVME, TierKind.REMOTE
NS = b"namespace-a"
OTHER_NS = b"namespace-b"


def chain(num_blocks: int, seed: int = 0) -> list[bytes]:
    return chain_hashes(list(range(seed * 1_000_000, seed * 1_000_000 + 4 * num_blocks)), 4)


def stored(hashes, tier: TierKind, namespace: bytes = NS) -> BlockStored:
    return BlockStored(namespace, tuple(hashes), None, tier, 1024)


def removed(hashes, tier: TierKind, namespace: bytes = NS) -> BlockRemoved:
    return BlockRemoved(namespace, tuple(hashes), tier, RemovalReason.CAPACITY)


def summary(matches: list[NodeMatch]) -> list[tuple[str, int, dict]]:
    return [(m.node_id, m.num_blocks, m.tier_counts()) for m in matches]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(coroutine):
    return asyncio.run(coroutine)


# -- BlockLocations: the pure core ---------------------------------------------------------


@pytest.fixture
def three_nodes() -> tuple[BlockLocations, list[bytes]]:
    hashes = chain(10)
    locations = BlockLocations()
    for node_id in ("a", "b", "c"):
        locations.add_node(node_id)
    locations.apply("a", [stored(hashes[:6], HOST)])
    locations.apply("b", [stored(hashes[:3], HBM), stored(hashes[3:9], NVME)])
    locations.apply("c", [stored(hashes[:2], GPU), stored(hashes[3:10], HOST)])  # c lacks block 2
    return locations, hashes


def test_each_node_matches_the_longest_prefix_it_holds_best_first(three_nodes):
    locations, hashes = three_nodes
    matches = locations.match(NS, hashes)
    assert summary(matches) == [("b", 9, {HBM: 3, NVME: 6}), ("a", 6, {HOST: 6}), ("c", 2, {GPU: 2})]
    assert matches[0].tiers == (HBM,) * 3 + (NVME,) * 6  # in chain order


def test_a_node_without_the_first_block_is_not_a_match(three_nodes):
    locations, hashes = three_nodes
    assert summary(locations.match(NS, hashes[2:])) == [("b", 7, {HBM: 1, NVME: 6}), ("a", 4, {HOST: 4})]  # c lacks block 2
    assert summary(locations.match(NS, hashes[3:])) == [("c", 7, {HOST: 7}), ("b", 6, {NVME: 6}), ("a", 3, {HOST: 3})]
    assert locations.match(NS, [chain(1, seed=9)[0]] + hashes) == []
    assert locations.match(NS, []) == []


def test_ties_break_by_node_id_and_node_ids_select_a_subset(three_nodes):
    locations, hashes = three_nodes
    locations.apply("c", [stored(hashes[2:3], GPU)])  # c now holds the whole chain
    assert [m.node_id for m in locations.match(NS, hashes)] == ["c", "b", "a"]
    locations.apply("a", [stored(hashes, HOST)])
    assert [(m.node_id, m.num_blocks) for m in locations.match(NS, hashes)] == [("a", 10), ("c", 10), ("b", 9)]
    assert [m.node_id for m in locations.match(NS, hashes, ["b", "a", "unknown"])] == ["a", "b"]
    assert locations.match(NS, hashes, []) == []
    assert locations.match(NS, hashes, ["unknown"]) == []


def test_namespaces_are_isolated(three_nodes):
    locations, hashes = three_nodes
    assert locations.match(OTHER_NS, hashes) == []
    locations.apply("a", [stored(hashes[:2], NVME, OTHER_NS)])
    assert summary(locations.match(OTHER_NS, hashes)) == [("a", 2, {NVME: 2})]
    assert summary(locations.match(NS, hashes))[1] == ("a", 6, {HOST: 6})


def test_moves_change_the_tier_and_removals_from_another_tier_are_stale(three_nodes):
    locations, hashes = three_nodes
    locations.apply("a", [BlockMoved(NS, tuple(hashes[:2]), HOST, HBM)])
    assert locations.match(NS, hashes, ["a"])[0].tiers == (HBM, HBM, HOST, HOST, HOST, HOST)
    locations.apply("a", [removed(hashes[4:5], NVME)])  # a holds block 4 in HOST
    assert locations.match(NS, hashes, ["a"])[0].num_blocks == 6
    locations.apply("a", [removed(hashes[4:5], HOST)])
    assert summary(locations.match(NS, hashes, ["a"])) == [("a", 4, {HBM: 2, HOST: 2})]  # the gap ends it


def test_all_blocks_cleared_empties_only_that_node(three_nodes):
    locations, hashes = three_nodes
    locations.apply("b", [AllBlocksCleared()])
    assert [m.node_id for m in locations.match(NS, hashes)] == ["a", "c"]
    assert "b" in locations
    locations.apply("b", [AllBlocksCleared(), stored(hashes[:1], GPU)])  # a resync: clear, then the catalogue
    assert summary(locations.match(NS, hashes, ["b"])) == [("b", 1, {GPU: 1})]


def test_events_of_a_batch_apply_in_order():
    hashes = chain(4)
    locations = BlockLocations()
    locations.add_node("a")
    locations.apply("a", [stored(hashes, HOST), stored(hashes[:1], NVME), stored(hashes[:1], HBM), removed(hashes[3:], HOST)])
    assert locations.match(NS, hashes)[0].tiers == (HBM, HOST, HOST)
    locations.apply("a", [removed(hashes[:1], HBM), stored(hashes[:1], GPU), BlockMoved(NS, tuple(hashes[1:2]), HOST, NVME)])
    assert locations.match(NS, hashes)[0].tiers == (GPU, NVME, HOST)


def test_a_malformed_batch_changes_nothing():
    hashes = chain(3)
    locations = BlockLocations()
    locations.add_node("a")
    for bad in ([stored(hashes, HOST), stored([b"short"], HOST)], [stored(hashes, HOST), "not an event"], [stored([bytes(16)], HOST)]):
        with pytest.raises(InvalidArgument):
            locations.apply("a", bad)
    assert locations.num_blocks() == 0
    with pytest.raises(NotFound):
        locations.apply("nobody", [stored(hashes, HOST)])
    locations.apply("a", [stored(hashes, HOST)])
    for bad_chain in ([b"short"], [hashes[0], "text"]):
        with pytest.raises(InvalidArgument):
            locations.match(NS, bad_chain)


def test_a_removed_nodes_slot_never_shows_its_blocks_to_the_next_node():
    hashes = chain(5)
    locations = BlockLocations(max_nodes=2)  # two slots: every new node reuses one
    locations.add_node("old")
    locations.add_node("keeper")
    locations.apply("old", [stored(hashes, HOST)])
    locations.apply("keeper", [stored(hashes[:2], NVME)])
    locations.remove_node("old")
    assert [m.node_id for m in locations.match(NS, hashes)] == ["keeper"]
    locations.add_node("new")  # takes the old node's slot
    assert summary(locations.match(NS, hashes)) == [("keeper", 2, {NVME: 2})]
    locations.apply("new", [stored(hashes[:1], GPU)])
    assert summary(locations.match(NS, hashes, ["new"])) == [("new", 1, {GPU: 1})]
    with pytest.raises(CapacityExhausted):
        locations.add_node("one too many")
    with pytest.raises(InvalidArgument):
        locations.add_node("keeper")


def test_cleared_node_does_not_see_its_old_blocks_when_its_slot_is_reused():
    hashes = chain(3)
    locations = BlockLocations(max_nodes=1)  # clear must scrub the only slot to reuse it
    locations.add_node("a")
    locations.apply("a", [stored(hashes, HOST)])
    locations.clear_node("a")
    assert locations.match(NS, hashes) == []
    assert locations.num_blocks() == 0  # the scrub freed the rows too


def test_memory_is_reclaimed_after_removal_and_after_sweep():
    hashes = chain(20_000)
    locations = BlockLocations()
    locations.add_node("a")
    locations.add_node("b")
    locations.apply("a", [stored(hashes, HOST)])
    locations.apply("b", [stored(hashes[:100], NVME)])
    full = locations.memory_bytes()
    assert locations.num_blocks() == 20_000 and locations.num_locations() == 20_100
    assert full >= 20_000 * 24  # key + one code word per row, at least
    locations.apply("a", [removed(hashes[1000:], HOST)])
    assert locations.num_blocks() == 1000
    assert locations.memory_bytes() <= full // 8  # the table shrank
    assert summary(locations.match(NS, hashes)) == [("a", 1000, {HOST: 1000}), ("b", 100, {NVME: 100})]
    locations.remove_node("a")
    assert locations.num_locations() == 100 and locations.num_blocks() == 1000  # rows wait for the scrub
    assert locations.sweep() == 900
    assert locations.num_blocks() == 100
    locations.apply("b", [removed(hashes[:100], NVME)])
    assert locations.num_blocks() == 0 and locations.memory_bytes() == 0


def test_more_than_sixteen_nodes_widen_the_rows():
    hashes = chain(40)
    locations = BlockLocations(max_nodes=40)
    for i in range(40):
        locations.add_node(f"n{i:02}")
        locations.apply(f"n{i:02}", [stored(hashes[: i + 1], (HOST, NVME, HBM)[i % 3])])
    matches = locations.match(NS, hashes)
    assert [(m.node_id, m.num_blocks) for m in matches] == [(f"n{i:02}", i + 1) for i in reversed(range(40))]
    assert all(set(m.tiers) == {(HOST, NVME, HBM)[int(m.node_id[1:]) % 3]} for m in matches)


def test_a_128k_token_prefix_over_eight_nodes_matches_exactly():
    hashes = chain(8192)
    locations = BlockLocations()
    expected = []
    for i in range(8):
        node_id, length = f"node-{i}", 8192 - 1000 * i
        locations.add_node(node_id)
        locations.apply(node_id, [stored(hashes[: length // 2], (GPU, HBM, HOST, NVME)[i % 4]), stored(hashes[length // 2 : length], NVME)])
        expected.append((node_id, (GPU, HBM, HOST, NVME)[i % 4], length))
    matches = locations.match(NS, hashes)
    assert [m.node_id for m in matches] == [node_id for node_id, _, _ in expected]
    for m, (_, tier, length) in zip(matches, expected):
        assert m.tiers == (tier,) * (length // 2) + (NVME,) * (length - length // 2)


def test_random_operations_agree_with_a_plain_model():
    rng = random.Random(7)
    chains = {ns: [chain(300, seed) for seed in range(3)] for ns in (NS, OTHER_NS)}
    locations = BlockLocations(max_nodes=4)
    model: dict[str, dict[tuple[bytes, bytes], TierKind]] = {}
    tiers = list(TierKind)
    for step in range(600):
        node_id = f"n{rng.randrange(5)}"
        if node_id not in model:
            if len(model) == 4:
                gone = rng.choice(sorted(model))
                locations.remove_node(gone)
                del model[gone]
            locations.add_node(node_id)
            model[node_id] = {}
        ns = rng.choice((NS, OTHER_NS))
        hashes = rng.choice(chains[ns])
        start = rng.randrange(300)
        picked = hashes[start : start + rng.randrange(1, 200)]
        tier = rng.choice(tiers)
        roll = rng.random()
        if roll < 0.5:
            locations.apply(node_id, [stored(picked, tier, ns)])
            model[node_id].update({(ns, h): tier for h in picked})
        elif roll < 0.8:
            locations.apply(node_id, [removed(picked, tier, ns)])
            for h in picked:
                if model[node_id].get((ns, h)) is tier:
                    del model[node_id][(ns, h)]
        elif roll < 0.97:
            locations.apply(node_id, [BlockMoved(ns, tuple(picked), HOST, tier)])
            model[node_id].update({(ns, h): tier for h in picked})
        else:
            locations.apply(node_id, [AllBlocksCleared()])
            model[node_id] = {}
        if step % 7 == 0:
            for ns_, hashes_ in ((n, c) for n in chains for c in chains[n]):
                assert locations.match(ns_, hashes_) == _reference_match(model, ns_, hashes_), f"step {step}"
    held = {key for blocks in model.values() for key in blocks}
    locations.sweep()
    assert locations.num_blocks() == len(held)
    assert locations.num_locations() == sum(len(blocks) for blocks in model.values())


def _reference_match(model, namespace, hashes) -> list[NodeMatch]:
    matches = []
    for node_id, blocks in model.items():
        tiers = []
        for h in hashes:
            if (namespace, h) not in blocks:
                break
            tiers.append(blocks[(namespace, h)])
        if tiers:
            matches.append(NodeMatch(node_id, tuple(tiers)))
    return sorted(matches, key=lambda m: (-m.num_blocks, m.node_id))


# -- EmbeddedIndex: leases -----------------------------------------------------------------


def test_embedded_index_publishes_and_matches():
    async def scenario():
        index = EmbeddedIndex(clock=FakeClock())
        hashes = chain(8)
        assert await index.register(NodeInfo("a", "a:1"), 10) is False  # new: starts empty
        assert await index.register(NodeInfo("b", "b:1"), 10) is False
        await index.publish("a", [stored(hashes[:5], HOST)])
        await index.publish("b", [stored(hashes, NVME)])
        assert summary(await index.match(NS, hashes)) == [("b", 8, {NVME: 8}), ("a", 5, {HOST: 5})]
        assert summary(await index.match(NS, hashes, ["a"])) == [("a", 5, {HOST: 5})]
        assert [n.node_id for n in await index.nodes()] == ["a", "b"]
        await index.leave("b")
        await index.leave("b")  # leaving twice is harmless
        assert [m.node_id for m in await index.match(NS, hashes)] == ["a"]
        with pytest.raises(NotFound):
            await index.publish("b", [stored(hashes, NVME)])

    run(scenario())


def test_an_expired_lease_hides_the_node_and_it_comes_back_empty():
    async def scenario():
        clock = FakeClock()
        index = EmbeddedIndex(clock=clock)
        hashes = chain(4)
        await index.register(NodeInfo("a"), 10)
        await index.register(NodeInfo("b"), 30)
        await index.publish("a", [stored(hashes, HOST)])
        await index.publish("b", [stored(hashes[:2], HOST)])
        clock.now += 9.9
        assert await index.register(NodeInfo("a", "a:2"), 10) is True  # a heartbeat renews it
        assert (await index.nodes())[0].grpc_address == "a:2"
        clock.now += 9.9
        assert [m.node_id for m in await index.match(NS, hashes)] == ["a", "b"]
        clock.now += 0.2  # a's lease ran out, b's has not
        assert [m.node_id for m in await index.match(NS, hashes)] == ["b"]
        assert [n.node_id for n in await index.nodes()] == ["b"]
        with pytest.raises(NotFound):  # deltas against a forgotten catalogue are refused
            await index.publish("a", [stored(hashes, HOST)])
        assert await index.register(NodeInfo("a"), 10) is False
        assert [m.node_id for m in await index.match(NS, hashes)] == ["b"]  # back, but empty
        await index.publish("a", [AllBlocksCleared(), stored(hashes[:1], NVME)])
        assert summary(await index.match(NS, hashes)) == [("b", 2, {HOST: 2}), ("a", 1, {NVME: 1})]

    run(scenario())


def test_a_reused_slot_after_expiry_never_shows_the_old_nodes_blocks():
    async def scenario():
        clock = FakeClock()
        index = EmbeddedIndex(clock=clock, max_nodes=1)
        hashes = chain(4)
        await index.register(NodeInfo("old"), 5)
        await index.publish("old", [stored(hashes, HOST)])
        clock.now += 6
        await index.register(NodeInfo("new"), 5)  # the only slot: scrubbed, then reused
        assert await index.match(NS, hashes) == []
        assert index.locations.num_blocks() == 0

    run(scenario())


def test_sweep_reclaims_the_memory_of_expired_nodes():
    async def scenario():
        clock = FakeClock()
        index = EmbeddedIndex(clock=clock)
        await index.register(NodeInfo("a"), 5)
        await index.publish("a", [stored(chain(5000), NVME)])
        assert index.memory_bytes() > 0
        clock.now += 5
        assert index.sweep() == 5000
        assert index.memory_bytes() == 0

    run(scenario())


def test_register_validates_its_arguments():
    async def scenario():
        index = EmbeddedIndex(clock=FakeClock())
        for ttl in (0, -1, float("inf"), float("nan")):
            with pytest.raises(InvalidArgument):
                await index.register(NodeInfo("a"), ttl)
        with pytest.raises(InvalidArgument):
            await index.register(NodeInfo(""), 10)
        assert await index.nodes() == []

    run(scenario())


# -- EmbeddedSessionStore ------------------------------------------------------------------


def test_sessions_stick_move_and_expire():
    async def scenario():
        clock = FakeClock()
        store = EmbeddedSessionStore(clock=clock, wall_clock=lambda: 1.7e9, max_moves=2)
        assert await store.get("s1") is None
        assert await store.put("s1", "a", 10) == (affinity := await store.get("s1"))
        assert affinity.node_id == "a" and affinity.num_moves == 0
        await store.put("s1", "a", 10, reason="sticky: …")  # no move
        moved = await store.put("s1", "b", 10, moved_from="a", reason="moved: a cost 2.1 s vs 0.4 s")
        assert moved.num_moves == 1
        assert await store.moves() == [{"session": "s1", "from": "a", "to": "b", "reason": "moved: a cost 2.1 s vs 0.4 s", "time": 1.7e9}]
        await store.put("s1", "c", 10)
        await store.put("s1", "a", 10)
        assert [m["to"] for m in await store.moves()] == ["a", "c"]  # newest first, bounded
        assert [m["to"] for m in await store.moves(limit=1)] == ["a"]
        clock.now += 9
        await store.put("s2", "a", 10)
        clock.now += 1.5  # s1 expired (not refreshed); s2 lives
        assert await store.get("s1") is None
        assert (await store.get("s2")).node_id == "a"
        assert len(store) == 1
        again = await store.put("s1", "b", 10, moved_from="a")  # expired affinity: the router names the origin
        assert again.num_moves == 1 and (await store.moves(1))[0]["from"] == "a"

    run(scenario())


def test_session_store_validates_and_forgets_refreshed_entries():
    async def scenario():
        clock = FakeClock()
        store = EmbeddedSessionStore(clock=clock)
        for bad in (("", "a", 10), ("s", "", 10), ("s", "a", 0), ("s", "a", float("nan"))):
            with pytest.raises(InvalidArgument):
                await store.put(*bad)
        for _ in range(5000):
            await store.put("s", "a", 10)
        assert len(store._expiries) <= 2 * len(store) + 1024 + 1
        with pytest.raises(InvalidArgument):
            EmbeddedSessionStore(max_moves=0)

    run(scenario())


def test_large_batches_grow_the_table_and_every_block_stays_findable():
    hashes = chain(60_000)
    locations = BlockLocations()
    locations.add_node("a")
    locations.apply("a", [stored(hashes[:30_000], HOST)])  # one event: one vectorised insert
    locations.apply("a", [stored([h], NVME) for h in hashes[30_000:]])  # a resync: one event per block
    assert locations.num_blocks() == 60_000
    assert locations.match(NS, hashes)[0].tiers == (HOST,) * 30_000 + (NVME,) * 30_000


def test_crafted_colliding_hashes_are_refused():
    # every hash shares its three table positions (bits 0-31 and 32-55 of its second half,
    # bits 0-31 of its first): no table size up to 2**24 can hold them
    crafted = [((i << 32) | 5).to_bytes(8, "little") + ((i << 56) | 0x0504_0302_0100).to_bytes(8, "little") for i in range(1, 20)]
    locations = BlockLocations()
    locations.add_node("a")
    with pytest.raises(InvalidArgument):
        locations.apply("a", [stored(crafted, HOST)])
