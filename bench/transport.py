"""Transport throughput and overlap against same-run raw baselines.

    python -m bench.transport [--quick] [--json]

The sender is another process (bench/transport_sender.py), as peer daemons are; this
process receives. For each block size (256 KiB, 1 MiB, 4 MiB), 64 MiB (32 with --quick):
- kvstore over TCP and over UCX: each block one frame (header + payload), its checksum
  computed by the sender in the timed loop and verified here, the payload received
  straight into its slice of a preallocated destination buffer, as the daemon receives
  (`transport.peer.Landing`: receives posted ahead, each block verified as it lands);
- raw baselines, same bytes, same processes, taking turns with kvstore's runs: a blocking
  socket ``sendall`` of everything against ``recv_into`` (the receiver woken per MiB by
  SO_RCVLOWAT, as kvstore's is), and the same
  frames and checksums as kvstore's over blocking sockets, each frame's header and
  payload sent in one ``sendmsg`` as kvstore gathers them (what framing costs without an
  event loop); ucxx tagged send/recv of everything as one message, and of the bare blocks
  (no headers, no checksums) with the window of receives posted ahead that kvstore
  uses: the most any one-message-per-block scheme gets through ucxx. Target for each:
  kvstore ≥ 0.8×. UCX runs in the progress mode the daemon uses (its config's default,
  unless UCXPY_PROGRESS_MODE says otherwise).
Overlap efficiency: the blocks received while a layer's compute consumes each block as it
lands (sized to take as long as the transfer) — total time ÷ max(transfer alone, compute
alone); target ≤ 1.15 for a GPU layer, launched on the GPU as blocks land (only where
there is one). Without a GPU the figure is *modelled* (``overlap_<kind>_modelled``, no
target): the layer runs on the schedule a GPU stream would give it over the measured
arrival times (see `Consumer`), so it can only show how late blocks arrive, not whether a
device keeps up. A consumer burning a host core is reported beside it. Idle cost: the cores the receiving process uses while its
channel is open and idle; target ≤ 0.05.

What peer authentication costs (transport/auth.py), over TCP, its links taking the same
turns as the TCP links above, with the same block sizes and window:
- MAC: the channel with a fleet secret (every frame's MAC, an AES-256-GCM tag, taken by the
  sender and checked by the receiver, beside the checksum) against the same channel
  unprotected (``mac_vs_plain_<size>``, target ≥ 0.7);
- TLS: the channel over mutual TLS 1.3 against a raw TLS socket pair moving the same
  bytes (``tls_vs_raw_tls_<size>``, target ≥ 0.8). The raw pair uses the contexts the
  channel does (``transport.auth.tls_context`` over the same files: the same version and
  cipher, printed) and does everything the channel does that is not its protocol: each
  block behind kvstore's 96-byte header, whose XXH3-64 the sender takes in the loop and
  the receiver verifies, as the channel's receiver does (TLS already guards the bytes on
  the wire, but the channel checks the checksum its writer committed, end to end); the
  sender ``sendall``s the header, then the payload (an SSL socket does not gather); the
  receiver ``recv_into``s each into its slot of the preallocated destination, woken as
  kvstore's receiver is (SO_RCVLOWAT), less one TLS record (see `RawTlsLink`). Its one
  ``sendall`` of everything is shown beside;
- the handshake: what it adds before a new connection's first answer, against one
  control round trip (a 64-byte CONTROL frame and its echo) on an established channel of
  the same mode. It is the time to connect and get the first answer, ``connect()`` and a
  first round trip on the channel, less the same over a raw socket to a raw echo server
  in the same process as kvstore's (the address lookup, the TCP connect, with TLS the TLS
  handshake with the same contexts, then a round trip of the same size): the raw side too
  waits for its server to accept and, with TLS, to finish its side of the TLS handshake.
  Samples taken in turns, twice: on loopback (``handshake_<mode>_vs_round_trip_loopback``,
  no target: a round trip there is ~100 µs of the two ends' CPU, and so is what the
  handshake adds), and through a proxy that holds every byte 2 ms each way, as a network
  would (``handshake_<mode>_round_trips``: the medians' ratio counts the round trips the
  handshake adds; target ≤ 1.5, at most one and its CPU);
- CPU per GB moved, the sender's and the receiver's together (exact, from schedstat):
  unlike throughput, it does not move with what else the machine runs.
The targeted ratios are those of the round with the median ratio (both figures measured
in that round), as the best runs of two links may come from different moments of a busy
machine; the ratios of the best runs (``…_best``) and the range round by round beside.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import json
import secrets
import select
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.report import Report, gbps, parse_args, timed
from bench.transport_sender import recv_exactly, send_all, tls_handshake
from kvstore.errors import CorruptBlock, TransportUnavailable
from kvstore.transport.auth import tls_context
from kvstore.transport.base import split_address
from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.peer import Landing
from kvstore.transport.tcp import WAKE_BYTES, tune
from kvstore.transport.ucx import UcxPoster, import_ucxx
from kvstore.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, control_header, encode_control

KiB, MiB = 1024, 1024 * 1024
BLOCK_SIZES = (256 * KiB, MiB, 4 * MiB)
OVERLAP_BLOCK_BYTES = MiB
# the layer compute the target applies to (a GPU's, or its schedule), then a host core's
OVERLAP_COMPUTE = ("gpu" if torch.cuda.is_available() else "timeline", "cpu")
OVERLAP_REPEATS = 9  # a run takes tens of milliseconds: best-of-3 would leave mostly noise
IDLE_SECONDS = 2.0
RAW_WAIT_S = 60.0  # the raw receiver gives up after this long without a byte
WINDOW = TransportConfig().window_blocks
ROOT = Path(__file__).resolve().parent.parent
ROUND_TRIP_BYTES = 64  # the control round trip a handshake is set against
HANDSHAKE_DELAY_S = 0.002  # each way, through the proxy that counts the handshake's round trips
TLS_RECORD_BYTES = 5 + (1 << 14) + 256  # the most ciphertext of one TLS 1.3 record: header, content, expansion
SECURITY_MODES = ("plain", "mac", "tls")
# (ratio, the link measured, its baseline, target)
SECURE_RATIOS = (("mac_vs_plain", "kvstore_tcp_mac", "kvstore_tcp", ">= 0.7"), ("tls_vs_raw_tls", "kvstore_tcp_tls", "raw_tls", ">= 0.8"))


def fleet_credentials(directory: Path) -> dict[str, dict[str, str]]:
    """The `TransportConfig` fields of each way peers authenticate, their files written
    into ``directory``: ``plain`` (nothing), ``mac`` (a fleet secret; no TLS, so every
    frame carries a MAC) and ``tls`` (mutual TLS with certificates of a test CA)."""
    import trustme  # the dev extra's test CA

    def private(path: Path) -> str:
        path.chmod(0o600)
        return str(path)

    secret = directory / "peer-secret"
    secret.write_text(secrets.token_hex(32))
    authority = trustme.CA()
    issued = authority.issue_cert("127.0.0.1", "localhost")
    issued.cert_chain_pems[0].write_to_path(str(directory / "node.pem"))
    issued.private_key_pem.write_to_path(str(directory / "node.key"))
    authority.cert_pem.write_to_path(str(directory / "ca.pem"))
    return {
        "plain": {},
        "mac": {"peer_secret_file": private(secret)},
        "tls": {"tls_cert": str(directory / "node.pem"), "tls_key": private(directory / "node.key"), "tls_ca": str(directory / "ca.pem")},
    }


# -- links: one sender process each, run(block_bytes) -> seconds ---------------------
class FramedLink:
    """kvstore's transport: frames with checksums, each payload received into its slice."""

    def __init__(self, kind: str, destination: memoryview, security: dict[str, str] | None = None) -> None:
        self.kind, self.destination, self.security = kind, destination, security or {}

    async def __aenter__(self) -> FramedLink:
        self.transport = open_transport(TransportConfig(kind=self.kind, window_blocks=WINDOW, **self.security))
        accepted: asyncio.Queue = asyncio.Queue()
        self.finished = asyncio.Event()

        async def on_channel(channel):
            await accepted.put(channel)
            await self.finished.wait()

        address = await self.transport.listen("127.0.0.1", 0, on_channel)
        self.sender = start_sender(f"kvstore-{self.kind}", address, len(self.destination), self.security)
        self.channel = await asyncio.wait_for(accepted.get(), 60)
        return self

    async def run(self, block_bytes: int, consumer: Consumer | None = None) -> float:
        """Receive as the daemon does (`Landing`: receives posted ahead, checksums verified
        as payloads land), handing each verified block to ``consumer``; the seconds until
        the last block was received (and consumed)."""
        start = time.perf_counter()
        await self.channel.send(*request(block_bytes))

        def landed(header: FrameHeader, ok: bool) -> None:
            if not ok:
                raise CorruptBlock(f"block #{header.sequence} failed its checksum")
            if consumer is not None:
                offset = header.sequence * block_bytes
                consumer.arrived(self.destination[offset : offset + block_bytes])

        landing, offset = Landing(self.channel, WINDOW, landed), 0
        while offset < len(self.destination):
            header = await self.channel.recv_header()
            await landing.start(header, self.destination[offset : offset + header.length])
            offset += header.length
        await landing.finish()
        if consumer is not None:
            return await consumer.finished() - start
        return time.perf_counter() - start

    async def __aexit__(self, *exc_info) -> None:
        with contextlib.suppress(Exception):
            await self.channel.send(*request(0))
        stop_sender(self.sender)
        self.finished.set()
        await self.transport.close()


class RawSocketLink:
    """Blocking sockets, no event loop: everything as one ``sendall`` against ``recv_into``
    (a block size equal to everything), or the same frames and checksums as kvstore's. The
    receiver is woken as kvstore's is (SO_RCVLOWAT: per ``WAKE_BYTES``, or what is left of
    the receive if less; one ``recv_into`` per wake), which also lets the kernel grow its
    receive buffer: woken per segment, the same sendall ran at about half the speed on
    loopback here (1.3–2.4 GB/s against 2.6–3.8), a baseline kvstore's own receiver beat."""

    def __init__(self, destination: memoryview) -> None:
        self.destination = destination
        self.wake_bytes = 1  # the socket's SO_RCVLOWAT

    async def __aenter__(self) -> RawSocketLink:
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(60)
            self.sender = start_sender("raw-tcp", f"tcp://127.0.0.1:{server.getsockname()[1]}", len(self.destination))
            self.conn, _ = server.accept()
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    async def run(self, block_bytes: int) -> float:
        start = time.perf_counter()
        self.conn.sendall(block_bytes.to_bytes(8, "little"))
        if block_bytes == len(self.destination):
            self.recv_exactly(self.destination)
            return time.perf_counter() - start
        header_buffer, offset = bytearray(HEADER_BYTES), 0
        while offset < len(self.destination):
            self.recv_exactly(memoryview(header_buffer))
            header = FrameHeader.unpack(header_buffer)
            slot = self.destination[offset : offset + header.length]
            self.recv_exactly(slot)
            header.verify(slot)
            offset += header.length
        return time.perf_counter() - start

    def recv_exactly(self, view: memoryview) -> None:
        """Take what is there; when nothing is, sleep until ``WAKE_BYTES`` (or what is left)
        have come, as kvstore's receiver does. A blocking receive with SO_RCVLOWAT set would
        hang: once part of its bytes are in, it still waits for the whole threshold, more
        than the rest still to come."""
        got = 0
        while got < len(view):
            count = self.recv_some(view[got:])
            if count is None:
                wake_bytes = self.wake_threshold(min(len(view) - got, WAKE_BYTES))
                if wake_bytes != self.wake_bytes:
                    self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wake_bytes)
                    self.wake_bytes = wake_bytes
                if not select.select([self.conn], [], [], RAW_WAIT_S)[0]:
                    raise TimeoutError(f"the raw sender sent nothing for {RAW_WAIT_S:.0f} s")
                continue
            if not count:
                raise ConnectionError("the raw sender closed the connection")
            got += count

    def wake_threshold(self, nbytes: int) -> int:
        """How many bytes to be woken at, for ``nbytes`` still to receive."""
        return nbytes

    def recv_some(self, view: memoryview) -> int | None:
        """One receive into ``view``: how many bytes came (0: the sender closed), None when
        nothing was there."""
        try:
            return self.conn.recv_into(view, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None

    async def __aexit__(self, *exc_info) -> None:
        with contextlib.suppress(OSError):
            self.conn.sendall(bytes(8))
        stop_sender(self.sender)
        self.conn.close()


class RawTlsLink(RawSocketLink):
    """`RawSocketLink` through TLS: a Python ``ssl`` socket pair with the contexts kvstore's
    channel makes from the same files (``tls_context``), the sender's blocking ``sendall``
    of each header and then its payload, this side's non-blocking ``recv_into`` (one read
    per TLS record: an SSL socket does not scatter) woken as kvstore's TLS channel is, less
    one record: OpenSSL may already hold part of the record the rest of the bytes finish,
    and a wait for all of them stalled here when the last record arrived in parts."""

    def __init__(self, destination: memoryview, security: dict[str, str]) -> None:
        super().__init__(destination)
        self.security = security
        self.context = tls_context(security["tls_cert"], security["tls_key"], security["tls_ca"], server_side=True)

    async def __aenter__(self) -> RawTlsLink:
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(60)
            self.sender = start_sender("raw-tls", f"tcp://127.0.0.1:{server.getsockname()[1]}", len(self.destination), self.security)
            conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(60)
        self.conn = self.context.wrap_socket(conn, server_side=True)
        self.conn.setblocking(False)
        self.cipher = self.conn.cipher()  # (name, protocol, bits)
        return self

    def wake_threshold(self, nbytes: int) -> int:
        return max(1, nbytes - TLS_RECORD_BYTES)

    def recv_some(self, view: memoryview) -> int | None:
        try:
            return self.conn.recv_into(view)
        except ssl.SSLWantReadError:
            return None
        except ssl.SSLZeroReturnError:
            return 0


class RawUcxLink:
    """ucxx tagged messages of the bare blocks (one message when the block is everything),
    posted straight on the endpoint in the progress mode kvstore runs (`UcxPoster`): ucxx's
    ``Endpoint.recv`` would add a task per message, and outside ucxx's thread mode an
    await that polls the event loop."""

    def __init__(self, destination: memoryview) -> None:
        self.destination = destination

    async def __aenter__(self) -> RawUcxLink:
        ucxx = import_ucxx(TransportConfig(kind="ucx"))
        accepted: asyncio.Queue = asyncio.Queue()

        async def on_endpoint(endpoint):  # the endpoint lives on in self.endpoint
            await accepted.put(endpoint)

        self.listener = ucxx.create_listener(on_endpoint, 0)
        self.sender = start_sender("raw-ucx", f"ucx://127.0.0.1:{self.listener.port}", len(self.destination))
        self.endpoint = await asyncio.wait_for(accepted.get(), 60)
        self.poster = UcxPoster(self.endpoint)
        return self

    async def run(self, block_bytes: int) -> float:
        """The receives of the next WINDOW blocks posted ahead, as kvstore's Landing does."""
        start = time.perf_counter()
        await self.poster.post(block_bytes.to_bytes(8, "little"))
        posted: collections.deque = collections.deque()
        for offset in range(0, len(self.destination), block_bytes):
            posted.append(self.poster.post(self.destination[offset : offset + block_bytes], receive=True))
            if len(posted) > WINDOW:
                await posted.popleft()
        await asyncio.gather(*posted)
        return time.perf_counter() - start

    async def __aexit__(self, *exc_info) -> None:
        with contextlib.suppress(Exception):
            await self.poster.post(bytes(8))
        stop_sender(self.sender)
        await self.endpoint.close()
        self.listener.close()


def start_sender(mode: str, address: str, total_bytes: int, security: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "bench.transport_sender", mode, address, str(total_bytes), str(WINDOW), json.dumps(security or {})]
    return subprocess.Popen(command, cwd=ROOT)


def stop_sender(process: subprocess.Popen) -> None:
    try:
        process.wait(timeout=30)
    finally:
        process.kill()
        process.wait()


def request(block_bytes: int) -> tuple:
    payload = encode_control({"block_bytes": block_bytes})
    return control_header(FrameKind.CONTROL, 1, payload), payload


# -- overlap ---------------------------------------------------------------------------
class Consumer:
    """A layer's compute over each block as it arrives, sized so that computing every
    block takes about as long as receiving them (``seconds_per_block``).

    - ``gpu``: where there is a GPU, each block is copied to it and passed over there,
      launched on a CUDA stream as it arrives (the host does not wait);
    - ``timeline``: where there is none, the same schedule without the device: the layer
      for block i starts when block i has arrived and the previous layer has finished,
      and takes ``seconds_per_block``, as a GPU stream would run it. Arrivals are
      measured; only the device's time is modelled;
    - ``cpu``: passes over the bytes on one host thread (torch releases the GIL), which
      competes for the cores that the sender and the receiver use.
    """

    def __init__(self, kind: str, seconds_per_block: float, sample: memoryview) -> None:
        self.kind, self.seconds = kind, seconds_per_block
        self.passes = 1
        if kind != "timeline":
            self.passes = 10
            per_pass = min(timed(lambda: self.compute_synced(sample)) for _ in range(7)) / 10
            self.passes = max(1, round(seconds_per_block / per_pass))
        self.pool = concurrent.futures.ThreadPoolExecutor(1) if kind == "cpu" else None
        self.reset()

    def reset(self) -> None:
        self.end = 0.0  # timeline: when the modelled device finishes
        self.pending: list[asyncio.Future] = []

    def compute(self, block: memoryview) -> None:
        values = torch.frombuffer(block, dtype=torch.uint8).to("cuda" if self.kind == "gpu" else "cpu", non_blocking=True)
        for _ in range(self.passes):
            values.sum(dtype=torch.int32)

    def compute_synced(self, block: memoryview) -> None:
        """``compute``, returning once the GPU has finished it too."""
        self.compute(block)
        if self.kind == "gpu":
            torch.cuda.synchronize()

    def arrived(self, block: memoryview) -> None:
        if self.kind == "timeline":
            self.end = max(self.end, time.perf_counter()) + self.seconds
        elif self.kind == "gpu":
            self.compute(block)  # launched on the stream; the host goes on receiving
        else:
            self.pending.append(asyncio.get_running_loop().run_in_executor(self.pool, self.compute, block))

    async def finished(self) -> float:
        """When the last block's layer finished."""
        if self.kind == "timeline":
            return self.end
        if self.kind == "gpu":
            torch.cuda.synchronize()
        await asyncio.gather(*self.pending)
        return time.perf_counter()

    def alone(self, blocks: list[memoryview]) -> float:
        """Every block computed back to back, cache-warm, as a consumer sees it."""
        if self.kind == "timeline":
            return self.seconds * len(blocks)
        total = 0.0
        for block in blocks:
            self.compute_synced(block)  # warm, as a block that has just arrived
            total += timed(functools.partial(self.compute_synced, block))
        return total

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


async def bench_overlap(link: FramedLink, kind: str, repeats: int) -> dict:
    blocks = [link.destination[offset : offset + OVERLAP_BLOCK_BYTES] for offset in range(0, len(link.destination), OVERLAP_BLOCK_BYTES)]
    transfer = min([await link.run(OVERLAP_BLOCK_BYTES) for _ in range(repeats)])
    consumer = Consumer(kind, transfer / len(blocks), blocks[0])
    together, alone = [], []
    try:
        for _ in range(repeats):  # interleaved, so that all three see the same machine
            alone.append(consumer.alone(blocks))
            consumer.reset()
            together.append(await link.run(OVERLAP_BLOCK_BYTES, consumer))
            transfer = min(transfer, await link.run(OVERLAP_BLOCK_BYTES))
    finally:
        consumer.close()
    return {
        "transfer_s": transfer,
        "compute_s": min(alone),
        "together_s": min(together),
        "efficiency": min(together) / max(transfer, min(alone)),
        "compute": kind,
        "passes_per_block": consumer.passes,
    }


async def bench_links(total_bytes: int, has_ucx: bool, repeats: int, credentials: dict[str, dict[str, str]]) -> tuple[dict, dict]:
    """Best seconds per (link, block size), and every round's seconds and CPU seconds
    (``"cpu", link, block size``: the sender's and this receiving process's). TCP runs first,
    before UCX starts in this process (ucxx's blocking progress keeps the event loop busy,
    which would slow every other measurement); within a family the links take turns, so
    that each sees the same machine (other work on it shifts every figure alike). The TCP
    family has the secured channels and the raw TLS socket too."""
    destination = memoryview(bytearray(total_bytes))
    families = [("tcp", RawSocketLink(destination))] + ([("ucx", RawUcxLink(destination))] if has_ucx else [])
    best: dict = {}
    rounds: dict = collections.defaultdict(list)
    for kind, raw_link in families:
        async with contextlib.AsyncExitStack() as stack:
            # the framed link closes last: closing the last kvstore UCX transport resets ucxx
            framed = await stack.enter_async_context(FramedLink(kind, destination))
            links = {f"raw_{kind}": await stack.enter_async_context(raw_link), f"kvstore_{kind}": framed}
            if kind == "tcp":
                links["kvstore_tcp_mac"] = await stack.enter_async_context(FramedLink("tcp", destination, credentials["mac"]))
                links["raw_tls"] = await stack.enter_async_context(RawTlsLink(destination, credentials["tls"]))
                links["kvstore_tcp_tls"] = await stack.enter_async_context(FramedLink("tcp", destination, credentials["tls"]))
                best["tls_cipher"] = links["raw_tls"].cipher
            for _ in range(repeats):
                for block_bytes in (total_bytes, *BLOCK_SIZES):  # total_bytes: the raw link's one message
                    for name, link in links.items():
                        if block_bytes < total_bytes or name.startswith("raw"):
                            cpu_before = time.process_time() + cpu_seconds(link.sender.pid)
                            seconds = await link.run(block_bytes)
                            rounds["cpu", name, block_bytes].append(time.process_time() + cpu_seconds(link.sender.pid) - cpu_before)
                            rounds[name, block_bytes].append(seconds)
                            best[name, block_bytes] = min(seconds, best.get((name, block_bytes), seconds))
            for compute in OVERLAP_COMPUTE:
                best["overlap", kind, compute] = await bench_overlap(framed, compute, max(repeats, OVERLAP_REPEATS))
            best["idle_cpu", kind] = await idle_cpu(IDLE_SECONDS)
    return best, rounds


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used, all its threads (Linux schedstat: ns, exact)."""
    return sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9


# -- the handshake ---------------------------------------------------------------------
@contextlib.contextmanager
def echo_servers(security: dict[str, str]) -> Iterator[tuple[str, str]]:
    """The addresses of a kvstore TCP transport that echoes control frames and of a raw
    socket server (TLS where ``security`` has it) that echoes messages of a control frame's
    size, both in another process (bench/transport_sender.py)."""
    message_bytes = HEADER_BYTES + ROUND_TRIP_BYTES
    command = [
        sys.executable,
        "-m",
        "bench.transport_sender",
        "echo-tcp",
        "127.0.0.1",
        str(message_bytes),
        str(WINDOW),
        json.dumps(security),
    ]
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        kvstore_address, raw_address = process.stdout.readline().split()
        yield kvstore_address, raw_address
    finally:
        process.stdin.close()
        stop_sender(process)


async def bench_handshakes(
    credentials: dict[str, dict[str, str]], samples: int, delay_s: float = 0.0
) -> dict[tuple[str, str], dict[str, float]]:
    """The best and the median µs per security mode (``(mode, "best" or "median")``) of
    samples taken in turns against servers in another process:
    - ``bare_connect``: what ``connect()`` does besides kvstore's handshake (the address
      lookup, the TCP connect, the TLS handshake where there is TLS);
    - ``connect``: ``connect()``, which returns an authenticated channel;
    - ``raw_first_reply``: a bare connect to a raw echo server and the first round trip of
      a control frame's size on it (which waits for the server to accept, and, with TLS,
      to finish its side of the TLS handshake: the server checks the client's certificate
      after the client's side is done);
    - ``first_reply``: ``connect()`` and the first control round trip on that channel;
    - ``round_trip``: a control round trip on an established channel.
    ``handshake`` = first_reply − raw_first_reply: what kvstore's handshake adds before a
    new connection's first answer. With ``delay_s``, every byte reaches the servers and
    comes back through a proxy that holds it ``delay_s`` each way (a network's latency):
    the handshake's CPU then hardly counts beside the round trips it waits for."""
    result = {}
    for mode in SECURITY_MODES:
        security = credentials[mode]
        with echo_servers(security) as (address, raw_address):
            if delay_s:
                address, raw_address = await delaying_proxy(address, delay_s), await delaying_proxy(raw_address, delay_s)
            transport = open_transport(TransportConfig(kind="tcp", **security))
            tls = transport.auth.client_tls
            try:
                channel = await transport.connect(address)
                timings: dict[str, list[float]] = collections.defaultdict(list)
                for _ in range(samples):
                    timings["bare_connect"].append((await bare_connect(raw_address, tls, round_trips=0))[0])
                    timings["raw_first_reply"].append(sum(await bare_connect(raw_address, tls, round_trips=1)))
                    timings["connect"].append((await kvstore_connect(transport, address, round_trips=0))[0])
                    timings["first_reply"].append(sum(await kvstore_connect(transport, address, round_trips=1)))
                    timings["round_trip"].append(await round_trip(channel))
            finally:
                await transport.close()
        for statistic, of in (("best", min), ("median", statistics.median)):
            figures = {f"{name}_us": of(seconds) * 1e6 for name, seconds in timings.items()}
            result[mode, statistic] = {**figures, "handshake_us": figures["first_reply_us"] - figures["raw_first_reply_us"]}
    return result


async def delaying_proxy(address: str, delay_s: float) -> str:
    """The address of a proxy (on this loop, for the rest of its life) that forwards each
    chunk either way ``delay_s`` after it came, in order."""
    host, port = split_address(address, "tcp")

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(1 << 16):
                loop.call_later(delay_s, writer.write, chunk)  # equal delays: the order is kept
        loop.call_later(delay_s, writer.close)

    async def on_client(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(host, port)
        with contextlib.suppress(asyncio.CancelledError):  # the bench's loop ending with connections open
            await asyncio.gather(pump(client_reader, server_writer), pump(server_reader, client_writer))

    proxy = await asyncio.start_server(on_client, "127.0.0.1", 0)
    return f"tcp://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"


async def bare_connect(address: str, tls: ssl.SSLContext | None, round_trips: int) -> list[float]:
    """Seconds of what ``TcpTransport.connect`` does besides kvstore's handshake (the
    address lookup, a tuned socket's connect, with ``tls`` the TLS handshake; under the
    same timeouts), then of each of ``round_trips`` round trips of a control frame's size."""
    loop = asyncio.get_running_loop()
    host, port = split_address(address, "tcp")
    start = time.perf_counter()
    family, _, _, _, sockaddr = (await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), 5))[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        tune(sock)
        await asyncio.wait_for(loop.sock_connect(sock, sockaddr), 5)
        if tls is not None:
            sock = tls.wrap_socket(sock, do_handshake_on_connect=False, server_hostname=host)
            await tls_handshake(sock)
        seconds = [time.perf_counter() - start]
        message = memoryview(bytearray(HEADER_BYTES + ROUND_TRIP_BYTES))
        for _ in range(round_trips):
            start = time.perf_counter()
            await send_all(sock, message)
            await recv_exactly(sock, message)
            seconds.append(time.perf_counter() - start)
        return seconds
    finally:
        sock.close()


async def kvstore_connect(transport, address: str, round_trips: int) -> list[float]:
    """Seconds of ``connect()``, then of each of ``round_trips`` control round trips."""
    start = time.perf_counter()
    channel = await transport.connect(address)
    seconds = [time.perf_counter() - start]
    try:
        for _ in range(round_trips):
            seconds.append(await round_trip(channel))
    finally:
        await channel.close()
    return seconds


async def round_trip(channel) -> float:
    payload = bytes(ROUND_TRIP_BYTES)
    start = time.perf_counter()
    await channel.send(control_header(FrameKind.CONTROL, 1, payload), payload)
    reply = await channel.recv_header()
    await channel.recv_bytes(reply)
    return time.perf_counter() - start


async def idle_cpu(seconds: float) -> float:
    """Cores this process uses while its channel is open and nothing moves."""
    start_cpu, start = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (time.process_time() - start_cpu) / (time.perf_counter() - start)


# -- report ----------------------------------------------------------------------------
def label_of(block_bytes: int) -> str:
    return f"{block_bytes // KiB}KiB" if block_bytes < MiB else f"{block_bytes // MiB}MiB"


def secure_table(report: Report, total: int, repeats: int, best: dict, rounds: dict) -> None:
    """The MAC'd channel against the plain one, the TLS channel against the raw TLS socket."""
    rows = []
    for block_bytes in BLOCK_SIZES:
        label = label_of(block_bytes)
        row = {"secure_block_bytes": block_bytes}
        for name in ("kvstore_tcp", "kvstore_tcp_mac", "raw_tls", "kvstore_tcp_tls"):
            row[name] = gbps(total, best[name, block_bytes])
        row["raw_tls_1buf"] = gbps(total, best["raw_tls", total])
        spreads = {}
        for ratio, measured, baseline, target in SECURE_RATIOS:
            # seconds of the baseline over the link's, round by round: its throughput ratio
            per_round = [b / m for m, b in zip(rounds[measured, block_bytes], rounds[baseline, block_bytes])]
            spreads[ratio] = per_round
            row[f"{ratio}_rounds"] = per_round
            measured_s, baseline_s = median_round(rounds[measured, block_bytes], rounds[baseline, block_bytes])
            report.compare(f"{ratio}_{label}", gbps(total, measured_s), gbps(total, baseline_s), "GB/s", target)
            report.compare(f"{ratio}_{label}_best", row[measured], row[baseline], "GB/s")
        report.results.append(row)
        rows.append(
            [
                label,
                row["kvstore_tcp"],
                row["kvstore_tcp_mac"],
                spread(spreads["mac_vs_plain"]),
                row["raw_tls_1buf"],
                row["raw_tls"],
                row["kvstore_tcp_tls"],
                spread(spreads["tls_vs_raw_tls"]),
            ]
        )
    name, protocol, bits = best["tls_cipher"]
    report.print_table(
        f"peer authentication over TCP (GB/s, best of {repeats}, {total // MiB} MiB from a sender process, in turns with the links above; "
        f"MAC: a fleet secret, every frame's MAC (AES-256-GCM tag) taken and checked; TLS: {protocol} {name} ({bits}-bit), mutual; "
        "raw tls framed: the same blocks behind kvstore's header, XXH3 checked, over a Python ssl socket pair; "
        "ratios round by round: median [min, max])",
        ["block", "kv plain", "kv MAC", "MAC/plain", "raw tls 1 buf", "raw tls framed", "kv TLS", "TLS/raw tls"],
        rows,
    )
    # CPU time does not depend on how busy the rest of the machine is, as throughput does
    cpu_links = ("raw_tcp", "kvstore_tcp", "kvstore_tcp_mac", "raw_tls", "kvstore_tcp_tls")
    cpu_rows = []
    for block_bytes in BLOCK_SIZES:
        label = label_of(block_bytes)
        ms_per_gb = {name: statistics.median(rounds["cpu", name, block_bytes]) / total * 1e12 for name in cpu_links}
        report.results.append({"cpu_ms_per_gb": ms_per_gb, "block_bytes": block_bytes})
        report.compare(f"mac_cpu_vs_plain_{label}", ms_per_gb["kvstore_tcp_mac"], ms_per_gb["kvstore_tcp"], "CPU ms/GB")
        report.compare(f"tls_cpu_vs_raw_tls_{label}", ms_per_gb["kvstore_tcp_tls"], ms_per_gb["raw_tls"], "CPU ms/GB")
        cpu_rows.append([label] + [ms_per_gb[name] for name in cpu_links])
    report.print_table(
        "CPU per GB moved (ms, the sender's and the receiver's together, median of the rounds above)",
        ["block", "raw tcp framed", "kv plain", "kv MAC", "raw tls framed", "kv TLS"],
        cpu_rows,
    )


def handshake_table(report: Report, handshakes: dict[tuple[str, str], dict[str, float]], samples: int, delay_s: float = 0.0) -> None:
    """The handshake against a round trip. On loopback (no ``delay_s``) a round trip is
    ~100 µs of the two ends' CPU, and so is what the handshake adds: reported, no target.
    Through the delaying proxy the round trips dominate, and the ratio of the medians says
    how many round trips the handshake adds before a new connection's first answer (the
    target: at most one; ≤ 1.5 leaves room for its CPU)."""
    rows = []
    for (mode, statistic), figures in handshakes.items():
        report.results.append({"handshake": mode, "statistic": statistic, "delay_s": delay_s, **figures})
        if delay_s:
            name = f"handshake_{mode}_round_trips" + ("" if statistic == "median" else "_best")
            target = "<= 1.5" if statistic == "median" else None
        else:
            name = f"handshake_{mode}_vs_round_trip_loopback" + ("" if statistic == "best" else "_median")
            target = None
        report.compare(name, figures["handshake_us"], figures["round_trip_us"], "µs", target)
        rows.append(
            [
                mode,
                statistic,
                figures["bare_connect_us"],
                figures["connect_us"],
                figures["raw_first_reply_us"],
                figures["first_reply_us"],
                figures["handshake_us"],
                figures["round_trip_us"],
                figures["handshake_us"] / figures["round_trip_us"],
            ]
        )
    latency = f"through a proxy that holds every byte {delay_s * 1e3:g} ms each way" if delay_s else "on loopback"
    report.print_table(
        f"connecting {latency} (µs, the best and the median of {samples} in turns, to servers in another process; "
        "bare: the address lookup, the TCP connect and, with TLS, the TLS handshake; connect(): that and kvstore's handshake; "
        "first reply: connecting and the first round trip of a control frame's size, to a raw echo server (raw) or on the channel; "
        "handshake: the difference of the first replies; round trip: on an established channel)",
        ["mode", "of samples", "bare", "connect()", "raw first reply", "first reply", "handshake", "round trip", "handshake/rt"],
        rows,
    )


def median_round(measured: list[float], baseline: list[float]) -> tuple[float, float]:
    """The seconds of a link and of its baseline in the round whose ratio (baseline ÷ link:
    the throughput ratio) is the median of the rounds. Both ran in that round, on the same
    machine; the best runs of each may come from different rounds, and on a machine whose
    other work comes and goes the shorter run is the likelier to fall in a quiet moment."""
    order = sorted(range(len(measured)), key=lambda index: baseline[index] / measured[index])
    middle = order[(len(order) - 1) // 2]
    return measured[middle], baseline[middle]


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    total, repeats, handshake_samples = (32 * MiB, 3, 100) if args.quick else (64 * MiB, 7, 500)
    torch.set_num_threads(1)  # the consumer is one thread, as a layer's host-side work would be
    report = Report("transport")
    try:
        import_ucxx(TransportConfig(kind="ucx"))  # the UCX defaults reach the senders' environment too
        has_ucx = True
    except TransportUnavailable as exc:
        print(f"UCX rows skipped: {exc}")
        has_ucx = False
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-transport-") as directory:
        credentials = fleet_credentials(Path(directory))
        best, rounds = asyncio.run(bench_links(total, has_ucx, repeats, credentials))
        handshakes = asyncio.run(bench_handshakes(credentials, handshake_samples))
        delayed = asyncio.run(bench_handshakes(credentials, handshake_samples // 10, HANDSHAKE_DELAY_S))

    # (column, link, block size or None for "this row's", ratio name of kvstore / it)
    measures = [
        ("raw socket 1 buf", "raw_tcp", total, "tcp_vs_raw_socket"),
        ("raw socket framed", "raw_tcp", None, "tcp_vs_blocking_framed"),
        ("kv tcp", "kvstore_tcp", None, ""),
    ]
    if has_ucx:
        measures += [
            ("raw ucx 1 msg", "raw_ucx", total, "ucx_vs_raw_ucx_1msg"),
            ("raw ucx blocks", "raw_ucx", None, "ucx_vs_raw_ucx_blocks"),
            ("kv ucx", "kvstore_ucx", None, ""),
        ]
    rows = []
    for block_bytes in BLOCK_SIZES:
        label = label_of(block_bytes)
        row = {"block_bytes": block_bytes}
        for column, link, size, _ in measures:
            row[column] = gbps(total, best[link, size or block_bytes])
        for column, link, _, ratio in measures:
            if ratio:
                kvstore = row["kv " + link.split("_")[1]]
                report.compare(f"{ratio}_{label}", kvstore, row[column], "GB/s", ">= 0.8")
        report.results.append(row)
        rows.append([label] + [row[column] for column, *_ in measures])
    report.print_table(
        f"throughput (GB/s, best of {repeats}, {total // MiB} MiB from a sender process; "
        "kv: kvstore framed, checksummed, received in place; "
        "raw framed / blocks: the same block sizes, with kvstore's headers and checksums over a blocking socket / bare over ucxx)",
        ["block"] + [column for column, *_ in measures],
        rows,
    )

    secure_table(report, total, repeats, best, rounds)
    handshake_table(report, handshakes, handshake_samples)
    handshake_table(report, delayed, handshake_samples // 10, HANDSHAKE_DELAY_S)

    overlap_rows = []
    for kind in ("tcp", "ucx") if has_ucx else ("tcp",):
        for compute in OVERLAP_COMPUTE:
            overlap = best["overlap", kind, compute]
            modelled = compute == "timeline"  # no device: the consumer's time is the model's, not a measurement
            report.results.append({"overlap": kind, **overlap, "modelled": modelled})
            slowest = max(overlap["transfer_s"], overlap["compute_s"])
            if compute == "gpu":
                report.compare(f"overlap_{kind}", overlap["together_s"], slowest, "s", "<= 1.15")
            else:  # modelled (no GPU), or a host-core consumer: reported, not targeted (see Consumer)
                report.compare(f"overlap_{kind}_{'modelled' if modelled else compute}", overlap["together_s"], slowest, "s")
            overlap_rows.append(
                [
                    kind,
                    compute + (" (modelled)" if modelled else ""),
                    overlap["transfer_s"],
                    overlap["compute_s"],
                    overlap["together_s"],
                    overlap["efficiency"],
                ]
            )
    report.print_table(
        f"overlap ({OVERLAP_BLOCK_BYTES // MiB} MiB blocks consumed by a compute thread as they arrive; "
        "efficiency = together / max(transfer, compute); compute: gpu = launched on the GPU as blocks land; "
        "timeline = a GPU stream's schedule over the measured arrivals (no GPU here); cpu = a host thread beside sender and receiver)",
        ["transport", "compute", "transfer s", "compute s", "together s", "efficiency"],
        overlap_rows,
    )
    idle_rows = []
    for kind in ("tcp", "ucx") if has_ucx else ("tcp",):
        cores = best["idle_cpu", kind]
        report.results.append({"idle_cpu": kind, "cores": cores})
        report.ratio(f"idle_cores_{kind}", cores, "<= 0.05")
        idle_rows.append([kind, cores])
    report.print_table(
        f"idle cost (cores the receiving process uses over {IDLE_SECONDS:g} s with its channel open and no traffic)",
        ["transport", "cores"],
        idle_rows,
    )
    report.emit(args.json)


if __name__ == "__main__":
    main()
