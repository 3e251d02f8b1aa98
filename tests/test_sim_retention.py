"""bench/sim/retention.py: a saved bench.retention run replayed through the replicas'
caches, on small hand-made traces (4-token blocks, a few blocks a tier)."""

import pytest

from bench.report import Report
from bench.retention import Sample, summarize
from bench.sim.retention import Tiers, Turn, predict_run, predict_runs, replay, report_predictions, tiers_of, turns_of
from kvstore.hashing import chain_hashes

BLOCK = 4
TIERS = Tiers(block_tokens=BLOCK, block_bytes=4096, engine_blocks=12, host_blocks=8, nvme_blocks=8, retained_blocks=12)
SESSION_TOKENS = 8 * BLOCK  # a session's first prompt: 8 blocks
NOISE_TOKENS = 4 * BLOCK


def tokens(seed: int, n: int) -> list[int]:
    return [seed * 10_000 + i for i in range(n)]


def turn(session: int, index: int, prompt: list[int], sent_s: float, cached: int = 0, ttft_s: float = 0.1, replica: str = "r0") -> Turn:
    answered = sent_s + ttft_s
    return Turn(
        session, index, replica, sent_s, answered, answered + 0.1, len(prompt), cached, ttft_s, 1, tuple(chain_hashes(prompt, BLOCK))
    )


def noise(seed: int, sent_s: float, replica: str = "r0") -> Turn:
    prompt = tokens(seed, NOISE_TOKENS)
    return Turn(-1, 0, replica, sent_s, sent_s + 0.1, sent_s + 0.1, len(prompt), 0, 0.0, 1, tuple(chain_hashes(prompt, BLOCK)))


def paused_session(flood_at: list[float], resume_s: float) -> list[Turn]:
    """A session's two turns on one replica, one-off prompts sent at ``flood_at`` between them."""
    first = tokens(1, SESSION_TOKENS)
    second = first + tokens(2, 2 * BLOCK)
    turns = [turn(0, 0, first, 0.0)] + [noise(100 + i, at) for i, at in enumerate(flood_at)] + [turn(0, 1, second, resume_s)]
    return sorted(turns, key=lambda t: t.sent_s)


def resumed_cached(turns: list[Turn], cached: list[int]) -> int:
    return next(c for t, c in zip(turns, cached) if t.session == 0 and t.turn == 1)


def test_a_session_retained_through_its_pause_survives_a_flood_that_evicts_it_without_retention():
    # 6 one-off prompts store 24 blocks: more than the engine's 11 and the daemon's 16
    turns = paused_session([1.0 + i for i in range(6)], resume_s=10.0)
    assert resumed_cached(turns, replay(turns, TIERS, retention=False)) == 0
    # the whole first prompt, loaded from the daemon (host and NVMe)
    assert resumed_cached(turns, replay(turns, TIERS, retention=True)) == SESSION_TOKENS


def test_an_expired_retention_does_not_protect():
    # the first pause is retained for RetentionConfig's first_ttl_s (60 s); the flood comes after
    turns = paused_session([61.0 + i for i in range(6)], resume_s=70.0)
    assert resumed_cached(turns, replay(turns, TIERS, retention=True)) == 0


def test_a_retention_beyond_the_budget_does_not_protect():
    turns = paused_session([1.0 + i for i in range(6)], resume_s=10.0)
    tiers = Tiers(BLOCK, 4096, engine_blocks=12, host_blocks=8, nvme_blocks=8, retained_blocks=2)
    # the first 2 blocks are retained; leaf-first eviction takes the chain's tail, then
    # those 2 are all a lookup finds
    assert resumed_cached(turns, replay(turns, tiers, retention=True)) == 2 * BLOCK


def test_demotion_to_nvme_keeps_blocks_hittable():
    # 3 one-off prompts (12 blocks): the engine's cache keeps the session's first blocks
    # at most, the host tier loses it, and the NVMe tier holds what the host tier demoted
    turns = paused_session([1.0, 2.0, 3.0], resume_s=10.0)
    tiers = Tiers(BLOCK, 4096, engine_blocks=12, host_blocks=8, nvme_blocks=16, retained_blocks=12)
    assert resumed_cached(turns, replay(turns, tiers, retention=False)) == SESSION_TOKENS
    without_nvme = Tiers(BLOCK, 4096, engine_blocks=12, host_blocks=8, nvme_blocks=0, retained_blocks=12)
    assert resumed_cached(turns, replay(turns, without_nvme, retention=False)) < SESSION_TOKENS // 2


def test_an_engine_hit_is_one_token_short_of_the_prompt_and_the_daemon_supplies_the_rest():
    prompt = tokens(1, SESSION_TOKENS)
    # the same prompt again at once: the engine still holds every block
    turns = [turn(0, 0, prompt, 0.0), turn(0, 1, prompt, 1.0)]
    assert replay(turns, TIERS, retention=False) == [0, SESSION_TOKENS - 1]


def test_tiers_of_counts_the_slots_the_daemon_carves():
    # bench.retention's mid shape: 224 blocks' bytes of NVMe in 4 MiB pages, each with a
    # 4 KiB header, each 256 KiB block in a slot with its trailer: 15 a page, 14 pages
    shape = {"engine_blocks": 288, "host_blocks": 96, "nvme_blocks": 224}
    document = {"shape": shape, "block_bytes": 256 * 1024, "retained_fraction": 0.85}
    tiers = tiers_of(document, 32)
    assert (tiers.host_blocks, tiers.nvme_blocks) == (96, 210)
    assert tiers.retained_blocks == int(0.85 * 320)  # of the tiers' bytes, headers and trailers included


# -- the prediction against a run's measurements -------------------------------------


def saved_run(setting: str, samples: list[Sample], round_: int = 0) -> dict:
    return {"setting": setting, "round": round_, "requests": [vars(s) | {"blocks": list(s.blocks)} for s in samples]}


AMPLE = Tiers(BLOCK, 4096, engine_blocks=64, host_blocks=8, nvme_blocks=8, retained_blocks=12)  # the engine keeps every session


def known_samples(intercept_s: float, per_token_s: float) -> list[Sample]:
    """Three sessions of three turns one after another on one replica whose engine keeps
    each session's chain: turn k finds turn k-1's prompt in the engine. TTFTs exactly a
    service model's, nothing queued."""
    samples, now = [], 0.0
    for session in range(3):
        prompt = tokens(session + 1, SESSION_TOKENS + session * BLOCK)
        cached = 0
        for index in range(3):
            computed = len(prompt) - cached
            ttft = intercept_s + per_token_s * computed
            keys = tuple(h.hex() for h in chain_hashes(prompt, BLOCK))
            samples.append(Sample(session, index, ttft, len(prompt), cached, "r0", now, now + ttft + 0.05, keys))
            now += ttft + 1.0
            cached = len(prompt) // BLOCK * BLOCK  # full blocks of this prompt, found by the next turn
            prompt = prompt + tokens(50 + session * 10 + index, 2 * BLOCK - 1)  # answer (1 token) and user message
    return samples


def test_the_prediction_equals_the_measured_figures_where_the_answer_is_known():
    samples = known_samples(0.05, 0.001)
    prediction = predict_run(saved_run("without", samples), AMPLE, answer_tokens=1)
    for figure in ("hit_rate", "ttft_p50_s", "ttft_p99_s"):
        assert prediction.predicted[figure] == pytest.approx(prediction.measured[figure], rel=1e-9)
        assert prediction.error(figure) == pytest.approx(0.0, abs=1e-9)
    assert prediction.service.intercept_s == pytest.approx(0.05)
    assert prediction.service.per_token_s == pytest.approx(0.001)
    # the measured figures are bench.retention's own
    summary = summarize(samples)
    assert prediction.measured["hit_rate"] == pytest.approx(summary["resumed_hit_rate"])
    assert prediction.measured["ttft_p50_s"] == pytest.approx(summary["resumed_ttft_p50_s"])
    assert prediction.measured["ttft_p99_s"] == pytest.approx(summary["resumed_ttft_p99_s"])


def test_a_misprediction_shows_as_an_error():
    samples = known_samples(0.05, 0.001)
    inflated = [Sample(**(vars(s) | {"cached_tokens": s.prompt_tokens - 1})) if s.turn else s for s in samples]
    prediction = predict_run(saved_run("without", inflated), AMPLE, answer_tokens=1)
    assert prediction.error("hit_rate") > 0.1


def test_the_report_registers_the_errors_with_targets_for_the_hit_rates_and_the_ratios():
    samples = known_samples(0.05, 0.001)
    shape = {"engine_blocks": AMPLE.engine_blocks, "host_blocks": 8, "nvme_blocks": 8, "answer_tokens": 1}
    document = {
        "shape": shape,
        "block_bytes": 4096,
        "retained_fraction": 0.85,
        "runs": [saved_run("without", samples), saved_run("with", samples)],
    }
    report = Report("retention")
    report_predictions(report, predict_runs(document, BLOCK))
    assert report.targets["sim_resumed_hit_rate_error_with"] == "<= 0.15"
    assert report.targets["sim_resumed_hit_rate_error_without"] == "<= 0.15"
    assert report.met("sim_resumed_hit_rate_error_with")
    assert "sim_resumed_ttft_p99_error_with" in report.ratios and "sim_resumed_ttft_p99_error_with" not in report.targets
    assert report.ratios["sim_resumed_hit_rate_with_retention"] == pytest.approx(1.0)


def test_turns_of_reads_a_saved_run_in_send_order_and_leaves_out_requests_without_a_replica():
    samples = known_samples(0.05, 0.001)
    samples[3].replica = ""
    turns = turns_of(saved_run("with", samples[::-1]), answer_tokens=16)
    assert [t.sent_s for t in turns] == sorted(s.sent_s for s in samples if s.replica)
    assert all(t.answer_tokens == 16 for t in turns)
