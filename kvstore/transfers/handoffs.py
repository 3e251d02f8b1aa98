"""Every handoff a daemon takes part in, by transfer id, and what each engine session holds.

Outgoing handoffs belong to the producer engine's session that opened them; incoming
ones are created by the producer's daemon and attached to the consumer engine's session
that receives them. When a session ends (its engine exited or was killed) its handoffs
are cancelled or detached; when a handoff's deadline passes it is failed. Staging slots
are freed exactly once, when nobody can read them any more: the conversation is over
and no consumer holds their views.

Owner: the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import xxhash

from kvstore.errors import InvalidArgument, NotFound, TransferFailed
from kvstore.hashing import BlockHash
from kvstore.layout import KVLayout
from kvstore.tiers.manager import TierManager
from kvstore.transfers.handoff import HandoffState, IncomingHandoff, OutgoingHandoff

__all__ = ["HandoffRegistry", "wire_transfer_id"]

logger = logging.getLogger(__name__)
MAX_TRANSFER_ID_CHARS = 256


def wire_transfer_id(transfer_id: str) -> int:
    """The 64-bit id frames carry for a handoff named by the engine's string."""
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS:
        raise InvalidArgument(f"a transfer id is a non-empty string of at most {MAX_TRANSFER_ID_CHARS} characters.")
    return xxhash.xxh3_64_intdigest(transfer_id.encode())


class HandoffRegistry:
    def __init__(self, manager: TierManager, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.timeout_s = timeout_s
        self._clock = clock
        self.outgoing: dict[str, OutgoingHandoff] = {}
        self.incoming: dict[str, IncomingHandoff] = {}
        self._arrivals: dict[str, asyncio.Event] = {}  # consumers waiting for a handoff to be announced
        self._owners: dict[int, set[str]] = {}  # session → outgoing transfer ids it opened
        self._readers: dict[int, set[str]] = {}  # session → incoming transfer ids it attached

    # -- producer side --------------------------------------------------------------------
    def open_outgoing(
        self,
        session: int,
        transfer_id: str,
        digest: bytes,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        layout: KVLayout,
        destination: str,
    ) -> OutgoingHandoff:
        if transfer_id in self.outgoing:
            raise InvalidArgument(f"handoff {transfer_id!r} is already being sent from this node.")
        slots = self.manager.allocate_staging(digest, len(hashes))
        views = self.manager.staging_views(digest, slots)
        handoff = OutgoingHandoff(
            transfer_id, wire_transfer_id(transfer_id), digest, hashes, parent, layout, slots, views,
            self._clock() + self.timeout_s, destination=destination,
        )  # fmt: skip
        self.outgoing[transfer_id] = handoff
        self._owners.setdefault(session, set()).add(transfer_id)
        return handoff

    def outgoing_for(self, session: int, transfer_id: str) -> OutgoingHandoff:
        if transfer_id not in self._owners.get(session, ()):
            raise NotFound(f"handoff {transfer_id!r} was not opened by this connection.")
        return self.outgoing[transfer_id]

    def close_outgoing(self, handoff: OutgoingHandoff) -> None:
        """Stop its sender and free its staging; the handoff is over either way."""
        if self.outgoing.get(handoff.transfer_id) is not handoff:
            return
        del self.outgoing[handoff.transfer_id]
        for owned in self._owners.values():
            owned.discard(handoff.transfer_id)
        handoff.fail("cancelled")
        if handoff.task is not None and not handoff.task.done():
            handoff.task.cancel()
        self.manager.free_staging(handoff.slots)

    # -- consumer side --------------------------------------------------------------------
    def open_incoming(
        self, transfer_id: str, wire_id: int, digest: bytes, hashes: Sequence[BlockHash], parent: BlockHash | None, layout: KVLayout
    ) -> IncomingHandoff:
        if wire_transfer_id(transfer_id) != wire_id:
            raise InvalidArgument(f"handoff {transfer_id!r} arrived under a frame id that does not match its name.")
        if transfer_id in self.incoming:
            raise InvalidArgument(f"handoff {transfer_id!r} is already being received by this node.")
        if not hashes:
            raise InvalidArgument(f"handoff {transfer_id!r} names no blocks.")
        slots = self.manager.allocate_staging(digest, len(hashes))
        views = self.manager.staging_views(digest, slots)
        handoff = IncomingHandoff(transfer_id, wire_id, digest, hashes, parent, layout, slots, views, self._clock() + self.timeout_s)
        self.incoming[transfer_id] = handoff
        arrival = self._arrivals.pop(transfer_id, None)
        if arrival is not None:
            arrival.set()
        return handoff

    async def attach(self, session: int, digest: bytes, transfer_id: str, timeout_s: float) -> IncomingHandoff:
        """The handoff once its producer has announced it (waiting up to ``timeout_s``)."""
        handoff = self.incoming.get(transfer_id)
        if handoff is None:
            arrival = self._arrivals.setdefault(transfer_id, asyncio.Event())
            try:
                await asyncio.wait_for(arrival.wait(), timeout_s)
            except asyncio.TimeoutError:
                raise TransferFailed(f"no producer announced handoff {transfer_id!r} within {timeout_s}s.") from None
            finally:
                if self._arrivals.get(transfer_id) is arrival and not arrival.is_set():
                    del self._arrivals[transfer_id]
            handoff = self.incoming.get(transfer_id)
            if handoff is None:
                raise TransferFailed(f"handoff {transfer_id!r} ended before it could be read.")
        if handoff.digest != digest:
            raise InvalidArgument(f"handoff {transfer_id!r} carries namespace {handoff.digest.hex()}, not {digest.hex()}.")
        if handoff.attached:
            raise InvalidArgument(f"handoff {transfer_id!r} is already being read by another connection.")
        handoff.attached = True
        self._readers.setdefault(session, set()).add(transfer_id)
        return handoff

    def incoming_for(self, session: int, transfer_id: str) -> IncomingHandoff:
        if transfer_id not in self._readers.get(session, ()):
            raise NotFound(f"handoff {transfer_id!r} is not being read by this connection; receive it first.")
        return self.incoming[transfer_id]

    def detach(self, session: int, transfer_id: str) -> None:
        """The consumer is done reading (or went away)."""
        self._readers.get(session, set()).discard(transfer_id)
        handoff = self.incoming.get(transfer_id)
        if handoff is not None:
            self._end_incoming(handoff, "the consumer closed it before every layer arrived")

    def _end_incoming(self, handoff: IncomingHandoff, reason: str) -> None:
        """Nobody will read this handoff again: fail it if it is still open, let go of its
        reader and free its staging."""
        for readers in self._readers.values():
            readers.discard(handoff.transfer_id)
        handoff.attached = False
        handoff.reader_done = True
        handoff.fail(reason)
        self.settle(handoff)

    def store_incoming(self, handoff: IncomingHandoff) -> int:
        """Every layer arrived: store the blocks (reusable later) and mark it complete."""
        try:
            handoff.num_stored = self.manager.put(handoff.digest, handoff.hashes, handoff.views, handoff.parent)
        except Exception as exc:  # the consumer can still read the staged layers
            logger.warning("handoff %r arrived but was not stored: %s", handoff.transfer_id, exc)
        handoff.complete()
        self.settle(handoff)
        return handoff.num_stored

    def settle(self, handoff: IncomingHandoff) -> None:
        """Free an incoming handoff's staging once it is over and nobody reads it."""
        if handoff.state is HandoffState.OPEN or handoff.attached:
            return
        if handoff.state is HandoffState.COMPLETE and not handoff.reader_done and not handoff.expired(self._clock()):
            return  # its consumer has not come yet: keep the layers for it until the deadline
        if self.incoming.get(handoff.transfer_id) is handoff:
            del self.incoming[handoff.transfer_id]
            self.manager.free_staging(handoff.slots)

    # -- lifetime ---------------------------------------------------------------------------
    def close_session(self, session: int) -> None:
        for transfer_id in self._owners.pop(session, set()):
            handoff = self.outgoing.get(transfer_id)
            if handoff is not None:
                self.close_outgoing(handoff)
        for transfer_id in list(self._readers.get(session, ())):
            self.detach(session, transfer_id)
        self._readers.pop(session, None)

    def expire(self) -> int:
        now = self._clock()
        expired = 0
        for handoff in [h for h in self.outgoing.values() if h.expired(now)]:
            logger.warning("handoff %r to %s timed out", handoff.transfer_id, handoff.destination)
            self.close_outgoing(handoff)
            expired += 1
        for handoff in [h for h in self.incoming.values() if h.expired(now)]:
            self._end_incoming(handoff, f"it did not finish within {self.timeout_s}s")
            expired += 1
        return expired

    def close(self) -> None:
        for handoff in list(self.outgoing.values()):
            self.close_outgoing(handoff)
        for handoff in list(self.incoming.values()):
            self._end_incoming(handoff, "the daemon is stopping")
        for arrival in self._arrivals.values():
            arrival.set()
