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
it can register it, its tenant salt as the salt's digest (a salt never leaves the daemon
of its engine); ``hashes`` one bytes string of 16-byte chain hashes. Every field is
checked first (kvstore/transfers/peer_requests.py). A fetch leases
the blocks first, so blocks on the peer's NVMe tier are promoted and verified before they
are sent. A store reserves slots and receives each block straight into its slot; a block
that fails its checksum is dropped and only the verified prefix before it is committed.
Any refusal is an ERROR frame with a sentence, after which the channel is closed.

A peer is trusted no more than it has to be: a conversation that makes no progress for
``transport.peer_idle_timeout_s`` is broken off (kvstore/transfers/idle.py) and gives back
its leases and reservations; namespaces peers register have their own bound and never
crowd out the ones this host's engines register (``Node.peer_namespace``).

Owner: the daemon's event loop; one task per channel (``serve``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvstore.chains import describable, shared_prefixes
from kvstore.errors import CorruptBlock, KVStoreError, PermissionDenied, TransferFailed
from kvstore.localproto import namespace_to_wire, pack_hashes
from kvstore.steps import run_steps
from kvstore.tier_kind import TierKind
from kvstore.transfers.handoff import IncomingHandoff
from kvstore.transfers.idle import Watched
from kvstore.transfers.peer_requests import checked_request
from kvstore.transport.base import Channel
from kvstore.transport.peer import Landing, buffer_of, send_blocks, send_control, send_error
from kvstore.transport.wire import FrameHeader, FrameKind, decode_control

if TYPE_CHECKING:
    from kvstore.transfers.service import TransferService

__all__ = ["PeerServer", "READER_OPS"]

# what an engine reading blocks itself may ask (transport/auth.py: its credential is a reader's)
READER_OPS = ("fetch",)

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
        idle_s = self.service.config.peer_idle_timeout_s
        try:
            while True:
                header = await channel.recv_header()  # between conversations nothing is held: no deadline
                async with asyncio.timeout(idle_s) as deadline:
                    watched = Watched(channel, deadline, idle_s)
                    if header.kind is not FrameKind.CONTROL:
                        raise CorruptBlock(f"a conversation must start with a CONTROL frame, got {header.kind.name}.")
                    op, fields = checked_request(decode_control(header, await watched.recv_bytes(header)))
                    if channel.role != "daemon" and op not in READER_OPS:
                        raise PermissionDenied(f"a {channel.role} may only {', '.join(READER_OPS)}; {op!r} needs a daemon's credential.")
                    await self._ops[op](watched, header.transfer_id, fields)
        except TimeoutError:
            logger.warning("peer %s made no progress for %ss; its conversation was broken off", channel.peer, idle_s)
        except TransferFailed:
            pass  # the peer hung up: every conversation cleans up after itself
        except KVStoreError as exc:
            logger.warning("peer %s: %s", channel.peer, exc)
            await send_error(channel, 0, exc)
        finally:
            await channel.close()

    # -- conversations ------------------------------------------------------------------------
    async def _fetch(self, channel: Watched, transfer_id: int, fields: dict) -> None:
        digest = fields["namespace"]
        lease = await run_steps(self.manager.acquire_steps(digest, fields["hashes"], TierKind.HOST))
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

    async def _store(self, channel: Watched, transfer_id: int, fields: dict) -> None:
        with self.node.peer_namespace(fields["namespace"]) as digest:
            await self._store_under(channel, transfer_id, fields, digest)

    async def _store_under(self, channel: Watched, transfer_id: int, fields: dict, digest: bytes) -> None:
        hashes = fields["hashes"]
        try:
            reservation = await run_steps(self.manager.reserve_steps(digest, hashes, fields["parent"]))
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

    async def _handoff(self, channel: Watched, transfer_id: int, fields: dict) -> None:
        with self.node.peer_namespace(fields["namespace"]) as digest:
            await self._handoff_under(channel, transfer_id, fields, digest)

    async def _handoff_under(self, channel: Watched, transfer_id: int, fields: dict, digest: bytes) -> None:
        namespace, hashes = fields["namespace"], fields["hashes"]
        handoffs = self.service.handoffs
        # the producer sends each layer as it computes it: it may rightly pause as long as a handoff may last
        channel.allow_idle(max(channel.idle_s, self.service.config.handoff_timeout_s))
        handoff = await handoffs.open_incoming(fields["transfer"], transfer_id, digest, hashes, fields["parent"], namespace.layout)
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

    async def _receive_layers(self, channel: Watched, handoff: IncomingHandoff) -> None:
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

    async def _capacity(self, channel: Watched, transfer_id: int, fields: dict) -> None:
        free = sum(s.capacity_bytes - s.used_bytes for s in self.manager.tier_stats())
        await send_control(channel, transfer_id, {"node_id": self.node.node_id, "free_bytes": free})

    async def _hot(self, channel: Watched, transfer_id: int, fields: dict) -> None:
        blocks = describable(self.manager.blocks(), self.manager.namespaces())
        chains = shared_prefixes(blocks, fields["max_bytes"])
        reply = [[namespace_to_wire(self.node.namespace(c.namespace)), c.parent, pack_hashes(list(c.hashes))] for c in chains]
        await send_control(channel, transfer_id, {"chains": reply})
