"""`RedisIndex` and `RedisSessionStore`: the fleet-wide index in Redis or Redis Cluster.

    RedisIndex(url)  url: redis://[user:pass@]host:port[/db], rediss://… (TLS),
                     redis+cluster://host:port, rediss+cluster://…, or any of the
                     first two with cluster=True (a seed node of a Redis Cluster).
    access=RedisAccess(tls_ca, tls_cert, tls_key, username, password)
                     whom to trust and who we are: over rediss:// the server's
                     certificate and host name are always checked; `check_access`
                     tells refused settings (credentials, certificates) from an outage.

Keys and scripts are described in index/redis_scripts.py. Sharding: every key a match
touches carries the namespace's hash tag, so one namespace (one model, layout and shard
of KV heads) lives on one Redis shard and a match is a single script there; the price is
that one hot namespace cannot spread its load over several shards. The registry (nodes,
leases) is one more tag, so a match costs at most two round trips: the live-node view
(cached in this process for ``view_ttl_s`` and never past the earliest lease deadline it
saw), then the MATCH script, which searches each node's prefix with a few hundred probes
instead of reading every block (exact for prefix-closed holdings; `RedisIndex.match`).

Leases and epochs: ``register`` sets the node's lease (SET PX) and starts a new epoch
when the lease was missing or this process registers the node for the first time (a
daemon restarted within its lease lost its memory tiers: what the index knew is stale). A block
map belongs to an epoch; maps of older epochs or of nodes without a lease are ignored
by every match and unlinked by the next match or ``sweep`` of their namespace, so a dead
node vanishes when its lease expires, without anyone deleting its blocks.

Failure contract for the daemon (kvstore/publisher.py follows it): every Redis error
surfaces as ``IndexUnavailable`` after a bounded, exponentially backed-off retry; the index
may then have lost or half applied what the node published. ``register`` returns False
(an extension of `Index.register`) when it did not renew a current lease but began a new
epoch: the lease had lapsed (Redis restarted empty, heartbeats stalled) or this process
registers the node for the first time; the node's earlier blocks are then gone from
every answer. After either, the node keeps serving its own blocks and publishes
``[AllBlocksCleared(), *its catalogue]`` once Redis answers.

Owner: one asyncio event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import math
import ssl
import time
import urllib.parse
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from kvstore.errors import IndexUnavailable, InvalidArgument
from kvstore.events import AllBlocksCleared, BlockEvent, BlockMoved, BlockRemoved, BlockStored
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.index import redis_scripts
from kvstore.index.base import MAX_CHAIN_BLOCKS, Index, NodeInfo, NodeMatch, SessionAffinity, SessionStore
from kvstore.index.redis_scripts import RedisBoundary, RedisClient
from kvstore.tier_kind import TierKind

__all__ = ["RedisAccess", "RedisIndex", "RedisSessionStore", "connect", "tls_refusal"]

MAX_HASHES_PER_CALL = 8192  # bounds how long one APPLY script holds the Redis shard
MAX_NODE_ID_CHARS = 256
TLS_VERDICT_S = 1.0  # how long a handshake must stand before Redis counts as accepting it
_TIER_BY_RANK = {tier.rank: tier for tier in TierKind}


@dataclass(frozen=True, slots=True)
class RedisAccess:
    """How this process knows it talks to Redis, and proves who it is: the CA that signed
    the server's certificate and a client certificate (rediss:// only: the certificate and
    the host name are always checked), and a Redis ACL user. Credentials in the URL work
    too; these keep them out of it."""

    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    username: str = ""
    password: str = field(default="", repr=False)

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS settings of ``options``, for a handshake of our own (`tls_refusal`)."""
        context = ssl.create_default_context(cafile=None if self.tls_ca is None else str(self.tls_ca))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.tls_cert is not None:
            context.load_cert_chain(str(self.tls_cert), None if self.tls_key is None else str(self.tls_key))
        return context

    def options(self, url: str) -> dict[str, Any]:
        """redis-py's connection options for ``url`` (already stripped of ``+cluster``)."""
        options: dict[str, Any] = {}
        if self.username:
            options["username"] = self.username
        if self.password:
            options["password"] = self.password
        tls_files = (self.tls_ca, self.tls_cert, self.tls_key)
        if not url.startswith("rediss://"):
            if any(path is not None for path in tls_files):
                raise InvalidArgument("TLS files are given for a plain redis:// index URL; use rediss:// to speak TLS to Redis.")
            return options
        options.update(ssl_cert_reqs="required", ssl_check_hostname=True, ssl_min_version=ssl.TLSVersion.TLSv1_2)
        if self.tls_ca is not None:
            options["ssl_ca_certs"] = str(self.tls_ca)
        if self.tls_cert is not None:
            options["ssl_certfile"], options["ssl_keyfile"] = str(self.tls_cert), str(self.tls_key)
        return options


def connect(
    url: str, *, cluster: bool = False, timeout_s: float = 2.0, retries: int = 3, access: RedisAccess = RedisAccess()
) -> RedisClient:
    """A client for ``url`` whose calls fail within a few seconds when Redis is down:
    ``retries`` reconnects, 50 ms doubling to 1 s apart, each bounded by ``timeout_s``."""
    for scheme in ("redis+cluster://", "rediss+cluster://"):
        if url.startswith(scheme):
            url, cluster = url.replace("+cluster", "", 1), True
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise InvalidArgument(f"a Redis index URL starts with redis://, rediss:// or redis+cluster://, got {_redacted(url)!r}.")
    if timeout_s <= 0 or retries < 0:
        raise InvalidArgument(f"timeout_s must be positive and retries not negative, got {timeout_s} and {retries}.")
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries)
    options = access.options(url)
    if cluster:
        return RedisCluster.from_url(url, retry=retry, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **options)
    return aioredis.Redis.from_url(url, retry=retry, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **options)


async def tls_refusal(url: str, access: RedisAccess) -> ssl.SSLError | None:
    """The TLS alert with which the Redis at ``url`` (rediss://) refuses this process's
    certificate, or the reason this side does not trust Redis's; None when the handshake
    stands for TLS_VERDICT_S or the server cannot be reached. Nothing is sent after the
    handshake, so a server that refuses the certificate has no unread bytes and closes
    cleanly, and its alert cannot be lost to a reset (as it can under a command's reply)."""
    where = urllib.parse.urlsplit(url.replace("+cluster", "", 1))
    try:
        context = access.ssl_context()
        async with asyncio.timeout(TLS_VERDICT_S):
            reader, writer = await asyncio.open_connection(where.hostname, where.port or 6379, ssl=context)
            try:
                await reader.read(1)  # Redis speaks only when spoken to: a refusal is all that can arrive
            finally:
                writer.close()
    except ssl.SSLError as exc:
        return exc
    except (OSError, TimeoutError):
        return None
    return None


def _boundary(url: str, client: RedisClient | None, cluster: bool, timeout_s: float, retries: int, access: RedisAccess) -> RedisBoundary:
    if client is not None:
        return RedisBoundary(client, url, owns_client=False)
    return RedisBoundary(connect(url, cluster=cluster, timeout_s=timeout_s, retries=retries, access=access), url, owns_client=True)


def _redacted(url: str) -> str:
    """``url`` without its user part, which may hold a password."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url.rpartition("@")[2]


def _check_prefix(key_prefix: str) -> str:
    if not key_prefix or any(c in key_prefix for c in "{}: "):
        raise InvalidArgument(f"key_prefix must be a non-empty word without braces, colons or spaces, got {key_prefix!r}.")
    return key_prefix


@dataclass(frozen=True, slots=True)
class _NodeState:
    info: NodeInfo
    num: int
    epoch: int
    lease_deadline: float  # time.monotonic() when its lease runs out; -inf when it had none


@dataclass(frozen=True, slots=True)
class _View:
    """The registry as of one fetch: who is alive until when, under which epoch."""

    fetched_at: float
    next_num: int
    nodes: tuple[_NodeState, ...]

    def fresh(self, now: float, ttl_s: float) -> bool:
        return now - self.fetched_at < ttl_s and all(n.lease_deadline > now or n.lease_deadline == -math.inf for n in self.nodes)

    def alive(self, now: float) -> list[_NodeState]:
        return [n for n in self.nodes if n.lease_deadline > now]


class RedisIndex(Index):
    def __init__(
        self,
        url: str,
        *,
        cluster: bool = False,
        key_prefix: str = "kvs",
        view_ttl_s: float = 0.5,
        forget_after_s: float = 86_400.0,
        timeout_s: float = 2.0,
        retries: int = 3,
        client: RedisClient | None = None,
        access: RedisAccess = RedisAccess(),
    ) -> None:
        """``view_ttl_s``: how stale this process's copy of the registry may be (a new node or
        a new epoch shows up within it; an expired lease disappears at its deadline).
        ``forget_after_s``: a node silent that long leaves the registry for good.
        ``client``: share one connection with a `RedisSessionStore` (not closed here).
        ``access``: TLS files and an ACL user (for a connection this index opens)."""
        if view_ttl_s < 0 or forget_after_s <= 0:
            raise InvalidArgument("view_ttl_s must not be negative and forget_after_s must be positive.")
        self._prefix = _check_prefix(key_prefix)
        self._redis = _boundary(url, client, cluster, timeout_s, retries, access)
        self._url, self._access = url, access
        self._view_ttl_s = view_ttl_s
        self._forget_after_ms = int(forget_after_s * 1000)
        self._view: _View | None = None
        self._registered: dict[str, tuple[int, int]] = {}  # node_id → (num, epoch) it publishes under
        self._announced: set[bytes] = set()  # namespaces added to the registry's set by this process
        registry = "{" + key_prefix + ":reg}"
        self._nodes_key, self._next_key = f"{registry}:nodes", f"{registry}:next"
        self._lease_prefix, self._spaces_key = f"{registry}:lease:", f"{registry}:spaces"

    @classmethod
    def from_url(cls, url: str) -> RedisIndex:
        return cls(url)

    @property
    def num_round_trips(self) -> int:
        return self._redis.num_round_trips

    @property
    def client(self) -> RedisClient:
        """This index's connection, to share with a `RedisSessionStore`."""
        return self._redis.client

    async def check_access(self) -> None:
        """Whether Redis accepts this process: InvalidArgument when it refuses its credentials
        or certificate (or presents one this side does not trust), IndexUnavailable when it
        cannot be reached. A server that refuses a client certificate may reset the
        connection under a command before its alert is read; a handshake alone tells."""
        try:
            await self._redis.check_access()
        except IndexUnavailable as exc:
            refusal = await tls_refusal(self._url, self._access) if self._url.startswith("rediss") else None
            if refusal is None:
                raise
            raise self._redis.tls_refused(refusal) from exc

    async def register(self, node: NodeInfo, lease_ttl_s: float) -> bool:
        """Set or renew the node's lease. True when a current lease was renewed; False when
        a new epoch began, i.e. the index holds none of the node's blocks any more."""
        _check_node_id(node.node_id)
        if not 0.001 <= lease_ttl_s <= 30 * 86_400:
            raise InvalidArgument(f"lease_ttl_s must lie in [0.001, 30 days], got {lease_ttl_s}.")
        info = msgpack.packb([node.grpc_address, node.transport_address, node.kind])
        first = node.node_id not in self._registered
        keys = (self._nodes_key, self._next_key, self._lease_prefix + node.node_id)
        args = (node.node_id, max(1, round(lease_ttl_s * 1000)), info, "1" if first else "0")
        with self._redis.translated(f"register of node {node.node_id!r}"):
            num, epoch, fresh = await self._redis.run(redis_scripts.REGISTER, keys, args)
        if fresh:
            self._announced.clear()  # Redis may have restarted empty
            self._view = None
        self._registered[node.node_id] = (int(num), int(epoch))
        return not fresh

    async def leave(self, node_id: str) -> None:
        _check_node_id(node_id)
        self._registered.pop(node_id, None)
        self._view = None
        with self._redis.translated(f"leave of node {node_id!r}"):
            await self._redis.run_many([], [("DEL", self._lease_prefix + node_id), ("HDEL", self._nodes_key, node_id)])

    async def publish(self, node_id: str, events: Sequence[BlockEvent]) -> None:
        if node_id not in self._registered:
            raise InvalidArgument(f"node {node_id!r} must register with this index before it publishes.")
        num, epoch = self._registered[node_id]
        cleared = max((i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)), default=-1)
        extra: list[tuple] = []
        if cleared >= 0:
            # A new epoch hides every earlier map of this node at once; what the batch did
            # before the clear is moot.
            epoch += 1
            extra.append(("HSET", self._nodes_key, node_id, f"{num} {epoch} {int(time.time() * 1000)}"))
        ops_by_space = _ops_by_namespace(events[cleared + 1 :])
        calls = []
        for namespace, ops in ops_by_space.items():
            if namespace not in self._announced:
                extra.append(("SADD", self._spaces_key, namespace.hex()))
            for chunk in _chunks(ops):
                calls.append((redis_scripts.APPLY, (self._space(namespace),), (num, epoch, *chunk)))
        if not calls and not extra:
            return
        try:
            with self._redis.translated(f"publish of {len(events)} events from node {node_id!r}"):
                results = await self._redis.run_many(calls, extra)
        except IndexUnavailable:
            self._announced.clear()
            raise
        self._registered[node_id] = (num, epoch)
        self._announced.update(ops_by_space)
        if cleared >= 0:
            self._view = None
        if any(r == -1 for r in results[: len(calls)]):
            self._registered.pop(node_id, None)
            raise IndexUnavailable(
                f"a newer epoch of node {node_id!r} owns its blocks in the index (another process registered "
                "it, or a failed publish half-applied a clear), so this batch was dropped; register again "
                "and re-publish the catalogue."
            )

    async def match(self, namespace: bytes, hashes: Sequence[BlockHash], node_ids: Collection[str] | None = None) -> list[NodeMatch]:
        """`Index.match` by a search of each node's holdings, not a walk of every block
        (index/redis_scripts.py, MATCH): exact where a node's holdings along the chain are
        prefix-closed, which leaf-first eviction keeps them. Across a hole the probes step
        over (narrower than MATCH_STRIDE blocks, and than its distance from the start of
        its tier run) a node's prefix may be reported longer than it is — never shorter,
        never across MATCH_STRIDE missing blocks in a row; fetching it is then a miss."""
        _check_namespace(namespace)
        chain = _joined(_bounded(hashes))
        if not chain:
            return []
        with self._redis.translated("match"):
            view = await self._current_view()
            states, by_num = _match_states(view, node_ids)
            if not by_num:
                return []
            reply = await self._redis.run(redis_scripts.MATCH, (self._space(namespace),), (chain, view.next_num, *states))
        return _matches(reply, by_num)

    async def match_many(self, namespace: bytes, chains: Sequence[bytes], node_ids: Collection[str] | None = None) -> list[list[NodeMatch]]:
        """`match` of each packed chain, the MATCH scripts sent in pipelines of at most
        MAX_CHAIN_BLOCKS hashes in all: one round trip per pipeline (and the registry view's
        when it is stale), however many chains; the packed chains go to Redis as they are."""
        _check_namespace(namespace)
        joined = [_packed(chain) for chain in chains]
        answers: list[list[NodeMatch]] = [[] for _ in joined]
        with self._redis.translated(f"a match of {len(joined)} chains"):
            view = await self._current_view()
            states, by_num = _match_states(view, node_ids)
            if not by_num:
                return answers
            space = (self._space(namespace),)
            batches: list[list[int]] = [[]]
            size = 0
            for i, chain in enumerate(joined):
                if not chain:
                    continue
                if batches[-1] and size + len(chain) > MAX_CHAIN_BLOCKS * HASH_BYTES:
                    batches.append([])
                    size = 0
                batches[-1].append(i)
                size += len(chain)
            for batch in batches:
                if batch:
                    replies = await self._redis.run_many([(redis_scripts.MATCH, space, (joined[i], view.next_num, *states)) for i in batch])
                    for i, reply in zip(batch, replies):
                        answers[i] = _matches(reply, by_num)
        return answers

    async def nodes(self) -> list[NodeInfo]:
        with self._redis.translated("a listing of nodes"):
            view = await self._current_view()
        return [node.info for node in view.alive(time.monotonic())]

    async def sweep(self) -> int:
        """Unlink every garbage block map (dead nodes, old epochs) in every namespace ever
        published; returns how many. Matches collect the maps they meet; this catches the
        namespaces nobody asks about. Idempotent: any one process may run it now and then."""
        with self._redis.translated("a sweep"):
            self._view = None
            view = await self._current_view()
            spaces = await self._redis.command("SMEMBERS", self._spaces_key)
            states = []
            for node in view.nodes:
                states += (node.num, node.epoch, "d" if node.lease_deadline == -math.inf else "l")
            calls = [(redis_scripts.MATCH, (self._space(bytes.fromhex(s.decode())),), (b"", view.next_num, *states)) for s in spaces]
            results = await self._redis.run_many(calls) if calls else []
        return sum(int(r[0]) for r in results)

    async def close(self) -> None:
        await self._redis.close()

    async def _current_view(self) -> _View:
        now = time.monotonic()
        if self._view is not None and self._view.fresh(now, self._view_ttl_s):
            return self._view
        keys = (self._nodes_key, self._next_key, self._lease_prefix)
        reply = await self._redis.run(redis_scripts.VIEW, keys, (self._forget_after_ms,))
        fetched_at = time.monotonic()
        nodes = []
        for node_id, num, epoch, pttl, info in reply[1:]:
            grpc, transport, kind = msgpack.unpackb(info) if info else ("", "", "kvstore")
            deadline = -math.inf if pttl == -2 else math.inf if pttl == -1 else now + pttl / 1000
            nodes.append(_NodeState(NodeInfo(node_id.decode(), grpc, transport, kind), int(num), int(epoch), deadline))
        self._view = _View(fetched_at, int(reply[0]), tuple(nodes))
        return self._view

    def _space(self, namespace: bytes) -> str:
        return "{" + self._prefix + ":" + namespace.hex() + "}"


class RedisSessionStore(SessionStore):
    """Session → node affinities with a TTL; moves in one capped list, newest first.
    Each session is its own key (any shard); a put that moves a session costs one more
    round trip to record the move."""

    def __init__(
        self,
        url: str,
        *,
        cluster: bool = False,
        key_prefix: str = "kvs",
        max_moves: int = 10_000,
        timeout_s: float = 2.0,
        retries: int = 3,
        client: RedisClient | None = None,
        access: RedisAccess = RedisAccess(),
    ) -> None:
        if max_moves <= 0:
            raise InvalidArgument(f"max_moves must be positive, got {max_moves}.")
        self._prefix = _check_prefix(key_prefix)
        self._redis = _boundary(url, client, cluster, timeout_s, retries, access)
        self._max_moves = max_moves
        self._moves_key = f"{key_prefix}:moves"

    @classmethod
    def from_url(cls, url: str) -> RedisSessionStore:
        return cls(url)

    async def get(self, session_id: str) -> SessionAffinity | None:
        key = self._session_key(session_id)
        with self._redis.translated(f"a lookup of session {session_id!r}"):
            node, moves = await self._redis.command("HMGET", key, "node", "moves")
        return None if node is None else SessionAffinity(session_id, node.decode(), int(moves or 0))

    async def put(self, session_id: str, node_id: str, ttl_s: float, moved_from: str | None = None, reason: str = "") -> SessionAffinity:
        key = self._session_key(session_id)
        _check_node_id(node_id)
        if not 0.001 <= ttl_s <= 365 * 86_400:
            raise InvalidArgument(f"ttl_s must lie in [0.001, 1 year], got {ttl_s}.")
        args = (node_id, max(1, round(ttl_s * 1000)), moved_from or "")
        with self._redis.translated(f"an update of session {session_id!r}"):
            num_moves, src = await self._redis.run(redis_scripts.SESSION_PUT, (key,), args)
            if src:
                record = msgpack.packb({"session": session_id, "from": src.decode(), "to": node_id, "reason": reason, "time": time.time()})
                push = [("LPUSH", self._moves_key, record), ("LTRIM", self._moves_key, 0, self._max_moves - 1)]
                await self._redis.run_many([], push)
        return SessionAffinity(session_id, node_id, int(num_moves))

    async def reassign(self, from_node: str, to_node: str, reason: str) -> int:
        """Scans every session key (on every shard): a drain is rare and operator-paced."""
        _check_node_id(to_node)
        moved: list[str] = []
        prefix = f"{self._prefix}:s:"
        with self._redis.translated(f"moving the sessions of node {from_node!r}"):
            async for key in self._redis.client.scan_iter(match=prefix + "*", count=1000):
                key = key.decode() if isinstance(key, bytes) else key
                if await self._redis.run(redis_scripts.SESSION_REASSIGN, (key,), (from_node, to_node)):
                    moved.append(key[len(prefix) :])
            if moved:
                now = time.time()
                records = [msgpack.packb({"session": s, "from": from_node, "to": to_node, "reason": reason, "time": now}) for s in moved]
                await self._redis.run_many([], [("LPUSH", self._moves_key, *records), ("LTRIM", self._moves_key, 0, self._max_moves - 1)])
        return len(moved)

    async def moves(self, limit: int = 100) -> list[dict]:
        if limit <= 0:
            return []
        with self._redis.translated("a listing of session moves"):
            records = await self._redis.command("LRANGE", self._moves_key, 0, min(limit, self._max_moves) - 1)
        return [msgpack.unpackb(r) for r in records]

    async def close(self) -> None:
        await self._redis.close()

    def _session_key(self, session_id: str) -> str:
        if not isinstance(session_id, str) or not 0 < len(session_id) <= 1024:
            raise InvalidArgument("a session id is a non-empty string of at most 1024 characters.")
        return f"{self._prefix}:s:{session_id}"


def _check_node_id(node_id: str) -> None:
    if not isinstance(node_id, str) or not 0 < len(node_id) <= MAX_NODE_ID_CHARS:
        raise InvalidArgument(f"a node id is a non-empty string of at most {MAX_NODE_ID_CHARS} characters, got {node_id!r}.")


def _check_namespace(namespace: bytes) -> None:
    if not isinstance(namespace, bytes) or not 0 < len(namespace) <= 64:
        raise InvalidArgument("a namespace is a digest of 1 to 64 bytes (Namespace.digest).")


def _bounded(hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
    if len(hashes) > MAX_CHAIN_BLOCKS:
        raise InvalidArgument(f"a chain holds at most {MAX_CHAIN_BLOCKS} blocks, got {len(hashes)}.")
    return hashes


def _packed(chain: bytes) -> bytes:
    if not isinstance(chain, bytes) or len(chain) % HASH_BYTES:
        raise InvalidArgument(f"a packed chain is bytes, a whole number of {HASH_BYTES}-byte block keys.")
    if len(chain) > MAX_CHAIN_BLOCKS * HASH_BYTES:
        raise InvalidArgument(f"a chain holds at most {MAX_CHAIN_BLOCKS} blocks, got {len(chain) // HASH_BYTES}.")
    return chain


def _match_states(view: _View, node_ids: Collection[str] | None) -> tuple[list, dict[int, str]]:
    """MATCH's (num, epoch, state) arguments for every node of ``view``, and the node id of
    each candidate's number: the live nodes, of ``node_ids`` when given."""
    now = time.monotonic()
    wanted = None if node_ids is None else set(node_ids)
    states: list = []
    by_num: dict[int, str] = {}
    for node in view.nodes:
        live = node.lease_deadline > now
        if live and (wanted is None or node.info.node_id in wanted):
            state = "c"
            by_num[node.num] = node.info.node_id
        else:
            # a lease seen gone is gone for good (a comeback gets a new epoch);
            # a deadline passed only by our clock is not proof
            state = "d" if node.lease_deadline == -math.inf else "l"
        states += (node.num, node.epoch, state)
    return states, by_num


def _matches(reply: Sequence, by_num: dict[int, str]) -> list[NodeMatch]:
    matches = [NodeMatch(by_num[int(runs[0])], _decode_runs(runs[2:])) for runs in reply[1:]]
    matches.sort(key=lambda m: (-m.num_blocks, m.node_id))  # the embedded index's order
    return matches


def _joined(hashes: Sequence[BlockHash]) -> bytes:
    """The hashes concatenated. Only the total length is checked on the way (a per-hash
    check costs more than a whole match's script): hashes of wrong lengths that add up
    misalign nothing but themselves, so they miss, as unknown hashes do."""
    try:
        chain = b"".join(hashes)
    except TypeError as exc:
        raise InvalidArgument("block hashes must be bytes.") from exc
    if len(chain) != HASH_BYTES * len(hashes):
        lengths = sorted(set(map(len, hashes)))
        raise InvalidArgument(f"every block hash is {HASH_BYTES} bytes; got lengths {lengths}.")
    return chain


def _ops_by_namespace(events: Sequence[BlockEvent]) -> dict[bytes, list[tuple[str, bytes]]]:
    """Each namespace's (op, hashes) in event order, as APPLY reads them; runs of the same
    op merge (a catalogue arrives as one BlockStored per block)."""
    ops: dict[bytes, list[tuple[str, list[bytes]]]] = {}
    for event in events:
        if isinstance(event, BlockStored):
            op = f"S{event.tier.rank}"
        elif isinstance(event, BlockRemoved):
            op = f"R{event.tier.rank}"
        elif isinstance(event, BlockMoved):
            op = f"M{event.src.rank}{event.dst.rank}"
        else:
            raise InvalidArgument(f"cannot publish {type(event).__name__}; expected a block event.")
        _check_namespace(event.namespace)
        if event.block_hashes:
            space = ops.setdefault(event.namespace, [])
            if not space or space[-1][0] != op:
                space.append((op, []))
            space[-1][1].append(_joined(event.block_hashes))
    return {namespace: [(op, b"".join(blobs)) for op, blobs in space] for namespace, space in ops.items()}


def _chunks(ops: list[tuple[str, bytes]]) -> Iterator[list]:
    """Flat (op, hashes, op, hashes, …) argument lists of at most MAX_HASHES_PER_CALL hashes."""
    chunk: list = []
    room = MAX_HASHES_PER_CALL
    for op, blob in ops:
        while blob:
            take = blob[: room * HASH_BYTES]
            blob = blob[len(take) :]
            chunk += (op, take)
            room -= len(take) // HASH_BYTES
            if room == 0:
                yield chunk
                chunk, room = [], MAX_HASHES_PER_CALL
    if chunk:
        yield chunk


def _decode_runs(runs: Sequence[int]) -> tuple[TierKind, ...]:
    tiers: list[TierKind] = []
    for i in range(0, len(runs), 2):
        tiers += [_TIER_BY_RANK[int(runs[i])]] * int(runs[i + 1])
    return tuple(tiers)
