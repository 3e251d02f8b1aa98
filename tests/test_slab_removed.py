"""A daemon whose shared-memory file is removed under it (systemd's ``RemoveIPC=yes``)
says so — NOT_SERVING, a sentence in its log and in ``kvstore status`` — and recreates the
file for the next engine; blocks of the lost file are misses or their own bytes, never
another block's (a real daemon, real engine clients over its socket, the real CLI)."""

import fcntl
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from daemon_harness import daemons, eventually
from engine_proc import LAYOUT, NAMESPACE, kv_for

from kvstore.api.client import connect
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError, NotFound, TierUnavailable
from kvstore.hashing import chain_hashes
from kvstore.tiers.host import HostTier, HostTierConfig, SharedSlab
from kvstore.tiers.manager import TierManager, TierManagerConfig

SENTENCE = "was removed or replaced"
TOKEN = "slab-removed-test-token-5d1f0c8e9a7b"
BLOCK = torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8)


def health(daemon) -> str:
    with connect(daemon.address, token=TOKEN) as client:
        return client.health()


def status(daemon) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "--socket", str(daemon.socket), "--json", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVSTORE_TOKEN": TOKEN},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def load(client: KVStoreClient, digest: bytes, hashes: list[bytes]) -> tuple[int, bool]:
    """(blocks loaded, whether each loaded block holds its own bytes); a call the daemon
    could not answer is a miss."""
    into = [torch.empty(LAYOUT.block_bytes // 2, dtype=torch.float16) for _ in hashes]
    for _ in range(20):
        try:
            loaded = client.load(digest, hashes, into)
        except KVStoreError:
            time.sleep(0.1)  # the connection was cut: the client reconnects on a later call
            continue
        return loaded, all(torch.equal(t, kv_for(h)) for t, h in zip(into[:loaded], hashes))
    raise AssertionError("the client never got an answer from the daemon again")


@pytest.fixture
def daemon(tmp_path):
    with daemons(tmp_path) as start:
        yield start


def chain(seed: int, num_blocks: int) -> list[bytes]:
    return chain_hashes([(seed * 7919 + i) % 50_000 for i in range(num_blocks * LAYOUT.block_size)], LAYOUT.block_size)


def save_and_load(client: KVStoreClient, seed: int, num_blocks: int) -> None:
    digest = client.register_namespace(NAMESPACE)
    hashes = chain(seed, num_blocks)
    assert client.save(digest, hashes, [kv_for(h) for h in hashes]) == num_blocks
    assert load(client, digest, hashes) == (num_blocks, True)


@pytest.mark.slow
def test_a_removed_slab_file_is_reported_and_recreated_and_old_blocks_are_never_wrong(daemon):
    d = daemon(token=TOKEN)
    slab = Path(d.state["host_slab"])
    old_hashes = chain(7, 8)
    # an engine that stays connected across the removal, mapping the old file
    with KVStoreClient(str(d.socket)) as old_engine:
        digest = old_engine.register_namespace(NAMESPACE)
        assert old_engine.save(digest, old_hashes, [kv_for(h) for h in old_hashes]) == 8
        assert health(d) == "SERVING"
        old_inode = slab.stat().st_ino

        slab.unlink()
        assert eventually(lambda: health(d) == "NOT_SERVING")
        problems = status(d)["problems"]
        assert len(problems) == 1 and str(slab) in problems[0] and SENTENCE in problems[0]
        assert d.log().count(SENTENCE) == 1  # said once, not on every check

        # a new engine gets a new file: the old blocks are misses or their own bytes, and
        # what it saves there loads back whole
        with KVStoreClient(str(d.socket)) as new_engine:
            count, intact = load(new_engine, new_engine.register_namespace(NAMESPACE), old_hashes)
            assert intact and count in (0, 8)
            save_and_load(new_engine, seed=6, num_blocks=10)
        assert slab.exists() and slab.stat().st_ino != old_inode
        assert health(d) == "SERVING" and status(d)["problems"] == []

        # the engine that mapped the old file is never served another block's bytes
        count, intact = load(old_engine, digest, old_hashes)
        assert intact and count in (0, 8)
        save_and_load(old_engine, seed=9, num_blocks=6)
    assert d.process.poll() is None


@pytest.mark.slow
def test_a_replaced_slab_file_is_noticed_when_an_engine_connects(daemon):
    d = daemon(token=TOKEN)
    slab = Path(d.state["host_slab"])
    hashes = chain(8, 4)
    with KVStoreClient(str(d.socket)) as first:
        digest = first.register_namespace(NAMESPACE)
        assert first.save(digest, hashes, [kv_for(h) for h in hashes]) == 4
    # another file under the same name: engines that connect must not map it as the daemon's
    slab.unlink()
    slab.write_bytes(bytes(LAYOUT.block_bytes * 64))
    replaced_inode = slab.stat().st_ino
    with KVStoreClient(str(d.socket)) as new_engine:
        count, intact = load(new_engine, new_engine.register_namespace(NAMESPACE), hashes)
        assert intact and count in (0, 4)
        assert slab.stat().st_ino != replaced_inode
        save_and_load(new_engine, seed=10, num_blocks=4)
    assert SENTENCE in d.log()
    assert health(d) == "SERVING"


def test_replacing_the_host_file_keeps_granted_leases_whole_and_voids_open_reservations(tmp_path):
    """The tier manager's side, with a real host tier file: what was granted over the old
    file stays readable there; what was reserved there is never committed into the new."""
    host = HostTier(HostTierConfig(capacity_bytes=8 * BLOCK.numel(), name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=64 * 1024))
    manager = TierManager(TierManagerConfig(), [host])
    try:
        manager.register_namespace(NAMESPACE)
        digest = NAMESPACE.digest
        hashes = chain(11, 3)
        data = [torch.full_like(BLOCK, i + 1) for i in range(3)]
        manager.put(digest, hashes[:2], data[:2])
        lease = manager.acquire(digest, hashes[:2])
        reservation = manager.reserve(digest, hashes[2:], parent_hash=hashes[1])
        engine_view = SharedSlab.attach(host.path)  # an engine that mapped the file before it went
        host.path.unlink()
        assert manager.host_slab_problem() is not None

        assert manager.replace_host_slab() == 2
        assert manager.host_slab_problem() is None
        with pytest.raises(TierUnavailable):  # its slots in the new file hold other bytes
            manager.lease_views(lease)
        for block in lease.blocks:  # the engine's mapping of the old file still holds what it was granted
            assert torch.equal(engine_view.view(block.slot, BLOCK.numel()), data[lease.blocks.index(block)])
        with pytest.raises(NotFound):
            manager.commit(reservation.id, None, [0])
        manager.release(lease.id)
        assert manager.lookup(digest, hashes) == []

        manager.put(digest, hashes, data)
        fresh = SharedSlab.attach(host.path)  # an engine that connects now
        lease = manager.acquire(digest, hashes)
        assert [torch.equal(fresh.view(block.slot, BLOCK.numel()), d) for block, d in zip(lease.blocks, data)] == [True] * 3
        manager.release(lease.id)
        fresh.close()
        engine_view.close()
    finally:
        manager.close()


def test_a_file_a_live_process_holds_is_never_taken_over_and_nothing_changes(tmp_path):
    host = HostTier(HostTierConfig(capacity_bytes=8 * BLOCK.numel(), name=f"kvstore-test-{uuid.uuid4().hex[:8]}", page_bytes=64 * 1024))
    manager = TierManager(TierManagerConfig(), [host])
    try:
        manager.register_namespace(NAMESPACE)
        digest = NAMESPACE.digest
        hashes = chain(12, 2)
        data = [torch.full_like(BLOCK, 7 + i) for i in range(2)]
        manager.put(digest, hashes, data)
        host.path.unlink()
        with open(host.path, "wb") as squatter:  # another live owner of the name
            fcntl.flock(squatter, fcntl.LOCK_EX)
            with pytest.raises(TierUnavailable, match="live"):
                manager.replace_host_slab()
            assert manager.host_slab_problem() is not None
            lease = manager.acquire(digest, hashes)  # engines already connected are served as before
            assert [torch.equal(v, d) for v, d in zip(manager.lease_views(lease), data)] == [True, True]
            manager.release(lease.id)
        host.path.unlink()
    finally:
        manager.close()
