"""The simulator's workloads: the prefix-block trace reader and the coding-agent generator."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.sim.agents import PRESETS, AgentVariant, CodingAgentConfig, CodingAgentWorkload, LogNormal
from bench.sim.traces import (
    TraceFormat,
    TraceFormatError,
    oracle_hit_rate,
    oracle_hit_tokens,
    parse_trace_lines,
    read_trace,
    shared_trace,
)
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash, hash_block

TINY = TraceFormat(block_tokens=4)


def _line(timestamp, ids, input_length, output_length=8, **extra) -> str:
    record = {"timestamp": timestamp, "input_length": input_length, "output_length": output_length}
    return json.dumps({**record, "hash_ids": ids, **extra})


def _common_prefix(a, b) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _by_session(requests) -> dict[str, list[Request]]:
    sessions: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        sessions[request.session_id].append(request)
    return sessions


# --- trace reader -------------------------------------------------------------------------

# block_tokens=4: a line with n ids has between 4(n-1)+1 and 4n prompt tokens.
CONVERSATIONS = [
    _line(0, [1, 2, 3, 4], 14),  # line 1: opens t1 (3 full blocks + a partial one)
    _line(1000, [1, 2, 3, 5, 6], 18),  # 2: extends line 1 -> t1
    _line(2000, [1, 9, 10], 12),  # 3: only the first block shared -> new t3
    _line(3000, [1, 2, 3, 5, 7, 8], 24, extra_field="ignored"),  # 4: extends line 2 -> t1
    _line(4000, [1, 2, 3, 20, 21, 22, 23, 24], 32),  # 5: keeps 3 of line 4's 6 blocks -> new t5
    _line(5000, [1, 2, 3, 5, 7, 30, 31], 28),  # 6: rewrites line 4's last block -> t1
]


def test_trace_keys_chain_the_ids_and_identify_the_whole_prefix():
    first, second, third = parse_trace_lines([_line(0, [1, 2, 3], 12), _line(1, [1, 2, 4], 12), _line(2, [5, 2, 3], 12)], TINY)
    expected = [hash_block(None, [1])]
    for block_id in (2, 3):
        expected.append(hash_block(expected[-1], [block_id]))
    assert list(first.block_hashes) == expected
    assert first.block_hashes[:2] == second.block_hashes[:2]
    assert first.block_hashes[2] != second.block_hashes[2]
    # Id 2 and 3 at the same positions, but after a different first block: nothing is shared.
    assert not set(third.block_hashes) & set(first.block_hashes)
    assert all(len(key) == 16 for key in first.block_hashes)


def test_trace_keys_only_full_blocks_unless_asked():
    (request,) = parse_trace_lines([_line(0, [1, 2, 3], 10)], TINY)
    assert len(request.block_hashes) == 2 and request.num_prompt_tokens == 10
    (with_tail,) = parse_trace_lines([_line(0, [1, 2, 3], 10)], replace(TINY, keep_partial_block=True))
    assert with_tail.block_hashes[:2] == request.block_hashes and len(with_tail.block_hashes) == 3


def test_trace_fields_times_and_order():
    lines = [_line(2500, [1], 4, output_length=7), _line(500, [2], 4), _line(500, [3], 4)]
    requests = parse_trace_lines(lines, TINY)
    assert [r.arrival_s for r in requests] == [0.5, 0.5, 2.5]
    # Stable: equal timestamps keep file order (the order within a conversation).
    assert [r.session_id for r in requests] == ["t2", "t3", "t1"]
    assert requests[2].num_output_tokens == 7 and requests[2].block_tokens == 4
    seconds = parse_trace_lines(lines, replace(TINY, timestamp_unit_s=1.0))
    assert seconds[-1].arrival_s == 2500.0


def test_trace_sessions_follow_prefix_extensions():
    requests = parse_trace_lines(CONVERSATIONS, TINY)
    assert [r.session_id for r in requests] == ["t1", "t1", "t3", "t1", "t5", "t1"]
    assert parse_trace_lines(CONVERSATIONS, TINY) == requests  # deterministic
    strict = parse_trace_lines(CONVERSATIONS, replace(TINY, continuation_fraction=1.0))
    assert strict[5].session_id == "t6"  # a rewritten tail is no longer a continuation
    loose = parse_trace_lines(CONVERSATIONS, replace(TINY, min_shared_blocks=1, continuation_fraction=0.0))
    assert loose[2].session_id == "t1"


def test_oracle_counts_leading_prefix_hits_only():
    a, b, c, d = (BlockHash(bytes([i]) * 16) for i in range(4))
    requests = [
        Request(0.0, "s", (a, b), 8, 1, 4),
        Request(1.0, "s", (a, b, c), 14, 1, 4),  # 2 hits of 3
        Request(2.0, "s", (d, b, c), 12, 1, 4),  # b and c were seen, but d misses first: 0
    ]
    assert oracle_hit_rate(requests) == pytest.approx(2 / 8)
    assert oracle_hit_rate(requests, per="token") == pytest.approx(8 / 34)
    assert oracle_hit_tokens(requests) == [0, 8, 0]
    assert oracle_hit_rate([]) == 0.0
    with pytest.raises(InvalidArgument):
        oracle_hit_rate(requests, per="request")


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"timestamp": 0, "input_length": 4', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "missing field 'input_length'"),
        (_line(0, [1], "4"), "'input_length' must be int"),
        (_line(True, [1], 4), "'timestamp' must be int or float"),
        (_line(-1, [1], 4), "timestamp must be a finite number"),
        (_line(0, [1], 0), "input_length must be > 0"),
        (_line(0, [1, -2], 8), "hash_ids must be integers"),
        (_line(0, [1, 2**32], 8), "hash_ids must be integers"),
        (_line(0, [1, "2"], 8), "hash_ids must be integers"),
        (_line(0, [1, 2], 12), "2 hash_ids for 12 prompt tokens, expected 3"),
    ],
)
def test_trace_bad_lines_name_the_line(bad_line, message):
    lines = [_line(0, [1], 4), "", bad_line]  # the blank line is skipped but counted
    with pytest.raises(TraceFormatError, match=f"<trace>:3: .*{message}"):
        parse_trace_lines(lines, TINY)


def test_trace_file_errors_name_the_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(_line(0, [1], 4) + "\n" + _line(0, [1, 2, 3], 4) + "\n")
    with pytest.raises(TraceFormatError, match=f"{path}:2: 3 hash_ids"):
        read_trace(path, TINY)
    path.write_text("\n".join(CONVERSATIONS) + "\n")
    assert read_trace(path, TINY) == parse_trace_lines(CONVERSATIONS, TINY)


def _synthetic_trace() -> Path:
    path = shared_trace()
    if path is None:
        pytest.skip("the Mooncake synthetic trace (shared/traces) is not on this machine")
    return path


def test_mooncake_synthetic_trace_matches_its_published_figures():
    path = _synthetic_trace()
    as_published = read_trace(path, TraceFormat(keep_partial_block=True))
    assert len(as_published) == 3993
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(as_published, as_published[1:]))
    # README: 121,877 blocks requested, 43,924 distinct, 64.0% leading-prefix hits.
    assert sum(len(r.block_hashes) for r in as_published) == 121_877
    assert len({key for r in as_published for key in r.block_hashes}) == 43_924
    assert oracle_hit_rate(as_published) == pytest.approx(0.640, abs=0.005)
    full_blocks = read_trace(path)
    assert oracle_hit_rate(full_blocks) == pytest.approx(0.659, abs=0.005)
    assert all(len(r.block_hashes) == r.num_prompt_tokens // 512 for r in full_blocks)
    sessions = _by_session(full_blocks)
    assert 2000 < len(sessions) < 2600  # multi-turn conversations found, not one per request
    assert max(len(turns) for turns in sessions.values()) < 50  # nor merged through a shared start


# --- coding-agent generator ---------------------------------------------------------------

QUICK = PRESETS["quick"]
ONE_VARIANT = CodingAgentConfig(
    num_sessions=24,
    variants=(AgentVariant("solo", 10_000, 1.0),),
    context_window_tokens=64_000,  # small, so that most sessions compact, several times
)


@pytest.fixture(scope="module")
def quick_requests() -> list[Request]:
    return list(CodingAgentWorkload(QUICK).requests())


def test_agent_workload_is_reproducible_and_seeded(quick_requests):
    assert list(CodingAgentWorkload(QUICK).requests()) == quick_requests
    other = list(CodingAgentWorkload(replace(QUICK, seed=1)).requests())
    assert [r.arrival_s for r in other] != [r.arrival_s for r in quick_requests]
    session_keys = {r.block_hashes[-1] for r in quick_requests}
    assert not session_keys & {r.block_hashes[-1] for r in other}
    # A session's draws do not depend on how many sessions follow it.
    fewer = _by_session(CodingAgentWorkload(replace(QUICK, num_sessions=8)).requests())
    assert fewer == {s: turns for s, turns in _by_session(quick_requests).items() if s in fewer}


def test_agent_arrivals_are_ordered_and_poisson(quick_requests):
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(quick_requests, quick_requests[1:]))
    single_turn = replace(QUICK, num_sessions=2000, num_turns=LogNormal(1, 0.0, 1, 1))
    starts = np.array([r.arrival_s for r in CodingAgentWorkload(single_turn).requests()])
    assert np.mean(np.diff(starts)) == pytest.approx(1 / QUICK.session_rate_per_s, rel=0.1)


def test_agent_sessions_grow_by_appending_until_compaction(quick_requests):
    config = QUICK
    for turns in _by_session(quick_requests).values():
        assert config.num_turns.low <= len(turns) <= config.num_turns.high
        for before, after in zip(turns, turns[1:]):
            assert after.arrival_s >= before.arrival_s + before.num_output_tokens / config.decode_tokens_per_s
            if after.num_prompt_tokens < before.num_prompt_tokens:
                continue  # compaction, tested below
            appended = after.num_prompt_tokens - before.num_prompt_tokens - before.num_output_tokens
            assert config.tool_result_tokens.low <= appended <= config.tool_result_tokens.high
            assert after.block_hashes[: len(before.block_hashes)] == before.block_hashes


def test_agent_sizes_stay_within_bounds(quick_requests):
    config = QUICK
    shared = [v.shared_prefix_tokens for v in config.variants]
    for request in quick_requests:
        assert len(request.block_hashes) == request.num_prompt_tokens // config.block_tokens
        assert request.block_tokens == config.block_tokens
        assert config.output_tokens.low <= request.num_output_tokens <= config.output_tokens.high
        assert request.num_prompt_tokens + request.num_output_tokens <= config.context_window_tokens
    for turns in _by_session(quick_requests).values():
        own = turns[0].num_prompt_tokens - np.array(shared)
        assert np.any((config.task_tokens.low <= own) & (own <= config.task_tokens.high))
    mean_start = np.mean([turns[0].num_prompt_tokens for turns in _by_session(quick_requests).values()])
    assert 20_000 < mean_start < 40_000  # DESIGN.md: sessions start around 30K tokens


def test_agent_compaction_keeps_only_the_shared_prompt():
    config = ONE_VARIANT
    num_shared_blocks = config.variants[0].shared_prefix_tokens // config.block_tokens
    num_compactions = 0
    for turns in _by_session(CodingAgentWorkload(config).requests()).values():
        for before, after in zip(turns, turns[1:]):
            if after.num_prompt_tokens > before.num_prompt_tokens:
                continue
            num_compactions += 1
            # Only a prompt that could have outgrown the window is compacted.
            assert before.num_prompt_tokens + before.num_output_tokens + config.tool_result_tokens.high > (
                config.context_window_tokens - config.output_tokens.high
            )
            assert _common_prefix(before.block_hashes, after.block_hashes) == num_shared_blocks
            summary = after.num_prompt_tokens - config.variants[0].shared_prefix_tokens
            assert config.summary_tokens.low <= summary <= config.summary_tokens.high
    assert num_compactions >= 10


def test_agent_variant_prompts_are_shared_across_sessions(quick_requests):
    config = QUICK
    num_shared_blocks = {v.shared_prefix_tokens // config.block_tokens for v in config.variants}
    firsts = [turns[0] for turns in _by_session(quick_requests).values()]
    by_variant: dict[BlockHash, list[Request]] = defaultdict(list)
    for request in firsts:
        by_variant[request.block_hashes[0]].append(request)
    assert len(by_variant) == len(config.variants)
    for group in by_variant.values():
        assert len(group) >= 2
        common = min(_common_prefix(group[0].block_hashes, other.block_hashes) for other in group[1:])
        assert common in num_shared_blocks  # shared exactly up to the variant's prompt
    # Past the shared prompt every session is its own: its first own block is unique.
    own_blocks = [r.block_hashes[-1] for r in firsts]
    assert len(set(own_blocks)) == len(firsts)
    # Same product, same prompt, whatever the workload seed.
    reseeded = next(iter(CodingAgentWorkload(replace(config, seed=7)).requests()))
    assert reseeded.block_hashes[0] in by_variant


def test_agent_block_size_is_configurable():
    config = replace(ONE_VARIANT, num_sessions=2, block_tokens=16)
    for request in CodingAgentWorkload(config).requests():
        assert len(request.block_hashes) == request.num_prompt_tokens // 16


def test_agent_caches_hit_the_repeated_context(quick_requests):
    # Each turn resends the last, so one infinite cache serves most blocks (measured ≈ 0.967);
    # keys that did not chain across turns would score near 1/50.
    assert oracle_hit_rate(quick_requests) > 0.9


def test_agent_config_is_checked():
    with pytest.raises(InvalidArgument, match="cannot hold a fresh context"):
        CodingAgentConfig(context_window_tokens=40_000)
    with pytest.raises(InvalidArgument, match="unique"):
        CodingAgentConfig(variants=(AgentVariant("a", 1000, 1.0), AgentVariant("a", 2000, 1.0)))
    with pytest.raises(InvalidArgument, match="session_rate_per_s"):
        CodingAgentConfig(session_rate_per_s=0)
    with pytest.raises(InvalidArgument):
        LogNormal(100, 0.5, 200, 100)
