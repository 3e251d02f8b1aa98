"""Keeps the block-location index in step with this node.

The publisher registers the node and heartbeats its lease, drains the tier manager's
event queue into the index in batches, and re-sends the node's whole catalogue whenever
the index may have lost track of it: at start, after any failed call (the index was
unreachable: events were lost, or it restarted empty), after a heartbeat that found the
lease gone, and when the event queue overflowed. The node never waits for the index: if
it is down, engines are served from the local tiers meanwhile (DESIGN.md §6: the index is
advisory).

Owner: the daemon's event loop (it reads the tier manager, which lives there too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvstore.config import IndexConfig
from kvstore.errors import KVStoreError
from kvstore.events import AllBlocksCleared, BlockEvent, BlockStored
from kvstore.index.base import Index, NodeInfo
from kvstore.tiers.manager import TierManager

__all__ = ["IndexPublisher"]

logger = logging.getLogger(__name__)


class IndexPublisher:
    def __init__(
        self, index: Index, node: NodeInfo, manager: TierManager, config: IndexConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.index = index
        self.node = node
        self.manager = manager
        self.config = config
        self._clock = clock
        self._needs_resync = True
        self._next_heartbeat = 0.0
        self.num_published = 0
        self.num_resyncs = 0
        self.num_failures = 0

    @property
    def in_sync(self) -> bool:
        return not self._needs_resync

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.step()
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.publish_interval_s)
            except asyncio.TimeoutError:
                pass

    async def step(self) -> None:
        """One round: heartbeat when due, then resync or send pending events."""
        try:
            if self._clock() >= self._next_heartbeat:
                renewed = await self.index.register(self.node, self.config.lease_ttl_s)
                self._next_heartbeat = self._clock() + self.config.heartbeat_interval_s
                if not renewed:  # the index holds none of this node's blocks any more
                    self._needs_resync = True
            if self._needs_resync or self.manager.events.needs_resync:
                await self._resync()
            else:
                await self._send_pending()
        except KVStoreError as exc:
            self.num_failures += 1
            if not self._needs_resync:
                logger.warning("block-location index unreachable, serving local blocks meanwhile: %s", exc)
            self._needs_resync = True
            self._next_heartbeat = 0.0

    async def leave(self) -> None:
        try:
            await self.index.leave(self.node.node_id)
        except KVStoreError as exc:
            logger.warning("could not leave the block-location index (its lease will expire): %s", exc)

    async def _send_pending(self) -> None:
        while len(self.manager.events):
            batch = self.manager.events.drain(self.config.max_batch_events)
            try:
                await self.index.publish(self.node.node_id, batch)
            except KVStoreError:
                self._needs_resync = True  # the drained batch is lost: re-send everything
                raise
            self.num_published += len(batch)

    async def _resync(self) -> None:
        # events queued so far are covered by the snapshot taken below; the loop owns the
        # manager, so nothing changes between the drain and the snapshot
        self.manager.events.drain()
        events: list[BlockEvent] = [AllBlocksCleared(), *self.catalogue_events()]
        for start in range(0, len(events), self.config.max_batch_events):
            await self.index.publish(self.node.node_id, events[start : start + self.config.max_batch_events])
        self.manager.events.resynced()
        self._needs_resync = False
        self.num_resyncs += 1
        logger.info("published the whole catalogue (%d blocks) to the block-location index", len(events) - 1)

    def catalogue_events(self) -> list[BlockStored]:
        """One BlockStored per cached block, parents before children where both are cached."""
        blocks = sorted(self.manager.blocks(), key=lambda b: b.stored_at)
        return [BlockStored(b.namespace, (b.block_hash,), b.parent_hash, b.tier, b.nbytes) for b in blocks]
