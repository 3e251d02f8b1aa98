"""Retention (tiers/retention.py): the tier manager keeping a session's chain between
turns, over memory tiers (a host tier and a memory tier standing in for NVMe) and a
clock the test moves."""

import math

import pytest
import torch
from test_manager import BLOCK, NS, Clock, chain, make_manager

from kvstore.errors import InvalidArgument, UnknownNamespace
from kvstore.events import BlockRemoved
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManagerConfig
from kvstore.tiers.retention import Retention


def put(manager, seed, count):
    hashes = chain(seed, count)
    data = [torch.full((BLOCK,), seed, dtype=torch.uint8) for _ in hashes]
    return manager.put(NS, hashes, data)


def flood(manager, seeds, count=4):
    """Save other sessions' chains, each of which must be stored whole."""
    for seed in seeds:
        assert put(manager, seed, count) == count


def test_a_retained_chain_stays_in_the_host_tier_while_a_flood_demotes_the_rest():
    manager = make_manager(host_blocks=8, lower_blocks=64)
    session = chain(1, 4)
    put(manager, 1, 4)
    assert manager.retain(NS, session, ttl_s=60).num_retained == 4
    flood(manager, range(2, 8))  # 24 blocks through an 8-block host tier
    assert manager.lookup(NS, session) == [TierKind.HOST] * 4
    assert TierKind.NVME in manager.lookup(NS, chain(2, 4))  # the others were demoted instead
    unretained = make_manager(host_blocks=8, lower_blocks=64)  # the same flood without the retain
    put(unretained, 1, 4)
    flood(unretained, range(2, 8))
    assert unretained.lookup(NS, session) != [TierKind.HOST] * 4


def test_when_only_retained_blocks_are_left_they_are_demoted_not_dropped_and_the_save_goes_on():
    manager = make_manager(host_blocks=8, lower_blocks=32, demote_on_commit=False)  # room made on demand, as the daemon's saves do
    session = chain(1, 8)
    put(manager, 1, 8)  # the whole host tier
    assert manager.retain(NS, session, ttl_s=60).num_retained == 8
    flood(manager, [2])
    tiers = manager.lookup(NS, session)
    assert len(tiers) == 8 and TierKind.NVME in tiers  # all still cached
    assert tiers == sorted(tiers, key=lambda kind: kind.rank)  # demoted from the tail
    flood(manager, [3])  # now an unretained chain is there to give way first
    assert manager.lookup(NS, session) == tiers
    assert not [e for e in manager.events.drain() if isinstance(e, BlockRemoved)]
    assert manager.counters["retained_dropped"] == 0


def test_without_a_tier_below_retained_blocks_give_way_to_a_save_and_the_loss_is_counted():
    manager = make_manager(host_blocks=8, max_retained_fraction=1.0)
    session = chain(1, 8)
    put(manager, 1, 8)
    assert manager.retain(NS, session, ttl_s=60).num_retained == 8
    flood(manager, [2])  # never refused: retention orders eviction, it does not forbid it
    num_left = len(manager.lookup(NS, session))
    assert num_left < 8 and manager.counters["retained_dropped"] == 8 - num_left


def test_retention_ends_at_its_deadline_and_a_newer_retain_extends_it():
    clock = Clock()
    manager = make_manager(host_blocks=8, lower_blocks=64, clock=clock)
    session = chain(1, 4)
    put(manager, 1, 4)
    manager.retain(NS, session, ttl_s=10)
    clock.now = 5
    manager.retain(NS, session, ttl_s=10)  # until 15
    manager.retain(NS, session, ttl_s=1)  # a shorter one never cuts it
    clock.now = 12
    flood(manager, range(2, 6))
    assert manager.lookup(NS, session) == [TierKind.HOST] * 4 and manager.num_retained == 4
    clock.now = 16  # ended; nobody calls expire_retention: eviction notices as it picks
    flood(manager, range(6, 10))
    assert manager.lookup(NS, session) != [TierKind.HOST] * 4
    assert manager.num_retained == 0 and manager.retained_bytes == 0


def test_a_block_stored_under_a_retained_key_is_retained_as_it_arrives():
    manager = make_manager(host_blocks=8, lower_blocks=64)
    session = chain(1, 4)
    result = manager.retain(NS, session, ttl_s=60)  # the turn's blocks are still being saved
    assert (result.num_found, result.num_retained) == (0, 4)
    put(manager, 1, 4)
    flood(manager, range(2, 8))
    assert manager.lookup(NS, session) == [TierKind.HOST] * 4


def test_the_retention_budget_bounds_the_keys_and_the_longest_retained_give_way_to_new_ones():
    clock = Clock()
    # capacity 8 blocks, a quarter of it retainable: 2 blocks
    manager = make_manager(host_blocks=8, clock=clock, max_retained_fraction=0.25)
    session = chain(1, 3)
    put(manager, 1, 3)
    result = manager.retain(NS, session, ttl_s=10)
    assert (result.num_found, result.num_retained) == (3, 2)  # in chain order: the prefix, never its own keys displaced
    assert manager.retained_bytes == 2 * BLOCK
    assert manager.retain(NS, session[:2], ttl_s=20).num_retained == 2  # extending costs nothing
    # a newer session's key takes the place of the key retained longest ago
    newer = chain(2, 1)
    put(manager, 2, 1)
    assert manager.retain(NS, newer, ttl_s=10).num_retained == 1
    assert manager.retained_bytes == 2 * BLOCK and manager.num_retained == 2
    assert manager.counters["retained_displaced"] == 1
    entry = manager._residency.catalogue.get  # the flag eviction reads (tiers/eviction.py)
    assert not entry((NS, session[0])).retained and entry((NS, session[1])).retained and entry((NS, newer[0])).retained
    clock.now = 21
    assert manager.expire_retention() == 2 and manager.retained_bytes == 0
    assert manager.retain(NS, chain(2, 1), ttl_s=10).num_retained == 1
    off = make_manager(host_blocks=8, max_retained_fraction=0.0)
    put(off, 1, 3)
    assert off.retain(NS, session, ttl_s=10).num_retained == 0


def test_a_displaced_retention_leaves_its_block_to_the_lru_order():
    retention = Retention(max_bytes=2 * BLOCK, clock=Clock())
    a, b, c = [(NS, block_hash) for block_hash in chain(3, 3)]
    assert retention.grant(a, BLOCK, 10.0, call=1) and retention.grant(b, BLOCK, 10.0, call=1)
    assert not retention.grant(c, BLOCK, 10.0, call=1)  # its own call's keys never give way
    assert retention.grant(a, BLOCK, 20.0, call=2)  # extended: now the most recent
    assert retention.grant(c, BLOCK, 10.0, call=3)
    assert retention.take_displaced() == [b] and retention.take_displaced() == []
    assert a in retention and c in retention and b not in retention and retention.num_bytes == 2 * BLOCK


def test_ttls_are_cut_to_the_maximum_and_malformed_ones_are_refused():
    manager = make_manager(max_retain_s=30)
    put(manager, 1, 2)
    assert manager.retain(NS, chain(1, 2), ttl_s=1e9).ttl_s == 30
    for ttl_s in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgument, match="ttl_s"):
            manager.retain(NS, chain(1, 2), ttl_s=ttl_s)
    with pytest.raises(UnknownNamespace):
        manager.retain(bytes(16), chain(1, 2), ttl_s=10)
    assert manager.num_retained == 2
    with pytest.raises(InvalidArgument, match="max_retain_s"):
        TierManagerConfig(max_retain_s=0)
    with pytest.raises(InvalidArgument, match="max_retained_fraction"):
        TierManagerConfig(max_retained_fraction=1.5)


def test_the_deadline_heap_stays_bounded_however_often_a_chain_is_extended():
    clock = Clock()
    retention = Retention(max_bytes=1 << 30, clock=clock)
    keys = [(NS, block_hash) for block_hash in chain(1, 8)]
    for step in range(2000):
        clock.now = step
        for key in keys:
            assert retention.grant(key, BLOCK, step + 100.0)
    assert len(retention) == 8 and len(retention._deadlines) <= 4 * 8 + 1024 + 1
    clock.now = 2098
    assert retention.expire() == [] and len(retention) == 8  # the stale items of earlier deadlines are skipped
    clock.now = 2099
    assert sorted(retention.expire()) == sorted(keys) and retention.num_bytes == 0 and not retention
