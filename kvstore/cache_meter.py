"""This daemon's unique cache value (kvstore/cache_value.py), measured against the
block-location index: for ``Admin.CacheValue`` on demand, and every
``server.cache_value_interval_s`` for the metric an autoscaler reads.

A measurement takes a snapshot of the tier manager's catalogue (every tier, NVMe
included) on the event loop, its owner; cuts it into chains in a worker thread (pure work
on the snapshot: 100,000 blocks take a fifth of a second, which the loop does not wait
for); and asks the index, in batches, how far the other live daemons hold each chain.
With an embedded index a daemon sees no other daemon, and every block it holds counts as
unique: the figure means something in a fleet whose daemons share a (Redis) index.

Metrics (absent until the first measurement, and after one that failed — unknown, not zero):

    kvstore_unique_cache_value_bytes   the bytes no other daemon holds, weighted by recent use
    kvstore_unique_cache_bytes         the same blocks' bytes, unweighted

Owner: the daemon's event loop runs `measure` and `run`, and replaces ``latest`` whole;
the metrics exporter's thread only reads ``latest`` (one attribute read).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.cache_value import CacheValue, check_half_life, node_value, unique_keys
from kvstore.chains import Chain, drain_plan
from kvstore.errors import KVStoreError
from kvstore.index.base import MAX_CHAIN_BLOCKS, Index

if TYPE_CHECKING:
    from kvstore.tiers.manager import TierManager

__all__ = ["CacheValueMeter", "measure"]

logger = logging.getLogger(__name__)

# hashes per call to the index: one Redis pipeline, or one stretch of an embedded index's
# matching between two chances for the loop to serve requests
BATCH_HASHES = 1 << 16


async def measure(manager: TierManager, index: Index, node_id: str, half_life_s: float) -> CacheValue:
    """``node_id``'s figure now. Raises IndexUnavailable when the index does not answer."""
    half_life_s = check_half_life(half_life_s)
    blocks = list(manager.blocks())
    now = time.monotonic()  # the tier manager's clock
    peers = sorted(n.node_id for n in await index.nodes() if n.kind == "kvstore" and n.node_id != node_id)
    chains = await asyncio.to_thread(drain_plan, blocks)
    held = await _held_lengths(index, chains, peers) if peers else [0] * len(chains)

    def figure() -> CacheValue:
        return node_value(node_id, blocks, unique_keys(chains, held), now, half_life_s, len(peers))

    return await asyncio.to_thread(figure)


async def _held_lengths(index: Index, chains: list[Chain], peers: list[str]) -> list[int]:
    """For each chain, the longest run from its first block that one of ``peers`` holds. A
    chain longer than the index matches (MAX_CHAIN_BLOCKS) is asked by its start: its tail
    counts as held by nobody."""
    by_namespace: dict[bytes, list[int]] = {}
    for i, chain in enumerate(chains):
        by_namespace.setdefault(chain.namespace, []).append(i)
    held = [0] * len(chains)
    for namespace, positions in by_namespace.items():
        start = 0
        while start < len(positions):
            batch, num_hashes = [], 0
            while start < len(positions) and (not batch or num_hashes + len(chains[positions[start]].hashes) <= BATCH_HASHES):
                batch.append(positions[start])
                num_hashes += len(chains[positions[start]].hashes)
                start += 1
            packed = [b"".join(chains[i].hashes[:MAX_CHAIN_BLOCKS]) for i in batch]
            answers = await index.match_many(namespace, packed, peers)
            for i, matches in zip(batch, answers):
                held[i] = max((m.num_blocks for m in matches), default=0)
            await asyncio.sleep(0)  # an embedded index matched without awaiting: let requests in
    return held


class CacheValueMeter(Collector):
    def __init__(self, manager: TierManager, index: Index, node_id: str, half_life_s: float, interval_s: float) -> None:
        self.manager = manager
        self.index = index
        self.node_id = node_id
        self.half_life_s = check_half_life(half_life_s)
        self.interval_s = interval_s
        self.latest: CacheValue | None = None
        self._failing = False  # the last measurement failed (logged once per streak)

    async def refresh(self) -> None:
        try:
            self.latest = await measure(self.manager, self.index, self.node_id, self.half_life_s)
        except KVStoreError as exc:  # the index does not answer: the figure is unknown until it does
            self.latest = None
            if not self._failing:
                logger.warning("measuring this node's unique cache value failed; its metric is absent until it works: %s", exc)
            self._failing = True
            return
        except Exception:  # a failed measurement must not stop the daemon
            self.latest = None
            logger.exception("measuring this node's unique cache value failed")
            return
        if self._failing:
            logger.info("measuring this node's unique cache value works again.")
        self._failing = False

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    def collect(self) -> Iterator:
        value = self.latest
        if value is None:
            return
        yield GaugeMetricFamily(
            "kvstore_unique_cache_value_bytes",
            "Bytes of blocks no other live daemon of the index holds, each weighted by 2^(-idle/half-life) "
            "(server.cache_value_half_life_s; pinned blocks whole): what the fleet loses with this node.",
            value=value.value_bytes,
        )
        yield GaugeMetricFamily(
            "kvstore_unique_cache_bytes", "Bytes of blocks no other live daemon of the index holds, unweighted.", value=value.unique_bytes
        )
