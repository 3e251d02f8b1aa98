"""What the chaos run's engines store, and how every byte they load is checked.

Blocks carry content that can be verified without remembering it: the bytes of a block
are a PCG64 stream seeded by the first 8 bytes of its chain hash, so any process derives
the bytes a key must hold, and bytes served under one key that belong to another key (or
to no key) differ from the expected ones in almost every position.

Chains are conversations with growing, shared prefixes: session ``s`` belongs to agent
group ``s % num_groups``; its chain is the group's shared system prompt
(``shared_blocks`` blocks, the same in every session of the group) followed by
``own_blocks`` blocks of its own. A turn of a session is a prefix of that chain, so
turns of one session and sessions of one group overlap. Token ids are a function of
(group, session, position), so every process computes the same chain hashes.

Pure: no I/O, no kvstore daemon; the engines (bench/chaos_engine.py), the driver
(bench/chaos.py) and the tests share it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.hashing import BlockHash, chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

__all__ = [
    "LAYOUT",
    "NAMESPACE",
    "BLOCK_BYTES",
    "Workload",
    "expected_bytes",
    "wrong_bytes",
    "Mismatch",
    "describe_mismatch",
    "scratch_chain",
    "content_digest",
]

# 4 layers x K,V x 16 tokens x 2 heads x 64 dims x fp16 = 32 KiB per block
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
NAMESPACE = Namespace("bench/chaos-model", LAYOUT, tenant_salt="chaos")
BLOCK_BYTES = LAYOUT.block_bytes


def expected_bytes(block_hash: bytes) -> np.ndarray:
    """The bytes a block stored under ``block_hash`` must hold (uint8, BLOCK_BYTES long)."""
    seed = int.from_bytes(block_hash[:8], "little")
    return np.frombuffer(np.random.Generator(np.random.PCG64(seed)).bytes(BLOCK_BYTES), dtype=np.uint8)


def content_digest(data: np.ndarray) -> str:
    """XXH3-64 of a block's bytes, hex: names whose bytes a wrong block holds (see
    bench/chaos.py's attribution of every wrong block it finds)."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(data))


def wrong_bytes(actual: np.ndarray, block_hash: bytes) -> int:
    """How many bytes of ``actual`` differ from what ``block_hash`` must hold; a block of
    the wrong length counts every byte of the expected length as wrong."""
    expected = expected_bytes(block_hash)
    if actual.size != expected.size:
        return expected.size
    return int(np.count_nonzero(actual != expected))


@dataclass(frozen=True, slots=True)
class Mismatch:
    """What a block that failed the check held instead, to tell harness bugs from store bugs."""

    wrong: int
    first_offset: int
    all_zero: bool
    belongs_to: int | None  # index in the chain of the block whose bytes these are, if any
    digest: str  # content_digest of the bytes found


def describe_mismatch(actual: np.ndarray, hashes: Sequence[bytes], index: int) -> Mismatch:
    expected = expected_bytes(hashes[index])
    differs = np.flatnonzero(actual != expected)
    belongs_to = None
    for other, block_hash in enumerate(hashes):
        if other != index and np.array_equal(actual, expected_bytes(block_hash)):
            belongs_to = other
            break
    return Mismatch(int(differs.size), int(differs[0]) if differs.size else -1, not actual.any(), belongs_to, content_digest(actual))


@dataclass(frozen=True, slots=True)
class Workload:
    num_groups: int = 4
    num_sessions: int = 24
    shared_blocks: int = 6
    own_blocks: int = 30

    @property
    def chain_blocks(self) -> int:
        return self.shared_blocks + self.own_blocks

    @property
    def distinct_blocks(self) -> int:
        """Blocks of every chain together: the working set the tiers are sized against."""
        return self.num_groups * self.shared_blocks + self.num_sessions * self.own_blocks

    def chain(self, session: int) -> list[BlockHash]:
        """The hashes of session ``session``'s longest turn; each turn is a prefix of it."""
        return _chain(self, session)


@functools.lru_cache(maxsize=256)
def _chain(workload: Workload, session: int) -> list[BlockHash]:
    size = LAYOUT.block_size
    group = session % workload.num_groups
    shared = np.arange(workload.shared_blocks * size, dtype=np.int64) + 1_000 * group
    own = np.arange(workload.own_blocks * size, dtype=np.int64) + 100_000 + 10_000 * session
    return chain_hashes(np.concatenate([shared, own]) % 50_000, size)


def scratch_chain(engine_id: int, incarnation: int, serial: int, num_blocks: int) -> list[BlockHash]:
    """A chain nobody else writes (reservations that are abandoned or stalled past their
    TTL): tokens from a range the sessions never use, unique per engine life and call."""
    size = LAYOUT.block_size
    base = 60_000 + ((engine_id * 1_000_003 + incarnation * 10_007 + serial) % 1_000_000) * 64
    return chain_hashes(np.arange(base, base + num_blocks * size, dtype=np.int64), size)
