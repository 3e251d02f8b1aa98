"""Cache bytes held per tenant: which of the blocks a tenant's recent requests need are
resident in the fleet, and how many bytes that is.

The router remembers, per tenant label (metrics.TenantLabels: at most ``max_tenants`` and
``other``), the chains of block keys its recent requests sent (`RecentChains`: the last
``max_chains`` distinct chains, at most ``max_blocks`` blocks in all; a chain that extends
a remembered one, as a session's next turn does, replaces it). Every
``tenant_cache_interval_s`` `TenantCache.refresh` asks the index which prefix of each
chain some live node holds (`Index.match_many`: pipelined, one round trip per
MAX_CHAIN_BLOCKS hashes) and `attribute` splits the resident blocks among the tenants:

- a resident block counts once for the fleet, however many nodes and tiers hold a copy;
- a block in the chains of several tenants is split evenly among them, so the tenants'
  bytes add up to the bytes of the distinct resident blocks of all remembered chains;
- a chain's resident part is the longest prefix any one live node holds (a block past a
  missing parent is worthless to a request, DESIGN.md §3); the index may over-report a
  node's prefix across small holes (RedisIndex.match), and so may this figure.

Only the remembered chains count: the figure is what the tenant's recent traffic keeps
in cache, not everything that tenant ever stored.

The core (`RecentChains`, `attribute`) is pure and synchronous. Owner: the router's event
loop (`TenantCache`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.gateway.metrics import RouterMetrics
from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.index.base import Index
from kvstore.namespace import Namespace

__all__ = ["RecentChains", "TenantShare", "TenantCache", "attribute"]

log = logging.getLogger(__name__)


class _TenantChains:
    """One tenant's chains, oldest first, each joined into one bytes object and keyed by
    its last block key (chained keys: equal last keys mean equal chains)."""

    def __init__(self) -> None:
        self.by_last_key: OrderedDict[bytes, bytes] = OrderedDict()
        self.num_blocks = 0

    def add(self, chain: bytes) -> None:
        for last_key, known in list(self.by_last_key.items()):
            if len(known) >= len(chain) and known[len(chain) - HASH_BYTES : len(chain)] == chain[-HASH_BYTES:]:
                self.by_last_key.move_to_end(last_key)  # already remembered, within a longer chain
                return
            if known[-HASH_BYTES:] == chain[len(known) - HASH_BYTES : len(known)]:
                self._drop(last_key)  # the new chain extends it
        self.by_last_key[chain[-HASH_BYTES:]] = chain
        self.num_blocks += len(chain) // HASH_BYTES

    def shrink(self, max_chains: int, max_blocks: int) -> None:
        while len(self.by_last_key) > max_chains or self.num_blocks > max_blocks:
            self._drop(next(iter(self.by_last_key)))

    def _drop(self, last_key: bytes) -> None:
        self.num_blocks -= len(self.by_last_key.pop(last_key)) // HASH_BYTES


class RecentChains:
    """The last ``max_chains`` distinct chains of each tenant label, ``max_blocks`` blocks
    in all per label (a longer chain is remembered by its first ``max_blocks``): at most
    ``max_blocks`` × 16 bytes per label."""

    def __init__(self, max_chains: int, max_blocks: int) -> None:
        self._max_chains = max_chains
        self._max_blocks = max_blocks
        self._by_tenant: dict[str, _TenantChains] = {}

    def record(self, tenant: str, hashes: Sequence[BlockHash]) -> None:
        chain = b"".join(hashes[: self._max_blocks])
        if not chain:
            return
        chains = self._by_tenant.setdefault(tenant, _TenantChains())
        chains.add(chain)
        chains.shrink(self._max_chains, self._max_blocks)

    def tenants(self) -> list[str]:
        return list(self._by_tenant)

    def chains(self) -> list[tuple[str, bytes]]:
        """(tenant, joined chain) of every remembered chain, oldest first per tenant."""
        return [(tenant, chain) for tenant, chains in self._by_tenant.items() for chain in chains.by_last_key.values()]


@dataclass(frozen=True, slots=True)
class TenantShare:
    num_blocks: int  # resident blocks in the tenant's chains, a shared one counted in full
    num_bytes: float  # its share of their bytes: a block of n tenants counts 1/n of its bytes


def attribute(resident: Sequence[tuple[str, bytes]], block_bytes: int) -> dict[str, TenantShare]:
    """Each tenant's share of the distinct blocks in ``resident``: (tenant, joined chain
    prefix) pairs. Chained keys make a block at position i of two chains the same block
    exactly when the chains agree up to i, so the chains, sorted, form a trie whose nodes
    are runs of blocks with one set of tenants; one pass over the sorted chains with a
    stack of open runs visits each run once, without a set of every block."""
    blocks: dict[str, int] = {}
    shares: dict[str, float] = {}
    ordered = sorted((chain, tenant) for tenant, chain in resident if chain)
    stack: list[tuple[int, set[str]]] = [(0, set())]  # (depth in blocks, tenants below), depths increasing

    def close(depth: int, tenants: set[str], parent_depth: int) -> None:
        run = depth - parent_depth
        for tenant in tenants:
            blocks[tenant] = blocks.get(tenant, 0) + run
            shares[tenant] = shares.get(tenant, 0.0) + run * block_bytes / len(tenants)

    for k, (chain, tenant) in enumerate(ordered):
        depth = len(chain) // HASH_BYTES
        if stack[-1][0] == depth:
            stack[-1][1].add(tenant)
        else:
            stack.append((depth, {tenant}))
        following = _common_blocks(chain, ordered[k + 1][0]) if k + 1 < len(ordered) else 0
        while stack[-1][0] > following:
            depth, tenants = stack.pop()
            if stack[-1][0] >= following:
                close(depth, tenants, stack[-1][0])
                stack[-1][1].update(tenants)
            else:
                close(depth, tenants, following)
                stack.append((following, tenants))
    return {tenant: TenantShare(blocks[tenant], shares[tenant]) for tenant in blocks}


def _common_blocks(a: bytes, b: bytes) -> int:
    """How many leading blocks two chains share: with chained keys, blocks agree exactly up
    to the first that differs, so a binary search compares single keys."""
    low, high = 0, min(len(a), len(b)) // HASH_BYTES
    while low < high:
        mid = (low + high + 1) // 2
        if a[(mid - 1) * HASH_BYTES : mid * HASH_BYTES] == b[(mid - 1) * HASH_BYTES : mid * HASH_BYTES]:
            low = mid
        else:
            high = mid - 1
    return low


class TenantCache:
    """Keeps ``kvstore_router_tenant_cache_{bytes,blocks}`` current from the index.
    Owner: the router's event loop."""

    def __init__(self, recent: RecentChains, index: Index, namespace: Namespace, metrics: RouterMetrics) -> None:
        self.recent = recent
        self._index = index
        self._namespace = namespace
        self._metrics = metrics
        self._block_bytes = namespace.block_bytes * namespace.tp_size  # every rank holds its shard of the block

    async def refresh(self) -> dict[str, TenantShare]:
        remembered = self.recent.chains()
        if not remembered:
            return {}
        distinct = sorted({chain for _tenant, chain in remembered})
        answers = await self._index.match_many(self._namespace.digest, distinct)
        resident_blocks = {chain: max((m.num_blocks for m in matches), default=0) for chain, matches in zip(distinct, answers)}
        resident = [(tenant, chain[: resident_blocks[chain] * HASH_BYTES]) for tenant, chain in remembered]
        found = attribute(resident, self._block_bytes)
        for tenant in self.recent.tenants():
            share = found.get(tenant, TenantShare(0, 0.0))
            self._metrics.tenant_cache_blocks.labels(tenant).set(share.num_blocks)
            self._metrics.tenant_cache_bytes.labels(tenant).set(share.num_bytes)
        return found

    async def run(self, interval_s: float) -> None:
        """Refresh every ``interval_s`` until cancelled; an index that does not answer leaves
        the last figures in place until it does."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.refresh()
            except KVStoreError as exc:
                log.warning("cache bytes per tenant not refreshed: %s", exc)
