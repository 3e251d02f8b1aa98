"""Closed-loop sessions on a fleet of simulated vLLM replicas (bench/sim/vllm_replica.py).

A session is a client that sends its next turn ``think_s`` after its previous turn's
answer completed — in the simulation, not at the time a measured run sent it — so how
fast the fleet serves decides when the next prompt arrives, and a run's throughput
(requests ÷ the time until the last client is done) is predicted rather than replayed.
A session's first turn is sent at its ``start_s``; a request first spends its own CPU
(``request_cpu_s`` + ``request_cpu_s_per_token`` per prompt token: the client's, the
router's and the API server's work on it — the HTTP requests, tokenizing the prompt,
returning its ids), then reaches its engine ``request_overhead_s`` later (the hops'
latency beyond that CPU), and the client sees its first token when the step that
sampled it ends.

Each replica runs one step at a time, back to back while it has work. Replicas that do
not have compute of their own share it: at most ``replica_parallelism`` steps run at full
speed at once, and with k > that many replicas mid-step each progresses at
replica_parallelism ÷ k of its speed (processor sharing; a fleet of N replicas on N
accelerators has replica_parallelism N, N engines on one host whose engines each use
all its cores about 1). On a host of ``host_cores`` cores (0: no limit) the steps also
share the cores with the CPU that runs beside them and with the requests' CPU: a step
of work w with floating CPU f beside it (its engine core's scheduling, its API server's
streaming; bench/sim/vllm_replica.py) needs 1 + f/w cores at full speed, a request's CPU
one; when what runs needs more than the host has, everything runs at cores ÷ demand of
its speed (processor sharing, as the kernel shares cores among runnable threads). One
engine alone keeps full speed while its floating CPU fits on another core.

Routing happens when a request arrives, on what the fleet shows then: each replica's
requests and load, and — for policies that read block locations — one `BlockLocations`
index fed with no delay by every engine's cache events (node ``vllm@replica-k``, tier
GPU) and every daemon's tier events (node ``replica-k``). A turn whose ``replica`` is
given is sent there when no policy is (the client's choice, replayed).

Events at equal times resolve the same way every run: steps that end first, then
requests whose CPU is done, then sends, then arrivals in the order they were queued; an
idle engine starts its next step once every request that arrived at that instant is
queued.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.engine import RequestOutcome, RunResult, _Clock
from bench.sim.policies import Fleet, RoutingPolicy
from bench.sim.replica import TierSizes
from bench.sim.vllm_replica import EngineSpec, Seq, StepSpeeds, VllmReplica, placeholder_hash
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash, chain_hashes
from kvstore.index.locations import BlockLocations
from kvstore.namespace import Namespace

__all__ = ["Turn", "Session", "FleetModel", "simulate_sessions", "turn_hashes"]


@dataclass(frozen=True, slots=True)
class Turn:
    index: int  # its position in the outcomes (the run's send order)
    prompt: tuple[int, ...]  # token ids
    answer_tokens: int
    think_s: float = 0.0  # the client's pause after this turn's answer, before its next turn
    answer: tuple[int, ...] = ()  # the answer's token ids, as far as the run shows them
    replica: int = -1  # where the client sent it (replayed when no policy routes); -1: unknown


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    start_s: float  # when its client sends its first turn
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class FleetModel:
    num_replicas: int
    engine: EngineSpec
    speeds: StepSpeeds
    namespace: Namespace  # the engines' model and KV layout (the index's and the daemons' keys)
    replica_parallelism: float = 0.0  # steps that run at full speed at once; 0: every replica's
    request_overhead_s: float = 0.0  # from a client's send to its engine, beyond the request's CPU
    cache_bytes: int = 0  # what a router that prices cache pressure is told each replica keeps
    host_cores: float = 0.0  # the cores that steps, their floating CPU and requests' CPU share; 0: no limit
    request_cpu_s: float = 0.0  # CPU of a request on its way to its engine (client, router, API server)
    request_cpu_s_per_token: float = 0.0  # and per token of its prompt (tokenizing it, returning its ids)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise InvalidArgument(f"a fleet needs at least one replica, got {self.num_replicas}.")
        if self.replica_parallelism < 0 or self.request_overhead_s < 0 or self.cache_bytes < 0:
            raise InvalidArgument("replica_parallelism, request_overhead_s and cache_bytes cannot be negative.")
        if self.host_cores < 0 or self.request_cpu_s < 0 or self.request_cpu_s_per_token < 0:
            raise InvalidArgument("host_cores, request_cpu_s and request_cpu_s_per_token cannot be negative.")

    def request_cpu(self, prompt_tokens: int) -> float:
        """CPU seconds of a request of ``prompt_tokens`` before its engine has it."""
        return self.request_cpu_s + prompt_tokens * self.request_cpu_s_per_token

    def rates(self, steps: Sequence[tuple[float, float]], num_jobs: int) -> tuple[float, float]:
        """(the speed of every running step, of every request's CPU) with ``steps`` — each
        running step's (work, floating CPU) — and ``num_jobs`` requests' CPU running at
        once: at most ``replica_parallelism`` steps at full speed, and the host's cores
        shared alike by every step (its engine's core and its floating CPU beside it,
        1 + floating ÷ work cores at full speed) and request (one core each)."""
        demand = sum(1 + (floating / work if work > 0 else 0.0) for work, floating in steps) + num_jobs
        share = min(1.0, self.host_cores / demand) if self.host_cores > 0 and demand > 0 else 1.0
        parallelism = self.replica_parallelism or float(self.num_replicas)
        step_rate = min(1.0, parallelism / len(steps), share) if steps else 0.0
        return step_rate, share
        if self.namespace.block_size != self.engine.block_tokens:
            raise InvalidArgument("the namespace's block size must be the engines' block size.")


def turn_hashes(turn: Turn, block_tokens: int, label: str) -> list[BlockHash]:
    """Chain hashes of every block of prompt + answer that the engine fills (the last
    sampled token's KV is never computed); blocks of answer tokens the run does not show
    get keys of their own (``label``), which no other prompt shares."""
    answer_tokens = max(1, turn.answer_tokens)
    num_full = (len(turn.prompt) + answer_tokens - 1) // block_tokens
    known = list(turn.prompt) + list(turn.answer[:answer_tokens])
    hashes = chain_hashes(known, block_tokens)[:num_full]
    hashes += [placeholder_hash(f"{label}/{position}") for position in range(len(hashes), num_full)]
    return hashes


def simulate_sessions(sessions: Sequence[Session], policy: RoutingPolicy | None, model: FleetModel) -> RunResult:
    """Serve ``sessions`` on a fresh fleet; ``policy`` None sends each turn to its ``replica``."""
    started = time.perf_counter()
    if not any(session.turns for session in sessions):
        raise InvalidArgument("the sessions have no turns.")
    size = model.engine.block_tokens
    clock = _Clock()
    replicas = [VllmReplica(k, model.engine, model.speeds, model.namespace, clock, model.cache_bytes) for k in range(model.num_replicas)]
    index = None
    if policy is not None and (policy.uses_index or policy.remote_fetch):
        index = BlockLocations(max_nodes=2 * model.num_replicas)
        for replica in replicas:
            index.add_node(replica.node_id)
            index.add_node(replica.engine_node_id)
    fleet = Fleet(tuple(replicas), index, model.namespace.digest, model.speeds.block_bytes)
    overhead = model.request_overhead_s

    sends: list[tuple[float, int, int, int]] = []  # (sent, order, session, turn): requests whose CPU starts then
    jobs: list[list] = []  # [CPU left, order, session, turn, sent]: requests' CPU on their way to the engines
    arrivals: list[tuple[float, int, int, int, float]] = []  # (at the engine, order, session, turn, sent)
    order = 0

    def send(session: int, turn: int, at: float) -> None:
        nonlocal order
        order += 1
        if model.request_cpu(len(sessions[session].turns[turn].prompt)) > 0:
            heapq.heappush(sends, (at, order, session, turn))
        else:
            heapq.heappush(arrivals, (at + overhead, order, session, turn, at))

    for s, session in enumerate(sessions):
        if session.turns:
            send(s, 0, session.start_s)

    def publish(replica: VllmReplica) -> None:
        for node, events in replica.drain_events():
            if index is not None:
                index.apply(node, events)

    def start(replica: VllmReplica, now: float) -> None:
        replica.schedule(now)
        publish(replica)

    seqs: dict[int, Seq] = {}
    where: dict[int, tuple[int, int]] = {}  # a turn's index -> (session, turn)
    makespan = 0.0
    now = 0.0
    while True:
        busy = [replica for replica in replicas if replica.step is not None]
        step_rate, job_rate = model.rates([(r.step.work_s, r.step.floating_s) for r in busy], len(jobs))
        step_end = now + min(r.step.remaining_s for r in busy) / step_rate if busy else math.inf
        job_end = now + min(job[0] for job in jobs) / job_rate if jobs else math.inf
        sent_at = sends[0][0] if sends else math.inf
        arrival = arrivals[0][0] if arrivals else math.inf
        # at equal times: steps end first, then requests' CPU, then sends, then arrivals
        upcoming = min(step_end, job_end, sent_at, arrival)
        if upcoming == math.inf:
            break
        elapsed = upcoming - now
        for replica in busy:
            replica.step.remaining_s = max(0.0, replica.step.remaining_s - elapsed * step_rate)
        for job in jobs:
            job[0] = max(0.0, job[0] - elapsed * job_rate)
        now = clock.now = upcoming
        if step_end == upcoming:
            # the step(s) with the least work left end; the others have progressed as far
            least = min(r.step.remaining_s for r in busy)
            ending = [r for r in busy if r.step.remaining_s <= least + 1e-12 * max(1.0, r.step.work_s)]
            for replica in ending:
                for seq in replica.finish_step(now):
                    s, t = where[seq.index]
                    turns = sessions[s].turns
                    if t + 1 < len(turns):
                        send(s, t + 1, now + turns[t].think_s)
                    else:
                        makespan = max(makespan, now + turns[t].think_s)
                publish(replica)
                start(replica, now)
            continue
        if job_end == upcoming:
            least = min(job[0] for job in jobs)
            done = [job for job in jobs if job[0] <= least + 1e-12]
            for job in done:
                jobs.remove(job)
                _, job_order, s, t, sent_s = job
                heapq.heappush(arrivals, (now + overhead, job_order, s, t, sent_s))
            continue
        if sent_at == upcoming:
            sent_s, job_order, s, t = heapq.heappop(sends)
            jobs.append([model.request_cpu(len(sessions[s].turns[t].prompt)), job_order, s, t, sent_s])
            continue
        _, _, s, t, sent_s = heapq.heappop(arrivals)
        session, turn = sessions[s], sessions[s].turns[t]
        hashes = turn_hashes(turn, size, f"{session.session_id}/{t}")
        prompt_blocks = tuple(hashes[: len(turn.prompt) // size])
        request = Request(now, session.session_id, prompt_blocks, len(turn.prompt), max(1, turn.answer_tokens), size)
        seq = Seq(turn.index, request, hashes, sent_s)
        if turn.index in seqs:
            raise InvalidArgument(f"two turns have the index {turn.index}.")
        seqs[turn.index] = seq
        where[turn.index] = (s, t)
        if policy is None:
            if not 0 <= turn.replica < len(replicas):
                raise InvalidArgument(f"turn {turn.index} of {session.session_id} has no replica to replay ({turn.replica}).")
            chosen = turn.replica
        else:
            chosen = policy.choose(request, fleet, now)
        replicas[chosen].enqueue(seq)
        if not (arrivals and arrivals[0][0] <= now):  # an engine takes every request that arrived at once
            for replica in replicas:
                if replica.step is None and replica.waiting:
                    start(replica, now)
    counters: dict[str, int] = {}
    for replica in replicas:
        for name, value in replica.counters.items():
            counters[name] = counters.get(name, 0) + value
        counters["engine_evictions"] = counters.get("engine_evictions", 0) + replica.cache.num_evicted
    unserved = [turn.index for session in sessions for turn in session.turns if turn.index not in seqs or seqs[turn.index].done_s < 0]
    if unserved:
        raise InvalidArgument(f"turns {unserved[:5]} were never served; the fleet cannot fit them.")
    outcomes = tuple(_outcome(seqs[k]) for k in sorted(seqs))
    engine_bytes = (model.engine.num_blocks - 1) * model.speeds.block_bytes
    return RunResult(
        policy=policy.name if policy is not None else "replay",
        model=model.namespace.model_id,
        tier_sizes=TierSizes(engine_bytes, model.engine.host_blocks * model.speeds.block_bytes, 0),
        outcomes=outcomes,
        counters=dict(sorted(counters.items())),
        num_replicas=model.num_replicas,
        block_tokens=size,
        wall_s=time.perf_counter() - started,
        makespan_s=makespan,
    )


def _outcome(seq: Seq) -> RequestOutcome:
    return RequestOutcome(
        index=seq.index,
        session_id=seq.request.session_id,
        replica=seq.replica,
        arrival_s=seq.sent_s,
        start_s=seq.start_s,
        first_token_s=seq.first_token_s,
        done_s=seq.done_s,
        num_prompt_tokens=seq.prompt_len,
        hit_blocks=(seq.local_blocks, seq.external_blocks, 0, 0),
        num_computed_tokens=seq.prompt_len - seq.cached_tokens,
    )
