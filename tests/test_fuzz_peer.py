"""Bad input on the peer port, against a node's transfer service on a real TCP transport.

Hypothesis plays a peer daemon that does not play by the rules:

- control messages with a random op and random fields (wrong types, bytes of the wrong
  length, huge and negative numbers, nested lists, namespaces with a field changed, a
  salt in clear where its digest belongs, fields missing or extra);
- well-formed stores followed by block frames that are damaged in transit, of the wrong
  length, key or sequence, repeated, interleaved with other kinds, or cut short;
- well-formed fetches whose reader hangs up after a random number of frames;
- valid request frames with random bytes changed, cut or inserted.

Every answer is a reply of the conversation or an ERROR naming an error kind of
kvstore.errors with a bounded sentence; the event loop records no exception; no block is
stored with bytes other than the ones its key stands for (nothing unverified is
committed); once the peer hangs up, no lease, reservation or slot waiting to settle is
left; and after each example a well-formed peer stores and fetches blocks intact.

Every connection goes through ``peer_connection`` (tests/peer_frames.py). The examples are
derandomized: a failure reproduces run after run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch
from blocks import chain_of, content_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peer_frames import RawPeer, peer_connection, recv_frame, send_frame, send_message

import kvstore.errors as errors
from kvstore.index.embedded import EmbeddedIndex
from kvstore.layout import KVLayout
from kvstore.localproto import MAX_SENTENCE_CHARS, namespace_to_wire, pack_hashes
from kvstore.metrics import Metrics
from kvstore.namespace import Namespace
from kvstore.node import Limits, Node
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import MemoryTier
from kvstore.transfers.service import TransferService
from kvstore.transport.auth import PeerAuth, fleet_key
from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.wire import FrameHeader, FrameKind, block_header, control_header, decode_control, encode_control

pytestmark = pytest.mark.slow

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16")  # 1 KiB blocks
NAMESPACE = Namespace("test/fuzz-peer", LAYOUT, tenant_salt="fuzz-peer")
BLOCK = LAYOUT.block_bytes
ERROR_KINDS = {name for name in errors.__all__ if name[0].isupper()} - {"KVStoreError"}
SEEDS = itertools.count(1_000)  # each example's fresh blocks
SAVED = chain_of(LAYOUT, 7, 8)  # stored before the fuzzing: fetches find them


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def content(block_hash: bytes) -> bytes:
    return content_of(block_hash, BLOCK).numpy().tobytes()


# -- the node under fuzzing -------------------------------------------------------------------------
class ServedNode:
    """A node and its transfer service on a real TCP transport, on an event loop of its own
    thread; ``errors`` has whatever the loop saw escape a task."""

    def __init__(self, secret: str = "") -> None:
        self.secret = secret  # the fleet secret the node authenticates peers with ("": none)
        self.auth = PeerAuth(key=fleet_key(secret)) if secret else None  # what a peer of the fleet connects with
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict] = []
        self._checked: set[tuple[bytes, float]] = set()  # stored blocks whose bytes were checked
        self.loop.set_exception_handler(lambda loop, context: self.errors.append(context))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service: TransferService = self.call(self._start())

    async def _start(self) -> TransferService:
        host = MemoryTier(TierKind.HOST, torch.zeros(512 * BLOCK, dtype=torch.uint8), page_bytes=16 * BLOCK)
        node = Node("fuzzed", TierManager(TierManagerConfig(), [host]), Metrics(), Limits(max_peer_namespaces=16))
        node.register_namespace(NAMESPACE)
        node.manager.put(NAMESPACE.digest, SAVED, [content_of(h, BLOCK) for h in SAVED])
        config = TransportConfig(kind="tcp", peer_idle_timeout_s=0.5, peer_secret=self.secret)
        service = TransferService(node, open_transport(config), config, EmbeddedIndex())
        self.address = await service.start()
        return service

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def held(self) -> tuple[int, int, int]:
        async def counts():
            manager = self.service.manager
            return manager.num_leases, manager.num_reservations, self.service.settling.num_waiting

        return self.call(counts())

    def wrong_blocks(self) -> list[str]:
        """Blocks of the fuzzed namespace stored since the last call whose bytes are not their key's."""

        async def check():
            manager = self.service.manager
            fresh = [b for b in manager.blocks(NAMESPACE.digest) if (b.block_hash, b.stored_at) not in self._checked]
            wrong = []
            for block in fresh:
                with contextlib.suppress(errors.KVStoreError):
                    lease = manager.acquire(NAMESPACE.digest, [block.block_hash])
                    try:
                        if lease.blocks and bytes(manager.lease_views(lease)[0].numpy()) != content(block.block_hash):
                            wrong.append(block.block_hash.hex())
                    finally:
                        manager.release(lease.id)
                self._checked.add((block.block_hash, block.stored_at))
            return wrong

        return self.call(check())

    def close(self) -> None:
        self.call(self.service.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module", params=["unauthenticated", "fleet secret"])
def served(request):
    """The node the peer fuzzes: authenticating nobody, and sealing every frame with a fleet
    secret (the examples then come from a peer of the fleet, every frame signed)."""
    node = ServedNode("" if request.param == "unauthenticated" else "fuzz-peer fleet secret of 32+ characters")
    yield node
    node.close()


# -- the peer's side ---------------------------------------------------------------------------------
def answers(sock: RawPeer, limit: int = 64) -> list[tuple[FrameKind, object]]:
    """Every frame the node sends until it closes the connection (or ``limit`` frames)."""
    frames = []
    with contextlib.suppress(ConnectionError, OSError):
        while len(frames) < limit:
            header, payload = recv_frame(sock)
            frames.append((header.kind, payload if header.kind is FrameKind.BLOCK else decode_control(header, payload)))
    return frames


def check_answers(frames: list[tuple[FrameKind, object]]) -> None:
    for kind, body in frames:
        if kind is FrameKind.ERROR:
            assert isinstance(body, list) and len(body) == 2, body
            assert body[0] in ERROR_KINDS, f"the node refused with {body[0]}: {body[1]}"
            assert isinstance(body[1], str) and len(body[1]) <= 4 * MAX_SENTENCE_CHARS


def after_each(served: ServedNode) -> None:
    """Nothing held, nothing wrong stored, nothing escaped, and a well-formed peer is served."""
    deadline = time.monotonic() + 10
    while served.held() != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert served.held() == (0, 0, 0), "a hung-up peer left a lease, a reservation or a slot behind"
    assert not served.errors, served.errors
    assert not served.wrong_blocks(), "a block was stored with bytes its key does not stand for"
    hashes = chain_of(LAYOUT, next(SEEDS), 2)
    with contextlib.closing(peer_connection(served.address, served.auth)) as sock:
        assert store(sock, hashes) == 2
        send_message(sock, {"op": "fetch", "namespace": NAMESPACE.digest, "hashes": pack_hashes(hashes)})
        frames = [recv_frame(sock) for _ in range(4)]  # the count, two blocks, END
        assert decode_control(*frames[0])["count"] == 2
        assert [payload for _, payload in frames[1:3]] == [content(h) for h in hashes]
        assert frames[3][0].kind is FrameKind.END


def store_request(hashes: list[bytes], namespace: Namespace = NAMESPACE, parent=None) -> dict:
    return {"op": "store", "namespace": namespace_to_wire(namespace), "hashes": pack_hashes(hashes), "parent": parent}


def block_frame(hashes: list[bytes], seq: int) -> tuple[FrameHeader, bytes]:
    payload = content(hashes[seq])
    return block_header(7, NAMESPACE.digest, hashes[seq], payload, seq), payload


def store(sock: RawPeer, hashes: list[bytes]) -> int:
    send_message(sock, store_request(hashes))
    header, payload = recv_frame(sock)
    accepted = decode_control(header, payload)["accepted"]
    for seq in accepted:
        send_frame(sock, *block_frame(hashes, seq))
    send_message(sock, {}, FrameKind.END)
    header, payload = recv_frame(sock)
    assert header.kind is FrameKind.END
    return decode_control(header, payload)["stored"]


# -- strategies --------------------------------------------------------------------------------------
def wrong(fields: list, index: int, value) -> list:
    return [value if i == index else f for i, f in enumerate(fields)]


WIRE = namespace_to_wire(NAMESPACE)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=24),
    st.binary(max_size=48),
    st.sampled_from([b"", b"x" * 15, b"x" * 16, b"x" * 17, b"x" * 32, b"x" * 33, "x" * 1025, -1, 0, 1 << 62, 1 << 63]),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6
)
namespaces = st.one_of(
    st.just(WIRE),
    st.builds(wrong, st.just(WIRE), st.integers(0, 12), values),
    st.just(wrong(WIRE, 12, "fuzz-peer")),  # the salt in clear: an older peer
    st.builds(lambda n: namespace_to_wire(Namespace(f"invented/{n}", LAYOUT)), st.integers(0, 40)),
    values,
)
hash_blobs = st.one_of(
    st.just(pack_hashes(SAVED)),
    st.binary(max_size=80),
    st.integers(0, 8).map(lambda n: pack_hashes(chain_of(LAYOUT, 9, n))),
    st.just(b"\x01" * (16 * 65_537)),  # one block over the bound
    values,
)
FIELDS = {
    "namespace": st.one_of(namespaces, st.just(NAMESPACE.digest)),
    "hashes": hash_blobs,
    "parent": st.one_of(st.none(), st.binary(max_size=20), st.just(SAVED[0]), values),
    "transfer": st.one_of(st.text(max_size=12), st.just("x" * 1025), values),
    "max_bytes": st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), values),
}


@st.composite
def control_messages(draw) -> object:
    op = draw(st.one_of(st.sampled_from(["fetch", "store", "handoff", "capacity", "hot"]), values))
    names = draw(st.sets(st.sampled_from([*FIELDS, "extra"]), max_size=6))
    message = {name: draw(FIELDS.get(name, values)) for name in names}
    message["op"] = op
    return draw(st.one_of(st.just(message), values))  # sometimes not a map at all


FRAME_ACTIONS = [
    "good",
    "damaged",
    "short",
    "long",
    "wrong key",
    "wrong sequence",
    "again",
    "control",
    "error",
    "end",
    "garbage",
    "hang up",
]


@st.composite
def store_scripts(draw) -> tuple[list[bytes], list[str], bool]:
    hashes = chain_of(LAYOUT, next(SEEDS), draw(st.integers(1, 6)))
    actions = draw(st.lists(st.sampled_from(FRAME_ACTIONS), min_size=1, max_size=8))
    return hashes, actions, draw(st.booleans())


def frame_for(action: str, hashes: list[bytes], seq: int) -> tuple[FrameHeader, bytes, Callable[[bytes], bytes] | None]:
    """The frame a store script's ``action`` sends for block ``seq``, and how it is changed on the way."""
    payload = content(hashes[seq % len(hashes)])
    key = hashes[seq % len(hashes)]
    if action == "damaged":  # changed on the way: the header keeps the checksum of the bytes sent
        return block_header(7, NAMESPACE.digest, key, payload, seq), payload, lambda frame: frame[:-1] + bytes([frame[-1] ^ 0xFF])
    if action in ("short", "long"):
        changed = payload[:-8] if action == "short" else payload + b"\x00" * 8
        return block_header(7, NAMESPACE.digest, key, changed, seq), changed, None
    if action == "wrong key":
        return block_header(7, NAMESPACE.digest, bytes(16), payload, seq), payload, None
    if action == "wrong sequence":
        return block_header(7, NAMESPACE.digest, key, payload, seq + 1000), payload, None
    if action in ("control", "error", "end"):
        kind = {"control": FrameKind.CONTROL, "error": FrameKind.ERROR, "end": FrameKind.END}[action]
        body = encode_control({"op": "hot", "max_bytes": 0})
        return control_header(kind, 7, body), body, None
    if action == "garbage":
        return block_header(7, NAMESPACE.digest, key, payload, seq), payload, lambda frame: b"\x00" * 40
    return block_header(7, NAMESPACE.digest, key, payload, seq), payload, None  # good, again


@st.composite
def mutated_frames(draw) -> tuple[FrameHeader, bytes, list[tuple[str, float, bytes]]]:
    message = draw(
        st.sampled_from(
            [
                store_request(chain_of(LAYOUT, 11, 2)),
                {"op": "fetch", "namespace": NAMESPACE.digest, "hashes": pack_hashes(SAVED)},
                {"op": "hot", "max_bytes": 0},
                {"op": "capacity"},
                {"op": "handoff", "transfer": "t", "namespace": WIRE, "hashes": pack_hashes(SAVED[:1]), "parent": None},
            ]
        )
    )
    payload = encode_control(message)
    mutations = []
    for _ in range(draw(st.integers(1, 4))):
        mutations.append((draw(st.sampled_from(["flip", "cut", "insert"])), draw(st.floats(0, 1)), draw(st.binary(min_size=1, max_size=8))))
    return control_header(FrameKind.CONTROL, 7, payload), payload, mutations


def mutate(frame: bytes, mutations: list[tuple[str, float, bytes]]) -> bytes:
    data = bytearray(frame)
    for change, where, extra in mutations:
        if not data:
            break
        position = int(where * (len(data) - 1))
        if change == "flip":
            data[position] ^= extra[0] or 1
        elif change == "cut":
            del data[position:]
        else:
            data[position:position] = extra
    return bytes(data)


# -- the fuzzing ---------------------------------------------------------------------------------------
def test_random_control_messages_get_a_clear_answer(served):
    @fuzz_settings(1000)
    @given(control_messages())
    def fuzz(message):
        with contextlib.closing(peer_connection(served.address, served.auth)) as sock:
            try:
                send_message(sock, message)
            except (TypeError, ValueError, OverflowError):
                return  # msgpack cannot say it: no peer could send it either
            sock.sock.shutdown(socket.SHUT_WR)  # the peer hangs up once it has asked
            check_answers(answers(sock))
        after_each(served)

    fuzz()


def test_store_streams_of_bad_frames_commit_only_verified_blocks(served):
    @fuzz_settings(500)
    @given(store_scripts())
    def fuzz(script):
        hashes, actions, end = script
        with contextlib.closing(peer_connection(served.address, served.auth)) as sock:
            send_message(sock, store_request(hashes))
            header, payload = recv_frame(sock)
            accepted = decode_control(header, payload)["accepted"]
            sent = []
            for seq, action in zip(itertools.cycle(accepted or [0]), actions):
                if action == "hang up":
                    break
                with contextlib.suppress(OSError):
                    for _ in range(2 if action == "again" else 1):
                        send_frame(sock, *frame_for(action, hashes, seq))
                sent.append(action)
            else:
                if end:
                    with contextlib.suppress(OSError):
                        send_message(sock, {}, FrameKind.END)
            with contextlib.suppress(OSError):
                sock.sock.shutdown(socket.SHUT_WR)
            frames = answers(sock)
            check_answers(frames)
            stored = [body["stored"] for kind, body in frames if kind is FrameKind.END]
            leading_good = len(list(itertools.takewhile(lambda a: a in ("good", "again"), sent)))
            assert not stored or stored[0] <= leading_good, (sent, stored)
        after_each(served)

    fuzz()


def test_a_fetch_reader_that_hangs_up_anywhere_leaves_nothing_held(served):
    @fuzz_settings(300)
    @given(st.integers(0, 8), st.integers(1, 8))
    def fuzz(read, count):
        with contextlib.closing(peer_connection(served.address, served.auth)) as sock:
            send_message(sock, {"op": "fetch", "namespace": NAMESPACE.digest, "hashes": pack_hashes(SAVED[:count])})
            for _ in range(read):
                header, payload = recv_frame(sock)
                if header.kind is FrameKind.END:
                    break
        after_each(served)

    fuzz()


def test_request_frames_with_bytes_changed_get_a_clear_answer(served):
    @fuzz_settings(600)
    @given(mutated_frames())
    def fuzz(frame):
        header, payload, mutations = frame
        with contextlib.closing(peer_connection(served.address, served.auth)) as sock:
            with contextlib.suppress(OSError):
                send_frame(sock, header, payload, lambda data: mutate(data, mutations))
                sock.sock.shutdown(socket.SHUT_WR)
            check_answers(answers(sock))
        after_each(served)

    fuzz()
