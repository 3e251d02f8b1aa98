"""Namespaces: everything that makes two blocks' bytes incompatible, in one digest.

A block key is ``(namespace digest, chain hash)``. The digest covers the model, the KV
layout (dtype, block size, layers, heads, head dim, element order), the tensor- and
pipeline-parallel shard, and an optional tenant salt, so two engines that would write
different bytes for the same tokens never share a block. Serving KV computed under
another namespace would give plausible but wrong answers; the digest makes that
impossible by construction.

The digest covers the salt only through ``salt_digest`` (BLAKE3 of the salt), and that is
all a namespace carries to other daemons, prints or logs: a daemon that receives it from a
peer registers an equal namespace (the same digest) without ever learning the salt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import blake3
import msgpack
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout

__all__ = ["Namespace", "NAMESPACE_DIGEST_BYTES", "SALT_DIGEST_BYTES", "SaltDigest", "salt_digest"]

NAMESPACE_DIGEST_BYTES = 16
SALT_DIGEST_BYTES = 32
_NAMESPACE_FORMAT = "kvstore/namespace/v2"  # v2: the salt enters the digest as its BLAKE3 digest


class SaltDigest(bytes):
    """BLAKE3 of a tenant salt: what a namespace's ``tenant_salt`` is where the salt must not be known."""


def salt_digest(tenant_salt: str) -> SaltDigest:
    """What stands for a tenant salt everywhere outside the engine that chose it."""
    return SaltDigest(blake3.blake3(tenant_salt.encode()).digest())


@dataclass(frozen=True, slots=True)
class Namespace:
    model_id: str
    layout: KVLayout
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # the salt, or its SaltDigest where a peer sent the namespace; never printed, and compared through its digest
    tenant_salt: str | SaltDigest = field(default="", repr=False, compare=False)
    salt_digest: bytes = field(init=False, repr=False)
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise InvalidArgument("Namespace.model_id must be a non-empty model name.")
        if not isinstance(self.layout, KVLayout):
            raise InvalidArgument("Namespace.layout must be a KVLayout.")
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"), (self.pp_rank, self.pp_size, "pp")):
            # bools are ints to Python, but would give the same shard a second digest
            if type(size) is not int or size <= 0:
                raise InvalidArgument(f"Namespace.{what}_size must be a positive integer, got {size!r}.")
            if type(rank) is not int or not 0 <= rank < size:
                raise InvalidArgument(f"Namespace.{what}_rank must lie in [0, {size}), got {rank!r}.")
        if isinstance(self.tenant_salt, SaltDigest):
            if len(self.tenant_salt) != SALT_DIGEST_BYTES:
                raise InvalidArgument(f"a tenant salt's digest is {SALT_DIGEST_BYTES} bytes (BLAKE3), got {len(self.tenant_salt)}.")
            object.__setattr__(self, "salt_digest", bytes(self.tenant_salt))
        elif isinstance(self.tenant_salt, str):
            object.__setattr__(self, "salt_digest", bytes(salt_digest(self.tenant_salt)))
        else:
            raise InvalidArgument("Namespace.tenant_salt must be a string.")
        canonical = msgpack.packb(
            [
                _NAMESPACE_FORMAT,
                self.model_id,
                self.layout.describe(),
                self.tp_rank,
                self.tp_size,
                self.pp_rank,
                self.pp_size,
                self.salt_digest,
            ]
        )
        object.__setattr__(self, "digest", xxhash.xxh3_128_digest(canonical))

    @property
    def id(self) -> str:
        """The digest as 32 hex digits, as the CLI and the API print it."""
        return self.digest.hex()

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def block_size(self) -> int:
        return self.layout.block_size
