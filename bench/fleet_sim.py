"""The routing simulator's prediction of a bench.fleet run, next to what the run measured.

The simulator (bench/sim) gets the run itself, not tuned constants, and predicts each
stack's token hit rate and throughput from the same model, whichever cache regime the
stack is in — the engines' own prefix caches, kvstore's tiers behind them, or both:

- the sessions: every request the run sent, in its session's order, its prompt's token
  ids keyed with kvstore's chain hashes at the engines' block size, its answer's length
  (and the answer's tokens, which the session's next prompt holds); each session's first
  turn leaves at the time the run sent it, each later turn ``think_s`` after the previous
  answer completed *in the simulation* (bench/sim/closed_loop.py) — a closed loop, so
  the fleet's speed decides when prompts arrive and the run's requests/s is predicted;
- the engines (bench/sim/vllm_replica.py, bench/sim/engine_cache.py): vLLM v1's
  scheduler step by step — a token budget per step (``max_num_batched_tokens``) that
  decodes and chunks of prompts share, admission only when a request's whole sequence
  fits the free blocks, preemption of the last running request when a block is missing
  — over the engine's own prefix cache: ``engine_blocks`` blocks (or what
  ``engine_kv_cache_bytes`` holds in the engines' KV layout), running requests' blocks
  pinned, freed blocks in an LRU free queue tail first, so a prefix's later blocks go
  before its earlier ones. With prefix caching off the budget still bounds what runs;
  nothing is found in it;
- the daemons (``host_capacity_bytes`` > 0): each replica's host tier is kvstore's
  production tier manager over a capacity-only tier; the connector offers the prompt's
  blocks it holds beyond the engine's hit, and saves each prompt block a step computes;
  no NVMe tier, no remote fetch (the router runs with ``remote_fetch = false``);
- the speeds, every one measured by `calibrate` in bench/fleet.py on the same engines
  before the runs (never taken from the runs themselves):

  - a step costs its own part (``decode_step_s``) plus its tokens: a chunk of a prompt
    new tokens × (1 + (context + new/2) ÷ the attention context) ÷ the prefill rate (the
    rate measured on cold prompts, the calibration prompt's steps, its admission and its
    attention taken out given its length, ``prefill_prompt_tokens``; the attention
    context from the model's geometry, `models.attention_context_tokens`); its decodes
    together ``decode_seq_s`` each and ``decode_context_s_per_token`` per distinct token
    of context they read — a prefix several sessions share is read once a step
    (`decode_costs`: fitted to decode steps, the time between two streamed chunks, of
    one request and of a replica's share of the sessions, at a one-block context and at
    a first turn's: the sessions' shared prefix and a context of each one's own);
  - ``admission_s`` for each request the step admits (`admission_cost`: what requests
    of the workload's kind, their prompts held, add to the steps of requests decoding
    on the engine they are sent to, beyond their own token);
  - the connector's loads, ``load_request_s`` a request and ``load_block_s`` a block
    (`load_costs`: prompts of two lengths the daemons held and the engines no longer
    did, against prompts the engines held; where the calibration's prompts never left
    the engines' caches, a copy at the host's measured copy rate), and its saves, a copy
    at that rate;
  - beside each step, CPU that is not its engine's own core's — the engine core's
    scheduling, the API server's handling of each sampled token — runs on the host's
    shared cores (``floating_step_s`` + ``floating_token_s`` per sampling request,
    `floating_cpu`: fitted to how much the decode steps slow when every engine steps at
    once, the engines' compute threads each bound to a core of their own);
  - each request spends CPU on its way to its engine: the client's and the API server's
    (the HTTP request, tokenizing the prompt, returning its ids; ``request_cpu_s`` +
    ``request_cpu_s_per_token``, `request_cpu`: the API server's process and the
    client's thread, to the nanosecond, over requests of the workload's kind at two
    prompt lengths) and, behind a router, the router's (its processes' CPU per request
    while calibration requests go through it), plus the latency beyond that CPU
    (``request_overhead_s`` and the router's ``overhead_s``, `router_cost`);
  - steps, their floating CPU and the requests' CPU share the host's ``host_cores``
    (bench/sim/closed_loop.py); replicas that share one host's cores share its compute
    besides (``replica_parallelism``: how many engines prefill at full speed at once;
    default, each replica its own hardware).

  A setup measured without these terms prices a step as before them: a one-request
  decode step (``decode_s_per_request``) plus its tokens, each decode as a prompt token,
  and nothing else takes the cores;
- the routing: ``replay`` sends each request where the run says it went (round-robin
  and session hash, chosen by the client); otherwise the policy the stack's name ends in
  routes — ``round_robin``, ``session_hash``, ``kvstore`` (the simulator's kvstore
  policy with the router's ``[routing]`` speeds, the engines' caches folded into their
  replicas' matches as the router folds their KV events), ``vllm_router_cache_aware``
  and ``vllm_router_kv_aware`` (vllm-router's policies, bench/sim/policies.py).

The engines report a request's cached tokens as their own hit plus the connector's at
its first admission; so does the simulator, and the hit rate compared is cached ÷
prompt tokens over the run. Throughput compared is requests ÷ seconds: the measured
run's duration against the simulated time until the last client was done.

What the simulator does not model, and so where its errors come from: the daemons'
and Redis's CPU (indexing the engines' KV events, the connector's lookups and saves: a
few milliseconds per request), costs that grow beyond what the calibration requests
show (later turns' decodes read more context of their own, which the fit prices
linearly; requests that wait for room are looked up again), what earlier stacks of the
same run left behind (each simulated stack starts cold), and vLLM's async scheduling.

`save_runs` writes what `predict` takes of a run — every request as sent and seen, the
run's seconds, the engine sets' `fleet_setup` arguments with their calibration, each
stack's policy — to a JSON file, and `load_runs` reads it back (``python -m bench.fleet
--predict-from FILE``): the model can be worked on without the engines.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from bench.sim.closed_loop import FleetModel, Session, Turn, simulate_sessions
from bench.sim.engine import RunResult, SimConfig
from bench.sim.models import ModelPreset, attention_context_tokens
from bench.sim.policies import KvstoreCost, RoundRobin, RoutingPolicy, SessionHash, VllmRouterCacheAware, VllmRouterKvAware
from bench.sim.replica import TierSizes
from bench.sim.vllm_replica import EngineSpec, StepSpeeds
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.hashing import chain_hashes
from kvstore.index.scoring import CostModel
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

__all__ = [
    "SentRequest",
    "FleetSetup",
    "Prediction",
    "ROUTINGS",
    "llama_layer_params",
    "engine_layout",
    "fleet_setup",
    "sim_model",
    "sim_config",
    "sim_requests",
    "fleet_model",
    "sessions_of",
    "routing_of",
    "predict",
    "replica_parallelism",
    "decode_costs",
    "floating_cpu",
    "request_cpu",
    "admission_cost",
    "load_costs",
    "router_cost",
    "copy_bytes_per_s",
    "SavedRuns",
    "save_runs",
    "load_runs",
]

GiB = 1024**3
# vLLM's defaults for its OpenAI server on CPU (vllm/engine/arg_utils.py)
CPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_MAX_NUM_SEQS = 128
# the routing policies a stack's name may end in
ROUTINGS = ("round_robin", "session_hash", "kvstore", "vllm_router_cache_aware", "vllm_router_kv_aware")


@dataclass(frozen=True, slots=True)
class SentRequest:
    """One request of a measured run, as the client sent and saw it."""

    session: str
    sent_s: float  # since the policy's run began
    prompt: tuple[int, ...]  # token ids
    answer_tokens: int
    replica: str  # the node that served it ("" where the run cannot say, e.g. behind vllm-router)
    ttft_s: float  # to the first streamed chunk
    prompt_tokens: int  # as the engine counted them (its usage)
    cached_tokens: int  # as the engine reported them
    think_s: float = 0.0  # the client's pause after this answer before the session's next turn
    answer_ids: tuple[int, ...] = ()  # the answer's token ids as generated; (): read from the session's next prompt


@dataclass(frozen=True, slots=True)
class FleetSetup:
    """How the measured fleet was configured, and the speeds measured on it."""

    replica_ids: tuple[str, ...]
    model_id: str
    layout: KVLayout  # the engines' KV layout (its block_size is the engines' block size)
    host_capacity_bytes: int  # each daemon's host tier (0: no daemon)
    max_model_len: int
    prefix_caching: bool  # the engines' own prefix cache
    engine_kv_cache_bytes: int  # VLLM_CPU_KVCACHE_SPACE
    linear_params: float  # per token, the model's layers (no embedding, no LM head)
    num_query_heads: int
    prefill_tokens_per_s: float
    decode_s_per_token: float  # a decode step of one request
    host_bytes_per_s: float
    engine_blocks: int = 0  # each engine's KV cache in blocks (--num-gpu-blocks-override); 0: engine_kv_cache_bytes's
    max_num_batched_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = CPU_MAX_NUM_SEQS
    replica_parallelism: float = 0.0  # replicas' steps at full speed at once; 0: every replica's (own hardware)
    request_overhead_s: float = 0.0  # from a client's send to its engine
    prefill_prompt_tokens: int = 0  # the calibration prompt behind prefill_tokens_per_s; 0: take it as the base rate
    router_cache_bytes: int | None = None  # what kvstore's router is told a replica keeps; None: host_capacity_bytes
    # a decode step's parts (`decode_costs`); decode_seq_s None: a step costs decode_s_per_token
    # beyond its tokens, and a decode token is priced as a prompt token
    decode_step_s: float = 0.0
    decode_seq_s: float | None = None
    decode_context_s_per_token: float = 0.0
    floating_step_s: float = 0.0  # CPU beside each step on the host's shared cores (`floating_cpu`)
    floating_token_s: float = 0.0  # and per request sampling a token in it
    host_cores: float = 0.0  # the cores the replicas and the requests' CPU share; 0: no limit
    request_cpu_s: float = 0.0  # a request's CPU on its way to its engine (`request_cpu`)
    request_cpu_s_per_token: float = 0.0  # and per prompt token
    admission_s: float = 0.0  # what a request's admission costs a busy engine's step beyond its tokens (`admission_cost`)
    load_request_s: float = 0.0  # a request's load through the connector (`load_costs`), and
    load_block_s: float = 0.0  # each block it loads; 0 (both): a copy at host_bytes_per_s
    # per routing policy (`ROUTINGS`) whose router was measured in front of these engines: its CPU
    # per request ("cpu_s") and the latency it adds beyond that CPU ("overhead_s")
    routers: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.replica_ids:
            raise InvalidArgument("a fleet needs at least one replica.")
        positive = ("max_model_len", "linear_params", "prefill_tokens_per_s", "host_bytes_per_s", "max_num_batched_tokens", "max_num_seqs")
        for name in positive:
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"FleetSetup.{name} must be positive, got {getattr(self, name)}.")
        if self.host_capacity_bytes < 0 or self.engine_kv_cache_bytes < 0 or self.engine_blocks < 0:
            raise InvalidArgument("cache capacities cannot be negative.")
        others = ("decode_step_s", "decode_context_s_per_token", "floating_step_s", "floating_token_s", "host_cores")
        others += ("request_cpu_s", "request_cpu_s_per_token", "admission_s", "load_request_s", "load_block_s")
        for name in ("decode_s_per_token", "replica_parallelism", "request_overhead_s", "prefill_prompt_tokens", *others):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"FleetSetup.{name} cannot be negative, got {getattr(self, name)}.")
        if self.decode_seq_s is not None and self.decode_seq_s < 0:
            raise InvalidArgument(f"FleetSetup.decode_seq_s cannot be negative, got {self.decode_seq_s}.")
        if self.num_engine_blocks < 2:
            raise InvalidArgument(
                f"each engine needs a KV cache of at least 2 blocks; engine_blocks {self.engine_blocks}, "
                f"engine_kv_cache_bytes {self.engine_kv_cache_bytes:,} at {self.layout.block_bytes:,} bytes a block."
            )

    @property
    def step_overhead_s(self) -> float:
        """A step's cost beyond its tokens: the measured decode step's own part, or (not
        measured) a whole one-request decode step."""
        return self.decode_step_s if self.decode_seq_s is not None else self.decode_s_per_token

    @property
    def num_engine_blocks(self) -> int:
        """Each engine's KV cache in blocks, as vLLM counts them (one is its null block)."""
        return self.engine_blocks or self.engine_kv_cache_bytes // self.layout.block_bytes


@dataclass(frozen=True, slots=True)
class Prediction:
    policy: str
    measured_hit_rate: float
    predicted_hit_rate: float
    measured_ttft_p50_s: float
    predicted_ttft_p50_s: float
    predicted_requests_per_s: float = math.nan  # modelled: requests ÷ the simulated time until the last client was done
    measured_requests_per_s: float = math.nan  # requests ÷ the measured run's duration (nan: not given)

    @property
    def hit_rate_error(self) -> float:
        return _relative_error(self.predicted_hit_rate, self.measured_hit_rate)

    @property
    def ttft_p50_error(self) -> float:
        return _relative_error(self.predicted_ttft_p50_s, self.measured_ttft_p50_s)

    @property
    def throughput_error(self) -> float:
        """|predicted − measured| ÷ measured requests/s; nan when the run's duration was not given."""
        return _relative_error(self.predicted_requests_per_s, self.measured_requests_per_s)


def _relative_error(predicted: float, measured: float) -> float:
    """|predicted − measured| ÷ measured (0 when both are 0; nan when either is)."""
    if math.isnan(predicted) or math.isnan(measured):
        return math.nan
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return abs(predicted - measured) / measured


def llama_layer_params(config: dict) -> float:
    """Linear parameters a prompt token goes through in a Llama's layers (q, k, v, o and the
    gated MLP), from its config.json; the LM head runs on the last token only."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    attention = hidden * head_dim * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    mlp = 3 * hidden * config["intermediate_size"]
    return float(config["num_hidden_layers"] * (attention + mlp))


def engine_layout(model_config: dict, block_size: int) -> KVLayout:
    """The KV layout the engines of a bench.fleet run cache: the model's config.json (a
    Llama served in bf16), K and V of every layer."""
    return KVLayout(
        model_config["num_hidden_layers"],
        model_config["num_key_value_heads"],
        model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"],
        block_size,
        "bfloat16",
        2,
    )


def fleet_setup(
    model_config: dict,
    model_id: str,
    replica_ids: Sequence[str],
    block_size: int,
    host_capacity_bytes: int,
    max_model_len: int,
    prefix_caching: bool,
    engine_kv_cache_bytes: int,
    measured: dict,
    *,
    engine_blocks: int = 0,
    max_num_batched_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS,
    max_num_seqs: int = CPU_MAX_NUM_SEQS,
    router_cache_bytes: int | None = None,
) -> FleetSetup:
    """The setup of a bench.fleet run: the model's config.json (a Llama served in bf16),
    the fleet's configuration (``host_capacity_bytes`` 0 for a stack without daemons;
    ``prefix_caching`` for engines that cache; ``engine_blocks`` for an engine given
    ``--num-gpu-blocks-override``, else its cache is what ``engine_kv_cache_bytes``
    holds), and ``measured`` — ``prefill_tokens_per_s``, ``decode_s_per_request`` (a
    decode step, as bench.fleet's `calibrate` measures them) and ``host_bytes_per_s``;
    optionally ``prefill_prompt_tokens`` (the calibration prompt's length),
    ``replica_parallelism`` (see `replica_parallelism`), ``request_overhead_s``, and the
    simulator's terms `calibrate` measures: ``decode_step_s``, ``decode_seq_s`` and
    ``decode_context_s_per_token`` (`decode_costs`), ``floating_step_s`` and
    ``floating_token_s`` (`floating_cpu`), ``host_cores``, ``request_cpu_s`` and
    ``request_cpu_s_per_token`` (`request_cpu`), ``admission_s`` (`admission_cost`),
    ``load_request_s`` and ``load_block_s`` (`load_costs`) and ``routers`` (routing
    policy → `router_cost`)."""
    layout = engine_layout(model_config, block_size)
    return FleetSetup(
        replica_ids=tuple(replica_ids),
        model_id=model_id,
        layout=layout,
        host_capacity_bytes=host_capacity_bytes,
        max_model_len=max_model_len,
        prefix_caching=prefix_caching,
        engine_kv_cache_bytes=engine_kv_cache_bytes,
        linear_params=llama_layer_params(model_config),
        num_query_heads=model_config["num_attention_heads"],
        prefill_tokens_per_s=measured["prefill_tokens_per_s"],
        decode_s_per_token=measured["decode_s_per_request"],
        host_bytes_per_s=measured["host_bytes_per_s"],
        engine_blocks=engine_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        replica_parallelism=float(measured.get("replica_parallelism", 0.0)),
        request_overhead_s=float(measured.get("request_overhead_s", 0.0)),
        prefill_prompt_tokens=int(measured.get("prefill_prompt_tokens", 0)),
        router_cache_bytes=router_cache_bytes,
        decode_step_s=float(measured.get("decode_step_s", 0.0)),
        decode_seq_s=float(measured["decode_seq_s"]) if measured.get("decode_seq_s") is not None else None,
        decode_context_s_per_token=float(measured.get("decode_context_s_per_token", 0.0)),
        floating_step_s=float(measured.get("floating_step_s", 0.0)),
        floating_token_s=float(measured.get("floating_token_s", 0.0)),
        host_cores=float(measured.get("host_cores", 0.0)),
        request_cpu_s=float(measured.get("request_cpu_s", 0.0)),
        request_cpu_s_per_token=float(measured.get("request_cpu_s_per_token", 0.0)),
        admission_s=float(measured.get("admission_s", 0.0)),
        load_request_s=float(measured.get("load_request_s", 0.0)),
        load_block_s=float(measured.get("load_block_s", 0.0)),
        routers={routing: {k: float(v) for k, v in costs.items()} for routing, costs in measured.get("routers", {}).items()},
    )


def _attention_context(setup: FleetSetup) -> float:
    layout = setup.layout
    return attention_context_tokens(setup.linear_params, layout.num_layers, setup.num_query_heads, layout.head_dim, layout.head_dim)


def sim_model(setup: FleetSetup) -> ModelPreset:
    layout = setup.layout
    return ModelPreset(
        name="measured",
        model_id=setup.model_id,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        kv_planes=layout.kv_planes,
        dtype=layout.dtype,
        prefill_tokens_per_s=setup.prefill_tokens_per_s,
        attention_context_tokens=_attention_context(setup),
        decode_s_per_token=setup.decode_s_per_token,
        host_bytes_per_s=setup.host_bytes_per_s,
        nvme_bytes_per_s=setup.host_bytes_per_s,  # no NVMe tier: never used
        remote_bytes_per_s=setup.host_bytes_per_s,  # no remote fetch: never used
    )


def sim_config(setup: FleetSetup) -> SimConfig:
    """The trace simulator's configuration of the fleet (bench/sim/engine.py), whose HBM
    tier stands for the engine's cache: its blocks where the engine caches prefixes, else
    one ``max_model_len`` prompt (what a prefill occupies)."""
    block_bytes = setup.layout.block_bytes
    block_size = setup.layout.block_size
    prefill_blocks = -(-setup.max_model_len // block_size)
    engine_blocks = setup.num_engine_blocks if setup.prefix_caching else 0
    sizes = TierSizes(
        hbm_bytes=max(prefill_blocks, engine_blocks) * block_bytes,
        host_bytes=(setup.host_capacity_bytes // block_bytes) * block_bytes,
        nvme_bytes=0,
    )
    return SimConfig(sim_model(setup), sizes, len(setup.replica_ids), remote_fetch=False)


def sim_requests(sent: Sequence[SentRequest], block_size: int) -> list[Request]:
    """The run's requests in the order they were sent, keyed as the connector keys them."""
    ordered = sorted(sent, key=lambda r: r.sent_s)
    return [
        Request(
            arrival_s=r.sent_s,
            session_id=r.session,
            block_hashes=tuple(chain_hashes(list(r.prompt), block_size)),
            num_prompt_tokens=len(r.prompt),
            num_output_tokens=r.answer_tokens,
            block_tokens=block_size,
        )
        for r in ordered
    ]


def base_prefill_tokens_per_s(setup: FleetSetup) -> float:
    """The prefill rate at an empty context (modelled): the measured rate with the
    calibration prompt's steps' own part, its admission and its attention taken out,
    where its length is known; else the measured rate itself."""
    tokens = setup.prefill_prompt_tokens
    if not tokens:
        return setup.prefill_tokens_per_s
    measured_s = tokens / setup.prefill_tokens_per_s
    steps = -(-tokens // setup.max_num_batched_tokens)
    compute_s = measured_s - steps * setup.step_overhead_s - setup.admission_s
    if compute_s <= 0:
        return setup.prefill_tokens_per_s
    # Σ over its chunks of chunk × (1 + (context + chunk/2) / A) = n + n² / 2A, however chunked
    work = tokens + tokens * tokens / (2 * _attention_context(setup))
    return work / compute_s


def fleet_model(setup: FleetSetup, routing: str = "") -> FleetModel:
    """The closed-loop simulator's fleet for ``setup``, its requests sent through the router
    of ``routing`` (one of `ROUTINGS`): its measured CPU per request joins the request's
    CPU, and the latency it adds beyond that the request's overhead ("" or a router not
    measured: the client's own routing)."""
    layout = setup.layout
    engine = EngineSpec(
        num_blocks=setup.num_engine_blocks,
        block_tokens=layout.block_size,
        prefix_caching=setup.prefix_caching,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        host_blocks=setup.host_capacity_bytes // layout.block_bytes,
    )
    speeds = StepSpeeds(
        prefill_tokens_per_s=base_prefill_tokens_per_s(setup),
        attention_context_tokens=_attention_context(setup),
        step_overhead_s=setup.step_overhead_s,
        host_bytes_per_s=setup.host_bytes_per_s,
        block_bytes=layout.block_bytes,
        decode_seq_s=setup.decode_seq_s,
        decode_context_s_per_token=setup.decode_context_s_per_token,
        floating_step_s=setup.floating_step_s,
        floating_token_s=setup.floating_token_s,
        admission_s=setup.admission_s,
        load_request_s=setup.load_request_s,
        load_block_s=setup.load_block_s,
    )
    cache_bytes = setup.host_capacity_bytes if setup.router_cache_bytes is None else setup.router_cache_bytes
    router = setup.routers.get(routing, {})
    return FleetModel(
        num_replicas=len(setup.replica_ids),
        engine=engine,
        speeds=speeds,
        namespace=Namespace(setup.model_id, layout),
        replica_parallelism=setup.replica_parallelism,
        request_overhead_s=setup.request_overhead_s + router.get("overhead_s", 0.0),
        cache_bytes=cache_bytes,
        host_cores=setup.host_cores,
        request_cpu_s=setup.request_cpu_s + router.get("cpu_s", 0.0),
        request_cpu_s_per_token=setup.request_cpu_s_per_token,
    )


def sessions_of(sent: Sequence[SentRequest], setup: FleetSetup, replay: bool) -> list[Session]:
    """The run's sessions: each one's requests in the order it sent them (a turn's index is
    its place in the run's send order), its first turn at the time the run sent it, each
    answer's tokens as generated (``answer_ids``) or else as the session's next prompt
    holds them, where that prompt extends this one (the engine's cached answer blocks hit
    the next prompt as far as its token ids agree); with ``replay``, the replica each
    request went to."""
    ordered = sorted(range(len(sent)), key=lambda k: sent[k].sent_s)
    position = {k: place for place, k in enumerate(ordered)}
    index_of = {node: k for k, node in enumerate(setup.replica_ids)}
    by_session: dict[str, list[int]] = {}
    for k in ordered:
        by_session.setdefault(sent[k].session, []).append(k)
    sessions = []
    for session, members in by_session.items():
        turns = []
        for j, k in enumerate(members):
            request = sent[k]
            answer = request.answer_ids
            if not answer and j + 1 < len(members):
                following = sent[members[j + 1]].prompt
                if following[: len(request.prompt)] == request.prompt:
                    answer = following[len(request.prompt) : len(request.prompt) + request.answer_tokens]
            replica = -1
            if replay:
                if request.replica not in index_of:
                    raise InvalidArgument(
                        f"cannot replay: a request of session {session!r} went to {request.replica!r}, "
                        f"not one of {list(setup.replica_ids)} (route it with a policy instead: replay=False)."
                    )
                replica = index_of[request.replica]
            turns.append(Turn(position[k], request.prompt, request.answer_tokens, request.think_s, answer, replica))
        sessions.append(Session(session, sent[members[0]].sent_s, tuple(turns)))
    return sessions


def routing_of(policy: str) -> str:
    """The routing policy a stack's name stands for: one of `ROUTINGS`, or the longest of
    them its name contains ("plain_vllm_round_robin" → round_robin,
    "connector_vllm_router_cache_aware" → vllm_router_cache_aware)."""
    name = policy.replace("-", "_")
    if name in ROUTINGS:
        return name
    found = [routing for routing in ROUTINGS if routing in name]
    if not found:
        raise InvalidArgument(f"no routing policy in the name {policy!r}; name one of {', '.join(ROUTINGS)}.")
    return max(found, key=len)


def _router(policy: str, setup: FleetSetup) -> RoutingPolicy:
    routing = routing_of(policy)
    if routing == "round_robin":
        return RoundRobin()
    if routing == "session_hash":
        return SessionHash(len(setup.replica_ids))
    if routing == "vllm_router_cache_aware":
        return VllmRouterCacheAware()
    if routing == "vllm_router_kv_aware":
        return VllmRouterKvAware()
    # the router's [routing] speeds: the measured prefill rate and decode step
    speeds = CostModel(
        prefill_tokens_per_s=setup.prefill_tokens_per_s,
        attention_context_tokens=_attention_context(setup),
        host_bytes_per_s=setup.host_bytes_per_s,
        nvme_bytes_per_s=setup.host_bytes_per_s,
        remote_bytes_per_s=setup.host_bytes_per_s,
        decode_s_per_request=setup.decode_s_per_token,
        remote_fetch=False,
    )
    return KvstoreCost(speeds)


def predict(
    policy: str, setup: FleetSetup, sent: Sequence[SentRequest], replay: bool, measured_seconds: float | None = None
) -> tuple[Prediction, RunResult]:
    """The simulator's hit rate, TTFT p50 and requests/s for the measured run of
    ``policy`` (a stack's name; see `routing_of`): ``replay`` sends each request where it
    was measured, otherwise the policy routes. ``measured_seconds``: the measured run's
    duration, for its requests/s."""
    if not sent:
        raise InvalidArgument(f"the run of {policy} sent no request.")
    if measured_seconds is not None and not measured_seconds > 0:
        raise InvalidArgument(f"the measured run's duration must be positive, got {measured_seconds}.")
    router = None if replay else _router(policy, setup)
    routing = "" if replay else routing_of(policy)
    result = simulate_sessions(sessions_of(sent, setup, replay), router, fleet_model(setup, routing))
    prompt = sum(o.num_prompt_tokens for o in result.outcomes)
    predicted_hit = sum(o.num_cached_tokens for o in result.outcomes) / prompt
    measured_hit = sum(r.cached_tokens for r in sent) / sum(r.prompt_tokens for r in sent)
    prediction = Prediction(
        policy=policy,
        measured_hit_rate=measured_hit,
        predicted_hit_rate=predicted_hit,
        measured_ttft_p50_s=float(np.median([r.ttft_s for r in sent])),
        predicted_ttft_p50_s=float(np.median([o.ttft_s for o in result.outcomes])),
        predicted_requests_per_s=len(result.outcomes) / result.makespan_s if result.makespan_s > 0 else math.inf,
        measured_requests_per_s=len(sent) / measured_seconds if measured_seconds is not None else math.nan,
    )
    return prediction, result


def replica_parallelism(solo_tokens_per_s: float, concurrent_tokens_per_s: float, num_replicas: int) -> float:
    """How many replicas' steps run at full speed at once, from a prefill rate measured
    on one replica alone and the per-replica rate with all ``num_replicas`` prefilling at
    once (1 for engines that each take all of one host's cores; N on N accelerators)."""
    if not (solo_tokens_per_s > 0 and concurrent_tokens_per_s > 0 and num_replicas >= 1):
        raise InvalidArgument("replica_parallelism needs two positive rates and at least one replica.")
    return min(float(num_replicas), max(1.0, num_replicas * concurrent_tokens_per_s / solo_tokens_per_s))


def decode_costs(
    contexts: tuple[int, int], batch: int, one: tuple[float, float], many: tuple[float, float], shared: int = 0
) -> dict[str, float]:
    """A decode step's parts, from steps measured on one engine alone: ``one`` request and
    ``batch`` requests decoding together, each at the two ``contexts`` (short, long;
    seconds per step), the batch's long contexts sharing their first ``shared`` tokens (a
    prefix cached once). A step of k decodes that read D distinct tokens of context costs
    ``decode_step_s`` + k × ``decode_seq_s`` + D × ``decode_context_s_per_token``: fitted
    to the four steps by least squares (D: the context; k × the short one; the shared
    prefix once and k × the rest of the long one)."""
    (short, long), k = contexts, batch
    if not (0 <= short < long and k >= 2 and 0 <= shared <= long):
        raise InvalidArgument(
            f"decode_costs needs contexts short < long, a batch of 2 or more, a prefix within; got {contexts}, {batch}, {shared}."
        )
    rows = [(1.0, 1.0, short), (1.0, 1.0, long), (1.0, k, k * short), (1.0, k, shared + k * (long - shared))]
    fitted = np.linalg.lstsq(np.array(rows, dtype=float), np.array([one[0], one[1], many[0], many[1]]), rcond=None)[0]
    step, per_seq, per_token = (max(0.0, float(value)) for value in fitted)
    return {"decode_step_s": step, "decode_seq_s": per_seq, "decode_context_s_per_token": per_token}


def floating_cpu(
    batch: int, alone: tuple[float, float], together: tuple[float, float], num_replicas: int, host_cores: float
) -> dict[str, float]:
    """The CPU beside an engine's steps on the host's shared cores (its engine core's
    scheduling, its API server's handling of each sampled token), from decode steps of one
    request and of ``batch`` requests measured on one engine ``alone`` and on all
    ``num_replicas`` at once (``together``; seconds per step): with every engine's steps
    and their floating CPU sharing ``host_cores`` (bench/sim/closed_loop.py), n engines
    whose steps take t alone and carry f beside them take t × n (1 + f/t) ÷ cores
    together, so f = t (slowdown × cores ÷ n − 1) (0 where they slowed none; where the cores
    have room for more than the engines' own, f is known only as far as it used them);
    ``floating_step_s`` + ``floating_token_s`` per sampling request fits the two."""
    if batch < 2 or num_replicas < 1 or not host_cores > 0:
        raise InvalidArgument("floating_cpu needs a batch of 2 or more, a replica and the host's cores.")
    floating = [max(0.0, alone[i] * (together[i] / alone[i] * host_cores / num_replicas - 1)) for i in range(2)]
    per_token = max(0.0, (floating[1] - floating[0]) / (batch - 1))
    return {"floating_step_s": max(0.0, floating[0] - per_token), "floating_token_s": per_token}


def router_cost(cpu_s: float, added_s: float) -> dict[str, float]:
    """A router's cost per request, from requests sent through it and straight to an engine:
    its CPU per request (``cpu_s``, its processes' from /proc) and the latency beyond that
    CPU that it added (``added_s``: the requests' time through it less straight)."""
    return {"cpu_s": max(0.0, cpu_s), "overhead_s": max(0.0, added_s - cpu_s)}


def admission_cost(extra_s: Sequence[float], tokens_s: float) -> dict[str, float]:
    """What admitting a request costs a busy engine's step beyond its tokens: requests of
    the workload's kind (their prompts held by the engine: one token to compute) sent to
    an engine while others decode there; ``extra_s``, per request sent, the time the
    decoding requests' steps took beyond their pace without it; ``tokens_s``, what its
    token costs (`StepSpeeds.decodes_s`). The median, less its token."""
    if not extra_s:
        raise InvalidArgument("admission_cost needs at least one measurement.")
    return {"admission_s": max(0.0, float(np.median(extra_s)) - tokens_s)}


def load_costs(loads: Sequence[tuple[int, float]], block_size: int) -> dict[str, float]:
    """What a request's load through the connector costs, from prompts the daemon held and
    their engine no longer did: (tokens the connector loaded, the prompt's time to a first
    token beyond that of one the engine held). A load of b blocks costs ``load_request_s``
    + b × ``load_block_s``, fitted by least squares where the loads were of two sizes or
    more (else all of it per block)."""
    if not loads or any(tokens < 1 for tokens, _ in loads):
        raise InvalidArgument("load_costs needs loads of at least one token.")
    blocks = np.array([-(-tokens // block_size) for tokens, _ in loads], dtype=float)
    seconds = np.array([max(0.0, s) for _, s in loads])
    if len(set(blocks.tolist())) < 2:
        return {"load_request_s": 0.0, "load_block_s": float(np.mean(seconds / blocks))}
    per_request, per_block = np.linalg.lstsq(np.stack([np.ones_like(blocks), blocks], axis=1), seconds, rcond=None)[0]
    if per_block <= 0:
        return {"load_request_s": 0.0, "load_block_s": float(np.mean(seconds / blocks))}
    if per_request < 0:
        return {"load_request_s": 0.0, "load_block_s": float(seconds.sum() / blocks.sum())}
    return {"load_request_s": float(per_request), "load_block_s": float(per_block)}


def request_cpu(prompt_tokens: tuple[int, int], cpu_s: tuple[float, float]) -> dict[str, float]:
    """A request's CPU on its way to its engine (the client's and the API server's: the
    HTTP request, tokenizing the prompt, returning its ids), from the CPU seconds per
    request measured at two prompt lengths: a fixed part and one per prompt token."""
    short, long = prompt_tokens
    if not 0 <= short < long:
        raise InvalidArgument(f"request_cpu needs two prompt lengths, short < long; got {prompt_tokens}.")
    per_token = max(0.0, (cpu_s[1] - cpu_s[0]) / (long - short))
    return {"request_cpu_s": max(0.0, cpu_s[0] - short * per_token), "request_cpu_s_per_token": per_token}


def copy_bytes_per_s(num_bytes: int = 64 * 1024**2, repeats: int = 3) -> float:
    """Bytes per second of one copy between two host buffers, the fastest of ``repeats``:
    what a load of cached blocks out of the host slab costs the engine here."""
    source = np.ones(num_bytes, dtype=np.uint8)
    destination = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(destination, source)
        best = min(best, time.perf_counter() - started)
    return num_bytes / best


RUNS_FORMAT = "kvstore-fleet-runs/1"


@dataclass(frozen=True, slots=True)
class SavedRuns:
    """What the simulator needs of a bench.fleet run (`save_runs`, `load_runs`): the run's
    settings, each engine set's `fleet_setup` arguments (the calibration among them), each
    stack's engine set and simulator policy, and each of its runs' requests and seconds."""

    settings: dict
    setup_inputs: dict[str, dict]  # engine set -> fleet_setup's keyword arguments
    stacks: dict[str, dict]  # stack -> {"engines": engine set, "sim_policy": policy, "replay": bool}
    runs: dict[str, list[tuple[list[SentRequest], float]]]  # stack -> (requests, seconds) per round
    summaries: dict[str, list[dict]]  # stack -> what each run measured (for reading, not for predicting)

    def setups(self) -> dict[str, FleetSetup]:
        return {kind: fleet_setup(**inputs) for kind, inputs in self.setup_inputs.items()}

    def predictions(self) -> dict[str, list[Prediction]]:
        """The simulator's prediction of every saved run, per stack in round order."""
        setups = self.setups()
        predicted: dict[str, list[Prediction]] = {}
        for name, runs in self.runs.items():
            stack = self.stacks[name]
            setup = setups[stack["engines"]]
            predicted[name] = [predict(stack["sim_policy"], setup, sent, stack["replay"], seconds)[0] for sent, seconds in runs]
        return predicted


_SENT_FIELDS = tuple(f.name for f in fields(SentRequest))


def _record_of(sent: SentRequest) -> dict:
    return {name: getattr(sent, name) for name in _SENT_FIELDS}


def _sent_of(record: Mapping) -> SentRequest:
    values = {name: record[name] for name in _SENT_FIELDS if name in record}
    values["prompt"] = tuple(values["prompt"])
    values["answer_ids"] = tuple(values.get("answer_ids", ()))
    return SentRequest(**values)


def save_runs(
    path: str | Path,
    settings: Mapping,
    setup_inputs: Mapping[str, Mapping],
    stacks: Mapping[str, Mapping],
    runs: Mapping[str, Sequence[tuple[Sequence[SentRequest], float]]],
    summaries: Mapping[str, Sequence[Mapping]] | None = None,
) -> None:
    """Write a run's `SavedRuns` to ``path`` as JSON (``setup_inputs``: `fleet_setup`'s
    keyword arguments per engine set, all of them JSON values)."""
    document = {
        "format": RUNS_FORMAT,
        "settings": dict(settings),
        "setups": {kind: dict(inputs) for kind, inputs in setup_inputs.items()},
        "stacks": {name: dict(stack) for name, stack in stacks.items()},
        "runs": {
            name: [{"seconds": seconds, "requests": [_record_of(r) for r in sent]} for sent, seconds in per_round]
            for name, per_round in runs.items()
        },
        "summaries": {name: list(per_round) for name, per_round in (summaries or {}).items()},
    }
    Path(path).write_text(json.dumps(document))


def load_runs(path: str | Path) -> SavedRuns:
    """The `SavedRuns` that `save_runs` wrote to ``path``."""
    document = json.loads(Path(path).read_text())
    if document.get("format") != RUNS_FORMAT:
        raise InvalidArgument(f"{path} is not a bench.fleet runs file ({RUNS_FORMAT}): format {document.get('format')!r}.")
    runs = {
        name: [([_sent_of(r) for r in run["requests"]], float(run["seconds"])) for run in per_round]
        for name, per_round in document["runs"].items()
    }
    return SavedRuns(document["settings"], document["setups"], document["stacks"], runs, document.get("summaries", {}))
