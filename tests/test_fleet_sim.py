"""bench.fleet's simulator prediction: how a measured run becomes the simulator's input and
its predicted hit rate, TTFT and requests/s, checked by hand without vLLM."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.fleet_sim import (
    SentRequest,
    fleet_model,
    fleet_setup,
    llama_layer_params,
    predict,
    replica_parallelism,
    routing_of,
    sim_config,
    sim_requests,
)
from bench.sim.replica import TierSizes
from kvstore.errors import InvalidArgument
from kvstore.hashing import chain_hashes

MiB, GiB = 1024**2, 1024**3
# bench.vllm_model's "mid" Llama
MID = {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 4096,
}
MEASURED = {"prefill_tokens_per_s": 1000.0, "decode_s_per_request": 0.05, "host_bytes_per_s": 2e9}
BLOCK_BYTES = 8 * 4 * 64 * 32 * 2 * 2  # layers × KV heads × head dim × block × K and V × bf16 = 256 KiB


def setup(**changes):
    made = fleet_setup(MID, "mid", ["replica-0", "replica-1"], 32, 256 * MiB, 4096, False, 1 * GiB, MEASURED)
    return dataclasses.replace(made, **changes)


def test_the_model_geometry_gives_the_layout_and_the_attention_context():
    config = sim_config(setup())
    # q and o 768 × 768 each, k and v 768 × 256 each, the MLP 3 × 768 × 2048: 6,291,456 a layer
    assert llama_layer_params(MID) == 8 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 2048) == 50_331_648
    # attention doubles a token's cost when 8 layers × 12 heads × 2 × (64 + 64) FLOPs per
    # context token equal its 2 × 50,331,648 linear FLOPs: at 4,096 tokens of context
    assert config.model.attention_context_tokens == pytest.approx(4096)
    assert config.model.namespace(32).block_bytes == BLOCK_BYTES
    assert config.model.prefill_tokens_per_s == 1000.0 and config.model.decode_s_per_token == 0.05
    assert config.model.host_bytes_per_s == 2e9
    assert config.num_replicas == 2 and config.remote_fetch is False


def test_the_cache_is_the_daemons_host_tier_unless_the_engine_caches_prefixes():
    # prefix caching off: HBM holds one 4,096-token prompt (128 blocks), the daemon's 256 MiB 1,024 blocks
    assert sim_config(setup()).tier_sizes == TierSizes(128 * BLOCK_BYTES, 1024 * BLOCK_BYTES, 0)
    # plain vLLM: its 1 GiB KV cache (4,096 blocks) is the cache, no daemon
    plain = sim_config(setup(prefix_caching=True, host_capacity_bytes=0))
    assert plain.tier_sizes == TierSizes(4096 * BLOCK_BYTES, 0, 0)
    with pytest.raises(InvalidArgument):
        setup(prefill_tokens_per_s=0.0)


A = tuple(range(2, 66))  # 64 tokens: two blocks
SENT = [
    # sent out of order: the simulator replays them by the time they were sent
    SentRequest("s", 10.0, A + tuple(range(100, 140)), 16, "replica-0", 0.2, 104, 64),
    SentRequest("s", 0.0, A, 16, "replica-0", 0.1, 64, 0),
]


def test_the_requests_are_the_runs_prompts_keyed_as_the_connector_keys_them():
    first, second = sim_requests(SENT, 32)
    assert (first.arrival_s, second.arrival_s) == (0.0, 10.0)
    assert first.block_hashes == tuple(chain_hashes(list(A), 32))
    assert second.block_hashes[:2] == first.block_hashes and len(second.block_hashes) == 3
    assert (second.num_prompt_tokens, second.num_output_tokens, second.session_id) == (104, 16, "s")


# the mid model's block: 256 KiB, copied at 2 GB/s
COPY_S = BLOCK_BYTES / 2e9


def decode_steps_s(first_context: int, count: int) -> float:
    """``count`` one-request decode steps (0.05 s each plus a token at 1,000/s attending its context)."""
    return sum(0.05 + 0.001 * (1 + (first_context + k + 0.5) / 4096) for k in range(count))


@pytest.mark.parametrize(("stack", "replay"), [("round_robin", True), ("session_hash", False)])
def test_the_prediction_by_hand(stack, replay):
    # replayed where the client sent each request, or routed by the simulator's session hash
    prediction, result = predict(stack, setup(), SENT, replay=replay, measured_seconds=4.0)
    # the second turn finds the first's two blocks in the daemon: 64 of 168 tokens, as measured
    assert prediction.predicted_hit_rate == prediction.measured_hit_rate == pytest.approx(64 / 168)
    assert prediction.hit_rate_error == 0.0
    # a step costs the measured decode step (0.05 s) plus its tokens at 1,000/s × (1 + (context + new/2) / 4,096),
    # plus the blocks the connector saves and loads at 2 GB/s: the first prompt, 64 tokens, saves its 2 blocks
    first_ttft = 0.05 + 0.064 * (1 + 32 / 4096) + 2 * COPY_S
    first_done = first_ttft + decode_steps_s(64, 15)  # 15 more answer tokens, a step each
    # closed loop: the second turn leaves when the first's answer is done (no think time here), not at 10 s;
    # it loads the 2 blocks, computes 40 tokens after 64 and saves its third block
    second_ttft = 0.05 + 0.040 * (1 + (64 + 20) / 4096) + 2 * COPY_S + COPY_S
    first, second = result.outcomes
    assert (first.arrival_s, first.first_token_s, first.done_s) == (0.0, pytest.approx(first_ttft), pytest.approx(first_done))
    assert second.arrival_s == first.done_s and second.ttft_s == pytest.approx(second_ttft)
    assert second.hit_blocks == (0, 2, 0, 0)  # none from the engine's cache (prefix caching off), 2 from the daemon
    assert prediction.predicted_ttft_p50_s == pytest.approx((first_ttft + second_ttft) / 2)
    assert prediction.measured_ttft_p50_s == pytest.approx(0.15)
    # throughput: 2 requests in the simulated time until the last answer, against 2 in the measured 4 s
    assert result.makespan_s == pytest.approx(second.done_s)
    assert prediction.predicted_requests_per_s == pytest.approx(2 / second.done_s)
    assert prediction.measured_requests_per_s == 0.5
    assert prediction.throughput_error == pytest.approx(abs(2 / second.done_s - 0.5) / 0.5)
    assert first.replica == second.replica == (0 if replay else first.replica)


def test_without_the_runs_duration_the_throughput_error_is_nan():
    prediction, _ = predict("round_robin", setup(), SENT, replay=True)
    assert math.isnan(prediction.measured_requests_per_s) and math.isnan(prediction.throughput_error)
    assert prediction.predicted_requests_per_s > 0
    with pytest.raises(InvalidArgument):
        predict("round_robin", setup(), SENT, replay=True, measured_seconds=0.0)


def test_the_engines_cache_holds_the_answers_blocks_the_connector_does_not_save():
    # turn 1: 60 prompt tokens and a 16-token answer; the engine fills two blocks (its 75 computed tokens),
    # the second half prompt, half answer. Turn 2 is turn 1's prompt + answer + 40 tokens.
    prompt = tuple(range(2, 62))
    answer = tuple(range(500, 516))
    turns = [
        SentRequest("s", 0.0, prompt, 16, "replica-0", 0.1, 60, 0, think_s=0.5),
        SentRequest("s", 1.0, prompt + answer + tuple(range(600, 640)), 16, "replica-0", 0.1, 116, 64),
    ]
    plain = setup(prefix_caching=True, host_capacity_bytes=0)
    prediction, result = predict("plain_vllm_round_robin", plain, turns, replay=True)
    assert result.outcomes[1].hit_blocks == (2, 0, 0, 0)  # the engine's own cache: prompt and answer, 64 tokens
    assert prediction.predicted_hit_rate == pytest.approx(64 / 176) == prediction.measured_hit_rate
    assert result.outcomes[1].arrival_s == pytest.approx(result.outcomes[0].done_s + 0.5)  # the client's think time
    # the connector alone (prefix caching off) has saved the prompt's one full block: 32 tokens
    _, connector = predict("round_robin", setup(), turns, replay=True)
    assert connector.outcomes[1].hit_blocks == (0, 1, 0, 0)
    # both: the engine serves its two blocks first, the daemon has nothing beyond them
    _, both = predict("round_robin", setup(prefix_caching=True), turns, replay=True)
    assert both.outcomes[1].hit_blocks == (2, 0, 0, 0)
    # an answer generated as other token ids than the next prompt re-tokenizes it to: its block does not hit
    generated = [dataclasses.replace(turns[0], answer_ids=tuple(range(700, 716))), turns[1]]
    _, retokenized = predict("plain_vllm_round_robin", plain, generated, replay=True)
    assert retokenized.outcomes[1].hit_blocks == (1, 0, 0, 0)


def test_the_engine_budget_and_the_speeds_come_from_the_setup():
    made = fleet_setup(
        MID, "mid", ["a", "b"], 32, 0, 4096, True, 1 * GiB, MEASURED | {"replica_parallelism": 1.0, "prefill_prompt_tokens": 2048},
        engine_blocks=320,
    )  # fmt: skip
    model = fleet_model(made)
    assert model.engine.num_blocks == 320 and model.engine.host_blocks == 0 and model.replica_parallelism == 1.0
    assert model.engine.max_num_batched_tokens == 2048 and model.engine.max_num_seqs == 128
    # without --num-gpu-blocks-override: what 1 GiB holds, 4,096 blocks of 256 KiB
    assert fleet_model(setup()).engine.num_blocks == 4096 and fleet_model(setup()).engine.host_blocks == 1024
    # the calibration prompt of 2,048 tokens took 2.048 s at the measured 1,000/s: one step (0.05 s) and
    # 2,048 + 2,048² / (2 × 4,096) = 2,560 tokens' worth of work at an empty context
    assert model.speeds.prefill_tokens_per_s == pytest.approx(2560 / (2.048 - 0.05))
    assert model.speeds.step_overhead_s == 0.05 and model.speeds.block_bytes == BLOCK_BYTES
    with pytest.raises(InvalidArgument):
        setup(engine_blocks=1)


@pytest.mark.parametrize(
    ("stack", "routing"),
    [
        ("round_robin", "round_robin"),
        ("plain_vllm_round_robin", "round_robin"),
        ("kvstore_routing_only", "kvstore"),
        ("plain_vllm_router_cache_aware", "vllm_router_cache_aware"),
        ("kvstore_connector_vllm_router_cache_aware", "vllm_router_cache_aware"),
        ("plain-vllm-router-kv-aware", "vllm_router_kv_aware"),
    ],
)
def test_a_stacks_name_names_its_routing(stack, routing):
    assert routing_of(stack) == routing


def test_a_run_behind_vllm_router_is_routed_not_replayed():
    behind = [dataclasses.replace(r, replica="") for r in SENT]
    with pytest.raises(InvalidArgument):
        predict("plain_vllm_router_cache_aware", setup(), behind, replay=True)
    prediction, result = predict("plain_vllm_router_cache_aware", setup(), behind, replay=False)
    assert result.policy == "vllm-router-cache-aware" and len(result.outcomes) == 2
    with pytest.raises(InvalidArgument):
        predict("least_loaded", setup(), behind, replay=False)


def test_replica_parallelism_from_two_prefill_rates():
    # two engines that each take both of a host's cores prefill at half speed together: one at a time
    assert replica_parallelism(1000.0, 500.0, 2) == 1.0
    assert replica_parallelism(1000.0, 1000.0, 2) == 2.0  # each its own hardware
    assert replica_parallelism(1000.0, 200.0, 2) == 1.0  # never below one
