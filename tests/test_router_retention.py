"""The router keeps a session's chain on its replica's daemon through its pause and asks
for it back at its next turn (kvstore/gateway/retention.py): against the real `kvstore
router` process, two real daemons and two http_replica engines (test_router_stale_load's
fleet). What a daemon does with Retain and Prefetch — the eviction order, demotion to
NVMe, promotion, the fetch from a session's previous replica — is tested against real
daemons in tests/test_session_retention.py; the pure pause bookkeeping here too."""

from __future__ import annotations

import re

import httpx
import pytest
from daemon_harness import eventually
from test_engine_subscriptions import BLOCK
from test_router_stale_load import conversation, fleet

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.config import ConfigError
from kvstore.gateway.config import RetentionConfig
from kvstore.gateway.retention import MIN_FLEET_PAUSES, PAUSES_KEPT, RetentionPlan


def retention_calls(router: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{router}/metrics", timeout=5).text
    found = re.findall(r'^kvstore_router_retention_calls_total\{call="([^"]+)",outcome="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {(call, outcome): float(value) for call, outcome, value in found}


def retained_keys(address: str, token: str) -> int:
    with connect(address, token=token or None) as client:
        return int(client.admin.Stats(pb.StatsRequest()).counters["retained_blocks"])


def test_a_sessions_turn_retains_its_chain_on_its_replica_and_its_next_turn_prefetches_it(tmp_path):
    with fleet(tmp_path) as f:
        addresses = {node_id: (daemon.address, daemon.token) for node_id, daemon in f.daemons.items()}
        prompt = conversation(50_000)
        first = f.complete(prompt, "agent-1", "tenant-1")
        replica = first.headers["x-kvstore-replica"]
        # its answer is in: the turn's whole chain is retained on the replica that computed it
        assert eventually(lambda: retention_calls(f.router).get(("Retain", "ok")) == 1), retention_calls(f.router)
        assert retention_calls(f.router).get(("Prefetch", "ok")) == 1
        assert retained_keys(*addresses[replica]) == len(prompt) // BLOCK
        other = "replica-b" if replica == "replica-a" else "replica-a"
        assert retained_keys(*addresses[other]) == 0
        # a completion without a session id is not kept (its session is a guess from its prefix)
        body = {"model": "tiny", "prompt": conversation(60_000), "max_tokens": 1}
        assert httpx.post(f"{f.router}/v1/completions", json=body, timeout=30).status_code == 200

        second = f.complete(conversation(50_000, turns=2), "agent-1", "tenant-1")
        assert second.headers["x-kvstore-replica"] == replica  # sticky
        # its first turn asked for what the replica holds of it too (the shared system prompt)
        assert eventually(lambda: retention_calls(f.router).get(("Prefetch", "ok")) == 2), retention_calls(f.router)
        # the second turn extends the chain: retained as far as it goes now
        assert eventually(lambda: retained_keys(*addresses[replica]) == len(conversation(50_000, turns=2)) // BLOCK)
        assert retention_calls(f.router).get(("Retain", "ok")) == 2
        assert not any(outcome != "ok" for _call, outcome in retention_calls(f.router))


def test_a_daemon_that_does_not_answer_costs_the_session_nothing_but_its_retention(tmp_path):
    with fleet(tmp_path) as f:
        for daemon in f.daemons.values():
            daemon.stop()
        for turn in (1, 2):
            answer = f.complete(conversation(70_000, turns=turn), "agent-2", "tenant-1")
            assert answer.status_code == 200
        assert eventually(lambda: retention_calls(f.router).get(("Retain", "failed"), 0) == 2), retention_calls(f.router)
        assert retention_calls(f.router).get(("Prefetch", "failed"), 0) == 2


def test_a_sessions_retention_follows_its_longest_recent_pause_and_the_fleets_within_bounds():
    config = RetentionConfig(first_ttl_s=60, min_ttl_s=5, max_ttl_s=300, margin=2)
    plan = RetentionPlan(config, max_sessions=100)
    assert plan.resumed("s", "a", now=0.0) is None  # its first turn
    assert plan.ended("s", "a", now=1.0) == 60  # too few pauses have ended: first_ttl_s
    assert plan.resumed("s", "a", now=11.0) is None  # paused 10 s, on the same replica
    assert plan.ended("s", "a", now=12.0) == 60  # the first pauses to end are the short ones
    assert plan.resumed("s", "b", now=52.0) == "a"  # paused 40 s, and moved: its blocks are on a
    assert plan.ended("s", "b", now=53.0) == 80  # its own longest recent pause
    plan.resumed("s", "b", now=1053.0)
    assert plan.ended("s", "b", now=1054.0) == 300  # at most max_ttl_s
    for i in range(PAUSES_KEPT):  # its long pauses age out of its recent ones
        plan.resumed("s", "b", now=1054.5 + i)
        plan.ended("s", "b", now=1055.0 + i)
    assert plan.ttl_s("s") == 60
    for i in range(MIN_FLEET_PAUSES):  # enough sessions' pauses have ended: theirs count
        plan.ended(f"t{i}", "a", now=2000.0)
        plan.resumed(f"t{i}", "a", now=2000.0 + (20.0 if i % 10 == 9 else 1.0))
    assert plan.fleet_floor() == 20  # the 90th percentile of 43 pauses, 5 of them 20 s or longer
    assert plan.ttl_s("s") == 40  # its own pauses are short; the fleet's say a pause may be longer
    assert plan.ended("new", "a", now=3000.0) == 40  # a session that has not paused: the fleet's


def test_a_fleet_of_short_pauses_retains_for_min_ttl_s_and_forgets_the_least_recent_session():
    plan = RetentionPlan(RetentionConfig(first_ttl_s=60, min_ttl_s=5, max_ttl_s=300, margin=2), max_sessions=MIN_FLEET_PAUSES)
    for i in range(MIN_FLEET_PAUSES):
        plan.ended(f"s{i}", "a", now=0.0)
        plan.resumed(f"s{i}", "b", now=1.0)
    assert plan.fleet_floor() == 1 and plan.ended("s0", "b", now=2.0) == 5
    plan.ended("one-more", "a", now=3.0)  # beyond max_sessions: the least recently seen is forgotten
    assert len(plan) == MIN_FLEET_PAUSES and plan.resumed("s1", "a", now=4.0) is None


def test_retention_settings_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="must not exceed"):
        RetentionConfig(min_ttl_s=10, max_ttl_s=5)
    with pytest.raises(ConfigError, match="router.retention.margin must be a positive number"):
        RetentionConfig(margin=0)
