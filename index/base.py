"""The `Index` interface: which node holds which blocks, for routers.

The index is advisory (DESIGN.md §6): the tiers are the truth, an answer may be stale,
and the only cost of a stale answer is a recompute. Nodes hold leases: a node that stops
heartbeating disappears from every answer once its lease expires, without anyone
deleting its blocks one by one.

    Index
    ├── EmbeddedIndex  (index/embedded.py)  in-process; the default for one host
    ├── RedisIndex     (index/redis.py)     Redis / Redis Cluster, for a fleet
    └── DaemonsIndex   (index/daemons.py)   the router's on one host: asks each
                                            replica's daemon (its EmbeddedIndex) over gRPC

    SessionStore: session → node affinities for routing, kept in the same backend so
    that every router replica agrees.

Every method is a coroutine: the daemon and routers call them from their event loop, and
the Redis backend does network I/O. Implementations translate their own errors into
``kvstore.errors.IndexUnavailable`` (backend unreachable) or ``InvalidArgument``.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.events import BlockEvent
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.tier_kind import TierKind

MAX_CHAIN_BLOCKS = 1 << 18  # the longest chain an index matches: a 4M-token prompt at 16 tokens per block

__all__ = ["MAX_CHAIN_BLOCKS", "NodeInfo", "NodeMatch", "SessionAffinity", "Index", "SessionStore"]


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    grpc_address: str = ""  # where its gRPC API answers
    transport_address: str = ""  # where peers fetch blocks from it (the transport issue)
    kind: str = "kvstore"  # "kvstore" for a daemon, "engine" for an engine's own GPU cache


@dataclass(frozen=True, slots=True)
class NodeMatch:
    """The longest prefix of a chain that one node holds, in every tier it holds it."""

    node_id: str
    tiers: tuple[TierKind, ...]  # tier of each matched block, in chain order

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    def tier_counts(self) -> dict[TierKind, int]:
        counts: dict[TierKind, int] = {}
        for tier in self.tiers:
            counts[tier] = counts.get(tier, 0) + 1
        return counts


@dataclass(frozen=True, slots=True)
class SessionAffinity:
    session_id: str
    node_id: str
    num_moves: int = 0


class Index(abc.ABC):
    @abc.abstractmethod
    async def register(self, node: NodeInfo, lease_ttl_s: float) -> bool:
        """Announce a node, or refresh its lease (a heartbeat). True when a current lease
        was renewed; False when the node starts empty in the index (new, back after its
        lease expired, or the backend lost its data): it must publish its catalogue."""

    @abc.abstractmethod
    async def leave(self, node_id: str) -> None:
        """The node is going away: drop it and its blocks from every answer now."""

    @abc.abstractmethod
    async def publish(self, node_id: str, events: Sequence[BlockEvent]) -> None:
        """Apply a batch of the node's block events, in order."""

    @abc.abstractmethod
    async def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        """For each live node (of ``node_ids``, when given) holding at least the first
        block: the longest prefix of ``hashes`` it holds. Best match first."""

    async def match_many(self, namespace: bytes, chains: Sequence[bytes], node_ids: Collection[str] | None = None) -> list[list[NodeMatch]]:
        """`match` of each chain, given packed: its block keys joined (``b"".join(hashes)``,
        HASH_BYTES each); answers in the order of ``chains``. A networked backend answers
        several chains in one round trip."""
        answers = []
        for chain in chains:
            if len(chain) % HASH_BYTES:
                raise InvalidArgument(f"a packed chain is a whole number of {HASH_BYTES}-byte block keys, got {len(chain)} bytes.")
            answers.append(await self.match(namespace, [chain[i : i + HASH_BYTES] for i in range(0, len(chain), HASH_BYTES)], node_ids))
        return answers

    @abc.abstractmethod
    async def nodes(self) -> list[NodeInfo]:
        """The nodes whose lease is current."""

    async def close(self) -> None:  # noqa: B027 (optional: the embedded index holds nothing)
        """Release connections; the default holds none."""


class SessionStore(abc.ABC):
    @abc.abstractmethod
    async def get(self, session_id: str) -> SessionAffinity | None:
        """The node a session sticks to, if its affinity has not expired."""

    @abc.abstractmethod
    async def put(self, session_id: str, node_id: str, ttl_s: float, moved_from: str | None = None, reason: str = "") -> SessionAffinity:
        """Stick a session to a node (refreshing its TTL); a change of node is recorded as
        a move with its reason."""

    @abc.abstractmethod
    async def reassign(self, from_node: str, to_node: str, reason: str) -> int:
        """Point every session that sticks to ``from_node`` at ``to_node`` (a drain);
        returns how many moved."""

    @abc.abstractmethod
    async def moves(self, limit: int = 100) -> list[dict]:
        """The most recent session moves, newest first: session, from, to, reason, time."""
