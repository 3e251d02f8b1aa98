"""bench.fleet's simulator prediction: how a measured run becomes the simulator's input and
its predicted hit rate, TTFT and requests/s, how calibration measurements become the
model's speeds, and the runs file that --predict-from reads — checked by hand without vLLM."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from bench.fleet import predict_from, settings_of
from bench.fleet_sim import (
    SentRequest,
    admission_cost,
    decode_costs,
    fleet_model,
    fleet_setup,
    floating_cpu,
    llama_layer_params,
    load_costs,
    load_runs,
    predict,
    replica_parallelism,
    request_cpu,
    router_cost,
    routing_of,
    save_runs,
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


def test_a_decode_steps_parts_from_steps_of_one_and_of_a_batch():
    # made by the model: a step of 0.013 s, 0.0005 s per request and 1 µs per distinct token of context;
    # the batch of four at the long context shares its first 1,536 tokens
    def step(k: int, distinct: int) -> float:
        return 0.013 + k * 0.0005 + distinct * 1e-6

    one = (step(1, 32), step(1, 2560))
    many = (step(4, 4 * 32), step(4, 1536 + 4 * 1024))
    fitted = decode_costs((32, 2560), 4, one, many, shared=1536)
    assert fitted == {
        "decode_step_s": pytest.approx(0.013),
        "decode_seq_s": pytest.approx(0.0005),
        "decode_context_s_per_token": pytest.approx(1e-6),
    }
    with pytest.raises(InvalidArgument):
        decode_costs((2560, 32), 4, (0.01, 0.01), (0.02, 0.02))


def test_the_cpu_beside_the_steps_from_their_slowdown_when_every_engine_steps_at_once():
    # two engines on two cores; a step of one request takes 0.02 s alone, of four 0.03 s; beside them
    # 0.004 s and 0.0005 s per sampling request: together 0.02 × (1 + 0.0045/0.02), 0.03 × (1 + 0.006/0.03)
    together = (0.02 + 0.0045, 0.03 + 0.006)
    fitted = floating_cpu(4, (0.02, 0.03), together, 2, 2.0)
    assert fitted == {"floating_step_s": pytest.approx(0.004), "floating_token_s": pytest.approx(0.0005)}
    # no slowdown: nothing beside the steps that took from them
    assert floating_cpu(4, (0.02, 0.03), (0.02, 0.03), 2, 2.0) == {"floating_step_s": 0.0, "floating_token_s": 0.0}


def test_a_requests_cpu_from_two_prompt_lengths():
    fitted = request_cpu((32, 2560), (0.01 + 32 * 2e-6, 0.01 + 2560 * 2e-6))
    assert fitted == {"request_cpu_s": pytest.approx(0.01), "request_cpu_s_per_token": pytest.approx(2e-6)}
    with pytest.raises(InvalidArgument):
        request_cpu((64, 64), (0.01, 0.01))


def test_a_routers_cost_and_a_connectors_load_from_what_calibration_measured():
    # 12 ms of the router's CPU per request, which added 30 ms to the requests through it: 18 ms waiting
    assert router_cost(0.012, 0.030) == {"cpu_s": 0.012, "overhead_s": pytest.approx(0.018)}
    assert router_cost(0.012, 0.005) == {"cpu_s": 0.012, "overhead_s": 0.0}  # its CPU ran beside the answer
    # loads of 40 and 80 blocks (the last partial) that took 0.05 s and 0.09 s beyond prompts the engine held:
    # 0.01 s a request and 1 ms a block
    assert load_costs([(1279, 0.05), (2559, 0.09), (2559, 0.09)], 32) == {
        "load_request_s": pytest.approx(0.01),
        "load_block_s": pytest.approx(0.001),
    }
    assert load_costs([(2559, 0.16)], 32) == {"load_request_s": 0.0, "load_block_s": pytest.approx(0.002)}  # one size
    with pytest.raises(InvalidArgument):
        load_costs([], 32)


def test_a_requests_admission_from_what_it_added_to_a_busy_engines_steps():
    # requests sent into a batch's decode steps added 20, 22 and 30 ms to them; their own token costs 3 ms
    assert admission_cost([0.020, 0.022, 0.030], 0.003) == {"admission_s": pytest.approx(0.019)}
    assert admission_cost([0.001], 0.003) == {"admission_s": 0.0}
    with pytest.raises(InvalidArgument):
        admission_cost([], 0.003)


CALIBRATED = MEASURED | {
    "decode_step_s": 0.013,
    "decode_seq_s": 0.0005,
    "decode_context_s_per_token": 1e-6,
    "floating_step_s": 0.004,
    "floating_token_s": 0.0005,
    "host_cores": 2.0,
    "request_cpu_s": 0.01,
    "request_cpu_s_per_token": 2e-6,
    "request_overhead_s": 0.003,
    "admission_s": 0.015,
}


ROUTER = {"cpu_s": 0.012, "overhead_s": 0.018}


def test_the_calibrated_terms_reach_the_fleet_model():
    made = fleet_setup(MID, "mid", ["a", "b"], 32, 0, 4096, True, 1 * GiB, CALIBRATED)
    model = fleet_model(made)
    # the step's own part is the measured one, not the whole one-request decode step
    assert model.speeds.step_overhead_s == 0.013 and made.step_overhead_s == 0.013
    assert model.speeds.decodes_s(2, 1000) == pytest.approx(2 * 0.0005 + 0.001)  # two decodes reading 1,000 tokens
    assert model.speeds.floating_s(3) == pytest.approx(0.004 + 3 * 0.0005)
    assert (model.host_cores, model.request_overhead_s) == (2.0, 0.003)
    assert model.request_cpu(1000) == pytest.approx(0.01 + 0.002)
    assert model.speeds.load_block_s == 0.0  # no load measured: a copy at the host's rate
    assert model.speeds.admission_s == 0.015
    # behind a measured router: its CPU joins the request's, the latency it adds beyond that the overhead
    routed = fleet_setup(MID, "mid", ["a", "b"], 32, 0, 4096, True, 1 * GiB, CALIBRATED | {"routers": {"kvstore": ROUTER}})
    assert fleet_model(routed, "kvstore").request_cpu(1000) == pytest.approx(0.01 + 0.002 + 0.012)
    assert fleet_model(routed, "kvstore").request_overhead_s == pytest.approx(0.003 + 0.018)
    assert fleet_model(routed, "round_robin").request_cpu(1000) == pytest.approx(0.012)  # the client routes
    # without them: a step costs the one-request decode step, a decode token a prompt token
    plain = fleet_model(fleet_setup(MID, "mid", ["a", "b"], 32, 0, 4096, True, 1 * GiB, MEASURED))
    assert plain.speeds.step_overhead_s == 0.05 and plain.speeds.decode_seq_s is None and plain.host_cores == 0.0


def test_the_calibrated_terms_slow_the_predicted_run():
    calibrated = fleet_setup(MID, "mid", ["replica-0", "replica-1"], 32, 256 * MiB, 4096, False, 1 * GiB, CALIBRATED)
    slow, _ = predict("round_robin", calibrated, SENT, replay=True, measured_seconds=4.0)
    fast, _ = predict("round_robin", setup(decode_s_per_token=0.013), SENT, replay=True, measured_seconds=4.0)
    assert slow.predicted_requests_per_s < fast.predicted_requests_per_s
    assert slow.predicted_hit_rate == fast.predicted_hit_rate  # what is cached does not depend on the speeds


def test_saved_runs_predict_as_the_runs_themselves(tmp_path):
    inputs = dict(
        model_config=MID, model_id="mid", replica_ids=["replica-0", "replica-1"], block_size=32, host_capacity_bytes=256 * MiB,
        max_model_len=4096, prefix_caching=False, engine_kv_cache_bytes=1 * GiB, measured=CALIBRATED,
    )  # fmt: skip
    stacks = {
        "plain_round_robin": {"engines": "plain", "sim_policy": "round_robin", "replay": True},
        "kvstore_routing_only": {"engines": "plain", "sim_policy": "kvstore", "replay": False},
    }
    behind = [dataclasses.replace(r, replica="") for r in SENT]
    runs = {"plain_round_robin": [(SENT, 4.0), (SENT, 5.0)], "kvstore_routing_only": [(behind, 3.0)]}
    path = tmp_path / "runs.json"
    save_runs(path, {"regime": "ample", "rounds": 2}, {"plain": inputs}, stacks, runs, {"plain_round_robin": [{"seconds": 4.0}]})
    saved = load_runs(path)
    assert saved.settings == {"regime": "ample", "rounds": 2} and saved.stacks == stacks
    assert saved.runs == runs and saved.summaries == {"plain_round_robin": [{"seconds": 4.0}]}
    setup_of = fleet_setup(**inputs)
    assert saved.setups() == {"plain": setup_of}
    predicted = saved.predictions()
    assert [p.measured_requests_per_s for p in predicted["plain_round_robin"]] == [0.5, 0.4]
    assert predicted["plain_round_robin"][0] == predict("round_robin", setup_of, SENT, True, 4.0)[0]
    assert predicted["kvstore_routing_only"][0] == predict("kvstore", setup_of, behind, False, 3.0)[0]
    path.write_text('{"format": "something else"}')
    with pytest.raises(InvalidArgument):
        load_runs(path)


def test_bench_fleet_predicts_again_from_a_saved_file(tmp_path, capsys):
    settings = settings_of(
        argparse.Namespace(
            quick=False, json=False, regime="binding", rounds=1, engine_blocks=None, sessions=None, turns=None, replicas=2,
            cache_share=0.0, size="", stacks="kvstore_full", sets="apart", think_s=0.2, session_gap_s=0.5,
        )
    )  # fmt: skip
    inputs = dict(
        model_config=MID, model_id="mid", replica_ids=["replica-0", "replica-1"], block_size=32, host_capacity_bytes=256 * MiB,
        max_model_len=4096, prefix_caching=True, engine_kv_cache_bytes=1 * GiB, measured=CALIBRATED,
    )  # fmt: skip
    behind = [dataclasses.replace(r, replica="") for r in SENT]
    path = tmp_path / "runs.json"
    stacks = {"kvstore_full": {"engines": "connector", "sim_policy": "kvstore", "replay": False}}
    save_runs(path, dataclasses.asdict(settings), {"connector": inputs}, stacks, {"kvstore_full": [(behind, 3.0)]})
    predict_from(str(path), as_json=True)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = predict("kvstore", fleet_setup(**inputs), behind, False, 3.0)[0]
    assert report["ratios"]["sim_throughput_error"] == round(expected.throughput_error, 4)
    assert report["ratios"]["sim_hit_rate_error"] == round(expected.hit_rate_error, 4)
