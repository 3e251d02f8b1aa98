"""A transport peer in its own OS process, for test_transport and bench.transport.

    python tests/transport_peer.py echo KIND    answer every frame with the same frame
    python tests/transport_peer.py flood KIND   send 256 KiB block frames until killed

Both listen on 127.0.0.1 (a free port), print ``ADDRESS <url>`` and serve until killed.
An echoed block is received into a buffer of its own and verified before it goes back,
so a test that gets its blocks back intact knows both directions worked.
"""

from __future__ import annotations

import asyncio
import os
import sys

from kvstore.transport.config import TransportConfig
from kvstore.transport.factory import open_transport
from kvstore.transport.wire import FrameKind, block_header

FLOOD_BLOCK_BYTES = 256 << 10


async def echo(channel) -> None:
    while True:
        header = await channel.recv_header()
        payload = bytearray(header.length)
        await channel.recv_payload(memoryview(payload))
        if header.kind is FrameKind.BLOCK:
            header.verify(payload)
        await channel.send(header, payload)


async def flood(channel) -> None:
    payload = os.urandom(FLOOD_BLOCK_BYTES)
    for sequence in range(1 << 62):
        await channel.send(block_header(1, bytes(16), sequence.to_bytes(16, "little"), payload, sequence), payload)


async def main(role: str, kind: str) -> None:
    transport = open_transport(TransportConfig(kind=kind))
    address = await transport.listen("127.0.0.1", 0, {"echo": echo, "flood": flood}[role])
    print("ADDRESS", address, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
