"""The working set a router has placed on each replica: the distinct tokens of its live sessions.

A session is live from its last request until its affinity would expire (the router's
``routing.session_ttl_s``): its context is what it will send again, and what its replica
must keep to hit. `LiveSessions` remembers, for each live session, its replica and its
chain of block keys, and answers how many distinct tokens a replica's live sessions hold
(`tokens_on`) — the figure `index/scoring.py` sets against the replica's cache to price
what a new prompt's blocks would evict there.

Sessions share prefixes (the system prompt and tools every agent sends), and a shared
block is one block in the cache, so the figure counts distinct blocks, not each session's
length. Chained keys make that cheap: block k's key names the whole prefix up to k, so
the prefixes of two chains are equal exactly where their keys are. Only the key ending
each stride of ``stride_tokens`` (whole blocks of them) is kept; a replica's distinct
tokens are its distinct kept keys × the stride, plus each session's tail past its last
kept key, counted as its own. At most ``max_sessions`` are kept, the least recently seen
forgotten first: a 150K-token session costs 37 kept keys at the default 4,096-token
stride, ~2 KB with its share of the per-replica counts.

Pure and synchronous: the HTTP router (kvstore/gateway) and the routing simulator
(bench/sim) drive it. Owner: the caller's thread.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash

__all__ = ["LiveSessions", "DEFAULT_STRIDE_TOKENS"]

DEFAULT_STRIDE_TOKENS = 4096  # tokens per kept key, in whole blocks


@dataclass(frozen=True, slots=True)
class _Live:
    node_id: str
    keys: tuple[BlockHash, ...]  # every stride-th key of its chain
    tail_tokens: int  # its tokens past the last kept key
    expires_s: float


class _Node:
    __slots__ = ("keys", "tail_tokens")

    def __init__(self) -> None:
        self.keys: Counter[BlockHash] = Counter()  # kept key -> live sessions whose chain has it
        self.tail_tokens = 0


class LiveSessions:
    def __init__(self, ttl_s: float, block_size: int, stride_tokens: int = DEFAULT_STRIDE_TOKENS, max_sessions: int = 50_000) -> None:
        if not ttl_s > 0:
            raise InvalidArgument(f"a live session's lifetime must be positive, got {ttl_s!r} s.")
        for name, value in (("block_size", block_size), ("stride_tokens", stride_tokens), ("max_sessions", max_sessions)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"LiveSessions.{name} must be a positive integer, got {value!r}.")
        self.ttl_s = ttl_s
        self.block_size = block_size
        self.stride = max(stride_tokens // block_size, 1)  # in blocks
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Live] = OrderedDict()  # least recently seen first
        self._nodes: dict[str, _Node] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def record(self, session_id: str, node_id: str, hashes: Sequence[BlockHash], num_tokens: int, now: float) -> None:
        """``session_id``'s latest prompt — ``num_tokens`` tokens whose full blocks have the
        keys ``hashes`` — was sent to ``node_id``: that is its working set from now on."""
        if not session_id:
            return
        self._drop(session_id)
        stride = self.stride
        keys = tuple(hashes[stride - 1 :: stride])
        tail = max(num_tokens - len(keys) * stride * self.block_size, 0)
        self._sessions[session_id] = _Live(node_id, keys, tail, now + self.ttl_s)
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _Node()
        node.keys.update(keys)
        node.tail_tokens += tail
        while len(self._sessions) > self.max_sessions:
            self._drop(next(iter(self._sessions)))
        self.expire(now)

    def forget(self, session_id: str) -> None:
        self._drop(session_id)

    def expire(self, now: float) -> None:
        """Forget the sessions whose lifetime has passed (the oldest are first in line)."""
        while self._sessions:
            session_id, live = next(iter(self._sessions.items()))
            if live.expires_s > now:
                return
            self._drop(session_id)

    def tokens_on(self, node_id: str, now: float) -> int:
        """The distinct tokens of the sessions live on ``node_id`` at ``now``."""
        self.expire(now)
        node = self._nodes.get(node_id)
        if node is None:
            return 0
        return len(node.keys) * self.stride * self.block_size + node.tail_tokens

    def _drop(self, session_id: str) -> None:
        live = self._sessions.pop(session_id, None)
        if live is None:
            return
        node = self._nodes[live.node_id]
        for key in live.keys:
            count = node.keys[key] - 1
            if count > 0:
                node.keys[key] = count
            else:
                node.keys.pop(key, None)
        node.tail_tokens -= live.tail_tokens
        if not node.keys and not node.tail_tokens:
            del self._nodes[live.node_id]
