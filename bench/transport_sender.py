"""The sending process of bench.transport: connects to the receiver and, on each request,
sends the same bytes in blocks of the size the receiver asks for.

    python -m bench.transport_sender MODE ADDRESS TOTAL_BYTES WINDOW

MODE is one of
    kvstore-tcp, kvstore-ucx   block frames through the transport: each block's checksum
                               is computed in the timed loop, frames go by send_many
    raw-tcp                    blocking sockets: one sendall of all the bytes (a block size
                               equal to TOTAL_BYTES), or each block's header and payload
                               in one sendmsg, as kvstore gathers a frame
    raw-ucx                    ucxx tagged sends of the bare blocks, WINDOW blocks in flight
                               (a block size equal to TOTAL_BYTES: one message)

A request is the block size (a CONTROL frame for the kvstore modes, 8 bytes little-endian
for the raw ones); a block size of 0 ends the process.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import sys

from kvstore.transport.base import split_address
from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.ucx import UcxPoster, import_ucxx
from kvstore.transport.wire import block_header, decode_control

NAMESPACE = bytes(16)


async def send_frames(kind: str, address: str, data: memoryview, window: int) -> None:
    transport = open_transport(TransportConfig(kind=kind, window_blocks=window))
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


def send_raw_tcp(address: str, data: memoryview) -> None:
    host, port = split_address(address, "tcp")
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
                # header and payload in one call, as kvstore's send_many gathers them
                send_gathered(sock, [block_header(1, NAMESPACE, index.to_bytes(16, "little"), block, index).pack(), block])


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


def main() -> None:
    mode, address, total_bytes, window = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    data = memoryview(bytearray(os.urandom(1 << 20)) * (total_bytes >> 20))
    if mode == "raw-tcp":
        send_raw_tcp(address, data)
    elif mode == "raw-ucx":
        asyncio.run(send_raw_ucx(address, data, window))
    else:
        asyncio.run(send_frames(mode.removeprefix("kvstore-"), address, data, window))


if __name__ == "__main__":
    main()
