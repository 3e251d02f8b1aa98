"""Routing scores: the expected cost of serving a prompt on each replica (DESIGN.md §7).

Pure and synchronous: the daemon's `Index.Route` (kvstore/router.py) and the routing
simulator drive exactly this code. The cost of sending a prompt of P tokens to replica r:

    cost_s  = queue_s + load_s + prefill_s + pressure_s
    queue_s = queued_tokens / prefill_tokens_per_s + active_requests × decode_s_per_request
              (the prefill work ahead of it, plus each running request's share of steps)
    pressure_s = evicted_tokens / prefill_tokens_per_s
              (what the prompt's new blocks push out of r's live sessions' working set, to
              be computed again when they come back: evicted_tokens = the new tokens beyond
              cache_tokens − live_tokens, none while the working set and the new tokens
              fit; 0 when r's cache_tokens is not known)
    load_s  = Σ over the cached blocks r will use: block_bytes / bandwidth of their tier
              (GPU and HBM hits are free: already where the engine reads them; HOST, NVME
              and REMOTE at host_, nvme_ and remote_bytes_per_s)
    prefill_s(n new tokens after c cached)
            = n / prefill_tokens_per_s × (1 + (c + n/2) / attention_context_tokens)
              (per-token work grows with the context each new token attends to: c + n/2 on
              average; attention_context_tokens is the context at which that doubles it)

r uses the longest prefix it holds (whole blocks of the prompt only). With
``remote_fetch``, r may also fetch the blocks it lacks of the longest prefix a peer holds,
at remote_bytes_per_s — it does so only when that beats recomputing them. Load and
prefill are added, not overlapped: layer-wise streaming hides part of the load, so the
model errs towards recomputing.

The pressure term is what keeps the holder of a shared prefix from drawing every new
session of a fleet whose contexts outgrow its caches: it holds the prefix, but each new
session's own context there evicts the live sessions' (live_tokens: the distinct tokens
of the sessions routed to r and not yet expired, index/live.py). A session's own growth
on its replica is priced the same way, and is small beside recomputing its context
elsewhere, so it stays.

Session affinity (`route`) is a strong prior: a session stays on its node unless that
node is not a candidate any more, or its cost exceeds the best alternative's by more than
BOTH margins of `AffinityPolicy` — i.e. the larger margin wins: the absolute one keeps
short prompts from flapping over noise, the relative one long prompts. Ties between equal
costs go to the smaller node id, so a decision never depends on input order.

An engine's own GPU prefix cache is a node of its own in the index, named
``<engine>@<replica>`` (`engine_node_id`) after the replica it serves — the node id of the
kvstore daemon beside it. `with_engine_caches` folds each engine's blocks into its
replica's match: the engine reads its GPU blocks first and loads the rest of the prefix
through its connector from the daemon, so the replica holds the longer of the two, in GPU
as far as the engine holds it. (A replica of several data-parallel engines is credited
with the one that holds the most; a peer that fetches from the replica can only have what
its daemon holds, which the model does not tell apart.)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.index.base import NodeMatch, SessionAffinity
from kvstore.tier_kind import TierKind

__all__ = [
    "CostModel",
    "AffinityPolicy",
    "Candidate",
    "Estimate",
    "RouteDecision",
    "estimate",
    "route",
    "ENGINE_SEPARATOR",
    "engine_node_id",
    "replica_of",
    "with_engine_caches",
]

_MAX_RUNS = 32  # beyond this many runs of one tier, counting block by block is as fast
ENGINE_SEPARATOR = "@"


def _check(name: str, value: float, minimum: float = 0.0, strict: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}.")
    if value < minimum or (strict and value == minimum):
        raise InvalidArgument(f"{name} must be {'>' if strict else '>='} {minimum}, got {value}.")


def _check_count(name: str, value: int, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}.")


@dataclass(frozen=True, slots=True)
class CostModel:
    """One replica's speeds; see the module docstring for how they combine."""

    prefill_tokens_per_s: float  # for an empty context
    attention_context_tokens: float
    host_bytes_per_s: float
    nvme_bytes_per_s: float
    remote_bytes_per_s: float
    decode_s_per_request: float
    remote_fetch: bool = True

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "attention_context_tokens", "host_bytes_per_s", "nvme_bytes_per_s", "remote_bytes_per_s"):
            _check(f"CostModel.{name}", getattr(self, name))
        _check("CostModel.decode_s_per_request", self.decode_s_per_request, strict=False)
        if not isinstance(self.remote_fetch, bool):
            raise InvalidArgument(f"CostModel.remote_fetch must be True or False, got {self.remote_fetch!r}.")

    def prefill_s(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        average_context = num_cached_tokens + num_new_tokens / 2
        return num_new_tokens / self.prefill_tokens_per_s * (1 + average_context / self.attention_context_tokens)

    def seconds_per_byte(self, tier: TierKind) -> float:
        if tier is TierKind.HOST:
            return 1 / self.host_bytes_per_s
        if tier is TierKind.NVME:
            return 1 / self.nvme_bytes_per_s
        if tier is TierKind.REMOTE:
            return 1 / self.remote_bytes_per_s
        return 0.0  # GPU, HBM: already in device memory


@dataclass(frozen=True, slots=True)
class AffinityPolicy:
    margin_s: float  # absolute: a move must save more than this many seconds…
    margin_ratio: float  # …and more than this fraction of the best alternative's cost

    def __post_init__(self) -> None:
        _check("AffinityPolicy.margin_s", self.margin_s, strict=False)
        _check("AffinityPolicy.margin_ratio", self.margin_ratio, strict=False)

    def margin_for(self, best_alternative_s: float) -> float:
        return max(self.margin_s, self.margin_ratio * best_alternative_s)


@dataclass(frozen=True, slots=True)
class Candidate:
    node_id: str
    queued_tokens: int = 0  # prompt tokens waiting for prefill
    active_requests: int = 0  # requests decoding
    cache_tokens: int = 0  # the tokens its caches keep; 0: not known (no pressure term)
    live_tokens: int = 0  # the distinct tokens of the live sessions on it (index/live.py)

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not self.node_id:
            raise InvalidArgument(f"a candidate needs a non-empty node id, got {self.node_id!r}.")
        _check_count("Candidate.queued_tokens", self.queued_tokens)
        _check_count("Candidate.active_requests", self.active_requests)
        _check_count("Candidate.cache_tokens", self.cache_tokens)
        _check_count("Candidate.live_tokens", self.live_tokens)


@dataclass(frozen=True, slots=True)
class Estimate:
    node_id: str
    cached_tokens: int  # its own hits plus the blocks it would fetch from a peer
    prefill_s: float
    load_s: float
    queue_s: float
    cost_s: float
    pressure_s: float = 0.0  # part of cost_s: the recompute its new blocks' evictions will cause


@dataclass(frozen=True, slots=True)
class RouteDecision:
    node_id: str
    expected_cached_tokens: int
    expected_cost_s: float
    reason: str
    moved_from: str | None  # the node the session stuck to, when it moves
    estimates: tuple[Estimate, ...]  # every candidate's, cheapest first


def estimate(
    candidate: Candidate,
    match: NodeMatch | None,
    num_prompt_tokens: int,
    block_size: int,
    block_bytes: int,
    model: CostModel,
    best_peer_blocks: int = 0,
) -> Estimate:
    """The cost of serving the prompt on ``candidate``, which holds ``match`` of it, while
    some peer holds the first ``best_peer_blocks`` blocks."""
    _check_count("num_prompt_tokens", num_prompt_tokens)
    _check_count("block_size", block_size, 1)
    _check_count("block_bytes", block_bytes)
    _check_count("best_peer_blocks", best_peer_blocks)
    if match is not None and match.node_id != candidate.node_id:
        raise InvalidArgument(f"the match of {match.node_id!r} was given for candidate {candidate.node_id!r}.")
    num_prompt_blocks = num_prompt_tokens // block_size
    tiers = match.tiers[:num_prompt_blocks] if match is not None else ()
    load_s = sum(count * block_bytes * model.seconds_per_byte(tier) for tier, count in _tier_counts(tiers).items())
    num_cached = len(tiers) * block_size
    prefill_s = model.prefill_s(num_prompt_tokens - num_cached, num_cached)
    num_fetched = min(best_peer_blocks, num_prompt_blocks) - len(tiers) if model.remote_fetch else 0
    if num_fetched > 0:
        fetch_s = num_fetched * block_bytes * model.seconds_per_byte(TierKind.REMOTE)
        num_with_fetch = num_cached + num_fetched * block_size
        prefill_with_fetch_s = model.prefill_s(num_prompt_tokens - num_with_fetch, num_with_fetch)
        if fetch_s + prefill_with_fetch_s < prefill_s:
            load_s, prefill_s, num_cached = load_s + fetch_s, prefill_with_fetch_s, num_with_fetch
    queue_s = candidate.queued_tokens / model.prefill_tokens_per_s + candidate.active_requests * model.decode_s_per_request
    pressure_s = 0.0
    if candidate.cache_tokens:
        num_new = num_prompt_tokens - len(tiers) * block_size  # blocks fetched from a peer are new here too
        room = max(candidate.cache_tokens - candidate.live_tokens, 0)
        pressure_s = max(num_new - room, 0) / model.prefill_tokens_per_s
    cost_s = queue_s + load_s + prefill_s + pressure_s
    return Estimate(candidate.node_id, num_cached, prefill_s, load_s, queue_s, cost_s, pressure_s)


def route(
    candidates: Sequence[Candidate],
    matches: Mapping[str, NodeMatch],
    num_prompt_tokens: int,
    block_size: int,
    block_bytes: int,
    model: CostModel,
    affinity: SessionAffinity | None,
    policy: AffinityPolicy,
    session_id: str = "",
) -> RouteDecision:
    """Pick the candidate to serve the prompt. ``matches`` (by node id) are what the index
    answered; every node in it counts as a peer to fetch from when ``model.remote_fetch``.

    Candidates of equal cost (typically idle replicas that hold none of a new session's
    prompt) are ranked by a rendezvous hash of the session id and the node id, then by
    fewest active requests: new sessions spread over the fleet as consistent hashing
    would spread them, instead of piling onto whichever node sorts first — and, since
    affinity keeps them there, staying piled."""
    if not candidates:
        raise InvalidArgument("route needs at least one candidate node.")
    if len({candidate.node_id for candidate in candidates}) != len(candidates):
        raise InvalidArgument("each candidate node may appear once.")
    # the longest and second-longest holders: a candidate's best peer is whichever is not itself
    longest = sorted(((m.num_blocks, node_id) for node_id, m in matches.items()), key=lambda item: (-item[0], item[1]))[:2]
    estimates = []
    for candidate in candidates:
        peers = [num_blocks for num_blocks, node_id in longest if node_id != candidate.node_id]
        best_peer_blocks = peers[0] if peers else 0
        match = matches.get(candidate.node_id)
        estimates.append(estimate(candidate, match, num_prompt_tokens, block_size, block_bytes, model, best_peer_blocks))
    active = {candidate.node_id: candidate.active_requests for candidate in candidates}
    estimates.sort(key=lambda e: (e.cost_s, _rendezvous_rank(session_id, e.node_id), active[e.node_id], e.node_id))
    best = estimates[0]
    ranked = tuple(estimates)
    if affinity is None:
        return _decision(best, f"best cost: {_describe(best)}", None, ranked)
    sticky = next((e for e in estimates if e.node_id == affinity.node_id), None)
    if sticky is None:
        reason = f"moved: {affinity.node_id} is not a candidate (gone or draining); best cost: {_describe(best)}"
        return _decision(best, reason, affinity.node_id, ranked)
    if sticky is best:
        return _decision(sticky, f"sticky: {_describe(sticky)}, also the best cost", None, ranked)
    margin_s = policy.margin_for(best.cost_s)
    comparison = f"{sticky.node_id} cost {_s(sticky.cost_s)} vs {_s(best.cost_s)} on {best.node_id}"
    if sticky.cost_s - best.cost_s <= margin_s:
        return _decision(sticky, f"sticky: {comparison}, within the margin of {_s(margin_s)}", None, ranked)
    return _decision(best, f"moved: {comparison}, beyond the margin of {_s(margin_s)}", sticky.node_id, ranked)


def engine_node_id(engine_name: str, replica_node_id: str) -> str:
    """The index's node id for the GPU cache of engine ``engine_name`` of the replica ``replica_node_id``."""
    if not engine_name or ENGINE_SEPARATOR in engine_name:
        raise InvalidArgument(f"an engine's name must be non-empty and without {ENGINE_SEPARATOR!r}, got {engine_name!r}.")
    return f"{engine_name}{ENGINE_SEPARATOR}{replica_node_id}"


def replica_of(node_id: str) -> str | None:
    """The replica whose engine's GPU cache ``node_id`` names; None for any other node."""
    engine, separator, replica = node_id.partition(ENGINE_SEPARATOR)
    return replica if separator and engine and replica else None


def with_engine_caches(matches: Sequence[NodeMatch], replica_ids: Collection[str]) -> dict[str, NodeMatch]:
    """The match of each of ``replica_ids`` that holds any of the chain: its daemon's, led by
    the GPU blocks of the longest of its engines' matches (see the module docstring)."""
    wanted = set(replica_ids)
    own: dict[str, NodeMatch] = {}
    engines: dict[str, NodeMatch] = {}
    for match in matches:
        if match.node_id in wanted:
            own[match.node_id] = match
            continue
        replica = replica_of(match.node_id)
        if replica in wanted and match.num_blocks > (engines[replica].num_blocks if replica in engines else 0):
            engines[replica] = match
    merged = dict(own)
    for replica, engine in engines.items():
        daemon_tiers = own[replica].tiers if replica in own else ()
        merged[replica] = NodeMatch(replica, engine.tiers + daemon_tiers[engine.num_blocks :])
    return merged


def _tier_counts(tiers: Sequence[TierKind]) -> dict[TierKind, int]:
    """How many blocks sit in each tier. A match is a few long runs of one tier, so each run
    is found by bisection and checked with one tuple comparison (identity first: ~1 ns a
    block) rather than compared block by block (~6 ns, or ~40 in Python) for every tier."""
    counts: dict[TierKind, int] = {}
    start, end_of_all = 0, len(tiers)
    for _run in range(_MAX_RUNS):
        if start == end_of_all:
            return counts
        tier = tiers[start]
        low, high = start + 1, end_of_all  # the first block past the run: not `tier`
        while low < high:
            middle = (low + high) // 2
            if tiers[middle] is tier:
                low = middle + 1
            else:
                high = middle
        if tuple(tiers[start:low]) != (tier,) * (low - start):
            break  # not one run after all (the tiers interleave)
        counts[tier] = counts.get(tier, 0) + low - start
        start = low
    counts = {}
    for tier in tiers:
        counts[tier] = counts.get(tier, 0) + 1
    return counts


def _rendezvous_rank(session_id: str, node_id: str) -> int:
    """Highest-random-weight order of nodes for a session (0 for every node without one)."""
    if not session_id:
        return 0
    return -xxhash.xxh64_intdigest(f"{session_id}\x00{node_id}".encode())


def _decision(chosen: Estimate, reason: str, moved_from: str | None, estimates: tuple[Estimate, ...]) -> RouteDecision:
    return RouteDecision(chosen.node_id, chosen.cached_tokens, chosen.cost_s, reason, moved_from, estimates)


def _describe(estimate_: Estimate) -> str:
    return f"{estimate_.node_id} cost {_s(estimate_.cost_s)} ({estimate_.cached_tokens:,} cached tokens)"


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s"
