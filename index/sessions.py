"""`EmbeddedSessionStore`: session → node affinities in this process, for one host.

The same contract as `RedisSessionStore` (index/redis.py): an affinity lives ``ttl_s``
after its last `put`; a put that changes a session's node counts a move and records it
(newest first, the oldest dropped beyond ``max_moves``). The move's origin is the node the
session stuck to, or, when its affinity had already expired, the ``moved_from`` the
router gives.

Expired sessions are forgotten lazily: a heap of (expiry, session) is popped on every
call (and rebuilt when refreshes have left it mostly stale), so memory follows the
sessions active within one TTL, not every session ever seen.

Owner: the event loop of the daemon, or of the router on one host (router.index = "daemons"); not thread-safe.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.index.base import SessionAffinity, SessionStore

__all__ = ["EmbeddedSessionStore"]

MAX_SESSION_ID_CHARS = 1024
MAX_TTL_S = 365 * 86_400


@dataclass(slots=True)
class _Session:
    node_id: str
    num_moves: int
    expires_at: float


class EmbeddedSessionStore(SessionStore):
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_moves: int = 10_000,
    ) -> None:
        if max_moves <= 0:
            raise InvalidArgument(f"max_moves must be positive, got {max_moves}.")
        self._clock = clock
        self._wall_clock = wall_clock  # a move's "time", for operators: seconds since the epoch
        self._sessions: dict[str, _Session] = {}
        self._expiries: list[tuple[float, str]] = []  # a heap; stale entries are skipped
        self._moves: collections.deque[dict] = collections.deque(maxlen=max_moves)

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions)

    async def get(self, session_id: str) -> SessionAffinity | None:
        _check_session_id(session_id)
        self._expire()
        session = self._sessions.get(session_id)
        return None if session is None else SessionAffinity(session_id, session.node_id, session.num_moves)

    async def put(self, session_id: str, node_id: str, ttl_s: float, moved_from: str | None = None, reason: str = "") -> SessionAffinity:
        _check_session_id(session_id)
        if not isinstance(node_id, str) or not node_id:
            raise InvalidArgument(f"a node id is a non-empty string, got {node_id!r}.")
        if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and 0 < ttl_s <= MAX_TTL_S):
            raise InvalidArgument(f"ttl_s must lie in (0, {MAX_TTL_S}] seconds, got {ttl_s!r}.")
        now = self._expire()
        session = self._sessions.get(session_id)
        if session is not None:
            origin = session.node_id if session.node_id != node_id else None
            num_moves = session.num_moves
        else:
            origin = moved_from if moved_from and moved_from != node_id else None
            num_moves = 0
        if origin is not None:
            num_moves += 1
            self._moves.appendleft({"session": session_id, "from": origin, "to": node_id, "reason": reason, "time": self._wall_clock()})
        self._sessions[session_id] = _Session(node_id, num_moves, now + ttl_s)
        heapq.heappush(self._expiries, (now + ttl_s, session_id))
        if len(self._expiries) > 2 * len(self._sessions) + 1024:  # mostly refreshed entries
            self._expiries = [(s.expires_at, sid) for sid, s in self._sessions.items()]
            heapq.heapify(self._expiries)
        return SessionAffinity(session_id, node_id, num_moves)

    async def reassign(self, from_node: str, to_node: str, reason: str) -> int:
        self._expire()
        moved = [sid for sid, session in self._sessions.items() if session.node_id == from_node]
        for session_id in moved:
            session = self._sessions[session_id]
            session.node_id = to_node
            session.num_moves += 1
            self._moves.appendleft({"session": session_id, "from": from_node, "to": to_node, "reason": reason, "time": self._wall_clock()})
        return len(moved)

    async def moves(self, limit: int = 100) -> list[dict]:
        if limit <= 0:
            return []
        return [dict(move) for move in itertools.islice(self._moves, limit)]

    def _expire(self) -> float:
        now = self._clock()
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expires_at, session_id = heapq.heappop(expiries)
            session = self._sessions.get(session_id)
            if session is not None and session.expires_at == expires_at:  # not refreshed since
                del self._sessions[session_id]
        return now


def _check_session_id(session_id: str) -> None:
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise InvalidArgument(f"a session id is a non-empty string of at most {MAX_SESSION_ID_CHARS} characters.")
