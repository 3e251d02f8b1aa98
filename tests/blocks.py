"""Test blocks whose bytes follow from their keys: a chain of keys from a seed, and the one
content each key may hold, so any other bytes found under a key are wrong."""

from __future__ import annotations

import torch

from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout


def chain_of(layout: KVLayout, seed: int, num_blocks: int) -> list[bytes]:
    return chain_hashes([(seed * 7919 + i) % 50_000 for i in range(num_blocks * layout.block_size)], layout.block_size)


def content_of(block_hash: bytes, num_bytes: int) -> torch.Tensor:
    seed = int.from_bytes(block_hash[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
