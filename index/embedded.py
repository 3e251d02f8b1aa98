"""The embedded index: block locations in this process, for one host (DESIGN.md §11).

`BlockLocations` (index/locations.py) does the work; this adds leases. A node's lease
ends ``lease_ttl_s`` after its last `register`; from then on it is gone from `match` and
`nodes` and its slot is handed back in O(1) — its blocks are not deleted one by one, and
their memory comes back when the slot is scrubbed (on reuse, or `sweep`). Leases are
checked lazily, on every call, against the injected clock: nothing runs in the
background.

Events from a node without a current lease are refused with NotFound rather than
applied or used to register it: they are deltas against a catalogue the index has
forgotten (or never had), so applying them would show a partial node as if it were
whole. The publisher (kvstore/publisher.py) answers a failed publish by registering
again and re-sending its whole catalogue, which is exactly what is needed.

The methods are coroutines to fit the `Index` interface; nothing here awaits: every
call runs to completion on the caller's event loop.

Owner: the daemon's event loop; not thread-safe.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, NotFound
from kvstore.events import BlockEvent
from kvstore.hashing import BlockHash
from kvstore.index.base import Index, NodeInfo, NodeMatch
from kvstore.index.locations import BlockLocations

__all__ = ["EmbeddedIndex"]


@dataclass(slots=True)
class _Lease:
    node: NodeInfo
    expires_at: float


class EmbeddedIndex(Index):
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_nodes: int = 64) -> None:
        self.locations = BlockLocations(max_nodes)
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._next_expiry = math.inf  # no lease can have ended before this

    async def register(self, node: NodeInfo, lease_ttl_s: float) -> bool:
        """Announce a node or refresh its lease. Returns True when the node already held a
        current lease (its blocks are still known), False when it starts empty — new, or
        back after its lease expired — and must publish its whole catalogue."""
        if not isinstance(node.node_id, str) or not node.node_id:
            raise InvalidArgument("a node needs a non-empty node_id.")
        if not (isinstance(lease_ttl_s, (int, float)) and math.isfinite(lease_ttl_s) and lease_ttl_s > 0):
            raise InvalidArgument(f"lease_ttl_s must be a positive number of seconds, got {lease_ttl_s!r}.")
        now = self._expire()
        expires_at = now + lease_ttl_s
        lease = self._leases.get(node.node_id)
        if lease is not None:
            lease.node, lease.expires_at = node, expires_at  # addresses may change on restart
        else:
            self.locations.add_node(node.node_id)
            self._leases[node.node_id] = _Lease(node, expires_at)
        self._next_expiry = self._earliest_expiry()
        return lease is not None

    async def leave(self, node_id: str) -> None:
        if self._leases.pop(node_id, None) is not None:
            self.locations.remove_node(node_id)
            self._next_expiry = self._earliest_expiry()

    async def publish(self, node_id: str, events: Sequence[BlockEvent]) -> None:
        """Apply the node's events in order; a malformed batch changes nothing. Raises
        NotFound for a node without a current lease (see the module docstring)."""
        self._expire()
        if node_id not in self._leases:
            raise NotFound(f"node {node_id!r} holds no current lease in the index; register it and re-publish its whole catalogue.")
        self.locations.apply(node_id, events)

    async def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        self._expire()
        return self.locations.match(namespace, hashes, node_ids)

    async def nodes(self) -> list[NodeInfo]:
        self._expire()
        return [self._leases[node_id].node for node_id in sorted(self._leases)]

    def sweep(self) -> int:
        """Give back the memory of nodes that left or expired now rather than when their
        slots are reused; returns the rows freed. One pass over every row: call it from a
        periodic maintenance task, not per request."""
        self._expire()
        return self.locations.sweep()

    def memory_bytes(self) -> int:
        return self.locations.memory_bytes()

    def _expire(self) -> float:
        """Drop the nodes whose lease has ended; returns the time it checked against."""
        now = self._clock()
        if now >= self._next_expiry:
            for node_id in [node_id for node_id, lease in self._leases.items() if lease.expires_at <= now]:
                del self._leases[node_id]
                self.locations.remove_node(node_id)
            self._next_expiry = self._earliest_expiry()
        return now

    def _earliest_expiry(self) -> float:
        return min((lease.expires_at for lease in self._leases.values()), default=math.inf)
