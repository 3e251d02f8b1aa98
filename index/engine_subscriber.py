"""Subscribe to one vLLM engine's KV events over ZMQ and keep its GPU blocks in the index.

The wire format and the translation to kvstore's keys are in ``index/engine_events.py``;
this module is the I/O around them: the SUB socket, the optional replay socket for gaps,
the engine's lease, and re-sending its blocks after the index lost track of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.events import BlockEvent
from kvstore.index.base import Index, NodeInfo
from kvstore.index.engine_events import EngineEventTranslator
from kvstore.namespace import Namespace

__all__ = ["EngineSubscription", "EngineEventSubscriber"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSubscription:
    """One engine's KV event stream (one per data-parallel rank: vLLM offsets the port by it)."""

    endpoint: str  # where the engine's PUB socket is, e.g. tcp://10.0.0.7:5557
    engine_node_id: str  # the engine as the index names it to routers
    topic: str = ""  # vLLM's kv_events_config.topic
    replay_endpoint: str = ""  # vLLM's kv_events_config.replay_endpoint, as reachable from here
    lease_ttl_s: float = 10.0
    heartbeat_interval_s: float = 3.0
    replay_timeout_s: float = 2.0  # the longest wait for the next replayed batch
    max_message_bytes: int = 64 << 20  # a larger frame makes ZMQ drop the connection (then reconnect)
    max_mapped_blocks: int = 4_000_000
    max_batch_events: int = 10_000  # per publish when re-sending the whole catalogue

    def __post_init__(self) -> None:
        if not self.endpoint or not self.engine_node_id:
            raise InvalidArgument("an engine subscription needs the engine's KV events endpoint and a node id.")
        if self.lease_ttl_s <= 0 or not 0 < self.heartbeat_interval_s < self.lease_ttl_s:
            raise InvalidArgument(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be positive and shorter than lease_ttl_s ({self.lease_ttl_s})."
            )
        if self.replay_timeout_s <= 0 or self.max_message_bytes <= 0 or self.max_mapped_blocks <= 0 or self.max_batch_events <= 0:
            raise InvalidArgument("replay_timeout_s, max_message_bytes, max_mapped_blocks and max_batch_events must be positive.")


class EngineEventSubscriber:
    """Subscribes to one engine's KV events and keeps its GPU blocks current in the index.

    It registers the engine as a node of kind ``engine`` and heartbeats its lease; each
    received batch becomes one ``publish``. Batches are numbered: a gap is counted and, with
    a replay endpoint, filled from the engine's replay buffer; a number that goes backwards
    means the engine restarted with an empty cache. When the index may have lost track (at
    start, after a failed call, after a lease that had expired) the whole mapping is
    re-published. ``stop()`` ends ``run()``, which then leaves the index: nobody would keep
    the engine's entries current any more. ``connected`` follows the socket's connection to
    the engine (a ZMQ socket monitor): PUB/SUB itself says nothing while an engine is idle.

    Owner: the event loop that runs ``run()``; every field is touched only there.
    """

    def __init__(
        self,
        subscription: EngineSubscription,
        namespace: Namespace,
        index: Index,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.subscription = subscription
        self.index = index
        self.node = NodeInfo(subscription.engine_node_id, kind="engine")
        self.translator = EngineEventTranslator(namespace, subscription.max_mapped_blocks)
        self._context = context  # None: run() makes its own and terminates it
        self._live_context: zmq.asyncio.Context | None = None
        self._clock = clock
        self._next_seq: int | None = None
        self._next_heartbeat = 0.0
        self._needs_resync = True
        self._stopping = False
        self.connected = False
        self.last_message_at: float | None = None  # by ``clock``
        self.num_messages = 0
        self.num_messages_malformed = 0
        self.num_gaps = 0
        self.num_batches_lost = 0
        self.num_batches_replayed = 0
        self.num_restarts = 0
        self.num_resyncs = 0
        self.num_index_failures = 0

    @property
    def in_sync(self) -> bool:
        return not self._needs_resync

    @property
    def next_seq(self) -> int | None:
        """The number of the batch expected next: every earlier one is applied and published."""
        return self._next_seq

    def counters(self) -> dict[str, int]:
        own = {name: value for name, value in vars(self).items() if name.startswith("num_")}
        return {**self.translator.counters(), **own}

    def stop(self) -> None:
        self._stopping = True

    async def run(self) -> None:
        context = self._live_context = self._context or zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, self.subscription.max_message_bytes)
            sub.setsockopt(zmq.SUBSCRIBE, self.subscription.topic.encode())
            try:
                sub.connect(self.subscription.endpoint)
            except zmq.ZMQError as exc:
                raise InvalidArgument(f"{self.subscription.endpoint!r} is not a ZMQ endpoint vLLM publishes KV events on: {exc}") from exc
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not self._stopping:
                await self._keep_index_current()
                wait_s = min(0.1, max(0.0, self._next_heartbeat - self._clock()))
                ready = dict(await poller.poll(int(wait_s * 1000)))
                if monitor in ready:
                    self.connected = parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_CONNECTED
                if sub in ready:
                    await self._receive(await sub.recv_multipart())
        finally:
            self.connected = False
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if self._context is None:
                context.term()
            await self._leave()

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_messages_malformed += 1
            return
        self.num_messages += 1
        self.last_message_at = self._clock()
        seq = int.from_bytes(frames[1], "big")
        if self._next_seq is not None and seq < self._next_seq:
            # vLLM numbers a publisher's batches from 0: going back means the engine restarted
            self.num_restarts += 1
            logger.info("engine %s restarted (batch %d after %d): forgetting its blocks", self.node.node_id, seq, self._next_seq - 1)
            await self._publish([self.translator.clear()])
            self._next_seq = None
        if self.subscription.replay_endpoint and seq > (self._next_seq or 0):
            await self._replay(self._next_seq or 0, seq)
        if self._next_seq is not None and seq > self._next_seq:
            self.num_gaps += 1
            self.num_batches_lost += seq - self._next_seq
            logger.warning(
                "lost %d KV event batches of engine %s; blocks chained to them stay unindexed", seq - self._next_seq, self.node.node_id
            )
        await self._apply(seq, frames[2])

    async def _apply(self, seq: int, payload: bytes) -> None:
        events = self.translator.translate_payload(payload)
        if events:
            await self._publish(events)
        self._next_seq = seq + 1

    async def _replay(self, start: int, stop: int) -> None:
        """Apply batches ``[start, stop)`` from the engine's replay buffer, as far as it has them."""
        assert self._live_context is not None  # only run() receives
        dealer = self._live_context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.subscription.max_message_bytes)
            dealer.connect(self.subscription.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while await dealer.poll(int(self.subscription.replay_timeout_s * 1000), zmq.POLLIN):
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.num_messages_malformed += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0 or seq >= stop:  # -1 ends the replay; the rest arrives live
                    return
                if self._next_seq is None or seq >= self._next_seq:
                    if self._next_seq is not None and seq > self._next_seq:
                        self.num_batches_lost += seq - self._next_seq  # the buffer no longer had them
                    await self._apply(seq, frames[2])
                    self.num_batches_replayed += 1
            logger.warning("engine %s stopped replaying KV event batches (from %d) before their end", self.node.node_id, start)
        except zmq.ZMQError as exc:
            logger.warning(
                "could not replay KV event batches of engine %s from %s: %s", self.node.node_id, self.subscription.replay_endpoint, exc
            )
        finally:
            dealer.close(linger=0)

    async def _keep_index_current(self) -> None:
        if self._clock() < self._next_heartbeat:
            return
        try:
            renewed = await self.index.register(self.node, self.subscription.lease_ttl_s)
            self._next_heartbeat = self._clock() + self.subscription.heartbeat_interval_s
            if renewed is False:  # a backend that can tell: the lease had expired, blocks gone
                self._needs_resync = True
            if self._needs_resync:
                events = self.translator.catalogue()
                step = self.subscription.max_batch_events
                for start in range(0, len(events), step):
                    await self.index.publish(self.node.node_id, events[start : start + step])
                self._needs_resync = False
                self.num_resyncs += 1
        except KVStoreError as exc:
            self._index_failed(exc)

    async def _publish(self, events: list[BlockEvent]) -> None:
        if self._needs_resync:
            return  # the next resync re-sends the whole mapping, these events included
        try:
            await self.index.publish(self.node.node_id, events)
        except KVStoreError as exc:
            self._index_failed(exc)

    def _index_failed(self, exc: KVStoreError) -> None:
        self.num_index_failures += 1
        if not self._needs_resync:
            logger.warning("block-location index unreachable; engine %s's blocks are re-sent once it answers: %s", self.node.node_id, exc)
        self._needs_resync = True
        # retry within a second but not in a tight loop
        self._next_heartbeat = self._clock() + min(1.0, self.subscription.heartbeat_interval_s)

    async def _leave(self) -> None:
        try:
            await self.index.leave(self.node.node_id)
        except KVStoreError as exc:
            logger.warning("engine %s could not leave the block-location index (its lease will expire): %s", self.node.node_id, exc)
