"""The engine-side client: what a connector uses inside an engine process.

It connects to the local daemon over its Unix socket and maps the daemon's host slab
(shared memory) once; afterwards block bytes move with one memcpy each way and only slot
offsets cross the socket:

- ``lookup(namespace, hashes)`` → the tier of each block of the longest cached prefix;
- ``save(namespace, hashes, blocks)``: reserve slots → copy into the mapped slab, taking
  each block's XXH3-64 with the copy (beside it, on a helper thread, for a large save) →
  commit with the checksums;
- ``load(namespace, hashes, into)``: lease the prefix (the daemon first promotes NVMe
  blocks into the slab) → copy out (verified against the writers' checksums where the
  daemon or the caller asks) → release;
- ``load(…, allow_remote=True)`` loads this node's prefix as above, asks the daemon which
  peer holds the rest, and receives those blocks from that peer itself, straight into the
  engine's tensors (kvstore/remote_read.py; a UCX peer or device tensors: the daemon
  fetches them into its host tier first), all within a deadline; ``fetch`` brings blocks
  into this node's tiers instead;
- ``begin_save``/``commit``/``abort`` and ``acquire``/``release``: the same save and
  load with the slab slots handed out in place, for connectors that copy one layer at a
  time as the forward pass produces or needs it;
- ``handoff_*``: prefill → decode, layer by layer (kvstore/transfers/handoff.py).

**One core, two faces.** Every call is written once, as a generator of requests
(``_Core``): it yields each request it needs answered (or only sent) and is resumed with
the answer. ``KVStoreClient`` runs them over a blocking socket (engine worker threads),
``AsyncKVStoreClient`` over asyncio streams; neither holds a copy of any call's body.
A blocking call polls for its answer for up to ``spin_s`` (200 µs by default) before it
sleeps in ``recv``: a lookup is answered in about the time a sleeping reader takes to be
woken on another CPU. It polls only while a CPU of the host is idle (``spare_cpu_now``):
on a host whose cores the engines keep busy, the poll would take the CPU the daemon needs
to answer, or one of the engine's own compute threads.

**Never wrong, never fatal** (DESIGN decisions 12, 14):

- Replies are matched by request id. A call that times out raises ``DaemonUnavailable``
  and poisons nothing: its late answer is recognised and what it granted (a lease, a
  reservation) is given back. While an answer is overdue, calls wait ``LAG_GRACE_S`` for
  it and then fail at once, instead of each waiting out its timeout.
- A daemon that goes away is ``DaemonUnavailable`` (a ``KVStoreError``), never an
  ``OSError``. The client reconnects by itself on a later call (backing off up to
  ``MAX_BACKOFF_S``), maps the new daemon's slab and registers its namespaces again;
  handles from the old daemon are dead (a commit of one raises, a release of one is a
  no-op). The transition is logged once each way.
- The client only gives back slots it holds by telling the daemon: ``close`` aborts and
  releases what is still out, so the daemon never has to guess whether a live process
  still copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvstore import localproto
from kvstore.errors import DaemonUnavailable, InvalidArgument, KVStoreError
from kvstore.hashing import BlockHash
from kvstore.localproto import HEADER, MAX_REPLY_BYTES, OP_NAMES, PROTOCOL_VERSION, TIERS_BY_CODE, Op
from kvstore.namespace import Namespace
from kvstore.paths import check_client_path, default_socket_path
from kvstore.remote_read import DirectRead, PeerReader
from kvstore.tier_kind import TierKind
from kvstore.tiers import device
from kvstore.tiers.base import (
    HELPER_BATCH_BYTES,
    byte_view,
    checksums_beside,
    copy_all,
    copy_all_checksummed,
    copy_checksummed,
    has_spare_core,
    spare_cpu_now,
)
from kvstore.tiers.host import SharedSlab
from kvstore.tiers.slab import Slot

__all__ = ["KVStoreClient", "AsyncKVStoreClient", "LookupResult", "HeldLookup", "HandoffSend", "HandoffReceive", "PendingSave", "Lease"]

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0
LAG_GRACE_S = 0.1  # while an answer is overdue, how long a call waits for it before failing at once
# how long a connection may spend mapping the slab's pages in before a helper thread
# takes over (tiers/prefault.py): the first save of a fresh process runs at warm speed
_PREFAULT_BUDGET_S = 0.2
# how long a blocking call polls for its answer before it sleeps in recv: a reader put to
# sleep is woken tens of µs after its answer lands (~45 µs on a 2-core VM, where a 512-key
# lookup is answered in ~60 µs), so the calls an engine waits on anyway are answered sooner
DEFAULT_SPIN_S = 200e-6
MAX_SPIN_S = 0.01


@dataclass(frozen=True, slots=True)
class LookupResult:
    ranks: bytes  # the rank (TierKind.rank) of the tier of each block of the longest cached prefix, one byte each
    block_size: int  # tokens per block

    @property
    def tiers(self) -> tuple[TierKind, ...]:
        """The tier of each block of the longest cached prefix."""
        return tuple(map(TIERS_BY_CODE.__getitem__, self.ranks))

    @property
    def num_blocks(self) -> int:
        return len(self.ranks)

    @property
    def num_tokens(self) -> int:
        return len(self.ranks) * self.block_size


@dataclass(frozen=True, slots=True)
class HeldLookup:
    """A lookup in several namespaces whose reported blocks are held from eviction."""

    hold_id: int  # 0: nothing was cached, nothing is held
    results: list[LookupResult]  # one per namespace asked, in order


@dataclass(frozen=True, slots=True)
class HandoffSend:
    transfer_id: str
    views: list[torch.Tensor]  # writable uint8 views of each block's staging slot, chain order


@dataclass(frozen=True, slots=True)
class HandoffReceive:
    transfer_id: str
    hashes: list[BlockHash]
    parent_hash: BlockHash | None
    views: list[torch.Tensor]  # uint8 views of each block's staging slot: read a layer once it is ready
    ready_layers: int

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True, slots=True)
class PendingSave:
    """Slots reserved for a save, written in place before ``commit``.

    ``views[k]`` is the writable slab slot (uint8, ``block_bytes`` long) of
    ``hashes[indices[k]]``; hashes that were cached already have no slot and nothing
    to write."""

    reservation_id: int
    indices: tuple[int, ...]
    views: tuple[torch.Tensor, ...]
    generation: int = 0  # the daemon connection it was made on


@dataclass(frozen=True, slots=True)
class Lease:
    """Leased slots of the longest cached prefix, readable until ``release``.

    ``views[k]`` is the slab slot of block k of the prefix; the blocks cannot be evicted
    or moved while leased."""

    lease_ids: tuple[int, ...]
    views: tuple[torch.Tensor, ...]
    generation: int = 0
    checksums: tuple[int, ...] = field(default=())

    @property
    def num_blocks(self) -> int:
        return len(self.views)


# -- what the core asks its face to do ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Request:
    """A request whose answer the call needs; ``give_back`` turns a late answer (after the
    call gave up) into the notices that return what it granted."""

    op: int
    args: tuple
    give_back: Callable[[Any], list[tuple[int, tuple]]] | None = None


@dataclass(frozen=True, slots=True)
class _DirectRead:
    """Blocks the call receives from a peer daemon itself, into ``destinations``
    (kvstore/remote_read.py); the answer is a ``DirectRead``. Not a request to the daemon:
    it runs on the calling thread, outside the connection's lock."""

    address: str
    namespace: bytes
    hashes: Sequence[BlockHash]
    destinations: list[memoryview]
    deadline_s: float


@dataclass(frozen=True, slots=True)
class _Notice:
    """A request sent without waiting for an answer (request id 0)."""

    op: int
    args: tuple


@dataclass(frozen=True, slots=True)
class _Detached:
    """A request sent without waiting for its answer, which ``on_reply`` gets (the whole
    reply: id, status, result) whenever a later call on the connection reads it; one that
    never comes (the connection breaks first) is never reported."""

    op: int
    args: tuple
    on_reply: Callable[[list], None]


Call = Generator["_Request | _Notice | _Detached | _DirectRead", Any, Any]


def _release_late(result: list) -> list[tuple[int, tuple]]:
    return [(Op.RELEASE, (result[0],))]


def _abort_late(result: list) -> list[tuple[int, tuple]]:
    return [(Op.ABORT, (result[0],))]


def _release_hold_late(result: list) -> list[tuple[int, tuple]]:
    return [(Op.HOLD_RELEASE, (localproto.pack_handles([result[0]]),))] if result[0] else []


class _Core:
    """The calls, as generators of requests; the state both faces share: the mapped slab,
    the namespaces, the handles still out, and the connection generation they belong to."""

    def __init__(self, verify_loads: bool | None, pin_for_gpu: bool = False) -> None:
        self.slab: SharedSlab | None = None
        self.pin_for_gpu = pin_for_gpu  # page-lock this process's mapping of the slab (tiers/device.py)
        self.pinned = False
        self.node_id = ""
        self.generation = 0
        self.namespaces: dict[bytes, Namespace] = {}
        self.block_bytes: dict[bytes, int] = {}
        self.block_size: dict[bytes, int] = {}
        self.verify_override = verify_loads
        self.daemon_verifies = False
        self.outstanding_leases: set[int] = set()
        self.outstanding_reservations: set[int] = set()
        self.peers = PeerReader()

    @property
    def verify(self) -> bool:
        return self.daemon_verifies if self.verify_override is None else self.verify_override

    # -- the connection ---------------------------------------------------------------------
    def hello(self) -> Call:
        """What a new connection says first: the handshake, then every namespace again."""
        slab_path, node_id, _version, verifies, reader = yield _Request(Op.HELLO, (PROTOCOL_VERSION,))
        self.peers.configure(reader)  # how this engine authenticates to peers it reads itself
        self._unmap()  # the old daemon's slab: views into it still held keep it mapped until they go
        self.slab = SharedSlab.attach(slab_path)
        if self.pin_for_gpu:
            self.pinned = device.pin_host_memory(self.slab.tensor)  # which faults every page in
        if not self.pinned:
            self.slab.prefault(_PREFAULT_BUDGET_S, "engine's mapping of the host tier")
        self.node_id, self.daemon_verifies = node_id, bool(verifies)
        self.generation += 1
        self.outstanding_leases.clear()
        self.outstanding_reservations.clear()
        for namespace in list(self.namespaces.values()):
            yield from self._register(namespace)

    def register_namespace(self, namespace: Namespace) -> Call:
        self.namespaces[namespace.digest] = namespace
        self.block_bytes[namespace.digest] = namespace.block_bytes
        self.block_size[namespace.digest] = namespace.block_size
        return (yield from self._register(namespace))

    def _register(self, namespace: Namespace) -> Call:
        digest, block_bytes = yield _Request(Op.REGISTER, (localproto.namespace_to_wire(namespace),))
        if digest != namespace.digest or block_bytes != namespace.block_bytes:
            raise InvalidArgument("the daemon derived a different namespace digest; client and daemon versions disagree.")
        return digest

    # -- lookups, saves, loads -------------------------------------------------------------------
    def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> Call:
        ranks = yield _Request(Op.LOOKUP, (namespace, localproto.pack_hashes(hashes)))
        return LookupResult(ranks, self.block_size.get(namespace, 0))

    def lookup_shards(self, namespaces: Sequence[bytes], hashes: Sequence[BlockHash]) -> Call:
        replies = yield _Request(Op.LOOKUP_SHARDS, (b"".join(namespaces), localproto.pack_hashes(hashes)))
        return self._results(namespaces, replies)

    def lookup_held(self, namespaces: Sequence[bytes], hashes: Sequence[BlockHash], hold_s: float, release: Sequence[int]) -> Call:
        args = (b"".join(namespaces), localproto.pack_hashes(hashes), hold_s, localproto.pack_handles(release))
        hold_id, replies = yield _Request(Op.LOOKUP_HOLD, args, _release_hold_late)
        return HeldLookup(hold_id, self._results(namespaces, replies))

    def _results(self, namespaces: Sequence[bytes], replies: list[bytes]) -> list[LookupResult]:
        return [LookupResult(ranks, self.block_size.get(namespace, 0)) for namespace, ranks in zip(namespaces, replies)]

    def save(self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None) -> Call:
        views = self._checked_blocks(namespace, hashes, blocks)
        pending = yield from self.begin_save(namespace, hashes, parent_hash)
        try:
            checksums = _copy_in(pending.views, [views[index] for index in pending.indices])
        except Exception:
            yield from self.abort(pending)
            raise
        return (yield from self._commit(pending, checksums))

    def load(
        self,
        namespace: bytes,
        hashes: Sequence[BlockHash],
        into: Sequence[torch.Tensor],
        allow_remote: bool,
        deadline_s: float,
        source: str | None,
    ) -> Call:
        views = self._checked_blocks(namespace, hashes, into)
        started = time.monotonic()
        done = yield from self._load_cached(namespace, hashes, views)
        remaining = deadline_s - (time.monotonic() - started)
        if not allow_remote or done == len(hashes) or remaining <= 0:
            return done
        # the daemon's index lookup ends within what is left of the deadline, and then is a miss
        address, upto = yield _Request(Op.LOCATE, (namespace, localproto.pack_hashes(hashes), done, source, remaining))
        upto = min(upto, len(hashes))
        remaining = deadline_s - (time.monotonic() - started)
        if upto <= done or remaining <= 0:
            return done
        if self.peers.reads(address) and all(view.device.type == "cpu" for view in views[done:upto]):
            destinations = [memoryview(view.numpy()) for view in views[done:upto]]
            read = yield _DirectRead(address, namespace, hashes[done:upto], destinations, remaining)
            if read.num_blocks or read.num_dropped:
                with contextlib.suppress(KVStoreError):  # the blocks are loaded; only this node's metrics miss them
                    yield _Request(Op.FETCHED, (read.num_blocks, read.num_bytes, read.num_dropped))
            return done + read.num_blocks
        # a UCX peer, or device memory to fill: the daemon fetches into its host tier first
        yield _Request(Op.FETCH, (namespace, localproto.pack_hashes(hashes), remaining, address))
        return done + (yield from self._load_cached(namespace, hashes[done:], views[done:]))

    def _load_cached(self, namespace: bytes, hashes: Sequence[BlockHash], views: list[torch.Tensor]) -> Call:
        """Copy the longest prefix of ``hashes`` this node holds into ``views``; its length."""
        done = 0
        while done < len(hashes):
            lease = yield from self._acquire_once(namespace, hashes[done:])
            try:
                _copy_out(views[done : done + lease.num_blocks], lease.views)
            except Exception:
                yield from self.release(lease)
                raise
            yield from self.release(lease)
            if not lease.num_blocks:
                break
            done += lease.num_blocks
        return done

    def read_directly(self, step: _DirectRead) -> DirectRead:
        return self.peers.read(step.address, step.namespace, step.hashes, step.destinations, step.deadline_s)

    def begin_save(self, namespace: bytes, hashes: Sequence[BlockHash], parent_hash: BlockHash | None) -> Call:
        self.nbytes(namespace)
        reservation_id, placements = yield _Request(Op.RESERVE, (namespace, localproto.pack_hashes(hashes), parent_hash), _abort_late)
        self.outstanding_reservations.add(reservation_id)
        indices = tuple(index for index, _ in placements)
        views = self._slot_views(namespace, [offset for _, offset in placements])
        return PendingSave(reservation_id, indices, tuple(views), self.generation)

    def commit(self, pending: PendingSave) -> Call:
        """Commit slots filled in place: their checksums are taken now, from the slots."""
        return (yield from self._commit(pending, _checksums_of_slots(pending.views)))

    def _commit(self, pending: PendingSave, checksums: list[int]) -> Call:
        if pending.generation != self.generation:
            raise DaemonUnavailable("the kvstore daemon restarted since these slots were reserved; nothing was stored.")
        try:
            stored = yield _Request(Op.COMMIT, (pending.reservation_id, None, localproto.pack_checksums(checksums)))
        finally:
            self.outstanding_reservations.discard(pending.reservation_id)
        return stored

    def commit_detached(self, pending: PendingSave, on_reply: Callable[[list], None]) -> Call:
        """``commit`` without waiting for the daemon's answer (``_Detached``)."""
        if pending.generation != self.generation:
            raise DaemonUnavailable("the kvstore daemon restarted since these slots were reserved; nothing was stored.")
        checksums = _checksums_of_slots(pending.views)
        self.outstanding_reservations.discard(pending.reservation_id)  # the daemon's from here on, answered or not
        yield _Detached(Op.COMMIT, (pending.reservation_id, None, localproto.pack_checksums(checksums)), on_reply)

    def abort(self, pending: PendingSave) -> Call:
        if pending.generation != self.generation:
            return  # the daemon that reserved them is gone, and its reservations with it
        self.outstanding_reservations.discard(pending.reservation_id)
        yield _Notice(Op.ABORT, (pending.reservation_id,))

    def acquire(self, namespace: bytes, hashes: Sequence[BlockHash]) -> Call:
        self.nbytes(namespace)
        leases: list[Lease] = []
        total = 0
        try:
            while total < len(hashes):
                lease = yield from self._acquire_once(namespace, hashes[total:])
                leases.append(lease)
                if not lease.num_blocks:
                    break
                total += lease.num_blocks
        except Exception:
            for lease in leases:
                yield from self.release(lease)
            raise
        return Lease(
            tuple(i for lease in leases for i in lease.lease_ids),
            tuple(v for lease in leases for v in lease.views),
            self.generation,
            tuple(c for lease in leases for c in lease.checksums),
        )

    def _acquire_once(self, namespace: bytes, hashes: Sequence[BlockHash]) -> Call:
        """One lease; with verification on, cut where a block's bytes fail their checksum
        (the daemon is told, and drops that block)."""
        lease_id, offsets, blob = yield _Request(Op.ACQUIRE, (namespace, localproto.pack_hashes(hashes)), _release_late)
        self.outstanding_leases.add(lease_id)
        views = self._slot_views(namespace, offsets)
        checksums = localproto.unpack_checksums(blob)
        if self.verify:
            for index, (view, expected) in enumerate(zip(views, checksums)):
                if _checksum(view) != expected:
                    logger.warning("kvstore: block %s failed its checksum when loaded; it is dropped and recomputed", hashes[index].hex())
                    self.outstanding_leases.discard(lease_id)
                    yield _Notice(Op.RELEASE, (lease_id, index))
                    if not index:
                        return Lease((), (), self.generation, ())
                    # the blocks before it are sound: lease them again on their own
                    return (yield from self._acquire_once(namespace, hashes[:index]))
        return Lease((lease_id,), tuple(views), self.generation, tuple(checksums))

    def release(self, lease: Lease) -> Call:
        if lease.generation != self.generation:
            return  # the daemon that granted it is gone, and its leases with it
        for lease_id in lease.lease_ids:
            if lease_id in self.outstanding_leases:
                self.outstanding_leases.discard(lease_id)
                yield _Notice(Op.RELEASE, (lease_id,))

    def give_back_all(self) -> Call:
        """Before closing: abort and release what is still out."""
        for reservation_id in list(self.outstanding_reservations):
            yield _Notice(Op.ABORT, (reservation_id,))
        for lease_id in list(self.outstanding_leases):
            yield _Notice(Op.RELEASE, (lease_id,))
        self.outstanding_reservations.clear()
        self.outstanding_leases.clear()

    # -- prefill → decode handoff -----------------------------------------------------------
    def handoff_send(
        self, namespace: bytes, hashes: Sequence[BlockHash], transfer_id: str, destination: str, parent_hash: BlockHash | None
    ) -> Call:
        give_back = lambda _result: [(Op.HANDOFF_CANCEL, (transfer_id,))]  # noqa: E731
        offsets = yield _Request(
            Op.HANDOFF_SEND, (namespace, localproto.pack_hashes(hashes), parent_hash, transfer_id, destination), give_back
        )
        return HandoffSend(transfer_id, self._slot_views(namespace, offsets))

    def handoff_receive(self, namespace: bytes, transfer_id: str, timeout_s: float) -> Call:
        give_back = lambda _result: [(Op.HANDOFF_CLOSE, (transfer_id,))]  # noqa: E731
        blob, offsets, parent, ready = yield _Request(Op.HANDOFF_RECEIVE, (namespace, transfer_id, timeout_s), give_back)
        return HandoffReceive(transfer_id, localproto.unpack_hashes(blob), parent, self._slot_views(namespace, offsets), ready)

    def request(self, op: int, *args) -> Call:
        """A call whose answer is its result (handoff progress, and the like)."""
        return (yield _Request(op, args))

    def notice(self, op: int, *args) -> Call:
        yield _Notice(op, args)

    # -- checks and views ----------------------------------------------------------------------
    def nbytes(self, digest: bytes) -> int:
        try:
            return self.block_bytes[digest]
        except KeyError:
            raise InvalidArgument(
                f"namespace {digest.hex()} was not registered through this client; call register_namespace first."
            ) from None

    def _checked_blocks(self, digest: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(blocks) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes were given with {len(blocks)} block tensors.")
        nbytes = self.nbytes(digest)
        views = [byte_view(b) for b in blocks]
        for index, view in enumerate(views):
            if view.numel() != nbytes:
                raise InvalidArgument(f"block tensor #{index} holds {view.numel()} bytes; this namespace's blocks have {nbytes}.")
        return views

    def _slot_views(self, digest: bytes, offsets: list[int]) -> list[torch.Tensor]:
        nbytes = self.nbytes(digest)
        return [self.slab.view(Slot(offset, nbytes), nbytes) for offset in offsets]

    def close(self) -> None:
        self.peers.close()
        self._unmap()

    def _unmap(self) -> None:
        if self.slab is None:
            return
        if self.pinned:
            device.unpin_host_memory(self.slab.tensor)
            self.pinned = False
        self.slab.close()
        self.slab = None


# -- copies ---------------------------------------------------------------------------------------
def _checksum(view: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(view.numpy()))


def _copy_in(slots: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> list[int]:
    """Copy each source into its slab slot and return the XXH3-64 of each block: from host
    memory as the tiers copy (``copy_all_checksummed``: large batches hashed on a helper
    thread beside the copy); a device source is copied (and waited for) first, then hashed
    in the slab. A checksum the slot's bytes do not match is caught wherever the block is
    verified: a miss, never data."""
    if all(source.device.type == "cpu" for source in sources):
        return copy_all_checksummed([slot.data_ptr() for slot in slots], sources)
    checksums = []
    for slot, source in zip(slots, sources):
        if source.device.type != "cpu":
            slot.copy_(source)  # device → host: returns once the bytes are in the slab
            checksums.append(_checksum(slot))
            continue
        checksums.append(copy_checksummed(slot.data_ptr(), memoryview(slot.numpy()), source.data_ptr()))
    return checksums


def _checksums_of(buffers: list[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(buffer) for buffer in buffers]


def _checksums_of_slots(views: Sequence[torch.Tensor]) -> list[int]:
    """The XXH3-64 of each slot; many megabytes are hashed half on the helper thread."""
    buffers = [memoryview(view.numpy()) for view in views]
    if sum(view.numel() for view in views) < HELPER_BATCH_BYTES:
        return _checksums_of(buffers)
    half = len(buffers) // 2
    first = checksums_beside(buffers[:half])
    second = _checksums_of(buffers[half:])
    return first.result() + second


def _copy_out(targets: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]) -> None:
    """Copy leased slots into the engine's tensors; copies to a device are waited for
    before this returns, since the lease is released right after."""
    on_device = False
    copies = []
    for target, slot in zip(targets, slots):
        if target.device.type == "cpu":
            copies.append((target.data_ptr(), slot.data_ptr(), slot.numel()))
        else:
            target.copy_(slot, non_blocking=True)
            on_device = True
    copy_all(copies)  # 4 MiB or more: half of it on the helper thread, where there is a second core
    if on_device:
        torch.cuda.synchronize()


# -- the blocking face ---------------------------------------------------------------------------------
def default_spin_s() -> float:
    """``DEFAULT_SPIN_S`` where this process may run on two CPUs or more, else 0: on one
    CPU the poll would only keep the daemon from answering."""
    return DEFAULT_SPIN_S if has_spare_core() else 0.0


class _Wire:
    """One connection's frames, without the I/O: request ids, the reply buffer, and the
    requests abandoned by a timeout whose answers are still to come."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.next_id = 1
        self.abandoned: dict[int, _Request] = {}
        self.overdue_since = 0.0  # when the oldest abandoned request was given up
        self.detached: dict[int, Callable[[list], None]] = {}  # requests sent without waiting -> who gets the answer

    def request(self, request: _Request) -> tuple[int, bytes]:
        request_id, self.next_id = self.next_id, self.next_id + 1
        return request_id, localproto.encode_request(request_id, request.op, request.args)

    @staticmethod
    def notice(op: int, args: tuple) -> bytes:
        return localproto.encode_request(0, op, args)

    def replies(self) -> Iterator[list]:
        buffer = self.buffer
        while len(buffer) >= 4:
            (length,) = HEADER.unpack_from(buffer)
            if length > MAX_REPLY_BYTES:
                raise DaemonUnavailable(f"the kvstore daemon sent a {length}-byte reply; client and daemon versions disagree.")
            if len(buffer) < 4 + length:
                return
            body = bytes(buffer[4 : 4 + length])
            del buffer[: 4 + length]
            yield localproto.decode_reply(body)

    def abandon(self, request_id: int, request: _Request) -> None:
        if not self.abandoned:
            self.overdue_since = time.monotonic()
        self.abandoned[request_id] = request

    def detach(self, step: _Detached) -> bytes:
        request_id, frame = self.request(_Request(step.op, step.args))
        self.detached[request_id] = step.on_reply
        return frame

    def settle(self, reply: list) -> list[bytes]:
        """A reply to a detached request, for whoever waits for it; or to an abandoned
        request: the notices that give back what it granted."""
        on_reply = self.detached.pop(reply[0], None)
        if on_reply is not None:
            on_reply(reply)
            return []
        request = self.abandoned.pop(reply[0], None)
        if request is None:
            raise DaemonUnavailable(f"the kvstore daemon answered request {reply[0]}, which this client never sent.")
        if not self.abandoned:
            self.overdue_since = 0.0
        if reply[1] != 0 or request.give_back is None:
            return []
        return [self.notice(op, args) for op, args in request.give_back(reply[2])]


class _Connection:
    """A blocking socket to the daemon and its wire state."""

    def __init__(self, path: str, timeout_s: float, spin_s: float = 0.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self.wire = _Wire()
        self.broken = False
        # replies land here first: sock.recv(1 MiB) would allocate (and give back) a MiB per reply, ~10 µs
        self._landing = memoryview(bytearray(1 << 20))
        self._sock_timeout: float | None = None
        check_client_path(Path(path), "socket")  # whoever owns its directory may answer in the daemon's place
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._set_timeout(timeout_s)
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise DaemonUnavailable(
                f"cannot reach the kvstore daemon at {path} ({exc.strerror or exc}); is `kvstore serve` running?"
            ) from exc

    def call(self, request: _Request) -> Any:
        if self.wire.abandoned:
            self._collect(min(self.timeout_s, LAG_GRACE_S))  # late answers, come or coming
            if self.wire.abandoned:
                overdue = time.monotonic() - self.wire.overdue_since
                raise DaemonUnavailable(f"the kvstore daemon has not answered for {overdue:.1f}s; treating calls as misses until it does.")
        request_id, frame = self.wire.request(request)
        self._send(frame)
        if self.spin_s and spare_cpu_now():  # on a busy host the poll would take the daemon's CPU
            self._spin()
        deadline = time.monotonic() + self.timeout_s
        while True:
            for reply in self.wire.replies():
                if reply[0] == request_id:
                    if reply[1] != 0:
                        localproto.raise_reply_error(reply)
                    return reply[2]
                self._give_back(reply)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._receive(remaining):
                self.wire.abandon(request_id, request)
                raise DaemonUnavailable(f"the kvstore daemon did not answer {OP_NAMES[request.op]} within {self.timeout_s:g}s.")

    def notify(self, op: int, args: tuple) -> None:
        self._send(self.wire.notice(op, args))

    def detach(self, step: _Detached) -> None:
        self._send(self.wire.detach(step))

    def collect_detached(self) -> None:
        """Read replies until every detached request's answer has come (or ``timeout_s``)."""
        self._collect(self.timeout_s, self.wire.detached)

    def _spin(self) -> None:
        """Poll for up to ``spin_s`` until some of the answer has arrived; the call then
        reads the rest as it always does (sleeping in recv if it is longer in coming)."""
        until = time.perf_counter() + self.spin_s
        while not self._receive(0.0) and time.perf_counter() < until:
            os.sched_yield()  # the daemon runs first where the scheduler put it on this CPU

    def _collect(self, timeout_s: float, awaited: dict | None = None) -> None:
        """Take the answers that arrive within ``timeout_s`` until ``awaited`` (the abandoned
        requests, by default; or the detached ones) is empty, giving back what late ones granted."""
        awaited = self.wire.abandoned if awaited is None else awaited
        deadline = time.monotonic() + timeout_s
        while awaited:
            for reply in self.wire.replies():
                self._give_back(reply)
            remaining = deadline - time.monotonic()
            if not awaited or remaining <= 0 or not self._receive(remaining):
                break
        for reply in self.wire.replies():
            self._give_back(reply)

    def _give_back(self, reply: list) -> None:
        try:
            frames = self.wire.settle(reply)
        except DaemonUnavailable as exc:  # out of step: this connection cannot be trusted any more
            raise self._gone(f"{exc} Reconnecting.") from None
        for frame in frames:
            self._send(frame)

    def _set_timeout(self, timeout_s: float) -> None:
        # each settimeout is two fcntl calls: kept when within 10 ms of the one asked for
        # (a call's remaining time differs by microseconds from one receive to the next)
        current = self._sock_timeout
        if current is None or (timeout_s != current and (timeout_s <= 0 or current <= 0 or abs(timeout_s - current) >= 0.01)):
            self.sock.settimeout(timeout_s)
            self._sock_timeout = timeout_s

    def _send(self, frame: bytes) -> None:
        try:
            # a frame usually fits the socket's buffer: one non-blocking send, with no poll
            # before it (CPython polls a socket that has a timeout before every send) and no
            # timeout to switch (a syscall each way); what is left waits as a call may
            self._set_timeout(0.0)
            try:
                sent = self.sock.send(frame)
            except BlockingIOError:
                sent = 0
            if sent < len(frame):
                self._set_timeout(self.timeout_s)
                self.sock.sendall(memoryview(frame)[sent:])
        except TimeoutError as exc:
            raise DaemonUnavailable(f"the kvstore daemon did not take a request within {self.timeout_s:g}s.") from exc
        except OSError as exc:
            raise self._gone(f"the connection to the kvstore daemon broke ({exc.strerror or exc}); it may be restarting.") from exc

    def _receive(self, timeout_s: float) -> bool:
        """Read what has arrived within ``timeout_s``; False when nothing did."""
        try:
            self._set_timeout(timeout_s if timeout_s > 0 else 0.0)
            count = self.sock.recv_into(self._landing)
        except (TimeoutError, BlockingIOError):
            return False
        except OSError as exc:
            raise self._gone(f"the connection to the kvstore daemon broke ({exc.strerror or exc}); it may be restarting.") from exc
        if not count:
            raise self._gone("the kvstore daemon closed the connection; it may be restarting.")
        self.wire.buffer += self._landing[:count]
        return True

    def _gone(self, sentence: str) -> DaemonUnavailable:
        """The connection itself is over: the client connects afresh on a later call."""
        self.broken = True
        return DaemonUnavailable(sentence)

    def close(self) -> None:
        self.sock.close()


class KVStoreClient:
    """The client for engine threads. Safe to share between threads: each request and its
    answer are exchanged under a lock (a call's copies run outside it)."""

    def __init__(
        self,
        socket_path: Path | str | None = None,
        timeout_s: float = 30.0,
        verify_loads: bool | None = None,
        require_daemon: bool = True,
        pin_for_gpu: bool = False,
        spin_s: float | None = None,
    ) -> None:
        """``verify_loads``: check every loaded block against its writer's checksum (None:
        as the daemon is configured, ``server.verify_loads``). ``require_daemon`` False: a
        daemon that is not up yet is not an error here; calls are misses until it is.
        ``pin_for_gpu``: page-lock this process's mapping of the slab, for an engine that
        copies between it and a GPU (a no-op without CUDA). ``spin_s``: how long a call
        polls for its answer before sleeping (None: ``default_spin_s()``; 0: never polls)."""
        if spin_s is not None and not 0.0 <= spin_s <= MAX_SPIN_S:
            raise InvalidArgument(f"spin_s is between 0 and {MAX_SPIN_S:g} seconds, got {spin_s!r}.")
        self._path = str(socket_path or default_socket_path())
        self._timeout_s = timeout_s
        self._spin_s = default_spin_s() if spin_s is None else spin_s
        self._core = _Core(verify_loads, pin_for_gpu)
        self._lock = threading.RLock()
        self._connection: _Connection | None = None
        self._backoff_s = 0.0
        self._next_attempt = 0.0
        self._closed = False
        try:
            self._connect()
        except DaemonUnavailable:
            if require_daemon:
                raise
            logger.warning("kvstore: no daemon at %s yet; calls are misses until it is up", self._path)

    @property
    def node_id(self) -> str:
        return self._core.node_id

    @property
    def connected(self) -> bool:
        return self._connection is not None

    def register_namespace(self, namespace: Namespace) -> bytes:
        """Register ``namespace`` with the daemon; it is registered again on every reconnect."""
        return self._run(self._core.register_namespace(namespace))

    def lookup_shards(self, namespaces: Sequence[bytes], hashes: Sequence[BlockHash]) -> list[LookupResult]:
        """``lookup`` of the same chain in several namespaces (the ranks of a tensor-parallel
        engine), in one round trip."""
        return self._run(self._core.lookup_shards(namespaces, hashes))

    def lookup_held(
        self, namespaces: Sequence[bytes], hashes: Sequence[BlockHash], hold_s: float, release: Sequence[int] = ()
    ) -> HeldLookup:
        """``lookup_shards`` that keeps every block it reports from eviction for ``hold_s``
        or until ``release_holds`` of the returned hold id (tiers/holds.py): for a reader
        that counts blocks now and loads them a moment later (an engine's scheduler and
        its workers). ``release``: earlier holds to let go of in the same round trip.
        Holds end with this connection: after a reconnect the old ids are ignored."""
        return self._run(self._core.lookup_held(namespaces, hashes, hold_s, release))

    def release_holds(self, hold_ids: Sequence[int]) -> None:
        """Let go of lookup holds, without waiting for an answer."""
        if hold_ids:
            self._run(self._core.notice(Op.HOLD_RELEASE, localproto.pack_handles(hold_ids)))

    def ensure_namespace(self, namespace: Namespace) -> bytes:
        """Register ``namespace`` now if the daemon is up, else once it is back; its digest
        either way (for engines that must start whether or not the daemon runs)."""
        try:
            return self.register_namespace(namespace)
        except DaemonUnavailable:
            return namespace.digest

    def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> LookupResult:
        return self._run(self._core.lookup(namespace, hashes))

    def save(
        self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None = None
    ) -> int:
        """Store the blocks not cached yet; returns how many were stored."""
        return self._run(self._core.save(namespace, hashes, blocks, parent_hash))

    def load(
        self,
        namespace: bytes,
        hashes: Sequence[BlockHash],
        into: Sequence[torch.Tensor],
        allow_remote: bool = False,
        deadline_s: float = 2.0,
        source: str | None = None,
    ) -> int:
        """Copy the longest cached prefix of ``hashes`` into ``into``; returns its length.

        With ``allow_remote`` the blocks past this node's prefix come from the peer the
        index says holds the most of them (or from ``source``, a node id or transport
        address): from a TCP peer this process receives them into ``into`` itself
        (kvstore/remote_read.py; no copy is left on this node), from a UCX peer (or into
        device memory) the daemon fetches them into its host tier first. What has not
        arrived verified within ``deadline_s`` is left out (a shorter hit, recomputed);
        tensors past the returned count may have been written."""
        return self._run(self._core.load(namespace, hashes, into, allow_remote, deadline_s, source))

    def fetch(self, namespace: bytes, hashes: Sequence[BlockHash], deadline_s: float = 2.0, source: str | None = None) -> int:
        """Bring the blocks of ``hashes`` this node misses into its tiers, from the peer the
        index names (or ``source``, a transport address), within ``deadline_s``; returns
        the length of the prefix this node holds after (a prefetch ahead of the requests
        that will load it)."""
        return self._run(self._core.request(Op.FETCH, namespace, localproto.pack_hashes(hashes), deadline_s, source))

    # -- prefill → decode handoff -----------------------------------------------------------
    def handoff_send(
        self, namespace: bytes, hashes: Sequence[BlockHash], transfer_id: str, destination: str, parent_hash: BlockHash | None = None
    ) -> HandoffSend:
        """Open a handoff of ``hashes`` to ``destination`` (a node id or a transport
        address); write each layer into the returned views, then `handoff_layers_ready`."""
        return self._run(self._core.handoff_send(namespace, hashes, transfer_id, destination, parent_hash))

    def handoff_layers_ready(self, transfer_id: str, first_layer: int, num_layers: int = 1) -> None:
        """Layers [first, first+n) of every block are written: the daemon sends them now."""
        self._run(self._core.notice(Op.HANDOFF_READY, transfer_id, first_layer, num_layers))

    def handoff_finish(self, transfer_id: str, timeout_s: float = 30.0) -> int:
        """Wait until the destination holds every layer; returns how many blocks it stored."""
        return self._run(self._core.request(Op.HANDOFF_FINISH, transfer_id, timeout_s), timeout_s)

    def handoff_cancel(self, transfer_id: str) -> None:
        self._run(self._core.request(Op.HANDOFF_CANCEL, transfer_id))

    def handoff_receive(self, namespace: bytes, transfer_id: str, timeout_s: float = 30.0) -> HandoffReceive:
        """Wait until the producer has announced the handoff; its layers arrive afterwards."""
        return self._run(self._core.handoff_receive(namespace, transfer_id, timeout_s), timeout_s)

    def handoff_wait_layers(self, transfer_id: str, stop_layer: int, timeout_s: float = 30.0) -> int:
        """Return once layers [0, stop_layer) of every block arrived verified."""
        return self._run(self._core.request(Op.HANDOFF_WAIT, transfer_id, stop_layer, timeout_s), timeout_s)

    def handoff_close(self, transfer_id: str) -> None:
        """Done reading; the blocks stay in the store."""
        self._run(self._core.request(Op.HANDOFF_CLOSE, transfer_id))

    # -- in-place access: connectors that write or read a block one layer at a time --------
    # The views below are the slab slots themselves; a layer-wise connector fills a
    # reservation as the forward pass produces each layer and reads a lease as each
    # layer is needed, so no whole-block staging copy exists on either side.
    def begin_save(self, namespace: bytes, hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None) -> PendingSave:
        """Reserve slots for the blocks of ``hashes`` not cached yet; fill them, then ``commit``."""
        return self._run(self._core.begin_save(namespace, hashes, parent_hash))

    def commit(self, pending: PendingSave) -> int:
        """Make a filled reservation visible (with the checksums of its slots, taken now);
        returns how many blocks were stored."""
        return self._run(self._core.commit(pending))

    def commit_detached(self, pending: PendingSave, on_reply: Callable[[int | None, str], None]) -> None:
        """``commit``, without waiting for the daemon's answer: the slots' checksums are
        taken now and the commit is sent; ``on_reply(stored, error)`` gets how many blocks
        were stored (or None and the daemon's error) when a later call on this client reads
        the answer, on that call's thread. For a caller on an engine's critical path, whose
        next call comes soon (the next step's), that only counts what a commit stored."""

        def reply(answer: list) -> None:
            if answer[1] == 0:
                on_reply(answer[2], "")
            else:
                on_reply(None, f"{answer[2]}: {answer[3] if len(answer) > 3 else ''}")

        self._run(self._core.commit_detached(pending, reply))

    def collect_detached(self) -> None:
        """Wait (up to the client's timeout) for the answers to the commits sent without
        waiting, so that their ``on_reply`` has run; a daemon that is away answers nothing."""
        with self._lock:
            if self._connection is None:
                return
            try:
                self._connection.collect_detached()
            except KVStoreError as exc:
                self._lost(exc)

    def abort(self, pending: PendingSave) -> None:
        """Drop a reservation whose slots were not (all) written; nothing becomes visible."""
        self._run(self._core.abort(pending))

    def acquire(self, namespace: bytes, hashes: Sequence[BlockHash]) -> Lease:
        """Lease the longest cached prefix of ``hashes`` (NVMe blocks are promoted and
        verified first; a block that fails verification ends the prefix)."""
        return self._run(self._core.acquire(namespace, hashes))

    def release(self, lease: Lease) -> None:
        """Give the leased slots back (not waited for: nothing can be done about a failure)."""
        self._run(self._core.release(lease))

    # -- slab access in place: for connectors whose engine memory is strided (SGLang's
    # host pool, LMCache's chunks), so bytes move in one strided copy, not two ------------
    @contextlib.contextmanager
    def writing(
        self, namespace: bytes, hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None
    ) -> Iterator[list[tuple[int, torch.Tensor]]]:
        """Reserve slots for the blocks of ``hashes`` not cached yet and yield ``(index in
        hashes, slab bytes)`` for each; the caller fills them. Committed when the ``with``
        body finishes, aborted when it raises, so a half-written block is never visible."""
        pending = self.begin_save(namespace, hashes, parent_hash)
        try:
            yield list(zip(pending.indices, pending.views))
        except BaseException:
            self.abort(pending)
            raise
        self.commit(pending)

    @contextlib.contextmanager
    def reading(self, namespace: bytes, hashes: Sequence[BlockHash]) -> Iterator[list[torch.Tensor]]:
        """Lease the longest cached prefix of ``hashes`` and yield the slab bytes of its
        blocks, valid until the ``with`` body ends; the lease keeps them from being evicted
        or overwritten meanwhile."""
        lease = self.acquire(namespace, hashes)
        try:
            yield list(lease.views)
        finally:
            self.release(lease)

    def close(self) -> None:
        with self._lock:
            connection, self._connection = self._connection, None
            if connection is not None:
                with contextlib.suppress(KVStoreError):
                    self._drive(self._core.give_back_all(), connection)
                connection.close()
            self._closed = True
            self._core.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- running calls ----------------------------------------------------------------------
    def _run(self, call: Call, timeout_s: float | None = None) -> Any:
        connection = self._connect()
        if timeout_s is not None and timeout_s + 5.0 > connection.timeout_s:
            connection = _Widened(connection, timeout_s + 5.0)  # a call that itself waits that long
        return self._drive(call, connection)

    def _drive(self, call: Call, connection) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = call.throw(error) if error is not None else call.send(value)
            except StopIteration as done:
                return done.value
            value, error = None, None
            if isinstance(step, _DirectRead):
                value = self._core.read_directly(step)  # outside the lock: it moves the bytes
                continue
            try:
                with self._lock:
                    if isinstance(step, _Notice):
                        connection.notify(step.op, step.args)
                    elif isinstance(step, _Detached):
                        connection.detach(step)
                    else:
                        value = connection.call(step)
            except KVStoreError as exc:
                if connection.broken:
                    self._lost(exc)
                error = exc

    def _connect(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise DaemonUnavailable("this kvstore client was closed.")
            if self._connection is not None:
                return self._connection
            now = time.monotonic()
            if now < self._next_attempt:
                raise DaemonUnavailable(
                    f"the kvstore daemon at {self._path} is not reachable; retrying in {self._next_attempt - now:.1f}s."
                )
            connection = None
            try:
                connection = _Connection(self._path, self._timeout_s, self._spin_s)
                self._drive(self._core.hello(), connection)
            except KVStoreError:
                self._backoff_s = min(MAX_BACKOFF_S, max(0.05, self._backoff_s * 2))
                self._next_attempt = now + self._backoff_s
                if connection is not None:
                    connection.close()
                raise
            if self._backoff_s:
                logger.info("kvstore: reconnected to the daemon at %s (node %s)", self._path, self._core.node_id)
            self._backoff_s, self._next_attempt = 0.0, 0.0
            self._connection = connection
            return connection

    def _lost(self, exc: KVStoreError) -> None:
        with self._lock:
            if self._connection is None:
                return
            self._connection.close()
            self._connection = None
            self._backoff_s = 0.05
            self._next_attempt = time.monotonic()  # the first reconnect is tried at once
            logger.warning("kvstore: lost the daemon at %s (%s); calls are misses until it is back", self._path, exc)


class _Widened:
    """A connection whose calls may take ``timeout_s`` (a handoff wait), for one call."""

    def __init__(self, connection: _Connection, timeout_s: float) -> None:
        self._connection, self._timeout_s = connection, timeout_s

    def call(self, request: _Request) -> Any:
        saved, self._connection.timeout_s = self._connection.timeout_s, self._timeout_s
        try:
            return self._connection.call(request)
        finally:
            self._connection.timeout_s = saved

    def notify(self, op: int, args: tuple) -> None:
        self._connection.notify(op, args)

    @property
    def broken(self) -> bool:
        return self._connection.broken


# -- the asyncio face -----------------------------------------------------------------------------------
async def _finished_in_thread(function: Callable[[Any], Any], argument: Any) -> Any:
    """``function(argument)`` on a worker thread, awaited to its end even when the caller is
    cancelled: a direct read writes into the caller's tensors until it returns, so the
    call that owns them must not end before it (the read's deadline bounds the wait)."""
    work = asyncio.get_running_loop().run_in_executor(None, function, argument)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


class AsyncKVStoreClient:
    """The same calls as coroutines, for engines that run an event loop. Requests on one
    connection are pipelined: each answer goes to the call that asked, by request id."""

    def __init__(self, path: str, timeout_s: float, verify_loads: bool | None) -> None:
        self._path = path
        self._timeout_s = timeout_s
        self._core = _Core(verify_loads)
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._wire = _Wire()
        self._waiting: dict[int, tuple[_Request, asyncio.Future]] = {}
        self._connecting = asyncio.Lock()

    @classmethod
    async def connect(
        cls, socket_path: Path | str | None = None, timeout_s: float = 30.0, verify_loads: bool | None = None
    ) -> AsyncKVStoreClient:
        client = cls(str(socket_path or default_socket_path()), timeout_s, verify_loads)
        await client._ensure_connected()
        return client

    @property
    def node_id(self) -> str:
        return self._core.node_id

    async def register_namespace(self, namespace: Namespace) -> bytes:
        return await self._run(self._core.register_namespace(namespace))

    async def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> LookupResult:
        return await self._run(self._core.lookup(namespace, hashes))

    async def save(
        self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None = None
    ) -> int:
        return await self._run(self._core.save(namespace, hashes, blocks, parent_hash))

    async def load(
        self,
        namespace: bytes,
        hashes: Sequence[BlockHash],
        into: Sequence[torch.Tensor],
        allow_remote: bool = False,
        deadline_s: float = 2.0,
        source: str | None = None,
    ) -> int:
        return await self._run(self._core.load(namespace, hashes, into, allow_remote, deadline_s, source))

    async def begin_save(self, namespace: bytes, hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None) -> PendingSave:
        return await self._run(self._core.begin_save(namespace, hashes, parent_hash))

    async def commit(self, pending: PendingSave) -> int:
        return await self._run(self._core.commit(pending))

    async def abort(self, pending: PendingSave) -> None:
        await self._run(self._core.abort(pending))

    async def acquire(self, namespace: bytes, hashes: Sequence[BlockHash]) -> Lease:
        return await self._run(self._core.acquire(namespace, hashes))

    async def release(self, lease: Lease) -> None:
        await self._run(self._core.release(lease))

    async def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(KVStoreError):
                await self._drive(self._core.give_back_all())
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()
        if self._reading is not None:
            self._reading.cancel()
        self._core.close()

    # -- running calls ----------------------------------------------------------------------
    async def _run(self, call: Call) -> Any:
        await self._ensure_connected()
        return await self._drive(call)

    async def _drive(self, call: Call) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = call.throw(error) if error is not None else call.send(value)
            except StopIteration as done:
                return done.value
            value, error = None, None
            try:
                if isinstance(step, _DirectRead):
                    value = await _finished_in_thread(self._core.read_directly, step)
                elif isinstance(step, _Notice):
                    self._write(self._wire.notice(step.op, step.args))
                else:
                    value = await self._call(step)
            except KVStoreError as exc:
                error = exc

    async def _call(self, request: _Request) -> Any:
        request_id, frame = self._wire.request(request)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = (request, answer)
        self._write(frame)
        try:
            reply = await asyncio.wait_for(asyncio.shield(answer), self._timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            self._give_up(request_id, request)
            raise DaemonUnavailable(f"the kvstore daemon did not answer {OP_NAMES[request.op]} within {self._timeout_s:g}s.") from None
        except asyncio.CancelledError:
            self._give_up(request_id, request)
            raise
        if reply[1] != 0:
            localproto.raise_reply_error(reply)
        return reply[2]

    def _give_up(self, request_id: int, request: _Request) -> None:
        if self._waiting.pop(request_id, None) is not None:
            self._wire.abandon(request_id, request)

    def _write(self, frame: bytes) -> None:
        if self._writer is None or self._writer.is_closing():
            raise DaemonUnavailable("the connection to the kvstore daemon is closed; it may be restarting.")
        self._writer.write(frame)

    async def _ensure_connected(self) -> None:
        async with self._connecting:
            if self._writer is not None and not self._writer.is_closing():
                return
            try:
                reader, writer = await asyncio.open_unix_connection(self._path)
            except OSError as exc:
                raise DaemonUnavailable(
                    f"cannot reach the kvstore daemon at {self._path} ({exc.strerror or exc}); is `kvstore serve` running?"
                ) from exc
            self._writer, self._wire = writer, _Wire()
            self._reading = asyncio.ensure_future(self._read(reader))
            await self._drive(self._core.hello())

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Hand each answer to the call that asked; a late one gives back what it granted."""
        try:
            while True:
                chunk = await reader.read(1 << 20)
                if not chunk:
                    break
                self._wire.buffer += chunk
                for reply in self._wire.replies():
                    waiting = self._waiting.pop(reply[0], None)
                    if waiting is not None:
                        if not waiting[1].done():
                            waiting[1].set_result(reply)
                        continue
                    for frame in self._wire.settle(reply):
                        self._write(frame)
        except (OSError, KVStoreError) as exc:
            logger.warning("kvstore: the connection to the daemon broke: %s", exc)
        finally:
            gone = DaemonUnavailable("the kvstore daemon closed the connection; it may be restarting.")
            for _, answer in self._waiting.values():
                if not answer.done():
                    answer.set_exception(gone)
            self._waiting.clear()
            if self._writer is not None:
                self._writer.close()
