"""Every error kvstore raises on purpose.

    KVStoreError
    ├── InvalidArgument        the caller passed something malformed (wrong size, bad hash, …)
    │   └── BlockSizeMismatch  the bytes offered do not match the block's layout
    ├── UnknownNamespace       no block was ever stored under this namespace here
    ├── NotFound               the named block, lease or reservation does not exist
    ├── CapacityExhausted      no slot can be freed for the request (everything pinned or leased)
    ├── TierUnavailable        a tier cannot be used right now (disk full, directory unwritable)
    ├── CorruptBlock           stored bytes failed verification; callers treat it as a miss
    ├── ReservationExpired     a writer committed after its reservation timed out
    └── TransferFailed         a peer transfer broke off (peer gone, deadline, bad frame)

Each message is a sentence that says what was wrong and, where it helps, what to do.
Foreign errors (OS, gRPC, Redis, UCX) are translated where they enter kvstore and
chained with ``raise … from exc``.
"""

from __future__ import annotations

__all__ = [
    "KVStoreError",
    "InvalidArgument",
    "BlockSizeMismatch",
    "UnknownNamespace",
    "NotFound",
    "CapacityExhausted",
    "TierUnavailable",
    "CorruptBlock",
    "ReservationExpired",
    "TransferFailed",
    "raise_error",
]


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class InvalidArgument(KVStoreError, ValueError):
    """The caller passed a malformed value."""


class BlockSizeMismatch(InvalidArgument):
    """The bytes offered for a block do not match the size its layout requires."""


class UnknownNamespace(KVStoreError, LookupError):
    """No block has been stored under this namespace."""


class NotFound(KVStoreError, LookupError):
    """The named block, lease or reservation does not exist."""


class CapacityExhausted(KVStoreError):
    """No slot can be freed: every resident block is pinned, leased or reserved."""


class TierUnavailable(KVStoreError):
    """A tier cannot serve right now (disk full, unwritable directory, missing device)."""


class CorruptBlock(KVStoreError):
    """Stored bytes failed checksum or header verification; the block was dropped."""


class ReservationExpired(KVStoreError):
    """A reservation was committed after it expired; its slots were already reclaimed."""


class TransferFailed(KVStoreError):
    """A block transfer with a peer daemon broke off: the peer went away, the deadline
    passed, or a frame failed verification. What arrived intact before stays usable."""


def raise_error(kind: str, sentence: str) -> None:
    """Raise the error a peer or daemon named by its class name (unknown names: the base)."""
    error = globals().get(kind)
    if not (isinstance(error, type) and issubclass(error, KVStoreError)):
        error = KVStoreError
    raise error(sentence)
