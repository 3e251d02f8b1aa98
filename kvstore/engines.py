"""The daemon's subscriptions to its engines' KV events: one subscriber per ``[[engines]]``
entry (kvstore/engines_config.py), so that each engine's GPU prefix cache is in the index.

An engine that is not up yet, or restarts, costs nothing here: ZMQ reconnects by itself
and the subscriber notices the restart from the batch numbers. A subscriber that fails
(anything but an index outage, which it rides out itself) is logged and started afresh
after ``retry_s``, with an empty mapping of the engine's blocks; the daemon never stops
for it. ``stop()`` ends every subscriber, each of which takes its engine out of the index.

Each subscription's state is reported three ways: ``status()`` (rows of figures), the
``engine_<name>_*`` counters of `kvstore status --json` / `kvstore stats`, and the
``kvstore_engine_*`` Prometheus families (a snapshot taken on the daemon's housekeeping
tick, read by the exporter's thread).

Owner: the daemon's event loop; only the collector's snapshot is read from another thread,
and it is replaced whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.engines_config import EngineConfig
from kvstore.index.base import Index
from kvstore.index.engine_subscriber import EngineEventSubscriber

__all__ = ["EngineSubscriptions", "EngineMetrics"]

logger = logging.getLogger("kvstore.engines")

# status() fields that are counters, and the subscriber's or translator's figure behind each
_COUNTED = {
    "messages": "num_messages",
    "batches": "num_batches",
    "gaps": "num_gaps",
    "batches_lost": "num_batches_lost",
    "restarts": "num_restarts",
    "resyncs": "num_resyncs",
    "index_failures": "num_index_failures",
}


class _Engine:
    """One configured engine: its current subscriber and the task that keeps one running."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.subscriber: EngineEventSubscriber | None = None
        self.task: asyncio.Task | None = None
        self.num_failures = 0
        self.carried: dict[str, int] = dict.fromkeys(_COUNTED, 0)  # counts of subscribers that failed


class EngineSubscriptions:
    def __init__(
        self, configs: Sequence[EngineConfig], index: Index, retry_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.configs = tuple(configs)
        self.index = index
        self.retry_s = retry_s
        self._clock = clock
        self._engines = [_Engine(config) for config in self.configs]
        self._stopping = asyncio.Event()

    def start(self) -> None:
        for engine in self._engines:
            engine.task = asyncio.create_task(self._keep_subscribed(engine), name=f"kv-events {engine.config.name}")
            subscription = engine.config.subscription
            logger.info(
                "subscribing to the KV events of engine %s at %s (indexed as %s)",
                engine.config.name,
                subscription.endpoint,
                subscription.engine_node_id,
            )

    async def stop(self) -> None:
        self._stopping.set()
        for engine in self._engines:
            if engine.subscriber is not None:
                engine.subscriber.stop()
        tasks = [engine.task for engine in self._engines if engine.task is not None]
        if tasks:
            # a subscriber ends within its poll interval, then leaves the index
            _done, pending = await asyncio.wait(tasks, timeout=5.0)
            for task in pending:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _keep_subscribed(self, engine: _Engine) -> None:
        while not self._stopping.is_set():
            subscriber = engine.subscriber = EngineEventSubscriber(engine.config.subscription, engine.config.namespace, self.index)
            try:
                await subscriber.run()
            except Exception:  # a failed subscription must not stop the daemon
                engine.num_failures += 1
                logger.exception(
                    "the KV event subscription of engine %s (%s) failed; starting it again in %.3g s",
                    engine.config.name,
                    engine.config.subscription.endpoint,
                    self.retry_s,
                )
            if self._stopping.is_set():
                return
            for name, value in _figures(subscriber).items():
                engine.carried[name] += value
            with contextlib.suppress(asyncio.TimeoutError):  # stop() cuts the wait short
                await asyncio.wait_for(self._stopping.wait(), self.retry_s)

    def status(self) -> list[dict]:
        """One row per engine, in configuration order."""
        rows = []
        now = self._clock()
        for engine in self._engines:
            subscriber = engine.subscriber
            figures = _figures(subscriber) if subscriber is not None else dict.fromkeys(_COUNTED, 0)
            last = subscriber.last_message_at if subscriber is not None else None
            rows.append(
                {
                    "name": engine.config.name,
                    "node_id": engine.config.subscription.engine_node_id,
                    "endpoint": engine.config.subscription.endpoint,
                    "running": engine.task is not None and not engine.task.done(),
                    "connected": subscriber is not None and subscriber.connected,
                    "in_sync": subscriber is not None and subscriber.in_sync,
                    "blocks": len(subscriber.translator) if subscriber is not None else 0,
                    "last_event_age_s": None if last is None else round(now - last, 3),
                    "failures": engine.num_failures,
                    **{name: value + engine.carried[name] for name, value in figures.items()},
                }
            )
        return rows

    def counters(self) -> dict[str, int]:
        """The status as ``engine_<name>_<figure>`` integers (ages in ms, -1: no event yet)."""
        counters: dict[str, int] = {}
        for row in self.status():
            prefix = f"engine_{row['name']}_"
            age = row["last_event_age_s"]
            counters[prefix + "last_event_age_ms"] = -1 if age is None else int(age * 1000)
            for name in ("running", "connected", "in_sync", "blocks", "failures", *_COUNTED):
                counters[prefix + name] = int(row[name])
        return counters


def _figures(subscriber: EngineEventSubscriber) -> dict[str, int]:
    counters = subscriber.counters()
    return {name: counters[source] for name, source in _COUNTED.items()}


class EngineMetrics(Collector):
    """``kvstore_engine_*``: each subscription's state as of the last ``update``."""

    def __init__(self) -> None:
        self._rows: list[dict] = []

    def update(self, engines: EngineSubscriptions) -> None:
        self._rows = engines.status()  # replaced whole: a scrape sees the old or the new list

    def collect(self) -> Iterator:
        connected = GaugeMetricFamily("kvstore_engine_connected", "1 while the engine's KV event socket is connected.", labels=["engine"])
        blocks = GaugeMetricFamily("kvstore_engine_blocks", "Blocks of the engine's GPU cache in the index.", labels=["engine"])
        age = GaugeMetricFamily(
            "kvstore_engine_last_event_age_seconds", "Seconds since the last KV event batch of the engine.", labels=["engine"]
        )
        counted = {
            name: CounterMetricFamily(f"kvstore_engine_{name}", f"The engine's KV event {name.replace('_', ' ')}.", labels=["engine"])
            for name in ("batches", "gaps", "batches_lost", "restarts", "failures")
        }
        for row in self._rows:
            labels = [row["node_id"]]
            connected.add_metric(labels, int(row["connected"]))
            blocks.add_metric(labels, row["blocks"])
            if row["last_event_age_s"] is not None:
                age.add_metric(labels, row["last_event_age_s"])
            for name, family in counted.items():
                family.add_metric(labels, row[name])
        yield from (connected, blocks, age, *counted.values())
