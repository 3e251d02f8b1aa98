"""Which blocks are worth moving: chains picked from a node's catalogue (pure core).

A block is only useful with its whole prefix, so what moves between nodes is a *chain*:
a root-to-block path of the prefix tree, sent parent first. Two questions pick chains:

- drain (`drain_plan`): before a node leaves, its most valuable blocks go to peers. The
  value of a path is the recency of its deepest block; a path brings its ancestors, so
  shallow, shared blocks come first and are sent once. Orphans (their parent is gone)
  are worthless and stay behind.
- warm-up (`shared_prefixes`): a new node takes the fleet's hottest *shared* prefixes —
  blocks that at least two cached chains go through (system prompts, tool definitions),
  most recently used first — not any one session's private tail.

Both stop at a byte budget and return chains in the order they should be sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvstore.hashing import BlockHash
from kvstore.namespace import Namespace
from kvstore.tiers.records import BlockInfo

__all__ = ["Chain", "describable", "drain_plan", "shared_prefixes"]


@dataclass(frozen=True, slots=True)
class Chain:
    namespace: bytes
    parent: BlockHash | None  # the block before ``hashes[0]``, already sent or None for a root
    hashes: tuple[BlockHash, ...]
    nbytes: int  # bytes of all its blocks

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


class _Forest:
    def __init__(self, blocks: Iterable[BlockInfo]) -> None:
        self.by_key = {(b.namespace, b.block_hash): b for b in blocks}
        self.children: dict[tuple[bytes, BlockHash], list[BlockInfo]] = {}
        for block in self.by_key.values():
            if block.parent_hash is not None:
                self.children.setdefault((block.namespace, block.parent_hash), []).append(block)

    def path_to(self, block: BlockInfo, taken: set) -> list[BlockInfo] | None:
        """Blocks from the first not yet taken ancestor down to ``block``; None for an orphan."""
        path = [block]
        while True:
            top = path[-1]
            if top.parent_hash is None:
                break
            parent = self.by_key.get((top.namespace, top.parent_hash))
            if parent is None:
                return None
            if (parent.namespace, parent.block_hash) in taken:
                break
            path.append(parent)
        path.reverse()
        return path

    def leaves(self) -> list[BlockInfo]:
        return [b for key, b in self.by_key.items() if key not in self.children]


def _take(forest: _Forest, targets: list[BlockInfo], max_bytes: int) -> list[Chain]:
    chains: list[Chain] = []
    taken: set[tuple[bytes, BlockHash]] = set()
    budget = max_bytes if max_bytes > 0 else float("inf")
    for target in targets:
        if (target.namespace, target.block_hash) in taken:
            continue
        path = forest.path_to(target, taken)
        if path is None:
            continue
        nbytes = sum(b.nbytes for b in path)
        if nbytes > budget:
            # a shorter prefix of the path still fits and is still useful
            kept, nbytes = [], 0
            for block in path:
                if nbytes + block.nbytes > budget:
                    break
                kept.append(block)
                nbytes += block.nbytes
            path = kept
            if not path:
                continue
        budget -= nbytes
        taken.update((b.namespace, b.block_hash) for b in path)
        chains.append(Chain(path[0].namespace, path[0].parent_hash, tuple(b.block_hash for b in path), nbytes))
    return chains


def describable(blocks: Iterable[BlockInfo], namespaces: Mapping[bytes, Namespace | None]) -> list[BlockInfo]:
    """The blocks whose namespace an engine has registered here. A peer is sent the
    namespace's fields with its blocks; blocks recovered from NVMe under a namespace that
    nobody has registered since cannot be described, so they stay."""
    return [b for b in blocks if namespaces.get(b.namespace) is not None]


def drain_plan(blocks: Iterable[BlockInfo], max_bytes: int = 0) -> list[Chain]:
    """Root-to-leaf chains, most recently used leaf first, within ``max_bytes`` (0: all)."""
    forest = _Forest(blocks)
    leaves = sorted(forest.leaves(), key=lambda b: b.last_access, reverse=True)
    return _take(forest, leaves, max_bytes)


def shared_prefixes(blocks: Iterable[BlockInfo], max_bytes: int = 0) -> list[Chain]:
    """Chains ending at the deepest blocks that two or more cached chains share, most
    recently used first, within ``max_bytes`` (0: all)."""
    forest = _Forest(blocks)
    num_leaves: dict[tuple[bytes, BlockHash], int] = {}
    for leaf in forest.leaves():
        path = forest.path_to(leaf, set())
        for block in path or ():
            key = (block.namespace, block.block_hash)
            num_leaves[key] = num_leaves.get(key, 0) + 1
    shared = [forest.by_key[k] for k, n in num_leaves.items() if n >= 2]
    shared_keys = {(b.namespace, b.block_hash) for b in shared}
    # the deepest shared block of each branch: none of its children is shared
    ends = [
        b
        for b in shared
        if not any((c.namespace, c.block_hash) in shared_keys for c in forest.children.get((b.namespace, b.block_hash), ()))
    ]
    ends.sort(key=lambda b: b.last_access, reverse=True)
    return _take(forest, ends, max_bytes)
