"""vLLM KV events → kvstore index: the pure translator, then a real ZMQ publisher in
vLLM's wire format feeding a subscriber and an index on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgpack
import pytest
import zmq
import zmq.asyncio
from vllm_kv_events import (
    MemoryIndex,
    RecordingIndex,
    VllmPublisher,
    batch,
    cleared,
    eventually,
    removed,
    removed_map,
    stored,
    stored_map,
)

from kvstore.errors import InvalidArgument
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, RemovalReason
from kvstore.hashing import chain_hashes
from kvstore.index.base import Index, NodeInfo, NodeMatch
from kvstore.index.engine_events import EngineBlockStored, EngineEventTranslator, decode_batch
from kvstore.index.engine_subscriber import EngineEventSubscriber, EngineSubscription
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind

BLOCK = 4
NS = Namespace("test/model", KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK))
ENGINE = "engine-0"
GPU = TierKind.GPU

try:  # the embedded backend is built alongside; until it lands, MemoryIndex stands in
    from kvstore.index.embedded import EmbeddedIndex
except ImportError:
    EmbeddedIndex = None

INDEXES = [
    pytest.param(MemoryIndex, id="memory"),
    pytest.param(
        EmbeddedIndex, id="embedded", marks=pytest.mark.skipif(EmbeddedIndex is None, reason="index/embedded.py is not there yet")
    ),
]


def tokens(num_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_blocks * BLOCK))


# Engine hashes are arbitrary on purpose: nothing may depend on how the engine hashes.
H = [2**64 - 7, 3, 10**15, 42, 2**63 + 1, 9, 77, 5]


# ---------------------------------------------------------------- the pure translator


def test_blocks_are_keyed_by_their_tokens_never_by_engine_hashes():
    prompt = tokens(5)
    translator = EngineEventTranslator(NS)
    first = translator.translate_payload(batch([stored(H[:3], None, prompt[: 3 * BLOCK], BLOCK)]))
    second = translator.translate_payload(batch([stored(H[3:5], H[2], prompt[3 * BLOCK :], BLOCK)]))
    keys = chain_hashes(prompt, BLOCK)
    assert first == [BlockStored(NS.digest, tuple(keys[:3]), None, GPU, NS.block_bytes)]
    assert second == [BlockStored(NS.digest, tuple(keys[3:]), keys[2], GPU, NS.block_bytes)]
    # the same tokens under other engine hashes give the same keys
    other = EngineEventTranslator(NS)
    assert other.translate_payload(batch([stored([b"\x01" * 32, b"\x02" * 32], None, prompt[: 2 * BLOCK], BLOCK)]))[
        0
    ].block_hashes == tuple(keys[:2])

    assert translator.translate_payload(batch([removed([H[4], 123456])])) == [
        BlockRemoved(NS.digest, (keys[4],), GPU, RemovalReason.CAPACITY)
    ]
    assert translator.num_removals_unknown == 1 and len(translator) == 4
    assert translator.translate_payload(batch([cleared()])) == [AllBlocksCleared()]
    assert len(translator) == 0


def test_a_block_whose_parent_was_never_seen_is_skipped_not_guessed():
    translator = EngineEventTranslator(NS)
    assert translator.translate_payload(batch([stored(H[:2], 999, tokens(2), BLOCK)])) == []
    assert translator.num_blocks_unmapped == 2 and len(translator) == 0
    # its children cannot be keyed either
    assert translator.translate_payload(batch([stored([H[2]], H[1], tokens(1, 100), BLOCK)])) == []
    assert translator.num_blocks_unmapped == 3


def test_blocks_that_tokens_alone_do_not_key_are_skipped():
    translator = EngineEventTranslator(NS)
    events = [
        stored([1, 2], None, tokens(2), BLOCK, 7),  # a LoRA adapter's KV
        stored([3], None, tokens(1), BLOCK, None, "CPU"),  # an offloading connector's copy
        stored([4], None, tokens(1, 200)[:5], 5),  # the engine's block size differs from the namespace's
        stored([5], None, tokens(2, 500), 8),  # likewise (checked before the token count)
        stored_map([12], None, tokens(1, 700), BLOCK, lora_name="adapter-a"),  # newer vLLM names the LoRA
        stored([6, 7], None, tokens(1), BLOCK),  # 4 tokens for 2 blocks
        # multimodal: the second block carries an image hash; the first is still keyed
        stored([8, 9, 10], None, tokens(3), BLOCK, None, "GPU", None, [None, ["img-hash"], None]),
        stored_map([11], None, tokens(1), BLOCK, kv_cache_spec_kind="sliding_window", group_idx=1),
    ]
    out = translator.translate_payload(batch(events))
    assert out == [BlockStored(NS.digest, (chain_hashes(tokens(3), BLOCK)[0],), None, GPU, NS.block_bytes)]
    assert translator.num_blocks_unkeyable == 2 + 1 + 2
    assert translator.num_events_ignored == 2
    assert translator.num_events_wrong_block_size == 2
    assert translator.num_events_malformed == 1
    assert translator.num_blocks_stored == 1


def test_decoding_tolerates_appended_fields_map_encoding_and_unknown_kinds():
    prompt = tokens(2)
    newest = stored(H[:2], None, prompt, BLOCK, None, "GPU", None, [None, None], 0, "full_attention", None, "future")
    payload = msgpack.packb(
        {
            "ts": 1.5,
            "events": [newest, stored_map([H[2]], H[1], tokens(1, 50), BLOCK), ["BlockPinned", 1], removed_map([H[2]])],
            "data_parallel_rank": 3,
        }
    )
    decoded = decode_batch(payload)
    assert decoded.ts == 1.5 and decoded.data_parallel_rank == 3 and decoded.num_unknown == 1
    assert isinstance(decoded.events[0], EngineBlockStored) and decoded.events[0].kv_cache_spec_kind == "full_attention"
    translator = EngineEventTranslator(NS)
    out = translator.translate(decoded)
    keys = chain_hashes(prompt + tokens(1, 50), BLOCK)
    assert [type(e) for e in out] == [BlockStored, BlockStored, BlockRemoved]
    assert out[1].block_hashes == (keys[2],) and out[2].block_hashes == (keys[2],)
    # the oldest vLLM (0.8/0.9): five fields, no medium, two-element batch
    assert EngineEventTranslator(NS).translate_payload(msgpack.packb([0.0, [["BlockStored", [1], None, tokens(1), BLOCK, None]]]))[
        0
    ].block_hashes == (keys[0],)


def test_malformed_payloads_and_events_are_counted():
    translator = EngineEventTranslator(NS)
    for payload in (
        b"\xc1not msgpack",
        msgpack.packb({"x": 1}),
        msgpack.packb([1.0]),
        msgpack.packb("text"),
        msgpack.packb([1.0, [], 0]) + b"\x00",
    ):
        assert translator.translate_payload(payload) == []
    assert translator.num_batches_malformed == 5
    bad_events = [
        ["BlockStored", [1]],  # too short
        ["BlockStored", [True], None, tokens(1), BLOCK],  # a bool is not a hash
        ["BlockStored", [1], None, [-1, 2, 3, 4], BLOCK],  # a token id outside uint32
        ["BlockStored", [1], None, tokens(1), BLOCK, None, 5],  # medium is not a string
        ["BlockStored", [1], None, [[1, 2], 3, 4, 5], BLOCK],  # a ragged token list
        {"no": "tag"},
        17,
        stored([2], None, tokens(1), BLOCK),  # the one good event still counts
    ]
    out = translator.translate_payload(batch(bad_events))
    assert [e.block_hashes for e in out] == [(chain_hashes(tokens(1), BLOCK)[0],)]
    assert translator.num_events_malformed == 7


def test_the_catalogue_restates_every_mapped_block_parents_first():
    translator = EngineEventTranslator(NS)
    translator.translate_payload(batch([stored(H[:3], None, tokens(3), BLOCK), removed([H[1]])]))
    keys = chain_hashes(tokens(3), BLOCK)
    assert translator.catalogue() == [
        AllBlocksCleared(),
        BlockStored(NS.digest, (keys[0],), None, GPU, NS.block_bytes),
        BlockStored(NS.digest, (keys[2],), keys[1], GPU, NS.block_bytes),
    ]


def test_the_mapping_is_bounded():
    translator = EngineEventTranslator(NS, max_blocks=2)
    out = translator.translate_payload(batch([stored(H[:3], None, tokens(3), BLOCK)]))
    assert len(out[0].block_hashes) == 2 and translator.num_blocks_over_capacity == 1


def test_a_subscription_is_validated():
    with pytest.raises(InvalidArgument):
        EngineSubscription("tcp://127.0.0.1:5557", "")
    with pytest.raises(InvalidArgument):
        EngineSubscription("tcp://127.0.0.1:5557", ENGINE, lease_ttl_s=1.0, heartbeat_interval_s=2.0)


# ------------------------------------------------- a real ZMQ publisher and subscriber


def run_with_subscriber(
    body, *, endpoint: str = "tcp://127.0.0.1", replay: bool = False, index: Index | None = None, lease_ttl_s: float = 2.0
) -> RecordingIndex:
    async def main():
        context = zmq.asyncio.Context()
        publisher = VllmPublisher(context, endpoint, replay=replay)
        the_index = RecordingIndex(index or MemoryIndex())
        subscription = EngineSubscription(
            publisher.endpoint,
            ENGINE,
            topic="kv",
            replay_endpoint=publisher.replay_endpoint,
            lease_ttl_s=lease_ttl_s,
            heartbeat_interval_s=lease_ttl_s / 5,
            replay_timeout_s=2.0,
        )
        subscriber = EngineEventSubscriber(subscription, NS, the_index, context=context)
        running = asyncio.create_task(subscriber.run())
        serving = asyncio.create_task(publisher.serve_replay()) if replay else None
        try:
            await publisher.handshake(lambda: subscriber.num_messages > 0 or running.done())
            assert not running.done()
            await body(publisher, subscriber, the_index)
        finally:
            subscriber.stop()
            await asyncio.wait_for(running, 5)
            if serving is not None:
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
            publisher.close()
            context.term()
        return the_index

    return asyncio.run(main())


async def deliver(publisher: VllmPublisher, subscriber: EngineEventSubscriber, events) -> None:
    seq = await publisher.send(batch(events))
    await eventually(lambda: subscriber.next_seq == seq + 1)


async def held(index: Index, prompt: list[int]) -> list[NodeMatch]:
    return await index.match(NS.digest, chain_hashes(prompt, BLOCK))


@pytest.mark.parametrize("make_index", INDEXES)
def test_engine_gpu_prefix_is_indexed_over_zmq(make_index):
    prompt = tokens(6)

    async def body(publisher, subscriber, index):
        assert [(n.node_id, n.kind) for n in await index.nodes()] == [(ENGINE, "engine")]
        num_publishes = len(index.published)
        await deliver(publisher, subscriber, [stored(H[:4], None, prompt[: 4 * BLOCK], BLOCK)])
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,) * 4)]
        # the next batch chains from the previous batch's last block
        await deliver(publisher, subscriber, [stored(H[4:6], H[3], prompt[4 * BLOCK :], BLOCK)])
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,) * 6)]
        # one publish per batch
        assert len(index.published) == num_publishes + 2

        await deliver(publisher, subscriber, [removed([H[5], H[4]])])
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,) * 4)]
        await deliver(publisher, subscriber, [removed([H[2]])])
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,) * 2)]

        # an unknown parent is skipped and counted; the subscriber carries on
        await deliver(publisher, subscriber, [stored([H[7]], 123456789, tokens(1, 900), BLOCK)])
        assert subscriber.translator.num_blocks_unmapped == 1
        # malformed messages: undecodable payloads, missing frames, a bad sequence frame
        await publisher.send(b"\xc1\xc1garbage")
        await publisher.send_raw([b"kv", b"\x00" * 8])
        await publisher.send_raw([b"kv", b"\x01\x02", batch([])])
        await deliver(publisher, subscriber, [["BlockStored", "nonsense"], stored([H[6]], H[1], tokens(1, 8), BLOCK)])
        assert subscriber.translator.num_batches_malformed == 1
        assert subscriber.num_messages_malformed == 2
        assert subscriber.translator.num_events_malformed == 1
        other_branch = tokens(2) + tokens(1, 8)
        assert await held(index, other_branch) == [NodeMatch(ENGINE, (GPU,) * 3)]

        await deliver(publisher, subscriber, [cleared()])
        assert await held(index, prompt) == [] and len(subscriber.translator) == 0
        assert subscriber.num_gaps == 0 and subscriber.in_sync

    index = run_with_subscriber(body, index=make_index())
    assert asyncio.run(index.nodes()) == []  # stopping leaves the index


def test_bytes_hashes_and_map_encoded_events_over_ipc(tmp_path):
    prompt = tokens(3)
    hashes = [bytes([i]) * 32 for i in range(1, 4)]

    async def body(publisher, subscriber, index):
        await deliver(publisher, subscriber, [stored_map(hashes[:2], None, prompt[: 2 * BLOCK], BLOCK)])
        await deliver(publisher, subscriber, [stored(hashes[2:], hashes[1], prompt[2 * BLOCK :], BLOCK)])
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,) * 3)]
        await deliver(publisher, subscriber, [removed_map([hashes[1]])])
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,))]

    run_with_subscriber(body, endpoint=f"ipc://{tmp_path}/kv-events")


def test_a_gap_is_counted_and_what_chains_from_it_stays_unindexed():
    prompt = tokens(3)

    async def body(publisher, subscriber, index):
        await deliver(publisher, subscriber, [stored(H[:1], None, prompt[:BLOCK], BLOCK)])
        await publisher.send(batch([stored(H[1:2], H[0], prompt[BLOCK : 2 * BLOCK], BLOCK)]), lose=True)
        await deliver(publisher, subscriber, [stored(H[2:3], H[1], prompt[2 * BLOCK :], BLOCK)])
        assert subscriber.num_gaps == 1 and subscriber.num_batches_lost == 1
        assert subscriber.translator.num_blocks_unmapped == 1
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,))]

    run_with_subscriber(body)


def test_a_gap_is_filled_from_the_replay_socket():
    prompt = tokens(3)

    async def body(publisher, subscriber, index):
        await deliver(publisher, subscriber, [stored(H[:1], None, prompt[:BLOCK], BLOCK)])
        await publisher.send(batch([stored(H[1:2], H[0], prompt[BLOCK : 2 * BLOCK], BLOCK)]), lose=True)
        await deliver(publisher, subscriber, [stored(H[2:3], H[1], prompt[2 * BLOCK :], BLOCK)])
        assert await held(index, prompt) == [NodeMatch(ENGINE, (GPU,) * 3)]
        assert subscriber.num_batches_replayed >= 1 and subscriber.num_batches_lost == 0
        assert subscriber.num_gaps == 0 and subscriber.translator.num_blocks_unmapped == 0

    run_with_subscriber(body, replay=True)


def test_an_engine_restart_forgets_its_blocks():
    async def body(publisher, subscriber, index):
        await deliver(publisher, subscriber, [stored(H[:2], None, tokens(2), BLOCK)])
        assert await held(index, tokens(2)) == [NodeMatch(ENGINE, (GPU,) * 2)]
        publisher.restart()
        await deliver(publisher, subscriber, [stored([5], None, tokens(1, 300), BLOCK)])
        assert subscriber.num_restarts == 1
        assert await held(index, tokens(2)) == []
        assert await held(index, tokens(1, 300)) == [NodeMatch(ENGINE, (GPU,))]

    run_with_subscriber(body)


def test_an_index_outage_is_healed_by_resending_the_mapping(caplog):
    prompt = tokens(4)

    async def body(publisher, subscriber, index):
        await deliver(publisher, subscriber, [stored(H[:2], None, prompt[: 2 * BLOCK], BLOCK)])
        index.fail = True
        with caplog.at_level(logging.WARNING, logger="kvstore.index.engine_events"):
            await deliver(publisher, subscriber, [stored(H[2:4], H[1], prompt[2 * BLOCK :], BLOCK), removed([H[0]])])
        assert not subscriber.in_sync and subscriber.num_index_failures >= 1
        assert "re-sent once it answers" in caplog.text
        # the index comes back empty (it restarted)
        index.fail = False
        index.inner.node_infos.clear()
        index.inner.blocks.clear()
        await eventually(lambda: subscriber.in_sync)
        assert await held(index, prompt) == []  # block 0 is gone from the engine
        assert await index.match(NS.digest, chain_hashes(prompt, BLOCK)[1:]) == [NodeMatch(ENGINE, (GPU,) * 3)]

    run_with_subscriber(body)


def test_claims_left_by_an_earlier_subscriber_are_dropped_at_start():
    index = MemoryIndex()
    stale = chain_hashes(tokens(2), BLOCK)

    async def body(publisher, subscriber, index):
        # the mapping from engine hashes to these keys died with the earlier subscriber:
        # their removals could never be translated, so the node starts empty
        assert await held(index, tokens(2)) == []

    async def earlier():
        await index.register(NodeInfo(ENGINE, kind="engine"), 60.0)
        await index.publish(ENGINE, [BlockStored(NS.digest, tuple(stale), None, GPU, NS.block_bytes)])
        assert await held(index, tokens(2)) == [NodeMatch(ENGINE, (GPU,) * 2)]

    asyncio.run(earlier())
    run_with_subscriber(body, index=index)


def test_the_engine_lease_is_kept_alive_while_subscribed():
    async def body(publisher, subscriber, index):
        await deliver(publisher, subscriber, [stored(H[:1], None, tokens(1), BLOCK)])
        await asyncio.sleep(1.0)  # twice the lease
        assert [n.node_id for n in await index.nodes()] == [ENGINE]
        assert await held(index, tokens(1)) == [NodeMatch(ENGINE, (GPU,))]

    run_with_subscriber(body, lease_ttl_s=0.5)
