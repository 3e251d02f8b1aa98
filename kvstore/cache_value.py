"""What a node's cache is worth to the fleet: the bytes no other node holds, weighted by
recent use (pure core; kvstore/cache_meter.py measures it on a daemon, kvstore/scaledown.py
ranks the fleet's nodes by it).

A node that leaves takes with it only what nobody else holds. **Unique** means: no other
live daemon of the block-location index (a node of kind ``"kvstore"``) holds the block
*together with the blocks before it in its chain* — a block without its prefix serves no
prompt, and once a block is unique every block below it is too. Every tier counts: a copy
on a peer's NVMe is a copy. An engine's GPU prefix cache is not: it is the first to be
evicted and no peer fetches from it. Orphans (blocks whose parent is gone here) serve
nothing and are worth nothing.

**Weight**: how likely a block is to be read again falls with the time since it was last
read (its idle time)::

    weight(b)   = 1                                  if b is pinned (an operator keeps it)
                = 2 ** (-idle_s(b) / half_life_s)     otherwise
    value_bytes = sum of nbytes(b) * weight(b) over the node's unique blocks

A block idle for one half-life counts half its bytes, for two a quarter. The default
half-life, ``DEFAULT_HALF_LIFE_S`` (10 minutes, ``server.cache_value_half_life_s``), suits
agent sessions whose next turn comes within minutes: a prefix idle for an hour counts 1/64.

Nothing here does I/O or holds state: the caller brings a snapshot of the node's blocks
and, for each chain, how far another daemon holds it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from kvstore.chains import Chain
    from kvstore.hashing import BlockHash
    from kvstore.tiers.records import BlockInfo

__all__ = ["DEFAULT_HALF_LIFE_S", "MAX_HALF_LIFE_S", "CacheValue", "check_half_life", "reuse_weight", "unique_keys", "node_value"]

DEFAULT_HALF_LIFE_S = 600.0
MAX_HALF_LIFE_S = 30 * 86_400.0


@dataclass(frozen=True, slots=True)
class CacheValue:
    """One node's figure, as of when it was measured."""

    node_id: str
    value_bytes: float  # unique bytes weighted by recent use (the module docstring)
    unique_bytes: int  # the same blocks' bytes, unweighted
    unique_blocks: int
    total_bytes: int  # every block it holds, shared or not
    total_blocks: int
    num_peers: int  # other live daemons its index lists; 0: every block it holds counted as unique
    half_life_s: float


def check_half_life(half_life_s: float) -> float:
    if isinstance(half_life_s, bool) or not isinstance(half_life_s, (int, float)) or not 0 < half_life_s <= MAX_HALF_LIFE_S:
        raise InvalidArgument(f"half_life_s must be a number of seconds in (0, {MAX_HALF_LIFE_S:g}], got {half_life_s!r}.")
    return float(half_life_s)


def reuse_weight(idle_s: float, half_life_s: float, pinned: bool = False) -> float:
    """The share of a block's bytes that counts: 1 when pinned, else halved every ``half_life_s`` of idleness."""
    if pinned:
        return 1.0
    return math.pow(2.0, -max(idle_s, 0.0) / half_life_s)


def unique_keys(chains: Sequence[Chain], held_lengths: Sequence[int]) -> set[tuple[bytes, BlockHash]]:
    """The (namespace, hash) of every block of ``chains`` that no other daemon holds.

    ``chains`` are a node's chains as `kvstore.chains.drain_plan` cuts them: each starts
    below a block of an earlier chain (its ``parent``) or at a root. ``held_lengths[i]`` is
    the longest run of ``chains[i]``, from its first block, that some other daemon holds.
    A chain whose parent is unique is unique whole, whatever another daemon holds of it."""
    if len(chains) != len(held_lengths):
        raise InvalidArgument(f"{len(chains)} chains came with {len(held_lengths)} held lengths; give one per chain.")
    unique: set[tuple[bytes, BlockHash]] = set()
    for chain, held in zip(chains, held_lengths):
        if chain.parent is not None and (chain.namespace, chain.parent) in unique:
            held = 0
        unique.update((chain.namespace, block_hash) for block_hash in chain.hashes[held:])
    return unique


def node_value(
    node_id: str,
    blocks: Iterable[BlockInfo],
    unique: set[tuple[bytes, BlockHash]],
    now: float,
    half_life_s: float,
    num_peers: int,
) -> CacheValue:
    """The figure of a node holding ``blocks`` (``last_access`` on the clock of ``now``), of which ``unique`` are its alone."""
    half_life_s = check_half_life(half_life_s)
    value, unique_bytes, num_unique, total_bytes, num_blocks = 0.0, 0, 0, 0, 0
    for block in blocks:
        num_blocks += 1
        total_bytes += block.nbytes
        if (block.namespace, block.block_hash) in unique:
            num_unique += 1
            unique_bytes += block.nbytes
            value += block.nbytes * reuse_weight(now - block.last_access, half_life_s, block.pinned)
    return CacheValue(node_id, value, unique_bytes, num_unique, total_bytes, num_blocks, num_peers, half_life_s)
