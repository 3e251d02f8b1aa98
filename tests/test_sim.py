"""The routing simulator, checked against outcomes computed by hand.

The model throughout (TINY): 1,024 KV bytes a token, so a 4-token block is 4,096 bytes
(one slab-aligned slot); prefill 1,000 tokens/s with attention doubling a token's cost at
100 tokens of context; host 1 MB/s, NVMe 100 KB/s, remote 10 MB/s; 0.01 s per output
token. Hence:

    prefill(40 new after 0)  = 0.040 × (1 + 20/100)       = 0.048 s
    prefill(20 new after 0)  = 0.020 × (1 + 10/100)       = 0.022 s
    prefill(4 new after 8)   = 0.004 × (1 + (8 + 2)/100)  = 0.0044 s
    one block from host      = 4,096 / 1e6                = 0.004096 s
    two blocks from a peer   = 8,192 / 1e7                = 0.0008192 s
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from bench.sim import __main__ as sim_cli
from bench.sim import policies
from bench.sim.agents import CodingAgentConfig, CodingAgentWorkload, LogNormal
from bench.sim.capacity import AgentsAtRate, CapacitySearch, Probe, TraceAtRate, find_capacity, policy_capacity
from bench.sim.engine import SimConfig, simulate
from bench.sim.models import PRESETS, ModelPreset
from bench.sim.policies import POLICIES, make_policy
from bench.sim.replica import TierSizes, build_manager
from bench.sim.report import summarize
from bench.sim.traces import oracle_hit_rate, oracle_hit_tokens, shared_trace
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.hashing import hash_block
from kvstore.index import scoring
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager
from kvstore.tiers.memory import VirtualTier

TINY = ModelPreset(
    name="tiny",
    model_id="tiny-test-model",
    num_layers=1,
    num_kv_heads=1,
    head_dim=1024,
    kv_planes=1,
    dtype="uint8",
    prefill_tokens_per_s=1000.0,
    attention_context_tokens=100.0,
    decode_s_per_token=0.01,
    host_bytes_per_s=1e6,
    nvme_bytes_per_s=1e5,
    remote_bytes_per_s=1e7,
)
BLOCK = 4
BLOCK_BYTES = 4096
ROOMY = TierSizes(hbm_bytes=256 * BLOCK_BYTES, host_bytes=0, nvme_bytes=0)


def chain(label: str, num_blocks: int) -> tuple:
    """Block keys of a prompt; chain(x, n)[:m] == chain(x, m), as for a growing prompt."""
    keys, parent = [], None
    for position in range(num_blocks):
        parent = hash_block(parent, [sum(map(ord, label)), position])
        keys.append(parent)
    return tuple(keys)


def request(at: float, session: str, label: str, num_blocks: int, num_output_tokens: int = 1) -> Request:
    return Request(at, session, chain(label, num_blocks), num_blocks * BLOCK, num_output_tokens, BLOCK)


def run(requests, policy, replicas=2, sizes=ROOMY, **options):
    return simulate(requests, policy, SimConfig(TINY, sizes, replicas, **options))


def hit_rate(result) -> float:
    return sum(o.num_cached_tokens for o in result.outcomes) / sum(o.num_prompt_tokens for o in result.outcomes)


# --- the model presets ----------------------------------------------------------------------


def test_model_presets_have_the_documented_kv_bytes():
    assert PRESETS["kimi-k2"].bytes_per_token == 61 * (512 + 64) * 2 == 70_272
    assert PRESETS["llama3-70b"].bytes_per_token == 80 * 8 * 128 * 2 * 2 == 327_680
    assert PRESETS["kimi-k2"].namespace(512).block_bytes == 70_272 * 512
    assert PRESETS["kimi-k2"].attention_context_tokens == pytest.approx(25_615, rel=1e-3)
    assert PRESETS["llama3-70b"].attention_context_tokens == pytest.approx(53_864, rel=1e-3)


def test_a_replica_holds_exactly_the_blocks_its_capacity_allows():
    block_bytes = PRESETS["kimi-k2"].namespace(512).block_bytes  # 35,979,264: 4 KiB aligned
    manager = build_manager(TierSizes(int(15e9), int(15e9), int(30e9)), block_bytes, "lru", lambda: 0.0)
    assert [s.capacity_bytes // block_bytes for s in manager.tier_stats()] == [416, 416, 833]


# --- the time model ---------------------------------------------------------------------------


def test_ttft_of_a_lone_request_is_its_prefill_time():
    (outcome,) = run([request(5.0, "s", "a", 10, num_output_tokens=3)], "round-robin").outcomes
    assert outcome.ttft_s == pytest.approx(0.048)
    assert outcome.done_s == pytest.approx(5.0 + 0.048 + 3 * 0.01)
    assert outcome.num_computed_tokens == 40


def test_a_second_prompt_waits_for_the_first_prefill():
    first, second = run([request(0.0, "s", "a", 10), request(0.0, "t", "b", 5)], "round-robin", replicas=1).outcomes
    assert first.ttft_s == pytest.approx(0.048)
    assert second.start_s == pytest.approx(0.048)
    assert second.ttft_s == pytest.approx(0.048 + 0.022)


def test_a_hit_demoted_to_host_costs_its_transfer():
    # HBM of 2 blocks: committing a 2-block prompt crosses the 95% watermark and the
    # production manager demotes its leaf to host; the next turn promotes it back.
    sizes = TierSizes(hbm_bytes=2 * BLOCK_BYTES, host_bytes=4 * BLOCK_BYTES, nvme_bytes=0)
    result = run([request(0.0, "s", "a", 2), request(10.0, "s", "a", 3)], "round-robin", replicas=1, sizes=sizes)
    turn = result.outcomes[1]
    assert turn.hit_blocks == (1, 1, 0, 0)  # HBM, host, NVMe, remote
    assert turn.ttft_s == pytest.approx(0.004096 + 0.0044)
    assert result.counters["demoted_hbm_to_host"] >= 1
    assert result.counters["promoted_host_to_hbm"] == 1


# --- hit rates under each policy, by hand --------------------------------------------------------

# A1 then its next turn A2 (which resends A1's 2 blocks and adds one), then B1: 24 tokens.
THREE = [request(0.0, "a", "a", 2), request(10.0, "a", "a", 3), request(20.0, "b", "b", 1)]


def test_oracle_hit_rate_of_the_three_requests():
    assert oracle_hit_rate(THREE, per="token") == pytest.approx(8 / 24)


def test_round_robin_sends_the_second_turn_elsewhere_and_misses():
    result = run(THREE, "round-robin")
    assert [o.replica for o in result.outcomes] == [0, 1, 0]
    assert hit_rate(result) == 0.0


def test_session_hash_keeps_a_session_on_one_replica_and_hits():
    result = run(THREE, "session-hash")
    assert result.outcomes[0].replica == result.outcomes[1].replica
    assert hit_rate(result) == pytest.approx(8 / 24)


def test_kvstore_follows_the_prefix_and_hits_as_the_oracle():
    result = run(THREE, "kvstore")
    assert result.outcomes[1].replica == result.outcomes[0].replica
    assert result.outcomes[1].ttft_s == pytest.approx(0.0044)
    assert hit_rate(result) == pytest.approx(8 / 24)


def test_longest_prefix_reads_the_event_fed_index():
    # Ties rotate: A1 -> 0, B1 -> 1, C1 -> 0, so a tie would send the next request to 1. A
    # new session that shares A's prefix goes to 0 only because the index says 0 holds it.
    requests = [request(0.0, "a", "a", 2), request(1.0, "b", "b", 1), request(2.0, "c", "c", 1), request(3.0, "d", "a", 3)]
    result = run(requests, "longest-prefix")
    assert [o.replica for o in result.outcomes] == [0, 1, 0, 0]
    assert result.outcomes[3].hit_blocks == (2, 0, 0, 0)


def test_kvstore_fetches_a_prefix_from_a_busy_peer():
    # Z (100 blocks, a 1.2 s prefill) keeps replica 0 busy when a new session sharing A's
    # prefix arrives: it goes to idle replica 1, which fetches A's 2 blocks from replica 0.
    # sessions s2, s6 and s7 all rank replica 0 first by the route's rendezvous tie-break,
    # so only the busy queue can send the third one elsewhere
    requests = [request(0.0, "s2", "a", 2), request(1.0, "s6", "z", 100), request(1.5, "s7", "a", 3)]
    result = run(requests, "kvstore")
    shared = result.outcomes[2]
    assert [o.replica for o in result.outcomes] == [0, 0, 1]
    assert shared.hit_blocks == (0, 0, 0, 2)
    assert shared.ttft_s == pytest.approx(0.0008192 + 0.0044)
    without_fetch = run(requests, "kvstore", remote_fetch=False).outcomes[2]
    assert without_fetch.hit_blocks == (0, 0, 0, 0)


def test_summary_accounting_by_hand():
    # round robin: A1 -> 0, B1 -> 1, A2 -> 0 (hits A1's 8 tokens), C1 -> 1.
    requests = [request(0.0, "a", "a", 2), request(1.0, "b", "b", 1), request(2.0, "a", "a", 3), request(3.0, "c", "c", 1)]
    result = run(requests, "round-robin")
    summary = summarize(result, "hand", 1.0, oracle_hit_tokens(requests))
    assert summary.hit_rate == pytest.approx(8 / 28)
    assert summary.hit_rate_by_tier == {"hbm": pytest.approx(8 / 28), "host": 0.0, "nvme": 0.0, "remote": 0.0}
    assert summary.replica_hit_rates == (pytest.approx(8 / 20), 0.0)  # replica 0 served 20 tokens, 1 served 8
    assert summary.spread_std == pytest.approx(0.2)
    assert summary.spread_cv == pytest.approx(1.0)
    assert summary.load_cv == pytest.approx(6 / 14)
    assert summary.replica_requests == (2, 2)
    assert summary.prefill_tokens_per_request == pytest.approx((28 - 8) / 4)
    assert summary.session_moves == 0
    assert summary.oracle_hit_rate == pytest.approx(8 / 28)


def test_the_mix_spread_tells_the_requests_a_replica_got_from_its_misses():
    # round robin: A1 -> 0, A2 -> 1 (misses: A1 is on 0), B1 -> 0. Both replicas hit nothing,
    # but only replica 1 got a reusable request: 8 of its 12 tokens were cached somewhere.
    result = run(THREE, "round-robin")
    summary = summarize(result, "hand", 1.0, oracle_hit_tokens(THREE))
    assert summary.replica_hit_rates == (0.0, 0.0)
    assert summary.spread_cv == 0.0
    assert summary.replica_oracle_hit_rates == (0.0, pytest.approx(8 / 12))
    assert summary.mix_cv == pytest.approx(1.0)  # 0 and 2/3: mean 1/3, std 1/3
    assert summary.oracle_hit_rate == pytest.approx(8 / 24)
    with pytest.raises(InvalidArgument):
        summarize(result, "hand", 1.0, oracle_hit_tokens(THREE[:2]))


def test_round_robin_moves_every_session_turn():
    requests = [request(float(t), "a", "a", t + 1) for t in range(4)]
    summary = summarize(run(requests, "round-robin"), "hand", 1.0, oracle_hit_tokens(requests))
    assert summary.session_moves == 3


# --- the production code is what runs ------------------------------------------------------------

SMALL_AGENTS = CodingAgentConfig(num_sessions=4, num_turns=LogNormal(6, 0.3, 3, 8), session_rate_per_s=1.0)


@pytest.fixture(scope="module")
def agent_requests():
    return list(CodingAgentWorkload(SMALL_AGENTS).requests())


def test_replica_caches_are_production_tier_managers_whose_eviction_runs(agent_requests, monkeypatch):
    managers = []
    original = TierManager.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        managers.append(self)

    monkeypatch.setattr(TierManager, "__init__", spy)
    tight = TierSizes(hbm_bytes=100 * 512 * 1024, host_bytes=50 * 512 * 1024, nvme_bytes=50 * 512 * 1024)
    result = simulate(agent_requests, "session-hash", SimConfig(TINY, tight, num_replicas=2, eviction_policy="lru"))
    assert len(managers) == 2
    assert all(m.config.eviction_policy == "lru" for m in managers)
    assert all(isinstance(m.tier(TierKind.HBM), VirtualTier) for m in managers)
    assert result.counters["evicted_capacity"] > 0
    assert result.counters["demoted_hbm_to_host"] > 0 and result.counters["demoted_host_to_nvme"] > 0
    assert sum(m.counters["evicted_capacity"] for m in managers) == result.counters["evicted_capacity"]


def test_the_kvstore_policy_routes_through_production_scoring(agent_requests, monkeypatch):
    calls = []
    original = scoring.route

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(scoring, "route", spy)
    simulate(agent_requests, "kvstore", SimConfig(TINY, ROOMY, num_replicas=3))
    assert len(calls) == len(agent_requests)


def test_a_run_is_deterministic_and_the_seed_matters(agent_requests):
    config = SimConfig(TINY, TierSizes(200 * 512 * 1024, 200 * 512 * 1024, 0), num_replicas=3)
    first = simulate(agent_requests, "kvstore", config)
    again = simulate(list(CodingAgentWorkload(SMALL_AGENTS).requests()), "kvstore", config)
    assert first.outcomes == again.outcomes and first.counters == again.counters
    reseeded = list(CodingAgentWorkload(dataclasses.replace(SMALL_AGENTS, seed=1)).requests())
    assert simulate(reseeded, "kvstore", config).outcomes != first.outcomes


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_serves_every_request_once(agent_requests, policy):
    result = simulate(agent_requests, make_policy(policy, 3, TINY.cost_model()), SimConfig(TINY, ROOMY, num_replicas=3))
    assert [o.index for o in result.outcomes] == list(range(len(agent_requests)))
    assert all(o.arrival_s <= o.start_s <= o.first_token_s <= o.done_s for o in result.outcomes)
    assert all(0 <= o.num_computed_tokens <= o.num_prompt_tokens for o in result.outcomes)


@pytest.mark.parametrize("policy", ["session-hash", "longest-prefix", "dynamo"])
def test_cache_aware_baselines_on_kvstore_fetch_from_peers_as_its_router_does(agent_requests, policy):
    fetched = {}
    for name in (policy, next(n for n in POLICIES if n.startswith(policy + "+"))):
        result = simulate(agent_requests, make_policy(name, 3, TINY.cost_model()), SimConfig(TINY, ROOMY, num_replicas=3))
        fetched[name] = sum(o.hit_blocks[3] for o in result.outcomes)
    assert list(fetched.values())[0] == 0 < list(fetched.values())[1], fetched


def test_the_load_aware_llmd_profile_weighs_kvstores_queue_term(agent_requests, monkeypatch):
    queues = []
    original = policies.queue_s

    def spy(replica, now, speeds):
        queues.append(original(replica, now, speeds))
        return queues[-1]

    monkeypatch.setattr(policies, "queue_s", spy)
    speeds = dataclasses.replace(TINY.cost_model(), decode_s_per_request=0.05)
    result = simulate(agent_requests, make_policy("longest-prefix+load+fetch", 3, speeds), SimConfig(TINY, ROOMY, num_replicas=3))
    assert len(queues) == 3 * len(agent_requests) and max(queues) > 0
    assert result.policy == "longest-prefix+load+fetch"


# --- capacity at an SLO ----------------------------------------------------------------------

STRICT = CapacitySearch(slo_ttft_p99_s=3.3, resolution=0.02)


def test_the_search_brackets_then_bisects_to_the_resolution():
    calls = []

    def p99(scale):  # TTFT p99 equal to the scale: the capacity is the SLO itself
        calls.append(scale)
        return Probe(scale, scale, 0.0)

    capacity = find_capacity(p99, STRICT)
    assert 3.3 / 1.02 <= capacity.scale <= 3.3 < capacity.failing_scale <= capacity.scale * 1.02
    assert calls[:3] == [1.0, 2.0, 4.0]  # doubling until the SLO is missed
    assert len(calls) == len(set(calls)) == len(capacity.probes)  # no scale run twice
    known = find_capacity(p99, STRICT, known=[Probe(1.0, 1.0, 0.0)])
    assert known == capacity and calls.count(1.0) == 1  # a known probe is not run again


def test_the_search_reports_a_lower_bound_or_nothing_where_it_finds_no_bracket():
    search = CapacitySearch(slo_ttft_p99_s=10.0, max_steps=3)
    always = find_capacity(lambda scale: Probe(scale, 0.0, 0.0), search)
    assert always.scale == 8.0 and always.failing_scale is None
    never = find_capacity(lambda scale: Probe(scale, 99.0, 0.0), search)
    assert never.scale == 0.0 and never.failing_scale == 1 / 8 and never.at_capacity is None
    with pytest.raises(InvalidArgument):
        CapacitySearch(slo_ttft_p99_s=0.0)


def lone_prompts(num_requests: int, rate_per_s: float) -> list[Request]:
    """Evenly spaced 10-block prompts of one turn each that share no block."""
    return [Request(k / rate_per_s, f"s{k}", tuple(hash_block(None, [k, b]) for b in range(10)), 40, 1, BLOCK) for k in range(num_requests)]


def test_capacity_of_one_replica_is_the_rate_its_queue_allows():
    # Each prompt is a 0.048 s prefill. Arriving every 1/r s with r > 1/0.048, request k
    # waits k × (0.048 − 1/r), so TTFT p99 (numpy's, over 101 requests: the 100th) is
    # 0.048 + 99 × (0.048 − 1/r). An SLO of 0.048 + 99 × 0.008 s is met up to
    # 1/r = 0.040: 25 requests/s, scale 2.5 of the 10/s the workload is written at.
    trace = TraceAtRate(lone_prompts(101, 10.0))
    search = CapacitySearch(slo_ttft_p99_s=0.048 + 99 * 0.008, resolution=0.02)
    capacity = policy_capacity(trace, "round-robin", SimConfig(TINY, ROOMY, 1), TINY.cost_model(), search)
    assert 2.5 / 1.02 <= capacity.scale <= 2.5 < capacity.failing_scale <= capacity.scale * 1.02
    assert trace.base_rate == pytest.approx(101 / 10)
    assert capacity.at_capacity.ttft_p99_s <= search.slo_ttft_p99_s


def test_capacity_grows_with_the_slo_and_latency_with_the_rate():
    trace = TraceAtRate(lone_prompts(101, 10.0))
    config = SimConfig(TINY, ROOMY, 2)
    capacities = [
        policy_capacity(trace, "round-robin", config, TINY.cost_model(), CapacitySearch(slo, resolution=0.05)).scale for slo in (0.2, 1.0)
    ]
    assert capacities == sorted(capacities) and capacities[0] < capacities[-1]
    probes = policy_capacity(trace, "kvstore", config, TINY.cost_model(), CapacitySearch(0.5, resolution=0.05)).probes
    p99s = [p.ttft_p99_s for p in probes]  # by scale
    assert p99s == sorted(p99s)


def test_agents_at_a_rate_are_the_same_sessions_arriving_faster():
    agents = AgentsAtRate(SMALL_AGENTS)
    nominal, doubled = agents.at(1.0), agents.at(2.0)
    assert nominal == list(CodingAgentWorkload(SMALL_AGENTS).requests())
    assert agents.base_rate == SMALL_AGENTS.session_rate_per_s
    assert len({r.session_id for r in doubled}) == 2 * SMALL_AGENTS.num_sessions
    starts = {r.session_id: r.arrival_s for r in reversed(nominal)}  # every session's first turn
    starts_doubled = {r.session_id: r.arrival_s for r in reversed(doubled)}
    assert all(starts_doubled[s] == pytest.approx(starts[s] / 2) for s in starts)
    for session in starts:  # and the same turns
        assert [r.block_hashes for r in nominal if r.session_id == session] == [r.block_hashes for r in doubled if r.session_id == session]


def test_the_cli_searches_capacity_on_a_trace(tmp_path, monkeypatch, capsys):
    trace = shared_trace()
    if trace is None:
        pytest.skip("the Mooncake synthetic trace (shared/traces) is not on this machine")
    argv = ["bench.sim", "--trace", str(trace), "--max-requests", "30", "--replicas", "2", "--policies", "round-robin,kvstore"]
    argv += ["--slo-ttft-p99", "5", "--capacity-resolution", "0.1", "--json", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    sim_cli.main()
    out = capsys.readouterr().out
    document = json.loads(out.strip().splitlines()[-1])
    figures = document["figures"]["capacity_kvstore_vs_round_robin"]
    assert figures["unit"] == "sessions/s at modelled TTFT p99 <= 5 s"
    assert document["ratios"]["capacity_kvstore_vs_round_robin"] == pytest.approx(figures["numerator"] / figures["denominator"], rel=1e-3)
    searched = {r["capacity_policy"]: r for r in document["results"] if "capacity_policy" in r}
    assert set(searched) == {"round-robin", "kvstore"}
    for result in searched.values():
        passing = [p for p in result["probes"] if p["ttft_p99_s"] <= 5]
        assert max(p["sessions_per_s"] for p in passing) == result["capacity_sessions_per_s"]
    assert "capacity at TTFT p99 <= 5 s" in out
