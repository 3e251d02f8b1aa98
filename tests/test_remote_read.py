"""An engine reading a peer's blocks itself (kvstore/remote_read.py): against scripted peers
that misbehave as a daemon never does (each block checked before it counts, each header
before its length is trusted, a stall cut at the deadline, a hung-up connection replaced),
then through real daemons: the blocks land in the engine's tensors, none in its daemon's
tiers, and a peer that goes away is a miss."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest
import torch
from blocks import chain_of, content_of
from daemon_harness import daemons
from peer_frames import recv_exactly

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import AsyncKVStoreClient, KVStoreClient
from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.localproto import unpack_hashes
from kvstore.namespace import Namespace
from kvstore.remote_read import PeerReader
from kvstore.transport.auth import PeerAuth, ServerHandshake
from kvstore.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, block_header, control_header, decode_control, encode_control

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")  # 8 KiB blocks
NAMESPACE = Namespace("test/remote-read", LAYOUT, tenant_salt="remote-read")
DIGEST = NAMESPACE.digest
BLOCK = LAYOUT.block_bytes


def chain(seed: int, num_blocks: int) -> list[bytes]:
    return chain_of(LAYOUT, seed, num_blocks)


def content(block_hash: bytes) -> torch.Tensor:
    return content_of(block_hash, BLOCK)


def zeros(count: int) -> list[torch.Tensor]:
    return [torch.zeros(BLOCK, dtype=torch.uint8) for _ in range(count)]


def views(tensors: list[torch.Tensor]) -> list[memoryview]:
    return [memoryview(t.numpy()) for t in tensors]


def intact(tensors: list[torch.Tensor], hashes: list[bytes]) -> bool:
    return all(torch.equal(t, content(h)) for t, h in zip(tensors, hashes))


# -- scripted peers ------------------------------------------------------------------------------
class Conversation:
    """One fetch as a scripted peer sees it: the request, and ways to answer."""

    def __init__(self, conn: socket.socket, header: FrameHeader, request: dict) -> None:
        self.conn, self.transfer_id = conn, header.transfer_id
        self.hashes = unpack_hashes(request["hashes"])

    def control(self, message: dict, kind: FrameKind = FrameKind.CONTROL) -> None:
        payload = encode_control(message)
        self.conn.sendall(control_header(kind, self.transfer_id, payload).pack() + payload)

    def block(self, sequence: int, key: bytes | None = None, payload: bytes | None = None, checksum: int | None = None) -> None:
        key = self.hashes[sequence] if key is None else key
        payload = content(key).numpy().tobytes() if payload is None else payload
        header = block_header(self.transfer_id, DIGEST, key, payload, sequence, checksum=checksum)
        self.conn.sendall(header.pack() + payload)

    def answer(self, faulty: int = -1, **fault) -> None:
        """What a daemon holding everything answers, but for block ``faulty``, sent with
        ``fault`` (another key, sequence, payload or checksum)."""
        self.control({"count": len(self.hashes), "nbytes": BLOCK})
        for sequence in range(len(self.hashes)):
            if sequence == faulty:
                self.block(**{"sequence": sequence, **fault})
            else:
                self.block(sequence)
        self.control({}, FrameKind.END)


class ScriptedPeer:
    """A TCP server answering each fetch with ``script(conversation)``; a script that
    returns False hangs up afterwards."""

    def __init__(self, script: Callable[[Conversation], bool | None]) -> None:
        self.script = script
        self.connections = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                # the handshake, as a daemon with no credentials answers it
                hello = FrameHeader.unpack(recv_exactly(conn, HEADER_BYTES))
                reply = encode_control(
                    ServerHandshake(PeerAuth(), tls=False).reply(decode_control(hello, recv_exactly(conn, hello.length)))
                )
                conn.sendall(control_header(FrameKind.AUTH, 0, reply).pack() + reply)
                while True:
                    header = FrameHeader.unpack(recv_exactly(conn, HEADER_BYTES))
                    conversation = Conversation(conn, header, decode_control(header, recv_exactly(conn, header.length)))
                    if self.script(conversation) is False:
                        return
            except (ConnectionError, OSError):
                return

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def peer():
    peers: list[ScriptedPeer] = []

    def make(script):
        peers.append(ScriptedPeer(script))
        return peers[-1]

    yield make
    for scripted in peers:
        scripted.close()


@pytest.fixture
def reader():
    peers = PeerReader()
    yield peers
    peers.close()


def test_blocks_land_verified_in_their_destinations_and_the_connection_is_kept(peer, reader):
    scripted = peer(lambda c: c.answer())
    hashes = chain(1, 5)
    for _ in range(2):
        into = zeros(5)
        read = reader.read(scripted.address, DIGEST, hashes, views(into), deadline_s=10)
        assert (read.num_blocks, read.num_bytes, read.num_dropped) == (5, 5 * BLOCK, 0)
        assert intact(into, hashes)
    assert scripted.connections == 1


def test_a_block_that_fails_its_checksum_ends_the_read_at_the_prefix_before_it(peer, reader):
    scripted = peer(lambda c: c.answer(2, checksum=12345))  # bytes that are not what their writer committed
    hashes = chain(2, 4)
    into = zeros(4)
    read = reader.read(scripted.address, DIGEST, hashes, views(into), deadline_s=10)
    assert (read.num_blocks, read.num_dropped) == (2, 1)
    assert intact(into[:2], hashes[:2])
    reader.read(scripted.address, DIGEST, hashes, views(zeros(4)), deadline_s=10)
    assert scripted.connections == 2  # the broken-off conversation's connection was not reused


@pytest.mark.parametrize(
    "wrong",
    [
        {"key": chain(30, 1)[0]},  # another block's bytes
        {"sequence": 2},  # out of order
        {"payload": bytes(BLOCK + 1)},  # longer than the destination
        {"payload": bytes(BLOCK - 1)},
    ],
)
def test_a_frame_out_of_place_is_refused_before_its_payload_lands(peer, reader, wrong):
    scripted = peer(lambda c: c.answer(1, **wrong))
    hashes = chain(3, 3)
    into = zeros(3)
    read = reader.read(scripted.address, DIGEST, hashes, views(into), deadline_s=10)
    assert read.num_blocks == 1 and intact(into[:1], hashes)
    assert not into[1].any() and not into[2].any()  # nothing was received into them


@pytest.mark.parametrize(
    "script",
    [
        lambda c: c.control({"count": len(c.hashes) + 1, "nbytes": BLOCK}),  # more than asked for
        lambda c: c.control({"count": -1, "nbytes": BLOCK}),
        lambda c: c.control({"blocks": 2}),
        lambda c: c.control(["NotFound", "no such namespace"], FrameKind.ERROR),  # a refusal
        lambda c: c.control(["NoSuchError", "x" * 40], FrameKind.ERROR),
        lambda c: c.control({}, FrameKind.END),
        lambda c: False,  # hangs up without a word
    ],
    ids=["too-many", "negative", "no-count", "refused", "unknown-error", "end-first", "hang-up"],
)
def test_a_peer_that_does_not_answer_as_asked_is_a_miss(peer, reader, script):
    scripted = peer(script)
    read = reader.read(scripted.address, DIGEST, chain(4, 3), views(zeros(3)), deadline_s=5)
    assert read.num_blocks == 0


def test_a_peer_that_stalls_is_cut_at_the_deadline_with_what_arrived(peer, reader):
    release = threading.Event()

    def script(c: Conversation) -> bool:
        c.control({"count": 4, "nbytes": BLOCK})
        c.block(0)
        c.block(1)
        c.conn.sendall(block_header(c.transfer_id, DIGEST, c.hashes[2], bytes(BLOCK), 2).pack())
        release.wait(30)  # the payload never comes
        return False

    scripted = peer(script)
    hashes = chain(5, 4)
    into = zeros(4)
    started = time.monotonic()
    read = reader.read(scripted.address, DIGEST, hashes, views(into), deadline_s=0.5)
    elapsed = time.monotonic() - started
    release.set()
    assert read.num_blocks == 2 and intact(into[:2], hashes)
    assert elapsed < 10  # cut at the deadline, not at the peer's leisure


def test_an_idle_connection_the_peer_closed_is_replaced(peer, reader):
    def script(c: Conversation) -> bool:
        c.answer()
        return False  # hangs up once the conversation is over

    scripted = peer(script)
    hashes = chain(6, 3)
    assert reader.read(scripted.address, DIGEST, hashes, views(zeros(3)), deadline_s=5).num_blocks == 3
    time.sleep(0.2)  # the hang-up reaches this end
    into = zeros(3)
    assert reader.read(scripted.address, DIGEST, hashes, views(into), deadline_s=5).num_blocks == 3
    assert intact(into, hashes) and scripted.connections == 2


def test_an_unreachable_peer_is_a_miss_and_a_caller_error_is_an_error(reader):
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    hashes = chain(7, 2)
    assert reader.read(f"tcp://127.0.0.1:{port}", DIGEST, hashes, views(zeros(2)), deadline_s=2).num_blocks == 0
    assert reader.read("tcp://no-port", DIGEST, hashes, views(zeros(2)), deadline_s=2).num_blocks == 0
    with pytest.raises(InvalidArgument):
        reader.read(f"tcp://127.0.0.1:{port}", DIGEST, hashes, views(zeros(1)), deadline_s=2)


# -- through real daemons --------------------------------------------------------------------------
@pytest.fixture
def start(tmp_path):
    with daemons(tmp_path) as start:
        yield start


def host_used(daemon) -> int:
    with connect(daemon.address) as api:
        return next(t.used_bytes for t in api.admin.Stats(pb.StatsRequest()).tiers if t.tier == pb.TIER_HOST)


def metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.state['metrics_port']}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and 'direction="in"' in line)


def saved(daemon, hashes: list[bytes]) -> int:
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        return client.save(digest, hashes, [content(h) for h in hashes])


@pytest.mark.slow
def test_an_engine_reads_a_peer_daemons_blocks_after_its_own_prefix_and_its_daemon_keeps_no_copy(start):
    holder, reader_daemon = start(), start()
    hashes = chain(8, 8)
    assert saved(holder, hashes) == 8
    assert saved(reader_daemon, hashes[:3]) == 3  # this node's own prefix, copied from its tier
    with KVStoreClient(reader_daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        into = zeros(8)
        loaded = client.load(digest, hashes, into, allow_remote=True, deadline_s=10, source=holder.transport_address)
        assert loaded == 8 and intact(into, hashes)
        assert host_used(reader_daemon) == 3 * BLOCK  # the five read from the peer went to the engine only
        assert metric(reader_daemon, "kvstore_transfer_blocks_total") == 5  # and are counted where the engine runs
        # a prefetch brings them into this node's tiers instead
        assert client.fetch(digest, hashes, deadline_s=10, source=holder.transport_address) == 8
        assert host_used(reader_daemon) == 8 * BLOCK


@pytest.mark.slow
def test_the_async_client_reads_from_a_peer_too(start):
    holder, reader_daemon = start(), start()
    hashes = chain(9, 6)
    assert saved(holder, hashes) == 6

    async def main() -> tuple[int, list[torch.Tensor]]:
        client = await AsyncKVStoreClient.connect(reader_daemon.socket)
        try:
            digest = await client.register_namespace(NAMESPACE)
            into = zeros(6)
            loaded = await client.load(digest, hashes, into, allow_remote=True, deadline_s=10, source=holder.transport_address)
            return loaded, into
        finally:
            await client.close()

    loaded, into = asyncio.run(main())
    assert loaded == 6 and intact(into, hashes)


@pytest.mark.slow
def test_a_peer_daemon_that_went_away_is_a_miss_and_its_successor_is_read(start):
    holder, reader_daemon = start(), start()
    hashes = chain(10, 6)
    assert saved(holder, hashes) == 6
    with KVStoreClient(reader_daemon.socket) as client:
        digest = client.register_namespace(NAMESPACE)
        assert client.load(digest, hashes, zeros(6), allow_remote=True, deadline_s=10, source=holder.transport_address) == 6
        gone = holder.transport_address
        holder.stop(signal.SIGTERM)  # a clean stop keeps the blocks on NVMe
        assert client.load(digest, hashes, zeros(6), allow_remote=True, deadline_s=2, source=gone) == 0
        holder.start()
        into = zeros(6)
        loaded = client.load(digest, hashes, into, allow_remote=True, deadline_s=10, source=holder.transport_address)
        assert loaded == 6 and intact(into, hashes)  # promoted from the peer's NVMe, verified, read
