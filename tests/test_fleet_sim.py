"""bench.fleet's simulator prediction: how a measured run becomes the simulator's input,
checked by hand without vLLM."""

from __future__ import annotations

import dataclasses

import pytest

from bench.fleet_sim import SentRequest, fleet_setup, llama_layer_params, predict, sim_config, sim_requests
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


@pytest.mark.parametrize("replay", [True, False])
def test_the_prediction_by_hand(replay):
    prediction, result = predict("p", setup(), SENT, replay=replay)
    # the second turn finds the first's two blocks: 64 of 168 tokens, as measured
    assert prediction.predicted_hit_rate == prediction.measured_hit_rate == pytest.approx(64 / 168)
    assert prediction.hit_rate_error == 0.0
    # TTFT: 64 tokens at 1,000/s × (1 + 32/4096); 40 after 64 cached × (1 + (64 + 20)/4096), from HBM
    first, second = 0.064 * (1 + 32 / 4096), 0.040 * (1 + 84 / 4096)
    assert [o.ttft_s for o in result.outcomes] == [pytest.approx(first), pytest.approx(second)]
    assert prediction.predicted_ttft_p50_s == pytest.approx((first + second) / 2)
    assert prediction.measured_ttft_p50_s == pytest.approx(0.15)
    assert prediction.ttft_p50_error == pytest.approx(abs((first + second) / 2 - 0.15) / 0.15)
    if replay:
        assert [o.replica for o in result.outcomes] == [0, 0]
