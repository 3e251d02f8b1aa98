"""Capacity at a latency SLO: the highest arrival rate at which a policy keeps its modelled
TTFT p99 within the SLO.

A workload is run at a *scale* of its nominal arrival rate; the rate in sessions per
second is that scale times the workload's nominal rate (`RateScaled.base_rate`):

- a coding-agent workload (`AgentsAtRate`) at scale s starts sessions s times as often over
  the same window (``num_sessions × s`` sessions at ``session_rate_per_s × s``): each
  session's turns, sizes and think times are what its seed gives at every scale — the
  sessions of a lower rate are the first ones of a higher rate, their start times
  compressed — so more agents arrive, each at the pace of one agent;
- a trace (`TraceAtRate`) at scale s has every arrival time divided by s; its nominal rate
  is its sessions (as the reader derives them) over the span of its arrivals.

The search (`find_capacity`) is deterministic, and runs the same workload at each scale:
it brackets the SLO by doubling the scale from 1 while the p99 meets the SLO (or halving
it while it does not), at most ``max_steps`` times, then bisects the bracket geometrically
until the failing scale is within ``resolution`` (a fraction) above the passing one. It
reports the highest scale that passed, with the lowest that failed above it, so the true
capacity lies between them when TTFT p99 grows with the rate, which the search assumes; a
policy that meets the SLO at every scale tried reports the highest as a lower bound, one
that meets it at none reports 0. Every probe is kept, so a reader can see the curve.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bench.report import Report
from bench.sim.agents import CodingAgentConfig, CodingAgentWorkload
from bench.sim.engine import RunResult, SimConfig, simulate
from bench.sim.policies import make_policy
from bench.sim.report import bounded_ratio
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.index.scoring import CostModel

__all__ = [
    "CapacitySearch",
    "Probe",
    "Capacity",
    "RateScaled",
    "AgentsAtRate",
    "TraceAtRate",
    "find_capacity",
    "policy_capacity",
    "probe_of",
    "report_capacities",
]


@dataclass(frozen=True, slots=True)
class CapacitySearch:
    slo_ttft_p99_s: float
    resolution: float = 0.02  # the bracket's final width, as a fraction of the passing scale
    max_steps: int = 8  # doublings (or halvings) to find a bracket: scales 1/256 to 256

    def __post_init__(self) -> None:
        if not self.slo_ttft_p99_s > 0:
            raise InvalidArgument(f"the TTFT p99 SLO must be positive, got {self.slo_ttft_p99_s}.")
        if not 0 < self.resolution < 1:
            raise InvalidArgument(f"the capacity resolution must lie in (0, 1), got {self.resolution}.")
        if self.max_steps < 1:
            raise InvalidArgument(f"max_steps must be at least 1, got {self.max_steps}.")


@dataclass(frozen=True, slots=True)
class Probe:
    scale: float
    ttft_p99_s: float
    hit_rate: float

    def meets(self, search: CapacitySearch) -> bool:
        return self.ttft_p99_s <= search.slo_ttft_p99_s


@dataclass(frozen=True, slots=True)
class Capacity:
    scale: float  # the highest scale that met the SLO (0: none did)
    failing_scale: float | None  # the lowest that missed it above ``scale`` (None: none did)
    probes: tuple[Probe, ...]  # by scale

    @property
    def at_capacity(self) -> Probe | None:
        return next((p for p in self.probes if p.scale == self.scale), None)


def probe_of(result: RunResult, scale: float) -> Probe:
    ttft = np.array([o.ttft_s for o in result.outcomes])
    prompt = sum(o.num_prompt_tokens for o in result.outcomes)
    cached = sum(o.num_cached_tokens for o in result.outcomes)
    return Probe(scale, float(np.percentile(ttft, 99)), cached / prompt if prompt else 0.0)


def find_capacity(run_at: Callable[[float], Probe], search: CapacitySearch, known: Sequence[Probe] = ()) -> Capacity:
    """The capacity of whatever ``run_at`` measures a probe of at a scale; ``known`` probes
    (e.g. the nominal run's, at scale 1) are used instead of running those scales again."""
    probes: dict[float, Probe] = {p.scale: p for p in known}

    def meets(scale: float) -> bool:
        if scale not in probes:
            probes[scale] = run_at(scale)
        return probes[scale].meets(search)

    low: float = 0.0  # passing
    high: float | None = None  # failing
    scale = 1.0
    if meets(scale):
        low = scale
        for _ in range(search.max_steps):
            scale *= 2
            if not meets(scale):
                high = scale
                break
            low = scale
    else:
        high = scale
        for _ in range(search.max_steps):
            scale /= 2
            if meets(scale):
                low = scale
                break
            high = scale
    if low > 0 and high is not None:
        while high / low > 1 + search.resolution:
            middle = math.sqrt(low * high)
            if meets(middle):
                low = middle
            else:
                high = middle
    return Capacity(low, high, tuple(probes[s] for s in sorted(probes)))


class RateScaled(abc.ABC):
    """A workload that can be run at any scale of its nominal arrival rate."""

    base_rate: float  # sessions per second at scale 1

    @abc.abstractmethod
    def at(self, scale: float) -> list[Request]:
        """The workload's requests, in arrival order, at ``scale`` times its nominal rate."""


class AgentsAtRate(RateScaled):
    _KEPT = 4  # workloads kept, most recent first: the policies of a run probe the same scales

    def __init__(self, config: CodingAgentConfig) -> None:
        self.config = config
        self.base_rate = config.session_rate_per_s
        self._recent: dict[float, list[Request]] = {}

    def at(self, scale: float) -> list[Request]:
        requests = self._recent.pop(scale, None)
        if requests is None:
            config = self.config
            num_sessions = max(1, round(config.num_sessions * scale))
            scaled = dataclasses.replace(config, session_rate_per_s=config.session_rate_per_s * scale, num_sessions=num_sessions)
            requests = list(CodingAgentWorkload(scaled).requests())
        self._recent[scale] = requests
        while len(self._recent) > self._KEPT:
            del self._recent[next(iter(self._recent))]
        return requests


class TraceAtRate(RateScaled):
    def __init__(self, requests: Sequence[Request]) -> None:
        if not requests:
            raise InvalidArgument("the trace has no requests.")
        self._requests = list(requests)
        span = self._requests[-1].arrival_s - self._requests[0].arrival_s
        num_sessions = len({r.session_id for r in self._requests})
        # a trace whose requests all arrive at once has no rate to scale: call its span 1 s
        self.base_rate = num_sessions / span if span > 0 else float(num_sessions)

    def at(self, scale: float) -> list[Request]:
        return [dataclasses.replace(r, arrival_s=r.arrival_s / scale) for r in self._requests]


def policy_capacity(
    workload: RateScaled,
    policy: str,
    config: SimConfig,
    speeds: CostModel,
    search: CapacitySearch,
    known: Sequence[Probe] = (),
) -> Capacity:
    """The capacity of ``policy`` on ``workload``: a fresh fleet and router per probe."""

    def run_at(scale: float) -> Probe:
        return probe_of(simulate(workload.at(scale), make_policy(policy, config.num_replicas, speeds), config), scale)

    return find_capacity(run_at, search, known)


ROUND_ROBIN = "round-robin"
KVSTORE = "kvstore"


def report_capacities(report: Report, capacities: Mapping[str, Capacity], workload: RateScaled, search: CapacitySearch) -> None:
    """A table of each policy's capacity (sessions/s) with its ratio to round-robin's, and
    the contract's ratios with both figures beside them: every policy against round-robin,
    kvstore against the baseline of highest capacity. Modelled figures: no targets."""
    rate = workload.base_rate
    unit = f"sessions/s at modelled TTFT p99 <= {search.slo_ttft_p99_s:g} s"
    round_robin = capacities.get(ROUND_ROBIN)
    rows = []
    for policy, capacity in capacities.items():
        at = capacity.at_capacity
        ratio = bounded_ratio(capacity.scale, round_robin.scale) if round_robin is not None else float("nan")
        rows.append(
            [
                policy,
                ("≥ " if capacity.failing_scale is None and capacity.scale > 0 else "") + f"{capacity.scale * rate:.4g}",
                "-" if capacity.failing_scale is None else f"{capacity.failing_scale * rate:.4g}",
                ratio,
                at.ttft_p99_s if at is not None else "-",
                at.hit_rate if at is not None else "-",
                len(capacity.probes),
            ]
        )
    report.print_table(
        f"capacity at TTFT p99 <= {search.slo_ttft_p99_s:g} s (modelled; nominal rate {rate:.4g} sessions/s, "
        f"resolution {100 * search.resolution:g}%)",
        ["policy", "sessions/s", "fails at", "/ round-robin", "p99 at capacity s", "hit rate there", "runs"],
        rows,
    )
    for policy, capacity in capacities.items():
        report.results.append(
            {
                "capacity_policy": policy,
                "slo_ttft_p99_s": search.slo_ttft_p99_s,
                "capacity_sessions_per_s": capacity.scale * rate,
                "capacity_is_lower_bound": capacity.failing_scale is None,
                "fails_at_sessions_per_s": None if capacity.failing_scale is None else capacity.failing_scale * rate,
                "resolution": search.resolution,
                "probes": [
                    {"sessions_per_s": p.scale * rate, "ttft_p99_s": round(p.ttft_p99_s, 4), "hit_rate": round(p.hit_rate, 4)}
                    for p in capacity.probes
                ],
            }
        )
    if round_robin is not None:
        for policy, capacity in capacities.items():
            if policy != ROUND_ROBIN:
                _compare(report, f"capacity_{_key(policy)}_vs_round_robin", capacity.scale * rate, round_robin.scale * rate, unit)
    baselines = {policy: c for policy, c in capacities.items() if policy != KVSTORE}
    if KVSTORE in capacities and baselines:
        best = max(baselines, key=lambda policy: (baselines[policy].scale, policy))
        _compare(report, "capacity_kvstore_vs_best_baseline", capacities[KVSTORE].scale * rate, baselines[best].scale * rate, unit)
        print(f"\nbaseline of highest capacity: {best}")


def _compare(report: Report, name: str, value: float, baseline: float, unit: str) -> None:
    report.ratio(name, bounded_ratio(value, baseline))
    report.figures[name] = {"numerator": round(value, 6), "denominator": round(baseline, 6), "unit": unit}


def _key(policy: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in policy)
