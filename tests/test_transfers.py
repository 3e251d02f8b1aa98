"""The transfer service between two nodes of one process, over the in-memory transport:
remote fetch, store, handoff, drain and warm-up, with the production tier managers,
index and sessions. (tests/test_peers.py runs the same paths between daemon processes
over TCP and UCX.)"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.chains import drain_plan, shared_prefixes
from kvstore.drain import drain, warm
from kvstore.errors import CorruptBlock, InvalidArgument, NotFound, TransferFailed
from kvstore.events import BlockStored
from kvstore.hashing import chain_hashes
from kvstore.index.base import NodeInfo
from kvstore.index.embedded import EmbeddedIndex
from kvstore.index.sessions import EmbeddedSessionStore
from kvstore.layout import KVLayout
from kvstore.metrics import Metrics
from kvstore.namespace import Namespace
from kvstore.node import Node
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import MemoryTier
from kvstore.transfers.service import TransferService
from kvstore.transport.base import MemoryTransport
from kvstore.transport.config import TransportConfig
from kvstore.transport.wire import FrameHeader

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")
NAMESPACE = Namespace("test/model", LAYOUT)
DIGEST = NAMESPACE.digest
BLOCK = LAYOUT.block_bytes


def _node(name: str, num_blocks: int = 64) -> Node:
    host = MemoryTier(TierKind.HOST, torch.zeros(num_blocks * BLOCK, dtype=torch.uint8), page_bytes=4 * BLOCK)
    manager = TierManager(TierManagerConfig(), [host])
    node = Node(name, manager, Metrics())
    node.register_namespace(NAMESPACE)
    return node


def _blocks(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (BLOCK,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _hashes(n: int, start: int = 0) -> list[bytes]:
    return chain_hashes(list(range(start, start + n * LAYOUT.block_size)), LAYOUT.block_size)


class Fleet:
    """Nodes sharing one embedded index (as daemons share Redis), each with a service."""

    def __init__(self) -> None:
        self.index = EmbeddedIndex()
        self.sessions = EmbeddedSessionStore()
        self.services: dict[str, TransferService] = {}

    async def add(self, name: str, num_blocks: int = 64, **config) -> TransferService:
        node = _node(name, num_blocks)
        service = TransferService(node, MemoryTransport(), TransportConfig(**config), self.index)
        address = await service.start()
        await self.index.register(NodeInfo(name, transport_address=address), 60)
        self.services[name] = service
        return service

    async def publish(self) -> None:
        for name, service in self.services.items():
            await self.index.publish(name, service.manager.events.drain())

    async def close(self) -> None:
        for service in self.services.values():
            await service.close()


def _read(node: Node, hashes: list[bytes]) -> list[torch.Tensor]:
    lease = node.manager.acquire(DIGEST, hashes)
    try:
        return [v.clone() for v in node.manager.lease_views(lease)]
    finally:
        node.manager.release(lease.id)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_remote_fetch_brings_the_missing_suffix_from_the_peer_the_index_names():
    async def main():
        fleet = Fleet()
        a, b = await fleet.add("a"), await fleet.add("b")
        hashes, data = _hashes(8), _blocks(8, seed=1)
        a.manager.put(DIGEST, hashes, data)
        b.manager.put(DIGEST, hashes[:3], data[:3])
        await fleet.publish()
        cached = await b.fetch_missing(DIGEST, hashes, deadline_s=5)
        assert cached == 8
        assert all(torch.equal(x, y) for x, y in zip(_read(b.node, hashes), data))
        # only the 5 missing blocks crossed
        assert b.node.metrics.transfer_blocks.labels("in", "fetch")._value.get() == 5
        await fleet.close()

    run(main())


def test_a_prefix_the_index_over_reports_is_fetched_as_far_as_the_peer_holds_it():
    """The Redis index's match may step over a narrow hole and report a longer prefix than
    a node holds (index/redis_scripts.py, MATCH): the fetch gets what the peer really has."""

    async def main():
        fleet = Fleet()
        a, b = await fleet.add("a"), await fleet.add("b")
        hashes, data = _hashes(8), _blocks(8, seed=5)
        a.manager.put(DIGEST, hashes[:3], data[:3])
        await fleet.publish()
        await fleet.index.publish("a", [BlockStored(DIGEST, tuple(hashes), None, TierKind.HOST, BLOCK)])  # says 8
        assert [(m.node_id, m.num_blocks) for m in await fleet.index.match(DIGEST, hashes)] == [("a", 8)]
        cached = await b.fetch_missing(DIGEST, hashes, deadline_s=5)
        assert cached == 3  # the rest is a miss: recomputed
        assert all(torch.equal(x, y) for x, y in zip(_read(b.node, hashes[:3]), data[:3]))
        await fleet.close()

    run(main())


def test_a_block_corrupted_in_transit_ends_the_fetched_prefix_there():
    async def main():
        fleet = Fleet()
        a, b = await fleet.add("a"), await fleet.add("b")
        hashes, data = _hashes(6), _blocks(6, seed=2)
        a.manager.put(DIGEST, hashes, data)
        original = FrameHeader.verify

        def flaky_verify(self, payload):  # the 4th block's bytes arrive damaged
            if self.key == hashes[3]:
                raise CorruptBlock("damaged in transit")
            return original(self, payload)

        FrameHeader.verify = flaky_verify
        try:
            stored = await b.fetch_from(a.address, DIGEST, hashes, None, deadline_s=5)
        finally:
            FrameHeader.verify = original
        assert stored == 3
        assert b.manager.lookup(DIGEST, hashes) == [TierKind.HOST] * 3
        assert b.node.metrics.transfer_dropped.labels("checksum")._value.get() == 1
        await fleet.close()

    run(main())


def test_a_fetch_past_its_deadline_keeps_what_arrived_and_frees_the_rest():
    async def main():
        fleet = Fleet()
        a, b = await fleet.add("a"), await fleet.add("b")
        hashes, data = _hashes(8), _blocks(8, seed=3)
        a.manager.put(DIGEST, hashes, data)
        from kvstore.transport import peer

        original = peer.send_blocks

        async def slow_send_blocks(channel, transfer_id, namespace, blocks, *args):
            for block in blocks:  # one block at a time, slower than the deadline allows
                await original(channel, transfer_id, namespace, [block], *args)
                await asyncio.sleep(0.2)

        import kvstore.transfers.peer_server as serving

        serving.send_blocks = slow_send_blocks
        try:
            stored = await b.fetch_from(a.address, DIGEST, hashes, None, deadline_s=0.5)
        finally:
            serving.send_blocks = original
        assert 1 <= stored < 8
        assert b.manager.lookup(DIGEST, hashes) == [TierKind.HOST] * stored
        assert b.manager.num_reservations == 0
        await fleet.close()

    run(main())


def test_handoff_streams_layers_and_the_consumer_reads_each_as_it_arrives():
    async def main():
        fleet = Fleet()
        prefill, decode = await fleet.add("prefill"), await fleet.add("decode")
        hashes, data = _hashes(3), _blocks(3, seed=4)
        sender = await prefill.handoff_send(1, DIGEST, hashes, None, "req-1", decode.address)
        receiver = await decode.handoff_receive(7, DIGEST, "req-1", timeout_s=5)
        for layer in range(LAYOUT.num_layers):
            offset, length = LAYOUT.layer_slice(layer)
            for view, block in zip(sender.views, data):
                view[offset : offset + length] = block[offset : offset + length]
            prefill.handoff_layers_ready(1, "req-1", layer, 1)
            assert await decode.handoff_wait(7, "req-1", layer + 1, timeout_s=5) >= layer + 1
            for view, block in zip(receiver.views, data):
                assert torch.equal(view[offset : offset + length], block[offset : offset + length])
        assert await prefill.handoff_finish(1, "req-1", timeout_s=5) == 3
        decode.handoff_close(7, "req-1")
        # both nodes hold the prefix now; every staging slot is back
        assert decode.manager.lookup(DIGEST, hashes) == [TierKind.HOST] * 3
        assert prefill.manager.lookup(DIGEST, hashes) == [TierKind.HOST] * 3
        assert all(torch.equal(x, y) for x, y in zip(_read(decode.node, hashes), data))
        for service in (prefill, decode):
            assert service.handoffs.outgoing == {} and service.handoffs.incoming == {}
            assert service.manager.tier(TierKind.HOST).stats().used_bytes == 3 * BLOCK
        await fleet.close()

    run(main())


def test_a_cancelled_handoff_fails_the_consumer_and_frees_both_sides():
    async def main():
        fleet = Fleet()
        prefill, decode = await fleet.add("prefill"), await fleet.add("decode")
        hashes = _hashes(2)
        await prefill.handoff_send(1, DIGEST, hashes, None, "req-2", decode.address)
        await decode.handoff_receive(7, DIGEST, "req-2", timeout_s=5)
        prefill.handoff_layers_ready(1, "req-2", 0, 1)
        await decode.handoff_wait(7, "req-2", 1, timeout_s=5)
        prefill.close_session(1)  # the prefill engine died
        with pytest.raises(TransferFailed):
            await decode.handoff_wait(7, "req-2", 2, timeout_s=5)
        decode.close_session(7)
        for service in (prefill, decode):
            assert service.manager.tier(TierKind.HOST).stats().used_bytes == 0
        assert decode.manager.lookup(DIGEST, hashes) == []
        await fleet.close()

    run(main())


def test_handoff_layers_out_of_order_and_unknown_transfers_are_refused():
    async def main():
        fleet = Fleet()
        prefill, decode = await fleet.add("prefill"), await fleet.add("decode")
        await prefill.handoff_send(1, DIGEST, _hashes(1), None, "req-3", decode.address)
        with pytest.raises(TransferFailed, match="in order"):
            prefill.handoff_layers_ready(1, "req-3", 2, 1)
        with pytest.raises(InvalidArgument, match="never handed over"):
            await prefill.handoff_finish(1, "req-3", timeout_s=1)
        with pytest.raises(TransferFailed, match="no producer announced"):
            await decode.handoff_receive(7, DIGEST, "nobody", timeout_s=0.2)
        with pytest.raises(InvalidArgument, match="more than once"):
            await prefill.handoff_send(1, DIGEST, _hashes(2) + _hashes(1), None, "req-dup", decode.address)
        assert prefill.manager.tier(TierKind.HOST).stats().used_bytes == BLOCK  # req-3's staging only
        await fleet.close()

    run(main())


def test_drain_moves_chains_to_peers_with_room_and_moves_sessions():
    async def main():
        fleet = Fleet()
        leaving = await fleet.add("leaving")
        small, big = await fleet.add("small", num_blocks=8), await fleet.add("big", num_blocks=64)
        prompts = [_hashes(6, start=1000 * i) for i in range(4)]
        for i, hashes in enumerate(prompts):
            leaving.manager.put(DIGEST, hashes, _blocks(6, seed=10 + i))
        await fleet.sessions.put("agent-1", "leaving", 60)
        await fleet.sessions.put("agent-2", "small", 60)
        report = await drain(leaving, fleet.index, fleet.sessions)
        assert report.moved_blocks == 24 and report.remaining_blocks == 0
        assert sum(report.blocks_by_peer.values()) == 24
        held = {name: len(s.manager.lookup(DIGEST, prompts[0])) for name, s in fleet.services.items() if name != "leaving"}
        assert max(held.values()) == 6  # a whole chain landed on one peer
        assert report.sessions_moved == 1
        assert (await fleet.sessions.get("agent-1")).node_id == max(report.blocks_by_peer, key=report.blocks_by_peer.get)
        assert (await fleet.sessions.get("agent-2")).node_id == "small"
        # peers publish what they stored like any save
        stored = [e for e in big.manager.events.drain() + small.manager.events.drain() if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) == 24
        await fleet.close()

    run(main())


def test_warm_fetches_the_prefixes_several_chains_share():
    async def main():
        fleet = Fleet()
        old, new = await fleet.add("old"), await fleet.add("new")
        system = _hashes(3, start=0)
        data = _blocks(5, seed=20)
        old.manager.put(DIGEST, system, data[:3])
        for tail in range(2):  # two sessions on top of the shared system prompt
            own = chain_hashes(list(range(3 * 16)) + [10_000 + tail] * 32, 16)[3:]
            old.manager.put(DIGEST, own, _blocks(2, seed=30 + tail), parent_hash=system[-1])
        lonely = _hashes(2, start=50_000)
        old.manager.put(DIGEST, lonely, data[3:])
        report = await warm(new, fleet.index)
        assert report.moved_blocks == 3
        assert new.manager.lookup(DIGEST, system) == [TierKind.HOST] * 3
        assert new.manager.lookup(DIGEST, lonely) == []
        await fleet.close()

    run(main())


def test_chain_plans_skip_orphans_and_respect_the_budget():
    node = _node("plan")
    hashes = _hashes(4)
    node.manager.put(DIGEST, hashes, _blocks(4, seed=5))
    orphan = _hashes(2, start=7000)
    node.manager.put(DIGEST, orphan[1:], _blocks(1, seed=6), parent_hash=orphan[0])
    chains = drain_plan(list(node.manager.blocks()))
    assert [c.hashes for c in chains] == [tuple(hashes)]
    budget = drain_plan(list(node.manager.blocks()), max_bytes=2 * BLOCK + 1)
    assert [c.hashes for c in budget] == [tuple(hashes[:2])]
    assert shared_prefixes(list(node.manager.blocks())) == []


def test_a_consumer_daemon_gone_mid_handoff_fails_the_producer_and_frees_its_staging():
    async def main():
        fleet = Fleet()
        prefill, decode = await fleet.add("prefill"), await fleet.add("decode")
        await prefill.handoff_send(1, DIGEST, _hashes(2), None, "req-4", decode.address)
        prefill.handoff_layers_ready(1, "req-4", 0, 1)
        await decode.close()  # the decode host went away
        for layer in range(1, LAYOUT.num_layers):
            prefill.handoff_layers_ready(1, "req-4", layer, 1)
        with pytest.raises(TransferFailed):
            await prefill.handoff_finish(1, "req-4", timeout_s=5)
        assert prefill.handoffs.outgoing == {}
        assert prefill.manager.tier(TierKind.HOST).stats().used_bytes == 0
        await prefill.close()

    run(main())


def test_an_unclaimed_handoff_is_stored_and_its_staging_freed_at_the_deadline():
    async def main():
        fleet = Fleet()
        prefill, decode = await fleet.add("prefill"), await fleet.add("decode", handoff_timeout_s=0.5)
        hashes = _hashes(2)
        await prefill.handoff_send(1, DIGEST, hashes, None, "req-5", decode.address)
        prefill.handoff_layers_ready(1, "req-5", 0, LAYOUT.num_layers)
        assert await prefill.handoff_finish(1, "req-5", timeout_s=5) == 2
        assert decode.manager.tier(TierKind.HOST).stats().used_bytes == 4 * BLOCK  # stored + staged for a reader
        await asyncio.sleep(0.6)
        decode.housekeeping()
        assert decode.handoffs.incoming == {}
        assert decode.manager.tier(TierKind.HOST).stats().used_bytes == 2 * BLOCK
        assert decode.manager.lookup(DIGEST, hashes) == [TierKind.HOST] * 2  # a late reader loads it from the store
        await fleet.close()

    run(main())


# -- one owner per slot: staging and slots a broken-off channel may still touch --------------
def test_an_attached_consumer_keeps_its_staging_past_the_deadline_until_it_lets_go():
    async def main():
        fleet = Fleet()
        prefill, decode = await fleet.add("prefill"), await fleet.add("decode", handoff_timeout_s=0.3)
        hashes, data = _hashes(2), _blocks(2, seed=6)
        sender = await prefill.handoff_send(1, DIGEST, hashes, None, "req-6", decode.address)
        receiver = await decode.handoff_receive(7, DIGEST, "req-6", timeout_s=5)
        offset, length = LAYOUT.layer_slice(0)
        for view, block in zip(sender.views, data):
            view[offset : offset + length] = block[offset : offset + length]
        prefill.handoff_layers_ready(1, "req-6", 0, 1)
        await decode.handoff_wait(7, "req-6", 1, timeout_s=5)
        await asyncio.sleep(0.4)
        decode.housekeeping()  # the handoff times out while the consumer engine reads layer 0
        with pytest.raises(TransferFailed):
            await decode.handoff_wait(7, "req-6", 2, timeout_s=1)
        decode.manager.put(DIGEST, _hashes(60, start=10_000), _blocks(60, seed=7))  # other blocks take every free slot
        assert all(torch.equal(v[offset : offset + length], b[offset : offset + length]) for v, b in zip(receiver.views, data))
        used = decode.manager.tier(TierKind.HOST).stats().used_bytes
        decode.handoff_close(7, "req-6")  # the consumer lets go: now the staging is free
        assert decode.manager.tier(TierKind.HOST).stats().used_bytes == used - 2 * BLOCK
        await fleet.close()

    run(main())


def test_a_producer_keeps_its_staging_past_the_deadline_until_it_lets_go():
    async def main():
        fleet = Fleet()
        prefill, decode = await fleet.add("prefill", handoff_timeout_s=0.3), await fleet.add("decode")
        await prefill.handoff_send(1, DIGEST, _hashes(2), None, "req-7", decode.address)
        prefill.handoff_layers_ready(1, "req-7", 0, 1)
        await asyncio.sleep(0.4)
        prefill.housekeeping()  # timed out while the producer engine may still be writing layer 1
        assert prefill.manager.tier(TierKind.HOST).stats().used_bytes == 2 * BLOCK
        with pytest.raises(NotFound):
            prefill.handoff_cancel(2, "req-7")  # another connection cannot let go of it
        with pytest.raises(TransferFailed, match="did not finish"):
            prefill.handoffs.outgoing["req-7"].raise_if_failed()
        prefill.handoff_cancel(1, "req-7")  # its own engine does
        assert prefill.manager.tier(TierKind.HOST).stats().used_bytes == 0
        await fleet.close()

    run(main())


def test_slots_a_broken_off_receive_may_still_fill_are_freed_only_once_the_channel_settles(monkeypatch):
    from kvstore.transport import base

    settled = asyncio.Event()

    async def wait_settled(self):
        await settled.wait()

    monkeypatch.setattr(base._MemoryChannel, "touching_buffers", property(lambda self: not settled.is_set()))
    monkeypatch.setattr(base._MemoryChannel, "settled", wait_settled)

    async def main():
        fleet = Fleet()
        a, b = await fleet.add("a"), await fleet.add("b")
        hashes = _hashes(8)
        a.manager.put(DIGEST, hashes, _blocks(8, seed=8))
        from kvstore.transport import peer

        original = peer.send_blocks

        async def slow_send_blocks(channel, transfer_id, namespace, blocks, *args):
            for block in blocks:
                await original(channel, transfer_id, namespace, [block], *args)
                await asyncio.sleep(0.2)

        import kvstore.transfers.peer_server as serving

        monkeypatch.setattr(serving, "send_blocks", slow_send_blocks)
        stored = await b.fetch_from(a.address, DIGEST, hashes, None, deadline_s=0.5)
        assert stored == 0  # a receive may still be posted: nothing is committed or freed yet
        assert b.manager.num_reservations == 1 and b.manager.tier(TierKind.HOST).stats().used_bytes == 8 * BLOCK
        settled.set()  # the transport says nothing can land any more
        await asyncio.sleep(0.05)
        assert b.manager.num_reservations == 0
        arrived = len(b.manager.lookup(DIGEST, hashes))
        assert 1 <= arrived < 8 and b.manager.tier(TierKind.HOST).stats().used_bytes == arrived * BLOCK
        await fleet.close()

    run(main())
