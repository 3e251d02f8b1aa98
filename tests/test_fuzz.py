"""Bad input on every wire (integrity property 10), against one real `kvstore serve`.

Hypothesis sends thousands of malformed requests to a daemon:

- local-protocol frames with a random op (unknown, negative, huge, not an integer) and
  random arguments (wrong types and counts, bytes of the wrong length, huge and negative
  numbers, nested lists and maps, strings, nil, floats, NaN), pipelined a few at a time;
  requests naming what the connection holds (a reservation, a lease, a handoff it sends
  and reads) or handles that are not its own, with arguments that may not fit; peer
  addresses that cannot be one;
- raw bytes: random frame bodies, malformed msgpack, frames cut short, random length
  headers (over the limit too), unframed garbage, frames split at random points;
- every RPC of Store, Index and Admin with random field values (ids and hashes of wrong
  lengths, repeated fields at and over the limits, unknown tiers, odd page sizes and
  tokens, random token ids), and serialized requests with random bytes changed.

Each frame gets exactly one reply carrying its id (id 0 when the frame did not decode),
naming an error kind of kvstore.errors with a bounded sentence, never the internal error;
only a frame over the size limit closes its connection. Each RPC is answered OK or with
a status that names the caller's mistake, never INTERNAL or UNKNOWN. After every batch a
well-behaved engine that stayed connected throughout, and a new one, save blocks and
load them back intact; at the end the daemon's log has no traceback and nothing the
fuzzing connections took is still held.

The examples are derandomized: a failure reproduces run after run.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import msgpack
import numpy as np
import pytest
import torch
from blocks import chain_of, content_of
from daemon_harness import daemons, eventually
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore.errors as errors
from kvstore.api.auth import bearer_metadata
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.api.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.client import KVStoreClient
from kvstore.layout import DTYPE_SIZES, KVLayout
from kvstore.localproto import (
    HEADER,
    MAX_REQUEST_BYTES,
    MAX_SENTENCE_CHARS,
    MAX_SHARDS,
    OP_NAMES,
    PROTOCOL_VERSION,
    SIGNATURES,
    Op,
    decode_request,
    namespace_from_wire,
    namespace_to_wire,
    pack_hashes,
)
from kvstore.namespace import Namespace
from kvstore.paths import token_for

pytestmark = pytest.mark.slow

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16")  # 1 KiB blocks
NAMESPACE = Namespace("test/fuzz", LAYOUT, tenant_salt="fuzz")
BLOCK = LAYOUT.block_bytes
ERROR_KINDS = {name for name in errors.__all__ if name[0].isupper()} - {"KVStoreError"}  # the base is what an unexpected error travels as
SYNC_ID = (1 << 64) - 1  # the id of the request that ends each exchange; no fuzzed frame uses it
REPLY_TIMEOUT_S = 10.0  # an answer later than this is a hang
WAIT_OPS = {name for sig in SIGNATURES.values() for name, _, _ in sig if name.endswith("_s")}  # deadline_s, timeout_s
GRANTING = {Op.RESERVE, Op.ACQUIRE, Op.HANDOFF_SEND, Op.HANDOFF_RECEIVE}  # a success takes something to give back


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        derandomize=True,  # the same examples every run
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def chain(seed: int, num_blocks: int) -> list[bytes]:
    return chain_of(LAYOUT, seed, num_blocks)


def content(block_hash: bytes) -> torch.Tensor:
    """The bytes a witness block must hold: derived from its key, so any other bytes are wrong."""
    return content_of(block_hash, BLOCK)


FUZZ_HASHES = chain(10_000, 16)  # saved at the start: fuzzed requests name blocks that exist
NEW_HASHES = chain(20_000, 16)  # never saved on purpose: fuzzed requests reserve them


def distinct_hashes_blob(num_hashes: int) -> bytes:
    """``num_hashes`` different 16-byte hashes, concatenated."""
    return (np.arange(num_hashes * 4, dtype="<u4") + 0x5EED).tobytes()


WITNESS_ROUNDS = itertools.count(1)


# -- the well-behaved clients -----------------------------------------------------------------
class Witness:
    """An engine that stays connected through the fuzzing; ``check`` has it and a new one
    save blocks and load them back intact, and times their lookups."""

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.engine = KVStoreClient(daemon.socket)
        self.digest = self.engine.register_namespace(NAMESPACE)

    def check(self) -> None:
        assert self.daemon.process.poll() is None, f"the daemon exited:\n{self.daemon.log()}"
        with KVStoreClient(self.daemon.socket) as newcomer:
            newcomer.register_namespace(NAMESPACE)
            for client in (self.engine, newcomer):
                hashes = chain(next(WITNESS_ROUNDS), 4)  # blocks no earlier check saved
                assert client.save(self.digest, hashes, [content(h) for h in hashes]) == 4
                into = [torch.zeros(BLOCK, dtype=torch.uint8) for _ in hashes]
                assert client.load(self.digest, hashes, into) == 4
                assert all(torch.equal(t, content(h)) for t, h in zip(into, hashes)), "a witness got wrong bytes"
                slowest = 0.0
                for _ in range(10):
                    started = time.perf_counter()
                    assert client.lookup(self.digest, hashes).num_blocks == 4
                    slowest = max(slowest, time.perf_counter() - started)
                assert slowest < 0.5, f"a lookup took {slowest:.3f} s"
        assert stats(self.daemon).node_id == self.daemon.node_id  # the gRPC API serves too

    def close(self) -> None:
        self.engine.close()


@dataclass
class Served:
    daemon: object
    witness: Witness
    examples: int = 0

    def every(self, batch: int) -> None:
        """Count an example; every ``batch`` of them, check that the daemon still serves."""
        self.examples += 1
        if self.examples % batch == 0:
            self.witness.check()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with daemons(tmp_path_factory.mktemp("fuzz")) as start:
        daemon = start(extra={"transport.handoff_timeout_s": "2"})
        with KVStoreClient(daemon.socket) as client:
            digest = client.register_namespace(NAMESPACE)
            assert client.save(digest, FUZZ_HASHES, [content(h) for h in FUZZ_HASHES]) == len(FUZZ_HASHES)
        yield daemon


@pytest.fixture
def served(daemon):
    log_start = len(log_text(daemon))
    witness = Witness(daemon)
    witness.check()
    served = Served(daemon, witness)
    yield served
    print(f"{served.examples} examples")
    witness.check()
    witness.close()
    assert_nothing_leaked(daemon, log_start)


def credentials(daemon) -> tuple[tuple[str, str], ...]:
    """The bearer token the daemon generated at start (its gRPC is never open without one)."""
    return bearer_metadata(token_for(daemon.address))


def stats(daemon) -> pb.StatsResponse:
    with grpc.insecure_channel(daemon.address) as channel:
        return pb_grpc.AdminStub(channel).Stats(pb.StatsRequest(), timeout=10, metadata=credentials(daemon))


def log_text(daemon) -> str:
    return (daemon.workdir / f"daemon-{daemon.node_id}.log").read_text(errors="replace")


def assert_nothing_leaked(daemon, log_start: int) -> None:
    """Every fuzzing connection is closed: none of them may still hold a slot, and the
    daemon logged no traceback since ``log_start``."""

    def settled():
        s = stats(daemon)
        return s if s.num_reservations == 0 and s.num_leases == 0 and s.num_sessions == 0 else None

    assert eventually(settled, timeout_s=15), f"fuzzed requests left something held: {stats(daemon)}"
    assert daemon.process.poll() is None
    log = log_text(daemon)[log_start:]
    assert "Traceback" not in log, log[max(0, log.index("Traceback") - 2000) :][:6000]


# -- one local-protocol connection, frame by frame ------------------------------------------------
class Conn:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_TIMEOUT_S)
        self.sock.connect(str(path))
        self.next_id = 1 << 63  # above every fuzzed id

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> list | None:
        """The next reply; None when the daemon closed the connection."""
        header = self._exactly(4)
        if header is None:
            return None
        (length,) = HEADER.unpack(header)
        body = self._exactly(length)
        assert body is not None, "the daemon closed the connection in the middle of a reply"
        reply = msgpack.unpackb(body, raw=False)
        assert isinstance(reply, list) and len(reply) >= 3 and type(reply[0]) is int and reply[1] in (0, 1), reply
        return reply

    def call(self, op: int, *args):
        self.next_id += 1
        self.send(frame(msgpack.packb([self.next_id, op, *args])))
        reply = self.reply()
        assert reply is not None and reply[0] == self.next_id, reply
        return reply

    def sync(self) -> None:
        """A request answered only after everything sent before it that does not wait."""
        self.send(frame(msgpack.packb([SYNC_ID, Op.HELLO, PROTOCOL_VERSION])))
        reply = self.reply()
        assert reply is not None and reply[0] == SYNC_ID and reply[1] == 0, f"expected only the sync reply, got {reply}"

    def until_closed(self) -> list[list]:
        """Every reply until the daemon closes the connection (within REPLY_TIMEOUT_S)."""
        replies = []
        while (reply := self.reply()) is not None:
            replies.append(reply)
        return replies

    def _exactly(self, count: int) -> bytes | None:
        data = b""
        while len(data) < count:
            try:
                chunk = self.sock.recv(count - len(data))
            except TimeoutError:
                raise AssertionError(f"the daemon did not answer within {REPLY_TIMEOUT_S} s") from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                assert not data, "the daemon closed the connection in the middle of a frame"
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def check_error(reply: list) -> None:
    assert reply[1] == 1 and len(reply) == 4, reply
    kind, sentence = reply[2], reply[3]
    assert kind in ERROR_KINDS, f"not an error kind of kvstore.errors: {reply}"
    assert isinstance(sentence, str) and 0 < len(sentence) <= MAX_SENTENCE_CHARS, reply
    assert "internal error" not in sentence, reply
    assert not sentence.startswith("malformed request:"), f"a stray Python error, not a checked argument: {reply}"


class Request:
    """A frame body and what the daemon must answer to it."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.op, self.args = 0, []
        try:
            request_id, self.op, self.args = decode_request(body)
        except errors.InvalidArgument as exc:
            request_id = getattr(exc, "request_id", None)
            if request_id is None:
                self.answered_as = 0  # it did not decode: answered under id 0
                return
        self.answered_as = request_id or None  # None: id 0, answered never

    def __repr__(self) -> str:  # hypothesis prints failing examples; some bodies are a megabyte
        if len(self.body) <= 160:
            return f"Request({self.body!r})"
        return f"Request({self.body[:160]!r}... ({len(self.body)} bytes))"


def exchange(conn: Conn, requests: list[Request]) -> list[tuple[Request, list]]:
    """Send the requests at once; each must get exactly one reply (or none, for id 0).
    Returns the requests that got one, with it."""
    conn.send(b"".join(frame(r.body) for r in requests))
    waiting: dict[int, Request] = {}
    undecoded = 0
    for request in requests:
        if request.answered_as == 0:
            undecoded += 1
        elif request.answered_as is not None:
            assert request.answered_as not in waiting and request.answered_as != SYNC_ID
            waiting[request.answered_as] = request
    answered = []
    while waiting or undecoded:
        reply = conn.reply()
        assert reply is not None, f"the daemon closed a connection whose frames were all within the limit; unanswered: {waiting}"
        if reply[0] == 0:
            assert undecoded, f"an id-0 reply no frame called for: {reply}"
            undecoded -= 1
            check_error(reply)
            continue
        assert reply[0] in waiting, f"a reply to no request, or a second one: {reply}"
        request = waiting.pop(reply[0])
        if reply[1]:
            check_error(reply)
        else:
            assert len(reply) == 3, reply
        answered.append((request, reply))
    conn.sync()  # nothing else may be on the way
    return answered


def give_back(conn: Conn, answered: list[tuple[Request, list]]) -> None:
    """Let go of whatever the fuzzed requests were granted, on the connection that holds it."""
    for request, reply in answered:
        if reply[1] or request.op not in GRANTING:
            continue
        if request.op == Op.RESERVE:
            undo = conn.call(Op.ABORT, reply[2][0])
        elif request.op == Op.ACQUIRE:
            undo = conn.call(Op.RELEASE, reply[2][0])
        elif request.op == Op.HANDOFF_SEND:
            undo = conn.call(Op.HANDOFF_CANCEL, request.args[3])
        else:
            undo = conn.call(Op.HANDOFF_CLOSE, request.args[1])
        if undo[1]:  # a fuzzed request of the same batch may have let go of it already
            assert undo[2] in ("NotFound", "ReservationExpired"), undo
            check_error(undo)


def oversized(daemon, request: Request) -> None:
    """A frame over the limit is refused under id 0 and its connection closed."""
    conn = Conn(daemon.socket)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it may close before the body is sent
            conn.send(frame(request.body))
        replies = conn.until_closed()
        assert len(replies) == 1 and replies[0][0] == 0 and replies[0][2] == "InvalidArgument", replies
        check_error(replies[0])
    finally:
        conn.close()


def within_limit(daemon, requests: list[Request]) -> list[Request]:
    """The requests a connection may send; those over the limit are sent, each on a
    connection of its own, and checked to close it."""
    for request in requests:
        if len(request.body) > MAX_REQUEST_BYTES:
            oversized(daemon, request)
    return [r for r in requests if len(r.body) <= MAX_REQUEST_BYTES]


def serve_requests(daemon, requests: list[Request]) -> list[tuple[Request, list]]:
    requests = within_limit(daemon, requests)
    conn = Conn(daemon.socket)
    try:
        answered = exchange(conn, requests)
        give_back(conn, answered)
        conn.sync()
        return answered
    finally:
        conn.close()


# -- values for the local protocol -------------------------------------------------------------
EDGE_INTS = [
    0, 1, -1, 2, 15, 16, 17, 1 << 16, 1 << 31, 1 << 32, (1 << 53) + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 31), -(1 << 63),
]  # fmt: skip
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e-9, 0.05, 86_400.0, 86_400.5, 1e308]
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 48, 16 * 64, 16 * 4096 + 8, 65_536 * 16, 65_537 * 16, MAX_REQUEST_BYTES - 64]
ints = st.one_of(st.integers(-(1 << 63), (1 << 64) - 1), st.sampled_from(EDGE_INTS))
floats = st.one_of(st.floats(), st.sampled_from(EDGE_FLOATS))
sized_bytes = st.builds(lambda n, fill: bytes([fill]) * n, st.sampled_from(SIZES), st.integers(0, 255))
any_bytes = st.one_of(st.binary(max_size=48), sized_bytes)


def peer_of(daemon) -> tuple[str, str]:
    """The daemon's own transport address and node id: requests may name it as their peer."""
    return daemon.transport_address, daemon.node_id


BAD_ADDRESSES = [
    "tcp://127.0.0.1:1", "tcp://localhost:0", "tcp://", "tcp://:1", "tcp://127.0.0.1:", "tcp://[::1]:65536", "tcp://127.0.0.1:-1",
    "tcp://127.0.0.1:99999999999999999999", "tcp://127.0.0.1:²", "tcp://127.0.0.1:٣", "tcp://" + "a" * 64 + ":1", "tcp://\x00:1",
    "ucx://127.0.0.1:1", "127.0.0.1:1",
]  # fmt: skip


def edge_texts(peer: tuple[str, str]) -> list[str]:
    return [
        "", " ", "\x00", "x" * 1024, "x" * 1025, "é" * 1024, "🙂" * 1024, "🙂" * 1025,  # 1025 emoji: over the decoder's string limit
        *BAD_ADDRESSES, *peer, "-1", "nan",
    ]  # fmt: skip


def wire_values(peer: tuple[str, str]):
    texts = st.one_of(st.text(max_size=24), st.sampled_from(edge_texts(peer)))
    scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, any_bytes)
    long_lists = st.lists(st.integers(0, 3), min_size=17, max_size=40)  # longer than the decoder takes
    return texts, st.recursive(
        st.one_of(scalars, long_lists),
        lambda inner: st.one_of(
            st.lists(inner, max_size=6), st.dictionaries(st.one_of(st.integers(-3, 3), st.text(max_size=3)), inner, max_size=3)
        ),
        max_leaves=12,
    )


def hash_blobs():
    known = st.lists(st.sampled_from(FUZZ_HASHES + NEW_HASHES), max_size=8).map(pack_hashes)
    random_whole = st.integers(0, 6).flatmap(lambda n: st.binary(min_size=16 * n, max_size=16 * n))
    big = st.sampled_from([1024, 65_536, 65_537]).map(distinct_hashes_blob)
    return st.one_of(known, random_whole, big, any_bytes)


def namespace_fields(values, texts):
    """A namespace's 13 fields: a valid one with small random sizes, and up to three of its
    fields replaced by values that may not fit."""
    positive = st.one_of(st.integers(1, 8), st.sampled_from([1 << 20, 1 << 31, (1 << 63) - 1, (1 << 64) - 1, 0, -1, 2.0, True]))
    replacements = [
        st.sampled_from(["test/fuzz", "m", " ", ""]),
        positive,
        positive,
        positive,
        positive,
        st.sampled_from([*DTYPE_SIZES, "float64", ""]),
        st.sampled_from([1, 2, 0, 3, 1.0, 2.0, True]),
        st.sampled_from(["NHD", "HND", "nhd"]),
        *[st.integers(-1, 3)] * 4,
        texts,
    ]

    @st.composite
    def fields(draw):
        layout = [draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from([8, 16, 64])), draw(st.integers(1, 16))]
        chosen = [
            draw(st.sampled_from(["fuzz/a", "fuzz/b"])),
            *layout,
            draw(st.sampled_from(sorted(DTYPE_SIZES))),
            2,
            "NHD",
            0,
            1,
            0,
            1,
            "",
        ]
        for index in draw(st.lists(st.integers(0, 12), max_size=3)):
            chosen[index] = draw(st.one_of(replacements[index], replacements[index], values))
        return chosen

    return fields()


def argument(name: str, peer: tuple[str, str], values, texts, digests: tuple[bytes, ...] = (NAMESPACE.digest,)):
    """Values for one argument of an op's signature: what fits, and near misses.
    ``digests``: the registered namespaces a request may name."""
    layers = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(-2, 70_000), ints)  # the fuzz layout has 2
    handles = st.one_of(st.integers(1, (1 << 64) - 1), st.sampled_from(EDGE_INTS))
    seconds = st.one_of(st.floats(0.001, 0.05), st.sampled_from([0, -1, math.nan, math.inf, -math.inf, 86_400.5, 1e300, True, "1"]))
    addresses = st.sampled_from([*peer, *BAD_ADDRESSES])
    counts = st.one_of(st.integers(-3, 20), ints)
    strategies = {
        "version": st.one_of(st.just(PROTOCOL_VERSION), ints),
        "namespace": st.one_of(namespace_fields(values, texts), st.just(namespace_to_wire(NAMESPACE))),
        "namespace digest": st.one_of(st.sampled_from(digests), st.sampled_from(digests), st.binary(min_size=16, max_size=16)),
        "namespace digests": st.one_of(
            st.lists(st.sampled_from(digests), min_size=1, max_size=4).map(b"".join),
            st.lists(st.binary(min_size=16, max_size=16), min_size=0, max_size=3).map(b"".join),
            st.binary(max_size=40),
            st.just(bytes(16 * (MAX_SHARDS + 1))),
            values,
        ),
        "block hashes": hash_blobs(),
        "parent hash": st.one_of(st.none(), st.sampled_from(FUZZ_HASHES), st.binary(min_size=16, max_size=16)),
        "reservation id": handles,
        "lease id": handles,
        "blocks written": st.one_of(st.none(), st.integers(-3, 20), ints),
        "first block that failed verification": st.one_of(st.none(), st.integers(-3, 20), ints),
        "checksums": st.one_of(st.none(), st.integers(0, 20).map(lambda n: bytes(8 * n)), any_bytes),
        "deadline_s": seconds,
        "hold_s": st.one_of(seconds, st.sampled_from([600.0, 600.5])),
        "hold ids to release": st.one_of(
            st.lists(st.integers(0, (1 << 64) - 1), max_size=4).map(lambda ids: np.asarray(ids, dtype="<u8").tobytes()),
            st.binary(max_size=20),
            st.just(bytes(8 * 4097)),
            values,
        ),
        "timeout_s": seconds,
        "blocks already loaded": counts,
        "blocks verified": counts,
        "bytes verified": counts,
        "blocks dropped": counts,
        "source": st.one_of(st.none(), addresses, texts),
        "destination": st.one_of(addresses, texts),
        "transfer id": st.one_of(st.sampled_from(["t1", "t2"]), texts),
        "first layer": layers,
        "number of layers": layers,
        "stop layer": layers,
    }
    return strategies[name]


def bounded_waits(op: int, args: list) -> list:
    """A request that may wait (a fetch's deadline, a handoff's timeout) waits at most
    50 ms here, so that every frame's answer is due at once: a valid timeout of an hour is
    a legitimate wait, not a hang."""
    signature = SIGNATURES.get(op, ())
    for index, (name, _, _) in enumerate(signature):
        if name in WAIT_OPS and index < len(args) and type(args[index]) in (int, float) and 0.05 < args[index] <= 86_400:
            args[index] = 0.05
    return args


@st.composite
def local_requests(draw, peer: tuple[str, str], request_id: int, digests: tuple[bytes, ...]):
    """One request: ``request_id``, else (where drawn) an id that is not one."""
    texts, values = wire_values(peer)
    mode = draw(st.sampled_from(["typed", "typed", "one wrong", "count", "junk"]))
    if mode == "junk":  # any op, unknown ones too, with any arguments
        op = draw(st.one_of(st.sampled_from(sorted(OP_NAMES)), ints, values))
        args = draw(st.lists(values, max_size=5))
    else:  # the op's signature, each argument what fits or a near miss
        op = draw(st.sampled_from(sorted(OP_NAMES)))
        args = [draw(argument(name, peer, values, texts, digests)) for name, _, _ in SIGNATURES[op]]
        if mode == "one wrong" and args:
            args[draw(st.integers(0, len(args) - 1))] = draw(values)
        elif mode == "count":
            args = (
                args[: draw(st.integers(0, len(args) - 1))]
                if draw(st.booleans())
                else args + draw(st.lists(values, min_size=1, max_size=3))
            )
    args = bounded_waits(op, args) if type(op) is int else args
    if request_id and draw(st.integers(0, 7)) == 0:
        request_id = draw(st.sampled_from([-1, 1.5, "1", None, [1], b"\x01", True]))
    try:
        return Request(msgpack.packb([request_id, op, *args], use_bin_type=True))
    except (OverflowError, ValueError):  # nothing msgpack can carry: a string of bytes in its place
        return Request(draw(st.binary(max_size=64)))


@st.composite
def local_batches(draw, peer: tuple[str, str]) -> list[Request]:
    """Requests sent at once on one connection; the first registers a namespace (fields
    that may not fit) that the others may name, with the fuzz namespace and random ids."""
    texts, values = wire_values(peer)
    fields = draw(namespace_fields(values, texts))
    try:
        digests: tuple[bytes, ...] = (NAMESPACE.digest, namespace_from_wire(fields).digest)
    except errors.InvalidArgument:
        digests = (NAMESPACE.digest,)
    size = draw(st.integers(1, 6))
    ids = draw(st.lists(st.integers(1, (1 << 63) - 1), min_size=size + 1, max_size=size + 1, unique=True))
    try:
        requests = [Request(msgpack.packb([ids[0], Op.REGISTER, fields], use_bin_type=True))]
    except (OverflowError, ValueError):  # fields msgpack cannot carry
        requests = [Request(msgpack.packb([ids[0], Op.REGISTER, namespace_to_wire(NAMESPACE)]))]
    for request_id in ids[1:]:
        if draw(st.integers(0, 4)) == 0:  # id 0: no answer; nothing that grants, nobody would learn what it took
            requests.append(draw(local_requests(peer, 0, digests).filter(lambda r: r.op not in GRANTING)))
        else:
            requests.append(draw(local_requests(peer, request_id, digests)))
    return requests


# -- 1. the local protocol, frame by frame ---------------------------------------------------------
def test_local_requests_with_random_ops_and_arguments_get_one_clear_answer_each(served):
    daemon = served.daemon

    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()

    @fuzz_settings(1200)
    @given(requests=local_batches(peer_of(daemon)))
    def fuzz(requests):
        for request, reply in serve_requests(daemon, requests):
            outcomes[OP_NAMES.get(request.op, "?"), reply[2] if reply[1] else "ok"] += 1
        served.every(200)

    fuzz()
    print(sorted(outcomes.items()))


def register(daemon, conn: Conn, fields: list) -> bytes | None:
    """The digest of a namespace of these fields (which may not fit), None if refused."""
    try:
        body = msgpack.packb([1 << 62, Op.REGISTER, fields], use_bin_type=True)
    except (OverflowError, ValueError):  # fields msgpack cannot carry
        return None
    answered = exchange(conn, within_limit(daemon, [Request(body)]))
    return answered[0][1][2][0] if answered and answered[0][1][1] == 0 else None


HANDLES = ["reservation", "lease", "reservation+1", "lease^1"]
SCRIPTED_OPS = [Op.COMMIT, Op.COMMIT, Op.ABORT, Op.RELEASE, Op.RELEASE, Op.HANDOFF_READY, Op.HANDOFF_READY]
SCRIPTED_OPS += [Op.HANDOFF_FINISH, Op.HANDOFF_CANCEL, Op.HANDOFF_WAIT, Op.HANDOFF_WAIT, Op.HANDOFF_CLOSE]


@st.composite
def handle_scripts(draw, peer: tuple[str, str]):
    """Requests naming what the connection holds (a reservation, a lease, a handoff it
    sends and reads), near misses, others' and random ones, with arguments that may not
    fit; the op and the handle or transfer id first, then the other arguments."""
    texts, values = wire_values(peer)
    fitting = {  # arguments that fit the connection's own reservation (3 blocks) and handoff (2 layers)
        Op.COMMIT: st.sampled_from([None, 0, 1, 2, 3]).map(lambda n: [n, bytes(8 * (3 if n is None else n))]),
        Op.HANDOFF_READY: st.sampled_from([[0, 1], [0, 2], [1, 1]]),
        Op.HANDOFF_WAIT: st.integers(0, 2).map(lambda stop: [stop, 0.05]),
        Op.RELEASE: st.sampled_from([[], [None], [0], [3], [4]]),
    }
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(SCRIPTED_OPS))
        if op < Op.HANDOFF_READY:
            own = st.sampled_from(HANDLES[:2])
            first = draw(st.one_of(own, own, st.sampled_from(HANDLES), st.integers(1, (1 << 64) - 1), values))
        else:
            first = draw(st.one_of(st.just("handoff"), st.just("handoff"), st.sampled_from(["t1", "x" * 1025]), values))
        if op in fitting and draw(st.booleans()):
            rest = draw(fitting[op])
        else:
            rest = bounded_waits(op, [None, *[draw(argument(name, peer, values, texts)) for name, _, _ in SIGNATURES[op][1:]]])[1:]
        steps.append((op, first, rest[: draw(st.integers(0, len(rest)))] if draw(st.integers(0, 3)) == 0 else rest))
    return draw(namespace_fields(values, texts)), steps


def test_requests_naming_what_the_connection_holds_get_one_clear_answer_each(served):
    daemon = served.daemon
    rounds = itertools.count(30_000)
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()

    @fuzz_settings(400)
    @given(script=handle_scripts(peer_of(daemon)))
    def fuzz(script):
        fields, steps = script
        number = next(rounds)
        conn = Conn(daemon.socket)
        try:
            transfer_id = f"handoff-{number}"
            digest = register(daemon, conn, fields) or NAMESPACE.digest  # the reservation is in this namespace where it is one
            reserve = conn.call(Op.RESERVE, digest, pack_hashes(chain(number, 3)), None)
            acquire = conn.call(Op.ACQUIRE, NAMESPACE.digest, pack_hashes(FUZZ_HASHES[:4]))
            send = conn.call(Op.HANDOFF_SEND, NAMESPACE.digest, pack_hashes(chain(number, 5)[3:]), None, transfer_id, daemon.node_id)
            receive = conn.call(Op.HANDOFF_RECEIVE, NAMESPACE.digest, transfer_id, 5)  # this daemon is its own consumer
            assert all(reply[1] == 0 for reply in (reserve, acquire, send, receive)), (reserve, acquire, send, receive)
            handles = {
                "reservation": reserve[2][0],
                "lease": acquire[2][0],
                "reservation+1": (reserve[2][0] + 1) % (1 << 64),
                "lease^1": acquire[2][0] ^ 1,
                "handoff": transfer_id,
            }
            requests = []
            for request_id, (op, first, rest) in enumerate(steps, start=1):
                first = handles.get(first, first) if isinstance(first, str) else first
                requests.append(Request(msgpack.packb([request_id, op, first, *rest])))
            for request, reply in exchange(conn, within_limit(daemon, requests)):
                outcomes[OP_NAMES[request.op], reply[2] if reply[1] else "ok"] += 1
            for op, handle in (
                (Op.ABORT, handles["reservation"]),
                (Op.RELEASE, handles["lease"]),
                (Op.HANDOFF_CLOSE, transfer_id),
                (Op.HANDOFF_CANCEL, transfer_id),
            ):
                undo = conn.call(op, handle)
                if undo[1]:  # a scripted request let go of it already
                    assert undo[2] in ("NotFound", "ReservationExpired"), undo
                    check_error(undo)
        finally:
            conn.close()
        served.every(100)

    fuzz()
    print(sorted(outcomes.items()))
    assert outcomes["commit", "ok"] and outcomes["handoff_ready", "ok"] and outcomes["release", "ok"], outcomes


def test_peer_addresses_that_cannot_be_one_get_a_clear_answer(served):
    """A fetch's source and a handoff's destination come from the engine: one that is not
    a transport address is refused (or, for a fetch, a miss), never an internal error."""
    conn = Conn(served.daemon.socket)
    try:
        for number, address in enumerate(BAD_ADDRESSES):
            fetched = conn.call(Op.FETCH, NAMESPACE.digest, pack_hashes(NEW_HASHES[:2]), 0.5, address)
            sent = conn.call(Op.HANDOFF_SEND, NAMESPACE.digest, pack_hashes(NEW_HASHES[:2]), None, f"bad-{number}", address)
            assert fetched[1] == 0 or fetched[2] == "InvalidArgument", (address, fetched)
            check_error(sent)
            assert sent[2] in ("InvalidArgument", "TransferFailed", "NotFound"), (address, sent)
    finally:
        conn.close()


# -- 2. the local protocol, byte by byte -------------------------------------------------------------
SPECIAL_BODIES = [
    b"",
    b"\xc1",  # never used in msgpack
    b"\x91" * 100 + b"\xc0",  # nested 100 deep
    b"\x91" * 100_000 + b"\xc0",  # deeper than any decoder recursion
    b"\xdd\xff\xff\xff\xff",  # an array of 4 billion items, none sent
    b"\xdf\xff\xff\xff\xff",  # the same as a map
    b"\x93\x01\x03\xc6\xff\xff\xff\xff",  # a lookup whose hashes claim 4 GiB
    b"\x93\x01\x03\xdb\xff\xff\xff\xff",  # …or a string that long
    b"\x92\x01\xd4\x01\x00",  # an ext type as the op
    b"\x93\x01\x01\xa2\xff\xfe",  # a string that is not UTF-8
    b"\x92\xcf\xff\xff\xff\xff\xff\xff\xff\xfe\x01",  # the largest request id but one (that one is SYNC_ID)
    b"\x92\xd3\x80\x00\x00\x00\x00\x00\x00\x00\x01",  # the most negative one
    b"\x92\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00\x01",  # a NaN id
    msgpack.packb([1, Op.HELLO, PROTOCOL_VERSION]) + b"\x00",  # a request and trailing bytes
    msgpack.packb({1: Op.HELLO}),
    msgpack.packb([[1, Op.HELLO, PROTOCOL_VERSION]]),
    msgpack.packb([1, Op.LOOKUP, NAMESPACE.digest, [b"\x00" * 16] * 16]),
]


@dataclass(frozen=True)
class Body:
    """One frame whose body is these bytes."""

    body: bytes


@dataclass(frozen=True)
class Truncated:
    """A header promising ``promised`` bytes, fewer sent, then the connection closed (or
    only its sending half, after which the daemon must close its end)."""

    promised: int
    sent: bytes
    half_close: bool


@dataclass(frozen=True)
class Oversized:
    length: int


@dataclass(frozen=True)
class Garbage:
    """Bytes with no framing at all, then the sending half closed."""

    data: bytes


@dataclass(frozen=True)
class Fragmented:
    """A well-formed lookup delivered in pieces."""

    cuts: tuple[int, ...]


def raw_cases():
    bodies = st.one_of(
        st.binary(max_size=64),
        st.sampled_from(SPECIAL_BODIES),
        st.binary(min_size=1, max_size=24).map(lambda tail: msgpack.packb([7, Op.LOOKUP])[:-1] + tail),
    ).map(Body)
    truncated = st.builds(
        lambda promised, fraction, fill, half: Truncated(promised, bytes([fill]) * int(promised * fraction), half),
        st.one_of(st.integers(1, 64), st.sampled_from([4096, MAX_REQUEST_BYTES])),
        st.floats(0, 0.99),
        st.integers(0, 255),
        st.booleans(),
    )
    oversized_ = st.one_of(st.integers(MAX_REQUEST_BYTES + 1, (1 << 32) - 1), st.sampled_from([MAX_REQUEST_BYTES + 1, (1 << 32) - 1])).map(
        Oversized
    )
    garbage = st.binary(max_size=512).map(Garbage)
    fragmented = st.lists(st.integers(1, 60), max_size=6).map(lambda cuts: Fragmented(tuple(sorted(set(cuts)))))
    return st.one_of(bodies, bodies, truncated, oversized_, garbage, fragmented)


def serve_raw(daemon, case) -> None:
    if isinstance(case, Body):
        serve_requests(daemon, [Request(case.body)])
        return
    conn = Conn(daemon.socket)
    try:
        if isinstance(case, Truncated):
            conn.send(HEADER.pack(case.promised) + case.sent)
            if case.half_close:
                conn.sock.shutdown(socket.SHUT_WR)
                assert conn.until_closed() == []
        elif isinstance(case, Oversized):
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.send(HEADER.pack(case.length) + b"\x00" * 64)
            replies = conn.until_closed()
            assert len(replies) == 1 and replies[0][0] == 0, replies
            check_error(replies[0])
        elif isinstance(case, Garbage):
            conn.send(case.data)
            conn.sock.shutdown(socket.SHUT_WR)
            for reply in conn.until_closed():  # whatever it made of the bytes, it answered and then closed
                if reply[1]:
                    check_error(reply)
        else:
            data = frame(msgpack.packb([9, Op.LOOKUP, NAMESPACE.digest, pack_hashes(FUZZ_HASHES)]))
            for start, stop in zip((0, *case.cuts), (*case.cuts, len(data))):
                conn.send(data[start:stop])
                time.sleep(0.0005)
            reply = conn.reply()
            assert reply is not None and reply[:2] == [9, 0], reply
            conn.sync()
    finally:
        conn.close()


def test_raw_bytes_never_crash_or_hang_the_daemon(served):
    daemon = served.daemon

    @fuzz_settings(2000)
    @given(case=raw_cases())
    def fuzz(case):
        serve_raw(daemon, case)
        served.every(200)

    fuzz()


# -- 3. the gRPC API ---------------------------------------------------------------------------------
ALLOWED_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAVAILABLE,
}
uint32 = st.one_of(st.integers(0, (1 << 32) - 1), st.sampled_from([0, 1, 2, 16, (1 << 31), (1 << 32) - 1]))
uint64 = st.one_of(st.integers(0, (1 << 64) - 1), st.sampled_from([0, 1, 1 << 32, 1 << 63, (1 << 64) - 1]))
enum_values = st.one_of(st.sampled_from(sorted(pb.Tier.values())), st.integers(-(1 << 31), (1 << 31) - 1))
doubles = st.one_of(st.floats(), st.sampled_from(EDGE_FLOATS + [-1.0]))
names = st.one_of(st.text(max_size=16), st.sampled_from(["", "\x00", "x" * 1024, "x" * 1025, "n1"]))
namespace_ids = st.one_of(st.just(NAMESPACE.digest), st.just(NAMESPACE.digest), st.binary(max_size=40), st.binary(min_size=16, max_size=16))
one_hash = st.one_of(st.sampled_from(FUZZ_HASHES + NEW_HASHES), st.binary(max_size=40), st.binary(min_size=16, max_size=16))
hash_lists = st.one_of(
    st.lists(one_hash, max_size=8),
    st.sampled_from([1024, 65_536, 65_537]).map(lambda n: [bytes(h) for h in np.frombuffer(distinct_hashes_blob(n), dtype="V16").tolist()]),
)
token_lists = st.one_of(st.lists(st.integers(0, (1 << 32) - 1), max_size=64), st.sampled_from([0, 4, 1000]).map(lambda n: list(range(n))))
payload_lists = st.lists(
    st.one_of(st.sampled_from([BLOCK, BLOCK, 0, 1, BLOCK - 1, BLOCK + 1]).map(bytes), st.binary(max_size=16)), max_size=8
)


@st.composite
def prefixes(draw, message):
    which = draw(st.sampled_from(["token_ids", "block_hashes", None]))
    if which == "token_ids":
        message.token_ids.ids.extend(draw(token_lists))
    elif which == "block_hashes":
        message.block_hashes.hashes.extend(draw(hash_lists))
    return message


def optional(message, **fields):
    """Set each field whose drawn value is not None (proto3 optional fields stay unset)."""
    for name, value in fields.items():
        if value is not None:
            setattr(message, name, value)
    return message


def grpc_requests():
    layouts = st.builds(
        pb.KVLayout,
        num_layers=uint32,
        num_kv_heads=uint32,
        head_dim=uint32,
        block_size=uint32,
        dtype=st.one_of(st.sampled_from([*DTYPE_SIZES, "float64"]), names),
        kv_planes=uint32,
        inner_order=st.one_of(st.sampled_from(["NHD", "HND"]), names),
    )
    small_layouts = st.builds(
        pb.KVLayout,
        num_layers=st.integers(0, 4),
        num_kv_heads=st.integers(0, 4),
        head_dim=st.integers(0, 64),
        block_size=st.integers(0, 16),
    )
    register = st.builds(
        pb.RegisterNamespaceRequest,
        model_id=names,
        layout=st.one_of(st.none(), layouts, small_layouts),
        tp_rank=uint32,
        tp_size=uint32,
        pp_rank=uint32,
        pp_size=uint32,
        tenant_salt=names,
    )
    lookup = st.builds(pb.LookupRequest, namespace_id=namespace_ids).flatmap(prefixes)
    put = st.builds(
        lambda ns, hashes, parent, payloads: optional(
            pb.PutRequest(namespace_id=ns, block_hashes=hashes, payloads=payloads), parent_hash=parent
        ),
        namespace_ids,
        st.lists(one_hash, max_size=8),
        st.one_of(st.none(), one_hash),
        payload_lists,
    )
    get = st.builds(pb.GetRequest, namespace_id=namespace_ids, block_hashes=hash_lists)
    match = st.builds(pb.MatchRequest, namespace_id=namespace_ids, node_ids=st.lists(names, max_size=4)).flatmap(prefixes)
    candidates = st.lists(
        st.builds(pb.RouteCandidate, node_id=names, load=st.builds(pb.NodeLoad, queued_tokens=uint64, active_requests=uint32)), max_size=4
    )
    route = st.builds(pb.RouteRequest, namespace_id=namespace_ids, token_ids=token_lists, session_id=names, candidates=candidates)
    tokens = st.one_of(names, st.sampled_from(["-1", "-5", "0", "1", "99999999999999999999", "1e3", "0x10", " 7", "٣", "1_0", "x" * 65]))
    list_blocks = st.builds(
        lambda ns, tier, idle, size, token: optional(
            pb.ListBlocksRequest(namespace_id=ns, page_size=size, page_token=token), tier=tier, min_idle_s=idle
        ),
        st.one_of(st.just(b""), namespace_ids),
        st.one_of(st.none(), enum_values),
        st.one_of(st.none(), doubles),
        st.one_of(st.integers(0, 100), uint32),
        tokens,
    )
    evict = st.builds(
        lambda ns, hashes, tier, idle, everything: optional(
            pb.EvictRequest(namespace_id=ns, block_hashes=hashes, all=everything), tier=tier, min_idle_s=idle
        ),
        st.one_of(st.just(b""), namespace_ids),
        st.one_of(st.just([]), hash_lists),
        st.one_of(st.none(), enum_values),
        st.one_of(st.none(), doubles),
        st.booleans(),
    )
    pin = st.builds(pb.PinRequest, namespace_id=namespace_ids, block_hashes=hash_lists)
    unpin = st.builds(pb.UnpinRequest, namespace_id=namespace_ids, block_hashes=hash_lists)
    drain = st.builds(pb.DrainRequest, target_node_ids=st.lists(names, max_size=3), max_bytes=uint64)
    warm = st.builds(pb.WarmRequest, source_node_ids=st.lists(names, max_size=3), max_bytes=uint64)
    return st.one_of(
        st.tuples(st.just(("Store", "RegisterNamespace")), register),
        st.tuples(st.just(("Store", "Lookup")), lookup),
        st.tuples(st.just(("Store", "Put")), put),
        st.tuples(st.just(("Store", "Get")), get),
        st.tuples(st.just(("Index", "Match")), match),
        st.tuples(st.just(("Index", "Route")), route),
        st.tuples(st.just(("Index", "Nodes")), st.just(pb.NodesRequest())),
        st.tuples(st.just(("Admin", "Stats")), st.just(pb.StatsRequest())),
        st.tuples(st.just(("Admin", "ListBlocks")), list_blocks),
        st.tuples(st.just(("Admin", "Evict")), evict),
        st.tuples(st.just(("Admin", "Pin")), pin),
        st.tuples(st.just(("Admin", "Unpin")), unpin),
        st.tuples(st.just(("Admin", "Drain")), drain),
        st.tuples(st.just(("Admin", "Warm")), warm),
    )


def check_status(code: grpc.StatusCode, details: str, what: str) -> None:
    assert code in ALLOWED_CODES, f"{what} was answered {code.name}: {details}"
    if code != grpc.StatusCode.OK:
        assert "Stream removed" not in details, f"{what} was answered with a status the client could not read: {details}"
        assert details and len(details) <= 1024, f"{what} was answered {code.name} with the sentence {details!r}"


def call_rpc(channel: grpc.Channel, service: str, method: str, request, metadata=()) -> grpc.StatusCode:
    stub = getattr(pb_grpc, f"{service}Stub")(channel)
    try:
        getattr(stub, method)(request, timeout=REPLY_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        check_status(exc.code(), exc.details(), f"{service}.{method}")
        return exc.code()
    return grpc.StatusCode.OK


def test_grpc_requests_with_random_fields_get_a_status_naming_the_callers_mistake(served):
    daemon = served.daemon
    codes: dict[str, set[str]] = {}
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 256 << 20)]) as channel:

        @fuzz_settings(3000)
        @given(call=grpc_requests())
        def fuzz(call):
            (service, method), request = call
            code = call_rpc(channel, service, method, request, credentials(daemon))
            codes.setdefault(method, set()).add(code.name)
            if method == "ListBlocks" and request.page_token and not (request.page_token.isascii() and request.page_token.isdigit()):
                assert code != grpc.StatusCode.OK, f"page token {request.page_token!r} is none this node issues"
            served.every(250)

        fuzz()
        many_peers = [f"peer-{i:04d}-" + "x" * 1000 for i in range(100)]
        edges = [  # requests at and over the limits, each once: (what, request, the status it must get)
            ("Store", "Lookup", pb.LookupRequest(namespace_id=NAMESPACE.digest, token_ids=pb.TokenIds(ids=[7] * (4 * 1024 * 1024 + 1)))),
            ("Index", "Route", pb.RouteRequest(namespace_id=NAMESPACE.digest, token_ids=[7] * (4 * 1024 * 1024 + 1))),
            ("Index", "Match", pb.MatchRequest(namespace_id=NAMESPACE.digest, node_ids=["n"] * 4097, token_ids=pb.TokenIds(ids=[1]))),
            ("Index", "Route", pb.RouteRequest(namespace_id=NAMESPACE.digest, candidates=[pb.RouteCandidate(node_id="n")] * 4097)),
            ("Store", "Put", pb.PutRequest(namespace_id=NAMESPACE.digest, block_hashes=NEW_HASHES[:1], payloads=[bytes(65 << 20)])),
            ("Admin", "Drain", pb.DrainRequest(target_node_ids=["n"] * 4097)),
            ("Admin", "Warm", pb.WarmRequest(source_node_ids=["x" * 1025])),
        ]
        for service, method, request in edges:
            assert call_rpc(channel, service, method, request, credentials(daemon)) == grpc.StatusCode.INVALID_ARGUMENT, (service, method)
        for request in (pb.DrainRequest(target_node_ids=many_peers), pb.WarmRequest(source_node_ids=many_peers)):
            method = type(request).__name__[:-7]
            assert call_rpc(channel, "Admin", method, request, credentials(daemon)) == grpc.StatusCode.NOT_FOUND  # no such peer
        too_big = pb.PutRequest(namespace_id=NAMESPACE.digest, block_hashes=NEW_HASHES[:1], payloads=[bytes(96 << 20)])
        assert (
            call_rpc(channel, "Store", "Put", too_big, credentials(daemon)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        )  # over gRPC's message limit
        with grpc.insecure_channel(daemon.address) as plain:
            unpin = pb.UnpinRequest(namespace_id=NAMESPACE.digest, block_hashes=FUZZ_HASHES + NEW_HASHES)
            pb_grpc.AdminStub(plain).Unpin(unpin, metadata=credentials(daemon))
    print(sorted(codes.items()))
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND"} <= set().union(*codes.values()), codes


# mutations of a serialized request: the bytes a broken or hostile client sends
WIRE_TAILS = [
    b"\x0a\xff\xff\xff\x0f",  # field 1, length-delimited, 4 GiB promised
    b"\x20" + b"\xff" * 9 + b"\x01",  # field 4 as a varint of 2^64 - 1 (a negative int64)
    b"\x08\x01",  # field 1 with the wrong wire type
    b"\xf8\xff\xff\xff\x0f\x01",  # the largest field number, unknown
    b"\x0f",  # a deprecated group-end tag
    b"\x80",  # a varint cut short
]


def grpc_wire_bytes():
    def mutate(call, mutation):
        (service, method), request = call
        data = request.SerializeToString()
        kind, where, extra = mutation
        where = where % (len(data) + 1)
        if kind == "truncate":
            data = data[:where]
        elif kind == "flip" and data:
            data = (
                data[: where % len(data)] + bytes([data[where % len(data)] ^ (extra[0] if extra else 0xFF)]) + data[where % len(data) + 1 :]
            )
        elif kind == "insert":
            data = data[:where] + extra + data[where:]
        else:
            data = data + WIRE_TAILS[where % len(WIRE_TAILS)]
        return service, method, data

    mutations = st.tuples(st.sampled_from(["truncate", "flip", "insert", "tail"]), st.integers(0, 1 << 16), st.binary(max_size=8))
    return st.builds(mutate, grpc_requests(), mutations)


def test_grpc_requests_of_malformed_bytes_are_refused_as_invalid(served):
    daemon = served.daemon
    with grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 256 << 20)]) as channel:

        @fuzz_settings(1500)
        @given(call=grpc_wire_bytes())
        def fuzz(call):
            service, method, data = call
            rpc = channel.unary_unary(f"/kvstore.v1.{service}/{method}")  # bytes in, bytes out
            try:
                rpc(data, timeout=REPLY_TIMEOUT_S, metadata=credentials(daemon))
            except grpc.RpcError as exc:
                check_status(exc.code(), exc.details(), f"{service}.{method} of {len(data)} bytes")
            served.every(200)

        fuzz()
        with grpc.insecure_channel(daemon.address) as plain:
            unpin = pb.UnpinRequest(namespace_id=NAMESPACE.digest, block_hashes=FUZZ_HASHES + NEW_HASHES)
            pb_grpc.AdminStub(plain).Unpin(unpin, metadata=credentials(daemon))
