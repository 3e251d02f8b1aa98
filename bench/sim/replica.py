"""One simulated replica: an engine's FIFO prefill queue in front of kvstore's production
`TierManager`, whose tiers are capacity-only `VirtualTier`s (HBM standing for the GPU's
prefix cache, then host memory, then NVMe).

A request lives on a replica as it would on a real node:

1. `enqueue`: it waits behind earlier prompts. Prefills run one at a time: a prefill
   saturates the GPUs, so two at once take as long as two back to back, and FIFO order is
   what an engine's scheduler gives prompts of one priority.
2. `begin`: `lookup` records the tier of each block of the cached prefix, then `acquire`
   leases it — promoting host and NVMe blocks into HBM and demoting others to make room,
   all by the production code. Blocks a peer holds past that prefix may be fetched (when
   the cost model says fetching beats recomputing). `reserve` takes slots for every block
   not cached. The prefill then lasts load time + compute time (`service_s`).
3. `finish`: `commit` makes the computed and fetched blocks visible, `release` ends the
   lease, and the request decodes in the running batch (engine.py) until `decoded`.

Owner: the simulation loop (engine.py); not thread-safe.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.sim.workload import Request
from kvstore.errors import CapacityExhausted, InvalidArgument
from kvstore.index.base import NodeMatch
from kvstore.index.scoring import Candidate, CostModel, estimate
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import VirtualTier
from kvstore.tiers.slab import round_up

__all__ = ["TierSizes", "Job", "Replica", "HIT_TIERS", "build_manager", "node_id", "replica_index"]

# where a request's cached blocks came from, in the order `Job.hits` counts them
HIT_TIERS: tuple[TierKind, ...] = (TierKind.HBM, TierKind.HOST, TierKind.NVME, TierKind.REMOTE)
_HIT_SLOT = {kind: position for position, kind in enumerate(HIT_TIERS)}
_SLAB_ALIGNMENT = 4096  # the slab allocator's default alignment (tiers/slab.py)
# the simulated engine never crashes mid-prefill, and a 190K-token prefill of a large model
# outlasts the production default of 30 s: its reservations must not expire
_RESERVATION_TTL_S = 86_400.0


def node_id(index: int) -> str:
    return f"replica-{index}"


def replica_index(node: str) -> int:
    return int(node.rpartition("-")[2])


@dataclass(frozen=True, slots=True)
class TierSizes:
    """Capacity of each tier of one replica, in bytes (0: no such tier)."""

    hbm_bytes: int
    host_bytes: int
    nvme_bytes: int

    @classmethod
    def split(cls, total_bytes: float, fractions: Sequence[float]) -> TierSizes:
        hbm, host, nvme = fractions
        return cls(int(total_bytes * hbm), int(total_bytes * host), int(total_bytes * nvme))


def build_manager(sizes: TierSizes, block_bytes: int, eviction_policy: str, clock: Callable[[], float]) -> TierManager:
    """A production tier manager over virtual tiers holding exactly capacity // slot blocks
    each: a page is a whole number of slots that divides the tier (the default 64 MiB page
    would strand 28 MiB next to each 36 MB block)."""
    slot_bytes = round_up(block_bytes, _SLAB_ALIGNMENT)
    if sizes.hbm_bytes < slot_bytes:
        raise InvalidArgument(
            f"the HBM tier ({sizes.hbm_bytes:,} bytes) cannot hold one {block_bytes:,}-byte block; give each replica more cache."
        )
    capacities = ((TierKind.HBM, sizes.hbm_bytes), (TierKind.HOST, sizes.host_bytes), (TierKind.NVME, sizes.nvme_bytes))
    tiers = []
    for kind, capacity in capacities:
        num_slots = capacity // slot_bytes
        if num_slots:
            tiers.append(VirtualTier(kind, num_slots * slot_bytes, _slots_per_page(num_slots) * slot_bytes))
    config = TierManagerConfig(eviction_policy=eviction_policy, reservation_ttl_s=_RESERVATION_TTL_S)
    return TierManager(config, tiers, clock)


def _slots_per_page(num_slots: int) -> int:
    """The largest divisor of ``num_slots`` up to 64: carving a page costs a list of its
    slots, so one slot a page would make every allocation carve one."""
    return next(k for k in range(min(64, num_slots), 0, -1) if num_slots % k == 0)


class Job:
    """One request while a replica serves it; the engine turns it into an outcome."""

    __slots__ = (
        "index",
        "request",
        "num_blocks",
        "expected_new_tokens",
        "start_s",
        "first_token_s",
        "done_s",
        "replica",
        "hits",
        "new_tokens",
        "lease_id",
        "reservation_id",
    )

    def __init__(self, index: int, request: Request) -> None:
        self.index = index
        self.request = request
        # what the engine holds while the request runs: prompt blocks, partial tail included
        self.num_blocks = -(-request.num_prompt_tokens // request.block_tokens)
        self.expected_new_tokens = request.num_prompt_tokens
        self.start_s = self.first_token_s = self.done_s = 0.0
        self.replica = -1
        self.hits = [0] * len(HIT_TIERS)  # cached blocks used, by the tier they came from
        self.new_tokens = request.num_prompt_tokens
        self.lease_id: int | None = None
        self.reservation_id: int | None = None


class Replica:
    def __init__(self, index: int, manager: TierManager, namespace: Namespace, speeds: CostModel) -> None:
        self.index = index
        self.node_id = node_id(index)
        self.manager = manager
        self.speeds = speeds
        self._namespace = namespace.digest
        self._block_bytes = namespace.block_bytes
        self._block_tokens = namespace.block_size
        self.waiting: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self.busy_until = 0.0
        self.num_decoding = 0
        self.active_blocks = 0  # blocks of every request here, queued to decoding (Dynamo's "active blocks")
        self._waiting_new_tokens = 0

    @property
    def cache_bytes(self) -> int:
        """What its tiers hold in all: the ``cache_bytes`` a router is told of it."""
        return sum(stats.capacity_bytes for stats in self.manager.tier_stats())

    # -- load, as a router sees it ---------------------------------------------------------
    @property
    def num_outstanding(self) -> int:
        return len(self.waiting) + (self.current is not None) + self.num_decoding

    def queued_new_tokens(self, now: float) -> int:
        """Tokens still to prefill here: the waiting prompts' uncached tokens (as estimated
        when they arrived) plus the unfinished share of the running prefill."""
        queued = self._waiting_new_tokens
        current = self.current
        if current is not None and self.busy_until > current.start_s:
            remaining = (self.busy_until - now) / (self.busy_until - current.start_s)
            queued += int(current.new_tokens * min(1.0, max(0.0, remaining)))
        return queued

    def cached_prefix(self, request: Request) -> list[TierKind]:
        return self.manager.lookup(self._namespace, request.block_hashes)

    def engine_prefix_blocks(self, request: Request) -> int:
        """Blocks of the prompt's cached prefix in HBM, which stands for the engine's own
        cache here (what a router fed by the engine's KV events sees)."""
        tiers = self.cached_prefix(request)
        return next((k for k, tier in enumerate(tiers) if tier is not TierKind.HBM), len(tiers))

    # -- a request's life ------------------------------------------------------------------
    def enqueue(self, job: Job) -> None:
        request = job.request
        cached = len(self.cached_prefix(request)) * request.block_tokens
        job.replica = self.index
        job.expected_new_tokens = max(0, request.num_prompt_tokens - cached)
        self._waiting_new_tokens += job.expected_new_tokens
        self.active_blocks += job.num_blocks
        self.waiting.append(job)

    def begin(self, now: float, peer_tiers: Sequence[TierKind] = ()) -> float:
        """Start the next waiting prefill; returns when it ends. ``peer_tiers`` are the tiers
        of the longest prefix a peer holds (empty: no fetching)."""
        job = self.waiting.popleft()
        self._waiting_new_tokens -= job.expected_new_tokens
        request, manager, namespace = job.request, self.manager, self._namespace
        if request.block_tokens != self._block_tokens:
            raise InvalidArgument(
                f"a request of {request.block_tokens}-token blocks reached a replica keyed by {self._block_tokens}-token blocks."
            )
        tiers = manager.lookup(namespace, request.block_hashes)
        lease = manager.acquire(namespace, request.block_hashes)
        job.lease_id = lease.id
        local = tiers[: len(lease.blocks)]
        speeds, block_bytes = self.speeds, self._block_bytes
        load_s = 0.0
        for tier in local:
            load_s += block_bytes * speeds.seconds_per_byte(tier)
            job.hits[_HIT_SLOT[tier]] += 1
        fetched = self._blocks_worth_fetching(request, local, peer_tiers)
        for tier in peer_tiers[len(local) : len(local) + fetched]:
            # a peer's block crosses the network, and leaves NVMe no faster than NVMe reads
            load_s += block_bytes * max(speeds.seconds_per_byte(TierKind.REMOTE), speeds.seconds_per_byte(tier))
        job.hits[_HIT_SLOT[TierKind.REMOTE]] += fetched
        cached_tokens = min(request.num_prompt_tokens, (len(local) + fetched) * request.block_tokens)
        job.new_tokens = request.num_prompt_tokens - cached_tokens
        try:
            job.reservation_id = manager.reserve(namespace, request.block_hashes).id
        except CapacityExhausted:
            # nothing in HBM is evictable: it is all this prompt's leased prefix; computed, not cached
            job.reservation_id = None
        job.start_s = now
        self.busy_until = now + load_s + speeds.prefill_s(job.new_tokens, cached_tokens)
        self.current = job
        return self.busy_until

    def finish(self, now: float) -> Job:
        """The running prefill is done: its blocks become visible and it starts decoding."""
        job = self.current
        assert job is not None and now >= self.busy_until, "finish() follows begin() at the time it returned"
        if job.reservation_id is not None:
            self.manager.commit(job.reservation_id)
        self.manager.release(job.lease_id)
        job.first_token_s = now
        self.current = None
        self.num_decoding += 1
        return job

    def decoded(self, job: Job, now: float) -> None:
        job.done_s = now
        self.num_decoding -= 1
        self.active_blocks -= job.num_blocks

    def _blocks_worth_fetching(self, request: Request, local: Sequence[TierKind], peer_tiers: Sequence[TierKind]) -> int:
        """How many blocks past the local prefix to fetch from the peer: kvstore's own rule
        (`scoring.estimate`), which fetches only when that beats recomputing them."""
        if len(peer_tiers) <= len(local):
            return 0
        mine = NodeMatch(self.node_id, tuple(local))
        plan = estimate(
            Candidate(self.node_id), mine, request.num_prompt_tokens, request.block_tokens, self._block_bytes, self.speeds, len(peer_tiers)
        )
        return max(0, plan.cached_tokens // request.block_tokens - len(local))
