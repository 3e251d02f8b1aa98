"""The peer side of a daemon: conversations another daemon starts on a channel.

    request (CONTROL)                          reply, then
    {"op": "fetch", namespace, hashes}         {"count": n}; n BLOCK frames out; END
    {"op": "store", namespace, hashes, parent} {"accepted": [seq…]}; those BLOCK frames in;
                                               END in; {"stored": k} as END out
    {"op": "handoff", transfer, namespace,     {"accepted": n}; layer-range BLOCK frames in
     hashes, parent}                           as the producer computes; END in; END out
    {"op": "capacity"}                         {"node_id", "free_bytes"}
    {"op": "hot", "max_bytes"}                 {"chains": [[namespace, parent, hashes]…]}

``namespace`` is the 13-field wire form (kvstore/localproto.py) so a peer that never saw
it can register it; ``hashes`` one bytes string of 16-byte chain hashes. A fetch leases
the blocks first, so blocks on the peer's NVMe tier are promoted and verified before they
are sent. A store reserves slots and receives each block straight into its slot; a block
that fails its checksum is dropped and only the verified prefix before it is committed.
Any refusal is an ERROR frame with a sentence, after which the channel is closed.

Owner: the daemon's event loop; one task per channel (``serve``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstore.chains import describable, shared_prefixes
from kvstore.errors import CorruptBlock, InvalidArgument, KVStoreError, TransferFailed
from kvstore.localproto import namespace_from_wire, namespace_to_wire, pack_hashes, unpack_hashes
from kvstore.steps import run_steps
from kvstore.tier_kind import TierKind
from kvstore.transfers.handoff import IncomingHandoff
from kvstore.transport.base import Channel
from kvstore.transport.peer import Landing, buffer_of, send_blocks, send_control, send_error
from kvstore.transport.wire import FrameHeader, FrameKind, decode_control

if TYPE_CHECKING:
    from kvstore.transfers.service import TransferService

__all__ = ["PeerServer"]

logger = logging.getLogger(__name__)


class PeerServer:
    def __init__(self, service: TransferService) -> None:
        self.service = service
        self.node = service.node
        self.manager = service.node.manager
        self._ops = {
            "fetch": self._fetch,
            "store": self._store,
            "handoff": self._handoff,
            "capacity": self._capacity,
            "hot": self._hot,
        }

    async def serve(self, channel: Channel) -> None:
        try:
            while True:
                header = await channel.recv_header()
                if header.kind is not FrameKind.CONTROL:
                    raise CorruptBlock(f"a conversation must start with a CONTROL frame, got {header.kind.name}.")
                message = decode_control(header, await channel.recv_bytes(header))
                if not isinstance(message, dict) or message.get("op") not in self._ops:
                    raise InvalidArgument(f"unknown peer request {message!r:.80}; this daemon serves {sorted(self._ops)}.")
                try:
                    await self._ops[message["op"]](channel, header.transfer_id, message)
                except (KeyError, TypeError, ValueError) as exc:
                    raise InvalidArgument(f"malformed {message['op']} request: {exc!r}.") from exc
        except TransferFailed:
            pass  # the peer hung up: every conversation cleans up after itself
        except KVStoreError as exc:
            logger.warning("peer %s: %s", channel.peer, exc)
            await send_error(channel, 0, exc)
        finally:
            await channel.close()

    # -- conversations ------------------------------------------------------------------------
    async def _fetch(self, channel: Channel, transfer_id: int, message: dict) -> None:
        digest = message["namespace"]
        lease = await run_steps(self.manager.acquire_steps(digest, unpack_hashes(message["hashes"]), TierKind.HOST))
        done = False
        try:
            views = self.manager.lease_views(lease)
            await send_control(channel, transfer_id, {"count": len(views), "nbytes": lease.nbytes})
            # each block leaves with the checksum its writer committed: bytes changed since are refused at the other end
            blocks = [(seq, b.block_hash, buffer_of(v), b.checksum) for seq, (b, v) in enumerate(zip(lease.blocks, views))]
            await send_blocks(channel, transfer_id, digest, blocks)
            await send_control(channel, transfer_id, {}, FrameKind.END)
            done = True
        finally:
            self.service.settling.release_after(None if done else channel, lambda: self.manager.release(lease.id))
        self.node.metrics.transferred("out", "fetch", len(views), len(views) * lease.nbytes)

    async def _store(self, channel: Channel, transfer_id: int, message: dict) -> None:
        namespace = namespace_from_wire(message["namespace"])
        digest = self.node.register_namespace(namespace)
        hashes = unpack_hashes(message["hashes"])
        try:
            reservation = await run_steps(self.manager.reserve_steps(digest, hashes, message["parent"]))
        except KVStoreError as exc:  # no room at all: accept nothing rather than fail the peer
            logger.info("store from %s accepted nothing: %s", channel.peer, exc)
            await send_control(channel, transfer_id, {"accepted": []})
            await self.service.expect_end(channel)
            await send_control(channel, transfer_id, {"stored": 0}, FrameKind.END)
            return
        position = {h: i for i, h in enumerate(hashes)}
        accepted = [position[b.block_hash] for b in reservation.blocks]
        slot_of = dict(zip(accepted, self.manager.reservation_slots(reservation)))
        verified: dict[int, int] = {}
        try:
            await send_control(channel, transfer_id, {"accepted": accepted})
            await self.service.receive_blocks(channel, slot_of, hashes, len(accepted), verified)
            await self.service.expect_end(channel)
        except BaseException:
            await channel.close()
            self.service.settling.release_after(channel, lambda: self.manager.abort(reservation.id))
            raise
        stored = self.service.commit_received(None, reservation, accepted, verified)
        self.node.metrics.transferred("in", "store", stored, stored * reservation.nbytes)
        await send_control(channel, transfer_id, {"stored": stored}, FrameKind.END)

    async def _handoff(self, channel: Channel, transfer_id: int, message: dict) -> None:
        namespace = namespace_from_wire(message["namespace"])
        digest = self.node.register_namespace(namespace)
        hashes = unpack_hashes(message["hashes"])
        handoffs = self.service.handoffs
        handoff = await handoffs.open_incoming(message["transfer"], transfer_id, digest, hashes, message["parent"], namespace.layout)
        handoff.channel = channel
        try:
            await send_control(channel, transfer_id, {"accepted": len(hashes)})
            await self._receive_layers(channel, handoff)
            await handoffs.store_incoming(handoff)  # before the reply, and before any reader hears the last layer
        except BaseException as exc:
            await channel.close()
            handoffs.fail_incoming(handoff, f"the producer's stream broke off: {exc}")
            raise
        handoff.channel = None
        await send_control(channel, transfer_id, {"stored": handoff.num_stored}, FrameKind.END)

    async def _receive_layers(self, channel: Channel, handoff: IncomingHandoff) -> None:
        def landed(header: FrameHeader, ok: bool) -> None:
            if not ok:
                self.node.metrics.dropped("checksum")
                raise CorruptBlock(f"handoff {handoff.transfer_id!r}: a block of layers {header.first_layer}… failed its checksum.")
            handoff.arrived(header)
            self.node.metrics.transferred("in", "handoff", 0, header.length)

        landing = Landing(channel, self.service.config.window_blocks, landed)
        while True:
            header = await channel.recv_header()
            if header.kind is FrameKind.END:
                await landing.finish()
                await channel.recv_bytes(header)
                if not handoff.all_arrived:
                    raise TransferFailed(
                        f"handoff {handoff.transfer_id!r} ended with layer {handoff.ready_layers} of {handoff.num_layers}."
                    )
                return
            if header.kind is FrameKind.ERROR:
                await channel.recv_bytes(header)
                raise TransferFailed(f"the producer cancelled handoff {handoff.transfer_id!r}.")
            if header.kind is not FrameKind.BLOCK:
                raise CorruptBlock(f"handoff {handoff.transfer_id!r}: unexpected {header.kind.name} frame.")
            await landing.start(header, handoff.destination_for(header))

    async def _capacity(self, channel: Channel, transfer_id: int, message: dict) -> None:
        free = sum(s.capacity_bytes - s.used_bytes for s in self.manager.tier_stats())
        await send_control(channel, transfer_id, {"node_id": self.node.node_id, "free_bytes": free})

    async def _hot(self, channel: Channel, transfer_id: int, message: dict) -> None:
        blocks = describable(self.manager.blocks(), self.manager.namespaces())
        chains = shared_prefixes(blocks, int(message["max_bytes"]))
        reply = [[namespace_to_wire(self.node.namespace(c.namespace)), c.parent, pack_hashes(list(c.hashes))] for c in chains]
        await send_control(channel, transfer_id, {"chains": reply})
