"""The client's in-place calls (what a layer-wise connector uses) against a real daemon:
reserve slots and fill them layer by layer before committing; lease slots and read them
where they lie."""

import time

import pytest
import torch
from daemon_harness import daemons

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

pytestmark = pytest.mark.slow
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16", inner_order="HND")
NAMESPACE = Namespace("test/in-place", LAYOUT)
HASHES = chain_hashes(list(range(8 * 16)), 16)


def block(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.block_bytes // 2, generator=torch.Generator().manual_seed(seed)).bfloat16().view(torch.uint8)


def num_leases(daemon) -> int:
    with connect(daemon.address) as api:
        return api.admin.Stats(pb.StatsRequest()).num_leases


@pytest.fixture
def daemon(tmp_path):
    with daemons(tmp_path) as start:
        yield start()


def test_a_reservation_filled_layer_by_layer_is_stored_on_commit(daemon):
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        assert client.save(digest, HASHES[:3], [block(i) for i in range(3)]) == 3
        pending = client.begin_save(digest, HASHES, parent_hash=None)
        assert pending.indices == tuple(range(3, 8))  # the cached blocks get no slot
        for layer in range(LAYOUT.num_layers):
            offset, length = LAYOUT.layer_slice(layer)
            for index, view in zip(pending.indices, pending.views):
                view[offset : offset + length].copy_(block(index)[offset : offset + length])
        assert client.lookup(digest, HASHES).num_blocks == 3  # invisible until committed
        assert client.commit(pending) == 5
        into = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8) for _ in HASHES]
        assert client.load(digest, HASHES, into) == 8
        assert all(torch.equal(got, block(i)) for i, got in enumerate(into))


def test_a_commit_sent_without_waiting_is_stored_and_its_answer_reaches_the_caller_at_a_later_call(daemon):
    """commit_detached (a CPU engine's in-step commit): the daemon stores the blocks, and
    the answer — blocks stored, or the daemon's error — is handed over by the next call
    that reads it, or by collect_detached."""
    answers: list[tuple[int | None, str]] = []
    with KVStoreClient(daemon.socket) as client, KVStoreClient(daemon.socket) as other:
        digest = client.register_namespace(NAMESPACE)
        pending = client.begin_save(digest, HASHES[:4], parent_hash=None)
        for index, view in zip(pending.indices, pending.views):
            view.copy_(block(index))
        client.commit_detached(pending, lambda stored, error: answers.append((stored, error)))
        deadline = time.monotonic() + 10
        while other.lookup(other.register_namespace(NAMESPACE), HASHES).num_blocks < 4:
            assert time.monotonic() < deadline, "the detached commit was never stored"
            time.sleep(0.01)
        assert client.lookup(digest, HASHES).num_blocks == 4  # this call reads the commit's answer too
        assert answers == [(4, "")]
        into = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8) for _ in range(4)]
        assert client.load(digest, HASHES[:4], into) == 4
        assert all(torch.equal(got, block(i)) for i, got in enumerate(into))
        # a reservation the daemon no longer has: it refuses the commit, and the caller hears why
        pending = client.begin_save(digest, HASHES[4:6], parent_hash=HASHES[3])
        client.abort(pending)
        client.commit_detached(pending, lambda stored, error: answers.append((stored, error)))
        client.collect_detached()
        assert len(answers) == 2 and answers[1][0] is None and answers[1][1], answers
        assert client.lookup(digest, HASHES).num_blocks == 4


def test_an_aborted_reservation_leaves_nothing_behind(daemon):
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        pending = client.begin_save(digest, HASHES)
        pending.views[0].fill_(1)
        client.abort(pending)
        assert client.lookup(digest, HASHES).num_blocks == 0
        assert len(client.begin_save(digest, HASHES).views) == 8  # the slots were given back


def test_a_lease_reads_the_stored_prefix_in_place_until_released(daemon):
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        client.save(digest, HASHES[:5], [block(i) for i in range(5)])
        lease = client.acquire(digest, HASHES)
        assert lease.num_blocks == 5  # the prefix ends at the first missing block
        assert all(torch.equal(view, block(i)) for i, view in enumerate(lease.views))
        assert num_leases(daemon) >= 1
        client.release(lease)
        deadline = time.monotonic() + 10
        while num_leases(daemon) and time.monotonic() < deadline:  # the release is not waited for
            time.sleep(0.05)
        assert num_leases(daemon) == 0
        assert client.acquire(digest, chain_hashes([9] * 32, 16)).num_blocks == 0


@pytest.mark.gpu
def test_blocks_saved_from_and_loaded_into_gpu_memory_are_copied_before_their_slots_go_back(daemon):
    with KVStoreClient(daemon.socket, pin_for_gpu=True) as client:  # the engine pins its own mapping
        assert client._core.pinned
        digest = client.register_namespace(NAMESPACE)
        on_gpu = [block(i).cuda() for i in range(len(HASHES))]
        assert client.save(digest, HASHES, on_gpu) == len(HASHES)  # checksummed in the slab, after the copy
        into = [torch.zeros_like(b) for b in on_gpu]
        assert client.load(digest, HASHES, into) == len(HASHES)
        # the leases are gone: the slots may be reused at once, and the GPU copies must be complete by now
        with connect(daemon.address) as api:
            api.admin.Evict(pb.EvictRequest(namespace_id=digest, block_hashes=HASHES))
        client.save(digest, chain_hashes(list(range(10_000, 10_000 + 8 * 16)), 16), [block(100 + i) for i in range(8)])
        assert all(torch.equal(a, b) for a, b in zip(into, on_gpu))


def test_the_shards_of_a_tensor_parallel_engine_are_looked_up_in_one_round_trip(daemon):
    ranks = [Namespace("test/in-place", LAYOUT, tp_rank, 2) for tp_rank in (0, 1)]
    with KVStoreClient(daemon.socket) as client:
        digests = [client.register_namespace(namespace) for namespace in ranks]
        client.save(digests[0], HASHES[:6], [block(i) for i in range(6)])
        client.save(digests[1], HASHES[:4], [block(10 + i) for i in range(4)])
        found = client.lookup_shards(digests, HASHES)
        assert [result.num_blocks for result in found] == [6, 4]
        assert found == [client.lookup(digest, HASHES) for digest in digests]
