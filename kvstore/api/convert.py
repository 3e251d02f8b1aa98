"""Protobuf messages ↔ kvstore values; the only place the two meet.

Everything arriving from the wire is checked here before a servicer hands it to the
node: ids and hashes have exact lengths, counts and sizes are bounded by the node's
``Limits``, enums name a known value. A check that fails raises ``InvalidArgument`` with
a sentence naming the field, which the servicers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.cache_value import CacheValue, check_half_life
from kvstore.drain import MoveReport
from kvstore.errors import InvalidArgument
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.index.base import NodeInfo
from kvstore.index.scoring import Candidate, RouteDecision
from kvstore.layout import KVLayout
from kvstore.namespace import NAMESPACE_DIGEST_BYTES, Namespace
from kvstore.node import BlockPage, Limits, NodeStats
from kvstore.prefetch import PrefetchPlan
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import BlockInfo, EvictResult, RetainResult

__all__ = [
    "Prefix",
    "BlockQuery",
    "EvictQuery",
    "tier_to_proto",
    "tier_from_proto",
    "namespace_id",
    "optional_namespace_id",
    "block_hashes",
    "parent_hash",
    "payloads",
    "prefix",
    "node_ids",
    "namespace_from_proto",
    "tier_counts",
    "lookup_response",
    "node_match",
    "stats_response",
    "block_info",
    "block_query",
    "block_page_response",
    "evict_query",
    "evict_response",
    "route_candidates",
    "route_tokens",
    "session_id",
    "route_response",
    "node_info",
    "source_node_id",
    "retain_response",
    "prefetch_response",
    "half_life",
    "cache_value_response",
]

MAX_NAME_CHARS = 1024  # model ids, tenant salts, node ids
MAX_NODE_IDS = 4096
MAX_PAGE_TOKEN_CHARS = 64
DEFAULT_PAGE_SIZE = 1000

_TIER_TO_PROTO: dict[TierKind, int] = {
    TierKind.GPU: pb.TIER_GPU,
    TierKind.HBM: pb.TIER_HBM,
    TierKind.HOST: pb.TIER_HOST,
    TierKind.NVME: pb.TIER_NVME,
    TierKind.REMOTE: pb.TIER_REMOTE,
}
_TIER_FROM_PROTO: dict[int, TierKind] = {value: kind for kind, value in _TIER_TO_PROTO.items()}


@dataclass(frozen=True, slots=True)
class Prefix:
    """A Lookup or Match key: exactly one of the two is set."""

    token_ids: list[int] | None
    block_hashes: list[BlockHash] | None


@dataclass(frozen=True, slots=True)
class BlockQuery:
    namespace: bytes | None
    tier: TierKind | None
    min_idle_s: float | None
    page_size: int
    page_token: str


@dataclass(frozen=True, slots=True)
class EvictQuery:
    namespace: bytes | None
    block_hashes: list[BlockHash] | None
    tier: TierKind | None
    min_idle_s: float | None


# -- values from the wire ---------------------------------------------------------------
def tier_to_proto(kind: TierKind) -> int:
    return _TIER_TO_PROTO[kind]


def tier_from_proto(value: int, field: str = "tier") -> TierKind:
    kind = _TIER_FROM_PROTO.get(value)
    if kind is None:
        known = ", ".join(pb.Tier.Name(v) for v in _TIER_FROM_PROTO)
        what = "TIER_UNSPECIFIED" if value == pb.TIER_UNSPECIFIED else f"the unknown value {value}"
        raise InvalidArgument(f"{field} is {what}; name one of {known}, or leave the field unset.")
    return kind


def namespace_id(raw: bytes, field: str = "namespace_id") -> bytes:
    if len(raw) != NAMESPACE_DIGEST_BYTES:
        raise InvalidArgument(
            f"{field} has {len(raw)} bytes; a namespace id is the {NAMESPACE_DIGEST_BYTES}-byte digest that RegisterNamespace returns."
        )
    return bytes(raw)


def optional_namespace_id(raw: bytes) -> bytes | None:
    return namespace_id(raw) if raw else None


def block_hashes(raw: Sequence[bytes], limits: Limits, field: str = "block_hashes") -> list[BlockHash]:
    # the count first: a huge list is refused without walking it
    if len(raw) > limits.max_blocks_per_request:
        raise InvalidArgument(f"{field} has {len(raw)} hashes; the limit is {limits.max_blocks_per_request} per request.")
    hashes = list(raw)
    for index, block_hash in enumerate(hashes):
        if len(block_hash) != HASH_BYTES:
            raise InvalidArgument(f"{field}[{index}] has {len(block_hash)} bytes; a block hash is a {HASH_BYTES}-byte XXH3-128 digest.")
    return hashes  # type: ignore[return-value]  # checked above: every element is a BlockHash


def parent_hash(request: pb.PutRequest) -> BlockHash | None:
    if not request.HasField("parent_hash"):
        return None
    if len(request.parent_hash) != HASH_BYTES:
        raise InvalidArgument(f"parent_hash has {len(request.parent_hash)} bytes; a block hash has {HASH_BYTES}.")
    return BlockHash(request.parent_hash)


def payloads(raw: Sequence[bytes], limits: Limits, num_hashes: int) -> list[bytes]:
    if len(raw) != num_hashes:
        raise InvalidArgument(f"{num_hashes} block hashes came with {len(raw)} payloads; give one payload per hash.")
    total = sum(len(p) for p in raw)
    if total > limits.max_inline_bytes:
        raise InvalidArgument(
            f"the payloads hold {total} bytes, over the inline limit of {limits.max_inline_bytes}; "
            "move bulk data through the local client or the transport."
        )
    return list(raw)


def prefix(request: pb.LookupRequest | pb.MatchRequest, limits: Limits) -> Prefix:
    which = request.WhichOneof("prefix")
    if which == "token_ids":
        ids = request.token_ids.ids
        if len(ids) > limits.max_tokens_per_request:
            raise InvalidArgument(f"token_ids has {len(ids)} ids; the limit is {limits.max_tokens_per_request} per request.")
        return Prefix(list(ids), None)
    if which == "block_hashes":
        return Prefix(None, block_hashes(request.block_hashes.hashes, limits, "block_hashes.hashes"))
    raise InvalidArgument("the request names no prefix; set token_ids or block_hashes.")


def node_ids(raw: Sequence[str], field: str = "node_ids") -> set[str]:
    if len(raw) > MAX_NODE_IDS:
        raise InvalidArgument(f"{field} has {len(raw)} entries; the limit is {MAX_NODE_IDS}.")
    for node_id in raw:
        _check_name(node_id, field)
    return set(raw)


def source_node_id(raw: str) -> str | None:
    """A Prefetch's source: a node id or transport address; None where it names none."""
    if not raw:
        return None
    _check_name(raw, "source_node_id")
    return raw


def namespace_from_proto(request: pb.RegisterNamespaceRequest) -> Namespace:
    if not request.HasField("layout"):
        raise InvalidArgument("layout is missing; a namespace needs its KV layout to size its blocks.")
    _check_name(request.model_id, "model_id")
    _check_name(request.tenant_salt, "tenant_salt")
    message = request.layout
    _check_name(message.dtype, "layout.dtype")
    _check_name(message.inner_order, "layout.inner_order")
    layout = KVLayout(
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        block_size=message.block_size,
        dtype=message.dtype or "float16",
        kv_planes=message.kv_planes or 2,
        inner_order=message.inner_order or "NHD",
    )
    return Namespace(
        model_id=request.model_id,
        layout=layout,
        tp_rank=request.tp_rank,
        tp_size=request.tp_size or 1,
        pp_rank=request.pp_rank,
        pp_size=request.pp_size or 1,
        tenant_salt=request.tenant_salt,
    )


def block_query(request: pb.ListBlocksRequest, limits: Limits) -> BlockQuery:
    if len(request.page_token) > MAX_PAGE_TOKEN_CHARS:
        raise InvalidArgument("page_token is not one this node issued; pass next_page_token from the previous page.")
    return BlockQuery(
        namespace=optional_namespace_id(request.namespace_id),
        tier=tier_from_proto(request.tier) if request.HasField("tier") else None,
        min_idle_s=_min_idle(request),
        page_size=request.page_size or min(DEFAULT_PAGE_SIZE, limits.max_page_size),
        page_token=request.page_token,
    )


def evict_query(request: pb.EvictRequest, limits: Limits) -> EvictQuery:
    query = EvictQuery(
        namespace=optional_namespace_id(request.namespace_id),
        block_hashes=block_hashes(request.block_hashes, limits) if request.block_hashes else None,
        tier=tier_from_proto(request.tier) if request.HasField("tier") else None,
        min_idle_s=_min_idle(request),
    )
    filtered = any(value is not None for value in (query.namespace, query.block_hashes, query.tier, query.min_idle_s))
    if query.block_hashes is not None and query.namespace is None:
        raise InvalidArgument("block_hashes were given without namespace_id; a hash means nothing outside its namespace.")
    if not filtered and not request.all:
        raise InvalidArgument("the request has no filter; set all = true to evict every evictable block of the node.")
    if filtered and request.all:
        raise InvalidArgument("all = true was combined with filters; give either filters or all = true.")
    return query


# -- values to the wire -----------------------------------------------------------------
def tier_counts(tiers: Iterable[TierKind]) -> list[pb.TierCount]:
    counts: dict[TierKind, int] = {}
    for kind in tiers:
        counts[kind] = counts.get(kind, 0) + 1
    return [pb.TierCount(tier=tier_to_proto(k), blocks=counts[k]) for k in sorted(counts, key=lambda k: k.rank)]


def lookup_response(tiers: Sequence[TierKind], block_size: int) -> pb.LookupResponse:
    return pb.LookupResponse(
        matched_blocks=len(tiers),
        matched_tokens=len(tiers) * block_size,
        tiers=[tier_to_proto(k) for k in tiers],
        tier_counts=tier_counts(tiers),
    )


def node_match(node_id: str, tiers: Sequence[TierKind], block_size: int) -> pb.NodeMatch:
    return pb.NodeMatch(
        node_id=node_id,
        matched_blocks=len(tiers),
        matched_tokens=len(tiers) * block_size,
        tier_counts=tier_counts(tiers),
    )


def stats_response(stats: NodeStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        node_id=stats.node_id,
        uptime_s=stats.uptime_s,
        tiers=[
            pb.TierStats(
                tier=tier_to_proto(t.kind),
                capacity_bytes=t.capacity_bytes,
                used_bytes=t.used_bytes,
                num_blocks=t.num_blocks,
                occupancy=t.occupancy,
            )
            for t in stats.tiers
        ],
        failed_tiers=[tier_to_proto(k) for k in stats.failed_tiers],
        num_blocks=stats.num_blocks,
        num_namespaces=stats.num_namespaces,
        num_leases=stats.num_leases,
        num_reservations=stats.num_reservations,
        num_sessions=stats.num_sessions,
        counters=stats.counters,
        problems=list(stats.problems),
    )


def block_info(info: BlockInfo, now: float) -> pb.BlockInfo:
    return pb.BlockInfo(
        namespace_id=info.namespace,
        block_hash=info.block_hash,
        parent_hash=info.parent_hash or b"",
        tier=tier_to_proto(info.tier),
        nbytes=info.nbytes,
        age_s=max(0.0, now - info.stored_at),
        idle_s=max(0.0, now - info.last_access),
        pinned=info.pinned,
        leases=info.num_leases,
    )


def block_page_response(page: BlockPage, now: float) -> pb.ListBlocksResponse:
    """``now`` is on the tier manager's clock (monotonic), as the blocks' times are."""
    return pb.ListBlocksResponse(
        blocks=[block_info(info, now) for info in page.blocks],
        next_page_token=page.next_page_token,
        total=page.total,
    )


def evict_response(result: EvictResult) -> pb.EvictResponse:
    return pb.EvictResponse(evicted=result.num_evicted, skipped=result.num_skipped)


# -- checks -----------------------------------------------------------------------------
def _check_name(value: str, field: str) -> None:
    if len(value) > MAX_NAME_CHARS:
        raise InvalidArgument(f"{field} has {len(value)} characters; the limit is {MAX_NAME_CHARS}.")


def _min_idle(request: pb.ListBlocksRequest | pb.EvictRequest) -> float | None:
    if not request.HasField("min_idle_s"):
        return None
    value = request.min_idle_s
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"min_idle_s must be a finite number of seconds, zero or more; got {value}.")
    return value


def route_candidates(request: pb.RouteRequest) -> list[Candidate]:
    if len(request.candidates) > MAX_NODE_IDS:
        raise InvalidArgument(f"candidates has {len(request.candidates)} entries; the limit is {MAX_NODE_IDS}.")
    candidates = []
    for candidate in request.candidates:
        _check_name(candidate.node_id, "candidates.node_id")
        candidates.append(Candidate(candidate.node_id, candidate.load.queued_tokens, candidate.load.active_requests))
    return candidates


def route_tokens(request: pb.RouteRequest, limits: Limits) -> list[int]:
    if len(request.token_ids) > limits.max_tokens_per_request:
        raise InvalidArgument(f"token_ids has {len(request.token_ids)} ids; the limit is {limits.max_tokens_per_request} per request.")
    return list(request.token_ids)


def session_id(raw: str) -> str:
    if raw:
        _check_name(raw, "session_id")
    return raw


def route_response(decision: RouteDecision) -> pb.RouteResponse:
    return pb.RouteResponse(
        node_id=decision.node_id,
        expected_cached_tokens=decision.expected_cached_tokens,
        expected_cost_s=decision.expected_cost_s,
        reason=decision.reason,
    )


def node_info(node: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=node.node_id, grpc_address=node.grpc_address, transport_address=node.transport_address, kind=node.kind)


def move_report(report: MoveReport) -> pb.DrainResponse:
    return pb.DrainResponse(
        moved_blocks=report.moved_blocks,
        moved_bytes=report.moved_bytes,
        remaining_blocks=report.remaining_blocks,
        sessions_moved=report.sessions_moved,
        blocks_by_peer=report.blocks_by_peer,
    )


def retain_response(result: RetainResult) -> pb.RetainResponse:
    return pb.RetainResponse(found_blocks=result.num_found, retained_blocks=result.num_retained, ttl_s=result.ttl_s)


def prefetch_response(plan: PrefetchPlan) -> pb.PrefetchResponse:
    return pb.PrefetchResponse(
        host_blocks=plan.num_in_host,
        promoting_blocks=plan.num_promoting,
        missing_blocks=plan.num_missing,
        fetching_blocks=plan.num_fetching,
    )


def half_life(request: pb.CacheValueRequest, default_s: float) -> float:
    """The half-life a CacheValue request asks for: its own, or ``default_s`` where it gives 0."""
    value = request.half_life_s
    if value == 0:
        return default_s
    if not math.isfinite(value):
        raise InvalidArgument(f"half_life_s must be a finite number of seconds, got {value}.")
    return check_half_life(value)


def cache_value_response(value: CacheValue) -> pb.CacheValueResponse:
    return pb.CacheValueResponse(
        node_id=value.node_id,
        value_bytes=value.value_bytes,
        unique_bytes=value.unique_bytes,
        unique_blocks=value.unique_blocks,
        total_bytes=value.total_bytes,
        total_blocks=value.total_blocks,
        num_peers=value.num_peers,
        half_life_s=value.half_life_s,
    )
