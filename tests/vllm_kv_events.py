"""Test stand-ins for a vLLM engine's KV event publisher and for an index.

`VllmPublisher` speaks exactly what vLLM's ``ZmqEventPublisher`` puts on the wire
(``vllm/distributed/kv_events.py``): a PUB socket sending ``(topic, seq as 8-byte
big-endian, msgpack payload)`` and, optionally, a ROUTER socket replaying its buffer. The
payloads are built with msgpack as msgspec encodes vLLM's structs: ``array_like`` tagged
arrays (vLLM up to PR #42892) or ``"type"``-tagged maps (after it).

`RecordingIndex` wraps an `Index` to count its ``publish`` calls and to make it fail on
purpose; `MemoryIndex` is a small in-memory `Index` for when no real one is at hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from kvstore.errors import IndexUnavailable
from kvstore.events import AllBlocksCleared, BlockEvent, BlockMoved, BlockRemoved, BlockStored
from kvstore.hashing import BlockHash
from kvstore.index.base import Index, NodeInfo, NodeMatch
from kvstore.tier_kind import TierKind

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes, parent, token_ids, block_size, lora_id=None, medium="GPU", *extra) -> list:
    """A BlockStored as an array-like tagged struct (``extra``: fields a newer vLLM appends)."""
    return ["BlockStored", list(hashes), parent, list(token_ids), block_size, lora_id, medium, *extra]


def removed(hashes, medium="GPU") -> list:
    return ["BlockRemoved", list(hashes), medium]


def cleared() -> list:
    return ["AllBlocksCleared"]


def stored_map(hashes, parent, token_ids, block_size, **fields) -> dict:
    """A BlockStored as vLLM ≥ #42892 encodes it: a map tagged by "type"."""
    event = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    event.update(fields)
    return event


def removed_map(hashes, **fields) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", "group_idx": 0, **fields}


def batch(events: Sequence[Any], dp_rank: int | None = 0) -> bytes:
    return msgpack.packb([time.time(), list(events), dp_rank])


class VllmPublisher:
    """One engine's publisher: numbers batches from 0, keeps them for replay."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str = "tcp://127.0.0.1", topic: str = "kv", replay: bool = False) -> None:
        self.topic = topic.encode()
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._bind(self.pub, endpoint)
        self.router = None
        self.replay_endpoint = ""
        if replay:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self.router, endpoint, suffix="-replay")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.next_seq = 0
        self.num_replay_requests = 0

    @staticmethod
    def _bind(socket: zmq.asyncio.Socket, endpoint: str, suffix: str = "") -> str:
        if endpoint.startswith("tcp://"):
            port = socket.bind_to_random_port(endpoint)
            return f"{endpoint}:{port}"
        socket.bind(endpoint + suffix)
        return endpoint + suffix

    async def send(self, payload: bytes, lose: bool = False) -> int:
        """Publish the next batch; ``lose`` numbers and buffers it but never delivers it."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.buffer.append((seq, payload))
        if not lose:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """The engine restarted: its sequence starts again at 0 and its buffer is empty."""
        self.next_seq = 0
        self.buffer.clear()

    async def serve_replay(self) -> None:
        """vLLM's ``_service_replay``, until cancelled."""
        assert self.router is not None
        while True:
            client_id, _, start = await self.router.recv_multipart()
            self.num_replay_requests += 1
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart([client_id, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client_id, b"", END_SEQ, b""])

    async def handshake(self, has_received: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """PUB/SUB drops what is sent before the subscription reaches the publisher (the
        slow joiner): send empty batches until the subscriber has seen one."""
        deadline = time.monotonic() + timeout_s
        while not has_received():
            assert time.monotonic() < deadline, "the subscriber never received a batch"
            await self.send(batch([]))
            await asyncio.sleep(0.02)

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


@contextlib.contextmanager
def publishing(topic: str = "") -> Iterator[VllmPublisher]:
    """An engine's publisher on a ZMQ context of its own, both closed at exit."""
    context = zmq.asyncio.Context()
    publisher = VllmPublisher(context, topic=topic)
    try:
        yield publisher
    finally:
        publisher.close()
        context.term()


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class RecordingIndex(Index):
    """Wraps an `Index`: records every ``publish`` and, while ``fail`` is set, answers every
    call as an unreachable backend would."""

    def __init__(self, inner: Index) -> None:
        self.inner = inner
        self.published: list[tuple[str, list[BlockEvent]]] = []
        self.fail = False

    def _check(self) -> None:
        if self.fail:
            raise IndexUnavailable("the test index is down.")

    async def register(self, node: NodeInfo, lease_ttl_s: float):
        self._check()
        return await self.inner.register(node, lease_ttl_s)

    async def leave(self, node_id: str) -> None:
        self._check()
        await self.inner.leave(node_id)

    async def publish(self, node_id: str, events: Sequence[BlockEvent]) -> None:
        self._check()
        self.published.append((node_id, list(events)))
        await self.inner.publish(node_id, events)

    async def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        self._check()
        return await self.inner.match(namespace, hashes, node_ids)

    async def nodes(self) -> list[NodeInfo]:
        self._check()
        return await self.inner.nodes()


class MemoryIndex(Index):
    """An `Index` in a few dicts, for when no real one is at hand."""

    def __init__(self) -> None:
        self.node_infos: dict[str, tuple[NodeInfo, float]] = {}
        self.blocks: dict[str, dict[tuple[bytes, BlockHash], TierKind]] = {}

    async def register(self, node: NodeInfo, lease_ttl_s: float) -> bool:
        renewed = node.node_id in self.node_infos and self.node_infos[node.node_id][1] > time.monotonic()
        if not renewed:
            self.blocks[node.node_id] = {}
        self.node_infos[node.node_id] = (node, time.monotonic() + lease_ttl_s)
        return renewed

    async def leave(self, node_id: str) -> None:
        self.node_infos.pop(node_id, None)
        self.blocks.pop(node_id, None)

    async def publish(self, node_id: str, events: Sequence[BlockEvent]) -> None:
        held = self.blocks.setdefault(node_id, {})
        for event in events:
            if isinstance(event, BlockStored):
                held.update({(event.namespace, h): event.tier for h in event.block_hashes})
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    held.pop((event.namespace, h), None)
            elif isinstance(event, BlockMoved):
                held.update({(event.namespace, h): event.dst for h in event.block_hashes})
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    async def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        matches = []
        for node_id in await self._live():
            if node_ids is not None and node_id not in node_ids:
                continue
            held = self.blocks.get(node_id, {})
            tiers = []
            for h in hashes:
                if (namespace, h) not in held:
                    break
                tiers.append(held[(namespace, h)])
            if tiers:
                matches.append(NodeMatch(node_id, tuple(tiers)))
        return sorted(matches, key=lambda m: -m.num_blocks)

    async def nodes(self) -> list[NodeInfo]:
        return [self.node_infos[n][0] for n in await self._live()]

    async def _live(self) -> list[str]:
        now = time.monotonic()
        return [node_id for node_id, (_, expires) in self.node_infos.items() if expires > now]
