"""Damage the chaos run injects below kvstore's own code: a byte flipped on the wire
between two daemons, and a byte flipped inside a block stored in an NVMe slot file.

``FlipProxy`` is a TCP proxy in front of a daemon's peer transport. Its peers' remote
fetches go through it; ``arm()`` asks it to flip one byte of the next data it forwards
from the daemon (at a random position of that chunk: almost always inside a block's
payload, sometimes in a frame header), and ``flips`` counts the flips that happened.

``corrupt_nvme_slot`` reads the NVMe tier's slot files the way the tier lays them out
(tiers/nvme.py, tiers/nvme_format.py: pages of ``page_bytes`` end to end over files of
``file_bytes``; a page header names the slot size; each slot's 4 KiB trailer, at its
end, names the block and the length of its payload), picks a slot whose trailer is
valid and flips one byte of its payload in place. The trailer is left intact, so only
the payload checksum can tell. I/O is O_DIRECT on aligned buffers, as the daemon's own
(the page cache never holds a stale copy of either side's write).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import threading
from pathlib import Path

from kvstore.tiers.nvme_format import HEADER_BYTES, TRAILER_BYTES, decode_page_header, decode_slot_trailer

__all__ = ["FlipProxy", "corrupt_nvme_slot"]

ALIGN = 4096


class FlipProxy:
    """Forwards every connection to ``target`` (``tcp://host:port``) on its own event loop
    thread; flips one byte of the target's replies per ``arm()``."""

    def __init__(self, target: str, seed: int) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.rng = random.Random(seed)
        self.flips = 0
        self.flip_log: list[dict] = []
        self._armed = 0
        self._lock = threading.Lock()
        self._connections = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="chaos-flip-proxy", daemon=True)
        self._thread.start()
        self.server, self.address = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def arm(self) -> None:
        with self._lock:
            self._armed += 1

    def disarm(self) -> None:
        with self._lock:
            self._armed = 0

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    async def _start(self):
        server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return server, f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    def _take_flip(self) -> bool:
        with self._lock:
            if not self._armed:
                return False
            self._armed -= 1
            self.flips += 1
            return True

    async def _pipe(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        connection = self._connections
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return

        async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flipping: bool) -> None:
            seen = 0
            try:
                while data := await reader.read(1 << 16):
                    if flipping and self._take_flip():
                        damaged = bytearray(data)
                        position = self.rng.randrange(len(damaged))
                        damaged[position] ^= 1 << self.rng.randrange(8)
                        self.flip_log.append({"connection": connection, "stream_offset": seen + position})
                        data = bytes(damaged)
                    seen += len(data)
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        await asyncio.gather(copy(client_reader, server_writer, False), copy(server_reader, client_writer, True), return_exceptions=True)


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)  # anonymous mappings are page-aligned, as O_DIRECT needs


def corrupt_nvme_slot(directory: Path, page_bytes: int, file_bytes: int, rng: random.Random) -> dict | None:
    """Flip one payload byte of a block picked at random among those stored in the NVMe
    slot files under ``directory``; returns what was flipped (block hash, file, offset),
    or None when no stored block was found."""
    buffer = _aligned(ALIGN)
    view = memoryview(buffer)
    candidates: list[tuple[Path, int, bytes, int]] = []  # (file, slot start in it, block hash, payload length)
    for file_index, path in enumerate(sorted(directory.glob("slots-*.dat"))):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for base in range(0, min(file_bytes, os.path.getsize(path)) - page_bytes + 1, page_bytes):
                os.preadv(fd, [view], base)
                page = decode_page_header(view)
                if page is None or page.page_bytes != page_bytes:
                    continue
                slot_bytes = page.slot_bytes
                for start in range(base + HEADER_BYTES, base + page_bytes - slot_bytes + 1, slot_bytes):
                    os.preadv(fd, [view], start + slot_bytes - TRAILER_BYTES)
                    trailer = decode_slot_trailer(view)
                    if trailer is not None and trailer.seq > page.seq and trailer.fits(file_index * file_bytes + start, slot_bytes):
                        candidates.append((path, start, trailer.meta.block_hash, trailer.stored_len))
        finally:
            os.close(fd)
    if not candidates:
        return None
    path, start, block_hash, stored_len = rng.choice(candidates)
    position = start + rng.randrange(stored_len)
    chunk = position - position % ALIGN
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        os.preadv(fd, [view], chunk)
        buffer[position - chunk] ^= 1 << rng.randrange(8)
        os.pwritev(fd, [view], chunk)
    finally:
        os.close(fd)
    return {"file": path.name, "offset": position, "block": block_hash.hex(), "stored_blocks": len(candidates)}
