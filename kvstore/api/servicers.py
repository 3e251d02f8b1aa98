"""The kvstore.v1 services over a Node.

Owner: the daemon's event loop. The grpc.aio server runs these coroutines on the loop
that owns the Node, so they call it directly; none of them awaits between reading and
changing node state, so each request is atomic with respect to the others.

Every method validates its request (kvstore.api.convert) before touching the node, and
every kvstore error becomes a gRPC status in one place, ``_served``: a client always gets
a status with a sentence, and an unexpected exception is logged and answered INTERNAL
while the daemon keeps serving.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from kvstore.api import convert
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.cache_meter import measure
from kvstore.cache_value import DEFAULT_HALF_LIFE_S
from kvstore.drain import drain, warm
from kvstore.errors import (
    CapacityExhausted,
    CorruptBlock,
    InvalidArgument,
    KVStoreError,
    NotFound,
    ReservationExpired,
    TransferFailed,
    Unavailable,
    UnknownNamespace,
)
from kvstore.hashing import BlockHash
from kvstore.node import Node
from kvstore.prefetch import Prefetcher
from kvstore.router import Router
from kvstore.steps import run_steps
from kvstore.transfers.service import TransferService

__all__ = ["StoreServicer", "IndexServicer", "AdminServicer", "status_for"]

_log = logging.getLogger(__name__)

# First match wins, so subclasses come before the classes they extend.
_STATUS_FOR: tuple[tuple[type[KVStoreError], grpc.StatusCode], ...] = (
    (UnknownNamespace, grpc.StatusCode.NOT_FOUND),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (ReservationExpired, grpc.StatusCode.FAILED_PRECONDITION),
    (CorruptBlock, grpc.StatusCode.DATA_LOSS),
    (TransferFailed, grpc.StatusCode.UNAVAILABLE),
)

# A sentence travels in the grpc-message trailer: one that echoes much of a request (a
# drain's target list) would pass the client's metadata limit and reach it as "Stream
# removed" instead; the start of a sentence says what was wrong.
MAX_SENTENCE_CHARS = 1024

Request = TypeVar("Request")
Response = TypeVar("Response")
Method = Callable[[object, Request, grpc.aio.ServicerContext], Awaitable[Response]]


def status_for(error: KVStoreError) -> grpc.StatusCode:
    for kind, code in _STATUS_FOR:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def _bounded(sentence: str) -> str:
    cut = "… (shortened)."
    return sentence if len(sentence) <= MAX_SENTENCE_CHARS else sentence[: MAX_SENTENCE_CHARS - len(cut)] + cut


def _served(method: Method) -> Method:
    """Time the call and answer every failure with a status and a sentence."""

    @functools.wraps(method)
    async def serve(self, request, context: grpc.aio.ServicerContext):
        rpc = f"{self.service}.{method.__name__}"
        started = time.perf_counter()
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise  # the method chose its status already
        except KVStoreError as exc:
            await context.abort(status_for(exc), _bounded(str(exc)))
        except Exception as exc:
            _log.exception("%s failed", rpc)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"{rpc} failed on node {self.node.node_id} with an unexpected {type(exc).__name__}; "
                "the daemon logged the details and keeps serving.",
            )
        finally:
            self.node.metrics.observe(rpc, time.perf_counter() - started)

    return serve


class _NodeServicer:
    service = ""

    def __init__(self, node: Node) -> None:
        self.node = node

    def _hashes(self, digest: bytes, prefix: convert.Prefix) -> list[BlockHash]:
        if prefix.block_hashes is not None:
            return prefix.block_hashes
        return self.node.hashes_for_tokens(digest, prefix.token_ids or [])

    def _block_size(self, digest: bytes) -> int:
        """Tokens per block; 0 for a namespace known only from recovered NVMe blocks."""
        namespace = self.node.manager.namespaces().get(digest)
        return namespace.block_size if namespace is not None else 0

    def _require_namespace(self, digest: bytes) -> None:
        self.node.manager.block_bytes(digest)  # raises UnknownNamespace


class StoreServicer(_NodeServicer, pb_grpc.StoreServicer):
    service = "Store"

    @_served
    async def RegisterNamespace(self, request: pb.RegisterNamespaceRequest, context) -> pb.RegisterNamespaceResponse:
        namespace = convert.namespace_from_proto(request)
        digest = self.node.register_namespace(namespace)
        return pb.RegisterNamespaceResponse(namespace_id=digest, block_bytes=namespace.block_bytes)

    @_served
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        digest = convert.namespace_id(request.namespace_id)
        prefix = convert.prefix(request, self.node.limits)
        tiers = self.node.lookup(digest, self._hashes(digest, prefix))
        return convert.lookup_response(tiers, self._block_size(digest))

    @_served
    async def Put(self, request: pb.PutRequest, context) -> pb.PutResponse:
        limits = self.node.limits
        digest = convert.namespace_id(request.namespace_id)
        hashes = convert.block_hashes(request.block_hashes, limits)
        parent = convert.parent_hash(request)
        payloads = convert.payloads(request.payloads, limits, len(hashes))
        return pb.PutResponse(num_stored=await run_steps(self.node.put_inline(digest, hashes, payloads, parent)))

    @_served
    async def Get(self, request: pb.GetRequest, context) -> pb.GetResponse:
        digest = convert.namespace_id(request.namespace_id)
        hashes = convert.block_hashes(request.block_hashes, self.node.limits)
        return pb.GetResponse(payloads=await run_steps(self.node.get_inline(digest, hashes)))


class IndexServicer(_NodeServicer, pb_grpc.IndexServicer):
    """The fleet's view: which nodes hold a prefix (from the block-location index, embedded
    or Redis), and where a request should go."""

    service = "Index"

    def __init__(self, node: Node, router: Router) -> None:
        super().__init__(node)
        self.router = router

    @_served
    async def Match(self, request: pb.MatchRequest, context) -> pb.MatchResponse:
        digest = convert.namespace_id(request.namespace_id)
        prefix = convert.prefix(request, self.node.limits)
        wanted = convert.node_ids(request.node_ids)
        matches = await self.router.match(digest, self._hashes(digest, prefix), wanted or None)
        block_size = self._block_size(digest)
        return pb.MatchResponse(nodes=[convert.node_match(m.node_id, m.tiers, block_size) for m in matches])

    @_served
    async def Route(self, request: pb.RouteRequest, context) -> pb.RouteResponse:
        digest = convert.namespace_id(request.namespace_id)
        decision = await self.router.route(
            digest,
            convert.route_tokens(request, self.node.limits),
            convert.session_id(request.session_id),
            convert.route_candidates(request),
        )
        return convert.route_response(decision)

    @_served
    async def Nodes(self, request: pb.NodesRequest, context) -> pb.NodesResponse:
        nodes = await self.router.index.nodes()
        return pb.NodesResponse(nodes=[convert.node_info(n) for n in sorted(nodes, key=lambda n: n.node_id)])


class AdminServicer(_NodeServicer, pb_grpc.AdminServicer):
    service = "Admin"

    def __init__(
        self,
        node: Node,
        router: Router,
        transfers: TransferService | None,
        more_counters: Callable[[], dict[str, int]] = dict,
        prefetcher: Prefetcher | None = None,
        cache_half_life_s: float = DEFAULT_HALF_LIFE_S,
    ) -> None:
        super().__init__(node)
        self.router = router
        self.transfers = transfers
        self.more_counters = more_counters
        self.cache_half_life_s = cache_half_life_s  # CacheValue's, where a request names none
        # the daemon passes its own, which it closes at shutdown
        self.prefetcher = prefetcher or Prefetcher(node, transfers)

    @_served
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = self.node.stats()
        return convert.stats_response(dataclasses.replace(stats, counters={**stats.counters, **self.more_counters()}))

    @_served
    async def ListBlocks(self, request: pb.ListBlocksRequest, context) -> pb.ListBlocksResponse:
        query = convert.block_query(request, self.node.limits)
        page = self.node.list_blocks(query.namespace, query.tier, query.min_idle_s, query.page_size, query.page_token)
        # the tier manager stamps blocks with the monotonic clock, as Node.list_blocks assumes
        return convert.block_page_response(page, time.monotonic())

    @_served
    async def Evict(self, request: pb.EvictRequest, context) -> pb.EvictResponse:
        query = convert.evict_query(request, self.node.limits)
        result = self.node.evict(query.namespace, query.block_hashes, query.tier, query.min_idle_s)
        return convert.evict_response(result)

    @_served
    async def Pin(self, request: pb.PinRequest, context) -> pb.PinResponse:
        digest = convert.namespace_id(request.namespace_id)
        hashes = convert.block_hashes(request.block_hashes, self.node.limits)
        self._require_namespace(digest)
        return pb.PinResponse(count=self.node.pin(digest, hashes))

    @_served
    async def Unpin(self, request: pb.UnpinRequest, context) -> pb.UnpinResponse:
        digest = convert.namespace_id(request.namespace_id)
        hashes = convert.block_hashes(request.block_hashes, self.node.limits)
        self._require_namespace(digest)
        return pb.UnpinResponse(count=self.node.unpin(digest, hashes))

    @_served
    async def Retain(self, request: pb.RetainRequest, context) -> pb.RetainResponse:
        digest = convert.namespace_id(request.namespace_id)
        hashes = convert.block_hashes(request.block_hashes, self.node.limits)
        return convert.retain_response(self.node.retain(digest, hashes, request.ttl_s))

    @_served
    async def Prefetch(self, request: pb.PrefetchRequest, context) -> pb.PrefetchResponse:
        digest = convert.namespace_id(request.namespace_id)
        hashes = convert.block_hashes(request.block_hashes, self.node.limits)
        source = convert.source_node_id(request.source_node_id)
        return convert.prefetch_response(await self.prefetcher.start(digest, hashes, source))

    @_served
    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        targets = list(convert.node_ids(request.target_node_ids, "target_node_ids"))
        report = await drain(self._transfers(), self.router.index, self.router.sessions, targets, request.max_bytes)
        return convert.move_report(report)

    @_served
    async def Warm(self, request: pb.WarmRequest, context) -> pb.DrainResponse:
        sources = list(convert.node_ids(request.source_node_ids, "source_node_ids"))
        report = await warm(self._transfers(), self.router.index, sources, request.max_bytes)
        return convert.move_report(report)

    @_served
    async def CacheValue(self, request: pb.CacheValueRequest, context) -> pb.CacheValueResponse:
        half_life_s = convert.half_life(request, self.cache_half_life_s)
        value = await measure(self.node.manager, self.router.index, self.node.node_id, half_life_s)
        return convert.cache_value_response(value)

    def _transfers(self) -> TransferService:
        if self.transfers is None:
            raise InvalidArgument('this daemon runs without a transport (transport.kind = "off"); it cannot move blocks to peers.')
        return self.transfers
