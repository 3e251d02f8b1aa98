"""Block events: every change of what a node holds, in the order it happened.

The tier manager appends an event for each state change; the index publisher drains
them in batches. The queue is bounded: if nobody drains it (index down), the oldest
events are dropped and ``needs_resync`` is set, telling the publisher to re-send the
whole catalogue instead of trusting the stream.

Owner: the tier manager's thread (the daemon's event loop); not thread-safe.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass

from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind

__all__ = ["RemovalReason", "BlockStored", "BlockRemoved", "BlockMoved", "AllBlocksCleared", "BlockEvent", "EventQueue"]


class RemovalReason(str, enum.Enum):
    CAPACITY = "capacity"  # evicted to make room
    EXPLICIT = "explicit"  # an operator or API call evicted it
    CORRUPT = "corrupt"  # failed verification on read
    TIER_FAILED = "tier_failed"  # its tier became unusable (I/O error)
    SHUTDOWN = "shutdown"  # a memory tier closed with the daemon


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one chain became resident: ``block_hashes[0]``'s parent is
    ``parent_hash`` (None for a chain's first block), each next block's parent is the one
    before it — the shape of vLLM's own ``BlockStored`` event."""

    namespace: bytes
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    tier: TierKind
    nbytes: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    namespace: bytes
    block_hashes: tuple[BlockHash, ...]
    tier: TierKind
    reason: RemovalReason


@dataclass(frozen=True, slots=True)
class BlockMoved:
    namespace: bytes
    block_hashes: tuple[BlockHash, ...]
    src: TierKind
    dst: TierKind


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block the publishing node held is gone (an engine reset its prefix cache, or
    a node re-publishes its whole catalogue after the index lost track of it)."""


BlockEvent = BlockStored | BlockRemoved | BlockMoved | AllBlocksCleared


class EventQueue:
    def __init__(self, max_events: int = 1_000_000) -> None:
        self._events: collections.deque[BlockEvent] = collections.deque()
        self.max_events = max_events
        self.num_dropped = 0
        self.needs_resync = False

    def __len__(self) -> int:
        return len(self._events)

    def append(self, event: BlockEvent) -> None:
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.num_dropped += 1
            self.needs_resync = True
        self._events.append(event)

    def drain(self, max_events: int | None = None) -> list[BlockEvent]:
        """Remove and return up to ``max_events`` events, oldest first."""
        count = len(self._events) if max_events is None else min(max_events, len(self._events))
        return [self._events.popleft() for _ in range(count)]

    def resynced(self) -> None:
        """The consumer re-sent the whole catalogue; the stream can be trusted again."""
        self.needs_resync = False
