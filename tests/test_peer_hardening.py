"""The peer port against a peer that does not play by the rules, on a real `kvstore serve`.

A raw TCP peer sends fields no daemon would (a 3-byte parent), stops reading in the middle
of a fetch or stops sending in the middle of a store, floods the namespace table with
invented namespaces, and asks for the hottest chains of a node whose engine uses a tenant
salt. Afterwards the daemon still serves its engine: nothing the peer took stays held,
the engine can register its namespace and save, and no salt ever left the daemon.

Every connection to the peer port goes through ``peer_connection`` (tests/peer_frames.py):
the one place a test peer authenticates.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
from blocks import chain_of, content_of
from daemon_harness import daemons, eventually
from peer_frames import peer_connection, recv_frame, recv_reply, send_message

from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.client import KVStoreClient
from kvstore.errors import CapacityExhausted, KVStoreError
from kvstore.index.base import NodeInfo
from kvstore.index.embedded import EmbeddedIndex
from kvstore.index.redis import RedisIndex
from kvstore.layout import KVLayout
from kvstore.localproto import namespace_to_wire, pack_hashes
from kvstore.metrics import Metrics
from kvstore.namespace import Namespace
from kvstore.node import Limits, Node
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import MemoryTier
from kvstore.transfers.service import TransferService
from kvstore.transport.base import MemoryTransport
from kvstore.transport.config import TransportConfig
from kvstore.transport.peer import send_control
from kvstore.transport.wire import FrameKind, decode_control

LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=32, dtype="float16")  # 1 MiB blocks
SALT = "tenant-salt-that-must-stay-home"
NAMESPACE = Namespace("test/peer-hardening", LAYOUT, tenant_salt=SALT)
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16")
IDLE_S = 1.0


# -- the daemon and its engine -------------------------------------------------------------------
@pytest.fixture
def daemon(tmp_path) -> Iterator:
    with daemons(tmp_path) as start:
        yield start(extra={"transport.kind": "tcp", "transport.peer_idle_timeout_s": str(IDLE_S)})


def stats(daemon) -> pb.StatsResponse:
    with connect(daemon.address) as client:
        return client.admin.Stats(pb.StatsRequest())


def nothing_held(daemon) -> bool:
    response = stats(daemon)
    return response.num_leases == 0 and response.num_reservations == 0


def save(daemon, seed: int, num_blocks: int = 16) -> list[bytes]:
    hashes = chain_of(LAYOUT, seed, num_blocks)
    with KVStoreClient(daemon.socket) as engine:
        digest = engine.register_namespace(NAMESPACE)
        assert engine.save(digest, hashes, [content_of(h, LAYOUT.block_bytes) for h in hashes]) == num_blocks
    return hashes


def store_request(hashes: list[bytes], parent=None, namespace: Namespace = NAMESPACE) -> dict:
    return {"op": "store", "namespace": namespace_to_wire(namespace), "hashes": pack_hashes(hashes), "parent": parent}


# -- the tests ---------------------------------------------------------------------------------------
def test_a_parent_that_is_not_16_bytes_is_refused_at_the_door(daemon):
    sock = peer_connection(daemon.transport_address)
    send_message(sock, store_request(chain_of(LAYOUT, 1, 2), parent=b"abc"))
    kind, reply = recv_reply(sock)
    assert kind is FrameKind.ERROR and reply[0] == "InvalidArgument" and "parent" in reply[1]
    assert eventually(lambda: nothing_held(daemon))
    save(daemon, 2)  # the daemon still serves


@pytest.mark.parametrize(
    "field, value",
    [("hashes", b"x" * 17), ("hashes", "not bytes"), ("namespace", [1, 2, 3]), ("namespace", None), ("parent", 5)],
)
def test_every_malformed_store_field_is_an_invalid_argument_to_the_sender(daemon, field, value):
    sock = peer_connection(daemon.transport_address)
    send_message(sock, {**store_request(chain_of(LAYOUT, 3, 2)), field: value})
    kind, reply = recv_reply(sock)
    assert kind is FrameKind.ERROR and reply[0] == "InvalidArgument", reply


def test_a_peer_that_stops_reading_mid_fetch_loses_its_lease(daemon):
    hashes = save(daemon, 10)
    sock = peer_connection(daemon.transport_address, receive_buffer=4096)
    send_message(sock, {"op": "fetch", "namespace": NAMESPACE.digest, "hashes": pack_hashes(hashes)})
    kind, reply = recv_reply(sock)
    assert kind is FrameKind.CONTROL and reply["count"] == 16
    # 16 MiB of blocks cannot fit the socket buffers of a peer that reads no more
    assert eventually(lambda: nothing_held(daemon), timeout_s=10 * IDLE_S + 5)
    assert len(save(daemon, 11)) == 16
    sock.close()


def test_a_peer_that_stops_sending_mid_store_loses_its_reservation(daemon):
    sock = peer_connection(daemon.transport_address)
    send_message(sock, store_request(chain_of(LAYOUT, 20, 16)))
    kind, reply = recv_reply(sock)
    assert kind is FrameKind.CONTROL and len(reply["accepted"]) == 16
    assert stats(daemon).num_reservations == 1
    assert eventually(lambda: nothing_held(daemon), timeout_s=10 * IDLE_S + 5)
    assert len(save(daemon, 21)) == 16
    sock.close()


def test_a_flood_of_peer_namespaces_never_crowds_out_an_engine(daemon):
    sock = peer_connection(daemon.transport_address)
    for model in range(Limits().max_namespaces + 8):  # more than the whole table holds
        send_message(sock, store_request([], namespace=Namespace(f"invented/{model}", LAYOUT)))
        assert recv_reply(sock) == (FrameKind.CONTROL, {"accepted": []})
        send_message(sock, {}, FrameKind.END)
        assert recv_reply(sock) == (FrameKind.END, {"stored": 0})
    sock.close()
    assert stats(daemon).num_namespaces <= Limits().max_peer_namespaces  # empty ones made room for the next
    with KVStoreClient(daemon.socket) as engine:
        for model in range(8):  # more than one: the engine's room is not a single spare entry
            namespace = Namespace(f"engine/{model}", LAYOUT)
            assert engine.register_namespace(namespace) == namespace.digest


def test_peer_namespaces_that_hold_blocks_stay_and_empty_ones_make_room():
    host = MemoryTier(TierKind.HOST, torch.zeros(8 * SMALL.block_bytes, dtype=torch.uint8), page_bytes=4 * SMALL.block_bytes)
    node = Node("n", TierManager(TierManagerConfig(), [host]), Metrics(), Limits(max_namespaces=2, max_peer_namespaces=2))
    full, empty, busy, newcomer, refused = (Namespace(f"peer/{name}", SMALL) for name in ("full", "empty", "busy", "new", "refused"))

    def fill(namespace: Namespace) -> None:
        hashes = chain_of(SMALL, len(namespace.model_id), 1)
        node.manager.put(namespace.digest, hashes, [content_of(h, SMALL.block_bytes) for h in hashes])

    node.register_peer_namespace(full)
    fill(full)
    node.register_peer_namespace(empty)
    with node.peer_namespace(busy):  # a store under it is under way: it is not forgotten meanwhile
        known = node.manager.namespaces()
        assert full.digest in known and busy.digest in known and empty.digest not in known  # the empty one made room
        with pytest.raises(CapacityExhausted):
            node.register_peer_namespace(newcomer)  # one holds blocks, the other is in use
    node.register_peer_namespace(newcomer)  # the finished one had stored nothing: it goes
    assert busy.digest not in node.manager.namespaces()
    fill(newcomer)
    with pytest.raises(CapacityExhausted):
        node.register_peer_namespace(refused)
    for engine in ("engine/a", "engine/b"):  # the engines' room is their own
        node.register_namespace(Namespace(engine, SMALL, tenant_salt="t"))
    assert node.manager.namespace(Namespace("engine/a", SMALL, tenant_salt="t").digest).tenant_salt != "t"  # only its digest is kept


def test_a_hot_reply_names_tenants_by_digest_and_never_carries_the_salt(daemon):
    shared = chain_of(LAYOUT, 30, 4)
    with KVStoreClient(daemon.socket) as engine:
        digest = engine.register_namespace(NAMESPACE)
        for tail in (31, 32):  # two chains through one prefix: the prefix is hot
            extra = chain_of(LAYOUT, tail, 2)
            blocks = [*shared, *extra]
            assert engine.save(digest, shared, [content_of(h, LAYOUT.block_bytes) for h in shared]) >= 0
            assert engine.save(digest, extra, [content_of(h, LAYOUT.block_bytes) for h in extra], shared[-1]) == 2
            del blocks
    sock = peer_connection(daemon.transport_address)
    send_message(sock, {"op": "hot", "max_bytes": 0})
    header, payload = recv_frame(sock)
    assert header.kind is FrameKind.CONTROL
    chains = decode_control(header, payload)["chains"]
    assert chains and chains[0][2] == pack_hashes(shared)
    assert SALT.encode() not in payload
    assert namespace_to_wire(NAMESPACE) == chains[0][0]  # the receiver can register the same namespace


class RecordingProxy:
    """A TCP proxy in front of a daemon's peer port that keeps every byte sent to it."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target, self.recorded = (host, int(port)), bytearray()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.address = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> str:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _pipe(self, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.target)

        async def copy(reader, writer, record: bool) -> None:
            while data := await reader.read(1 << 16):
                if record:
                    self.recorded += data
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(copy(client_reader, server_writer, True), copy(server_reader, client_writer, False), return_exceptions=True)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_drain_between_daemons_sends_the_salt_digest_never_the_salt(tmp_path, redis):
    settings = {"index.backend": redis.url, "index.heartbeat_interval_s": "0.5", "transport.kind": "tcp"}
    with daemons(tmp_path) as start:
        a, b = start(node_id="a", extra=settings), start(node_id="b", extra=settings)
        hashes = save(a, 50, 4)
        proxy = RecordingProxy(b.transport_address)

        async def join_the_fleet() -> None:  # the proxy as a node of its own: the drain's stores pass through it
            index = RedisIndex(redis.url)
            try:
                await index.register(NodeInfo("b-behind-a-proxy", transport_address=proxy.address), 60)
            finally:
                await index.close()

        try:
            asyncio.run(join_the_fleet())
            with connect(a.address) as client:
                report = client.admin.Drain(pb.DrainRequest(target_node_ids=["b-behind-a-proxy"]))
        finally:
            proxy.close()
        assert report.moved_blocks == 4
        assert b'"store"'[1:-1] in proxy.recorded and NAMESPACE.salt_digest in proxy.recorded
        assert SALT.encode() not in proxy.recorded
        with KVStoreClient(b.socket) as engine:  # b registered the namespace an engine of its own names by its salt
            digest = engine.register_namespace(NAMESPACE)
            into = [torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8) for _ in hashes]
            assert engine.load(digest, hashes, into) == 4
            assert all(torch.equal(t, content_of(h, LAYOUT.block_bytes)) for t, h in zip(into, hashes))


@pytest.mark.parametrize(
    "op, reply",
    [
        ("fetch", {"count": "all of them"}),
        ("fetch", {"count": -1}),
        ("fetch", ["not", "a", "map"]),
        ("store", {"accepted": "everything"}),
        ("store", {"accepted": [0, 0]}),
        ("store", {"accepted": []}),  # and then nothing more: the peer never says how many it stored
        ("capacity", {"free_bytes": None}),
        ("hot", {"chains": [[namespace_to_wire(NAMESPACE), b"abc", b""]]}),
    ],
)
def test_a_peer_whose_reply_is_malformed_is_a_failed_transfer_never_a_crash(op, reply):
    """The asking side checks what a peer answers as the serving side checks what it is asked."""

    async def liar(channel) -> None:  # answers every request with ``reply``
        with contextlib.suppress(KVStoreError):
            while True:
                header = await channel.recv_header()
                await channel.recv_bytes(header)
                if header.kind is FrameKind.CONTROL:
                    await send_control(channel, header.transfer_id, reply)

    async def main() -> None:
        host = MemoryTier(TierKind.HOST, torch.zeros(8 * SMALL.block_bytes, dtype=torch.uint8), page_bytes=4 * SMALL.block_bytes)
        node = Node("asker", TierManager(TierManagerConfig(), [host]), Metrics())
        small = Namespace("test/asker", SMALL, tenant_salt=SALT)
        node.register_namespace(small)
        hashes = chain_of(SMALL, 60, 2)
        node.manager.put(small.digest, hashes, [content_of(h, SMALL.block_bytes) for h in hashes])
        peer = MemoryTransport()
        address = await peer.listen("liar", 0, liar)
        config = TransportConfig(kind="off", peer_idle_timeout_s=IDLE_S)
        service = TransferService(node, MemoryTransport(), config, EmbeddedIndex())
        asked = {
            "fetch": lambda: service.fetch_from(address, small.digest, chain_of(SMALL, 61, 2), None, 5.0),
            "store": lambda: service.push_chain(address, small, hashes, None),
            "capacity": lambda: service.capacity(address),
            "hot": lambda: service.hot_chains(address, 0),
        }[op]
        try:
            with pytest.raises(KVStoreError):
                await asked()
            assert (node.manager.num_leases, node.manager.num_reservations) == (0, 0)
        finally:
            await service.close()
            await peer.close()

    asyncio.run(asyncio.wait_for(main(), 30))
