"""The sending process of bench.transport: connects to the receiver and, on each request,
sends the same bytes in blocks of the size the receiver asks for.

    python -m bench.transport_sender MODE ADDRESS TOTAL_BYTES WINDOW [SECURITY]

MODE is one of
    kvstore-tcp, kvstore-ucx   block frames through the transport: each block's checksum
                               is computed in the timed loop, frames go by send_many
    raw-tcp                    blocking sockets: one sendall of all the bytes (a block size
                               equal to TOTAL_BYTES), or each block's header and payload
                               in one sendmsg, as kvstore gathers a frame
    raw-tls                    the same over a blocking Python ``ssl`` socket (the TLS
                               context kvstore's channel uses): one sendall of all the
                               bytes, or each block's header (checksum taken in the loop)
                               and payload in two ``sendall`` (an SSL socket does not gather)
    raw-ucx                    ucxx tagged sends of the bare blocks, WINDOW blocks in flight
                               (a block size equal to TOTAL_BYTES: one message)
    echo-tcp                   no sender: on ADDRESS (a host; free ports), a kvstore TCP
                               transport that answers every CONTROL frame with its payload,
                               and a raw socket server (TLS where SECURITY has it) that
                               answers every TOTAL_BYTES bytes with them; prints both
                               addresses on one line, serves until stdin closes

SECURITY is a JSON object of `TransportConfig` fields (``peer_secret_file``; ``tls_cert``,
``tls_key``, ``tls_ca``), the same as the receiver's; none: peers authenticate nothing.

A request is the block size (a CONTROL frame for the kvstore modes, 8 bytes little-endian
for the raw ones); a block size of 0 ends the process.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import ssl
import sys
from collections.abc import Callable

from kvstore.transport.auth import tls_context
from kvstore.transport.base import Channel, split_address
from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.tcp import tune
from kvstore.transport.ucx import UcxPoster, import_ucxx
from kvstore.transport.wire import FrameKind, block_header, control_header, decode_control

NAMESPACE = bytes(16)
# the echo server takes every connection the bench opens to time it (bare connects included)
ECHO_MAX_CHANNELS = 4096


async def send_frames(kind: str, address: str, data: memoryview, window: int, security: dict) -> None:
    transport = open_transport(TransportConfig(kind=kind, window_blocks=window, **security))
    channel = await transport.connect(address, timeout_s=30)
    try:
        while True:
            request = await channel.recv_header()
            block_bytes = decode_control(request, await channel.recv_bytes(request))["block_bytes"]
            if not block_bytes:
                return
            blocks = (data[offset : offset + block_bytes] for offset in range(0, len(data), block_bytes))
            # a generator: each block's checksum is computed when the window has room for it
            await channel.send_many(
                (block_header(1, NAMESPACE, index.to_bytes(16, "little"), block, index), block) for index, block in enumerate(blocks)
            )
    finally:
        await transport.close()


def send_raw(address: str, data: memoryview, tls: ssl.SSLContext | None) -> None:
    """Blocking sockets, plain or through ``tls``: each request answered with all the bytes
    in one sendall, or in blocks of the size asked for, each a kvstore header and its payload."""
    host, port = split_address(address, "tcp")
    with socket.create_connection((host, port)) as plain:
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            with tls.wrap_socket(plain, server_hostname=host) as sock:
                serve_requests(sock, data, lambda header, block: (sock.sendall(header), sock.sendall(block)))
        else:
            # header and payload in one call, as kvstore's send_many gathers them
            serve_requests(plain, data, lambda header, block: send_gathered(plain, [header, block]))


def serve_requests(sock: socket.socket | ssl.SSLSocket, data: memoryview, send_frame: Callable[[bytes, memoryview], object]) -> None:
    request = bytearray(8)
    while True:
        view, got = memoryview(request), 0
        while got < 8:
            got += sock.recv_into(view[got:])
        block_bytes = int.from_bytes(request, "little")
        if not block_bytes:
            return
        if block_bytes == len(data):
            sock.sendall(data)
            continue
        for index, offset in enumerate(range(0, len(data), block_bytes)):
            block = data[offset : offset + block_bytes]
            send_frame(block_header(1, NAMESPACE, index.to_bytes(16, "little"), block, index).pack(), block)


def send_gathered(sock: socket.socket, buffers: list) -> None:
    """``sendmsg`` of ``buffers`` until every byte is sent (a send may take only part)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


async def send_raw_ucx(address: str, data: memoryview, window: int) -> None:
    ucxx = import_ucxx(TransportConfig(kind="ucx"))
    host, port = split_address(address, "ucx")
    endpoint = await ucxx.create_endpoint(host, port)
    poster = UcxPoster(endpoint)  # as kvstore posts: no task, and no polling wait, per message
    request = bytearray(8)
    try:
        while True:
            await poster.post(request, receive=True)
            block_bytes = int.from_bytes(request, "little")
            if not block_bytes:
                return
            in_flight: collections.deque = collections.deque()
            for offset in range(0, len(data), block_bytes):
                in_flight.append(poster.post(data[offset : offset + block_bytes]))
                if len(in_flight) > window:
                    await in_flight.popleft()
            await asyncio.gather(*in_flight)
    finally:
        await endpoint.close()


async def serve_echo(host: str, message_bytes: int, window: int, security: dict) -> None:
    """Answer every CONTROL frame with its payload on every kvstore channel, and every
    ``message_bytes`` on every raw connection with the same bytes, until stdin closes.
    The bench's connects that close before kvstore's handshake are refused by design:
    their refusals are not logged."""
    logging.getLogger("kvstore.transport").setLevel(logging.ERROR)
    config = TransportConfig(
        kind="tcp", window_blocks=window, max_peer_channels=ECHO_MAX_CHANNELS, max_peer_channels_per_source=ECHO_MAX_CHANNELS, **security
    )
    transport = open_transport(config)
    tls = transport.auth.server_tls  # the context kvstore's channels use

    async def echo(channel: Channel) -> None:
        while True:
            header = await channel.recv_header()
            payload = await channel.recv_bytes(header)
            await channel.send(control_header(FrameKind.CONTROL, header.transfer_id, payload), payload)

    async def echo_raw(sock: socket.socket) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            if tls is not None:
                sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                await tls_handshake(sock)
            message = memoryview(bytearray(message_bytes))
            while await recv_exactly(sock, message):
                await send_all(sock, message)
        sock.close()

    loop = asyncio.get_running_loop()
    listener = socket.create_server((host, 0))
    listener.setblocking(False)
    tasks = set()

    async def accept_raw() -> None:
        while True:
            sock, _ = await loop.sock_accept(listener)
            tune(sock)
            task = loop.create_task(echo_raw(sock))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    accepting = loop.create_task(accept_raw())
    print(await transport.listen(host, 0, echo), f"tcp://{host}:{listener.getsockname()[1]}", flush=True)
    try:
        await loop.run_in_executor(None, sys.stdin.read)
    finally:
        accepting.cancel()
        listener.close()
        await transport.close()


# -- non-blocking sockets on the event loop, as kvstore's TCP channel waits on them ----------
async def ready(sock: socket.socket, write: bool = False) -> None:
    loop = asyncio.get_running_loop()
    watch, unwatch = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    waiter = loop.create_future()
    watch(sock, lambda: waiter.done() or waiter.set_result(None))
    try:
        await waiter
    finally:
        unwatch(sock)


async def tls_handshake(sock: ssl.SSLSocket) -> None:
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await ready(sock)
        except ssl.SSLWantWriteError:
            await ready(sock, write=True)


async def send_all(sock: socket.socket, data: memoryview) -> None:
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:])
        except (BlockingIOError, ssl.SSLWantWriteError):
            await ready(sock, write=True)


async def recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False if the other end closed first."""
    got = 0
    while got < len(view):
        try:
            count = sock.recv_into(view[got:])
        except (BlockingIOError, ssl.SSLWantReadError):
            await ready(sock)
            continue
        if not count:
            return False
        got += count
    return True


def main() -> None:
    mode, address, total_bytes, window = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    security = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    if mode == "echo-tcp":
        asyncio.run(serve_echo(address, total_bytes, window, security))
        return
    data = memoryview(bytearray(os.urandom(1 << 20)) * (total_bytes >> 20))
    if mode == "raw-tcp":
        send_raw(address, data, None)
    elif mode == "raw-tls":
        send_raw(address, data, tls_context(security["tls_cert"], security["tls_key"], security["tls_ca"], server_side=False))
    elif mode == "raw-ucx":
        asyncio.run(send_raw_ucx(address, data, window))
    else:
        asyncio.run(send_frames(mode.removeprefix("kvstore-"), address, data, window, security))


if __name__ == "__main__":
    main()
