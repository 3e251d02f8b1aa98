"""Prefetch: bring a session's chain into the host tier ahead of its next turn.

The router asks the replica it picked for an agent session's next turn to prefetch the
session's chain while it forwards the request, so that the engine connector's lookup
finds the chain in shared memory: the blocks of the cached prefix that lie below the host
tier (demoted to NVMe while the session's tools ran) are promoted, and — where the session
moved and the router names the replica it came from — the blocks past that prefix are
fetched from that peer over the transport, as a remote fetch is (kvstore/transfers/).

``start`` answers at once with what it found and started; the work runs as a task of the
daemon's event loop, which ``close`` ends. A prefetch that fails (a peer gone, a block
that fails its checksum) is logged and leaves a shorter prefix: the engine recomputes
the rest, as after any miss.

Owner: the daemon's event loop; the tasks it starts are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import CapacityExhausted, InvalidArgument, KVStoreError
from kvstore.hashing import BlockHash
from kvstore.node import Node
from kvstore.steps import run_steps
from kvstore.tier_kind import TierKind
from kvstore.transfers.service import TransferService

__all__ = ["MAX_RUNNING", "PrefetchPlan", "Prefetcher"]

logger = logging.getLogger(__name__)

MAX_RUNNING = 64  # prefetches running at once; past it a prefetch is refused (the next turn's lookup decides)


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    """What a prefetch found, and started, when it was asked."""

    num_in_host: int  # blocks of the cached prefix in the host tier already
    num_promoting: int  # blocks of the cached prefix below it, being promoted
    num_missing: int  # blocks past the cached prefix
    num_fetching: int  # of those, asked of the source peer (0: none named, or it is not reachable)


class Prefetcher:
    def __init__(self, node: Node, transfers: TransferService | None) -> None:
        self.node = node
        self.transfers = transfers
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    async def start(self, digest: bytes, hashes: Sequence[BlockHash], source: str | None = None) -> PrefetchPlan:
        """Start bringing ``hashes`` (a chain, from its first block) of namespace ``digest``
        into the host tier, the blocks this node misses from ``source`` (a node id, found
        through the index, or a transport address) where one is named."""
        if len(self._tasks) >= MAX_RUNNING:
            raise CapacityExhausted(f"{MAX_RUNNING} prefetches are running on this node; this one is not started.")
        if source is not None and self.transfers is None:
            raise InvalidArgument('this daemon runs without a transport (transport.kind = "off"); it cannot fetch blocks from a peer.')
        node = self.node
        tiers = node.manager.lookup(digest, hashes)  # not node.lookup: a prefetch is no engine's hit or miss
        num_in_host = tiers.count(TierKind.HOST)
        num_missing = len(hashes) - len(tiers)
        address = None
        if source is not None and num_missing and source != node.node_id:
            address = await self._resolve(source)
        plan = PrefetchPlan(num_in_host, len(tiers) - num_in_host, num_missing, num_missing if address else 0)
        node.metrics.prefetched("host", num_in_host)
        if plan.num_promoting or plan.num_fetching:
            task = asyncio.get_running_loop().create_task(self._run(digest, list(hashes), plan, address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            node.metrics.prefetched("missed", num_missing)
        return plan

    async def close(self) -> None:
        """End the prefetches still running (at shutdown)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _resolve(self, source: str) -> str | None:
        assert self.transfers is not None
        try:
            return await self.transfers.resolve(source, op="prefetch")
        except KVStoreError as exc:  # the session's old replica may be gone: its blocks are a miss
            logger.info("prefetch: the blocks this node misses are not fetched from %s: %s", source, exc)
            return None

    async def _run(self, digest: bytes, hashes: list[BlockHash], plan: PrefetchPlan, address: str | None) -> None:
        node = self.node
        promoted = fetched = 0
        try:
            if plan.num_promoting:
                in_host = await run_steps(node.prefetch_steps(digest, hashes))
                promoted = max(0, in_host - plan.num_in_host)
            if address is not None:
                assert self.transfers is not None
                have = len(hashes) - plan.num_missing
                deadline_s = self.transfers.config.handoff_timeout_s
                fetched = max(0, await self.transfers.fetch_missing(digest, hashes, deadline_s, address) - have)
        except KVStoreError as exc:
            logger.info("prefetch of %d blocks ended early: %s", len(hashes), exc)
        except Exception:  # nobody awaits this task: say so here, and the daemon keeps serving
            logger.exception("prefetch of %d blocks failed", len(hashes))
        finally:
            node.metrics.prefetched("promoted", promoted)
            node.metrics.prefetched("fetched", fetched)
            node.metrics.prefetched("missed", plan.num_missing - fetched)
