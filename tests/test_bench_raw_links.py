"""The raw socket baseline of bench.transport and bench.daemon moves every byte, as one
buffer and as framed blocks, with its receiver woken per MiB as kvstore's is — and never
waits for a wake-up threshold above what is still to come, which would hang the receive
instead of finishing it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import time

from bench.transport import RawSocketLink
from kvstore.transport.tcp import WAKE_BYTES

MiB = 1024 * 1024
TOTAL = 3 * MiB  # a multiple of 1 MiB, as the sender's data is


def test_the_raw_socket_link_moves_every_byte_as_one_buffer_and_as_framed_blocks():
    async def scenario() -> tuple[bytes, bytes]:
        destination = memoryview(bytearray(TOTAL))
        async with RawSocketLink(destination) as link:
            await asyncio.wait_for(asyncio.to_thread(lambda: asyncio.run(link.run(TOTAL))), 60)
            whole = bytes(destination)
            destination[:] = bytes(TOTAL)
            for block_bytes in (256 * 1024, MiB):  # each frame's checksum is verified as it lands
                await asyncio.wait_for(asyncio.to_thread(lambda b=block_bytes: asyncio.run(link.run(b))), 60)
            return whole, bytes(destination)

    whole, framed = asyncio.run(scenario())
    assert whole == framed and any(whole)  # the sender's bytes (random), both ways


def test_a_receive_whose_bytes_come_in_two_parts_finishes():
    """300 KiB are there when the receive starts, the rest (less than WAKE_BYTES) comes
    half a second later: a receiver that took the first part and then waited to be woken
    at WAKE_BYTES would never see the rest."""
    payload = os.urandom(WAKE_BYTES + 100 * 1024)
    first = 300 * 1024
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    # the sender closes first: a receiver still waiting then wakes to its end of stream
    with concurrent.futures.ThreadPoolExecutor(1) as pool, receiver, sender:
        link = RawSocketLink(memoryview(bytearray(len(payload))))
        link.conn = receiver
        sender.sendall(payload[:first])
        time.sleep(0.3)  # in the receiver's socket before it reads
        receiving = pool.submit(link.recv_exactly, link.destination)
        time.sleep(0.5)  # the receiver has taken the first part and waits
        sender.sendall(payload[first:])
        receiving.result(timeout=10)
        assert bytes(link.destination) == payload
