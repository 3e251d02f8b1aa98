"""What each request a peer daemon sends may hold, checked before anything acts on it.

A peer is not trusted more than an engine: every field goes through the checks the local
protocol applies (kvstore/localproto.py), so a malformed one is an InvalidArgument to the
sender naming the field, never a tier's failure later. A request carries exactly the
fields of its op; the namespace of a ``store`` or ``handoff`` travels with its tenant salt
as the salt's digest, never the salt itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.localproto import checked_count, checked_digest, checked_parent, checked_text, describe, namespace_from_wire, unpack_hashes
from kvstore.namespace import Namespace

__all__ = ["MAX_PEER_BLOCKS", "PEER_SIGNATURES", "checked_request", "checked_hashes", "checked_chain_hashes", "peer_namespace"]

MAX_PEER_BLOCKS = 65_536  # the most blocks one request may name, as on the local socket


def checked_hashes(value: Any) -> list[BlockHash]:
    if isinstance(value, bytes) and len(value) > MAX_PEER_BLOCKS * HASH_BYTES:
        raise InvalidArgument(f"a request names at most {MAX_PEER_BLOCKS} blocks, got {len(value) // HASH_BYTES}.")
    return unpack_hashes(value)


def checked_chain_hashes(value: Any) -> list[BlockHash]:
    """The hashes of one chain, which names no block twice (each hash covers its parent's)."""
    hashes = checked_hashes(value)
    if len(set(hashes)) != len(hashes):
        raise InvalidArgument("the block hashes of a chain are distinct; this request names a block more than once.")
    return hashes


def peer_namespace(value: Any) -> Namespace:
    return namespace_from_wire(value, salt_in_clear=False)


Check = Callable[[Any], Any]

# op → its fields and their checks
PEER_SIGNATURES: dict[str, dict[str, Check]] = {
    "fetch": {"namespace": checked_digest, "hashes": checked_hashes},
    "store": {"namespace": peer_namespace, "hashes": checked_chain_hashes, "parent": checked_parent},
    "handoff": {"transfer": checked_text, "namespace": peer_namespace, "hashes": checked_chain_hashes, "parent": checked_parent},
    "capacity": {},
    "hot": {"max_bytes": checked_count},
}


def checked_request(message: Any) -> tuple[str, dict[str, Any]]:
    """The op of a peer's request and its fields, converted; InvalidArgument naming the
    first field that does not fit."""
    op = message.get("op") if isinstance(message, dict) else None
    if not isinstance(op, str) or op not in PEER_SIGNATURES:
        raise InvalidArgument(f"a peer request is a map with an op among {sorted(PEER_SIGNATURES)}, got {describe(message)}.")
    signature = PEER_SIGNATURES[op]
    if message.keys() - {"op"} != signature.keys():
        unexpected = len(message.keys() - {"op"} - signature.keys())
        missing = sorted(signature.keys() - message.keys())
        raise InvalidArgument(
            f"a {op} request has the fields {sorted(signature) or 'none'}; this one misses {missing or 'none'} "
            f"and has {unexpected} other field(s)."
        )
    fields = {}
    for name, check in signature.items():
        try:
            fields[name] = check(message[name])
        except InvalidArgument as exc:
            raise InvalidArgument(f"{op}: {name}: {exc}") from None
    return op, fields
