"""The catalogue: every cached block of a node, by key, linked into prefix trees.

A block's parent is the block before it in its chain. The catalogue keeps, for every
block, its cached children and whether it is *reachable* — every ancestor cached, so a
prefix lookup that starts at the chain's first block can get to it. Eviction policies
read both (see tiers/eviction.py). Children may arrive before their parent (a restart
recovers NVMe slots in any order, a transfer may land out of order): they wait, unreachable,
until the parent is inserted and adopts them.

Beside the entries, a dict per namespace maps each cached block's hash to the rank of its
tier, so that the longest cached prefix of a chain arriving as one bytes string is found
in C (split by numpy, ``chain_keys``, then probed) without a tuple, an entry or an
attribute read per block (``prefix_ranks``, the
lookup every engine request makes: ~26 µs for 512 blocks against ~65 µs for a walk of
the entries, ~12 µs for a chain whose keys ``RecentChains`` has already hashed); every
insert, removal and change of tier (``relocate``) goes through here and keeps it in step.

Owner: the tier manager, through tiers/residency.py (which keeps the eviction policies in
step with it); not thread-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvstore.hashing import HASH_BYTES, BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.slab import Slot

__all__ = ["BlockKey", "BlockEntry", "Catalogue", "RecentChains", "chain_keys"]

_ABSENT = 255  # the rank byte of a block not cached (no tier has this rank)
_HASHES = np.dtype(f"V{HASH_BYTES}")  # a void dtype keeps trailing zero bytes, which a bytes dtype would strip

BlockKey = tuple[bytes, BlockHash]  # (namespace digest, chain hash)


def chain_keys(chain: bytes) -> list[bytes]:
    """The block hashes of a chain given concatenated (split by numpy, in C)."""
    return np.frombuffer(chain, dtype=_HASHES).tolist()


class RecentChains:
    """The block keys of the chains split lately, by their first block, so that a chain
    sharing a prefix with one of them (the next turn of a session, a session on the same
    system prompt, the same request looked up again) reuses that prefix's key objects.
    Their hashes are already taken: a fresh 16-byte key costs ~37 ns to hash, most of a
    dict probe's ~50 ns, so a repeated 512-block prefix is probed in ~12 µs instead of ~26.
    The keys are always the chain's own bytes (the shared prefix is found by comparing the
    bytes); what the catalogue holds for them is probed afresh every time.

    Bounded by ``max_blocks`` keys held in all (least recently used chains go first).
    Owner: the tier manager's thread; not thread-safe."""

    def __init__(self, max_blocks: int = 1 << 18) -> None:
        self._max_blocks = max_blocks
        self._held = 0
        self._chains: dict[bytes, tuple[bytes, tuple[bytes, ...]]] = {}  # first block → (chain, its keys), oldest first

    def keys(self, chain: bytes) -> Sequence[bytes]:
        """``chain_keys(chain)``, with the key objects of the prefix it shares with the last
        chain seen that starts with the same block."""
        num_blocks = len(chain) // HASH_BYTES
        if num_blocks < 2 or num_blocks > self._max_blocks:
            return chain_keys(chain)
        first = chain[:HASH_BYTES]
        known = self._chains.pop(first, None)
        if known is None:
            keys = tuple(chain_keys(chain))
        else:
            self._held -= len(known[1])
            common = _common_blocks(chain, known[0])
            keys = known[1][:common]
            if common < num_blocks:
                keys += tuple(chain_keys(chain[common * HASH_BYTES :]))
        self._chains[first] = (chain, keys)
        self._held += num_blocks
        while self._held > self._max_blocks:
            oldest = next(iter(self._chains))
            self._held -= len(self._chains.pop(oldest)[1])
        return keys


def _common_blocks(a: bytes, b: bytes) -> int:
    """How many leading 16-byte blocks ``a`` and ``b`` share (their first is known equal)."""
    end = min(len(a), len(b)) // HASH_BYTES
    if a[: end * HASH_BYTES] == b[: end * HASH_BYTES]:  # one extends the other: the usual case
        return end
    low, high = 1, end - 1  # a[:low] blocks are equal; a[:high + 1] blocks are not
    while low < high:
        middle = (low + high + 1) // 2
        if a[: middle * HASH_BYTES] == b[: middle * HASH_BYTES]:
            low = middle
        else:
            high = middle - 1
    return low


class BlockEntry:
    __slots__ = (
        "key",
        "parent_key",
        "parent",
        "children",
        "tier",
        "slot",
        "nbytes",
        "num_leases",
        "num_readers",
        "checksum",
        "pinned",
        "retained",
        "reachable",
        "moving",
        "stored_at",
        "last_access",
    )

    def __init__(
        self, key: BlockKey, parent_key: BlockKey | None, tier: TierKind, slot: Slot, nbytes: int, now: float, checksum: int | None = None
    ) -> None:
        self.key = key
        self.parent_key = parent_key
        self.parent: BlockEntry | None = None
        self.children: set[BlockEntry] | None = None
        self.tier = tier
        self.slot = slot
        self.nbytes = nbytes
        # holds of any kind (a read lease, a move, a reservation extending the chain): a
        # held block is never evicted
        self.num_leases = 0
        # the holds that are read leases: their holders read the block's slot, so it is
        # never moved out of its tier while one is out (tiers/movement.py)
        self.num_readers = 0
        # XXH3-64 of the bytes, taken by whoever wrote them (the engine's client, the
        # transport on receive); None only where no bytes are kept (the simulator)
        self.checksum = checksum
        self.pinned = False
        # its key is retained (tiers/retention.py): still evictable, but picked last. Set
        # and cleared by tiers/residency.py, which keeps the eviction policies in step
        self.retained = False
        self.reachable = parent_key is None
        # set while the block is being moved out of its tier: it no longer counts as a
        # child there, so its parent may be picked next in the same batch
        self.moving = False
        self.stored_at = now
        self.last_access = now

    @property
    def num_children(self) -> int:
        return len(self.children) if self.children else 0

    @property
    def is_tier_leaf(self) -> bool:
        """No cached child lives in this block's tier or a faster one."""
        children = self.children
        if not children:
            return True
        tier = self.tier
        if len(children) == 1:
            (child,) = children
            return child.moving or (child.tier is not tier and child.tier.rank > tier.rank)
        return all(child.moving or (child.tier is not tier and child.tier.rank > tier.rank) for child in children)

    @property
    def evictable(self) -> bool:
        return self.num_leases == 0 and not self.pinned

    def __repr__(self) -> str:
        return f"BlockEntry({self.key[1].hex()[:12]}…, {self.tier.value}, leases={self.num_leases}, pinned={self.pinned})"


class Catalogue:
    def __init__(self, on_reclassify: Callable[[BlockEntry], None]) -> None:
        # called when a block gains or loses a child, or its reachability flips, so that
        # its eviction group can follow
        self._on_reclassify = on_reclassify
        self._entries: dict[BlockKey, BlockEntry] = {}
        self._waiting: dict[BlockKey, set[BlockEntry]] = {}
        self._ranks: dict[bytes, dict[BlockHash, int]] = {}  # namespace -> block hash -> rank of its tier
        # the dict's own lookup: the hot paths (lookup, reserve) call it once per block
        self.get: Callable[[BlockKey], BlockEntry | None] = self._entries.get

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[BlockEntry]:
        """A snapshot, so callers may insert and remove while iterating."""
        return iter(list(self._entries.values()))

    def prefix_ranks(self, namespace: bytes, keys: Sequence[bytes]) -> bytes:
        """The tier rank (``TierKind.rank``) of each block of the longest cached prefix of
        the chain ``keys`` (its block hashes, from ``chain_keys``), one byte per block."""
        ranks = self._ranks.get(namespace)
        if ranks is None:
            return b""
        # the dict is probed in C, a miss read as _ABSENT
        found = bytes(map(ranks.get, keys, itertools.repeat(_ABSENT)))
        end = found.find(_ABSENT)
        return found if end < 0 else found[:end]

    def relocate(self, entry: BlockEntry, tier: TierKind, slot: Slot) -> None:
        """The block now lives in ``tier``, at ``slot`` (a move ended)."""
        entry.tier, entry.slot = tier, slot
        self._ranks[entry.key[0]][entry.key[1]] = tier.rank

    def insert(self, entry: BlockEntry) -> None:
        assert entry.key not in self._entries, "a block is inserted once; callers check first"
        parent_key = entry.parent_key
        parent = self._entries.get(parent_key) if parent_key is not None else None
        if parent is not None:
            entry.parent = parent
            entry.reachable = parent.reachable
            if parent.children is None:
                parent.children = set()
            parent.children.add(entry)
            self._on_reclassify(parent)
        else:
            entry.reachable = parent_key is None
            if parent_key is not None:
                self._waiting.setdefault(parent_key, set()).add(entry)
        self._entries[entry.key] = entry
        namespace, block_hash = entry.key
        ranks = self._ranks.get(namespace)
        if ranks is None:
            ranks = self._ranks[namespace] = {}
        ranks[block_hash] = entry.tier.rank
        adopted = self._waiting.pop(entry.key, None)
        if adopted:
            entry.children = adopted
            for child in adopted:
                child.parent = entry
            if entry.reachable:
                self._set_reachable(adopted, True)

    def insert_chain(self, entries: Sequence[BlockEntry]) -> None:
        """``insert`` each entry in turn, for blocks in no eviction policy yet (tiers/residency.py
        adds them after): a block whose parent is the one before it is linked to it in place,
        with no lookup and no reclassification of a parent no policy holds."""
        previous: BlockEntry | None = None
        ranks: dict[BlockHash, int] | None = None
        for entry in entries:
            key = entry.key
            if previous is None or entry.parent_key != previous.key or self._waiting:
                self.insert(entry)
            else:
                assert key not in self._entries, "a block is inserted once; callers check first"
                entry.parent = previous
                entry.reachable = previous.reachable
                if previous.children is None:
                    previous.children = {entry}
                else:
                    previous.children.add(entry)
                self._entries[key] = entry
                if ranks is None:
                    ranks = self._ranks[key[0]]
                ranks[key[1]] = ranks[previous.key[1]] if entry.tier is previous.tier else entry.tier.rank
            previous = entry

    def remove(self, entry: BlockEntry) -> None:
        del self._entries[entry.key]
        del self._ranks[entry.key[0]][entry.key[1]]
        parent = entry.parent
        if parent is not None:
            assert parent.children is not None and entry in parent.children
            parent.children.discard(entry)
            self._on_reclassify(parent)
            entry.parent = None
        elif entry.parent_key is not None:
            waiting = self._waiting.get(entry.parent_key)
            if waiting is not None:
                waiting.discard(entry)
                if not waiting:
                    del self._waiting[entry.parent_key]
        children = entry.children
        if children:
            entry.children = None
            for child in children:
                child.parent = None
            self._waiting[entry.key] = children
            if entry.reachable:
                self._set_reachable(children, False)

    def _set_reachable(self, roots: set[BlockEntry], value: bool) -> None:
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node.reachable == value:
                continue
            node.reachable = value
            self._on_reclassify(node)
            if node.children:
                stack.extend(node.children)
