"""Cache bytes held per tenant (kvstore/gateway/tenant_cache.py): the pure attribution
and the router's memory of recent chains, then refreshes against the in-process index,
then against real daemons publishing to a real Redis."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import daemons
from engine_proc import LAYOUT, NAMESPACE

from kvstore.errors import IndexUnavailable
from kvstore.events import BlockRemoved, BlockStored, RemovalReason
from kvstore.gateway.metrics import RouterMetrics
from kvstore.gateway.tenant_cache import RecentChains, TenantCache, TenantShare, attribute
from kvstore.hashing import chain_hashes
from kvstore.index.base import NodeInfo
from kvstore.index.embedded import EmbeddedIndex
from kvstore.index.redis import RedisIndex
from kvstore.tier_kind import TierKind

BLOCK = 16
ENGINE = Path(__file__).with_name("engine_proc.py")


def tokens(seed: int, num_blocks: int) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(num_blocks * BLOCK)]


def keys(token_ids: list[int]) -> list[bytes]:
    return chain_hashes(token_ids, BLOCK)


def joined(token_ids: list[int]) -> bytes:
    return b"".join(keys(token_ids))


def by_hand(resident: list[tuple[str, bytes]], block_bytes: int) -> dict[str, TenantShare]:
    """The same figure block by block: every distinct block, the set of tenants using it."""
    users: dict[bytes, set[str]] = {}
    for tenant, chain in resident:
        for i in range(0, len(chain), 16):
            users.setdefault(chain[i : i + 16], set()).add(tenant)
    blocks: dict[str, int] = {}
    shares: dict[str, float] = {}
    for tenants in users.values():
        for tenant in tenants:
            blocks[tenant] = blocks.get(tenant, 0) + 1
            shares[tenant] = shares.get(tenant, 0.0) + block_bytes / len(tenants)
    return {tenant: TenantShare(blocks[tenant], shares[tenant]) for tenant in blocks}


def test_a_block_several_tenants_use_is_split_evenly_among_them():
    system = tokens(1, 4)  # one system prompt of 4 blocks
    resident = [
        ("a", joined(system + tokens(2, 3))),
        ("a", joined(system + tokens(3, 1))),  # a's second session: the prefix counts once for a
        ("b", joined(system + tokens(4, 2))),
        ("c", joined(system[: 2 * BLOCK])),  # c's chain is resident only for 2 blocks
        ("c", joined(tokens(5, 5))),
    ]
    found = attribute(resident, block_bytes=100)
    # blocks 0-1: a, b, c; blocks 2-3: a, b; then each tenant's own
    assert {tenant: (share.num_blocks, pytest.approx(share.num_bytes)) for tenant, share in found.items()} == {
        "a": (4 + 3 + 1, 2 * 100 / 3 + 2 * 100 / 2 + 4 * 100),
        "b": (4 + 2, 2 * 100 / 3 + 2 * 100 / 2 + 2 * 100),
        "c": (2 + 5, 2 * 100 / 3 + 5 * 100),
    }
    assert sum(share.num_bytes for share in found.values()) == pytest.approx((4 + 3 + 1 + 2 + 5) * 100)
    assert attribute([], 100) == {} and attribute([("a", b"")], 100) == {}


def test_attribution_agrees_with_a_count_block_by_block_on_random_trees_of_chains():
    rng = random.Random(7)
    for _round in range(60):
        prefixes = [[]]
        resident = []
        for _chain in range(rng.randint(1, 30)):
            base = rng.choice(prefixes)[: rng.randint(0, 8) * BLOCK]  # branch off an earlier chain
            chain = base + [rng.randrange(1000) for _ in range(rng.randint(0, 6) * BLOCK)]
            prefixes.append(chain)
            resident.append((rng.choice("abcd"), joined(chain)))
        expected = by_hand(resident, block_bytes=3)
        found = attribute(resident, block_bytes=3)
        assert found.keys() == expected.keys()
        for tenant, share in found.items():
            assert share.num_blocks == expected[tenant].num_blocks
            assert share.num_bytes == pytest.approx(expected[tenant].num_bytes)


def test_the_router_remembers_each_tenants_last_distinct_chains_within_its_budget():
    recent = RecentChains(max_chains=3, max_blocks=20)
    turn = tokens(1, 4)
    recent.record("a", keys(turn))
    recent.record("a", keys(turn + tokens(2, 2)))  # the session's next turn replaces its first
    assert recent.chains() == [("a", joined(turn + tokens(2, 2)))]
    recent.record("a", keys(turn))  # an earlier prefix again: nothing new to remember
    assert recent.chains() == [("a", joined(turn + tokens(2, 2)))]
    for seed in (3, 4, 5):
        recent.record("a", keys(tokens(seed, 2)))
    assert [chain for _, chain in recent.chains()] == [joined(tokens(s, 2)) for s in (3, 4, 5)]  # the oldest went
    recent.record("a", keys(tokens(6, 30)))  # longer than the budget: its first 20 blocks, alone
    assert recent.chains() == [("a", joined(tokens(6, 20)))]
    recent.record("b", keys(tokens(7, 1)))
    recent.record("b", [])
    assert recent.tenants() == ["a", "b"] and len(recent.chains()) == 2


def stored(hashes, tier=TierKind.HOST) -> BlockStored:
    return BlockStored(NAMESPACE.digest, tuple(hashes), None, tier, LAYOUT.block_bytes)


def gauges(metrics: RouterMetrics, tenant: str) -> tuple[float | None, float | None]:
    value = metrics.registry.get_sample_value
    return value("kvstore_router_tenant_cache_bytes", {"tenant": tenant}), value("kvstore_router_tenant_cache_blocks", {"tenant": tenant})


def test_a_refresh_sets_each_tenants_gauges_from_the_index_and_eviction_lowers_them():
    async def scenario():
        index = EmbeddedIndex()
        for node_id in ("n1", "n2"):
            await index.register(NodeInfo(node_id), lease_ttl_s=60)
        shared = keys(tokens(1, 10))
        await index.publish("n1", [stored(shared)])
        await index.publish("n2", [stored(shared[:4], TierKind.NVME)])  # a second copy counts once
        metrics = RouterMetrics(["n1", "n2"], max_tenants=4)
        cache = TenantCache(RecentChains(8, 1000), index, NAMESPACE, metrics)
        assert await cache.refresh() == {}
        cache.recent.record("a", shared)
        cache.recent.record("b", keys(tokens(1, 4) + tokens(9, 3)))  # 4 resident blocks, shared with a
        cache.recent.record("c", keys(tokens(8, 2)))  # nothing resident
        await cache.refresh()
        block = LAYOUT.block_bytes
        assert gauges(metrics, "a") == (6 * block + 4 * block / 2, 10)
        assert gauges(metrics, "b") == (4 * block / 2, 4)
        assert gauges(metrics, "c") == (0, 0)
        await index.publish("n1", [BlockRemoved(NAMESPACE.digest, tuple(shared[5:]), TierKind.HOST, RemovalReason.CAPACITY)])
        await cache.refresh()
        assert gauges(metrics, "a") == (1 * block + 4 * block / 2, 5)
        await index.leave("n1")
        await index.leave("n2")
        await cache.refresh()
        assert gauges(metrics, "a") == gauges(metrics, "b") == (0, 0)

    asyncio.run(scenario())


class FlakyIndex(EmbeddedIndex):
    """The in-process index, unreachable for its first ``num_failures`` batched matches."""

    def __init__(self, num_failures: int) -> None:
        super().__init__()
        self.num_failures = num_failures

    async def match_many(self, namespace, chains, node_ids=None):
        if self.num_failures > 0:
            self.num_failures -= 1
            raise IndexUnavailable("the index is down for this test")
        return await super().match_many(namespace, chains, node_ids)


def test_the_background_task_outlives_an_unreachable_index():
    async def scenario():
        index = FlakyIndex(num_failures=3)
        await index.register(NodeInfo("n1"), lease_ttl_s=60)
        await index.publish("n1", [stored(keys(tokens(1, 3)))])
        metrics = RouterMetrics(["n1"], max_tenants=4)
        cache = TenantCache(RecentChains(8, 1000), index, NAMESPACE, metrics)
        cache.recent.record("a", keys(tokens(1, 3)))
        task = asyncio.create_task(cache.run(0.01))
        while gauges(metrics, "a") == (None, None) and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        assert index.num_failures == 0 and gauges(metrics, "a") == (3 * LAYOUT.block_bytes, 3)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def save(daemon, seed: int, num_blocks: int) -> None:
    command = [sys.executable, str(ENGINE), str(daemon.socket), "save", str(seed), str(num_blocks)]
    subprocess.run(command, check=True, capture_output=True, timeout=120)


async def until(check, expected, timeout_s: float = 10.0):
    """Await ``check()`` until it returns ``expected`` or ``timeout_s`` passes; its last value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (value := await check()) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return value


@pytest.mark.slow
def test_real_daemons_blocks_are_attributed_and_an_eviction_lowers_the_gauge(tmp_path, redis):
    settings = {"index.backend": redis.url, "index.heartbeat_interval_s": "0.4", "index.publish_interval_s": "0.05"}
    assert LAYOUT.block_size == BLOCK
    block = LAYOUT.block_bytes
    with daemons(tmp_path) as start:
        a, b = start(node_id="node-a", extra=settings), start(node_id="node-b", extra=settings)
        save(a, seed=1, num_blocks=12)
        save(b, seed=1, num_blocks=4)  # a copy of the shared prefix on the other node
        save(b, seed=2, num_blocks=5)

        async def scenario():
            metrics = RouterMetrics(["node-a", "node-b"], max_tenants=4)
            index = RedisIndex(redis.url)
            cache = TenantCache(RecentChains(8, 1000), index, NAMESPACE, metrics)
            cache.recent.record("team-a", keys(tokens(1, 12)))
            cache.recent.record("team-b", keys(tokens(1, 4) + tokens(3, 3)))  # diverges after the 4 shared blocks
            cache.recent.record("team-b", keys(tokens(2, 5)))
            expected = {"team-a": TenantShare(12, 8 * block + 4 * block / 2), "team-b": TenantShare(9, 5 * block + 4 * block / 2)}
            assert await until(cache.refresh, expected) == expected
            assert gauges(metrics, "team-a") == (expected["team-a"].num_bytes, 12)
            assert gauges(metrics, "team-b") == (expected["team-b"].num_bytes, 9)
            assert sum(share.num_bytes for share in expected.values()) == (12 + 5) * block  # the distinct resident blocks
            leaves = [h.hex() for h in keys(tokens(1, 12))[6:]]
            command = [sys.executable, "-m", "kvstore", "--address", a.address, "--json", "evict", "--namespace", NAMESPACE.id, *leaves]
            evicted = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
            assert evicted.returncode == 0 and json.loads(evicted.stdout)["evicted"] == 6, evicted.stderr
            lowered = {"team-a": TenantShare(6, 2 * block + 4 * block / 2), "team-b": expected["team-b"]}
            assert await until(cache.refresh, lowered) == lowered
            assert gauges(metrics, "team-a") == (lowered["team-a"].num_bytes, 6)
            await index.close()

        asyncio.run(scenario())
