"""Integrity under faults, against real `kvstore serve` processes (DESIGN decisions 12, 14).

Each test provokes one way an engine could be handed another block's bytes, or a fault
could spread beyond its cause, and asserts that it cannot happen: slots have one owner
at a time, late writers are fenced, handles belong to their connection, replies are
matched by request id, a read failure is the source tier's fault, the loop never waits
on the disk, and bad input gets a clear error without leaking capacity.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
from blocks import chain_of, content_of
from daemon_harness import daemons, eventually

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.errors import DaemonUnavailable, InvalidArgument, KVStoreError, NotFound, ReservationExpired
from kvstore.layout import KVLayout
from kvstore.localproto import PROTOCOL_VERSION, Op, encode_request, namespace_to_wire, pack_hashes
from kvstore.namespace import Namespace

pytestmark = pytest.mark.slow

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")  # 32 KiB blocks
NAMESPACE = Namespace("test/integrity", LAYOUT, tenant_salt="integrity")
BLOCK = LAYOUT.block_bytes


def chain(seed: int, num_blocks: int) -> list[bytes]:
    return chain_of(LAYOUT, seed, num_blocks)


def content(block_hash: bytes) -> torch.Tensor:
    """The bytes a block must hold: derived from its key, so any other bytes are wrong."""
    return content_of(block_hash, BLOCK)


def save(client: KVStoreClient, digest: bytes, hashes: list[bytes]) -> int:
    return client.save(digest, hashes, [content(h) for h in hashes])


def load_intact(client: KVStoreClient, digest: bytes, hashes: list[bytes]) -> tuple[int, bool]:
    into = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in hashes]
    loaded = client.load(digest, hashes, into)
    return loaded, all(torch.equal(t, content(h)) for t, h in zip(into[:loaded], hashes))


def stats(daemon) -> pb.StatsResponse:
    with connect(daemon.address) as api:
        return api.admin.Stats(pb.StatsRequest())


def host_used(daemon) -> int:
    return next(t.used_bytes for t in stats(daemon).tiers if t.tier == pb.TIER_HOST)


class Raw:
    """One connection speaking the local protocol frame by frame, for requests no client
    would send."""

    def __init__(self, path: Path, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))
        self.next_id = 1
        self.call(Op.HELLO, PROTOCOL_VERSION)

    def send_frame(self, payload: bytes) -> None:
        self.sock.sendall(struct.pack("<I", len(payload)) + payload)

    def send(self, op: int, *args) -> int:
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.sock.sendall(encode_request(request_id, op, args))
        return request_id

    def reply(self) -> list:
        (length,) = struct.unpack("<I", self._exactly(4))
        return msgpack.unpackb(self._exactly(length), raw=False)

    def call(self, op: int, *args):
        request_id = self.send(op, *args)
        reply = self.reply()
        assert reply[0] == request_id, reply
        if reply[1] != 0:
            raise _error(reply[2], reply[3])
        return reply[2]

    def _exactly(self, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = self.sock.recv(count - len(data))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def _error(kind: str, sentence: str) -> KVStoreError:
    import kvstore.errors as errors

    error = getattr(errors, kind, KVStoreError)
    return error(sentence)


@pytest.fixture
def start(tmp_path):
    with daemons(tmp_path) as start:
        yield start


# -- 1. a slot is reused only when its owner let go or is provably gone -----------------------
def test_an_expired_reservation_is_fenced_its_late_bytes_land_nowhere(start):
    daemon = start(extra={"manager.reservation_ttl_s": "0.5"})
    slow = KVStoreClient(daemon.socket)
    fast = KVStoreClient(daemon.socket)
    digest = slow.register_namespace(NAMESPACE)
    fast.register_namespace(NAMESPACE)
    stalled = chain(1, 4)
    pending = slow.begin_save(digest, stalled)  # a writer that stalls past its reservation's TTL
    time.sleep(1.5)
    other = chain(2, 4)
    assert save(fast, digest, other) == 4  # another engine saves meanwhile
    assert save(fast, digest, stalled) == 4  # and the stalled writer's keys are free to be written again
    for view in pending.views:  # the stalled writer wakes up and finishes its copies
        view.fill_(0xEE)
    with pytest.raises(ReservationExpired):
        slow.commit(pending)
    for hashes in (other, stalled):
        assert load_intact(fast, digest, hashes) == (4, True)
    slow.close()
    fast.close()
    assert eventually(lambda: stats(daemon).num_reservations == 0 and host_used(daemon) == 8 * BLOCK)


def test_a_live_writer_whose_connection_closed_keeps_its_slots_until_its_process_exits(start, tmp_path):
    daemon = start()
    script = (
        "import sys, time, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_integrity import NAMESPACE, chain\n"
        "from kvstore.client import KVStoreClient\n"
        "client = KVStoreClient(sys.argv[1])\n"
        "digest = client.register_namespace(NAMESPACE)\n"
        "pending = client.begin_save(digest, chain(3, 4))\n"
        "client._connection.sock.close()\n"  # the socket goes, the process (and its copies) do not
        "print('reserved', flush=True)\n"
        "time.sleep(3)\n"
        "for view in pending.views: view.fill_(0xEE)\n"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", script, str(daemon.socket), str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout.readline().strip() == "reserved"
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        time.sleep(0.5)
        hashes = chain(4, 4)
        assert save(client, digest, hashes) == 4  # may not land in the writer's slots
        writer.wait(timeout=30)
        assert load_intact(client, digest, hashes) == (4, True)
    assert eventually(lambda: host_used(daemon) == 4 * BLOCK)  # the writer's slots came back once it exited


# -- 2. blocks carry a checksum from the moment they are committed -------------------------------
def _overwrite_committed(daemon, client: KVStoreClient, digest: bytes, block_hash: bytes) -> None:
    """What a stale writer or a stray pointer does: change a committed block's bytes in the slab."""
    lease = client.acquire(digest, [block_hash])
    assert lease.num_blocks == 1
    lease.views[0][100:200].fill_(0x5A)
    client.release(lease)


def test_bytes_changed_after_commit_are_never_demoted_to_nvme(start):
    daemon = start()
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        hashes = chain(5, 6)
        assert save(client, digest, hashes) == 6
        _overwrite_committed(daemon, client, digest, hashes[3])
    daemon.stop(signal.SIGTERM)  # a clean stop moves the host tier to NVMe
    daemon.start()
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        assert load_intact(client, digest, hashes) == (3, True)  # the changed block is a miss, never data


def test_a_peer_never_stores_bytes_changed_after_commit(start, redis):
    a = start(extra={"index.backend": redis.url})
    b = start(extra={"index.backend": redis.url})
    hashes = chain(6, 6)
    with KVStoreClient(a.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        assert save(client, digest, hashes) == 6
        _overwrite_committed(a, client, digest, hashes[2])
    with KVStoreClient(b.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        into = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in hashes]
        loaded = client.load(digest, hashes, into, allow_remote=True, deadline_s=10, source=a.transport_address)
        assert loaded == 2 and all(torch.equal(t, content(h)) for t, h in zip(into[:2], hashes))


def test_loads_verified_by_the_client_when_configured(start):
    daemon = start(extra={"server.verify_loads": "true"})
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        hashes = chain(7, 5)
        assert save(client, digest, hashes) == 5
        _overwrite_committed(daemon, client, digest, hashes[1])
        assert load_intact(client, digest, hashes) == (1, True)
        assert client.lookup(digest, hashes).num_blocks == 1  # the block that failed was dropped
    with KVStoreClient(daemon.socket, verify_loads=False) as client:  # the daemon's setting, overridden
        digest = client.register_namespace(NAMESPACE)
        assert save(client, digest, hashes[1:2]) == 1
        _overwrite_committed(daemon, client, digest, hashes[1])
        assert load_intact(client, digest, hashes) == (5, False)  # unverified: the changed bytes are handed out


# -- 3. handles are bound to their session, and are not guessable --------------------------------
def test_handles_of_another_connection_are_refused(start):
    daemon = start()
    owner, other = Raw(daemon.socket), Raw(daemon.socket)
    try:
        digest, _ = owner.call(Op.REGISTER, namespace_to_wire(NAMESPACE))
        other.call(Op.REGISTER, namespace_to_wire(NAMESPACE))
        with KVStoreClient(daemon.socket) as client:
            client.register_namespace(NAMESPACE)
            save(client, digest, chain(8, 2))
        lease_id, offsets, _ = owner.call(Op.ACQUIRE, digest, pack_hashes(chain(8, 2)))
        reservation_id, placements = owner.call(Op.RESERVE, digest, pack_hashes(chain(9, 2)), None)
        assert len(offsets) == 2 and len(placements) == 2
        for op, args in ((Op.RELEASE, (lease_id,)), (Op.COMMIT, (reservation_id, None, None)), (Op.ABORT, (reservation_id,))):
            with pytest.raises(NotFound, match="connection"):
                other.call(op, *args)
        assert stats(daemon).num_leases == 1 and stats(daemon).num_reservations == 1  # nothing was let go
        ids = [owner.call(Op.ACQUIRE, digest, pack_hashes(chain(8, 2)))[0] for _ in range(4)]
        assert all(i > 1 << 32 for i in ids + [lease_id, reservation_id]) and len(set(ids)) == 4
        assert sorted(ids) != list(range(min(ids), min(ids) + 4))
        owner.call(Op.RELEASE, lease_id)
        assert owner.call(Op.ABORT, reservation_id) is None
    finally:
        owner.close()
        other.close()


# -- 4. replies are matched by request id ------------------------------------------------------
def test_a_call_that_timed_out_poisons_nothing(start):
    daemon = start()
    with KVStoreClient(daemon.socket) as setup:
        digest = setup.register_namespace(NAMESPACE)
        assert save(setup, digest, chain(10, 5)) == 5
        assert save(setup, digest, chain(11, 3)) == 3
    client = KVStoreClient(daemon.socket, timeout_s=0.5)
    client.register_namespace(NAMESPACE)
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(DaemonUnavailable):
            client.acquire(digest, chain(10, 5))  # a lease the daemon grants after the client gave up
        started = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="has not answered"):
            client.lookup(digest, chain(10, 5))
        assert time.monotonic() - started < 0.4  # while an answer is overdue, calls fail at once
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert client.lookup(digest, chain(11, 5)).num_blocks == 3  # its own answer, not the late one
    assert load_intact(client, digest, chain(11, 3)) == (3, True)
    assert eventually(lambda: stats(daemon).num_leases == 0)  # the late lease was given back
    client.close()


def test_a_client_that_polls_for_answers_still_waits_for_one_longer_in_coming(start):
    daemon = start()
    client = KVStoreClient(daemon.socket, timeout_s=5.0, spin_s=0.001)
    digest = client.register_namespace(NAMESPACE)
    assert save(client, digest, chain(30, 4)) == 4
    daemon.process.send_signal(signal.SIGSTOP)  # the answer comes long after the poll gave up
    resume = threading.Timer(0.3, daemon.process.send_signal, (signal.SIGCONT,))
    resume.start()
    try:
        started = time.monotonic()
        assert client.lookup(digest, chain(30, 6)).num_blocks == 4
        assert time.monotonic() - started >= 0.25
    finally:
        resume.join()
        daemon.process.send_signal(signal.SIGCONT)
    assert load_intact(client, digest, chain(30, 4)) == (4, True)
    client.close()
    for bad in (-1e-6, 0.5, float("nan")):
        with pytest.raises(InvalidArgument, match="spin_s"):
            KVStoreClient(daemon.socket, spin_s=bad)


def test_a_request_larger_than_the_socket_buffer_is_sent_whole(start):
    """A frame goes out in one non-blocking send when it fits the socket's buffer; one
    that does not (60,000 block hashes: ~940 KiB) is finished by a blocking send, and
    the connection stays in step for the calls after it."""
    daemon = start()
    client = KVStoreClient(daemon.socket, timeout_s=10.0)
    digest = client.register_namespace(NAMESPACE)
    assert save(client, digest, chain(40, 3)) == 3
    long_chain = chain(40, 3) + [os.urandom(16) for _ in range(60_000 - 3)]
    send_buffer = client._connection.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    assert len(pack_hashes(long_chain)) > 2 * send_buffer
    assert client.lookup(digest, long_chain).num_blocks == 3
    assert client.lookup(digest, chain(40, 5)).num_blocks == 3
    assert load_intact(client, digest, chain(40, 3)) == (3, True)
    client.close()


def test_the_async_client_matches_answers_too(start):
    from kvstore.client import AsyncKVStoreClient

    daemon = start()
    with KVStoreClient(daemon.socket) as setup:
        digest = setup.register_namespace(NAMESPACE)
        assert save(setup, digest, chain(21, 5)) == 5 and save(setup, digest, chain(22, 3)) == 3

    async def main() -> None:
        client = await AsyncKVStoreClient.connect(daemon.socket, timeout_s=0.5)
        await client.register_namespace(NAMESPACE)
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnavailable):
                await client.acquire(digest, chain(21, 5))  # granted after the client gave up
        finally:
            daemon.process.send_signal(signal.SIGCONT)
        # pipelined calls each get their own answer, the late one given back meanwhile
        first, second = await asyncio.gather(client.lookup(digest, chain(22, 5)), client.lookup(digest, chain(21, 5)))
        assert (first.num_blocks, second.num_blocks) == (3, 5)
        await client.close()

    asyncio.run(main())
    assert eventually(lambda: stats(daemon).num_leases == 0)


# -- 5. a read failure is the source's fault ---------------------------------------------------
def test_an_nvme_read_error_fails_nvme_blocks_never_the_host_tier(start, tmp_path):
    daemon = start()
    on_nvme, in_host = chain(12, 6), chain(13, 4)
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        assert save(client, digest, on_nvme) == 6
    daemon.stop(signal.SIGTERM)
    daemon.start()  # the blocks are on NVMe now
    for path in (daemon.workdir / "nvme").iterdir():
        if path.is_file() and path.stat().st_size:
            os.truncate(path, 0)  # every read of a slot in it fails with EIO
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        assert save(client, digest, in_host) == 4
        assert load_intact(client, digest, on_nvme) == (0, True)
        assert pb.TIER_HOST not in stats(daemon).failed_tiers
        assert load_intact(client, digest, in_host) == (4, True)
        assert save(client, digest, chain(14, 4)) == 4  # the host tier still takes writes


# -- 7. the loop never blocks on disk ------------------------------------------------------------
def test_lookups_are_answered_while_a_promotion_reads_nvme(start):
    daemon = start(extra={"host.capacity_bytes": "256MiB", "nvme.capacity_bytes": "512MiB", "nvme.file_bytes": "256MiB"})
    big = chain(15, 3072)  # 96 MiB
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        for start_index in range(0, len(big), 512):
            part = big[start_index : start_index + 512]
            client.save(
                digest,
                part,
                [torch.full((BLOCK,), i % 251, dtype=torch.uint8) for i in range(len(part))],
                parent_hash=big[start_index - 1] if start_index else None,
            )
        assert save(client, digest, chain(16, 4)) == 4
    daemon.stop(signal.SIGTERM)
    daemon.start()
    loader, looker = Raw(daemon.socket, timeout_s=60), Raw(daemon.socket)
    try:
        loader.call(Op.REGISTER, namespace_to_wire(NAMESPACE))
        looker.call(Op.REGISTER, namespace_to_wire(NAMESPACE))
        load_id = loader.send(Op.ACQUIRE, digest, pack_hashes(big))
        time.sleep(0.002)
        assert len(looker.call(Op.LOOKUP, digest, pack_hashes(chain(16, 4)))) == 4
        loader.sock.setblocking(False)
        try:
            answered_first = bool(loader.sock.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            answered_first = False
        loader.sock.setblocking(True)
        assert not answered_first  # the lookup was answered while the promotion was still reading
        reply = loader.reply()
        assert reply[0] == load_id and len(reply[2][1]) == len(big)
    finally:
        loader.close()
        looker.close()


# -- 8. no call can leak capacity or stall other clients ---------------------------------------
def test_a_save_that_repeats_a_key_is_refused_and_leaks_nothing(start):
    daemon = start()
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        hashes = chain(17, 3)
        for _ in range(3):
            with pytest.raises(InvalidArgument, match="more than once"):
                client.save(digest, hashes + hashes[:1], [content(h) for h in hashes + hashes[:1]])
        assert stats(daemon).num_reservations == 0 and host_used(daemon) == 0
        assert save(client, digest, hashes) == 3


def test_a_malformed_commit_is_refused_and_the_reservation_survives(start):
    daemon = start()
    raw = Raw(daemon.socket)
    try:
        digest, _ = raw.call(Op.REGISTER, namespace_to_wire(NAMESPACE))
        hashes = chain(18, 2)
        reservation_id, _ = raw.call(Op.RESERVE, digest, pack_hashes(hashes), None)
        for bad in ("two", -1, 3, 1.5):
            with pytest.raises(InvalidArgument):
                raw.call(Op.COMMIT, reservation_id, bad, None)
        assert stats(daemon).num_reservations == 1
        raw.call(Op.ABORT, reservation_id)
        assert stats(daemon).num_reservations == 0 and host_used(daemon) == 0
    finally:
        raw.close()
    with KVStoreClient(daemon.socket) as client:
        client.register_namespace(NAMESPACE)
        assert save(client, digest, hashes) == 2  # the key can be saved again


@pytest.mark.parametrize(
    "body",
    [
        [1, -1],  # a negative op
        [2, 1 << 40],  # an op out of range
        [3, Op.LOOKUP, "not bytes", b""],  # a digest of the wrong type
        [4, Op.LOOKUP, 12345, b""],
        [5, Op.RESERVE, b"\x00" * 16, b"\x01" * 17, None],  # hashes not a multiple of 16 bytes
        [6, Op.COMMIT, "id", None, None],
        [7, Op.ACQUIRE],  # too few arguments
        [8, Op.LOOKUP, b"\x00" * 16, b"", 1, 2, 3],  # too many
    ],
)
def test_malformed_requests_get_a_clear_error(start, body):
    daemon = start()
    raw = Raw(daemon.socket)
    try:
        raw.send_frame(msgpack.packb(body))
        reply = raw.reply()
        assert reply[0] == body[0] and reply[1] == 1 and reply[2] == "InvalidArgument", reply
        assert "internal error" not in reply[3] and len(reply[3]) < 600
        assert raw.call(Op.REGISTER, namespace_to_wire(NAMESPACE))[0] == NAMESPACE.digest  # the connection still serves
    finally:
        raw.close()
    assert "Traceback" not in daemon.log()


def test_a_node_keeps_a_bounded_number_of_namespaces(start):
    daemon = start()
    raw = Raw(daemon.socket)
    try:
        for model in range(4096):
            raw.send(Op.REGISTER, namespace_to_wire(Namespace(f"m{model}", LAYOUT)))
        replies = [raw.reply() for _ in range(4096)]
        assert all(reply[1] == 0 for reply in replies)
        with pytest.raises(KVStoreError, match="namespaces, its limit"):
            raw.call(Op.REGISTER, namespace_to_wire(Namespace("one-too-many", LAYOUT)))
        assert (
            raw.call(Op.REGISTER, namespace_to_wire(Namespace("m7", LAYOUT)))[0] == Namespace("m7", LAYOUT).digest
        )  # known ones still register
    finally:
        raw.close()


def test_error_replies_are_bounded(start):
    daemon = start()
    raw = Raw(daemon.socket)
    try:
        raw.send(Op.LOOKUP, b"\xab" * (1 << 20), b"")
        (length,) = struct.unpack("<I", raw._exactly(4))
        assert length < 2048
    finally:
        raw.close()


def _lookup_p99_while(daemon, attack) -> float:
    """The worst lookup round trip of a well-behaved engine while ``attack`` runs in a thread."""
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        save(client, digest, chain(19, 8))
        done = threading.Event()
        worker = threading.Thread(target=lambda: (attack(), done.set()), daemon=True)
        worker.start()
        times = []
        while not done.is_set() or len(times) < 20:
            started = time.perf_counter()
            client.lookup(digest, chain(19, 8))
            times.append(time.perf_counter() - started)
        worker.join()
        return sorted(times)[int(len(times) * 0.99)]


def test_a_huge_frame_of_small_integers_does_not_stall_other_engines(start):
    daemon = start()
    huge = msgpack.packb([1, Op.LOOKUP, [7] * 16_000_000])  # 16 MB of one-byte integers
    nested = msgpack.packb([2, Op.LOOKUP, *[[[[[1] * 15] * 15] * 15] * 7] * 14])  # as many small objects as fit below the limit

    def attack() -> None:
        for frame in (huge, nested, nested, huge):
            try:
                raw = Raw(daemon.socket)
                raw.send_frame(frame)
                assert raw.reply()[2] == "InvalidArgument"
                raw.close()
            except (ConnectionError, OSError):
                pass

    assert _lookup_p99_while(daemon, attack) < 0.25


def test_a_client_that_never_reads_replies_cannot_grow_the_daemon(start):
    daemon = start()

    def rss() -> int:
        for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    before = rss()
    raw = Raw(daemon.socket)
    raw.sock.setblocking(False)
    frames = encode_request(9, Op.LOOKUP, (b"\xab" * (512 * 1024), b"")) * 64
    sent = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sent < 1 << 30:
        try:
            sent += raw.sock.send(memoryview(frames)[sent % len(frames) :])
        except BlockingIOError:
            time.sleep(0.01)
    assert rss() - before < 64 << 20
    raw.close()
    with KVStoreClient(daemon.socket) as client:
        client.register_namespace(NAMESPACE)  # still serving


# -- 9. a daemon restart never takes an engine down ----------------------------------------------
def test_a_client_outlives_its_daemon(start):
    daemon = start()
    client = KVStoreClient(daemon.socket, timeout_s=2)
    digest = client.register_namespace(NAMESPACE)
    hashes = chain(20, 4)
    assert save(client, digest, hashes) == 4
    daemon.stop(signal.SIGKILL)
    for call in (lambda: client.lookup(digest, hashes), lambda: save(client, digest, hashes), lambda: load_intact(client, digest, hashes)):
        with pytest.raises(DaemonUnavailable):
            call()
    Path(f"/dev/shm/{daemon.shm_name}").unlink(missing_ok=True)
    daemon.start()
    assert eventually(lambda: _lookup_or_none(client, digest, hashes) is not None, timeout_s=15)
    assert save(client, digest, hashes) == 4  # the namespace was registered again on reconnect
    assert load_intact(client, digest, hashes) == (4, True)
    client.close()


def _lookup_or_none(client, digest, hashes):
    try:
        return client.lookup(digest, hashes)
    except DaemonUnavailable:
        return None
