"""Routing policies: which replica serves a request. Every policy sees the same fleet.

- ``round-robin``: replicas in turn (Dynamo's and most gateways' default).
- ``least-loaded``: fewest outstanding requests (queued, prefilling or decoding), as
  Envoy's LEAST_REQUEST balancer; ties go to the next replica in turn.
- ``session-hash``: consistent hashing of the session id on a ring of `VIRTUAL_NODES`
  points per replica (XXH3-64 of "replica-k#v", so it is the same in every process).
- ``longest-prefix``: llm-d's precise prefix-cache scorer (llm-d-kv-cache,
  ``LongestPrefixScorer``): score = Σ over the blocks of the longest prefix a replica holds
  of the weight of the tier each is in — llm-d's defaults are gpu 1.0, cpu 0.8; it has no
  default for disk (an unknown medium weighs 1.0), NVMe is given 0.5 here. Highest score
  wins; ties go to the least loaded. The prefix scorer alone, as llm-d's precise scorer
  runs by itself.
- ``dynamo``: Dynamo's KV router cost, ``overlap_score_weight × prefill_blocks +
  decode_blocks``, lowest wins (router temperature 0): prefill_blocks = the replica's
  prompt tokens still to prefill plus this prompt's uncached tokens, in blocks;
  decode_blocks = the blocks of every request active on it plus this prompt's. The weight
  defaults to 1.0, Dynamo's documented default. Cached blocks count in whatever tier.
- ``kvstore``: kvstore's production router, `kvstore.index.scoring.route`: the expected
  cost of each replica (queue + load + prefill + pressure seconds, the pressure from each
  replica's cache size and the live sessions placed on it, `kvstore.index.live`, as the
  HTTP router prices it) with session affinity kept in a dict with a TTL, margins and TTL
  from `RoutingConfig`'s defaults. Its replicas fetch
  blocks from peers when that beats recomputing them (kvstore's transport).

The same cache-aware baselines on a fleet that runs kvstore, with what kvstore's router
gets (so that a comparison isolates the routing rule, not the fleet under it):

- ``session-hash+fetch``, ``dynamo+fetch``: their replicas fetch from peers as kvstore's
  do (the replica's rule, `scoring.estimate`: only when that beats recomputing). Dynamo's
  cost already has its load terms — the prefill queued on a replica and its active
  blocks, the same two quantities as kvstore's queue term; consistent hashing has none by
  design.
- ``longest-prefix+load+fetch``: llm-d's deployed scheduling profile, prefix-cache scorer
  (weight 3) plus queue scorer (weight 2), each min-max normalised over the replicas as
  llm-d's scheduler normalises scorers, the queue being kvstore's own load term for the
  replica (`scoring.estimate`'s ``queue_s``: its queued prefill tokens at the prefill rate
  plus its decoding requests at ``decode_s_per_request``); its replicas fetch from peers.

The prefix-aware policies read block locations from one `BlockLocations` index that the
replicas' own tier-manager events feed (engine.py), as llm-d's and Dynamo's indexers are
fed by engines' KV events. Where an engine's own prefix cache is a node of its own in
that index (``vllm@replica-k``, bench/sim/vllm_replica.py), kvstore's policy folds it into
its replica's match as the production router does (`scoring.with_engine_caches`).

vLLM's Rust router (``vllm-router``, 0.1.17; a fork of SGLang's model gateway):

- ``vllm-router-cache-aware`` (``--policy cache_aware``, its default): an approximate
  radix tree of what each worker was sent (text, not KV events). When load is balanced —
  not both max − min in-flight requests > ``balance_abs_threshold`` (64) and max >
  ``balance_rel_threshold`` (1.5) × min — a prompt whose longest match in the tree
  covers more than ``cache_threshold`` (0.3; SGLang's own router defaults to 0.5) of it
  goes to the worker that match names (the tenant that created the tree node where the
  match ends), any other to the worker with the smallest tree (ties: the fewest in-flight
  requests, then the first); when imbalanced, to the fewest in-flight requests. The chosen worker's tree then learns the prompt. Modelled at
  block granularity (chain hashes of whole blocks, token counts for characters: the same
  ratios to within a block); the tree's size-bounded eviction (2^25 characters, every
  120 s) never triggers at these sizes and is not modelled.
- ``vllm-router-kv-aware`` (``--policy kv_aware``): routes by the engines' KV events — the
  prefix each worker's engine actually holds. Modelled as the cost of Dynamo's KV router,
  whose shape 0.1.17's kv_aware shares (per-worker slot counters of active blocks and
  prefill work, ``--router-temperature`` 0: the lowest cost wins, as its flags and
  symbols show; the wheel ships no source for its exact weights): (queued prefill tokens
  + this prompt's tokens beyond the worker's cached prefix) ÷ block + the blocks of its
  active requests and this prompt's; ties go to the workers in turn. The events arrive
  with no delay here, so the router sees each engine's cache exactly.
"""

from __future__ import annotations

import abc
import bisect
import collections
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from bench.sim.replica import Replica, node_id, replica_index
from bench.sim.workload import Request
from kvstore.config import RoutingConfig
from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash
from kvstore.index import scoring
from kvstore.index.base import SessionAffinity
from kvstore.index.live import LiveSessions
from kvstore.index.locations import BlockLocations
from kvstore.tier_kind import TierKind

__all__ = [
    "Fleet",
    "RoutingPolicy",
    "POLICIES",
    "make_policy",
    "VIRTUAL_NODES",
    "LLMD_TIER_WEIGHTS",
    "LLMD_PREFIX_WEIGHT",
    "LLMD_QUEUE_WEIGHT",
    "DYNAMO_OVERLAP_WEIGHT",
    "VLLM_ROUTER_CACHE_THRESHOLD",
    "VLLM_ROUTER_BALANCE_ABS_THRESHOLD",
    "VLLM_ROUTER_BALANCE_REL_THRESHOLD",
    "ApproximateTree",
    "VllmRouterCacheAware",
    "VllmRouterKvAware",
    "queue_s",
]

VIRTUAL_NODES = 160  # ketama's customary count: a replica's share is within a few % of 1/N
LLMD_TIER_WEIGHTS = {TierKind.GPU: 1.0, TierKind.HBM: 1.0, TierKind.HOST: 0.8, TierKind.NVME: 0.5}
# llm-d's default scheduling profile: prefix-cache scorer weight 3, queue scorer weight 2
LLMD_PREFIX_WEIGHT, LLMD_QUEUE_WEIGHT = 3.0, 2.0
DYNAMO_OVERLAP_WEIGHT = 1.0
# vllm-router 0.1.17's defaults (its router_args.py)
VLLM_ROUTER_CACHE_THRESHOLD = 0.3
VLLM_ROUTER_BALANCE_ABS_THRESHOLD = 64
VLLM_ROUTER_BALANCE_REL_THRESHOLD = 1.5


@dataclass(frozen=True, slots=True)
class Fleet:
    """What a router can see: the replicas' load, and where blocks live."""

    replicas: tuple[Replica, ...]
    index: BlockLocations | None
    namespace: bytes
    block_bytes: int


class RoutingPolicy(abc.ABC):
    name: str
    uses_index: bool = False  # reads block locations
    remote_fetch: bool = False  # its replicas fetch blocks from peers

    @abc.abstractmethod
    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        """The index of the replica to serve ``request``."""


class _Rotation:
    """Ties go to the first tied replica at or after a cursor that moves past each pick, so
    an idle fleet is filled in turn rather than piled onto replica 0."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, keys: Sequence) -> int:
        count = len(keys)
        start = self._next
        best = min(range(count), key=lambda offset: (keys[(start + offset) % count], offset))
        chosen = (start + best) % count
        self._next = chosen + 1
        return chosen


def _candidate(replica: Replica, now: float) -> scoring.Candidate:
    """A replica's load as kvstore's router sees it."""
    return scoring.Candidate(replica.node_id, replica.queued_new_tokens(now), replica.num_decoding)


def queue_s(replica: Replica, now: float, speeds: scoring.CostModel) -> float:
    """kvstore's router's load term for ``replica``: the production `scoring.estimate`'s
    queue seconds (an empty prompt, so nothing else is in it)."""
    return scoring.estimate(_candidate(replica, now), None, 0, 1, 0, speeds).queue_s


def _min_max(values: Sequence[float]) -> list[float]:
    """Scores scaled to [0, 1] over the replicas, as llm-d's scheduler scales each scorer's
    (all equal: 0 for all, so the scorer adds the same to every replica)."""
    low, high = min(values), max(values)
    if high == low:
        return [0.0] * len(values)
    return [(value - low) / (high - low) for value in values]


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._count = 0

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        chosen = self._count % len(fleet.replicas)
        self._count += 1
        return chosen


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        return self._rotation.pick([replica.num_outstanding for replica in fleet.replicas])


class SessionHash(RoutingPolicy):
    name = "session-hash"

    def __init__(self, num_replicas: int, virtual_nodes: int = VIRTUAL_NODES, remote_fetch: bool = False) -> None:
        ring = sorted(
            (xxhash.xxh3_64_intdigest(f"{node_id(k)}#{v}".encode()), k) for k in range(num_replicas) for v in range(virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]
        self.remote_fetch = remote_fetch
        if remote_fetch:
            self.name = "session-hash+fetch"

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        position = bisect.bisect(self._points, xxhash.xxh3_64_intdigest(request.session_id.encode()))
        return self._owners[position % len(self._points)]


class LongestPrefix(RoutingPolicy):
    """llm-d's prefix scorer; with ``speeds``, also its queue scorer over kvstore's load
    term, weighted as llm-d's default profile weighs the two."""

    name = "longest-prefix"
    uses_index = True

    def __init__(
        self,
        tier_weights: dict[TierKind, float] = LLMD_TIER_WEIGHTS,
        speeds: scoring.CostModel | None = None,
        remote_fetch: bool = False,
    ) -> None:
        self._weights = tier_weights
        self._speeds = speeds
        self._rotation = _Rotation()
        self.remote_fetch = remote_fetch
        self.name = "longest-prefix" + ("+load" if speeds is not None else "") + ("+fetch" if remote_fetch else "")

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        scores = [0.0] * len(fleet.replicas)
        for match in _matches(request, fleet):
            counts = collections.Counter(match.tiers)  # in C: a match is hundreds of blocks
            scores[replica_index(match.node_id)] = sum(count * self._weights[tier] for tier, count in counts.items())
        if self._speeds is None:
            return self._rotation.pick([(-scores[k], replica.num_outstanding) for k, replica in enumerate(fleet.replicas)])
        queues = [queue_s(replica, now, self._speeds) for replica in fleet.replicas]
        combined = [
            LLMD_PREFIX_WEIGHT * prefix + LLMD_QUEUE_WEIGHT * (1.0 - queue) for prefix, queue in zip(_min_max(scores), _min_max(queues))
        ]
        return self._rotation.pick([(-score, replica.num_outstanding) for score, replica in zip(combined, fleet.replicas)])


class DynamoCost(RoutingPolicy):
    name = "dynamo"
    uses_index = True

    def __init__(self, overlap_weight: float = DYNAMO_OVERLAP_WEIGHT, remote_fetch: bool = False) -> None:
        self._weight = overlap_weight
        self._rotation = _Rotation()
        self.remote_fetch = remote_fetch
        if remote_fetch:
            self.name = "dynamo+fetch"

    def overlaps(self, request: Request, fleet: Fleet) -> list[int]:
        """Blocks of the prompt each replica holds, in any tier."""
        overlap = [0] * len(fleet.replicas)
        for match in _matches(request, fleet):
            overlap[replica_index(match.node_id)] = match.num_blocks
        return overlap

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        overlap = self.overlaps(request, fleet)
        block_tokens = request.block_tokens
        prompt_blocks = -(-request.num_prompt_tokens // block_tokens)
        costs = []
        for k, replica in enumerate(fleet.replicas):
            new_tokens = max(0, request.num_prompt_tokens - overlap[k] * block_tokens)
            prefill_blocks = (replica.queued_new_tokens(now) + new_tokens) / block_tokens
            decode_blocks = replica.active_blocks + prompt_blocks
            costs.append(self._weight * prefill_blocks + decode_blocks)
        return self._rotation.pick(costs)


class KvstoreCost(RoutingPolicy):
    name = "kvstore"
    uses_index = True

    def __init__(self, speeds: scoring.CostModel, routing: RoutingConfig = RoutingConfig()) -> None:
        self.remote_fetch = speeds.remote_fetch
        self._speeds = speeds
        self._affinity_policy = scoring.AffinityPolicy(margin_s=routing.margin_s, margin_ratio=routing.margin_ratio)
        self._ttl_s = routing.session_ttl_s
        self._sessions: dict[str, tuple[SessionAffinity, float]] = {}  # session -> (affinity, expires at)
        self._live: LiveSessions | None = None  # the working set placed on each replica, as the HTTP router keeps it
        self.num_moves = 0

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        # an engine's own cache (its KV events) counts as its replica's, as the router counts it
        matches = scoring.with_engine_caches(_matches(request, fleet), [replica.node_id for replica in fleet.replicas])
        if self._live is None:
            self._live = LiveSessions(self._ttl_s, request.block_tokens)
        live = self._live
        candidates = [
            dataclasses.replace(
                _candidate(replica, now),
                cache_tokens=replica.cache_bytes // fleet.block_bytes * request.block_tokens,
                live_tokens=live.tokens_on(replica.node_id, now),
            )
            for replica in fleet.replicas
        ]
        held = self._sessions.get(request.session_id)
        affinity = held[0] if held is not None and held[1] > now else None
        decision = scoring.route(
            candidates,
            matches,
            request.num_prompt_tokens,
            request.block_tokens,
            fleet.block_bytes,
            self._speeds,
            affinity,
            self._affinity_policy,
            request.session_id,
        )
        num_moves = affinity.num_moves if affinity is not None else 0
        if affinity is not None and decision.node_id != affinity.node_id:
            num_moves += 1
            self.num_moves += 1
        self._sessions[request.session_id] = (SessionAffinity(request.session_id, decision.node_id, num_moves), now + self._ttl_s)
        live.record(request.session_id, decision.node_id, request.block_hashes, request.num_prompt_tokens, now)
        return replica_index(decision.node_id)


class ApproximateTree:
    """vllm-router's approximate radix tree of what each worker was sent, at block
    granularity: a node per chain hash (a prompt's whole blocks), the tenant that created
    it (the tree's cached ``last_tenant``, which a split copies), the tenants that were
    sent it, and each tenant's size in tokens."""

    def __init__(self) -> None:
        self._creator: dict[BlockHash, int] = {}
        self._tenants: dict[BlockHash, set[int]] = {}
        self.size: collections.Counter[int] = collections.Counter()

    def insert(self, hashes: Sequence[BlockHash], tenant: int, block_tokens: int) -> None:
        for block_hash in hashes:
            tenants = self._tenants.get(block_hash)
            if tenants is None:
                self._creator[block_hash] = tenant
                self._tenants[block_hash] = {tenant}
            elif tenant in tenants:
                continue
            else:
                tenants.add(tenant)
            self.size[tenant] += block_tokens

    def match(self, hashes: Sequence[BlockHash]) -> tuple[int, int | None]:
        """(blocks matched, the tenant the match names; None when nothing matched)."""
        matched = 0
        for block_hash in hashes:
            if block_hash not in self._creator:
                break
            matched += 1
        return matched, (self._creator[hashes[matched - 1]] if matched else None)


class VllmRouterCacheAware(RoutingPolicy):
    name = "vllm-router-cache-aware"

    def __init__(
        self,
        cache_threshold: float = VLLM_ROUTER_CACHE_THRESHOLD,
        balance_abs_threshold: int = VLLM_ROUTER_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = VLLM_ROUTER_BALANCE_REL_THRESHOLD,
    ) -> None:
        self._threshold = cache_threshold
        self._abs = balance_abs_threshold
        self._rel = balance_rel_threshold
        self.tree = ApproximateTree()
        self.decisions: collections.Counter[str] = collections.Counter()

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        loads = [replica.num_outstanding for replica in fleet.replicas]
        low, high = min(loads), max(loads)
        if high - low > self._abs and high > low * self._rel:
            chosen, decision = loads.index(low), "load_balance"
        else:
            matched, tenant = self.tree.match(request.block_hashes)
            rate = matched * request.block_tokens / request.num_prompt_tokens if request.num_prompt_tokens else 0.0
            if tenant is not None and rate > self._threshold:
                chosen, decision = tenant, "cache_hit"
            else:
                sizes = [self.tree.size[k] for k in range(len(fleet.replicas))]
                chosen = min(range(len(sizes)), key=lambda k: (sizes[k], loads[k], k))
                decision = "smallest_tree"
        self.decisions[decision] += 1
        self.tree.insert(request.block_hashes, chosen, request.block_tokens)
        return chosen


class VllmRouterKvAware(DynamoCost):
    name = "vllm-router-kv-aware"
    uses_index = False

    def __init__(self) -> None:
        super().__init__()
        self.name = "vllm-router-kv-aware"

    def overlaps(self, request: Request, fleet: Fleet) -> list[int]:
        """Blocks of the prompt each replica's engine holds in its own cache."""
        return [replica.engine_prefix_blocks(request) for replica in fleet.replicas]


def _matches(request: Request, fleet: Fleet):
    if fleet.index is None or not request.block_hashes:
        return []
    return fleet.index.match(fleet.namespace, request.block_hashes)


POLICIES: dict[str, Callable[[int, scoring.CostModel], RoutingPolicy]] = {
    "round-robin": lambda num_replicas, speeds: RoundRobin(),
    "least-loaded": lambda num_replicas, speeds: LeastLoaded(),
    "session-hash": lambda num_replicas, speeds: SessionHash(num_replicas),
    "longest-prefix": lambda num_replicas, speeds: LongestPrefix(),
    "dynamo": lambda num_replicas, speeds: DynamoCost(),
    "kvstore": lambda num_replicas, speeds: KvstoreCost(speeds),
    "session-hash+fetch": lambda num_replicas, speeds: SessionHash(num_replicas, remote_fetch=speeds.remote_fetch),
    "longest-prefix+load+fetch": lambda num_replicas, speeds: LongestPrefix(speeds=speeds, remote_fetch=speeds.remote_fetch),
    "dynamo+fetch": lambda num_replicas, speeds: DynamoCost(remote_fetch=speeds.remote_fetch),
    "vllm-router-cache-aware": lambda num_replicas, speeds: VllmRouterCacheAware(),
    "vllm-router-kv-aware": lambda num_replicas, speeds: VllmRouterKvAware(),
}


def make_policy(name: str, num_replicas: int, speeds: scoring.CostModel) -> RoutingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise InvalidArgument(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}.") from None
    return factory(num_replicas, speeds)
