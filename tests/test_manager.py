"""The tier manager over real memory tiers (CPU tensors) and, where noted, the NVMe tier."""

import threading
from concurrent.futures import Future

import pytest
import torch

from kvstore.errors import (
    BlockSizeMismatch,
    CapacityExhausted,
    InvalidArgument,
    NotFound,
    ReservationExpired,
    UnknownNamespace,
)
from kvstore.events import BlockMoved, BlockRemoved, BlockStored, RemovalReason
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import MemoryTier, VirtualTier, _SlabTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
NAMESPACE = Namespace("tiny-llama", LAYOUT)
NS = NAMESPACE.digest
BLOCK = LAYOUT.block_bytes  # 16 KiB
PAGE = 64 * 1024


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def memory_tier(kind, num_blocks):
    return MemoryTier(kind, torch.zeros(num_blocks * BLOCK, dtype=torch.uint8), page_bytes=PAGE)


def make_manager(host_blocks=8, hbm_blocks=None, lower_blocks=None, clock=None, **config):
    tiers = [memory_tier(TierKind.HOST, host_blocks)]
    if hbm_blocks:
        tiers.append(memory_tier(TierKind.HBM, hbm_blocks))
    if lower_blocks:
        tiers.append(memory_tier(TierKind.NVME, lower_blocks))
    manager = TierManager(TierManagerConfig(**config), tiers, clock=clock or Clock())
    manager.register_namespace(NAMESPACE)
    return manager


def blocks_for(seed, count):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (BLOCK,), dtype=torch.uint8, generator=gen) for _ in range(count)]


def chain(seed, count):
    return chain_hashes([seed * 1000 + i for i in range(count * 16)], 16)


def test_put_lookup_get_round_trip():
    manager = make_manager()
    hashes, data = chain(1, 3), blocks_for(1, 3)
    assert manager.put(NS, hashes, data) == 3
    assert manager.put(NS, hashes, data) == 0  # already cached
    assert manager.lookup(NS, hashes + chain(2, 1)) == [TierKind.HOST] * 3
    out = torch.empty(BLOCK, dtype=torch.uint8)
    assert manager.get(NS, hashes[2], out)
    assert torch.equal(out, data[2])
    stored = [e for e in manager.events.drain() if isinstance(e, BlockStored)]
    # put writes in chunks of a quarter of the tier (2 blocks here); each commit's chain
    # segment is one event, as vLLM batches them
    assert [e.block_hashes for e in stored] == [tuple(hashes[:2]), tuple(hashes[2:])]
    assert stored[0].parent_hash is None and stored[1].parent_hash == hashes[1]


def test_lookup_stops_at_the_first_gap():
    manager = make_manager()
    hashes = chain(1, 4)
    manager.put(NS, hashes[:2], blocks_for(1, 2))
    manager.put(NS, hashes[3:], blocks_for(2, 1), parent_hash=hashes[2])
    assert len(manager.lookup(NS, hashes)) == 2


def test_bad_input_gets_specific_errors_and_changes_nothing():
    manager = make_manager()
    other = Namespace("other-model", LAYOUT)
    with pytest.raises(UnknownNamespace):
        manager.lookup(other.digest, chain(1, 1))
    with pytest.raises(BlockSizeMismatch):
        manager.put(NS, chain(1, 1), [torch.zeros(BLOCK - 1, dtype=torch.uint8)])
    with pytest.raises(BlockSizeMismatch):
        manager.put(NS, chain(1, 1), [torch.zeros(0, dtype=torch.uint8)])
    with pytest.raises(InvalidArgument):
        manager.put(NS, chain(1, 2), blocks_for(1, 1))
    huge = Namespace("huge", KVLayout(num_layers=64, num_kv_heads=8, head_dim=128, block_size=64))
    with pytest.raises(InvalidArgument):
        manager.register_namespace(huge)
    assert len(manager.catalogue) == 0 and manager.tier(TierKind.HOST).stats().used_bytes == 0


def test_full_tier_evicts_leaf_first_lru_and_emits_removals():
    manager = make_manager(host_blocks=4)
    a = chain(1, 3)
    b = chain(2, 1)
    manager.put(NS, a, blocks_for(1, 3))
    manager.put(NS, b, blocks_for(2, 1))
    manager.events.drain()
    manager.put(NS, chain(3, 2), blocks_for(3, 2))  # needs two slots
    removed = [h for e in manager.events.drain() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    # a's leaf goes first (least recently used leaf), then its parent, never a[0] before them
    assert removed == [a[2], a[1]]
    assert manager.lookup(NS, a) == [TierKind.HOST]


def test_leases_and_pins_protect_blocks_and_capacity_is_reported():
    manager = make_manager(host_blocks=2)
    hashes = chain(1, 2)
    manager.put(NS, hashes, blocks_for(1, 2))
    lease = manager.acquire(NS, hashes[:1])
    assert manager.pin(NS, hashes[1:]) == 1
    with pytest.raises(CapacityExhausted):
        manager.put(NS, chain(2, 1), blocks_for(2, 1))
    manager.release(lease.id)
    with pytest.raises(NotFound):
        manager.release(lease.id)
    # a[0] is now evictable but has a pinned child: it still may go (interior), the pin holds
    assert manager.put(NS, chain(2, 1), blocks_for(2, 1)) == 1
    assert manager.lookup(NS, hashes) == []
    assert [b.block_hash for b in manager.blocks() if b.pinned] == [hashes[1]]
    manager.unpin(NS, hashes[1:])
    assert manager.put(NS, chain(3, 1), blocks_for(3, 1)) == 1


def test_reservations_expire_and_late_commits_are_refused():
    clock = Clock()
    manager = make_manager(host_blocks=2, clock=clock, reservation_ttl_s=5.0)
    reservation = manager.reserve(NS, chain(1, 2))
    assert manager.tier(TierKind.HOST).stats().used_bytes == 2 * BLOCK
    clock.now = 6.0
    assert manager.expire_reservations() == 1
    # its keys are free for other writers, its slots quarantined: the writer may still be copying
    assert manager.tier(TierKind.HOST).stats().used_bytes == 2 * BLOCK and manager.quarantined_slots == 2
    with pytest.raises(CapacityExhausted):
        manager.reserve(NS, chain(1, 2))
    with pytest.raises(ReservationExpired):
        manager.commit(reservation.id)  # the late writer lets go: now the slots are free
    assert manager.tier(TierKind.HOST).stats().used_bytes == 0 and manager.quarantined_slots == 0
    assert len(manager.reserve(NS, chain(1, 2)).blocks) == 2
    with pytest.raises(NotFound):
        manager.commit(12345)


def test_reserve_skips_cached_and_in_flight_blocks_and_partial_commit():
    manager = make_manager(host_blocks=8)
    hashes = chain(1, 4)
    manager.put(NS, hashes[:1], blocks_for(1, 1))
    first = manager.reserve(NS, hashes)
    assert [b.block_hash for b in first.blocks] == hashes[1:] and first.num_cached == 1
    second = manager.reserve(NS, hashes)
    assert second.blocks == () and second.num_cached == 4
    views = manager.reservation_slots(first)
    for view, data in zip(views, blocks_for(7, 3)):
        view.copy_(data)
    assert manager.commit(first.id, num_written=2) == 2
    assert len(manager.lookup(NS, hashes)) == 3
    assert manager.tier(TierKind.HOST).stats().num_blocks == 3


def test_reserve_covers_the_prefix_that_fits():
    manager = make_manager(host_blocks=3)
    manager.put(NS, chain(9, 1), blocks_for(9, 1))
    manager.pin(NS, chain(9, 1))
    reservation = manager.reserve(NS, chain(1, 4))
    assert len(reservation.blocks) == 2


def test_demotion_under_pressure_and_promotion_on_hit():
    manager = make_manager(host_blocks=4, lower_blocks=16, high_watermark=0.75, low_watermark=0.5)
    hashes, data = chain(1, 4), blocks_for(1, 4)
    manager.put(NS, hashes, data)
    # 4/4 > 0.75: demoted down to 2/4, leaves first
    assert manager.lookup(NS, hashes) == [TierKind.HOST, TierKind.HOST, TierKind.NVME, TierKind.NVME]
    moved = [e for e in manager.events.drain() if isinstance(e, BlockMoved)]
    assert {h for e in moved for h in e.block_hashes} == set(hashes[2:])
    lease = manager.acquire(NS, hashes)
    assert len(lease.blocks) == 4
    views = manager.lease_views(lease)
    assert all(torch.equal(v, d) for v, d in zip(views, data))
    assert manager.counters["hit_blocks_nvme"] == 2
    manager.release(lease.id)


def test_lowest_tier_drops_when_everything_is_full():
    manager = make_manager(host_blocks=2, lower_blocks=2, high_watermark=0.9, low_watermark=0.5)
    for seed in range(1, 6):
        manager.put(NS, chain(seed, 1), blocks_for(seed, 1))
    # the host is kept at its low watermark (1 block), NVMe full (2): the two oldest dropped
    assert len(manager.catalogue) == 3
    reasons = [e.reason for e in manager.events.drain() if isinstance(e, BlockRemoved)]
    assert reasons == [RemovalReason.CAPACITY] * 2
    assert manager.lookup(NS, chain(1, 1)) == [] and manager.lookup(NS, chain(2, 1)) == []


def test_explicit_evict_filters():
    clock = Clock()
    manager = make_manager(host_blocks=8, clock=clock)
    manager.put(NS, chain(1, 2), blocks_for(1, 2))
    clock.now = 100.0
    manager.put(NS, chain(2, 2), blocks_for(2, 2))
    assert manager.evict(idle_for_s=50).num_evicted == 2
    assert len(manager.lookup(NS, chain(2, 2))) == 2
    manager.pin(NS, chain(2, 1))
    result = manager.evict(namespace=NS)
    assert (result.num_evicted, result.num_skipped) == (1, 1)


def test_an_evict_naming_a_block_twice_drops_it_once():
    manager = make_manager(host_blocks=8)
    hashes = chain(1, 2)
    manager.put(NS, hashes, blocks_for(1, 2))
    result = manager.evict(namespace=NS, hashes=[hashes[1], hashes[1], hashes[0], hashes[1]])
    assert (result.num_evicted, result.num_skipped) == (2, 0)
    assert manager.lookup(NS, hashes) == []


def test_hbm_tier_logic_on_a_cpu_tensor():
    manager = make_manager(host_blocks=4, hbm_blocks=2, high_watermark=1.0)
    hashes, data = chain(1, 2), blocks_for(1, 2)
    manager.put(NS, hashes, data)  # the fastest tier is the default target
    assert manager.lookup(NS, hashes) == [TierKind.HBM] * 2
    lease = manager.acquire(NS, hashes, tier=TierKind.HOST)
    assert all(torch.equal(v, d) for v, d in zip(manager.lease_views(lease), data))
    assert manager.lookup(NS, hashes) == [TierKind.HOST] * 2


def test_virtual_tiers_account_capacity_without_bytes():
    tiers = [VirtualTier(TierKind.HOST, 4 * BLOCK, PAGE), VirtualTier(TierKind.NVME, 8 * BLOCK, PAGE)]
    manager = TierManager(TierManagerConfig(high_watermark=0.9, low_watermark=0.5), tiers, clock=Clock())
    manager.register_namespace(NAMESPACE)
    for seed in range(1, 4):
        reservation = manager.reserve(NS, chain(seed, 2))
        manager.commit(reservation.id)
    tiers_now = [TierKind(t) for t in manager.lookup(NS, chain(3, 2))]
    assert len(tiers_now) == 2
    assert sum(s.num_blocks for s in manager.tier_stats()) == 6


def test_persist_moves_memory_blocks_into_the_lowest_tier():
    manager = make_manager(host_blocks=4, lower_blocks=8, high_watermark=1.0)
    hashes, data = chain(1, 3), blocks_for(1, 3)
    manager.put(NS, hashes, data)
    assert manager.persist() == 3
    assert manager.lookup(NS, hashes) == [TierKind.NVME] * 3
    out = torch.empty(BLOCK, dtype=torch.uint8)
    assert manager.get(NS, hashes[1], out) and torch.equal(out, data[1])


# -- one owner per slot: readers, moves and the steps between them ------------------------------
def _reserve_in(manager, kind, hashes, data):
    reservation = manager.reserve(NS, hashes, tier=kind)
    for view, block in zip(manager.reservation_slots(reservation), data):
        view.copy_(block)
    manager.commit(reservation.id)


def test_a_block_a_reader_holds_never_moves_to_another_tier():
    manager = make_manager(host_blocks=4, hbm_blocks=4)
    hashes, data = chain(1, 2), blocks_for(1, 2)
    _reserve_in(manager, TierKind.HOST, hashes, data)
    reader = manager.acquire(NS, hashes, TierKind.HOST)
    views = manager.lease_views(reader)
    promoted = manager.acquire(NS, hashes, TierKind.HBM)  # another reader wants the top tier
    assert promoted.blocks == ()  # the block ends its prefix where it is, for the first reader
    _reserve_in(manager, TierKind.HOST, chain(2, 2), blocks_for(2, 2))  # the other slots go to other blocks
    assert all(torch.equal(view, block) for view, block in zip(views, data))
    manager.release(promoted.id)
    manager.release(reader.id)
    assert len(manager.acquire(NS, hashes, TierKind.HBM).blocks) == 2  # once let go, it may move


class GatedTier(_SlabTier):
    """A tier standing in for NVMe (bytes kept in private memory, no views) whose transfers
    end only when the test says so."""

    def __init__(self, kind, num_blocks):
        super().__init__(kind, num_blocks * BLOCK, PAGE)
        self._bytes = torch.zeros(num_blocks * BLOCK, dtype=torch.uint8)
        self.gates = []

    def write(self, slot, src, meta):
        self._bytes[slot.offset : slot.offset + meta.nbytes] = src

    def read(self, slot, dst, meta):
        dst.copy_(self._bytes[slot.offset : slot.offset + meta.nbytes])

    def _gated(self, operation, slot, tensor, meta):
        future = Future()
        self.gates.append((future, lambda: operation(slot, tensor, meta)))
        return future

    def submit_write(self, slot, src, meta):
        return self._gated(self.write, slot, src, meta)

    def submit_read(self, slot, dst, meta):
        return self._gated(self.read, slot, dst, meta)

    def open_gates(self):
        gates, self.gates = self.gates, []
        for future, operation in gates:
            operation()
            future.set_result(None)


def test_a_block_leased_while_it_is_being_demoted_stays_where_its_reader_reads_it():
    gated = GatedTier(TierKind.NVME, 8)
    manager = TierManager(TierManagerConfig(demote_on_commit=False), [memory_tier(TierKind.HOST, 4), gated], clock=Clock())
    manager.register_namespace(NAMESPACE)
    hashes, data = chain(3, 4), blocks_for(3, 4)
    manager.put(NS, hashes, data)  # the host tier is full: over its high watermark
    demotion = manager.relieve_pressure_steps()
    waits = next(demotion)  # demotions started: their NVMe writes are in flight
    assert waits and manager.num_moves_in_flight
    moving = [e for e in manager.catalogue if e.moving]
    lease = manager.acquire(NS, hashes, TierKind.HOST)  # a reader comes while they are copied
    assert len(lease.blocks) == 4
    gated.open_gates()
    with pytest.raises(StopIteration):
        demotion.send(None)
    assert manager.lookup(NS, hashes) == [TierKind.HOST] * 4  # nothing moved from under the reader
    assert manager.counters["moves_undone_for_readers"] == len(moving)
    assert all(torch.equal(v, d) for v, d in zip(manager.lease_views(lease), data))
    assert gated.stats().used_bytes == 0  # the copies made meanwhile were let go
    manager.release(lease.id)


def test_a_promotion_whose_reader_went_away_still_finishes_and_leaks_nothing():
    gated = GatedTier(TierKind.NVME, 8)
    manager = TierManager(TierManagerConfig(demote_on_commit=False), [memory_tier(TierKind.HOST, 4), gated], clock=Clock())
    manager.register_namespace(NAMESPACE)
    hashes, data = chain(4, 2), blocks_for(4, 2)
    manager.put(NS, hashes, data)
    persisting = manager.persist_steps()
    assert next(persisting)  # onto the gated tier
    gated.open_gates()
    with pytest.raises(StopIteration):
        persisting.send(None)
    assert manager.lookup(NS, hashes) == [TierKind.NVME] * 2
    acquiring = manager.acquire_steps(NS, hashes, TierKind.HOST)
    assert next(acquiring)  # promotions started, the reader waits for their reads
    acquiring.close()  # the reader went away at that step
    assert manager.num_moves_in_flight == 2
    gated.open_gates()
    assert manager.reap() == 2  # the moves finish on their own
    assert manager.lookup(NS, hashes) == [TierKind.HOST] * 2
    assert all(e.num_leases == 0 and e.evictable for e in manager.catalogue)
    lease = manager.acquire(NS, hashes, TierKind.HOST)
    assert all(torch.equal(v, d) for v, d in zip(manager.lease_views(lease), data))


@pytest.mark.parametrize("num_blocks, beside", [(8, False), (512, True)])  # 128 KiB, 8 MiB (past HELPER_BATCH_BYTES)
def test_a_put_commits_each_blocks_checksum_taken_with_its_copy_not_in_a_second_pass(num_blocks, beside, monkeypatch):
    """A put hashes each chunk right after copying it; a large one is cut in two runs of
    whole blocks, one copied and hashed on the helper thread beside the other. Neither
    reads the landed bytes again."""
    import kvstore.tiers.base as base_module
    import kvstore.tiers.reservations as reservations_module
    from kvstore.tiers.base import block_checksum

    def refuse(*_):
        raise AssertionError("a put from host memory takes its checksums with the copy, not in a second pass")

    runs = []
    copy_each = base_module._copy_each_checksummed

    def counted(spans):
        runs.append((threading.current_thread() is threading.main_thread(), len(spans)))
        return copy_each(spans)

    monkeypatch.setattr(base_module, "spare_cpu_now", lambda: True)
    monkeypatch.setattr(base_module, "_copy_each_checksummed", counted)
    monkeypatch.setattr(reservations_module, "block_checksum", refuse)
    manager = make_manager(host_blocks=4 * num_blocks + 8)  # a put reserves a quarter of the tier at a time
    hashes = chain_hashes(torch.arange(num_blocks * 16), 16)
    blocks = [torch.randint(0, 256, (BLOCK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)) for i in range(num_blocks)]
    assert manager.put(NS, hashes, blocks) == num_blocks
    assert sorted(runs) == ([(False, num_blocks // 2), (True, num_blocks // 2)] if beside else [(True, num_blocks)])
    for block_hash, block in zip(hashes, blocks):
        assert manager.catalogue.get((NS, block_hash)).checksum == block_checksum(block)
    lease = manager.acquire(NS, hashes)
    assert len(lease.blocks) == num_blocks  # verified against those checksums where the tier checks them
    manager.release(lease.id)


def test_lookup_holds_keep_what_a_lookup_counted_until_released_or_expired():
    """tiers/holds.py: a held chain survives a flood that evicts everything else, an
    explicit evict skips it, and once released (or at its deadline) it is ordinary cache."""
    clock = Clock()
    manager = make_manager(host_blocks=8, clock=clock)
    held, flood = chain(1, 4), [chain(seed, 4) for seed in range(2, 6)]
    manager.put(NS, held, blocks_for(1, 4))
    hold_id = manager.hold_prefixes([(NS, len(manager.lookup(NS, held)))], b"".join(held), ttl_s=10)
    assert hold_id and manager.num_holds == 1
    for seed, hashes in enumerate(flood, 2):
        manager.put(NS, hashes, blocks_for(seed, 4))  # only the other half of the tier is free
    assert manager.lookup(NS, held) == [TierKind.HOST] * 4
    assert manager.evict(NS, held).num_evicted == 0  # an operator's evict skips held blocks too
    manager.release_hold(hold_id)
    assert manager.evict(NS, held).num_evicted == 4
    with pytest.raises(NotFound):
        manager.release_hold(hold_id)
    manager.put(NS, held, blocks_for(1, 4))
    manager.hold_prefixes([(NS, 4)], b"".join(held), ttl_s=10)
    clock.now = 11
    assert len(manager.expire_holds()) == 1 and manager.num_holds == 0
    for seed, hashes in enumerate(flood, 2):
        manager.put(NS, hashes, blocks_for(seed, 4))
    assert manager.lookup(NS, held) == []


def test_the_last_hold_in_one_namespace_ends_there_only():
    """The end of a namespace's last hold lets its blocks go at once, those eviction had
    passed over included, and leaves another namespace's held blocks held."""
    other = Namespace("tiny-llama", LAYOUT, tp_rank=1, tp_size=2)
    manager = make_manager(host_blocks=8)
    manager.register_namespace(other)
    held = chain(1, 2)
    manager.put(NS, held, blocks_for(1, 2))
    manager.put(other.digest, held, blocks_for(2, 2))
    hold_id, ranks = manager.lookup_held([NS, other.digest], b"".join(held), ttl_s=10)
    assert hold_id and ranks == [bytes([TierKind.HOST.rank] * 2)] * 2
    first = manager.hold_prefixes([(NS, 2)], b"".join(held), ttl_s=10)
    for seed in range(3, 9):
        manager.put(NS, chain(seed, 2), blocks_for(seed, 2))  # eviction reaches all four held blocks
    manager.release_hold(hold_id)  # other's last hold; NS keeps ``first``
    assert manager.evict(NS, held).num_evicted == 0
    assert manager.evict(other.digest, held).num_evicted == 2
    manager.release_hold(first)
    assert manager.evict(NS, held).num_evicted == 2


def test_two_holds_on_one_block_end_with_the_last():
    manager = make_manager(host_blocks=4)
    held = chain(1, 2)
    manager.put(NS, held, blocks_for(1, 2))
    first = manager.hold_prefixes([(NS, 2)], b"".join(held), ttl_s=10)
    second = manager.hold_prefixes([(NS, 1)], b"".join(held), ttl_s=10)
    manager.put(NS, chain(2, 2), blocks_for(2, 2))
    manager.put(NS, chain(3, 2), blocks_for(3, 2))  # eviction reaches the held blocks and passes them over
    manager.release_hold(first)
    manager.put(NS, chain(4, 3), blocks_for(4, 3))  # all the room but the block still held
    assert manager.lookup(NS, held) == [TierKind.HOST]  # the second hold keeps the first block
    manager.release_hold(second)
    manager.put(NS, chain(5, 4), blocks_for(5, 4))
    assert manager.lookup(NS, held) == []
