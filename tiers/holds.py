"""Lookup holds: the blocks a lookup reported, kept from eviction until the reader that
counted them has loaded them.

An engine's scheduler asks what is cached, promises that many tokens to the engine, and a
worker loads them a step later; meanwhile another engine's saves could evict them, and
the promised load would come up short. A hold taken by the lookup keeps eviction and
demotion from picking each reported block (it may still be promoted, and a block
dropped for a failed check or a failed tier goes as always — a hold guarantees no bytes,
only that eviction does not pick the block). A hold ends when its holder releases it, at
its deadline, or with its holder's session.

Holds read no bytes and move nothing, and they are kept by key beside the eviction
policies (Residency.hold_keys): taking and releasing one costs a counter per block; only
a held block that eviction reaches is taken out of its policy. Never NVMe I/O.

Owner: the tier manager's thread (see tiers/manager.py); not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.errors import NotFound
from kvstore.tiers.residency import Residency

__all__ = ["LookupHolds"]


class LookupHolds:
    def __init__(self, residency: Residency, new_id: Callable[[], int], clock: Callable[[], float]) -> None:
        self._residency = residency
        self._new_id = new_id  # shared with reservations and leases: no two handles are equal
        self._clock = clock
        self._held: dict[int, tuple[float, list[tuple[bytes, Sequence[bytes]]]]] = {}  # id → (deadline, keys per namespace)

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, hold_id: int) -> bool:
        return hold_id in self._held

    def take(self, prefixes: Sequence[tuple[bytes, int]], keys: Sequence[bytes], ttl_s: float) -> int:
        """Hold, per ``(namespace, length)`` of ``prefixes``, the first ``length`` blocks of
        the chain ``keys`` (its block hashes, from ``chain_keys``) in that namespace; 0 when
        there is none to hold (nothing to release). Holds are by key (Residency.hold_keys):
        a block stored again under a held key while the hold lasts is held too."""
        held = [(namespace, keys[:length]) for namespace, length in prefixes if length]
        if not held:
            return 0
        for namespace, namespace_keys in held:
            self._residency.hold_keys(namespace, namespace_keys)
        hold_id = self._new_id()
        self._held[hold_id] = (self._clock() + ttl_s, held)
        return hold_id

    def release(self, hold_id: int) -> None:
        try:
            _, held = self._held.pop(hold_id)
        except KeyError:
            raise NotFound(f"hold {hold_id} does not exist; it was released, expired or never granted.") from None
        for namespace, keys in held:
            self._residency.release_keys(namespace, keys)

    def expire(self) -> list[int]:
        """Release the holds past their deadline; their ids."""
        now = self._clock()
        expired = [hold_id for hold_id, (deadline, _) in self._held.items() if deadline <= now]
        for hold_id in expired:
            self.release(hold_id)
        return expired
