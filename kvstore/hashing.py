"""Content-addressed, chained block hashes that every process computes alike.

A prompt is cut into blocks of ``block_size`` tokens; only full blocks are keyed (a
partial trailing block changes as the prompt grows, so it is never cacheable). The hash
of block ``i`` covers the whole prefix up to and including it::

    h[-1] = ROOT_PARENT                      (16 zero bytes)
    h[i]  = XXH3-128(CHAIN_SEED ‖ h[i-1] ‖ uint32-LE(tokens of block i))

``CHAIN_SEED`` is the fixed 16-byte string ``b"kvstore/chain/v1"``; the digest is
XXH3-128's canonical (big-endian) 16-byte form.

A block whose KV depends on more than its tokens — the request's cache salt (a tenant's
isolation), a LoRA adapter, a multimodal input or prompt embeddings inside it — carries
those *extra keys*, one canonical byte string per block as the engine's own prefix
hashing names them (connectors/vllm_compat.py), and is hashed under its own seed::

    h[i]  = XXH3-128(EXTRA_SEED ‖ h[i-1] ‖ uint32-LE(tokens of block i) ‖ XXH3-128(extra keys of block i))

so it can equal neither a block without extra keys nor one with other extra keys, and
through the chain every block after it differs too (a salt named on the first block
alone isolates the whole prompt). Nothing here depends on Python's
``hash()``, ``PYTHONHASHSEED`` or the process, so two engines on two hosts that see the
same tokens derive the same keys. Changing the seed or the encoding is a format change:
bump the version in the seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

__all__ = [
    "BlockHash",
    "CHAIN_SEED",
    "EXTRA_SEED",
    "ROOT_PARENT",
    "HASH_BYTES",
    "hash_block",
    "chain_hashes",
    "token_bytes",
    "num_full_blocks",
    "parse_block_hash",
]

BlockHash = NewType("BlockHash", bytes)

HASH_BYTES = 16
CHAIN_SEED = b"kvstore/chain/v1"
EXTRA_SEED = b"kvstore/chainx/1"
ROOT_PARENT = BlockHash(bytes(HASH_BYTES))

_MAX_TOKEN_ID = 2**32 - 1


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Encode token ids as uint32 little-endian, rejecting ids that do not fit (what block
    keys hash)."""
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise InvalidArgument(f"token ids must be a flat sequence, got shape {array.shape}.")
    if array.size == 0:
        return b""
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidArgument(f"token ids must be integers, got dtype {array.dtype}.")
    if int(array.min()) < 0 or int(array.max()) > _MAX_TOKEN_ID:
        raise InvalidArgument("token ids must lie in [0, 2**32); a negative or huge id was given.")
    return array.astype("<u4", copy=False).tobytes()


def hash_block(parent: BlockHash | None, block_tokens: Sequence[int] | np.ndarray) -> BlockHash:
    """Hash one full block given the hash of the block before it (None for the first)."""
    parent_bytes = ROOT_PARENT if parent is None else parent
    if len(parent_bytes) != HASH_BYTES:
        raise InvalidArgument(f"a parent hash is {HASH_BYTES} bytes, got {len(parent_bytes)}.")
    return BlockHash(xxhash.xxh3_128_digest(CHAIN_SEED + parent_bytes + token_bytes(block_tokens)))


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """How many full blocks ``num_tokens`` tokens make; the partial tail is not counted."""
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be positive, got {block_size}.")
    return num_tokens // block_size


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: BlockHash | None = None,
    extra_keys: Sequence[bytes | None] | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, chained from ``parent``.

    Passing the last hash of an earlier call as ``parent`` continues that chain, so a
    growing prompt can be hashed incrementally. ``extra_keys[i]``, where given and not
    None, is what besides its tokens block ``i`` depends on (see the module's docstring).
    """
    encoded = token_bytes(token_ids)
    num_blocks = num_full_blocks(len(encoded) // 4, block_size)
    stride = block_size * 4
    view = memoryview(encoded)
    previous = ROOT_PARENT if parent is None else parent
    if len(previous) != HASH_BYTES:
        raise InvalidArgument(f"a parent hash is {HASH_BYTES} bytes, got {len(previous)}.")
    if extra_keys is not None and len(extra_keys) < num_blocks:
        raise InvalidArgument(f"{len(extra_keys)} blocks' extra keys were given for {num_blocks} full blocks.")
    hashes: list[BlockHash] = []
    digest = xxhash.xxh3_128_digest
    for i in range(num_blocks):
        extra = None if extra_keys is None else extra_keys[i]
        if extra is None:
            previous = digest(b"".join((CHAIN_SEED, previous, view[i * stride : (i + 1) * stride])))
        else:
            previous = digest(b"".join((EXTRA_SEED, previous, view[i * stride : (i + 1) * stride], digest(extra))))
        hashes.append(BlockHash(previous))
    return hashes


def parse_block_hash(text: str) -> BlockHash:
    """Parse a 32-hex-digit block hash as printed by the CLI and the API."""
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise InvalidArgument(f"{text!r} is not a hex block hash.") from exc
    if len(raw) != HASH_BYTES:
        raise InvalidArgument(f"a block hash is {HASH_BYTES * 2} hex digits, got {len(text)}.")
    return BlockHash(raw)
