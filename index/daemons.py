"""`DaemonsIndex`: the router's index on one host without Redis — it asks the daemons.

Each replica's daemon keeps its own embedded index (``index.backend = "embedded"``): its
blocks, and its engines' GPU-cache blocks where it subscribes to their KV events. For a
routing decision this index asks every candidate's daemon, concurrently, over the
daemon's gRPC ``Index.Match`` (and ``Index.Nodes`` for the engines and transport
addresses), each call under its own deadline. A daemon that does not answer in time,
refuses, or answers something doubtful (another node's blocks, counts that do not add
up, an unknown tier) holds nothing for that decision: a miss, never an error. One that
let its deadline pass is not asked again for ``RETRY_AFTER_S`` (a miss meanwhile, without
waiting), so a hung daemon costs one deadline per second, not one per request.

A daemon answers only for itself and its engines (``<engine>@<replica>``): matches it
reports for other nodes are dropped, so a daemon pointed at a shared index by mistake
cannot count twice. Match gives blocks per tier, not their order; a match's tiers are
rebuilt fastest first. Where an engine's GPU blocks lead the daemon's
(scoring.with_engine_caches), the daemon's fastest blocks are the ones set aside, so the
estimate of the rest is never cheaper than the truth.

Only the router reads it: `register`, `leave` and `publish` are refused (the daemons
publish to their own indexes). Owner: the router's event loop, which opens the gRPC
channels lazily, one per daemon address.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from kvstore.api.auth import bearer_metadata
from kvstore.api.convert import tier_from_proto
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument
from kvstore.events import BlockEvent
from kvstore.hashing import BlockHash
from kvstore.index.base import Index, NodeInfo, NodeMatch
from kvstore.index.scoring import replica_of
from kvstore.node import Limits
from kvstore.paths import generated_token, is_loopback
from kvstore.tier_kind import TierKind

__all__ = ["MAX_ASKED_BLOCKS", "RETRY_AFTER_S", "DaemonAddress", "DaemonCalls", "DaemonsIndex"]

logger = logging.getLogger("kvstore.router")

# a daemon refuses a longer chain (its Limits.max_blocks_per_request, by default): a
# longer one is asked by its start, whose match is the chain's up to that many blocks
MAX_ASKED_BLOCKS = Limits().max_blocks_per_request
RETRY_AFTER_S = 1.0  # a daemon that let its deadline pass is asked again after this long


@dataclass(frozen=True, slots=True)
class DaemonAddress:
    node_id: str  # the replica's node id: its daemon's server.node_id
    address: str  # host:port of the daemon's gRPC API
    # the daemon's server.auth_token; "": $KVSTORE_TOKEN, else (loopback only) the one a daemon of this user generated
    token: str = ""


class DaemonsIndex(Index):
    def __init__(
        self, daemons: Callable[[], Sequence[DaemonAddress]], timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``daemons`` gives the current replicas' daemons (it follows a reloaded replica
        list); ``timeout_s`` is the deadline of each call to one daemon."""
        self._daemons = daemons
        self.calls = DaemonCalls(timeout_s, clock)

    async def register(self, node: NodeInfo, lease_ttl_s: float) -> bool:
        raise InvalidArgument(_READ_ONLY)

    async def leave(self, node_id: str) -> None:
        raise InvalidArgument(_READ_ONLY)

    async def publish(self, node_id: str, events: Sequence[BlockEvent]) -> None:
        raise InvalidArgument(_READ_ONLY)

    async def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        wanted = None if node_ids is None else set(node_ids)
        asked = [d for d in await self._current() if wanted is None or d.node_id in wanted or _engines_wanted(d, wanted)]
        asked_hashes = list(hashes[:MAX_ASKED_BLOCKS])
        request = pb.MatchRequest(namespace_id=namespace, block_hashes=pb.BlockHashes(hashes=asked_hashes))
        answers = await asyncio.gather(*(self._match_one(d, request, len(asked_hashes)) for d in asked))
        matches = [m for answer in answers for m in answer if wanted is None or m.node_id in wanted]
        matches.sort(key=lambda m: (-m.num_blocks, m.node_id))
        return matches

    async def nodes(self) -> list[NodeInfo]:
        answers = await asyncio.gather(*(self._nodes_one(d) for d in await self._current()))
        return sorted((n for answer in answers for n in answer), key=lambda n: n.node_id)

    async def close(self) -> None:
        await self.calls.close()

    async def _match_one(self, daemon: DaemonAddress, request: pb.MatchRequest, num_hashes: int) -> list[NodeMatch]:
        response = await self.calls.call(daemon, "Index", "Match", request)
        if response is None:
            return []
        matches = []
        for answer in response.nodes:
            if not _belongs(daemon, answer.node_id):
                continue
            try:
                tiers = _tiers(answer, num_hashes)
            except InvalidArgument as exc:
                logger.warning("kvstore router: %s's daemon at %s answered a doubtful match: %s", daemon.node_id, daemon.address, exc)
                return []
            if tiers:
                matches.append(NodeMatch(answer.node_id, tiers))
        return matches

    async def _nodes_one(self, daemon: DaemonAddress) -> list[NodeInfo]:
        response = await self.calls.call(daemon, "Index", "Nodes", pb.NodesRequest())
        if response is None:
            return []
        return [
            NodeInfo(n.node_id, n.grpc_address, n.transport_address, n.kind or "kvstore")
            for n in response.nodes
            if _belongs(daemon, n.node_id)
        ]

    async def _current(self) -> list[DaemonAddress]:
        """The daemons listed now; channels to addresses no longer listed are closed."""
        daemons = list(self._daemons())
        await self.calls.keep({d.address for d in daemons})
        return daemons


class DaemonCalls:
    """Calls to daemons' gRPC APIs, each under its own deadline: one channel per address,
    opened lazily; the bearer token a daemon takes (its own, else ``$KVSTORE_TOKEN``, else
    — on loopback only — the one a daemon of this user generated); a daemon that let its
    deadline pass is not asked again for ``RETRY_AFTER_S``; a daemon that stops answering
    is logged once, and once when it answers again."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise InvalidArgument(f"the deadline of a call to a daemon must be positive, got {timeout_s}.")
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._silent: set[str] = set()  # node ids whose daemon's last call failed (logged once)
        self._clock = clock
        self._asked_after: dict[str, float] = {}  # node id -> when its daemon, past its deadline, is asked again
        self._local_token: str | None = None  # read once; again after a daemon refuses it (a daemon may write it later)

    async def call(self, daemon: DaemonAddress, service: str, method: str, request):
        """The daemon's answer to ``service.method`` (``Index``, ``Admin``), or None when it
        gives none within the deadline, refuses, or has never seen the namespace."""
        if self._clock() < self._asked_after.get(daemon.node_id, 0.0):
            return None
        stub = _STUBS[service](self._channel(daemon.address))
        token = daemon.token or os.environ.get("KVSTORE_TOKEN") or (self._generated_token() if is_loopback(daemon.address) else "")
        metadata = bearer_metadata(token) if token else ()
        try:
            response = await getattr(stub, method)(request, timeout=self._timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # it answered: it has never seen the namespace
                return None
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                self._local_token = None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._asked_after[daemon.node_id] = self._clock() + RETRY_AFTER_S
            if daemon.node_id not in self._silent:
                self._silent.add(daemon.node_id)
                logger.warning(
                    "kvstore router: the daemon of %s at %s did not answer %s (%s: %s); it counts as holding nothing until it does.",
                    daemon.node_id,
                    daemon.address,
                    method,
                    exc.code().name,
                    exc.details(),
                )
            return None
        if daemon.node_id in self._silent:
            self._silent.discard(daemon.node_id)
            logger.info("kvstore router: the daemon of %s at %s answers again.", daemon.node_id, daemon.address)
        return response

    def _generated_token(self) -> str:
        """The token a daemon of this user generated; only a daemon on this host is sent it."""
        if not self._local_token:
            self._local_token = generated_token()
        return self._local_token

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return channel

    async def keep(self, addresses: set[str]) -> None:
        """Close the channels to addresses not in ``addresses``."""
        unlisted = [self._channels.pop(a) for a in list(self._channels) if a not in addresses]  # before any await
        for channel in unlisted:
            await channel.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


_STUBS = {"Index": pb_grpc.IndexStub, "Admin": pb_grpc.AdminStub}


_READ_ONLY = "the router's daemons index only reads: each daemon publishes to its own embedded index."


def _belongs(daemon: DaemonAddress, node_id: str) -> bool:
    """The daemon's own node, or one of its engines' GPU caches."""
    return node_id == daemon.node_id or replica_of(node_id) == daemon.node_id


def _engines_wanted(daemon: DaemonAddress, wanted: set[str]) -> bool:
    return any(replica_of(node_id) == daemon.node_id for node_id in wanted)


def _tiers(answer: pb.NodeMatch, num_hashes: int) -> tuple[TierKind, ...]:
    counts = sorted(((tier_from_proto(c.tier, "a match's tier"), c.blocks) for c in answer.tier_counts), key=lambda c: c[0].rank)
    total = sum(blocks for _tier, blocks in counts)
    if total != answer.matched_blocks or total > num_hashes:
        raise InvalidArgument(f"{answer.node_id} reports {answer.matched_blocks} blocks, {total} by tier, of a chain of {num_hashes}.")
    return tuple(tier for tier, blocks in counts for _ in range(blocks))
