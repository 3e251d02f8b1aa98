"""Prometheus metrics of a node, and the numbers `kvstore stats` prints.

Request-path counters are incremented as requests are served; tier gauges and the tier
manager's own counters (evictions by reason, promotions, demotions, …) are copied on
each housekeeping tick into a snapshot that the collector reads, so a scrape from the
exporter's thread never walks state the event loop is changing.

The two figures every request touches — lookup hits and misses, and the request latency
histogram — are plain integers and lists that the loop updates (a few hundred
nanoseconds, against ~5 µs through prometheus_client's locked children, on a ~60 µs
lookup) and a collector turns into metric families at scrape time, from a copy taken in
one step under the GIL.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvstore.tier_kind import TIER_BY_RANK, TierKind

if TYPE_CHECKING:
    from kvstore.tiers.manager import TierManager

__all__ = ["Metrics"]

_RANKS = tuple(tier.rank for tier in TierKind)
_MISS = -1  # the "rank" under which a lookup's missed blocks are counted
_LATENCY_BOUNDS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0, 5.0)
_GC_BOUNDS = (1e-4, 1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5)
_COUNTER_NAME = re.compile(r"^(evicted|promoted|demoted|hit_blocks|corrupt|tier_failed|free_errors)_(.+)$")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = _RequestPath()
        r.register(self._requests)
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
        self.peer_refused = Counter(
            "kvstore_peer_refused_connections",
            "Peer connections refused before any request: no or wrong credentials (refused), no handshake in time "
            "(timeout), a broken handshake (failed), or over transport.max_peer_channels[_per_source] (limit).",
            ["reason"],
            registry=r,
        )
        self.transfer_dropped = Counter(
            "kvstore_transfer_dropped_blocks", "Received blocks dropped before storing, by reason.", ["reason"], registry=r
        )
        self.index_timeouts = Counter(
            "kvstore_index_timeouts",
            "Index lookups given up at their caller's deadline, by operation: the caller got a miss for the remote part.",
            ["op"],
            registry=r,
        )
        self.retain_blocks = Counter(
            "kvstore_retain_blocks",
            "Blocks named by Admin.Retain calls, by outcome: retained (newly or extended), or over_budget "
            "(manager.max_retained_fraction of the node was retained already).",
            ["result"],
            registry=r,
        )
        self.prefetch_blocks = Counter(
            "kvstore_prefetch_blocks",
            "Blocks named by Admin.Prefetch calls, by outcome: host (in the host tier already), promoted (brought up from "
            "NVMe), fetched (from the source peer), missed (none of these).",
            ["result"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "kvstore_event_loop_lag_seconds",
            "How late the daemon's event loop ran a timer (sampled every server.loop_lag_interval_ms): "
            "the longest any request waits for the loop.",
            registry=r,
            buckets=(1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 10e-3, 15e-3, 20e-3, 30e-3, 50e-3, 75e-3, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
        )
        self._snapshot = _Snapshot()
        r.register(self._snapshot)

    # -- request path ---------------------------------------------------------------------
    def lookup(self, digest: bytes, ranks: bytes, num_asked: int, block_size: int) -> None:
        """A lookup's hits by tier: ``ranks`` holds the tier rank of each block found."""
        counts = self._requests.lookups
        # a scan in C per tier; a Counter costs 10x on 512 blocks. The misses count as one more "tier"
        tallies = [(rank, ranks.count(rank)) for rank in _RANKS]
        tallies.append((_MISS, num_asked - len(ranks)))
        for rank, count in tallies:
            if count:
                key = (digest, rank)
                found = counts.get(key)
                if found is None:
                    found = counts[key] = [0, 0]
                found[0] += count
                found[1] += count * block_size

    def loaded(self, digest: bytes, ranks: bytes, block_bytes: int) -> None:
        """Blocks served to a reader: ``ranks`` holds the rank of the tier each was found in."""
        for rank in _RANKS:
            count = ranks.count(rank)
            if count:
                tier = TIER_BY_RANK[rank].value
                self.loaded_blocks.labels(digest.hex(), tier).inc(count)
                self.read_bytes.labels(tier).inc(count * block_bytes)

    def stored(self, num_blocks: int, num_bytes: int) -> None:
        self.stored_blocks.inc(num_blocks)
        self.written_bytes.inc(num_bytes)

    def transferred(self, direction: str, op: str, num_blocks: int, num_bytes: int) -> None:
        if num_blocks:
            self.transfer_blocks.labels(direction, op).inc(num_blocks)
            self.transfer_bytes.labels(direction).inc(num_bytes)

    def refused_peer(self, reason: str) -> None:
        self.peer_refused.labels(reason).inc()

    def dropped(self, reason: str, num_blocks: int = 1) -> None:
        self.transfer_dropped.labels(reason).inc(num_blocks)

    def index_timed_out(self, op: str) -> None:
        self.index_timeouts.labels(op).inc()

    def evicted_explicitly(self, num_blocks: int) -> None:
        self.explicit_evictions.inc(num_blocks)

    def retain_requested(self, num_retained: int, num_over_budget: int) -> None:
        self.retain_blocks.labels("retained").inc(num_retained)
        if num_over_budget:
            self.retain_blocks.labels("over_budget").inc(num_over_budget)

    def prefetched(self, result: str, num_blocks: int) -> None:
        """Blocks a prefetch found or brought: ``result`` is host, promoted, fetched or missed."""
        if num_blocks > 0:
            self.prefetch_blocks.labels(result).inc(num_blocks)

    def observe(self, rpc: str, seconds: float) -> None:
        """A request of ``rpc`` took ``seconds`` to serve."""
        _observe(self._requests.latencies, rpc, _LATENCY_BOUNDS, seconds)

    def gc_pause(self, generation: int, seconds: float) -> None:
        """A garbage collection of ``generation`` stopped the daemon for ``seconds``. Called
        from inside the collector, so it takes no lock (a lock held by the code the
        collection interrupted would never be given back)."""
        _observe(self._requests.gc_pauses, str(generation), _GC_BOUNDS, seconds)

    def polled(self, seconds: float) -> None:
        """The loop polled for the next engine request for ``seconds`` (server.spin_us)."""
        self._requests.polling_s += seconds

    def poll_skipped(self) -> None:
        """The loop slept at once after an answer: no CPU of the host was idle (server.spin_us)."""
        self._requests.polls_skipped += 1

    def gc_frozen(self, count: int) -> None:
        self._requests.gc_frozen = count

    # -- housekeeping -------------------------------------------------------------------
    def refresh(self, manager: TierManager) -> None:
        self._snapshot.update(manager)


def _observe(histograms: dict[str, list], label: str, bounds: tuple[float, ...], seconds: float) -> None:
    counts = histograms.get(label)
    if counts is None:
        counts = histograms[label] = [0] * (len(bounds) + 1) + [0.0]  # per bucket, then the sum
    counts[bisect.bisect_left(bounds, seconds)] += 1
    counts[-1] += seconds


def _histogram(family: HistogramMetricFamily, histograms: dict[str, list], bounds: tuple[float, ...]) -> HistogramMetricFamily:
    for label, counts in [(label, list(counts)) for label, counts in list(histograms.items())]:
        cumulative, buckets = 0, []
        for bound, count in zip((*bounds, float("inf")), counts):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        family.add_metric([label], buckets, counts[-1])
    return family


class _RequestPath(Collector):
    """Lookup hits and misses and request latencies, written by the event loop as requests
    are served and read whole at scrape time (``dict`` and ``list`` copies happen in one
    step under the GIL; a scrape sees each figure as it was at some moment)."""

    def __init__(self) -> None:
        self.lookups: dict[tuple[bytes, int], list[int]] = {}  # (namespace, tier rank or _MISS) -> [blocks, tokens]
        self.latencies: dict[str, list] = {}  # rpc -> [count per bucket…, +Inf bucket, sum of seconds]
        self.gc_pauses: dict[str, list] = {}  # generation -> the same
        self.gc_frozen = 0
        self.polling_s = 0.0  # the loop's polling for engines' next requests
        self.polls_skipped = 0  # answers after which it did not poll: the host had no idle CPU

    def collect(self) -> Iterator:
        blocks = CounterMetricFamily(
            "kvstore_lookup_blocks", "Blocks asked for in lookups, by result and tier.", labels=["namespace", "result", "tier"]
        )
        tokens = CounterMetricFamily(
            "kvstore_lookup_tokens", "Tokens asked for in lookups, by result and tier.", labels=["namespace", "result", "tier"]
        )
        for (digest, rank), (num_blocks, num_tokens) in [(key, list(value)) for key, value in list(self.lookups.items())]:
            labels = [digest.hex(), "miss", "none"] if rank == _MISS else [digest.hex(), "hit", TIER_BY_RANK[rank].value]
            blocks.add_metric(labels, num_blocks)
            tokens.add_metric(labels, num_tokens)
        yield blocks
        yield tokens
        seconds = HistogramMetricFamily("kvstore_request_seconds", "Time to serve a request, by operation.", labels=["rpc"])
        yield _histogram(seconds, self.latencies, _LATENCY_BOUNDS)
        pauses = HistogramMetricFamily(
            "kvstore_gc_pause_seconds", "How long each garbage collection stopped the daemon, by generation.", labels=["generation"]
        )
        yield _histogram(pauses, self.gc_pauses, _GC_BOUNDS)
        yield CounterMetricFamily(
            "kvstore_loop_polling_seconds",
            "Time the daemon's event loop spent polling its sockets for an engine's next request after an answer, "
            "instead of sleeping (server.spin_us).",
            value=self.polling_s,
        )
        yield CounterMetricFamily(
            "kvstore_loop_polls_skipped",
            "Answers after which the daemon's event loop slept at once instead of polling for the engine's next request, "
            "because no CPU of the host was idle (a poll would take one from the engines' compute threads).",
            value=self.polls_skipped,
        )
        yield GaugeMetricFamily(
            "kvstore_gc_frozen_objects",
            "Objects moved out of the collector's reach (kvstore/gcpolicy.py), as counted at the last whole-heap collection.",
            value=self.gc_frozen,
        )


class _Snapshot(Collector):
    def __init__(self) -> None:
        self._tiers: list = []
        self._counters: dict[str, int] = {}
        self._gauges: dict[str, int] = {}

    def update(self, manager: TierManager) -> None:
        # each attribute is replaced whole: a scrape in another thread sees old or new
        self._tiers = manager.tier_stats()
        self._counters = dict(manager.counters)
        self._gauges = {
            "leases": manager.num_leases,
            "reservations": manager.num_reservations,
            "lookup_holds": manager.num_holds,
            "blocks": len(manager.catalogue),
            "retained_blocks": manager.num_retained,
            "retained_bytes": manager.retained_bytes,
        }

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
            ("lookup_holds", "Lookups whose blocks are held from eviction until their engine loads them."),
            ("blocks", "Blocks cached on this node."),
            ("retained_blocks", "Block keys retained for agent sessions between turns (Admin.Retain), cached here or awaited."),
            ("retained_bytes", "Bytes the retained keys count against manager.max_retained_fraction of the node."),
        ):
            yield GaugeMetricFamily(f"kvstore_{name}", help_text, value=self._gauges.get(name, 0))
        yield CounterMetricFamily(
            "kvstore_retained_dropped_blocks",
            "Retained blocks dropped for room while their retention held: the lowest tier had nothing else left to evict.",
            value=self._counters.get("retained_dropped", 0),
        )
        events = CounterMetricFamily(
            "kvstore_tier_events", "Tier manager events: evictions by reason, moves, corrupt reads, failures.", labels=["event", "detail"]
        )
        for name, value in sorted(self._counters.items()):
            match = _COUNTER_NAME.match(name)
            if match:
                events.add_metric([match.group(1), match.group(2)], value)
        yield events
