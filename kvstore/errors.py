"""Every error kvstore raises on purpose.

    KVStoreError
    ├── InvalidArgument        the caller passed something malformed (wrong size, bad hash, …)
    │   └── BlockSizeMismatch  the bytes offered do not match the block's layout
    ├── UnknownNamespace       no block was ever stored under this namespace here
    ├── NotFound               the named block, lease or reservation does not exist
    ├── CapacityExhausted      no slot can be freed for the request (everything pinned or leased)
    ├── Unavailable            something kvstore depends on cannot be used right now
    │   ├── TierUnavailable      a tier failed an I/O or cannot be opened; ``tier`` names it
    │   ├── DaemonUnavailable    the local daemon does not answer (not running, restarting, stopped)
    │   ├── IndexUnavailable     the block-location index backend cannot be reached
    │   └── TransportUnavailable the configured peer transport cannot be used (ucxx missing)
    ├── CorruptBlock           stored bytes failed verification; callers treat it as a miss
    ├── ReservationExpired     a writer committed after its reservation timed out
    ├── TransferFailed         a peer transfer broke off (peer gone, deadline, bad frame)
    └── PermissionDenied       the other end did not prove who it is, or may not ask that

Which class is raised says whose fault it is: a failed NVMe read is the NVMe tier's
(``TierUnavailable`` with ``tier`` NVMe), never the tier it was being read into; a daemon
that went away is ``DaemonUnavailable``, which a connector turns into misses.

Each message is a sentence that says what was wrong and, where it helps, what to do.
Foreign errors (OS, gRPC, Redis, UCX) are translated where they enter kvstore and
chained with ``raise … from exc``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.tier_kind import TierKind

__all__ = [
    "KVStoreError",
    "InvalidArgument",
    "BlockSizeMismatch",
    "UnknownNamespace",
    "NotFound",
    "CapacityExhausted",
    "Unavailable",
    "TierUnavailable",
    "DaemonUnavailable",
    "IndexUnavailable",
    "TransportUnavailable",
    "CorruptBlock",
    "ReservationExpired",
    "TransferFailed",
    "PermissionDenied",
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


class Unavailable(KVStoreError):
    """Something kvstore depends on cannot be used right now; retrying later may work."""


class TierUnavailable(Unavailable):
    """A tier cannot serve right now (an I/O error, disk full, unwritable directory, missing
    device). ``tier`` is the kind of the tier at fault, where one is (None: every tier)."""

    def __init__(self, sentence: str, tier: TierKind | None = None) -> None:
        super().__init__(sentence)
        self.tier = tier


class DaemonUnavailable(Unavailable):
    """The local kvstore daemon does not answer: not running, restarting, stopped, or slower
    than the client's timeout. Connectors treat it as misses and failed saves."""


class IndexUnavailable(Unavailable):
    """The block-location index backend (Redis) cannot be reached."""


class TransportUnavailable(Unavailable):
    """The configured peer transport cannot be used (e.g. ``ucxx`` is not installed)."""


class CorruptBlock(KVStoreError):
    """Stored bytes failed checksum or header verification; the block was dropped."""


class ReservationExpired(KVStoreError):
    """A reservation was committed after it expired; its slots were already reclaimed."""


class TransferFailed(KVStoreError):
    """A block transfer with a peer daemon broke off: the peer went away, the deadline
    passed, or a frame failed verification. What arrived intact before stays usable."""


class PermissionDenied(KVStoreError):
    """A peer did not authenticate (no credential, a wrong one, a certificate from another
    CA), or asked for what its role does not allow; nothing was sent to it or taken from it."""


def raise_error(kind: str, sentence: str) -> None:
    """Raise the error a peer or daemon named by its class name (unknown names: the base)."""
    error = globals().get(kind)
    if not (isinstance(error, type) and issubclass(error, KVStoreError)):
        error = KVStoreError
    raise error(sentence)
