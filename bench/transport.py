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
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.report import Report, gbps, parse_args, timed
from kvstore.errors import CorruptBlock, TransportUnavailable
from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.peer import Landing
from kvstore.transport.tcp import WAKE_BYTES
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


# -- links: one sender process each, run(block_bytes) -> seconds ---------------------
class FramedLink:
    """kvstore's transport: frames with checksums, each payload received into its slice."""

    def __init__(self, kind: str, destination: memoryview) -> None:
        self.kind, self.destination = kind, destination

    async def __aenter__(self) -> FramedLink:
        self.transport = open_transport(TransportConfig(kind=self.kind, window_blocks=WINDOW))
        accepted: asyncio.Queue = asyncio.Queue()
        self.finished = asyncio.Event()

        async def on_channel(channel):
            await accepted.put(channel)
            await self.finished.wait()

        address = await self.transport.listen("127.0.0.1", 0, on_channel)
        self.sender = start_sender(f"kvstore-{self.kind}", address, len(self.destination))
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
            try:
                count = self.conn.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                wake_bytes = min(len(view) - got, WAKE_BYTES)
                if wake_bytes != self.wake_bytes:
                    self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wake_bytes)
                    self.wake_bytes = wake_bytes
                if not select.select([self.conn], [], [], RAW_WAIT_S)[0]:
                    raise TimeoutError(f"the raw-tcp sender sent nothing for {RAW_WAIT_S:.0f} s") from None
                continue
            if not count:
                raise ConnectionError("the raw-tcp sender closed the connection")
            got += count

    async def __aexit__(self, *exc_info) -> None:
        with contextlib.suppress(OSError):
            self.conn.sendall(bytes(8))
        stop_sender(self.sender)
        self.conn.close()


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


def start_sender(mode: str, address: str, total_bytes: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "bench.transport_sender", mode, address, str(total_bytes), str(WINDOW)]
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


async def bench_links(total_bytes: int, has_ucx: bool, repeats: int) -> dict:
    """Best seconds per (link, block size). TCP runs first, before UCX starts in this
    process (ucxx's blocking progress keeps the event loop busy, which would slow every
    other measurement); within a family the links take turns, so that each sees the same
    machine (other work on it shifts every figure alike)."""
    destination = memoryview(bytearray(total_bytes))
    families = [("tcp", RawSocketLink(destination))] + ([("ucx", RawUcxLink(destination))] if has_ucx else [])
    best: dict = {}
    for kind, raw_link in families:
        # the framed link closes last: closing the last kvstore UCX transport resets ucxx
        async with FramedLink(kind, destination) as framed, raw_link:
            links = {f"raw_{kind}": raw_link, f"kvstore_{kind}": framed}
            for _ in range(repeats):
                for block_bytes in (total_bytes, *BLOCK_SIZES):  # total_bytes: the raw link's one message
                    for name, link in links.items():
                        if block_bytes < total_bytes or name.startswith("raw"):
                            seconds = await link.run(block_bytes)
                            best[name, block_bytes] = min(seconds, best.get((name, block_bytes), seconds))
            for compute in OVERLAP_COMPUTE:
                best["overlap", kind, compute] = await bench_overlap(framed, compute, max(repeats, OVERLAP_REPEATS))
            best["idle_cpu", kind] = await idle_cpu(IDLE_SECONDS)
    return best


async def idle_cpu(seconds: float) -> float:
    """Cores this process uses while its channel is open and nothing moves."""
    start_cpu, start = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (time.process_time() - start_cpu) / (time.perf_counter() - start)


# -- report ----------------------------------------------------------------------------
def label_of(block_bytes: int) -> str:
    return f"{block_bytes // KiB}KiB" if block_bytes < MiB else f"{block_bytes // MiB}MiB"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    total, repeats = (32 * MiB, 3) if args.quick else (64 * MiB, 7)
    torch.set_num_threads(1)  # the consumer is one thread, as a layer's host-side work would be
    report = Report("transport")
    try:
        import_ucxx(TransportConfig(kind="ucx"))  # the UCX defaults reach the senders' environment too
        has_ucx = True
    except TransportUnavailable as exc:
        print(f"UCX rows skipped: {exc}")
        has_ucx = False
    best = asyncio.run(bench_links(total, has_ucx, repeats))

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
