"""The prefix tree and the eviction policies, without any tier."""

from kvstore.tier_kind import TierKind
from kvstore.tiers.catalogue import BlockEntry, Catalogue
from kvstore.tiers.eviction import LRU, LeafFirstLRU
from kvstore.tiers.slab import Slot

NS = b"n" * 16


def key(name: str):
    return (NS, name.encode().ljust(16, b"."))


class Harness:
    """A catalogue wired to one policy, as the tier manager wires them."""

    def __init__(self, policy):
        self.policy = policy
        self.catalogue = Catalogue(policy.reclassify)
        self.now = 0.0

    def add(self, name, parent=None):
        self.now += 1.0
        entry = BlockEntry(key(name), key(parent) if parent else None, TierKind.HOST, Slot(0, 4096), 4096, self.now)
        self.catalogue.insert(entry)
        self.policy.insert(entry)
        return entry

    def drop(self, entry):
        self.policy.remove(entry)
        self.catalogue.remove(entry)

    def use(self, *names):
        """Touch blocks as a read of a chain does: all at one time, in chain order."""
        self.now += 1.0
        for name in names:
            entry = self.catalogue.get(key(name))
            entry.last_access = self.now
            self.policy.touch(entry)

    def retain(self, *names, retained=True):
        """Flip retention as tiers/residency.py does: the flag, then a reclassification."""
        for name in names:
            entry = self.catalogue.get(key(name))
            entry.retained = retained
            self.policy.reclassify(entry)

    def evict_all(self):
        order = []
        while (victim := self.policy.victim()) is not None:
            order.append(victim.key[1].rstrip(b".").decode())
            self.drop(victim)
        return order


def test_leaf_first_evicts_descendants_before_ancestors():
    h = Harness(LeafFirstLRU())
    h.add("a")
    h.add("b", "a")
    h.add("c", "b")
    h.add("x")
    h.use("a", "b", "c")
    h.use("x")
    # the cold chain goes whole, tail first, before the hotter x
    assert h.evict_all() == ["c", "b", "a", "x"]


def test_a_parent_used_after_the_head_joins_the_leaves_at_the_tail():
    h = Harness(LeafFirstLRU())
    h.add("a")
    h.add("b", "a")
    h.add("x")
    h.use("a")  # a shared prefix, used on its own more recently than x
    assert h.evict_all() == ["b", "x", "a"]


def test_plain_lru_ignores_structure():
    h = Harness(LRU())
    h.add("a")
    h.add("b", "a")
    h.add("c", "b")
    assert h.evict_all() == ["a", "b", "c"]


def test_orphans_go_first_and_the_whole_broken_subtree_is_orphaned():
    h = Harness(LeafFirstLRU())
    a = h.add("a")
    b = h.add("b", "a")
    c = h.add("c", "b")
    h.add("z")
    assert b.reachable and c.reachable
    h.drop(a)  # explicit removal of an interior block
    assert not b.reachable and not c.reachable
    order = h.evict_all()
    assert order[:2] == ["b", "c"] or order[:2] == ["c", "b"]
    assert order[2] == "z"


def test_children_arriving_before_their_parent_are_adopted():
    h = Harness(LeafFirstLRU())
    c = h.add("c", "b")
    b = h.add("b", "a")
    assert not b.reachable and not c.reachable
    a = h.add("a")
    assert a.num_children == 1 and b.parent is a and c.parent is b
    assert b.reachable and c.reachable
    assert h.evict_all() == ["c", "b", "a"]


def test_parent_becomes_leaf_when_its_last_child_goes():
    h = Harness(LeafFirstLRU())
    a = h.add("a")
    b1 = h.add("b1", "a")
    b2 = h.add("b2", "a")
    assert a.num_children == 2
    h.drop(b1)
    assert a.num_children == 1
    h.drop(b2)
    assert a.num_children == 0
    assert h.policy.victim() is a


def test_retained_blocks_go_after_every_unretained_block_leaves_first_among_them():
    h = Harness(LeafFirstLRU())
    h.add("a")
    h.add("b", "a")
    h.add("c", "b")
    h.add("x")
    h.add("y", "x")
    h.add("p")
    h.add("q", "p")
    h.retain("a", "b", "c", "p", "q")
    h.use("x", "y")  # the retained chains are the coldest: without retention they would go first
    # among the retained, the colder chain goes whole, tail first, as unretained chains do
    assert h.evict_all() == ["y", "x", "c", "b", "a", "q", "p"]


def test_a_retained_orphan_goes_with_the_orphans_before_any_unretained_leaf():
    h = Harness(LeafFirstLRU())
    a = h.add("a")
    h.add("b", "a")
    h.add("x")
    h.retain("b")
    h.drop(a)  # b can no longer be reached by any lookup: retaining it protects nothing
    assert h.evict_all() == ["b", "x"]


def test_a_block_whose_retention_ends_rejoins_its_group_by_its_last_use():
    h = Harness(LeafFirstLRU())
    h.add("a")
    h.add("b", "a")
    h.add("x")
    h.retain("a", "b")
    h.use("x")
    h.retain("a", "b", retained=False)  # last used before x: they go before it, tail first
    assert h.evict_all() == ["b", "a", "x"]


def test_plain_lru_takes_retained_blocks_last_and_lets_them_rejoin_by_last_use():
    h = Harness(LRU())
    h.add("a")
    h.add("b")
    h.add("c")
    h.retain("a")
    assert h.evict_all() == ["b", "c", "a"]
    h = Harness(LRU())
    h.add("a")
    h.add("b")
    h.retain("a")
    h.use("b")
    h.retain("a", retained=False)
    assert h.evict_all() == ["a", "b"]
