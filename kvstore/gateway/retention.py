"""Keep a session's KV through its tool calls, and bring it back before its next turn.

A coding agent's session pauses between turns — a tool runs, a person reads — for seconds
to minutes, and meanwhile the other sessions' saves push its chain out of its replica's
host tier. The router knows when a turn ends and, from the session's earlier pauses, about
how long the next pause will be:

- when a session's turn has been answered, it asks the replica's daemon to *retain* the
  turn's chain (Admin ``Retain``) for the pause it expects: ``margin`` times the longer of
  the session's longest recent pause (its last ``PAUSES_KEPT``) and the 90th percentile of
  every session's recent pauses (the last ``FLEET_PAUSES_KEPT``), within [``min_ttl_s``,
  ``max_ttl_s``]. Until ``MIN_FLEET_PAUSES`` pauses have ended, ``first_ttl_s`` stands in
  for the percentile: the first pauses to end are the short ones. A session's own few
  pauses alone say little of its next one (tool calls' times are long-tailed: after one
  pause of 5 s of a kind whose mean is 15 s, a retention of 2 × 5 s would end before
  half of the next pauses do), and a retention that lasts too long costs little: a
  retained block still gives way to a save, and the daemon bounds what it retains. A
  retained block is evicted last
  among those not pinned, and demoted to NVMe rather than dropped; it never blocks a save;
- when the session's next turn is routed, it asks the chosen replica's daemon to
  *prefetch* the new prompt's chain (Admin ``Prefetch``): blocks on NVMe are promoted to
  the host tier and, when the session moved, the blocks its last replica holds are fetched
  from it — while the request is on its way to the engine, whose connector then finds
  them in memory. Neither call is awaited by the request: a daemon that is slow or away
  costs nothing but the retention.

`RetentionPlan` is the pure part (pauses, deadlines, where a session was); `SessionRetention`
sends the calls (index/daemons.DaemonCalls), at most ``MAX_IN_FLIGHT`` at once — beyond
that a call is skipped and counted. Owner: the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.gateway.config import RetentionConfig
from kvstore.hashing import BlockHash
from kvstore.index.daemons import MAX_ASKED_BLOCKS, DaemonAddress, DaemonCalls

__all__ = ["FLEET_PAUSES_KEPT", "MAX_IN_FLIGHT", "MIN_FLEET_PAUSES", "PAUSES_KEPT", "RetentionPlan", "SessionRetention"]

logger = logging.getLogger("kvstore.router")

PAUSES_KEPT = 8  # a session's pauses that set its retention: the longest of these
FLEET_PAUSES_KEPT = 1024  # every session's recent pauses: their 90th percentile sets a floor
MIN_FLEET_PAUSES = 32  # before this many, first_ttl_s does
_FLEET_QUANTILE = 0.9
MAX_IN_FLIGHT = 256  # calls to daemons not answered yet; beyond, a call is skipped


@dataclass(slots=True)
class _Session:
    node_id: str
    ended_at: float | None = None  # when its last turn was answered; None while a turn runs
    pauses: deque[float] = field(default_factory=lambda: deque(maxlen=PAUSES_KEPT))


class RetentionPlan:
    """Per session: where its last turn ran, when it ended and how long it paused before."""

    def __init__(self, config: RetentionConfig, max_sessions: int) -> None:
        self._config = config
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently seen first
        self._fleet_pauses: deque[float] = deque(maxlen=FLEET_PAUSES_KEPT)
        self._fleet_floor: float | None = None  # their 90th percentile, recomputed as pauses come in

    def ended(self, session_id: str, node_id: str, now: float) -> float:
        """The session's turn on ``node_id`` has been answered: how long to retain its chain."""
        session = self._session(session_id, node_id)
        session.node_id, session.ended_at = node_id, now
        return self.ttl_s(session_id)

    def resumed(self, session_id: str, node_id: str, now: float) -> str | None:
        """The session's next turn is routed to ``node_id``: the node its last turn ran on
        when that is another (the blocks to fetch are there), else None."""
        session = self._sessions.get(session_id)
        if session is None:
            self._session(session_id, node_id)
            return None
        self._sessions.move_to_end(session_id)
        if session.ended_at is not None:
            pause = max(now - session.ended_at, 0.0)
            session.pauses.append(pause)
            self._fleet_pauses.append(pause)
            self._fleet_floor = None
            session.ended_at = None
        previous, session.node_id = session.node_id, node_id
        return previous if previous != node_id else None

    def ttl_s(self, session_id: str) -> float:
        config = self._config
        session = self._sessions.get(session_id)
        own = max(session.pauses, default=0.0) if session is not None else 0.0
        return min(max(config.margin * max(own, self.fleet_floor()), config.min_ttl_s), config.max_ttl_s)

    def fleet_floor(self) -> float:
        """The pause every session's retention covers: the 90th percentile of every
        session's recent pauses, or ``first_ttl_s / margin`` before ``MIN_FLEET_PAUSES``."""
        if len(self._fleet_pauses) < MIN_FLEET_PAUSES:
            return self._config.first_ttl_s / self._config.margin
        if self._fleet_floor is None:
            pauses = sorted(self._fleet_pauses)
            self._fleet_floor = pauses[int(_FLEET_QUANTILE * len(pauses))]
        return self._fleet_floor

    def __len__(self) -> int:
        return len(self._sessions)

    def _session(self, session_id: str, node_id: str) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session(node_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(session_id)
        return session


class SessionRetention:
    """Sends each session's Retain at its turn's end and Prefetch at its next turn's start,
    to the daemons ``daemons()`` names (replicas without one are skipped)."""

    def __init__(
        self,
        config: RetentionConfig,
        calls: DaemonCalls,
        daemons: Callable[[], dict[str, DaemonAddress]],
        max_sessions: int,
        count: Callable[[str, str], None] = lambda call, outcome: None,
    ) -> None:
        self.config = config
        self.plan = RetentionPlan(config, max_sessions)
        self._calls = calls
        self._daemons = daemons
        self._count = count  # (call, outcome): the router's metrics
        self._in_flight: set[asyncio.Task] = set()

    def turn_ended(self, session_id: str, node_id: str, namespace: bytes, hashes: Sequence[BlockHash], now: float) -> None:
        if not self.config.enabled or not hashes:
            return
        ttl_s = self.plan.ended(session_id, node_id, now)
        request = pb.RetainRequest(namespace_id=namespace, block_hashes=list(hashes[:MAX_ASKED_BLOCKS]), ttl_s=ttl_s)
        self._send("Retain", node_id, request)

    def turn_routed(self, session_id: str, node_id: str, namespace: bytes, hashes: Sequence[BlockHash], now: float) -> None:
        if not self.config.enabled or not hashes:
            return
        source = self.plan.resumed(session_id, node_id, now)
        if not self.config.prefetch:
            return
        request = pb.PrefetchRequest(namespace_id=namespace, block_hashes=list(hashes[:MAX_ASKED_BLOCKS]), source_node_id=source or "")
        self._send("Prefetch", node_id, request)

    async def close(self) -> None:
        for task in list(self._in_flight):
            task.cancel()
        await self._calls.close()

    async def wait(self) -> None:
        """Return once every call sent so far has ended (tests; the router's shutdown)."""
        while self._in_flight:
            await asyncio.gather(*list(self._in_flight), return_exceptions=True)

    def _send(self, method: str, node_id: str, request) -> None:
        daemon = self._daemons().get(node_id)
        if daemon is None:
            self._count(method, "no_daemon")
            return
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            self._count(method, "skipped")
            return
        task = asyncio.get_running_loop().create_task(self._call(method, daemon, request))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _call(self, method: str, daemon: DaemonAddress, request) -> None:
        response = await self._calls.call(daemon, "Admin", method, request)
        self._count(method, "ok" if response is not None else "failed")
