"""The catalogue's prefix lookup (the rank of each block's tier, from a chain as one bytes
string) against a walk of its entries, through any sequence of inserts, moves and removals."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.hashing import chain_hashes
from kvstore.tier_kind import TierKind
from kvstore.tiers.catalogue import BlockEntry, Catalogue, RecentChains, chain_keys
from kvstore.tiers.slab import Slot

NAMESPACE, OTHER = b"n" * 16, b"o" * 16
POOL = chain_hashes(np.arange(16 * 300), 16)
TIERS = list(TierKind)


def walked(catalogue: Catalogue, namespace: bytes, chain: list[bytes]) -> bytes:
    ranks = bytearray()
    for block_hash in chain:
        entry = catalogue.get((namespace, block_hash))
        if entry is None:
            break
        ranks.append(entry.tier.rank)
    return bytes(ranks)


def entry(namespace: bytes, index: int, tier: TierKind) -> BlockEntry:
    parent = None if index == 0 else (namespace, POOL[index - 1])
    return BlockEntry((namespace, POOL[index]), parent, tier, Slot(index * 64, 64), 64, 0.0)


def test_prefix_ranks_follow_inserts_moves_and_removals() -> None:
    catalogue = Catalogue(lambda entry: None)
    entries = [entry(NAMESPACE, i, TierKind.HOST) for i in range(8)]
    for e in entries:
        catalogue.insert(e)
    chain = b"".join(POOL[:10])
    assert catalogue.prefix_ranks(NAMESPACE, chain_keys(chain)) == bytes([TierKind.HOST.rank] * 8)
    assert catalogue.prefix_ranks(OTHER, chain_keys(chain)) == b""
    assert catalogue.prefix_ranks(NAMESPACE, chain_keys(b"")) == b""
    catalogue.relocate(entries[5], TierKind.NVME, Slot(0, 4096))
    assert entries[5].tier is TierKind.NVME and entries[5].slot == Slot(0, 4096)
    assert catalogue.prefix_ranks(NAMESPACE, chain_keys(chain))[5] == TierKind.NVME.rank
    catalogue.remove(entries[3])
    assert catalogue.prefix_ranks(NAMESPACE, chain_keys(chain)) == bytes([TierKind.HOST.rank] * 3)


def test_a_hash_ending_in_zero_bytes_is_found() -> None:
    catalogue = Catalogue(lambda entry: None)
    block_hash = b"\x07" + bytes(15)
    catalogue.insert(BlockEntry((NAMESPACE, block_hash), None, TierKind.HOST, Slot(0, 64), 64, 0.0))
    assert catalogue.prefix_ranks(NAMESPACE, chain_keys(block_hash)) == bytes([TierKind.HOST.rank])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "remove", "move"]), st.integers(0, 299), st.sampled_from(TIERS)), max_size=600))
def test_prefix_ranks_match_a_walk_of_the_entries(operations) -> None:
    catalogue = Catalogue(lambda entry: None)
    held: dict[int, BlockEntry] = {}
    for op, index, tier in operations:
        if op == "insert" and index not in held:
            held[index] = entry(NAMESPACE, index, tier)
            catalogue.insert(held[index])
        elif op == "remove" and index in held:
            catalogue.remove(held.pop(index))
        elif op == "move" and index in held:
            catalogue.relocate(held[index], tier, held[index].slot)
    for start in range(0, 300, 25):
        chain = POOL[start : start + 80]
        assert catalogue.prefix_ranks(NAMESPACE, chain_keys(b"".join(chain))) == walked(catalogue, NAMESPACE, chain)


def links(catalogue: Catalogue) -> dict:
    return {
        e.key: (None if e.parent is None else e.parent.key, sorted(c.key for c in e.children or ()), e.reachable, e.tier) for e in catalogue
    }


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 59), st.integers(1, 12)), max_size=20))
def test_a_chain_inserted_at_once_is_linked_as_if_inserted_block_by_block(runs) -> None:
    one_by_one_reclassified, chained_reclassified = [], []
    one_by_one = Catalogue(lambda e: one_by_one_reclassified.append(e.key))
    chained = Catalogue(lambda e: chained_reclassified.append(e.key))
    new_in_run: set = set()
    for start, length in runs:  # runs of a chain in any order: some extend a cached block, some wait for a parent
        indices = [i for i in range(start, min(start + length, 60)) if (NAMESPACE, POOL[i]) not in chained]
        for i in indices:
            one_by_one.insert(entry(NAMESPACE, i, TierKind.HOST))
        new_in_run = {(NAMESPACE, POOL[i]) for i in indices}
        chained.insert_chain([entry(NAMESPACE, i, TierKind.HOST) for i in indices])
        # blocks already cached before the run are reclassified alike; a block of the run itself is in no policy yet
        assert [k for k in chained_reclassified if k not in new_in_run] == [k for k in one_by_one_reclassified if k not in new_in_run]
        one_by_one_reclassified.clear()
        chained_reclassified.clear()
    assert links(chained) == links(one_by_one)
    chain = b"".join(POOL[:60])
    assert chained.prefix_ranks(NAMESPACE, chain_keys(chain)) == one_by_one.prefix_ranks(NAMESPACE, chain_keys(chain))


# chains that share prefixes of any length: a block of a chain is POOL[i] for i < its
# branch point, else a hash of (branch, i), as sessions on one system prompt and their turns are
BRANCHES = [chain_hashes(np.arange(16 * 40) + 1_000_000 * (branch + 1), 16) for branch in range(4)]


def branched(branch: int, split: int, length: int) -> bytes:
    return b"".join(POOL[:split] + BRANCHES[branch][split:length])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 40)), max_size=40), st.integers(1, 120))
def test_recent_chains_give_exactly_the_keys_of_each_chain(lookups, max_blocks) -> None:
    recent = RecentChains(max_blocks=max_blocks)
    for branch, split, length in lookups:
        chain = branched(branch, min(split, length), length)
        assert list(recent.keys(chain)) == chain_keys(chain)
        assert recent._held <= max_blocks


def test_a_chain_that_shares_a_prefix_reuses_its_key_objects() -> None:
    recent = RecentChains()
    first = recent.keys(branched(0, 20, 30))
    again = recent.keys(branched(1, 20, 35))  # another session on the same 20-block prefix
    assert again[:20] == first[:20] and all(a is b for a, b in zip(again[:20], first[:20]))
    assert again[20:] == tuple(BRANCHES[1][20:35]) and again[20] is not first[20]
    longer = recent.keys(branched(1, 20, 40))  # its next turn: 35 blocks shared
    assert all(a is b for a, b in zip(longer[:35], again))
