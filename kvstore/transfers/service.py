"""The daemon's transfer service: every block that moves between this node and a peer.

    remote fetch   a local lookup missed blocks the index says a peer holds: reserve
                   local slots, ask the peer, receive into the slots, commit what
                   arrived verified before the deadline (the rest is recomputed)
    store          push whole chains into a peer's tiers (drain, warm-up)
    handoff        prefill → decode, layer by layer (kvstore/transfers/handoff.py)
    serving        the same conversations started by peers (kvstore/transfers/peer_server.py)

Peers find each other through the block-location index: every node registers its
transport address there, and a destination may be named by node id or by address.

Integrity: a block leaves with the checksum its writer committed (the receiver refuses
bytes that changed since) and arrives verified against it, which is the checksum it is
committed with here. Slots a broken-off transfer may still touch (a UCX receive posted
past a deadline) are freed only once its channel settles (kvstore/transfers/settling.py).

Owner: the daemon's event loop; the tier manager is only touched from it, and every wait
for NVMe I/O is awaited (kvstore/steps.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import torch

from kvstore.errors import CorruptBlock, IndexUnavailable, InvalidArgument, KVStoreError, NotFound, TransferFailed
from kvstore.hashing import BlockHash
from kvstore.index.base import Index
from kvstore.localproto import checked_count, checked_parent, namespace_to_wire, pack_hashes
from kvstore.namespace import Namespace
from kvstore.steps import run_steps
from kvstore.tier_kind import TierKind
from kvstore.tiers.records import Reservation
from kvstore.transfers.handoff import HandoffState, IncomingHandoff, OutgoingHandoff
from kvstore.transfers.handoffs import HandoffRegistry
from kvstore.transfers.idle import Watched
from kvstore.transfers.peer_requests import checked_hashes, peer_namespace
from kvstore.transfers.peer_server import PeerServer
from kvstore.transfers.settling import Settling
from kvstore.transport.base import Channel, Transport
from kvstore.transport.config import TransportConfig
from kvstore.transport.peer import ChannelPool, Landing, buffer_of, leading, recv_message, request, send_blocks, send_control
from kvstore.transport.wire import FrameHeader, FrameKind

__all__ = ["TransferService"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TransferService:
    def __init__(self, node, transport: Transport, config: TransportConfig, index: Index) -> None:
        self.node = node
        self.manager = node.manager
        self.transport = transport
        self.config = config
        self.index = index
        self.pool = ChannelPool(transport, config.connect_timeout_s)
        self.auth = transport.auth  # how peers and this node prove who they are
        self.settling = Settling()
        self.handoffs = HandoffRegistry(node.manager, config.handoff_timeout_s, self.settling)
        self.server = PeerServer(self)
        self.address = ""
        self._transfer_ids = iter(range(1, 1 << 62))
        self._serving: set[asyncio.Task] = set()

    async def start(self) -> str:
        self.address = await self.transport.listen(self.config.host, self.config.port, self._on_channel)
        return self.address

    async def close(self) -> None:
        self.handoffs.close()
        await self.pool.close()
        await self.transport.close()
        for task in list(self._serving):
            task.cancel()
        self.settling.close()

    async def _on_channel(self, channel: Channel) -> None:
        task = asyncio.current_task()
        self._serving.add(task)
        try:
            await self.server.serve(channel)
        finally:
            self._serving.discard(task)

    # -- shared by both directions ------------------------------------------------------------
    async def receive_blocks(
        self, channel: Channel, slots: dict[int, torch.Tensor], hashes: Sequence[BlockHash], count: int, verified: dict[int, int]
    ) -> None:
        """Receive ``count`` BLOCK frames, each into ``slots[seq]``, recording the checksum
        of each block that arrives verified in ``verified`` (the caller's, so that it knows
        what arrived even when a deadline cancels this). A block whose bytes fail their
        checksum is dropped and the stream stays in step; a frame that does not belong to
        this transfer breaks it off."""

        def landed(header: FrameHeader, ok: bool) -> None:
            if ok:
                verified[header.sequence] = header.checksum
            else:
                self.node.metrics.dropped("checksum")

        landing = Landing(channel, self.config.window_blocks, landed)
        for _ in range(count):
            header = await channel.recv_header()
            if header.kind is FrameKind.ERROR:
                await channel.recv_bytes(header)
                raise TransferFailed(f"the peer {channel.peer} broke off the transfer.")
            seq = header.sequence
            if header.kind is not FrameKind.BLOCK or seq not in slots or header.key != hashes[seq]:
                raise CorruptBlock(f"a frame from {channel.peer} does not belong to this transfer (block #{seq}).")
            into = buffer_of(slots[seq])
            if header.length != len(into):
                await channel.discard_payload(header)
                self.node.metrics.dropped("length")
                continue
            await landing.start(header, into)
        await landing.finish()

    def commit_received(self, channel: Channel | None, reservation: Reservation, order: Sequence[int], verified: dict[int, int]) -> int:
        """Commit the leading blocks of ``order`` that arrived verified, with the checksums
        they arrived with; the reservation's other slots are freed once ``channel`` can no
        longer land bytes in them (the verified ones are done). Returns how many were stored
        now: 0 when the commit has to wait for the channel."""
        count = leading(order, verified)
        checksums = [verified[seq] for seq in order[:count]]

        def commit() -> int:
            try:
                return self.manager.commit(reservation.id, count, checksums)
            except KVStoreError as exc:  # expired while it waited: nothing is stored, its slots are free
                logger.info("blocks received from a peer were not stored: %s", exc)
                return 0

        if channel is None or not channel.touching_buffers:
            return commit()
        self.settling.release_after(channel, commit)
        return 0

    async def expect_end(self, channel: Channel) -> dict:
        return await recv_message(channel, FrameKind.END)

    def next_transfer_id(self) -> int:
        return next(self._transfer_ids)

    async def resolve(self, destination: str, deadline_s: float | None = None, op: str = "resolve") -> str:
        """A transport address for a node id (through the index, within ``deadline_s``; by
        default transport.connect_timeout_s: resolving is part of connecting) or an address."""
        if "://" in destination:
            return destination
        try:
            nodes = await self._index_call(op, self.index.nodes(), deadline_s)
        except KVStoreError as exc:
            raise IndexUnavailable(f"cannot resolve node {destination!r}: the index is unreachable ({exc}).") from exc
        for info in nodes:
            if info.node_id == destination and info.transport_address:
                return info.transport_address
        raise NotFound(f"no live node {destination!r} with a transport address is in the index.")

    async def _index_call(self, op: str, call: Coroutine[Any, Any, T], deadline_s: float | None) -> T:
        """``call`` to the index, given up at the caller's deadline: a Redis that stopped
        answering costs an engine its deadline, never the index's own retries (seconds)."""
        deadline_s = self.config.connect_timeout_s if deadline_s is None else deadline_s
        try:
            async with asyncio.timeout(max(deadline_s, 0.0)):
                return await call
        except TimeoutError:
            self.node.metrics.index_timed_out(op)
            raise IndexUnavailable(
                f"the index did not answer within the {deadline_s:.3f}s deadline of a {op}; it counts as a miss."
            ) from None

    # -- remote fetch ---------------------------------------------------------------------------
    async def fetch_missing(self, digest: bytes, hashes: Sequence[BlockHash], deadline_s: float, source: str | None = None) -> int:
        """Bring the blocks of ``hashes`` this node misses from the peer holding the most
        of them (or ``source``); returns the length of the locally cached prefix after.
        The index lookup and the transfer share ``deadline_s``."""
        started = time.monotonic()
        have = len(self.manager.lookup(digest, hashes))
        if have == len(hashes):
            return have
        if source is None:
            source, upto = await self._best_source(digest, hashes, have, deadline_s, "fetch")
        else:
            upto = len(hashes)
        if source is None:
            return have
        remaining = deadline_s - (time.monotonic() - started)
        if remaining > 0:
            parent = hashes[have - 1] if have else None
            try:
                await self.fetch_from(source, digest, hashes[have:upto], parent, remaining)
            except KVStoreError as exc:
                logger.info("remote fetch from %s failed: %s", source, exc)
        return len(self.manager.lookup(digest, hashes))

    async def locate(
        self, digest: bytes, hashes: Sequence[BlockHash], have: int, source: str | None = None, deadline_s: float | None = None
    ) -> tuple[str, int]:
        """Where an engine that loaded the first ``have`` blocks itself reads the rest: the
        transport address of ``source`` (or of the peer the index says holds the most of
        the chain past ``have``) and how far that peer's blocks reach; ("", have) if none,
        or if the index does not answer within ``deadline_s`` (what is left of the load's)."""
        if source is not None:
            try:
                return await self.resolve(source, deadline_s, "locate"), len(hashes)
            except KVStoreError as exc:
                logger.info("remote read from %s skipped: %s", source, exc)
                return "", have
        address, upto = await self._best_source(digest, hashes, have, deadline_s, "locate")
        return address or "", upto

    async def _best_source(
        self, digest: bytes, hashes: Sequence[BlockHash], have: int, deadline_s: float | None, op: str
    ) -> tuple[str | None, int]:
        async def ask() -> tuple[list, dict]:
            matches = await self.index.match(digest, hashes)
            return matches, {n.node_id: n for n in await self.index.nodes()}

        try:
            matches, nodes = await self._index_call(op, ask(), deadline_s)
        except KVStoreError as exc:
            logger.info("remote fetch skipped, the index is unreachable: %s", exc)
            return None, have
        for match in matches:  # best first
            info = nodes.get(match.node_id)
            if match.node_id != self.node.node_id and match.num_blocks > have and info is not None and info.transport_address:
                return info.transport_address, match.num_blocks
        return None, have

    async def fetch_from(
        self, address: str, digest: bytes, hashes: Sequence[BlockHash], parent: BlockHash | None, deadline_s: float
    ) -> int:
        """Fetch a chain segment from ``address`` into reserved local slots; returns how
        many blocks were stored (the verified prefix that arrived before the deadline)."""
        reservation = await run_steps(self.manager.reserve_steps(digest, hashes, parent))
        if not reservation.blocks:
            self.manager.abort(reservation.id)
            return 0
        wanted = [b.block_hash for b in reservation.blocks]
        slots = dict(enumerate(self.manager.reservation_slots(reservation)))
        transfer_id = self.next_transfer_id()
        verified: dict[int, int] = {}
        channel = None
        broken = False
        try:
            async with asyncio.timeout(deadline_s):  # one deadline for connecting and receiving
                channel = await self.pool.checkout(address)
                reply = await request(channel, transfer_id, {"op": "fetch", "namespace": digest, "hashes": pack_hashes(wanted)})
                count = _answer(reply, "count", address, checked_count)
                if count > len(wanted):
                    raise CorruptBlock(f"the peer {address} offered {count} blocks of the {len(wanted)} asked for.")
                await self.receive_blocks(channel, slots, wanted, count, verified)
                await self.expect_end(channel)
            self.pool.checkin(address, channel)
        except (TimeoutError, asyncio.TimeoutError):
            logger.info(
                "remote fetch from %s: %d of %d blocks arrived before the %.3fs deadline", address, len(verified), len(wanted), deadline_s
            )
            broken = True
        except BaseException:
            broken = True
            if channel is not None:
                await self.pool.discard(channel)
            self.settling.release_after(channel, lambda: self.manager.abort(reservation.id))
            raise
        if broken and channel is not None:
            await self.pool.discard(channel)
        stored = self.commit_received(channel if broken else None, reservation, range(len(wanted)), verified)
        self.node.metrics.transferred("in", "fetch", stored, stored * reservation.nbytes)
        return stored

    # -- store (drain, warm-up) -------------------------------------------------------------
    async def push_chain(self, address: str, namespace: Namespace, hashes: Sequence[BlockHash], parent: BlockHash | None) -> int:
        """Copy cached blocks of a chain into the peer's tiers; returns how many it stored."""
        digest = namespace.digest
        lease = await run_steps(self.manager.acquire_steps(digest, hashes, TierKind.HOST))
        channel = None
        try:
            leased = [b.block_hash for b in lease.blocks]
            if not leased:
                return 0
            views = self.manager.lease_views(lease)
            transfer_id = self.next_transfer_id()
            channel = await self.pool.checkout(address)
            message = {"op": "store", "namespace": namespace_to_wire(namespace), "hashes": pack_hashes(leased), "parent": parent}
            async with self._conversation(channel, address) as watched:
                accepted = _answer(await request(watched, transfer_id, message), "accepted", address, _sequences(len(leased)))
                blocks = [(seq, leased[seq], buffer_of(views[seq]), lease.blocks[seq].checksum) for seq in accepted]
                await send_blocks(watched, transfer_id, digest, blocks)
                await send_control(watched, transfer_id, {}, FrameKind.END)
                stored = _answer(await self.expect_end(watched), "stored", address, checked_count)
            self.pool.checkin(address, channel)
            channel = None
        finally:
            if channel is not None:
                await self.pool.discard(channel)
            self.settling.release_after(channel, lambda: self.manager.release(lease.id))
        self.node.metrics.transferred("out", "store", len(accepted), len(accepted) * lease.nbytes)
        return stored

    async def capacity(self, address: str) -> int:
        async with self.pool.channel(address) as channel, self._conversation(channel, address) as watched:
            return _answer(await request(watched, self.next_transfer_id(), {"op": "capacity"}), "free_bytes", address, checked_count)

    async def hot_chains(self, address: str, max_bytes: int) -> list[tuple[Namespace, BlockHash | None, list[BlockHash]]]:
        """The hottest shared chains of the peer at ``address``, checked as any request from a
        peer is (kvstore/transfers/peer_requests.py)."""
        async with self.pool.channel(address) as channel, self._conversation(channel, address) as watched:
            reply = await request(watched, self.next_transfer_id(), {"op": "hot", "max_bytes": max_bytes})
        return _answer(reply, "chains", address, _chains)

    @contextlib.asynccontextmanager
    async def _conversation(self, channel: Channel, address: str) -> AsyncIterator[Watched]:
        """``channel`` for one conversation this node starts, broken off (TransferFailed) once
        the peer makes no progress for ``transport.peer_idle_timeout_s``."""
        idle_s = self.config.peer_idle_timeout_s
        try:
            async with asyncio.timeout(idle_s) as deadline:
                yield Watched(channel, deadline, idle_s)
        except TimeoutError:
            raise TransferFailed(f"the peer {address} made no progress for {idle_s}s; the transfer was broken off.") from None

    # -- handoff, producer side ------------------------------------------------------------------
    async def handoff_send(
        self, session: int, digest: bytes, hashes: Sequence[BlockHash], parent: BlockHash | None, transfer_id: str, destination: str
    ) -> OutgoingHandoff:
        namespace = self.node.namespace(digest)
        address = await self.resolve(destination)
        handoff = await self.handoffs.open_outgoing(session, transfer_id, digest, hashes, parent, namespace.layout, address)
        channel = None
        try:
            channel = await self.pool.checkout(address)
            message = {
                "op": "handoff", "transfer": transfer_id, "namespace": namespace_to_wire(namespace),
                "hashes": pack_hashes(list(hashes)), "parent": parent,
            }  # fmt: skip
            reply = await asyncio.wait_for(request(channel, handoff.wire_id, message), self.config.connect_timeout_s)
            if reply.get("accepted") != len(hashes):
                raise TransferFailed(
                    f"the peer {address} accepted {reply.get('accepted')} of {len(hashes)} blocks of handoff {transfer_id!r}."
                )
        except BaseException as exc:
            if channel is not None:
                await self.pool.discard(channel)
            self.handoffs.close_outgoing(handoff)
            if isinstance(exc, asyncio.TimeoutError):
                raise TransferFailed(f"the peer {address} did not answer handoff {transfer_id!r} in time.") from exc
            raise
        handoff.channel = channel
        handoff.task = asyncio.get_running_loop().create_task(self._send_layers(handoff, channel))
        return handoff

    async def _send_layers(self, handoff: OutgoingHandoff, channel: Channel) -> None:
        try:
            while handoff.layers_sent < handoff.num_layers:
                first, count = await handoff.pending.get()
                payloads = handoff.layer_payloads(first, count)
                await send_blocks(channel, handoff.wire_id, handoff.digest, payloads, first, count)
                handoff.layers_sent += count
                self.node.metrics.transferred("out", "handoff", 0, sum(len(p) for _, _, p, _ in payloads))
            await send_control(channel, handoff.wire_id, {}, FrameKind.END)
            reply = await self.expect_end(channel)
            handoff.complete(int(reply["stored"]))
            self.node.metrics.transferred("out", "handoff", len(handoff.hashes), 0)
            self.pool.checkin(handoff.destination, channel)
            handoff.channel = None
        except asyncio.CancelledError:
            await self.pool.discard(channel)  # the consumer sees the stream end and fails its side
            raise
        except KVStoreError as exc:
            handoff.fail(str(exc))
            await self.pool.discard(channel)

    def handoff_layers_ready(self, session: int, transfer_id: str, first_layer: int, num_layers: int) -> None:
        self.handoffs.outgoing_for(session, transfer_id).mark_ready(first_layer, num_layers)

    async def handoff_finish(self, session: int, transfer_id: str, timeout_s: float) -> int:
        """Wait until the consumer's daemon holds every layer; store the blocks here too."""
        handoff = self.handoffs.outgoing_for(session, transfer_id)
        if handoff.layers_ready != handoff.num_layers:
            raise InvalidArgument(
                f"handoff {transfer_id!r} cannot finish: layers {handoff.layers_ready}…{handoff.num_layers - 1} were never handed over."
            )
        try:
            deadline = time.monotonic() + timeout_s
            while handoff.state is HandoffState.OPEN:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferFailed(f"handoff {transfer_id!r} to {handoff.destination} did not finish within {timeout_s}s.")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(handoff.changed.wait(), remaining)
            handoff.raise_if_failed()
            with contextlib.suppress(KVStoreError):  # caching it here too is a bonus, not the handoff
                await run_steps(self.manager.put_steps(handoff.digest, handoff.hashes, handoff.views, handoff.parent))
            return handoff.num_stored_remote
        finally:
            self.handoffs.close_outgoing(handoff)

    def handoff_cancel(self, session: int, transfer_id: str) -> None:
        self.handoffs.close_outgoing(self.handoffs.outgoing_for(session, transfer_id))

    # -- handoff, consumer side ---------------------------------------------------------------
    async def handoff_receive(self, session: int, digest: bytes, transfer_id: str, timeout_s: float) -> IncomingHandoff:
        return await self.handoffs.attach(session, digest, transfer_id, timeout_s)

    async def handoff_wait(self, session: int, transfer_id: str, stop_layer: int, timeout_s: float) -> int:
        handoff = self.handoffs.incoming_for(session, transfer_id)
        if not 0 <= stop_layer <= handoff.num_layers:
            raise InvalidArgument(f"handoff {transfer_id!r} has {handoff.num_layers} layers; cannot wait for {stop_layer}.")
        await handoff.wait_layers(stop_layer, timeout_s)
        return handoff.ready_layers

    def handoff_close(self, session: int, transfer_id: str) -> None:
        self.handoffs.incoming_for(session, transfer_id)
        self.handoffs.detach(session, transfer_id)

    # -- lifetime ------------------------------------------------------------------------------
    def holds(self, session: int) -> bool:
        """Whether ``session`` owns or reads a handoff (whose staging it may still touch)."""
        return self.handoffs.holds(session)

    def close_session(self, session: int) -> None:
        self.handoffs.close_session(session)

    def housekeeping(self) -> None:
        self.handoffs.expire()


# -- what a peer answers, checked as what it asks is (kvstore/transfers/peer_requests.py) ---------------
def _answer(reply: Any, field: str, address: str, check: Callable[[Any], T]) -> T:
    """``reply[field]`` through ``check``; CorruptBlock where the peer answered anything else."""
    try:
        return check(reply[field])
    except (KeyError, TypeError, IndexError, InvalidArgument) as exc:
        raise CorruptBlock(f"the peer {address} answered with a malformed {field!r} ({exc}); the transfer was dropped.") from None


def _sequences(num_offered: int) -> Callable[[Any], list[int]]:
    def check(value: Any) -> list[int]:
        if not isinstance(value, list) or len(set(value)) != len(value):
            raise InvalidArgument("block positions are a list without repeats")
        for seq in value:
            if type(seq) is not int or not 0 <= seq < num_offered:
                raise InvalidArgument(f"a block position lies in [0, {num_offered})")
        return value

    return check


def _chains(value: Any) -> list[tuple[Namespace, BlockHash | None, list[BlockHash]]]:
    if not isinstance(value, list) or not all(isinstance(c, list) and len(c) == 3 for c in value):
        raise InvalidArgument("chains are a list of [namespace, parent, hashes]")
    return [(peer_namespace(ns), checked_parent(parent), checked_hashes(blob)) for ns, parent, blob in value]
