"""The routing simulator's prediction of a bench.fleet run, next to what the run measured.

The simulator (bench/sim) gets the run itself, not tuned constants:

- the requests: every request the run sent, at the time it was sent (from the start of its
  policy's run), in its session, its prompt's token ids keyed with kvstore's chain hashes
  at the engines' block size (as the connector keys them), its answer's length;
- the replicas' cache: the daemon's host tier (``host.capacity_bytes``) in blocks of the
  engines' KV layout; no NVMe tier (``nvme.enabled = false``). The engine's own cache
  serves hits only with prefix caching on (its ``VLLM_CPU_KVCACHE_SPACE``); with it off,
  as bench.fleet runs kvstore's replicas, the simulator's HBM tier is only what a prefill
  occupies, one ``max_model_len`` prompt (the simulated tier manager needs a prompt's
  blocks in HBM while it is computed);
- the speeds: prefill tokens/s measured on the replicas' cold prompts (`calibrate` in
  bench/fleet.py), the context at which attention doubles a token's cost from the model's
  geometry (`models.attention_context_tokens`, the linear parameters of its layers), a
  decode step as measured, host bytes/s of a copy measured in the run (what a load from
  the host slab costs); no remote fetch (the router runs with ``remote_fetch = false``);
- the routing: round-robin and session hash were chosen by the client, so the simulator
  replays the replica each request went to; the kvstore router is the simulator's kvstore
  policy with the router's ``[routing]`` speeds.

What the simulator does not model here, and so where its errors come from: the HTTP and
router hops, vLLM's scheduler batching prefills and decodes in the same steps (the
simulator runs one prefill at a time and never lets decode delay it), blocks of the answer
tokens that the connector saves (the simulator caches prompt blocks only), and what earlier
policies of the same run left in the daemons' tiers (each simulated policy starts cold).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.sim.engine import RunResult, SimConfig, simulate
from bench.sim.models import ModelPreset, attention_context_tokens
from bench.sim.policies import Fleet, KvstoreCost, RoutingPolicy
from bench.sim.replica import TierSizes
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout

__all__ = [
    "SentRequest",
    "FleetSetup",
    "Prediction",
    "llama_layer_params",
    "fleet_setup",
    "sim_model",
    "sim_config",
    "sim_requests",
    "predict",
    "copy_bytes_per_s",
]

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class SentRequest:
    """One request of a measured run, as the client sent and saw it."""

    session: str
    sent_s: float  # since the policy's run began
    prompt: tuple[int, ...]  # token ids
    answer_tokens: int
    replica: str  # the node that served it
    ttft_s: float  # to the first streamed chunk
    prompt_tokens: int  # as the engine counted them (its usage)
    cached_tokens: int  # as the engine reported them


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
    decode_s_per_token: float
    host_bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.replica_ids:
            raise InvalidArgument("a fleet needs at least one replica.")
        for name in ("max_model_len", "linear_params", "prefill_tokens_per_s", "host_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"FleetSetup.{name} must be positive, got {getattr(self, name)}.")
        if self.host_capacity_bytes < 0 or self.engine_kv_cache_bytes < 0:
            raise InvalidArgument("cache capacities cannot be negative.")


@dataclass(frozen=True, slots=True)
class Prediction:
    policy: str
    measured_hit_rate: float
    predicted_hit_rate: float
    measured_ttft_p50_s: float
    predicted_ttft_p50_s: float

    @property
    def hit_rate_error(self) -> float:
        return _relative_error(self.predicted_hit_rate, self.measured_hit_rate)

    @property
    def ttft_p50_error(self) -> float:
        return _relative_error(self.predicted_ttft_p50_s, self.measured_ttft_p50_s)


def _relative_error(predicted: float, measured: float) -> float:
    """|predicted − measured| ÷ measured (0 when both are 0)."""
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
) -> FleetSetup:
    """The setup of a bench.fleet run: the model's config.json (a Llama served in bf16),
    the fleet's configuration, and ``measured`` — ``prefill_tokens_per_s``,
    ``decode_s_per_request`` (a decode step, as bench.fleet's `calibrate` measures them)
    and ``host_bytes_per_s``."""
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
    )


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
        attention_context_tokens=attention_context_tokens(
            setup.linear_params, layout.num_layers, setup.num_query_heads, layout.head_dim, layout.head_dim
        ),
        decode_s_per_token=setup.decode_s_per_token,
        host_bytes_per_s=setup.host_bytes_per_s,
        nvme_bytes_per_s=setup.host_bytes_per_s,  # no NVMe tier: never used
        remote_bytes_per_s=setup.host_bytes_per_s,  # no remote fetch: never used
    )


def sim_config(setup: FleetSetup) -> SimConfig:
    block_bytes = setup.layout.block_bytes
    block_size = setup.layout.block_size
    prefill_blocks = -(-setup.max_model_len // block_size)
    engine_blocks = setup.engine_kv_cache_bytes // block_bytes if setup.prefix_caching else 0
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


class _Replay(RoutingPolicy):
    """Each request to the replica it was measured on (the client's choice)."""

    name = "replay"

    def __init__(self, replicas: Sequence[int]) -> None:
        self._replicas = list(replicas)
        self._next = 0

    def choose(self, request: Request, fleet: Fleet, now: float) -> int:
        chosen = self._replicas[self._next]
        self._next += 1
        return chosen


def predict(policy: str, setup: FleetSetup, sent: Sequence[SentRequest], replay: bool) -> tuple[Prediction, RunResult]:
    """The simulator's hit rate and TTFT p50 for the measured run of ``policy``:
    ``replay`` sends each request where it was measured, otherwise the simulator's kvstore
    router chooses, with the run's speeds."""
    if not sent:
        raise InvalidArgument(f"the run of {policy} sent no request.")
    config = sim_config(setup)
    requests = sim_requests(sent, setup.layout.block_size)
    if replay:
        index_of = {node: k for k, node in enumerate(setup.replica_ids)}
        router: RoutingPolicy = _Replay([index_of[r.replica] for r in sorted(sent, key=lambda r: r.sent_s)])
    else:
        # the router's [routing] speeds: the measured prefill rate and decode step
        speeds = dataclasses.replace(config.model.cost_model(remote_fetch=False), decode_s_per_request=setup.decode_s_per_token)
        router = KvstoreCost(speeds)
    result = simulate(requests, router, config)
    prompt = sum(o.num_prompt_tokens for o in result.outcomes)
    predicted_hit = sum(o.num_cached_tokens for o in result.outcomes) / prompt
    measured_hit = sum(r.cached_tokens for r in sent) / sum(r.prompt_tokens for r in sent)
    prediction = Prediction(
        policy=policy,
        measured_hit_rate=measured_hit,
        predicted_hit_rate=predicted_hit,
        measured_ttft_p50_s=float(np.median([r.ttft_s for r in sent])),
        predicted_ttft_p50_s=float(np.median([o.ttft_s for o in result.outcomes])),
    )
    return prediction, result


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
