"""Prometheus metrics of a node, and the numbers `kvstore stats` prints.

Request-path counters are incremented as requests are served; tier gauges and the tier
manager's own counters (evictions by reason, promotions, demotions, …) are copied on
each housekeeping tick into a snapshot that the collector reads, so a scrape from the
exporter's thread never walks state the event loop is changing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.tier_kind import TierKind

if TYPE_CHECKING:
    from kvstore.tiers.manager import TierManager

__all__ = ["Metrics"]

_COUNTER_NAME = re.compile(r"^(evicted|promoted|demoted|hit_blocks|corrupt|tier_failed|free_errors)_(.+)$")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.lookup_blocks = Counter(
            "kvstore_lookup_blocks", "Blocks asked for in lookups, by result and tier.", ["namespace", "result", "tier"], registry=r
        )
        self.lookup_tokens = Counter(
            "kvstore_lookup_tokens", "Tokens asked for in lookups, by result and tier.", ["namespace", "result", "tier"], registry=r
        )
        self.loaded_blocks = Counter(
            "kvstore_loaded_blocks", "Blocks served to readers, by the tier they were found in.", ["namespace", "tier"], registry=r
        )
        self.read_bytes = Counter("kvstore_read_bytes", "Bytes served to readers, by the tier they were found in.", ["tier"], registry=r)
        self.stored_blocks = Counter("kvstore_stored_blocks", "Blocks committed by writers.", registry=r)
        self.written_bytes = Counter("kvstore_written_bytes", "Bytes committed by writers into the host tier.", registry=r)
        self.explicit_evictions = Counter("kvstore_explicit_evictions", "Blocks evicted by an operator or API call.", registry=r)
        self.transfer_blocks = Counter(
            "kvstore_transfer_blocks", "Blocks moved between daemons, by direction and operation.", ["direction", "op"], registry=r
        )
        self.transfer_bytes = Counter("kvstore_transfer_bytes", "Bytes moved between daemons, by direction.", ["direction"], registry=r)
        self.transfer_dropped = Counter(
            "kvstore_transfer_dropped_blocks", "Received blocks dropped before storing, by reason.", ["reason"], registry=r
        )
        self.request_seconds = Histogram(
            "kvstore_request_seconds",
            "Time to serve a request, by operation.",
            ["rpc"],
            registry=r,
            buckets=(50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0, 5.0),
        )
        self.loop_lag = Histogram(
            "kvstore_event_loop_lag_seconds",
            "How late the daemon's event loop ran a timer (sampled every server.loop_lag_interval_ms): "
            "the longest any request waits for the loop.",
            registry=r,
            buckets=(1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 10e-3, 15e-3, 20e-3, 30e-3, 50e-3, 75e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
        )
        self._children: dict[tuple[bytes, str, str], tuple] = {}
        self._rpc_children: dict[str, object] = {}
        self._snapshot = _Snapshot()
        r.register(self._snapshot)

    # -- request path ---------------------------------------------------------------------
    def lookup(self, digest: bytes, tiers: list[TierKind], num_asked: int, block_size: int) -> None:
        for tier in TierKind:
            count = tiers.count(tier)  # list.count runs in C; a Counter costs 10x on 512 blocks
            if count:
                blocks, tokens = self._lookup_children(digest, "hit", tier.value)
                blocks.inc(count)
                tokens.inc(count * block_size)
        missed = num_asked - len(tiers)
        if missed:
            blocks, tokens = self._lookup_children(digest, "miss", "none")
            blocks.inc(missed)
            tokens.inc(missed * block_size)

    def _lookup_children(self, digest: bytes, result: str, tier: str):
        # labels() takes a lock and builds a key on every call; lookups are the hot path
        key = (digest, result, tier)
        children = self._children.get(key)
        if children is None:
            labels = (digest.hex(), result, tier)
            children = self._children[key] = (self.lookup_blocks.labels(*labels), self.lookup_tokens.labels(*labels))
        return children

    def loaded(self, digest: bytes, tiers: Sequence[TierKind], block_bytes: int) -> None:
        namespace = digest.hex()
        for tier in tiers:
            self.loaded_blocks.labels(namespace, tier.value).inc()
            self.read_bytes.labels(tier.value).inc(block_bytes)

    def stored(self, num_blocks: int, num_bytes: int) -> None:
        self.stored_blocks.inc(num_blocks)
        self.written_bytes.inc(num_bytes)

    def transferred(self, direction: str, op: str, num_blocks: int, num_bytes: int) -> None:
        if num_blocks:
            self.transfer_blocks.labels(direction, op).inc(num_blocks)
            self.transfer_bytes.labels(direction).inc(num_bytes)

    def dropped(self, reason: str, num_blocks: int = 1) -> None:
        self.transfer_dropped.labels(reason).inc(num_blocks)

    def evicted_explicitly(self, num_blocks: int) -> None:
        self.explicit_evictions.inc(num_blocks)

    def observe(self, rpc: str, seconds: float) -> None:
        child = self._rpc_children.get(rpc)
        if child is None:
            child = self._rpc_children[rpc] = self.request_seconds.labels(rpc)
        child.observe(seconds)

    # -- housekeeping -------------------------------------------------------------------
    def refresh(self, manager: TierManager) -> None:
        self._snapshot.update(manager)


class _Snapshot(Collector):
    def __init__(self) -> None:
        self._tiers: list = []
        self._counters: dict[str, int] = {}
        self._gauges: dict[str, int] = {}

    def update(self, manager: TierManager) -> None:
        # each attribute is replaced whole: a scrape in another thread sees old or new
        self._tiers = manager.tier_stats()
        self._counters = dict(manager.counters)
        self._gauges = {"leases": manager.num_leases, "reservations": manager.num_reservations, "blocks": len(manager.catalogue)}

    def collect(self) -> Iterator:
        capacity = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity of each tier.", labels=["tier"])
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes of slots in use in each tier.", labels=["tier"])
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks resident in each tier.", labels=["tier"])
        occupancy = GaugeMetricFamily("kvstore_tier_occupancy_ratio", "Used over capacity, per tier.", labels=["tier"])
        for stats in self._tiers:
            capacity.add_metric([stats.kind.value], stats.capacity_bytes)
            used.add_metric([stats.kind.value], stats.used_bytes)
            blocks.add_metric([stats.kind.value], stats.num_blocks)
            occupancy.add_metric([stats.kind.value], stats.occupancy)
        yield from (capacity, used, blocks, occupancy)
        for name, help_text in (
            ("leases", "Read leases held now."),
            ("reservations", "Write reservations open now."),
            ("blocks", "Blocks cached on this node."),
        ):
            yield GaugeMetricFamily(f"kvstore_{name}", help_text, value=self._gauges.get(name, 0))
        events = CounterMetricFamily(
            "kvstore_tier_events", "Tier manager events: evictions by reason, moves, corrupt reads, failures.", labels=["event", "detail"]
        )
        for name, value in sorted(self._counters.items()):
            match = _COUNTER_NAME.match(name)
            if match:
                events.add_metric([match.group(1), match.group(2)], value)
        yield events
