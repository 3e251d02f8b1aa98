"""TCP and UCX transports over real endpoints on loopback: in this process, and against a
peer in another process (tests/transport_peer.py) that echoes frames or floods blocks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# before ucxx is first imported: keep UCX's network transports on loopback
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from peer_wire import open_raw

from kvstore.errors import CorruptBlock, InvalidArgument, TransferFailed, TransportUnavailable  # noqa: E402
from kvstore.transport.auth import ClientHandshake, PeerAuth
from kvstore.transport.config import TransportConfig  # noqa: E402
from kvstore.transport.factory import open_transport  # noqa: E402
from kvstore.transport.peer import Landing  # noqa: E402
from kvstore.transport.tcp import TcpTransport  # noqa: E402
from kvstore.transport.ucx import INLINE_BYTES, import_ucxx, pack_batch  # noqa: E402
from kvstore.transport.wire import (  # noqa: E402
    HEADER_BYTES,
    FrameKind,
    block_header,
    control_header,
    decode_control,
    encode_control,
)

PEER = Path(__file__).with_name("transport_peer.py")
NAMESPACE = bytes(range(16))
KiB = 1024


def skip_without_ucxx() -> None:
    try:
        import_ucxx(TransportConfig(kind="ucx"))
    except TransportUnavailable as exc:
        pytest.skip(f"ucxx does not import on this machine: {exc}")


@pytest.fixture(params=["tcp", "ucx"])
def kind(request) -> str:
    if request.param == "ucx":
        skip_without_ucxx()
    return request.param


@pytest.fixture
def ucx() -> str:
    skip_without_ucxx()
    return "ucx"


def run(coroutine, timeout_s: float = 60.0):
    """Run a test body; a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout_s))


def pattern(nbytes: int, seed: int) -> bytes:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def key_of(sequence: int) -> bytes:
    return sequence.to_bytes(16, "little")


def block_frame(sequence: int, payload: bytes):
    return block_header(7, NAMESPACE, key_of(sequence), payload, sequence, first_layer=2, num_layers=3), payload


@contextlib.asynccontextmanager
async def connected(kind: str, port_of=None):
    """(client channel, server channel) over a fresh pair of transports; ``port_of`` may
    redirect the client (through a proxy) from the listener's port."""
    config = TransportConfig(kind=kind)
    server, client = open_transport(config), open_transport(config)
    accepted: asyncio.Queue = asyncio.Queue()
    finished = asyncio.Event()

    async def on_channel(channel):
        await accepted.put(channel)
        await finished.wait()  # the test owns the channel until it is done

    try:
        address = await server.listen("127.0.0.1", 0, on_channel)
        if port_of is not None:
            address = f"{kind}://127.0.0.1:{await port_of(int(address.rpartition(':')[2]))}"
        channel = await client.connect(address, timeout_s=10)
        yield channel, await accepted.get()
    finally:
        finished.set()
        await client.close()
        await server.close()


async def receive_blocks(channel, destination: memoryview, count: int) -> list:
    """Receive ``count`` block frames back to back into ``destination``, verified."""
    headers, offset = [], 0
    for _ in range(count):
        header = await channel.recv_header()
        slot = destination[offset : offset + header.length]
        await channel.recv_payload(slot)
        header.verify(slot)
        headers.append(header)
        offset += header.length
    return headers


# -- one process -----------------------------------------------------------------------
def test_control_and_block_frames_round_trip(kind):
    async def body():
        async with connected(kind) as (client, server):
            request = encode_control({"op": "fetch", "keys": [key_of(1)], "deadline_ms": 250})
            payload = pattern(300 * KiB, 1)

            async def send_request():  # a large send completes once the peer receives it (UCX)
                await client.send(control_header(FrameKind.CONTROL, 7, request, NAMESPACE), request)
                await client.send(*block_frame(5, payload))

            sending = asyncio.ensure_future(send_request())
            header = await server.recv_header()
            assert (header.kind, header.transfer_id, header.namespace) == (FrameKind.CONTROL, 7, NAMESPACE)
            assert decode_control(header, await server.recv_bytes(header)) == {"op": "fetch", "keys": [key_of(1)], "deadline_ms": 250}
            header = await server.recv_header()
            assert (header.kind, header.key, header.sequence, header.first_layer, header.num_layers) == (
                FrameKind.BLOCK,
                key_of(5),
                5,
                2,
                3,
            )
            received = bytearray(header.length)
            await server.recv_payload(memoryview(received))
            header.verify(received)
            assert received == payload
            await sending

            summary = encode_control({"blocks": 1})
            await server.send(control_header(FrameKind.END, 7, summary), summary)
            reply = await client.recv_header()
            assert reply.kind is FrameKind.END and decode_control(reply, await client.recv_bytes(reply)) == {"blocks": 1}

    run(body())


def test_payload_lands_in_the_callers_buffer(kind):
    """Small (inline for UCX) and large payloads both land in the slot the caller gave."""

    async def body():
        async with connected(kind) as (client, server):
            small, large = pattern(INLINE_BYTES - 8, 2), pattern(1024 * KiB, 3)
            sending = asyncio.ensure_future(client.send_many([block_frame(0, small), block_frame(1, large)]))
            slab = torch.zeros(4 << 20, dtype=torch.uint8)
            slots = [(1 << 20, len(small)), (2 << 20, len(large))]
            for offset, nbytes in slots:
                assert (await server.recv_header()).length == nbytes
                await server.recv_payload(memoryview(slab.numpy())[offset : offset + nbytes])
            await sending
            assert slab[1 << 20 : (1 << 20) + len(small)].numpy().tobytes() == small
            assert slab[2 << 20 : (2 << 20) + len(large)].numpy().tobytes() == large
            assert int(slab.count_nonzero()) == int(torch.frombuffer(bytearray(small + large), dtype=torch.uint8).count_nonzero())

    run(body())


def test_send_many_delivers_a_window_of_blocks_in_order(kind):
    sizes = [4 * KiB, 64 * KiB, 300 * KiB, 17] * 24
    payloads = [pattern(size, 100 + i) for i, size in enumerate(sizes)]

    async def body():
        async with connected(kind) as (client, server):
            destination = memoryview(bytearray(sum(sizes)))
            receiving = asyncio.ensure_future(receive_blocks(server, destination, len(sizes)))
            await client.send_many(block_frame(i, p) for i, p in enumerate(payloads))  # a generator, consumed lazily
            headers = await receiving
            assert [h.sequence for h in headers] == list(range(len(sizes)))
            assert [h.key for h in headers] == [key_of(i) for i in range(len(sizes))]
            assert destination.tobytes() == b"".join(payloads)

    run(body())


def test_landing_posts_receives_ahead_and_verifies_each_block_in_order(kind):
    """Receives posted ahead (UCX: a batch's worth before any lands) into slots out of
    order; many small frames overflow a UCX batch message; one damaged block is dropped
    and the stream stays in step."""
    sizes = [4 * KiB] * 40 + [300 * KiB, 17, 2 * KiB, 1024 * KiB] * 12
    payloads = [pattern(size, 300 + i) for i, size in enumerate(sizes)]
    damaged = 45

    async def body():
        async with connected(kind) as (client, server):
            slots, offset = [], 0
            for size in reversed(sizes):  # later blocks at lower addresses
                slots.insert(0, offset)
                offset += size
            slab = memoryview(bytearray(offset))
            frames = [block_frame(i, p) for i, p in enumerate(payloads)]
            frames[damaged] = (frames[damaged][0], bytes(len(payloads[damaged])))  # the header's checksum no longer matches
            sending = asyncio.ensure_future(client.send_many(iter(frames)))
            outcome: list[tuple[int, bool]] = []
            landing = Landing(server, 8, lambda header, ok: outcome.append((header.sequence, ok)))
            for _ in sizes:
                header = await server.recv_header()
                await landing.start(header, slab[slots[header.sequence] : slots[header.sequence] + header.length])
            await landing.finish()
            await sending
            assert outcome == [(i, i != damaged) for i in range(len(sizes))]
            for i, payload in enumerate(payloads):
                if i != damaged:
                    assert slab[slots[i] : slots[i] + len(payload)] == payload

    run(body())


def test_close_wakes_a_blocked_receiver(kind):
    async def body():
        async with connected(kind) as (client, server):
            waiting = asyncio.ensure_future(client.recv_header())
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await client.close()
            with pytest.raises(TransferFailed, match="closed"):
                await asyncio.wait_for(waiting, 10)
            with pytest.raises(TransferFailed, match="closed"):
                await client.send(*block_frame(0, b"late"))

    run(body())


def test_transport_close_ends_the_channels_it_accepted(kind):
    """The server side blocks in a receive; closing its transport wakes it with TransferFailed."""

    async def body():
        config = TransportConfig(kind=kind)
        server, client = open_transport(config), open_transport(config)
        outcome: asyncio.Future = asyncio.get_running_loop().create_future()
        received = asyncio.Event()

        async def on_channel(channel):
            try:
                while True:
                    await channel.discard_payload(await channel.recv_header())
                    received.set()
            except TransferFailed as exc:
                outcome.set_result(exc)

        address = await server.listen("127.0.0.1", 0, on_channel)
        channel = await client.connect(address, timeout_s=10)
        await channel.send(*block_frame(0, b"hello"))
        await received.wait()  # the handler now waits for the next frame
        await server.close()
        assert isinstance(await asyncio.wait_for(outcome, 10), TransferFailed)
        await client.close()

    run(body())


def test_connecting_to_a_closed_port_fails_quickly(kind):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def body():
        transport = open_transport(TransportConfig(kind=kind))
        try:
            started = time.monotonic()
            with pytest.raises(TransferFailed, match=f"127.0.0.1:{port}"):
                await transport.connect(f"{kind}://127.0.0.1:{port}", timeout_s=5)
            return time.monotonic() - started
        finally:
            await transport.close()

    assert run(body(), timeout_s=30) < 6


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:99999999999999999999",
        "tcp://127.0.0.1:65536",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:²",
        "tcp://127.0.0.1:٣",
        "tcp://h:-1",
    ],
)
def test_an_address_without_a_port_in_range_is_refused_before_connecting(address):
    async def body():
        transport = open_transport(TransportConfig(kind="tcp"))
        try:
            with pytest.raises(InvalidArgument, match=r"port in \[1, 65535\]"):
                await transport.connect(address, timeout_s=5)
        finally:
            await transport.close()

    run(body())


@pytest.mark.parametrize("host", ["a" * 64, "a..b", "\x00"])
def test_a_host_name_that_cannot_be_resolved_is_a_transfer_failure(host):
    async def body():
        transport = open_transport(TransportConfig(kind="tcp"))
        try:
            with pytest.raises(TransferFailed, match="cannot resolve"):
                await transport.connect(f"tcp://{host}:1", timeout_s=5)
        finally:
            await transport.close()

    run(body())


# -- corruption ------------------------------------------------------------------------
# what a client with no credentials sends before its first frame: the handshake's hello
HELLO_BYTES = HEADER_BYTES + len(encode_control(ClientHandshake(PeerAuth(), tls=False).hello()))


async def start_flipping_proxy(target_port: int, flip_at: int):
    """A TCP proxy that forwards both ways and inverts the client's byte number ``flip_at``
    after its handshake."""
    flip_at += HELLO_BYTES

    async def pump(reader, writer, flip: bool):
        seen = 0
        try:
            while chunk := await reader.read(64 * KiB):
                if flip and seen <= flip_at < seen + len(chunk):
                    chunk = bytearray(chunk)
                    chunk[flip_at - seen] ^= 0xFF
                seen += len(chunk)
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def on_client(client_reader, client_writer):
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pump(client_reader, upstream_writer, True), pump(upstream_reader, client_writer, False))

    proxy = await asyncio.start_server(on_client, "127.0.0.1", 0)
    return proxy, proxy.sockets[0].getsockname()[1]


def test_tcp_header_corrupted_in_flight_is_refused():
    async def body():
        proxies = []

        async def through_proxy(port):
            proxy, proxy_port = await start_flipping_proxy(port, flip_at=40)  # the payload length field
            proxies.append(proxy)
            return proxy_port

        async with connected("tcp", through_proxy) as (client, server):
            await client.send(*block_frame(0, pattern(64 * KiB, 4)))
            with pytest.raises(CorruptBlock, match="checksum"):
                await server.recv_header()
            with pytest.raises(TransferFailed, match="out of step"):
                await server.recv_header()
        proxies[0].close()

    run(body())


def test_tcp_payload_corrupted_in_flight_fails_verification_and_the_stream_stays_in_step():
    first, second = pattern(64 * KiB, 5), pattern(32 * KiB, 6)

    async def body():
        proxies = []

        async def through_proxy(port):
            proxy, proxy_port = await start_flipping_proxy(port, flip_at=HEADER_BYTES + 1000)
            proxies.append(proxy)
            return proxy_port

        async with connected("tcp", through_proxy) as (client, server):
            sending = asyncio.ensure_future(client.send_many([block_frame(0, first), block_frame(1, second)]))
            header = await server.recv_header()
            slot = bytearray(header.length)
            await server.recv_payload(memoryview(slot))
            with pytest.raises(CorruptBlock, match="failed its checksum"):
                header.verify(slot)
            assert slot != first
            header = await server.recv_header()
            slot = bytearray(header.length)
            await server.recv_payload(memoryview(slot))
            header.verify(slot)
            assert (header.sequence, bytes(slot)) == (1, second)
            await sending
        proxies[0].close()

    run(body())


def test_ucx_frames_tampered_at_the_sender_are_refused(ucx):
    """UCX cannot be intercepted in flight; the sender's endpoint carries the damage."""
    payload = pattern(64 * KiB, 7)

    async def body():
        async with connected(ucx) as (client, server):
            header, _ = block_frame(0, payload)
            damaged = bytearray(payload)
            damaged[1000] ^= 0xFF
            sending = asyncio.ensure_future(client.send(header, damaged))
            header = await server.recv_header()
            slot = bytearray(header.length)
            await server.recv_payload(memoryview(slot))
            await sending
            with pytest.raises(CorruptBlock, match="failed its checksum"):
                header.verify(slot)

            forged = bytearray(block_frame(1, payload)[0].pack())
            forged[40] ^= 0xFF
            await client._endpoint.send(pack_batch([forged], 1))
            with pytest.raises(CorruptBlock, match="checksum"):
                await server.recv_header()
            with pytest.raises(TransferFailed, match="out of step"):
                await server.recv_header()

    run(body())


def test_ucx_channel_closed_with_receives_posted_lands_nothing_later(ucx):
    """Close returns only once UCX has ended the receives still posted: a slot handed back
    after close (a deadline) is never written by a late payload."""
    payload = pattern(256 * KiB, 11)

    async def body():
        async with connected(ucx) as (client, server):
            headers = [block_frame(i, payload)[0] for i in range(3)]
            await client._endpoint.send(pack_batch([h.pack() for h in headers], 3))  # the headers; payloads come late
            slots = [bytearray(len(payload)) for _ in headers]
            for slot in slots:
                await server.recv_header()
                await server.start_payload(memoryview(slot))
            await server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client._endpoint.send(payload), 2)
            await asyncio.sleep(0.5)
            assert all(slot == bytes(len(payload)) for slot in slots)

    run(body())


def test_ucx_batch_that_does_not_add_up_is_refused(ucx):
    async def body():
        async with connected(ucx) as (client, server):
            header = block_frame(0, b"x" * 100)[0]
            await client._endpoint.send(pack_batch([header.pack(), b"x" * 100], 2))  # says 2 frames, holds 1
            with pytest.raises(CorruptBlock, match="does not add up"):
                await server.recv_header()
            with pytest.raises(TransferFailed, match="out of step"):
                await server.recv_header()

    run(body())


def test_ucx_cancelled_payload_receive_never_lands_later(ucx):
    """A payload receive given up (a deadline) must not fill the slot afterwards: by then
    the caller may have handed the slot to another block."""
    payload = pattern(256 * KiB, 9)

    async def body():
        async with connected(ucx) as (client, server):
            header, _ = block_frame(0, payload)
            await client._endpoint.send(pack_batch([header.pack()], 1))  # the header alone; the payload comes late
            assert (await server.recv_header()).length == len(payload)
            slot = bytearray(len(payload))
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(server.recv_payload(memoryview(slot)), 0.5)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client._endpoint.send(payload), 2)
            await asyncio.sleep(0.5)
            assert slot == bytes(len(payload))
            with pytest.raises(TransferFailed, match="out of step"):
                await server.recv_header()

    run(body())


def test_tcp_peer_gone_in_the_middle_of_a_payload_is_a_transfer_failure():
    payload = pattern(256 * KiB, 8)

    async def body():
        transport = TcpTransport(TransportConfig())
        accepted: asyncio.Queue = asyncio.Queue()

        async def on_channel(channel):
            await accepted.put(channel)
            await asyncio.Event().wait()

        address = await transport.listen("127.0.0.1", 0, on_channel)
        raw, _ = await asyncio.to_thread(open_raw, address)
        header, _ = block_frame(0, payload)
        raw.sendall(header.pack() + payload[: len(payload) // 2])
        channel = await accepted.get()
        assert (await channel.recv_header()).length == len(payload)
        raw.close()
        with pytest.raises(TransferFailed, match=f"{len(payload) // 2} bytes into"):
            await channel.recv_payload(memoryview(bytearray(len(payload))))
        await transport.close()

    run(body())


# -- a peer in another process ---------------------------------------------------------
@contextlib.contextmanager
def peer_process(role: str, kind: str, env: dict | None = None):
    process = subprocess.Popen([sys.executable, str(PEER), role, kind], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()  # the peer prints its address once it listens
        assert line.startswith("ADDRESS "), f"the {role} peer did not start: {line!r}"
        yield process, line.split()[1]
    finally:
        process.kill()
        process.wait(timeout=30)


def test_blocks_echoed_by_a_peer_process_come_back_intact(kind):
    payloads = [pattern(256 * KiB, 200 + i) for i in range(32)]

    async def body(address):
        transport = open_transport(TransportConfig(kind=kind))
        try:
            channel = await transport.connect(address, timeout_s=10)
            destination = memoryview(bytearray(sum(map(len, payloads))))
            receiving = asyncio.ensure_future(receive_blocks(channel, destination, len(payloads)))
            await channel.send_many([block_frame(i, p) for i, p in enumerate(payloads)])
            headers = await receiving
            assert [h.sequence for h in headers] == list(range(len(payloads)))
            assert destination.tobytes() == b"".join(payloads)
        finally:
            await transport.close()

    with peer_process("echo", kind) as (_, address):
        run(body(address))


def test_a_killed_peer_process_fails_the_transfer_promptly(kind):
    async def body(process, address):
        transport = open_transport(TransportConfig(kind=kind))
        try:
            channel = await transport.connect(address, timeout_s=10)
            slot = memoryview(bytearray(256 * KiB))
            for _ in range(4):
                header = await channel.recv_header()
                await channel.recv_payload(slot)
                header.verify(slot)
            process.send_signal(signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(TransferFailed):
                while True:  # what was already in flight may still arrive, then the failure
                    header = await channel.recv_header()
                    await channel.recv_payload(slot)
            return time.monotonic() - started
        finally:
            await transport.close()

    with peer_process("flood", kind) as (process, address):
        assert run(body(process, address), timeout_s=60) < 30


BLOCKING_CLIENT = """
import asyncio, sys
from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.peer import Landing
from kvstore.transport.wire import block_header

async def main(address):
    transport = open_transport(TransportConfig(kind="ucx"))
    channel = await transport.connect(address, timeout_s=10)
    payloads = [bytes([i]) * (256 << 10) for i in range(24)] + [b"small"] * 8
    sending = asyncio.ensure_future(channel.send_many(
        (block_header(1, bytes(16), i.to_bytes(16, "little"), p, i), p) for i, p in enumerate(payloads)))
    landed = []
    landing = Landing(channel, 8, lambda header, ok: landed.append((header.sequence, ok)))
    slots = [bytearray(len(p)) for p in payloads]
    for _ in payloads:
        header = await channel.recv_header()
        await landing.start(header, memoryview(slots[header.sequence]))
    await landing.finish()
    await sending
    assert landed == [(i, True) for i in range(len(payloads))] and slots == payloads, landed
    await transport.close()
    print("OK")

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("mode", ["thread", "blocking"])
def test_ucxx_own_progress_modes_move_blocks(ucx, mode):
    """ucxx's thread mode completes requests through its Python futures, its blocking mode
    through their own waits: the request poster's other two paths (both processes in that
    mode; this one already runs kvstore's event mode, so the client is a process too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCXPY_", "KVSTORE_TRANSPORT_UCX"))}
    env["UCXPY_PROGRESS_MODE"] = mode
    with peer_process("echo", ucx, env) as (_, address):
        result = subprocess.run([sys.executable, "-c", BLOCKING_CLIENT, address], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["OK"], result.stderr[-2000:]


# -- choosing a transport --------------------------------------------------------------
def test_open_transport_follows_the_config(monkeypatch):
    assert open_transport(TransportConfig(kind="off")) is None
    assert isinstance(open_transport(TransportConfig(kind="tcp")), TcpTransport)
    monkeypatch.setitem(sys.modules, "ucxx", None)  # as on a machine without the [ucx] extra
    with pytest.raises(TransportUnavailable, match=r"pip install 'kvstore\[ucx\]'"):
        open_transport(TransportConfig(kind="ucx"))
    assert isinstance(open_transport(TransportConfig(kind="auto")), TcpTransport)
    with pytest.raises(InvalidArgument, match="ucx_progress_mode must be one of event, thread, blocking"):
        TransportConfig(kind="ucx", ucx_progress_mode="fast")


def test_ucx_defaults_reach_ucx_without_overriding_the_environment(ucx):
    script = (
        "import os\n"
        "from kvstore.transport.config import TransportConfig\n"
        "from kvstore.transport.factory import open_transport\n"
        "transport = open_transport(TransportConfig(kind='auto'))\n"
        "import ucxx\n"
        "print(type(transport).__name__, ucxx.get_config()['RNDV_SCHEME'], "
        "os.environ.get('KVSTORE_TRANSPORT_UCX_PROGRESS_MODE', '-'), os.environ['UCXPY_PROGRESS_MODE'], "
        "os.environ.get('UCXPY_ENABLE_PYTHON_FUTURE', '-'), os.environ['UCX_WARN_UNUSED_ENV_VARS'])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_RNDV", "UCXPY_", "UCX_WARN", "KVSTORE_TRANSPORT_UCX"))}

    def transport_env(**overrides) -> list[str]:
        result = subprocess.run([sys.executable, "-c", script], env={**env, **overrides}, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout.split()

    # kvstore's event progress runs ucxx in its blocking mode
    assert transport_env() == ["UcxTransport", "put_zcopy", "event", "blocking", "-", "n"]
    assert transport_env(UCX_RNDV_SCHEME="get_zcopy", UCXPY_PROGRESS_MODE="polling") == [
        "UcxTransport",
        "get_zcopy",
        "-",
        "polling",
        "-",
        "n",
    ]
    # the process exits although its transport was never closed: ucxx's notifier thread is stopped at exit
    assert transport_env(UCXPY_PROGRESS_MODE="thread") == ["UcxTransport", "put_zcopy", "-", "thread", "1", "n"]
