"""A node: the tier manager plus what a daemon serving many clients adds around it.

- namespaces registered by clients (a block is only ever served under its namespace);
- ownership (DESIGN decision 12): every reservation, lease and lookup hold belongs to
  the client session that took it, and a call naming a handle of another session is refused
  (NotFound). What a session holds is let go when its owner is provably gone: its engine
  process exited (a killed engine leaks nothing). A session whose connection closed while
  its process still runs is *orphaned*: it keeps every slot it holds — the process may
  still be copying into or out of them — until the front end reports the process gone.
  Lookup holds read no bytes, so they go with the connection;
- metrics for every operation;
- housekeeping the daemon runs periodically (expired reservations and retentions,
  watermarks, gauges).

Calls that may wait for NVMe I/O (``begin_save``, ``begin_load``, ``put_inline``,
``get_inline``, ``prefetch_steps``) are steps (tiers/steps.py), which the daemon drives
without blocking its loop (kvstore/steps.py).

Both front ends — the local protocol engines use over the Unix socket and the gRPC API —
call this one object, so they validate and behave alike.

Owner: the daemon's event loop thread; nothing here is thread-safe.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import CapacityExhausted, InvalidArgument, KVStoreError, NotFound, ReservationExpired, TierUnavailable, UnknownNamespace
from kvstore.hashing import HASH_BYTES, BlockHash, chain_hashes
from kvstore.metrics import Metrics
from kvstore.namespace import Namespace, SaltDigest
from kvstore.tier_kind import TIER_BY_RANK, TierKind
from kvstore.tiers.base import TierStats, byte_view
from kvstore.tiers.manager import BlockInfo, EvictResult, ReadLease, Reservation, RetainResult, TierManager
from kvstore.tiers.steps import Steps

__all__ = ["Node", "NodeStats", "Limits", "BlockPage"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may ask for; larger requests are rejected, not truncated."""

    max_blocks_per_request: int = 65_536
    max_tokens_per_request: int = 4 * 1024 * 1024
    max_inline_bytes: int = 64 * 1024 * 1024
    max_page_size: int = 10_000
    max_namespaces: int = 4096  # distinct namespaces a node keeps (each costs a table entry for good)
    max_peer_namespaces: int = 1024  # of those, registered by peers only, on top: peers never take an engine's room


@dataclass(frozen=True, slots=True)
class NodeStats:
    node_id: str
    uptime_s: float
    tiers: tuple[TierStats, ...]
    failed_tiers: tuple[TierKind, ...]
    num_blocks: int
    num_namespaces: int
    num_leases: int
    num_reservations: int
    num_sessions: int
    counters: dict[str, int]
    problems: tuple[str, ...] = ()  # why the node is NOT_SERVING, one sentence each


@dataclass(frozen=True, slots=True)
class BlockPage:
    blocks: tuple[BlockInfo, ...]
    next_page_token: str  # empty on the last page
    total: int


logger = logging.getLogger(__name__)

MAX_HOLD_S = 600.0  # a lookup hold covers the lookup-to-load gap of an engine step, not storage
_FORGET_CANDIDATES = 16  # peer namespaces looked at to make room for one more: a registration stays O(1)


def _without_salt(namespace: Namespace) -> Namespace:
    """The namespace as this node keeps it: an engine may have sent its tenant salt (gRPC, an
    older client), but only the salt's digest is ever needed, so the salt is not kept."""
    return dataclasses.replace(namespace, tenant_salt=SaltDigest(namespace.salt_digest))


class _Session:
    __slots__ = ("reservations", "leases", "holds", "open")

    def __init__(self) -> None:
        self.reservations: set[int] = set()
        self.leases: set[int] = set()
        self.holds: set[int] = set()
        self.open = True  # False once its connection is gone


class Node:
    def __init__(self, node_id: str, manager: TierManager, metrics: Metrics, limits: Limits = Limits()) -> None:
        self.node_id = node_id
        self.manager = manager
        self.metrics = metrics
        self.limits = limits
        self.started_at = time.monotonic()
        self._sessions: dict[int, _Session] = {}
        self._orphans: dict[int, _Session] = {}  # connection gone, owner process not (yet)
        # what `kvstore stats --fleet` turns into this node's hit rate
        self.lookup_counts: collections.Counter[str] = collections.Counter()
        self._session_ids = itertools.count(1)
        self._hold_sessions: dict[int, int] = {}  # hold id → the session that took it
        # why health says NOT_SERVING: the host tier's file was removed or replaced under it
        self._host_slab_problem: str | None = None
        # registered by peers and by no engine of this host, oldest first, and how many peer
        # conversations are storing under each now (those are never forgotten)
        self._peer_namespaces: dict[bytes, None] = {}
        self._peer_namespaces_in_use: collections.Counter[bytes] = collections.Counter()

    # -- sessions -----------------------------------------------------------------------
    def open_session(self) -> int:
        session_id = next(self._session_ids)
        self._sessions[session_id] = _Session()
        return session_id

    def close_session(self, session_id: int, owner_gone: bool = True) -> bool:
        """End a session whose connection went. With its owner gone, abort what it reserved
        and release what it leased; otherwise keep all of it (the session is orphaned) and
        return False: call again with ``owner_gone`` once the owner's process exited."""
        session = self._sessions.pop(session_id, None) or self._orphans.pop(session_id, None)
        if session is None:
            return True
        session.open = False
        self._release_holds(session, list(session.holds))  # they read no bytes: nothing to wait for
        if not owner_gone and (session.reservations or session.leases):
            self._orphans[session_id] = session
            return False
        try:
            for reservation_id in session.reservations:
                with contextlib.suppress(NotFound):  # its commit was refused as expired, which freed it
                    self.manager.abort(reservation_id)
        finally:
            for lease_id in session.leases:
                with contextlib.suppress(NotFound):
                    self.manager.release(lease_id)
        return True

    def close_all_sessions(self) -> None:
        for session_id in [*self._sessions, *self._orphans]:
            self.close_session(session_id)

    # -- health ---------------------------------------------------------------------------
    @property
    def problems(self) -> tuple[str, ...]:
        """Why the node is not serving (gRPC health NOT_SERVING), one sentence each; empty
        while it serves."""
        return () if self._host_slab_problem is None else (self._host_slab_problem,)

    def check_host_slab(self) -> str | None:
        """Whether the host tier's file is still the one the daemon maps: the sentence saying
        it is not (logged the first time), or None. Engines already connected keep being
        served from the daemon's mapping, which is theirs too; the next engine to connect
        has the file recreated (``renew_host_slab``)."""
        problem = self.manager.host_slab_problem()
        if problem is not None and problem != self._host_slab_problem:
            logger.error("%s", problem)
        self._host_slab_problem = problem
        return problem

    def renew_host_slab(self, keep_session: int) -> list[int]:
        """At an engine's handshake: when the host tier's file was removed or replaced, end
        every other session (their engines map the old file, and must not be handed slots
        of the new one), recreate the file and drop the blocks the old one held (misses).
        Returns the sessions ended, for the front end to cut their connections; raises
        TierUnavailable when the file cannot be recreated."""
        problem = self.check_host_slab()
        if problem is None:
            return []
        try:
            dropped = self.manager.replace_host_slab()  # changes nothing when it fails: the engines keep the old file
        except KVStoreError as exc:
            raise TierUnavailable(f"{problem} Recreating it failed: {exc}") from exc
        ended = [session_id for session_id in [*self._sessions, *self._orphans] if session_id != keep_session]
        for session_id in ended:
            self.close_session(session_id, owner_gone=True)  # what their engines copy now lands in the old file only
        logger.warning(
            "Recreated the host tier file; the %d blocks the lost one held were dropped (misses) and %d engine sessions "
            "were ended (their engines reconnect and map the new file).",
            dropped,
            len(ended),
        )
        self.check_host_slab()
        return ended

    # -- namespaces -----------------------------------------------------------------------
    def register_namespace(self, namespace: Namespace) -> bytes:
        """Register a namespace for an engine (or an operator) of this host."""
        known = self.manager.namespaces()
        num_local = len(known) - len(self._peer_namespaces)
        if namespace.digest not in known and num_local >= self.limits.max_namespaces:
            raise CapacityExhausted(
                f"node {self.node_id} knows {num_local} namespaces, its limit; restart it to forget the ones no engine uses."
            )
        self.manager.register_namespace(_without_salt(namespace))
        self._peer_namespaces.pop(namespace.digest, None)
        return namespace.digest

    def register_peer_namespace(self, namespace: Namespace) -> bytes:
        """Register a namespace a peer sent blocks under. Peers' namespaces have a bound of
        their own beside the engines' (``Limits.max_peer_namespaces``), so a peer that
        invents namespaces fills only its share of the table, never an engine's; when that
        share is full, the oldest peer namespace that holds no block makes room."""
        if namespace.digest in self.manager.namespaces():
            return namespace.digest
        if len(self._peer_namespaces) >= self.limits.max_peer_namespaces and not self._forget_a_peer_namespace():
            raise CapacityExhausted(
                f"node {self.node_id} knows {len(self._peer_namespaces)} namespaces that only peers registered, its limit, "
                "and each holds blocks; it takes blocks under a new one once some are evicted."
            )
        self.manager.register_namespace(_without_salt(namespace))
        self._peer_namespaces[namespace.digest] = None
        return namespace.digest

    @contextlib.contextmanager
    def peer_namespace(self, namespace: Namespace) -> Iterator[bytes]:
        """``register_peer_namespace`` for a conversation that stores under it: the namespace
        is not forgotten while the conversation lasts."""
        digest = self.register_peer_namespace(namespace)
        self._peer_namespaces_in_use[digest] += 1
        try:
            yield digest
        finally:
            self._peer_namespaces_in_use[digest] -= 1
            if not self._peer_namespaces_in_use[digest]:
                del self._peer_namespaces_in_use[digest]

    def _forget_a_peer_namespace(self) -> bool:
        for digest in list(itertools.islice(self._peer_namespaces, _FORGET_CANDIDATES)):
            if digest not in self._peer_namespaces_in_use and self.manager.forget_namespace(digest):
                del self._peer_namespaces[digest]
                return True
            self._peer_namespaces[digest] = self._peer_namespaces.pop(digest)  # holds blocks: look at it last next time
        return False

    def namespace(self, digest: bytes) -> Namespace:
        known = self.manager.namespaces()
        if digest not in known:
            raise UnknownNamespace(f"namespace {digest.hex()} is not registered on node {self.node_id}.")
        found = known[digest]
        if found is None:
            raise UnknownNamespace(
                f"namespace {digest.hex()} has blocks recovered from NVMe but no engine has registered it since the "
                "restart; token ids cannot be hashed for it until one does (block hashes work)."
            )
        return found

    def hashes_for_tokens(self, digest: bytes, token_ids: Sequence[int]) -> list[BlockHash]:
        if len(token_ids) > self.limits.max_tokens_per_request:
            raise InvalidArgument(f"{len(token_ids)} token ids exceed the limit of {self.limits.max_tokens_per_request} per request.")
        return chain_hashes(token_ids, self.namespace(digest).block_size)

    # -- store ---------------------------------------------------------------------------
    def lookup(self, digest: bytes, hashes: Sequence[BlockHash]) -> list[TierKind]:
        """The tier of each block of the longest cached prefix of ``hashes`` (checked in
        shape by the front end)."""
        chain = b"".join(hashes)
        if len(chain) != HASH_BYTES * len(hashes):
            raise InvalidArgument(f"every block hash is {HASH_BYTES} bytes.")
        return list(map(TIER_BY_RANK.__getitem__, self.lookup_ranks(digest, chain)))

    def lookup_ranks(self, digest: bytes, chain: bytes) -> bytes:
        """``lookup`` of a chain of concatenated 16-byte hashes, as tier ranks (one byte per
        block): the engines' hot path, with no object per block."""
        num_asked = len(chain) // HASH_BYTES
        self._check_count(num_asked)
        return self._counted(digest, self.manager.lookup_ranks(digest, chain), num_asked)

    def _counted(self, digest: bytes, ranks: bytes, num_asked: int) -> bytes:
        """A lookup's hits and misses, in the metrics and the node's counts."""
        block_size = self._block_size(digest)
        self.metrics.lookup(digest, ranks, num_asked, block_size)
        hit, missed = len(ranks), num_asked - len(ranks)
        counts = self.lookup_counts
        counts["lookup_hit_blocks"] += hit
        counts["lookup_missed_blocks"] += missed
        counts["lookup_hit_tokens"] += hit * block_size
        counts["lookup_missed_tokens"] += missed * block_size
        return ranks

    def lookup_held(
        self, session_id: int, digests: Sequence[bytes], chain: bytes, hold_s: float, release: Sequence[int] = ()
    ) -> tuple[int, list[bytes]]:
        """``lookup_ranks`` of ``chain`` in each namespace of ``digests``, with every block
        reported held from eviction for ``hold_s`` (tiers/holds.py) or until released: the
        hold's id (0: nothing held) and the ranks per namespace. ``release``: holds of this
        session to let go first (a scheduler's loads that completed), so that releasing
        costs no round trip of its own; ids it no longer holds are ignored."""
        session = self._session(session_id)
        if not 0 < hold_s <= MAX_HOLD_S:
            raise InvalidArgument(f"a lookup hold lasts more than 0 and at most {MAX_HOLD_S:g} seconds, got {hold_s:g}.")
        self.release_holds(session_id, release)
        num_asked = len(chain) // HASH_BYTES
        self._check_count(num_asked)
        hold_id, ranks = self.manager.lookup_held(digests, chain, hold_s)
        for digest, found in zip(digests, ranks):
            self._counted(digest, found, num_asked)
        if hold_id:
            session.holds.add(hold_id)
            self._hold_sessions[hold_id] = session_id
        return hold_id, ranks

    def release_holds(self, session_id: int, hold_ids: Sequence[int]) -> None:
        """Let go of lookup holds of this session; one it no longer holds (expired, or
        another session's) is ignored: a hold's end is never an error to its holder."""
        session = self._session(session_id)
        self._release_holds(session, [hold_id for hold_id in hold_ids if hold_id in session.holds])

    def _release_holds(self, session: _Session, hold_ids: Sequence[int]) -> None:
        for hold_id in hold_ids:
            session.holds.discard(hold_id)
            self._hold_sessions.pop(hold_id, None)
            with contextlib.suppress(NotFound):
                self.manager.release_hold(hold_id)

    def begin_save(self, session_id: int, digest: bytes, hashes: Sequence[BlockHash], parent: BlockHash | None) -> Steps[Reservation]:
        session = self._session(session_id)
        self._check_hashes(hashes)
        reservation = yield from self.manager.reserve_steps(digest, hashes, parent)
        if not session.open:  # the connection went while room was being made
            self.manager.abort(reservation.id)
            raise NotFound(f"session {session_id} closed while its reservation was being made.")
        session.reservations.add(reservation.id)
        return reservation

    def commit_save(self, session_id: int, reservation_id: int, num_written: int | None, checksums: Sequence[int] | None) -> int:
        """Commit the session's reservation with the XXH3-64 its writer took of each block."""
        session = self._session(session_id)
        self._owned(session.reservations, reservation_id, "reservation")
        try:
            reservation = self.manager.reservation(reservation_id)
        except ReservationExpired:
            session.reservations.discard(reservation_id)  # its slots were freed with the refusal
            raise
        count = len(reservation.blocks) if num_written is None else num_written
        if checksums is None and count:
            raise InvalidArgument("a commit carries the XXH3-64 of each block written (taken by the writer); none were given.")
        stored = self.manager.commit(reservation_id, num_written, checksums)
        session.reservations.discard(reservation_id)
        self.metrics.stored(stored, stored * reservation.nbytes)
        return stored

    def abort_save(self, session_id: int, reservation_id: int) -> None:
        session = self._session(session_id)
        self._owned(session.reservations, reservation_id, "reservation")
        session.reservations.discard(reservation_id)
        self.manager.abort(reservation_id)

    def begin_load(self, session_id: int, digest: bytes, hashes: Sequence[BlockHash]) -> Steps[ReadLease]:
        session = self._session(session_id)
        self._check_hashes(hashes)
        ranks = self.manager.lookup_ranks(digest, b"".join(hashes))
        lease = yield from self.manager.acquire_steps(digest, hashes, TierKind.HOST)
        if not session.open:  # the connection went while the blocks were promoted
            self.manager.release(lease.id)
            raise NotFound(f"session {session_id} closed while its lease was being granted.")
        session.leases.add(lease.id)
        self.metrics.loaded(digest, ranks[: len(lease.blocks)], lease.nbytes)
        return lease

    def end_load(self, session_id: int, lease_id: int, corrupt_index: int | None = None) -> None:
        """Release the session's lease; ``corrupt_index``: its reader found that block's
        bytes do not match its checksum (the block is dropped)."""
        session = self._session(session_id)
        self._owned(session.leases, lease_id, "lease")
        session.leases.discard(lease_id)
        self.manager.release(lease_id, corrupt_index)

    def put_inline(self, digest: bytes, hashes: Sequence[BlockHash], payloads: Sequence[bytes], parent: BlockHash | None) -> Steps[int]:
        """Store blocks whose bytes came with the request (remote clients, small payloads)."""
        self._check_hashes(hashes)
        nbytes = self.manager.block_bytes(digest)
        total = sum(len(p) for p in payloads)
        if total > self.limits.max_inline_bytes:
            raise InvalidArgument(
                f"{total} inline bytes exceed the limit of {self.limits.max_inline_bytes}; use the local client for bulk data."
            )
        if len(payloads) != len(hashes):
            raise InvalidArgument(f"{len(hashes)} block hashes were given with {len(payloads)} payloads.")
        tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) if p else torch.empty(0, dtype=torch.uint8) for p in payloads]
        for block_hash, tensor in zip(hashes, tensors):
            if tensor.numel() != nbytes:
                raise InvalidArgument(f"block {block_hash.hex()} has {tensor.numel()} bytes; this namespace's blocks have {nbytes}.")
        stored = yield from self.manager.put_steps(digest, hashes, tensors, parent_hash=parent)
        self.metrics.stored(stored, stored * nbytes)
        return stored

    def get_inline(self, digest: bytes, hashes: Sequence[BlockHash]) -> Steps[list[bytes]]:
        """The bytes of the longest cached prefix of ``hashes`` (bounded by max_inline_bytes)."""
        self._check_hashes(hashes)
        nbytes = self.manager.block_bytes(digest)
        limit = max(1, self.limits.max_inline_bytes // nbytes)
        session_id = self.open_session()
        try:
            lease = yield from self.begin_load(session_id, digest, list(hashes)[:limit])
            return [bytes(byte_view(view).numpy()) for view in self.manager.lease_views(lease)]
        finally:
            self.close_session(session_id)

    # -- admin ---------------------------------------------------------------------------
    def stats(self) -> NodeStats:
        manager = self.manager
        return NodeStats(
            node_id=self.node_id,
            uptime_s=time.monotonic() - self.started_at,
            tiers=tuple(manager.tier_stats()),
            failed_tiers=tuple(sorted(manager.failed_tiers, key=lambda k: k.rank)),
            num_blocks=len(manager.catalogue),
            num_namespaces=len(manager.namespaces()),
            num_leases=manager.num_leases,
            num_reservations=manager.num_reservations,
            num_sessions=len(self._sessions),
            problems=self.problems,
            counters={
                **manager.counters,
                **self.lookup_counts,
                # what is held for owners that may still touch it (DESIGN decision 12)
                "sessions_orphaned": len(self._orphans),  # connections gone, processes alive
                "slots_quarantined": manager.quarantined_slots,  # expired reservations', kept for their writers
                "moves_in_flight": manager.num_moves_in_flight,
                "retained_blocks": manager.num_retained,  # keys retained for agent sessions between turns
                "retained_bytes": manager.retained_bytes,
            },
        )

    def list_blocks(
        self,
        digest: bytes | None = None,
        tier: TierKind | None = None,
        min_idle_s: float | None = None,
        page_size: int = 1000,
        page_token: str = "",
    ) -> BlockPage:
        if not 0 < page_size <= self.limits.max_page_size:
            raise InvalidArgument(f"page_size must lie in [1, {self.limits.max_page_size}], got {page_size}.")
        if digest is not None:
            self.manager.block_bytes(digest)
        # the tokens issued are plain decimal offsets; int() would also take "-3" (a page
        # from the end), " 3", "+3", "1_0" and non-ASCII digits
        if page_token and not (page_token.isascii() and page_token.isdigit()):
            raise InvalidArgument(f"page_token {page_token!r} was not issued by this node.")
        start = int(page_token) if page_token else 0
        now = time.monotonic()
        blocks = [b for b in self.manager.blocks(digest, tier) if min_idle_s is None or now - b.last_access >= min_idle_s]
        # stable order so that pages follow each other: oldest first
        blocks.sort(key=lambda b: (b.stored_at, b.block_hash))
        page = blocks[start : start + page_size]
        more = start + page_size < len(blocks)
        return BlockPage(tuple(page), str(start + page_size) if more else "", len(blocks))

    def evict(
        self,
        digest: bytes | None = None,
        hashes: Sequence[BlockHash] | None = None,
        tier: TierKind | None = None,
        min_idle_s: float | None = None,
    ) -> EvictResult:
        if hashes is not None:
            self._check_hashes(hashes)
        if digest is not None:
            self.manager.block_bytes(digest)
        result = self.manager.evict(digest, hashes, tier, min_idle_s)
        self.metrics.evicted_explicitly(result.num_evicted)
        return result

    def pin(self, digest: bytes, hashes: Sequence[BlockHash]) -> int:
        self._check_hashes(hashes)
        return self.manager.pin(digest, hashes)

    def unpin(self, digest: bytes, hashes: Sequence[BlockHash]) -> int:
        self._check_hashes(hashes)
        return self.manager.unpin(digest, hashes)

    # -- agent sessions between turns ------------------------------------------------------
    def retain(self, digest: bytes, hashes: Sequence[BlockHash], ttl_s: float) -> RetainResult:
        """Keep a session's chain through the pause before its next turn: evicted last,
        demoted rather than dropped, for ``ttl_s`` (cut to manager.max_retain_s); see
        ``TierManager.retain``."""
        self._check_hashes(hashes)
        result = self.manager.retain(digest, hashes, ttl_s)
        self.metrics.retain_requested(result.num_retained, len(hashes) - result.num_retained)
        return result

    def prefetch_steps(self, digest: bytes, hashes: Sequence[BlockHash]) -> Steps[int]:
        """Bring the cached prefix of ``hashes`` into the host tier, promoting (and
        verifying) what lies below it, so that an engine's next lookup finds it in memory;
        returns how many blocks of it are in the host tier after."""
        self._check_hashes(hashes)
        lease = yield from self.manager.acquire_steps(digest, hashes, TierKind.HOST)
        self.manager.release(lease.id)
        return len(lease.blocks)

    def housekeeping(self) -> None:
        """Periodic work that never waits: expire reservations and retentions, refresh
        gauges, check that the host tier's file is still there. (Demotion above the
        watermarks waits for NVMe; the daemon drives ``relieve_pressure_steps``.)"""
        self.check_host_slab()
        self.manager.expire_reservations()
        self.manager.expire_retention()
        for hold_id in self.manager.expire_holds():
            session = self._sessions.get(self._hold_sessions.pop(hold_id, 0))
            if session is not None:
                session.holds.discard(hold_id)
        self.metrics.refresh(self.manager)

    # -- checks --------------------------------------------------------------------------
    def _session(self, session_id: int) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise NotFound(f"session {session_id} is not open on node {self.node_id}.") from None

    @staticmethod
    def _owned(handles: set[int], handle: int, what: str) -> None:
        if handle not in handles:
            raise NotFound(
                f"{what} {handle} was not granted to this connection (or was given back already); a connection may only use its own."
            )

    def _check_hashes(self, hashes: Sequence[BlockHash]) -> None:
        # The front ends check each hash's shape where the bytes arrive (the local protocol
        # by construction, the gRPC API in kvstore/api/convert.py); the node bounds counts.
        self._check_count(len(hashes))

    def _check_count(self, num_blocks: int) -> None:
        if num_blocks > self.limits.max_blocks_per_request:
            raise InvalidArgument(f"{num_blocks} blocks exceed the limit of {self.limits.max_blocks_per_request} per request.")

    def _block_size(self, digest: bytes) -> int:
        namespace = self.manager.namespace(digest)
        return namespace.block_size if namespace is not None else 0
