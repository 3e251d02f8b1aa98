"""The daemon's garbage-collection policy (kvstore/gcpolicy.py): survivors of a full
collection are frozen, so the next one walks only what is new; cyclic garbage is still
collected; and a dropped block never needs the collector, which is what makes freezing
the catalogue safe."""

from __future__ import annotations

import gc
import re
import urllib.request
import uuid
import weakref

import numpy as np
import pytest
import torch
from daemon_harness import daemons, eventually

from kvstore.gcpolicy import GcPolicy
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tiers.host import HostTier, HostTierConfig
from kvstore.tiers.manager import TierManager, TierManagerConfig

MiB = 1 << 20


class Node:
    """Objects in a reference cycle: only the collector frees them."""

    def __init__(self) -> None:
        self.me = self


def cycles(count: int) -> tuple[list[Node], list[weakref.ref]]:
    nodes = [Node() for _ in range(count)]
    return nodes, [weakref.ref(node) for node in nodes]


def living(refs: list[weakref.ref]) -> int:
    return sum(ref() is not None for ref in refs)


def alive(kind: type) -> int:
    """Tracked objects of ``kind`` in the collector's generations (frozen ones excluded)."""
    return sum(type(o) is kind for o in gc.get_objects())


@pytest.fixture
def policy():
    pauses: list[tuple[int, float]] = []
    now = [0.0]
    policy = GcPolicy(full_interval_s=600, observe_pause=lambda g, s: pauses.append((g, s)), clock=lambda: now[0])
    policy.install()
    try:
        yield policy, pauses, now
    finally:
        policy.uninstall()
        gc.collect()


def test_a_full_collection_freezes_its_survivors_and_young_garbage_is_still_collected(policy):
    policy, pauses, _ = policy
    assert policy.frozen_objects > 0  # the imports, at install
    survivors, survivor_refs = cycles(1000)
    before = gc.get_freeze_count()
    gc.collect()
    assert gc.get_freeze_count() >= before + 1000  # the next full collection will not walk them
    assert alive(Node) == 0 and living(survivor_refs) == 1000
    assert any(generation == 2 for generation, _ in pauses) and all(seconds >= 0 for _, seconds in pauses)
    young, young_refs = cycles(1000)
    del young  # cycles that die young, never frozen
    gc.collect()
    assert living(young_refs) == 0 and living(survivor_refs) == 1000
    del survivors


def test_cyclic_garbage_frozen_while_alive_is_collected_by_the_periodic_full_collection(policy):
    policy, _, now = policy
    doomed, refs = cycles(500)
    gc.collect()  # frozen, alive
    del doomed
    gc.collect()
    assert living(refs) == 500  # out of the collector's reach
    assert not policy.housekeeping()  # not due yet
    now[0] += 600
    assert policy.housekeeping() and policy.full_collections == 1
    assert living(refs) == 0
    assert policy.frozen_objects > 0  # what survived is frozen again


def test_the_frozen_count_is_kept_without_walking_the_frozen_objects(policy, monkeypatch):
    """``gc.get_freeze_count`` walks every frozen object (~11 ns each: 20 ms for a
    daemon's two million), and the daemon reads ``frozen_objects`` on its loop four times
    a second. The count is taken only where a whole-heap collection walks the heap anyway."""
    policy, _, now = policy
    walks = []
    monkeypatch.setattr(gc, "get_freeze_count", lambda real=gc.get_freeze_count: walks.append(real()) or walks[-1])
    start = policy.frozen_objects
    survivors, _ = cycles(1000)
    gc.collect()  # a generation-2 collection: its survivors are frozen, not counted
    for _ in range(10):
        assert not policy.housekeeping() and policy.frozen_objects == start
    assert walks == []
    now[0] += 600
    assert policy.housekeeping()  # the periodic whole-heap collection counts afresh
    assert len(walks) == 1 and policy.frozen_objects == walks[0] >= start + 1000
    del survivors


def test_cpythons_own_policy_freezes_nothing_and_still_reports_pauses():
    pauses: list[tuple[int, float]] = []
    policy = GcPolicy(0, observe_pause=lambda g, s: pauses.append((g, s)), freeze=False)
    frozen = gc.get_freeze_count()
    policy.install()
    try:
        gc.collect()
        assert gc.get_freeze_count() == frozen and (2, pauses[-1][1]) == pauses[-1]
        assert not policy.housekeeping()
    finally:
        policy.uninstall()


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="must not be negative"):
        GcPolicy(-5)


def test_dropped_blocks_are_freed_without_the_collector():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)
    namespace = Namespace("gc-model", layout)
    host = HostTier(HostTierConfig(capacity_bytes=4 * MiB, name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=4 * MiB))
    manager = TierManager(TierManagerConfig(high_watermark=1.0, low_watermark=0.9), [host])
    manager.register_namespace(namespace)
    capacity = 4 * MiB // layout.block_bytes
    src = torch.zeros(layout.block_bytes, dtype=torch.uint8)
    entry_type = None
    gc.collect()
    gc.disable()
    try:
        # two chains, each longer than the tier: capacity eviction drops blocks as they come
        for offset in (0, 10**6):
            hashes = chain_hashes(np.arange(2 * capacity * 16, dtype=np.int64) + offset, 16)
            for i in range(0, len(hashes), 128):
                manager.put(namespace.digest, hashes[i : i + 128], [src] * len(hashes[i : i + 128]))
                manager.relieve_pressure()
            entry_type = entry_type or type(next(iter(manager.catalogue)))
        assert alive(entry_type) == len(manager.catalogue) <= capacity
        manager.evict()
        assert alive(entry_type) == 0
    finally:
        gc.enable()
        manager.close()


def test_the_daemon_exports_its_collections(tmp_path):
    with daemons(tmp_path) as start:
        daemon = start()
        port = daemon.state["metrics_port"]

        def scrape() -> str:
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        def frozen() -> float:
            found = re.search(r"^kvstore_gc_frozen_objects (\S+)$", scrape(), re.MULTILINE)
            return float(found.group(1)) if found else 0.0

        assert eventually(lambda: frozen() > 10_000)  # torch, grpc and the rest, frozen at start
        assert "# TYPE kvstore_gc_pause_seconds histogram" in scrape()  # observed as the unit tests above show


@pytest.mark.parametrize("interval", [-2, 5, 10**7])
def test_a_full_collection_interval_out_of_range_is_refused_with_a_sentence(interval):
    from kvstore.config import ConfigError, ServerConfig

    with pytest.raises(ConfigError, match=r"server.gc_full_interval_s must be -1 .* got"):
        ServerConfig(gc_full_interval_s=interval)
