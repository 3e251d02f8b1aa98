"""The discrete-event loop: requests arrive, a policy routes them, replicas serve them.

Time model (every speed from the model preset, bench/sim/models.py):

- a replica prefills one prompt at a time, first come first served (replica.py);
- TTFT = time queued + load of the cached blocks from the tier each was in (HBM free;
  host, NVMe and a peer at their bandwidths) + prefill of the rest, with attention cost
  growing with context (`CostModel.prefill_s`, the production formula);
- decode runs as a concurrent batch (continuous batching): a request finishes
  output_tokens × decode_s_per_token after its first token and never delays another
  prompt's prefill. Chosen over occupying the replica for the whole decode, which would
  serialize what engines batch and make every replica decode-bound; the cost is that
  decode steps stealing time from prefill (chunked prefill) are not modeled, so TTFT
  under heavy decode load is optimistic for every policy alike.

Events: arrivals in workload order; a prefill's end and a decode's end are scheduled on
a heap keyed by (time, sequence number), so equal times resolve the same way every run,
and everything due by an arrival happens before it. After every step that touches a
replica's tier manager its events are drained and, when the policy reads block
locations, applied to the fleet's `BlockLocations` — the production event path, with no
publishing delay.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.models import ModelPreset
from bench.sim.policies import Fleet, RoutingPolicy, make_policy
from bench.sim.replica import Job, Replica, TierSizes, build_manager, replica_index
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.index.locations import BlockLocations
from kvstore.tier_kind import TierKind

__all__ = ["SimConfig", "RequestOutcome", "RunResult", "simulate"]

_PREFILL_DONE, _DECODE_DONE = 0, 1


@dataclass(frozen=True, slots=True)
class SimConfig:
    model: ModelPreset
    tier_sizes: TierSizes  # per replica
    num_replicas: int = 8
    eviction_policy: str = "leaf-first-lru"
    remote_fetch: bool = True  # for policies whose replicas fetch from peers (kvstore)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise InvalidArgument(f"num_replicas must be at least 1, got {self.num_replicas}.")


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    index: int  # position in the workload
    session_id: str
    replica: int
    arrival_s: float
    start_s: float  # its prefill began
    first_token_s: float
    done_s: float
    num_prompt_tokens: int
    hit_blocks: tuple[int, ...]  # cached blocks used, by source tier (replica.HIT_TIERS)
    num_computed_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def num_cached_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_computed_tokens


@dataclass(frozen=True, slots=True)
class RunResult:
    policy: str
    model: str
    tier_sizes: TierSizes
    outcomes: tuple[RequestOutcome, ...]  # in workload order
    counters: dict[str, int]  # the replicas' tier-manager counters, summed
    num_replicas: int
    block_tokens: int
    wall_s: float  # how long the simulation itself took
    # closed-loop runs (closed_loop.py): simulated seconds until every session's client was
    # done (its last answer and the pause after it); 0 for a replayed trace
    makespan_s: float = 0.0


class _Clock:
    """Simulated time, which every replica's tier manager reads (last access, deadlines)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(requests: Sequence[Request], policy: str | RoutingPolicy, config: SimConfig) -> RunResult:
    """Serve ``requests`` (in arrival order) on a fresh fleet routed by ``policy``."""
    started = time.perf_counter()
    if not requests:
        raise InvalidArgument("the workload has no requests.")
    block_tokens = requests[0].block_tokens
    if any(r.block_tokens != block_tokens for r in requests):
        raise InvalidArgument("every request of a workload must use one block size.")
    model = config.model
    namespace = model.namespace(block_tokens)
    speeds = model.cost_model(remote_fetch=config.remote_fetch)
    router = make_policy(policy, config.num_replicas, speeds) if isinstance(policy, str) else policy
    clock = _Clock()
    replicas = []
    for k in range(config.num_replicas):
        manager = build_manager(config.tier_sizes, namespace.block_bytes, config.eviction_policy, clock)
        manager.register_namespace(namespace)
        replicas.append(Replica(k, manager, namespace, speeds))
    index = None
    if router.uses_index or router.remote_fetch:
        index = BlockLocations(max_nodes=max(1, config.num_replicas))
        for replica in replicas:
            index.add_node(replica.node_id)
    fleet = Fleet(tuple(replicas), index, namespace.digest, namespace.block_bytes)
    loop = _Loop(fleet, clock, model.decode_s_per_token, router.remote_fetch)
    jobs = []
    for position, request in enumerate(requests):
        loop.run_until(request.arrival_s)
        clock.now = max(clock.now, request.arrival_s)
        job = Job(position, request)
        jobs.append(job)
        chosen = router.choose(request, fleet, clock.now)
        replicas[chosen].enqueue(job)
        if replicas[chosen].current is None:
            loop.begin(replicas[chosen])
    loop.run_until(float("inf"))
    counters: dict[str, int] = {}
    for replica in replicas:
        for name, value in replica.manager.counters.items():
            counters[name] = counters.get(name, 0) + value
    return RunResult(
        policy=router.name,
        model=model.name,
        tier_sizes=config.tier_sizes,
        outcomes=tuple(_outcome(job) for job in jobs),
        counters=dict(sorted(counters.items())),
        num_replicas=config.num_replicas,
        block_tokens=block_tokens,
        wall_s=time.perf_counter() - started,
    )


class _Loop:
    def __init__(self, fleet: Fleet, clock: _Clock, decode_s_per_token: float, remote_fetch: bool) -> None:
        self._fleet = fleet
        self._clock = clock
        self._decode_s_per_token = decode_s_per_token
        self._remote_fetch = remote_fetch
        self._heap: list[tuple[float, int, int, int, Job | None]] = []
        self._sequence = 0

    def run_until(self, until: float) -> None:
        heap, replicas, clock = self._heap, self._fleet.replicas, self._clock
        while heap and heap[0][0] <= until:
            when, _, kind, k, job = heapq.heappop(heap)
            clock.now = when
            replica = replicas[k]
            if kind == _DECODE_DONE:
                replica.decoded(job, when)
                continue
            finished = replica.finish(when)
            self._publish(replica)
            self._push(when + finished.request.num_output_tokens * self._decode_s_per_token, _DECODE_DONE, k, finished)
            if replica.waiting:
                self.begin(replica)

    def begin(self, replica: Replica) -> None:
        now = self._clock.now
        peer_tiers = self._peer_prefix(replica, replica.waiting[0].request) if self._remote_fetch else ()
        ends_at = replica.begin(now, peer_tiers)
        self._publish(replica)
        self._push(ends_at, _PREFILL_DONE, replica.index, None)

    def _push(self, when: float, kind: int, replica: int, job: Job | None) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, (when, self._sequence, kind, replica, job))

    def _publish(self, replica: Replica) -> None:
        events = replica.manager.events.drain()
        if self._fleet.index is not None and events:
            self._fleet.index.apply(replica.node_id, events)

    def _peer_prefix(self, replica: Replica, request: Request) -> list[TierKind]:
        """The tiers of the longest prefix of ``request`` that a peer holds, as the index
        names the peer and that peer's tiers confirm (the index is advisory)."""
        fleet = self._fleet
        if fleet.index is None or not request.block_hashes:
            return []
        for match in fleet.index.match(fleet.namespace, request.block_hashes):
            if match.node_id != replica.node_id:
                peer = fleet.replicas[replica_index(match.node_id)]
                return peer.manager.lookup(fleet.namespace, request.block_hashes[: match.num_blocks])
        return []


def _outcome(job: Job) -> RequestOutcome:
    request = job.request
    return RequestOutcome(
        index=job.index,
        session_id=request.session_id,
        replica=job.replica,
        arrival_s=request.arrival_s,
        start_s=job.start_s,
        first_token_s=job.first_token_s,
        done_s=job.done_s,
        num_prompt_tokens=request.num_prompt_tokens,
        hit_blocks=tuple(job.hits),
        num_computed_tokens=job.new_tokens,
    )
