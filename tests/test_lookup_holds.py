"""Lookup holds, against real `kvstore serve` processes: the blocks a scheduler's lookup
counted are still there when its worker loads them, however hard other engines write
meanwhile; a hold ends when released, at its deadline, or with its connection, and a
connection can end only its own holds."""

from __future__ import annotations

import urllib.request

import pytest
from daemon_harness import daemons, eventually
from test_integrity import LAYOUT, Raw, chain, load_intact, save

from kvstore.client import KVStoreClient
from kvstore.errors import InvalidArgument
from kvstore.localproto import Op, pack_handles, pack_hashes
from kvstore.namespace import Namespace

pytestmark = pytest.mark.slow

NAMESPACE = Namespace("test/holds", LAYOUT, tenant_salt="holds")
OTHER = Namespace("test/holds", LAYOUT, tenant_salt="holds-rank-1")
HELD = 64  # blocks a scheduler counts (2 MiB)
FLOOD = 2600  # blocks another engine writes meanwhile: more than the 64 MiB host tier holds


@pytest.fixture
def daemon(tmp_path):
    with daemons(tmp_path) as start:
        yield start(extra={"nvme.enabled": "false"})  # an evicted block is gone, not demoted


def _flood(client: KVStoreClient, digest: bytes) -> None:
    """Another engine's saves, enough to evict every block not held."""
    for seed in range(100, 100 + FLOOD // 100):
        save(client, digest, chain(seed, 100))


def _clients(daemon) -> tuple[KVStoreClient, KVStoreClient, bytes]:
    scheduler, writer = KVStoreClient(daemon.socket), KVStoreClient(daemon.socket)
    digest = scheduler.register_namespace(NAMESPACE)
    writer.register_namespace(NAMESPACE)
    return scheduler, writer, digest


def _stored(daemon) -> tuple[KVStoreClient, KVStoreClient, bytes, list[bytes]]:
    """A scheduler's and a writer's connection, and a chain of HELD blocks stored."""
    scheduler, writer, digest = _clients(daemon)
    hashes = chain(1, HELD)
    assert save(writer, digest, hashes) == HELD
    return scheduler, writer, digest, hashes


def test_without_a_hold_a_flood_evicts_what_a_lookup_counted(daemon):
    """The hazard holds exist for: counted, then gone before the load."""
    scheduler, writer, digest, hashes = _stored(daemon)
    assert scheduler.lookup(digest, hashes).num_blocks == HELD
    _flood(writer, digest)
    assert load_intact(scheduler, digest, hashes)[0] < HELD


def test_blocks_a_lookup_holds_survive_a_flood_and_load_whole(daemon):
    scheduler, writer, digest, hashes = _stored(daemon)
    held = scheduler.lookup_held([digest], hashes, hold_s=60)
    assert held.hold_id and [r.num_blocks for r in held.results] == [HELD]
    _flood(writer, digest)
    worker = KVStoreClient(daemon.socket)  # the load comes from another process's connection
    worker.register_namespace(NAMESPACE)
    assert load_intact(worker, digest, hashes) == (HELD, True)
    # released, the blocks are ordinary cache again: the next flood may take them
    scheduler.release_holds([held.hold_id])
    _flood(writer, digest)
    assert load_intact(worker, digest, hashes)[0] < HELD


def test_a_hold_covers_each_namespace_asked_and_only_what_was_found(daemon):
    scheduler, writer, digest = _clients(daemon)
    other = scheduler.register_namespace(OTHER)
    writer.register_namespace(OTHER)
    hashes = chain(2, HELD)
    save(writer, digest, hashes)
    save(writer, other, hashes[: HELD // 2])
    held = scheduler.lookup_held([digest, other], hashes, hold_s=60)
    assert [r.num_blocks for r in held.results] == [HELD, HELD // 2]
    _flood(writer, digest)
    assert load_intact(scheduler, digest, hashes)[0] == HELD
    assert load_intact(scheduler, other, hashes)[0] == HELD // 2
    # nothing cached: nothing held, no id to release
    assert scheduler.lookup_held([digest], chain(3, 4), hold_s=60).hold_id == 0


def test_a_hold_ends_at_its_deadline(daemon):
    scheduler, writer, digest, hashes = _stored(daemon)
    assert scheduler.lookup_held([digest], hashes, hold_s=1.0).hold_id
    assert eventually(lambda: _gauge(daemon, "kvstore_lookup_holds") == 1)
    assert eventually(lambda: _gauge(daemon, "kvstore_lookup_holds") == 0, timeout_s=10)
    _flood(writer, digest)
    assert load_intact(scheduler, digest, hashes)[0] < HELD


def test_a_hold_ends_with_its_connection_and_releases_ride_on_the_next_lookup(daemon):
    scheduler, writer, digest, hashes = _stored(daemon)
    first = scheduler.lookup_held([digest], hashes, hold_s=60)
    second = scheduler.lookup_held([digest], hashes, hold_s=60, release=[first.hold_id])
    assert second.hold_id != first.hold_id
    assert eventually(lambda: _gauge(daemon, "kvstore_lookup_holds") == 1)
    scheduler.close()
    assert eventually(lambda: _gauge(daemon, "kvstore_lookup_holds") == 0)
    _flood(writer, digest)
    assert load_intact(writer, digest, hashes)[0] < HELD


def test_a_connection_cannot_end_another_connections_hold(daemon):
    scheduler, writer, digest, hashes = _stored(daemon)
    held = scheduler.lookup_held([digest], hashes, hold_s=60)
    writer.release_holds([held.hold_id])  # ignored: not the writer's
    own = writer.lookup_held([digest], hashes[:1], hold_s=60, release=[held.hold_id])  # ignored too
    writer.release_holds([own.hold_id])
    _flood(writer, digest)
    assert load_intact(scheduler, digest, hashes)[0] == HELD


MALFORMED = [
    ((0.0,), "positive number of seconds"),
    ((float("nan"),), "positive number of seconds"),
    ((601.0,), "at most 600 seconds"),
    ((5.0, pack_handles([0])), "positive 64-bit"),
    ((5.0, [1]), "hold ids are one bytes string"),
    ((5.0, b"\x01" * 7), "hold ids are one bytes string"),
    ((5.0, pack_handles([1] * 4097)), "at most 4096"),
]


def test_malformed_holds_get_a_clear_error_and_hold_nothing(daemon):
    _scheduler, writer, digest = _clients(daemon)
    hashes = chain(1, 4)
    save(writer, digest, hashes)
    raw = Raw(daemon.socket)  # the wire's bounds, as any client could send them
    try:
        for args, sentence in MALFORMED:
            with pytest.raises(InvalidArgument, match=sentence):
                raw.call(Op.LOOKUP_HOLD, digest, pack_hashes(hashes), *args)
        with pytest.raises(InvalidArgument, match="hold ids are one bytes string"):
            raw.call(Op.HOLD_RELEASE, 7)
        assert raw.call(Op.HOLD_RELEASE, pack_handles([12345678901])) is None  # not this connection's: ignored
    finally:
        raw.close()
    assert _gauge(daemon, "kvstore_lookup_holds") == 0


def _gauge(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")
