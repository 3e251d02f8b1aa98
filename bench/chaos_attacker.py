"""An attacker on the chaos run's peer ports: a process without the fleet's credential that
keeps trying to read blocks from the daemons and to plant blocks of its own in them.

    python -m bench.chaos_attacker '<json settings>'   (started by bench/chaos.py)

Each attempt picks a daemon and one of:

    store             a store of the attacker's own bytes (``attacker_payload``) under chain
                      hashes the engines really use (a planted block would be served to
                      them as a hit), every third under the attacker's own chain
                      (``attacker_chain``: listed anywhere, it was planted); the request
                      sent as the first frame, after a hello that skips the proof, or
                      after a made-up proof (``OPENINGS``)
    fetch             a fetch of the engines' chain hashes, the same three ways
    hot               a request for the daemon's hot chains, the same three ways
    wrong_secret      the whole handshake with a secret the fleet does not use (the proof
                      sent even though the daemon's own proof did not check out), then a fetch
    oversized_header  a first frame that announces more than a handshake may hold (AUTH,
                      CONTROL and BLOCK headers), or a header of random bytes
    silent            a connection that never sends a byte (the daemon must close it)
    flood             up to ``flood_connections`` (at most 200) connections at once, held
                      for a moment and closed

Where the fleet uses mutual TLS, every attempt connects either in the clear or over TLS
with a certificate from a CA the fleet does not trust.

Whatever comes back is parsed as frames. AUTH frames (the daemon's half of a handshake)
and ERROR frames (refusals) are expected; any CONTROL, BLOCK or END frame means the
daemon served a request: its payload bytes are counted as served (block payloads and
hot-chain lists apart), and a store the daemon accepted is carried through, so that the
run's audit finds the planted blocks. Bytes that do not parse as frames (a TLS alert to
a plaintext peer) are counted apart.

Bounded: connections only to loopback addresses, from a loopback source of its own
(``source_host``, so that the daemons' per-source channel limit sets it apart from the
fleet's own peers where the host allows it); at most ``max_attempts`` attempts within
``seconds``, then it stops by itself (or earlier when ``stop_path`` exists). Counters
are cumulative and appended as one JSON line to ``stats_path`` every half second and at
the end (``"done": true``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import random
import resource
import select
import socket
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.chaos_workload import BLOCK_BYTES, NAMESPACE, Workload, content_digest
from kvstore.errors import CorruptBlock, InvalidArgument
from kvstore.hashing import BlockHash, chain_hashes
from kvstore.localproto import namespace_to_wire, pack_hashes
from kvstore.transport.auth import ClientHandshake, PeerAuth, fleet_key
from kvstore.transport.base import split_address
from kvstore.transport.config import is_loopback
from kvstore.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, block_header, control_header, decode_control, encode_control

__all__ = [
    "ATTACK_KINDS",
    "MAX_FLOOD_CONNECTIONS",
    "AttackerSettings",
    "Attacker",
    "attacker_payload",
    "attacker_digest",
    "attacker_chain",
    "main",
]

ATTACK_KINDS = ("store", "fetch", "hot", "wrong_secret", "oversized_header", "silent", "flood")
ATTACK_WEIGHTS = (3.0, 3.0, 1.5, 2.0, 1.0, 0.5)  # of the kinds before flood (which has its own interval)
MAX_FLOOD_CONNECTIONS = 200
OPENINGS = ("first_frame", "skip_proof", "forged_proof")  # how a request is sent without the credential
_PATTERN = b"\xa5 planted by the chaos attacker \x5a"


def attacker_payload() -> np.ndarray:
    """The bytes every block the attacker stores holds: a pattern no block of the run has."""
    return np.resize(np.frombuffer(_PATTERN, dtype=np.uint8), BLOCK_BYTES)


def attacker_digest() -> str:
    return content_digest(attacker_payload())


def attacker_chain(num_blocks: int) -> list[BlockHash]:
    """Chain hashes only the attacker uses (tokens no session or scratch chain takes)."""
    size = NAMESPACE.layout.block_size
    base = 100_000_000
    return chain_hashes(np.arange(base, base + num_blocks * size, dtype=np.int64), size)


@dataclass(frozen=True)
class AttackerSettings:
    targets: list[str]  # every daemon's peer address, tcp://host:port (loopback only)
    stats_path: str
    stop_path: str
    seconds: float
    seed: int
    wrong_secret: str
    workload: dict = field(default_factory=dict)
    source_host: str = "127.0.0.2"  # falls back to 127.0.0.1 where it cannot be bound
    stranger_cert: str = ""  # with stranger_key: TLS attempts, where the fleet uses mutual TLS
    stranger_key: str = ""
    openings: tuple[str, ...] = OPENINGS
    max_attempts: int = 50_000
    flood_connections: int = 100
    flood_interval_s: float = 4.0
    max_silent: int = 4  # silent connections held at once
    silent_patience_s: float = 8.0  # past this, a silent connection the daemon kept open is closed and counted
    answer_timeout_s: float = 2.0
    pause_s: float = 0.03  # between attempts: the run's engines and daemons share the cores

    def __post_init__(self) -> None:
        for target in self.targets:
            if not is_loopback(split_address(target, "tcp")[0]):
                raise InvalidArgument(f"the chaos attacker only attacks loopback addresses, not {target}.")
        if not is_loopback(self.source_host):
            raise InvalidArgument(f"the chaos attacker connects from a loopback address, not {self.source_host}.")
        if not self.openings or set(self.openings) - set(OPENINGS):
            raise InvalidArgument(f"openings are among {OPENINGS}, got {self.openings}.")
        if not 0 < self.flood_connections <= MAX_FLOOD_CONNECTIONS:
            raise InvalidArgument(f"a flood opens 1 to {MAX_FLOOD_CONNECTIONS} connections, got {self.flood_connections}.")


@dataclass
class _Silent:
    sock: socket.socket
    target: str
    opened: float


class Attacker:
    """Owner: the process's only thread."""

    def __init__(self, settings: AttackerSettings) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        self.counters: dict[str, int] = {}
        self.served: list[dict] = []  # the first frames a daemon served, for the report
        self.error_classes: dict[str, int] = {}
        workload = Workload(**settings.workload)
        self.engine_chains = [workload.chain(session) for session in range(workload.num_sessions)]
        self.own_chain = attacker_chain(8)
        self.payload = attacker_payload().tobytes()
        self.wrong_key = fleet_key(settings.wrong_secret)
        self.silent: list[_Silent] = []
        self.num_stores = 0
        self.source_host = self._bindable(settings.source_host)
        self.stranger_tls = self._stranger_context() if settings.stranger_cert else None
        self.stats_fd = os.open(settings.stats_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    # -- bookkeeping ----------------------------------------------------------------------
    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def report(self, done: bool = False) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        record = {"kind": "attacker", "t": time.time(), "done": done, "source_host": self.source_host}
        record["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
        record.update(counters=self.counters, served=self.served[:20], error_classes=self.error_classes)
        os.write(self.stats_fd, (json.dumps(record) + "\n").encode())

    # -- connections -------------------------------------------------------------------------
    @staticmethod
    def _bindable(host: str) -> str:
        try:
            with socket.socket() as sock:
                sock.bind((host, 0))
            return host
        except OSError:
            return "127.0.0.1"

    def _stranger_context(self) -> ssl.SSLContext:
        """TLS with a certificate from a CA the fleet does not trust (the attacker does not
        check the daemon's: it wants in, not to know whom it talks to)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(self.settings.stranger_cert, self.settings.stranger_key)
        return context

    def _socket(self, target: str, timeout_s: float) -> socket.socket:
        host, port = split_address(target, "tcp")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.bind((self.source_host, 0))
            sock.connect((host, port))
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect(self, target: str) -> socket.socket:
        """A connection in the clear, or (half the time, where the fleet uses TLS) over TLS
        with the stranger's certificate."""
        sock = self._socket(target, self.settings.answer_timeout_s)
        if self.stranger_tls is not None and self.rng.random() < 0.5:
            self.count("tls_attempts")
            try:
                return self.stranger_tls.wrap_socket(sock, server_hostname=None)
            except BaseException:
                sock.close()
                raise
        return sock

    # -- one attempt --------------------------------------------------------------------------
    def attempt(self, kind: str, target: str) -> None:
        self.count(f"attempts_{kind}")
        attack = getattr(self, f"_{kind}")
        try:
            outcome = attack(target)
        except ssl.SSLError:
            outcome = "tls_refused"
        except ConnectionRefusedError:
            outcome = "unreachable"  # the daemon is down or restarting
        except TimeoutError:
            outcome = "no_answer"  # e.g. a daemon stopped by SIGSTOP
        except OSError:
            outcome = "closed"
        self.count(f"outcome:{kind}:{outcome}")

    def _opening(self, sock: socket.socket, opening: str) -> None:
        """What comes before a request: nothing, a hello, or a hello and a made-up proof."""
        if opening == "first_frame":
            return
        hello = encode_control(ClientHandshake(PeerAuth(), tls=False).hello())
        frames = control_header(FrameKind.AUTH, 0, hello).pack() + hello
        if opening == "forged_proof":
            proof = encode_control({"proof": os.urandom(32)})
            frames += control_header(FrameKind.AUTH, 0, proof).pack() + proof
        sock.sendall(frames)

    def _request(self, target: str, message: dict, store_hashes: list[bytes] | None = None) -> str:
        opening = self.rng.choice(self.settings.openings)
        with self._connect(target) as sock:
            self._opening(sock, opening)
            payload = encode_control(message)
            sock.sendall(control_header(FrameKind.CONTROL, 1, payload).pack() + payload)
            return self._answer(sock, opening, store_hashes)

    def _store(self, target: str) -> str:
        self.num_stores += 1
        hashes = self.own_chain if self.num_stores % 3 == 0 else self.rng.choice(self.engine_chains)
        hashes = hashes[: self.rng.randint(1, len(hashes))]
        message = {"op": "store", "namespace": namespace_to_wire(NAMESPACE), "hashes": pack_hashes(hashes), "parent": None}
        return self._request(target, message, hashes)

    def _fetch(self, target: str) -> str:
        hashes = self.rng.choice(self.engine_chains)
        return self._request(target, {"op": "fetch", "namespace": NAMESPACE.digest, "hashes": pack_hashes(hashes)})

    def _hot(self, target: str) -> str:
        return self._request(target, {"op": "hot", "max_bytes": 1 << 30})

    def _wrong_secret(self, target: str) -> str:
        """The handshake in full, with a proof made from a secret the fleet does not use."""
        with self._connect(target) as sock:
            handshake = ClientHandshake(PeerAuth(key=self.wrong_key), tls=False)
            hello = encode_control(handshake.hello())
            sock.sendall(control_header(FrameKind.AUTH, 0, hello).pack() + hello)
            reply = self._read_frame(sock)
            if reply is None:
                return "closed"
            header, payload = reply
            if header.kind is not FrameKind.AUTH:
                return self._answer(sock, "wrong_secret", None, first=[reply])
            nonce_s = _field(header, payload, "nonce")
            proof = encode_control({"proof": _proof(self.wrong_key, handshake.nonce, nonce_s or bytes(32))})
            fetch = encode_control({"op": "fetch", "namespace": NAMESPACE.digest, "hashes": pack_hashes(self.engine_chains[0])})
            sock.sendall(
                control_header(FrameKind.AUTH, 0, proof).pack() + proof + control_header(FrameKind.CONTROL, 1, fetch).pack() + fetch
            )
            return self._answer(sock, "wrong_secret", None)

    def _oversized_header(self, target: str) -> str:
        variant = self.rng.choice(("auth_64MiB", "control_1GiB", "block_1GiB", "random_bytes"))
        self.count(f"oversized_header_{variant}")
        if variant == "random_bytes":
            data = os.urandom(HEADER_BYTES)
        else:
            kind, length = {
                "auth_64MiB": (FrameKind.AUTH, 64 << 20),
                "control_1GiB": (FrameKind.CONTROL, (1 << 30) + 1),
                "block_1GiB": (FrameKind.BLOCK, 1 << 30),
            }[variant]
            data = FrameHeader(kind, 0, length=length).pack()
        with self._connect(target) as sock:
            sock.sendall(data)
            return self._answer(sock, "oversized_header", None)

    def _silent(self, target: str) -> str:
        if len(self.silent) >= self.settings.max_silent:
            return "skipped_held_enough"
        sock = self._socket(target, self.settings.answer_timeout_s)  # plain TCP: the daemon waits for a first byte either way
        sock.setblocking(False)
        self.silent.append(_Silent(sock, target, time.monotonic()))
        return "opened"

    def _flood(self, target: str) -> str:
        """Open ``flood_connections`` at once (non-blocking), hold them, count those the daemon closed."""
        host, port = split_address(target, "tcp")
        socks: list[socket.socket] = []
        try:
            for _ in range(self.settings.flood_connections):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.setblocking(False)
                sock.bind((self.source_host, 0))
                sock.connect_ex((host, port))
            deadline = time.monotonic() + 1.0
            pending = list(socks)
            while pending and time.monotonic() < deadline:
                _, writable, _ = select.select([], pending, [], max(0.0, deadline - time.monotonic()))
                pending = [s for s in pending if s not in writable]
            connected = [s for s in socks if s not in pending and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0]
            self.count("flood_connections", len(socks))
            self.count("flood_connected", len(connected))
            time.sleep(0.5)
            closed = 0
            for sock in connected:
                if self._closed_by_daemon(sock):
                    closed += 1
            self.count("flood_closed_by_daemon", closed)
            return "done" if connected else "unreachable"
        finally:
            for sock in socks:
                sock.close()

    def _closed_by_daemon(self, sock: socket.socket) -> bool:
        """Non-blocking: whether the daemon closed ``sock`` (whatever it sent first is parsed)."""
        data = bytearray()
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except BlockingIOError:
            self._tally(data, "flood")
            return False
        except OSError:
            pass
        self._tally(data, "flood")
        return True

    def tend_silent(self) -> None:
        """Close what the daemons closed (counted), and connections held past patience."""
        now = time.monotonic()
        kept = []
        for silent in self.silent:
            if self._closed_by_daemon(silent.sock):
                self.count("silent_closed_by_daemon")
                silent.sock.close()
            elif now - silent.opened > self.settings.silent_patience_s:
                self.count("silent_outlived_patience")  # a daemon stopped by SIGSTOP closes nothing
                silent.sock.close()
            else:
                kept.append(silent)
        self.silent = kept

    # -- what came back ----------------------------------------------------------------------
    def _read_frame(self, sock: socket.socket) -> tuple[FrameHeader, bytes] | None:
        header_bytes = _read_exactly(sock, HEADER_BYTES)
        if header_bytes is None:
            return None
        try:
            header = FrameHeader.unpack(header_bytes)
        except CorruptBlock:
            self.count("unparsed_bytes", len(header_bytes))
            return None
        payload = _read_exactly(sock, header.length) if header.length <= 1 << 24 else None
        return None if payload is None else (header, payload)

    def _answer(self, sock: socket.socket, how: str, store_hashes: list[bytes] | None, first: list | None = None) -> str:
        """Read until the daemon closes (or the answer timeout), carrying an accepted store
        through; the outcome: ``served`` if any request was answered, else ``refused`` (an
        ERROR), ``handshake_only``, ``closed`` or ``no_answer``."""
        received = bytearray()
        deadline = time.monotonic() + self.settings.answer_timeout_s
        timed_out = carried = False
        while True:
            try:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                timed_out = True
                chunk = b""
            except OSError:
                chunk = b""
            if not chunk:
                break
            received += chunk
            frames = _split(received)[0]
            if store_hashes is not None and not carried:
                accepted = [_field(h, p, "accepted") for h, p in frames if h.kind is FrameKind.CONTROL]
                accepted = [a for a in accepted if a is not None]
                if accepted:
                    self._carry_store(sock, store_hashes, accepted[0])
                    carried = True
            if any(_ends_conversation(h, p) for h, p in frames):
                break
        frames, unparsed = _split(received)
        self.count("unparsed_bytes", unparsed)
        outcome = self._tally_frames(list(first or []) + frames, how)
        if outcome == "nothing":
            return "no_answer" if timed_out else "closed"
        return outcome

    def _carry_store(self, sock: socket.socket, hashes: list[bytes], accepted) -> None:
        """The daemon accepted the store: send it the attacker's bytes, then END."""
        out = bytearray()
        for sequence in accepted if isinstance(accepted, list) else ():
            if isinstance(sequence, int) and 0 <= sequence < len(hashes):
                out += block_header(1, NAMESPACE.digest, hashes[sequence], self.payload, sequence).pack() + self.payload
                self.count("planting_blocks_sent")
        end = encode_control({})
        out += control_header(FrameKind.END, 1, end).pack() + end
        with contextlib.suppress(OSError):
            sock.sendall(out)

    def _tally(self, data: bytes | bytearray, how: str) -> str:
        frames, unparsed = _split(data)
        self.count("unparsed_bytes", unparsed)
        return self._tally_frames(frames, how)

    def _tally_frames(self, frames: list[tuple[FrameHeader, bytes]], how: str) -> str:
        outcome = "nothing"
        for header, payload in frames:
            if header.kind is FrameKind.AUTH:
                self.count("handshake_replies")
                outcome = "handshake_only" if outcome == "nothing" else outcome
            elif header.kind is FrameKind.ERROR:
                try:
                    error = decode_control(header, payload)
                    name = str(error[0]) if isinstance(error, list) and error else "malformed"
                except (CorruptBlock, InvalidArgument):
                    name = "malformed"
                self.error_classes[name] = self.error_classes.get(name, 0) + 1
                outcome = "refused" if outcome != "served" else outcome
            else:
                outcome = "served"
                self.count("served_frames")
                self.count("served_bytes", len(payload))
                if header.kind is FrameKind.BLOCK:
                    self.count("served_block_bytes", len(payload))
                elif header.kind is FrameKind.CONTROL and _field(header, payload, "chains") is not None:
                    self.count("served_chain_list_bytes", len(payload))
                elif header.kind is FrameKind.CONTROL and _field(header, payload, "accepted"):
                    self.count("stores_accepted")
                elif header.kind is FrameKind.END and isinstance(_field(header, payload, "stored"), int):
                    self.count("planted_blocks_stored_reported", _field(header, payload, "stored"))
                if len(self.served) < 20:
                    self.served.append({"how": how, "frame": header.kind.name, "bytes": len(payload), "t": round(time.time(), 3)})
        return outcome

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        settings = self.settings
        deadline = time.monotonic() + settings.seconds
        stop = Path(settings.stop_path)
        kinds = ATTACK_KINDS[:-1]
        next_flood = time.monotonic() + 1.0
        next_report = 0.0
        attempts = 0
        while attempts < settings.max_attempts and time.monotonic() < deadline and not stop.exists():
            target = self.rng.choice(settings.targets)
            if time.monotonic() >= next_flood:
                kind = "flood"
                next_flood = time.monotonic() + settings.flood_interval_s
            else:
                kind = self.rng.choices(kinds, ATTACK_WEIGHTS)[0]
            self.attempt(kind, target)
            attempts += 1
            self.tend_silent()
            if time.monotonic() >= next_report:
                self.report()
                next_report = time.monotonic() + 0.5
            time.sleep(settings.pause_s)
        for silent in self.silent:
            if self._closed_by_daemon(silent.sock):
                self.count("silent_closed_by_daemon")
            silent.sock.close()
        self.silent = []
        self.report(done=True)


def _proof(key: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    """A daemon's proof as transport/auth.py derives it, from a key the fleet does not use."""
    role_key = hmac.new(key, b"kvstore role daemon", hashlib.sha256).digest()
    return hmac.new(role_key, b"client" + nonce_c + nonce_s, hashlib.sha256).digest()


def _field(header: FrameHeader, payload: bytes, name: str):
    try:
        message = decode_control(header, payload)
    except (CorruptBlock, InvalidArgument):
        return None
    return message.get(name) if isinstance(message, dict) else None


def _ends_conversation(header: FrameHeader, payload: bytes) -> bool:
    """A refusal, the END of a fetch or store, or a hot-chain list: nothing more is coming."""
    if header.kind in (FrameKind.ERROR, FrameKind.END):
        return len(payload) == header.length
    return header.kind is FrameKind.CONTROL and _field(header, payload, "chains") is not None


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _split(data: bytes | bytearray) -> tuple[list[tuple[FrameHeader, bytes]], int]:
    """The frames in ``data`` (the last one possibly cut short: a daemon that began to serve
    a block and was stopped still served its first bytes) and how many bytes after them are
    no frame at all."""
    frames, offset = [], 0
    while offset + HEADER_BYTES <= len(data):
        try:
            header = FrameHeader.unpack(bytes(data[offset : offset + HEADER_BYTES]))
        except CorruptBlock:
            break
        end = min(len(data), offset + HEADER_BYTES + header.length)
        frames.append((header, bytes(data[offset + HEADER_BYTES : end])))
        offset = end
    return frames, len(data) - offset


def main() -> None:
    Attacker(AttackerSettings(**json.loads(sys.argv[1]))).run()


if __name__ == "__main__":
    main()
