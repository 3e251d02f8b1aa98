"""The closed-loop fleet simulator: an engine's own prefix cache (vLLM's block pool), its
scheduler's admission and preemption, sessions that wait for their answers, compute
shared between replicas, vllm-router's policies, and the measured costs beyond a step's
tokens (batched decodes, admissions, loads, the CPU beside the steps and each request's)
— each checked on a case worked out by hand.

The model throughout (TINY): 4-token blocks of 4,096 bytes; a step costs 0.01 s plus its
tokens at 1,000/s (attention is made negligible: its doubling context is 10^9 tokens);
copies to and from a daemon at 1 GB/s.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.sim.closed_loop import FleetModel, Session, Turn, simulate_sessions
from bench.sim.engine_cache import REMOVED, STORED, EngineCache
from bench.sim.policies import Fleet, KvstoreCost, VllmRouterCacheAware, VllmRouterKvAware
from bench.sim.vllm_replica import EngineSpec, StepSpeeds
from bench.sim.workload import Request
from kvstore.errors import CapacityExhausted, InvalidArgument
from kvstore.hashing import chain_hashes, hash_block
from kvstore.index.scoring import CostModel
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

BLOCK = 4
NAMESPACE = Namespace("tiny-test-model", KVLayout(1, 1, 1024, BLOCK, "uint8", 1))
SPEEDS = StepSpeeds(prefill_tokens_per_s=1000.0, attention_context_tokens=1e9, step_overhead_s=0.01, host_bytes_per_s=1e9, block_bytes=4096)


def keys(label: str, count: int) -> list[bytes]:
    return [hash_block(None, [sum(map(ord, label)), k]) for k in range(count)]


def model(num_blocks: int = 400, prefix_caching: bool = True, host_blocks: int = 0, replicas: int = 1, **options) -> FleetModel:
    engine = EngineSpec(num_blocks, BLOCK, prefix_caching, host_blocks=host_blocks)
    return FleetModel(replicas, engine, SPEEDS, NAMESPACE, **options)


def tokens(start: int, count: int) -> tuple[int, ...]:
    return tuple(range(start, start + count))


# -- the engine's prefix cache ----------------------------------------------------------------


def test_the_engine_cache_evicts_as_vllms_block_pool():
    x0, x1, x2 = keys("x", 3)
    y0, w0 = keys("y", 1)[0], keys("w", 1)[0]
    cache = EngineCache(6)  # 5 usable: one block is vLLM's null block
    x = cache.allocate(3)
    for block, key in zip(x, (x0, x1, x2)):
        cache.cache(block, key)
    y = cache.allocate(2)
    cache.cache(y[0], y0)  # y's second block is partial: never hashed
    assert cache.num_free == 0
    with pytest.raises(CapacityExhausted):
        cache.allocate(1)  # every block is held by a running request
    cache.free(x)  # tail first: x2, x1, x0 join the free queue's tail
    cache.free(y)  # y0 to the tail, y's partial block to the head
    assert cache.lru_order() == [x2, x1, x0, y0] and cache.num_free == 5
    # a request hits x0 (then misses w0): the hit takes x0 out of the free queue
    hit = cache.longest_hit([x0, w0], 2)
    assert hit == [x[0]]
    cache.touch(hit)
    assert cache.lru_order() == [x2, x1, y0]
    # its two new blocks: the unhashed one first, then the free queue's head, x2 — a prefix's later
    # block goes before its earlier ones
    new = cache.allocate(2)
    assert new[0] == y[1] and not cache.holds(x2) and cache.holds(x1)
    assert cache.longest_hit([x0, x1, x2], 3) == [x[0], x[1]]
    # it finishes: its blocks freed tail first (its new blocks are unhashed: to the head); x0 used last goes last
    cache.free(hit + new)
    assert cache.lru_order() == [x1, y0, x0]
    cache.allocate(3)  # two unhashed, then x1
    assert cache.longest_hit([x0, x1], 2) == [x[0]] and cache.holds(y0)
    assert cache.events == [(STORED, x0), (STORED, x1), (STORED, x2), (STORED, y0), (REMOVED, x2), (REMOVED, x1)]
    assert cache.num_evicted == 2


def test_with_prefix_caching_off_the_budget_still_holds_but_nothing_is_found():
    cache = EngineCache(4, prefix_caching=False)
    blocks = cache.allocate(3)
    cache.cache(blocks[0], keys("x", 1)[0])
    cache.free(blocks)
    assert cache.longest_hit(keys("x", 1), 1) == [] and cache.num_free == 3 and cache.events == []


def test_two_copies_of_a_block_leave_its_key_until_both_are_evicted():
    (x0,) = keys("x", 1)
    cache = EngineCache(3)
    first, second = cache.allocate(1), cache.allocate(1)
    cache.cache(first[0], x0)
    cache.cache(second[0], x0)  # computed twice at once, as two requests in one step do
    cache.free(first)
    cache.free(second)
    cache.allocate(1)
    assert cache.holds(x0)
    cache.allocate(1)
    assert not cache.holds(x0) and cache.events == [(STORED, x0), (REMOVED, x0)]


# -- the scheduler ---------------------------------------------------------------------------------


def test_a_request_waits_until_its_whole_sequence_fits():
    # 10 usable blocks; each prompt needs 6: the second waits for the first to finish and free its blocks
    sessions = [
        Session("a", 0.0, (Turn(0, tokens(0, 24), 4, replica=0),)),
        Session("b", 0.0, (Turn(1, tokens(1000, 24), 4, replica=0),)),
    ]
    result = simulate_sessions(sessions, None, model(num_blocks=11))
    first, second = result.outcomes
    prefill_s, decode_s = 0.01 + 0.024, 0.01 + 0.001
    assert first.first_token_s == pytest.approx(prefill_s) and first.done_s == pytest.approx(prefill_s + 3 * decode_s)
    assert second.start_s == first.done_s and second.done_s == pytest.approx(first.done_s + prefill_s + 3 * decode_s)
    # with room for both (7 blocks each once their answers grow) they share each step: one prefill step of
    # 48 tokens, then decode steps of two
    both = simulate_sessions(sessions, None, model(num_blocks=15)).outcomes
    assert both[0].first_token_s == both[1].first_token_s == pytest.approx(0.01 + 0.048)
    assert both[0].done_s == pytest.approx(0.058 + 3 * 0.012)


def test_a_running_request_without_a_free_block_is_preempted_and_recomputed():
    # 7 usable blocks: both 12-token prompts are admitted (3 blocks each); their answers need a fourth block
    # each, and only one is left: the last running request is preempted and computed again later
    sessions = [
        Session("a", 0.0, (Turn(0, tokens(0, 12), 12, replica=0),)),
        Session("b", 0.0, (Turn(1, tokens(1000, 12), 12, replica=0),)),
    ]
    result = simulate_sessions(sessions, None, model(num_blocks=8))
    first, second = result.outcomes
    assert result.counters["preemptions"] >= 1
    assert first.first_token_s == second.first_token_s  # admitted together, prefilled in one step
    assert second.done_s > first.done_s
    assert second.num_computed_tokens == 12  # reported at its first admission: nothing cached then
    with pytest.raises(InvalidArgument):  # a request larger than the whole cache is refused, as vLLM refuses it
        simulate_sessions([Session("c", 0.0, (Turn(0, tokens(0, 40), 4, replica=0),))], None, model(num_blocks=8))


def test_a_binding_budget_hits_less_than_an_ample_one_and_a_daemon_serves_what_it_evicted():
    sessions = []
    for s in range(4):
        prompt, turns = tokens(10_000 * s, 40), []
        for t in range(4):
            answer = tokens(10_000 * s + 1000 + 100 * t, 4)
            turns.append(Turn(4 * s + t, prompt, 4, 0.1, answer, replica=0))
            prompt = prompt + answer + tokens(10_000 * s + 5000 + 100 * t, 8)
        sessions.append(Session(f"s{s}", 0.01 * s, tuple(turns)))

    def hit_rate(result):
        return sum(o.num_prompt_tokens - o.num_computed_tokens for o in result.outcomes) / sum(o.num_prompt_tokens for o in result.outcomes)

    binding = simulate_sessions(sessions, None, model(num_blocks=30))  # 29 blocks: 116 tokens for four ~80-token sessions
    ample = simulate_sessions(sessions, None, model(num_blocks=400))
    assert binding.counters["engine_evictions"] > 0 and ample.counters["engine_evictions"] == 0
    assert hit_rate(binding) < hit_rate(ample)
    # every later turn of a session hits its whole previous prompt and answer when nothing is evicted
    assert all(o.hit_blocks[0] == (40 + 12 * (o.index % 4 - 1) + 3) // BLOCK for o in ample.outcomes if o.index % 4)
    with_daemon = simulate_sessions(sessions, None, model(num_blocks=30, host_blocks=400))
    assert hit_rate(binding) < hit_rate(with_daemon)
    assert sum(o.hit_blocks[1] for o in with_daemon.outcomes) > 0  # the connector's loads, beyond the engine's hit


# -- closed-loop timing ------------------------------------------------------------------------------


def test_a_sessions_next_turn_leaves_think_s_after_its_answer():
    first = tokens(0, 20)
    turns = (
        Turn(0, first, 2, think_s=0.5, answer=tokens(100, 2), replica=0),
        Turn(1, first + tokens(100, 2) + tokens(200, 6), 2, think_s=0.25, replica=0),
    )
    result = simulate_sessions([Session("s", 1.0, turns)], None, model())
    one, two = result.outcomes
    assert one.arrival_s == 1.0 and one.first_token_s == pytest.approx(1.0 + 0.01 + 0.020)
    assert one.done_s == pytest.approx(one.first_token_s + 0.011)
    assert two.arrival_s == one.done_s + 0.5
    # it finds turn 1's prompt and answer blocks: 20 + 1 computed answer token → 5 blocks, 20 tokens
    assert two.hit_blocks == (5, 0, 0, 0) and two.num_computed_tokens == 8
    assert result.makespan_s == two.done_s + 0.25  # the client's pause after its last answer counts
    delayed = simulate_sessions([Session("s", 1.0, turns)], None, model(request_overhead_s=0.1)).outcomes
    assert delayed[0].ttft_s == pytest.approx(one.ttft_s + 0.1)


@pytest.mark.parametrize(("parallelism", "ends_at"), [(2.0, 0.05), (1.0, 0.10)])
def test_replicas_that_share_compute_share_it(parallelism, ends_at):
    sessions = [Session(name, 0.0, (Turn(k, tokens(1000 * k, 40), 1, replica=k),)) for k, name in enumerate("ab")]
    result = simulate_sessions(sessions, None, model(replicas=2, replica_parallelism=parallelism))
    assert [o.first_token_s for o in result.outcomes] == [pytest.approx(ends_at)] * 2  # 0.01 + 0.040 each


# -- routing ----------------------------------------------------------------------------------------


def request(hashes, num_tokens=None) -> Request:
    return Request(0.0, "s", tuple(hashes), num_tokens or len(hashes) * BLOCK, 1, BLOCK)


def fleet(*replicas) -> Fleet:
    return Fleet(tuple(replicas), None, NAMESPACE.digest, 4096)


def test_vllm_routers_cache_aware_policy():
    idle = [SimpleNamespace(num_outstanding=0), SimpleNamespace(num_outstanding=0)]
    policy = VllmRouterCacheAware()
    p1 = keys("p1", 10)
    assert policy.choose(request(p1), fleet(*idle), 0.0) == 0  # nothing matches: the smallest tree (both empty: the first)
    # 4 of 10 blocks match (0.4 > 0.3): the worker the match names
    assert policy.choose(request(p1[:4] + keys("p2", 6)), fleet(*idle), 0.0) == 0
    # 2 of 10 (0.2): the smallest tree, worker 1's
    p3 = p1[:2] + keys("p3", 8)
    assert policy.choose(request(p3), fleet(*idle), 0.0) == 1
    assert policy.choose(request(p3[:8] + keys("p4", 2)), fleet(*idle), 0.0) == 1
    # imbalanced (70 − 2 > 64 and 70 > 1.5 × 2): the fewest in-flight requests, even for a full match
    busy = [SimpleNamespace(num_outstanding=70), SimpleNamespace(num_outstanding=2)]
    assert policy.choose(request(p1), fleet(*busy), 0.0) == 1
    # within the absolute threshold (70 − 10 = 60) the match wins again, and names p1's creator, worker 0,
    # although worker 1 was sent p1 too
    busy = [SimpleNamespace(num_outstanding=70), SimpleNamespace(num_outstanding=10)]
    assert policy.choose(request(p1), fleet(*busy), 0.0) == 0
    assert policy.decisions == {"smallest_tree": 2, "cache_hit": 3, "load_balance": 1}


def test_vllm_routers_kv_aware_policy_prices_what_each_engine_holds_against_its_load():
    def replica(held, active_blocks=0, queued=0):
        return SimpleNamespace(
            engine_prefix_blocks=lambda r: held, active_blocks=active_blocks, queued_new_tokens=lambda now: queued, num_outstanding=0
        )

    policy = VllmRouterKvAware()
    prompt = request(keys("p", 10))  # 40 tokens
    # (queued + new tokens) / block + active blocks + the prompt's 10: 8/4 + 0 + 10 = 12 against 40/4 + 10 = 20
    assert policy.choose(prompt, fleet(replica(8), replica(0)), 0.0) == 0
    assert policy.choose(prompt, fleet(replica(8, active_blocks=10), replica(0)), 0.0) == 1  # 22 against 20


def test_kvstores_router_counts_an_engines_own_cache_as_its_replicas():
    # routing only: plain engines with prefix caching, no daemon; the engines' KV events feed the index.
    # Session a's prompt shares 48 tokens with every later session: each goes where a's engine holds them.
    shared = tokens(0, 48)
    sessions = [Session("a", 0.0, (Turn(0, shared + tokens(500, 8), 1),))]
    sessions += [Session(f"later-{k}", 1.0 + k, (Turn(1 + k, shared + tokens(1000 * (k + 1), 8), 1),)) for k in range(4)]
    speeds = CostModel(1000.0, 1e9, 1e9, 1e9, 1e9, 0.01, remote_fetch=False)
    result = simulate_sessions(sessions, KvstoreCost(speeds), model(replicas=2))
    first, *later = result.outcomes
    assert all(o.replica == first.replica and o.hit_blocks == (12, 0, 0, 0) for o in later)


def test_turn_keys_cover_the_blocks_the_engine_fills():
    turn = Turn(0, tokens(0, 10), 4, answer=tokens(50, 4))
    from bench.sim.closed_loop import turn_hashes

    # 10 + 3 computed answer tokens: 3 full blocks, the third half answer
    assert turn_hashes(turn, BLOCK, "x") == chain_hashes(list(tokens(0, 10) + tokens(50, 4)), BLOCK)[:3]
    unknown = turn_hashes(Turn(0, tokens(0, 10), 8), BLOCK, "x")  # the run does not show this answer
    assert unknown[:2] == chain_hashes(list(tokens(0, 10)), BLOCK) and len(unknown) == 4


# -- batched decodes, CPU beside the steps, a request's CPU ------------------------------------------


BATCHED = StepSpeeds(
    prefill_tokens_per_s=1000.0,
    attention_context_tokens=1e9,
    step_overhead_s=0.01,
    host_bytes_per_s=1e9,
    block_bytes=4096,
    decode_seq_s=0.002,
    decode_context_s_per_token=0.0001,
)


def test_a_steps_decodes_are_priced_per_request_and_per_distinct_token_of_context():
    # two decodes reading 50 distinct tokens between them: 2 × 0.002 + 50 × 0.0001
    assert BATCHED.decodes_s(2, 50) == pytest.approx(0.009)
    assert BATCHED.tokens_s(8, 20) == pytest.approx(0.008)  # a prompt's chunk: at the prefill rate
    engine = EngineSpec(400, BLOCK, True)

    def done(prompts):
        sessions = [Session(f"s{k}", 0.0, (Turn(k, prompt, 3, replica=0),)) for k, prompt in enumerate(prompts)]
        return [o.done_s for o in simulate_sessions(sessions, None, FleetModel(1, engine, BATCHED, NAMESPACE)).outcomes]

    # prompts of 20 and 30 tokens of their own, prefilled in one step (50 tokens at 1,000/s); then two decode
    # steps of both: contexts 20 + 30 (every block its own), then 21 + 31
    prefill_s = 0.01 + 0.050
    steps = (0.01 + 0.004 + 50 * 0.0001) + (0.01 + 0.004 + 52 * 0.0001)
    assert done([tokens(0, 20), tokens(1000, 30)]) == [pytest.approx(prefill_s + steps)] * 2
    # the same lengths sharing their first 16 tokens (4 blocks): the second finds them cached as the first
    # is scheduled (34 tokens computed), and the decode steps read them once: 16 + 4 + 14, then 16 + 5 + 15
    shared = tokens(0, 16)
    steps = (0.01 + 0.004 + 34 * 0.0001) + (0.01 + 0.004 + 36 * 0.0001)
    assert done([shared + tokens(100, 4), shared + tokens(1000, 14)]) == [pytest.approx(0.01 + 0.034 + steps)] * 2
    # without a decode price a decode is a prompt token: 1,000/s
    assert SPEEDS.tokens_s(1, 20) == pytest.approx(0.001)
    with pytest.raises(InvalidArgument):
        StepSpeeds(1000.0, 1e9, 0.01, 1e9, 4096, decode_seq_s=-0.001)


def test_cpu_beside_the_steps_slows_them_only_when_the_cores_are_short():
    floating = StepSpeeds(1000.0, 1e9, 0.01, 1e9, 4096, floating_step_s=0.005, floating_token_s=0.0)
    engine = EngineSpec(400, BLOCK, True)

    def ends(replicas: int, cores: float) -> list[float]:
        sessions = [Session(name, 0.0, (Turn(k, tokens(1000 * k, 40), 1, replica=k),)) for k, name in enumerate("ab"[:replicas])]
        fleet = FleetModel(2, engine, floating, NAMESPACE, host_cores=cores)
        return [o.first_token_s for o in simulate_sessions(sessions, None, fleet).outcomes]

    # one step of 0.05 s (0.01 + 40 tokens) with 0.005 s beside it: 1.1 cores' worth
    assert ends(1, 2.0) == [pytest.approx(0.05)]  # one engine: its floating CPU takes the other core
    assert ends(2, 0.0) == [pytest.approx(0.05)] * 2  # no limit on the cores
    assert ends(2, 4.0) == [pytest.approx(0.05)] * 2  # room for both
    assert ends(2, 2.0) == [pytest.approx(0.05 * 2.2 / 2)] * 2  # two engines on two cores: 2.2 cores' worth
    assert FleetModel(2, engine, floating, NAMESPACE, host_cores=2.0).rates([(0.05, 0.005)], 2) == (pytest.approx(2 / 3.1),) * 2


def test_a_requests_cpu_delays_it_and_shares_the_cores():
    first = tokens(0, 20)
    one = [Session("s", 1.0, (Turn(0, first, 1, replica=0),))]
    # 0.02 s + 0.001 s per prompt token: 0.04 s of CPU, then 0.1 s to the engine, then its step (0.01 + 0.02)
    fleet = model(request_cpu_s=0.02, request_cpu_s_per_token=0.001, request_overhead_s=0.1)
    (outcome,) = simulate_sessions(one, None, fleet).outcomes
    assert outcome.arrival_s == 1.0 and outcome.start_s == pytest.approx(1.14)
    assert outcome.first_token_s == pytest.approx(1.14 + 0.03)
    # two requests' CPU at once on one core: each at half speed
    two = [Session(name, 0.0, (Turn(k, tokens(1000 * k, 20), 1, replica=0),)) for k, name in enumerate("ab")]
    shared = simulate_sessions(two, None, model(request_cpu_s=0.02, request_cpu_s_per_token=0.001, host_cores=1.0)).outcomes
    assert [o.start_s for o in shared] == [pytest.approx(0.08)] * 2
    with pytest.raises(InvalidArgument):
        model(request_cpu_s=-1.0)


def test_a_measured_load_prices_each_block_the_connector_loads():
    # turn 2 finds turn 1's prompt (5 blocks) in the daemon only (prefix caching off): it loads them
    first = tokens(0, 20)
    turns = (Turn(0, first, 1, replica=0), Turn(1, first + tokens(100, 8), 1, replica=0))
    loading = StepSpeeds(1000.0, 1e9, 0.01, 1e9, 4096, load_request_s=0.003, load_block_s=0.002)
    engine = EngineSpec(400, BLOCK, False, host_blocks=100)

    def second_ttft(speeds: StepSpeeds) -> float:
        outcome = simulate_sessions([Session("s", 0.0, turns)], None, FleetModel(1, engine, speeds, NAMESPACE)).outcomes[1]
        assert outcome.hit_blocks == (0, 5, 0, 0)
        return outcome.ttft_s

    # a load of 5 blocks: 3 ms and 2 ms a block, instead of 4,096 bytes at 1 GB/s a block
    assert second_ttft(loading) - second_ttft(SPEEDS) == pytest.approx(0.003 + 5 * 0.002 - 5 * 4096 / 1e9)


def test_each_request_a_step_admits_costs_it_its_admission():
    admitting = StepSpeeds(1000.0, 1e9, 0.01, 1e9, 4096, admission_s=0.005)
    engine = EngineSpec(400, BLOCK, True)
    sessions = [Session(name, 0.0, (Turn(k, tokens(1000 * k, 20), 2, replica=0),)) for k, name in enumerate("ab")]
    one, two = simulate_sessions(sessions, None, FleetModel(1, engine, admitting, NAMESPACE)).outcomes
    # both admitted in one step: 0.01 + 2 × 0.005 + 40 tokens; the decode step after admits none
    assert one.first_token_s == two.first_token_s == pytest.approx(0.01 + 0.010 + 0.040)
    assert one.done_s == pytest.approx(0.06 + 0.01 + 0.002)
