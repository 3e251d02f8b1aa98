"""The engine-side client: what a connector uses inside an engine process.

It connects to the local daemon over its Unix socket and maps the daemon's host slab
(shared memory) once; afterwards block bytes move with one memcpy each way and only slot
offsets cross the socket:

- ``lookup(namespace, hashes)`` → the tier of each block of the longest cached prefix;
- ``save(namespace, hashes, blocks)``: reserve slots → copy into the mapped slab → commit;
- ``load(namespace, hashes, into)``: lease the prefix (the daemon first promotes NVMe
  blocks into the slab) → copy out → release.

- ``load(…, allow_remote=True)`` first asks the daemon to fetch the blocks it misses
  from the peer that holds them (within a deadline), then loads as above;
- ``begin_save``/``commit``/``abort`` and ``acquire``/``release``: the same save and
  load with the slab slots handed out in place, for connectors that copy one layer at a
  time as the forward pass produces or needs it;
- ``handoff_*``: prefill → decode, layer by layer (kvstore/transfers/handoff.py): the producer
  writes layers into staging slots and hands each over as it is computed; the consumer
  waits for a layer only when its forward pass needs it.

Each call is one control round trip for any number of blocks (a save is reserve +
commit; a load is acquire + a release that is not waited for), repeated only when a
prefix is larger than the host tier can lease at once. ``KVStoreClient`` is blocking
(engine worker threads); ``AsyncKVStoreClient`` has the same calls as coroutines.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch

from kvstore.errors import DaemonUnavailable, InvalidArgument
from kvstore.hashing import BlockHash
from kvstore.localproto import (
    HEADER,
    PROTOCOL_VERSION,
    TIERS_BY_CODE,
    Op,
    encode_frame,
    namespace_to_wire,
    pack_hashes,
    raise_remote_error,
    unpack_hashes,
)
from kvstore.namespace import Namespace
from kvstore.paths import default_socket_path
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import byte_view, copy_bytes
from kvstore.tiers.host import SharedSlab
from kvstore.tiers.slab import Slot

__all__ = ["KVStoreClient", "AsyncKVStoreClient", "LookupResult", "HandoffSend", "HandoffReceive", "PendingSave", "Lease"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    tiers: tuple[TierKind, ...]  # tier of each block of the longest cached prefix
    block_size: int  # tokens per block

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def num_tokens(self) -> int:
        return len(self.tiers) * self.block_size


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


@dataclass(frozen=True, slots=True)
class Lease:
    """Leased slots of the longest cached prefix, readable until ``release``.

    ``views[k]`` is the slab slot of block k of the prefix; the blocks cannot be evicted
    or moved while leased."""

    lease_ids: tuple[int, ...]
    views: tuple[torch.Tensor, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.views)


class _Codec:
    """What both clients share: request bodies, reply decoding, slab copies."""

    def __init__(self) -> None:
        self.slab: SharedSlab | None = None
        self.node_id = ""
        self.block_bytes: dict[bytes, int] = {}
        self.block_size: dict[bytes, int] = {}

    def on_hello(self, result: list) -> None:
        slab_path, self.node_id, _version = result
        self.slab = SharedSlab.attach(slab_path)

    def on_register(self, namespace: Namespace, result: list) -> bytes:
        digest, block_bytes = result
        if digest != namespace.digest or block_bytes != namespace.block_bytes:
            raise InvalidArgument("the daemon derived a different namespace digest; client and daemon versions disagree.")
        self.block_bytes[digest] = block_bytes
        self.block_size[digest] = namespace.block_size
        return digest

    def nbytes(self, digest: bytes) -> int:
        try:
            return self.block_bytes[digest]
        except KeyError:
            raise InvalidArgument(
                f"namespace {digest.hex()} was not registered through this client; call register_namespace first."
            ) from None

    def checked_blocks(self, digest: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(blocks) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} hashes were given with {len(blocks)} block tensors.")
        nbytes = self.nbytes(digest)
        views = [byte_view(b) for b in blocks]
        for index, view in enumerate(views):
            if view.numel() != nbytes:
                raise InvalidArgument(f"block tensor #{index} holds {view.numel()} bytes; this namespace's blocks have {nbytes}.")
        return views

    def copy_in(self, digest: bytes, placements: list, views: list[torch.Tensor]) -> None:
        nbytes = self.block_bytes[digest]
        for index, offset in placements:
            copy_bytes(self.slab.view(Slot(offset, nbytes), nbytes), views[index])

    def slot_views(self, digest: bytes, offsets: list[int]) -> list[torch.Tensor]:
        nbytes = self.nbytes(digest)
        return [self.slab.view(Slot(offset, nbytes), nbytes) for offset in offsets]

    def handoff_receive(self, digest: bytes, transfer_id: str, result: list) -> HandoffReceive:
        blob, offsets, parent, ready = result
        return HandoffReceive(transfer_id, unpack_hashes(blob), parent, self.slot_views(digest, offsets), ready)

    def copy_out(self, digest: bytes, offsets: list[int], views: list[torch.Tensor]) -> None:
        nbytes = self.block_bytes[digest]
        for offset, view in zip(offsets, views):
            copy_bytes(view, self.slab.view(Slot(offset, nbytes), nbytes))

    @staticmethod
    def result(reply: list):
        if reply[0] != 0:
            raise_remote_error(reply[1], reply[2])
        return reply[1]

    def close(self) -> None:
        if self.slab is not None:
            self.slab.close()
            self.slab = None


class KVStoreClient:
    def __init__(self, socket_path: Path | str | None = None, timeout_s: float = 30.0) -> None:
        path = str(socket_path or default_socket_path())
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailable(
                f"cannot reach the kvstore daemon at {path} ({exc.strerror or exc}); is `kvstore serve` running?"
            ) from exc
        self._codec = _Codec()
        self._codec.on_hello(self._call(Op.HELLO, PROTOCOL_VERSION))

    @property
    def node_id(self) -> str:
        return self._codec.node_id

    def register_namespace(self, namespace: Namespace) -> bytes:
        return self._codec.on_register(namespace, self._call(Op.REGISTER, namespace_to_wire(namespace)))

    def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> LookupResult:
        codes = self._call(Op.LOOKUP, namespace, pack_hashes(hashes))
        return LookupResult(tuple(map(TIERS_BY_CODE.__getitem__, codes)), self._codec.block_size.get(namespace, 0))

    def save(
        self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None = None
    ) -> int:
        """Store the blocks not cached yet; returns how many were stored."""
        views = self._codec.checked_blocks(namespace, hashes, blocks)
        reservation_id, placements = self._call(Op.RESERVE, namespace, pack_hashes(hashes), parent_hash)
        try:
            self._codec.copy_in(namespace, placements, views)
        except BaseException:
            self._call(Op.ABORT, reservation_id)
            raise
        return self._call(Op.COMMIT, reservation_id, None)

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

        With ``allow_remote`` the daemon first fetches missing blocks from the peer the
        index says holds the most of them (or from ``source``, a transport address); what
        has not arrived within ``deadline_s`` is left out (a shorter hit, recomputed)."""
        views = self._codec.checked_blocks(namespace, hashes, into)
        if allow_remote:
            self._call(Op.FETCH, namespace, pack_hashes(hashes), deadline_s, source)
        done = 0
        while done < len(hashes):
            lease_id, offsets = self._call(Op.ACQUIRE, namespace, pack_hashes(hashes[done:]))
            try:
                self._codec.copy_out(namespace, offsets, views[done:])
            finally:
                self._send(Op.RELEASE | Op.NO_REPLY, lease_id)
            if not offsets:
                break
            done += len(offsets)
        return done

    # -- prefill → decode handoff -----------------------------------------------------------
    def handoff_send(
        self, namespace: bytes, hashes: Sequence[BlockHash], transfer_id: str, destination: str, parent_hash: BlockHash | None = None
    ) -> HandoffSend:
        """Open a handoff of ``hashes`` to ``destination`` (a node id or a transport
        address); write each layer into the returned views, then `handoff_layers_ready`."""
        offsets = self._call(Op.HANDOFF_SEND, namespace, pack_hashes(hashes), parent_hash, transfer_id, destination)
        return HandoffSend(transfer_id, self._codec.slot_views(namespace, offsets))

    def handoff_layers_ready(self, transfer_id: str, first_layer: int, num_layers: int = 1) -> None:
        """Layers [first, first+n) of every block are written: the daemon sends them now."""
        self._send(Op.HANDOFF_READY | Op.NO_REPLY, transfer_id, first_layer, num_layers)

    def handoff_finish(self, transfer_id: str, timeout_s: float = 30.0) -> int:
        """Wait until the destination holds every layer; returns how many blocks it stored."""
        return self._call(Op.HANDOFF_FINISH, transfer_id, timeout_s)

    def handoff_cancel(self, transfer_id: str) -> None:
        self._call(Op.HANDOFF_CANCEL, transfer_id)

    def handoff_receive(self, namespace: bytes, transfer_id: str, timeout_s: float = 30.0) -> HandoffReceive:
        """Wait until the producer has announced the handoff; its layers arrive afterwards."""
        return self._codec.handoff_receive(namespace, transfer_id, self._call(Op.HANDOFF_RECEIVE, namespace, transfer_id, timeout_s))

    def handoff_wait_layers(self, transfer_id: str, stop_layer: int, timeout_s: float = 30.0) -> int:
        """Return once layers [0, stop_layer) of every block arrived verified."""
        return self._call(Op.HANDOFF_WAIT, transfer_id, stop_layer, timeout_s)

    def handoff_close(self, transfer_id: str) -> None:
        """Done reading; the blocks stay in the store."""
        self._call(Op.HANDOFF_CLOSE, transfer_id)

    # -- in-place access: connectors that write or read a block one layer at a time --------
    # The views below are the slab slots themselves; a layer-wise connector fills a
    # reservation as the forward pass produces each layer and reads a lease as each
    # layer is needed, so no whole-block staging copy exists on either side.
    def begin_save(self, namespace: bytes, hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None) -> PendingSave:
        """Reserve slots for the blocks of ``hashes`` not cached yet; fill them, then ``commit``."""
        self._codec.nbytes(namespace)
        reservation_id, placements = self._call(Op.RESERVE, namespace, pack_hashes(hashes), parent_hash)
        indices = tuple(index for index, _ in placements)
        views = self._codec.slot_views(namespace, [offset for _, offset in placements])
        return PendingSave(reservation_id, indices, tuple(views))

    def commit(self, pending: PendingSave) -> int:
        """Make a filled reservation visible; returns how many blocks were stored."""
        return self._call(Op.COMMIT, pending.reservation_id, None)

    def abort(self, pending: PendingSave) -> None:
        """Drop a reservation whose slots were not (all) written; nothing becomes visible."""
        self._call(Op.ABORT, pending.reservation_id)

    def acquire(self, namespace: bytes, hashes: Sequence[BlockHash]) -> Lease:
        """Lease the longest cached prefix of ``hashes`` (NVMe blocks are promoted and
        verified first; a block that fails verification ends the prefix)."""
        self._codec.nbytes(namespace)
        lease_ids: list[int] = []
        views: list[torch.Tensor] = []
        try:
            while len(views) < len(hashes):
                lease_id, offsets = self._call(Op.ACQUIRE, namespace, pack_hashes(hashes[len(views) :]))
                lease_ids.append(lease_id)
                if not offsets:
                    break
                views.extend(self._codec.slot_views(namespace, offsets))
        except BaseException:
            self.release(Lease(tuple(lease_ids), ()))
            raise
        return Lease(tuple(lease_ids), tuple(views))

    def release(self, lease: Lease) -> None:
        """Give the leased slots back (not waited for: nothing can be done about a failure)."""
        for lease_id in lease.lease_ids:
            self._send(Op.RELEASE | Op.NO_REPLY, lease_id)

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
        self._codec.close()
        self._sock.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _send(self, *body) -> None:
        self._sock.sendall(encode_frame(list(body)))

    def _call(self, *body):
        self._send(*body)
        (length,) = HEADER.unpack(self._recv_exactly(4))
        return _Codec.result(msgpack.unpackb(self._recv_exactly(length), raw=False))

    def _recv_exactly(self, count: int) -> bytes:
        chunks, remaining = [], count
        while remaining:
            chunk = self._sock.recv(remaining)
            if not chunk:
                raise DaemonUnavailable("the kvstore daemon closed the connection; it may be restarting.")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)


class AsyncKVStoreClient:
    """The same calls as coroutines, for engines that run an event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._codec = _Codec()
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, socket_path: Path | str | None = None) -> AsyncKVStoreClient:
        path = str(socket_path or default_socket_path())
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError as exc:
            raise DaemonUnavailable(
                f"cannot reach the kvstore daemon at {path} ({exc.strerror or exc}); is `kvstore serve` running?"
            ) from exc
        client = cls(reader, writer)
        client._codec.on_hello(await client._call(Op.HELLO, PROTOCOL_VERSION))
        return client

    async def register_namespace(self, namespace: Namespace) -> bytes:
        return self._codec.on_register(namespace, await self._call(Op.REGISTER, namespace_to_wire(namespace)))

    async def lookup(self, namespace: bytes, hashes: Sequence[BlockHash]) -> LookupResult:
        codes = await self._call(Op.LOOKUP, namespace, pack_hashes(hashes))
        return LookupResult(tuple(map(TIERS_BY_CODE.__getitem__, codes)), self._codec.block_size.get(namespace, 0))

    async def save(
        self, namespace: bytes, hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor], parent_hash: BlockHash | None = None
    ) -> int:
        views = self._codec.checked_blocks(namespace, hashes, blocks)
        reservation_id, placements = await self._call(Op.RESERVE, namespace, pack_hashes(hashes), parent_hash)
        try:
            self._codec.copy_in(namespace, placements, views)
        except BaseException:
            await self._call(Op.ABORT, reservation_id)
            raise
        return await self._call(Op.COMMIT, reservation_id, None)

    async def load(
        self,
        namespace: bytes,
        hashes: Sequence[BlockHash],
        into: Sequence[torch.Tensor],
        allow_remote: bool = False,
        deadline_s: float = 2.0,
        source: str | None = None,
    ) -> int:
        views = self._codec.checked_blocks(namespace, hashes, into)
        if allow_remote:
            await self._call(Op.FETCH, namespace, pack_hashes(hashes), deadline_s, source)
        done = 0
        while done < len(hashes):
            lease_id, offsets = await self._call(Op.ACQUIRE, namespace, pack_hashes(hashes[done:]))
            try:
                self._codec.copy_out(namespace, offsets, views[done:])
            finally:
                async with self._lock:
                    self._writer.write(encode_frame([Op.RELEASE | Op.NO_REPLY, lease_id]))
            if not offsets:
                break
            done += len(offsets)
        return done

    async def close(self) -> None:
        self._codec.close()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    async def _call(self, *body):
        async with self._lock:  # one request in flight per connection: replies come in order
            self._writer.write(encode_frame(list(body)))
            try:
                (length,) = HEADER.unpack(await self._reader.readexactly(4))
                payload = await self._reader.readexactly(length)
            except asyncio.IncompleteReadError as exc:
                raise DaemonUnavailable("the kvstore daemon closed the connection; it may be restarting.") from exc
        return _Codec.result(msgpack.unpackb(payload, raw=False))
