"""What a daemon answers routers with: `Index.Match` and `Index.Route` over the fleet.

`match` asks the block-location index which nodes hold how much of a chain; `route`
weighs that against each candidate's load and the session's affinity with the pure
cost model of ``kvstore.index.scoring`` (the routing simulator drives the same code), and
records the session's choice in the index backend so that every router replica agrees.

Owner: the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvstore.config import RoutingConfig
from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash
from kvstore.index.base import Index, NodeMatch, SessionAffinity, SessionStore
from kvstore.index.scoring import AffinityPolicy, Candidate, CostModel, RouteDecision, replica_of, route, with_engine_caches
from kvstore.node import Node

__all__ = ["Lookup", "Router", "cost_model_for"]

MAX_CANDIDATES = 4096


def cost_model_for(config: RoutingConfig) -> CostModel:
    return CostModel(
        prefill_tokens_per_s=config.prefill_tokens_per_s,
        attention_context_tokens=config.attention_context_tokens,
        host_bytes_per_s=config.host_bytes_per_s,
        nvme_bytes_per_s=config.nvme_bytes_per_s,
        remote_bytes_per_s=config.remote_bytes_per_s,
        decode_s_per_request=config.decode_s_per_request,
        remote_fetch=config.remote_fetch,
    )


@dataclass(frozen=True, slots=True)
class Lookup:
    """The index's answer for one prompt: each replica's match, and the session's affinity."""

    matches: dict[str, NodeMatch]
    affinity: SessionAffinity | None


@dataclass(frozen=True, slots=True)
class _Chain:
    hashes: list[BlockHash]
    num_tokens: int
    block_size: int
    block_bytes: int


class Router:
    """``node`` resolves a namespace's block size for `route` and `match` by token ids; the
    HTTP router (kvstore/gateway) has none and calls `route_chain` with its own hashes."""

    def __init__(self, node: Node | None, index: Index, sessions: SessionStore, config: RoutingConfig) -> None:
        self.node = node
        self.index = index
        self.sessions = sessions
        self.config = config
        self.model = cost_model_for(config)
        self.policy = AffinityPolicy(margin_s=config.margin_s, margin_ratio=config.margin_ratio)

    async def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        if not hashes:
            raise InvalidArgument("the chain to match is empty: give at least one block hash, or a full block of token ids.")
        return await self.index.match(namespace, hashes, node_ids or None)

    async def route(self, namespace: bytes, token_ids: Sequence[int], session_id: str, candidates: Sequence[Candidate]) -> RouteDecision:
        if not candidates:
            raise InvalidArgument("Route needs at least one candidate node to choose from.")
        if len(candidates) > MAX_CANDIDATES:
            raise InvalidArgument(f"{len(candidates)} candidates exceed the limit of {MAX_CANDIDATES}.")
        if len({c.node_id for c in candidates}) != len(candidates):
            raise InvalidArgument("each candidate node may appear once.")
        chain = self._chain(namespace, token_ids)
        return await self.route_chain(
            namespace, chain.hashes, chain.num_tokens, chain.block_size, chain.block_bytes, session_id, candidates
        )

    async def route_chain(
        self,
        namespace: bytes,
        hashes: Sequence[BlockHash],
        num_tokens: int,
        block_size: int,
        block_bytes: int,
        session_id: str,
        candidates: Sequence[Candidate],
        note: str = "",
    ) -> RouteDecision:
        """`route` for a caller that hashed the prompt itself (the HTTP router knows the
        engines' namespace without a daemon of its own registering it): `look_up`, `decide`
        and `remember` in one."""
        lookup = await self.look_up(namespace, hashes, [c.node_id for c in candidates], session_id)
        decision = self.decide(lookup, candidates, num_tokens, block_size, block_bytes, session_id, note)
        await self.remember(session_id, decision)
        return decision

    async def look_up(self, namespace: bytes, hashes: Sequence[BlockHash], replica_ids: Sequence[str], session_id: str) -> Lookup:
        """What a decision needs from the index: which of ``replica_ids`` hold how much of
        the chain (their engines' GPU caches counted as theirs: index/scoring.with_engine_caches),
        and the session's affinity."""
        if hashes and session_id:  # two questions at once: the request waits for one round trip, not two
            answers = await asyncio.gather(
                self._matches(namespace, hashes, list(replica_ids)), self.sessions.get(session_id), return_exceptions=True
            )
            for answer in answers:  # either failing fails the lookup, the other's answer retrieved
                if isinstance(answer, BaseException):
                    raise answer
            matches, affinity = answers
        else:
            matches = await self._matches(namespace, hashes, list(replica_ids)) if hashes else {}
            affinity = await self.sessions.get(session_id) if session_id else None
        return Lookup(matches, affinity)

    def decide(
        self,
        lookup: Lookup,
        candidates: Sequence[Candidate],
        num_tokens: int,
        block_size: int,
        block_bytes: int,
        session_id: str,
        note: str = "",
    ) -> RouteDecision:
        """The choice among ``candidates`` given what the index said. Synchronous, so a
        caller that tracks load reads the candidates' load after the index's answer and
        adds the chosen request to it before anything else can decide: concurrent
        requests then each see the ones placed before them. A ``note`` (why the request is
        routed again, say) leads the decision's reason, as recorded with the session's move."""
        affinity = lookup.affinity
        decision = route(candidates, lookup.matches, num_tokens, block_size, block_bytes, self.model, affinity, self.policy, session_id)
        return dataclasses.replace(decision, reason=f"{note}; {decision.reason}") if note else decision

    async def remember(self, session_id: str, decision: RouteDecision) -> None:
        """The session sticks to the decision's node, in the index backend (router replicas agree)."""
        if session_id:
            await self.sessions.put(session_id, decision.node_id, self.config.session_ttl_s, decision.moved_from, decision.reason)

    async def _matches(self, namespace: bytes, hashes: Sequence[BlockHash], replica_ids: list[str]) -> dict[str, NodeMatch]:
        wanted = set(replica_ids)
        engines = [n.node_id for n in await self.index.nodes() if n.kind == "engine" and replica_of(n.node_id) in wanted]
        return with_engine_caches(await self.index.match(namespace, hashes, replica_ids + engines), wanted)

    def _chain(self, namespace: bytes, token_ids: Sequence[int]) -> _Chain:
        if self.node is None:
            raise InvalidArgument("this router was built without a node: give it block hashes (route_chain), not token ids.")
        known = self.node.namespace(namespace)  # token ids need the namespace's block size
        return _Chain(self.node.hashes_for_tokens(namespace, token_ids), len(token_ids), known.block_size, known.block_bytes)
