"""Every handoff a daemon takes part in, by transfer id, and what each engine session holds.

Outgoing handoffs belong to the producer engine's session that opened them; incoming
ones are created by the producer's daemon and attached to the consumer engine's session
that receives them.

Staging slots have one owner at a time (DESIGN decision 12) and are freed exactly once,
when nobody can touch them any more:

- an outgoing handoff's staging is written by its producer engine: it is freed when that
  engine lets go (finishes or cancels it, or its session ends with its process gone) —
  a handoff that times out is failed and its sender stopped, but its slots stay with the
  engine, which may still be writing a layer;
- an incoming handoff's staging is read by its consumer engine once attached: it is
  freed when the conversation is over and no consumer holds the views — one that fails
  or times out while attached keeps them until the consumer lets go;
- either way, not before the channel its layers travelled on can no longer touch them
  (kvstore/transfers/settling.py).

Owner: the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import xxhash

from kvstore.errors import InvalidArgument, KVStoreError, NotFound, TransferFailed
from kvstore.hashing import BlockHash
from kvstore.layout import KVLayout
from kvstore.steps import run_steps
from kvstore.tiers.manager import TierManager
from kvstore.transfers.handoff import HandoffState, IncomingHandoff, OutgoingHandoff, _Handoff
from kvstore.transfers.settling import Settling

__all__ = ["HandoffRegistry", "wire_transfer_id"]

logger = logging.getLogger(__name__)
MAX_TRANSFER_ID_CHARS = 256


def wire_transfer_id(transfer_id: str) -> int:
    """The 64-bit id frames carry for a handoff named by the engine's string."""
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_TRANSFER_ID_CHARS:
        raise InvalidArgument(f"a transfer id is a non-empty string of at most {MAX_TRANSFER_ID_CHARS} characters.")
    return xxhash.xxh3_64_intdigest(transfer_id.encode())


def _check_distinct(transfer_id: str, hashes: Sequence[BlockHash]) -> None:
    if len(set(hashes)) != len(hashes):
        raise InvalidArgument(f"handoff {transfer_id!r} names a block more than once; block hashes of one handoff must be distinct.")


class HandoffRegistry:
    def __init__(self, manager: TierManager, timeout_s: float, settling: Settling, clock: Callable[[], float] = time.monotonic) -> None:
        self.manager = manager
        self.timeout_s = timeout_s
        self.settling = settling
        self._clock = clock
        self.outgoing: dict[str, OutgoingHandoff] = {}
        self.incoming: dict[str, IncomingHandoff] = {}
        self._arrivals: dict[str, asyncio.Event] = {}  # consumers waiting for a handoff to be announced
        self._owners: dict[int, set[str]] = {}  # session → outgoing transfer ids it opened
        self._readers: dict[int, set[str]] = {}  # session → incoming transfer ids it attached

    # -- producer side --------------------------------------------------------------------
    async def open_outgoing(
        self,
        session: int,
        transfer_id: str,
        digest: bytes,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        layout: KVLayout,
        destination: str,
    ) -> OutgoingHandoff:
        wire_id = wire_transfer_id(transfer_id)
        _check_distinct(transfer_id, hashes)
        if transfer_id in self.outgoing:
            raise InvalidArgument(f"handoff {transfer_id!r} is already being sent from this node.")
        slots = await run_steps(self.manager.allocate_staging_steps(digest, len(hashes)))
        if transfer_id in self.outgoing:  # another open of the same id won while room was made
            self.manager.free_staging(slots)
            raise InvalidArgument(f"handoff {transfer_id!r} is already being sent from this node.")
        views = self.manager.staging_views(digest, slots)
        handoff = OutgoingHandoff(
            transfer_id, wire_id, digest, hashes, parent, layout, slots, views, self._clock() + self.timeout_s, destination=destination
        )
        self.outgoing[transfer_id] = handoff
        self._owners.setdefault(session, set()).add(transfer_id)
        return handoff

    def outgoing_for(self, session: int, transfer_id: str) -> OutgoingHandoff:
        if transfer_id not in self._owners.get(session, ()):
            raise NotFound(f"handoff {transfer_id!r} was not opened by this connection.")
        return self.outgoing[transfer_id]

    def close_outgoing(self, handoff: OutgoingHandoff) -> None:
        """Its producer lets go: stop its sender and free its staging; the handoff is over
        either way."""
        if self.outgoing.get(handoff.transfer_id) is not handoff:
            return
        del self.outgoing[handoff.transfer_id]
        for owned in self._owners.values():
            owned.discard(handoff.transfer_id)
        self._stop(handoff, "cancelled")
        self._free_staging(handoff)

    def _stop(self, handoff: OutgoingHandoff, reason: str) -> None:
        handoff.fail(reason)
        if handoff.task is not None and not handoff.task.done():
            handoff.task.cancel()

    # -- consumer side --------------------------------------------------------------------
    async def open_incoming(
        self, transfer_id: str, wire_id: int, digest: bytes, hashes: Sequence[BlockHash], parent: BlockHash | None, layout: KVLayout
    ) -> IncomingHandoff:
        if wire_transfer_id(transfer_id) != wire_id:
            raise InvalidArgument(f"handoff {transfer_id!r} arrived under a frame id that does not match its name.")
        if transfer_id in self.incoming:
            raise InvalidArgument(f"handoff {transfer_id!r} is already being received by this node.")
        if not hashes:
            raise InvalidArgument(f"handoff {transfer_id!r} names no blocks.")
        _check_distinct(transfer_id, hashes)
        slots = await run_steps(self.manager.allocate_staging_steps(digest, len(hashes)))
        if transfer_id in self.incoming:
            self.manager.free_staging(slots)
            raise InvalidArgument(f"handoff {transfer_id!r} is already being received by this node.")
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
        if handoff.attached or handoff.reader_done:
            raise InvalidArgument(f"handoff {transfer_id!r} is already being read by another connection.")
        handoff.attached = True
        self._readers.setdefault(session, set()).add(transfer_id)
        return handoff

    def incoming_for(self, session: int, transfer_id: str) -> IncomingHandoff:
        if transfer_id not in self._readers.get(session, ()):
            raise NotFound(f"handoff {transfer_id!r} is not being read by this connection; receive it first.")
        return self.incoming[transfer_id]

    def detach(self, session: int, transfer_id: str) -> None:
        """The consumer is done reading (or went away): it lets go of the staging views."""
        self._readers.get(session, set()).discard(transfer_id)
        handoff = self.incoming.get(transfer_id)
        if handoff is None or not handoff.attached:
            return
        handoff.attached = False
        handoff.reader_done = True
        handoff.fail("the consumer closed it before every layer arrived")
        self.settle(handoff)

    def fail_incoming(self, handoff: IncomingHandoff, reason: str) -> None:
        """The producer's stream broke off; an attached consumer keeps the views it reads."""
        handoff.fail(reason)
        self.settle(handoff)

    async def store_incoming(self, handoff: IncomingHandoff) -> int:
        """Every layer arrived: store the blocks (reusable later), then announce the last
        layer — so no reader lets go of the staging while it is copied."""
        handoff.storing = True
        try:
            handoff.num_stored = await run_steps(self.manager.put_steps(handoff.digest, handoff.hashes, handoff.views, handoff.parent))
        except KVStoreError as exc:  # the consumer can still read the staged layers
            logger.warning("handoff %r arrived but was not stored: %s", handoff.transfer_id, exc)
        finally:
            handoff.storing = False
        handoff.complete()
        self.settle(handoff)
        return handoff.num_stored

    def settle(self, handoff: IncomingHandoff) -> None:
        """Free an incoming handoff's staging once it is over and nobody reads it."""
        if handoff.state is HandoffState.OPEN or handoff.attached or handoff.storing:
            return
        if handoff.state is HandoffState.COMPLETE and not handoff.reader_done and not handoff.expired(self._clock()):
            return  # its consumer has not come yet: keep the layers for it until the deadline
        if self.incoming.get(handoff.transfer_id) is handoff:
            del self.incoming[handoff.transfer_id]
            self._free_staging(handoff)

    def _free_staging(self, handoff: _Handoff) -> None:
        self.settling.release_after(handoff.channel, lambda: self.manager.free_staging(handoff.slots))

    # -- lifetime ---------------------------------------------------------------------------
    def holds(self, session: int) -> bool:
        return bool(self._owners.get(session) or self._readers.get(session))

    def close_session(self, session: int) -> None:
        """The session's engine is gone: its handoffs are let go."""
        for transfer_id in self._owners.pop(session, set()):
            handoff = self.outgoing.get(transfer_id)
            if handoff is not None:
                self.close_outgoing(handoff)
        for transfer_id in list(self._readers.get(session, ())):
            self.detach(session, transfer_id)
        self._readers.pop(session, None)

    def expire(self) -> int:
        """Fail handoffs past their deadline. Their staging goes once its holder lets go:
        the producer engine (outgoing), the attached consumer (incoming)."""
        now = self._clock()
        expired = 0
        for handoff in [h for h in self.outgoing.values() if h.expired(now) and h.state is HandoffState.OPEN]:
            logger.warning("handoff %r to %s timed out", handoff.transfer_id, handoff.destination)
            self._stop(handoff, f"it did not finish within {self.timeout_s}s")
            expired += 1
        for handoff in [h for h in self.incoming.values() if h.expired(now)]:
            if handoff.state is HandoffState.OPEN:
                handoff.fail(f"it did not finish within {self.timeout_s}s")
                expired += 1
            self.settle(handoff)
        return expired

    def fail_all_incoming(self, reason: str) -> None:
        """Every incoming handoff ends: its staging lies in a host tier file that was
        replaced, so a consumer that maps the new one would read other bytes there."""
        for handoff in list(self.incoming.values()):
            handoff.attached = False
            handoff.reader_done = True
            handoff.fail(reason)
            self.settle(handoff)

    def close(self) -> None:
        """The daemon stops: every handoff ends (its tiers go with it)."""
        for handoff in list(self.outgoing.values()):
            self.close_outgoing(handoff)
        for handoff in list(self.incoming.values()):
            handoff.attached = False
            handoff.reader_done = True
            handoff.fail("the daemon is stopping")
            self.settle(handoff)
        for arrival in self._arrivals.values():
            arrival.set()
