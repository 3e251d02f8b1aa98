"""What a simulation run measured, per policy: summaries, tables, ratios, JSON and plots.

Definitions (every figure from the run's own outcomes):

- token hit rate: cached prompt tokens / prompt tokens, over all requests; by tier, the
  share whose blocks came from HBM, host, NVMe or a peer (remote);
- oracle hit rate: one replica with an infinite cache serving the whole workload in order
  (`traces.oracle_hit_rate`, per token): the upper bound of prefix reuse;
- prefill tokens per request: tokens computed rather than loaded, on average;
- TTFT p50 / p99: arrival to first token; throughput: requests completed / (last
  completion - first arrival);
- per-replica hit rate: the token hit rate of the requests each replica served. Its
  spread is the population standard deviation and coefficient of variation (std / mean)
  over the replicas that served any request; ``load_cv`` is the CV of prompt tokens
  served per replica, idle replicas included, so piling work on few replicas shows there;
- per-replica oracle hit rate: the oracle's cached tokens of the requests each replica
  served / their prompt tokens — the hit rate that replica would have had with an infinite
  cache, so the reuse its share of the workload offered. ``mix_cv``, its CV over the
  replicas that served any request, is the part of the hit-rate spread that the mix of
  requests each replica got explains (a replica that got more first turns, or shorter
  sessions, has less to reuse); the rest of ``spread_cv`` is cache misses;
- session moves: consecutive requests of one session served by different replicas.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.report import Report
from bench.sim.engine import RunResult
from bench.sim.replica import HIT_TIERS
from kvstore.errors import InvalidArgument

__all__ = [
    "PolicySummary",
    "summarize",
    "print_summaries",
    "add_ratios",
    "write_json",
    "plot",
    "BASELINE_OF_RATIOS",
    "BASELINE_OF_SPREAD",
    "bounded_ratio",
]

KVSTORE = "kvstore"
_UNBOUNDED = 1e9  # a ratio over a zero baseline: infinity that strict JSON parsers accept
BASELINE_OF_RATIOS = "the baseline policy with the highest token hit rate at the largest cache size"
BASELINE_OF_SPREAD = "the baseline policy with the lowest hit-rate CV across replicas at the largest cache size"


@dataclass(frozen=True, slots=True)
class PolicySummary:
    workload: str
    policy: str
    model: str
    cache_gb_per_replica: float
    num_requests: int
    hit_rate: float
    hit_rate_by_tier: dict[str, float]
    oracle_hit_rate: float
    prefill_tokens_per_request: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    replica_hit_rates: tuple[float | None, ...]  # None: the replica served nothing
    replica_requests: tuple[int, ...]
    replica_oracle_hit_rates: tuple[float | None, ...]
    spread_std: float
    spread_cv: float
    mix_cv: float
    load_cv: float
    session_moves: int
    counters: dict[str, int]
    wall_s: float


def summarize(result: RunResult, workload: str, cache_gb_per_replica: float, oracle_hit_tokens: Sequence[int]) -> PolicySummary:
    """``oracle_hit_tokens``: per request of the workload, in its order, the tokens the
    oracle serves from cache (`traces.oracle_hit_tokens`)."""
    outcomes = result.outcomes
    if len(oracle_hit_tokens) != len(outcomes):
        raise InvalidArgument(f"{len(oracle_hit_tokens)} oracle counts for {len(outcomes)} requests: both come from one workload.")
    prompt = np.array([o.num_prompt_tokens for o in outcomes], dtype=np.int64)
    computed = np.array([o.num_computed_tokens for o in outcomes], dtype=np.int64)
    replica = np.array([o.replica for o in outcomes], dtype=np.int64)
    hit_blocks = np.array([o.hit_blocks for o in outcomes], dtype=np.int64).reshape(len(outcomes), len(HIT_TIERS))
    ttft = np.array([o.ttft_s for o in outcomes])
    total_prompt = int(prompt.sum())
    by_tier = hit_blocks.sum(axis=0) * result.block_tokens / total_prompt
    served = np.bincount(replica, weights=prompt, minlength=result.num_replicas)
    cached = np.bincount(replica, weights=prompt - computed, minlength=result.num_replicas)
    reusable = np.bincount(replica, weights=np.asarray(oracle_hit_tokens, dtype=np.int64), minlength=result.num_replicas)
    rates = [float(c / s) if s else None for c, s in zip(cached, served)]
    oracle_rates = [float(r / s) if s else None for r, s in zip(reusable, served)]
    active = np.array([r for r in rates if r is not None])
    span = max(o.done_s for o in outcomes) - min(o.arrival_s for o in outcomes)
    return PolicySummary(
        workload=workload,
        policy=result.policy,
        model=result.model,
        cache_gb_per_replica=cache_gb_per_replica,
        num_requests=len(outcomes),
        hit_rate=float((prompt - computed).sum() / total_prompt),
        hit_rate_by_tier={tier.value: float(share) for tier, share in zip(HIT_TIERS, by_tier)},
        oracle_hit_rate=float(reusable.sum() / total_prompt),
        prefill_tokens_per_request=float(computed.mean()),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        throughput_rps=len(outcomes) / span if span > 0 else 0.0,
        replica_hit_rates=tuple(rates),
        replica_requests=tuple(int(n) for n in np.bincount(replica, minlength=result.num_replicas)),
        replica_oracle_hit_rates=tuple(oracle_rates),
        spread_std=float(active.std()),
        spread_cv=_cv(active),
        mix_cv=_cv(np.array([r for r in oracle_rates if r is not None])),
        load_cv=_cv(served),
        session_moves=_session_moves(outcomes),
        counters=dict(result.counters),
        wall_s=result.wall_s,
    )


def _cv(values: np.ndarray) -> float:
    mean = float(values.mean()) if len(values) else 0.0
    return float(values.std()) / mean if mean > 0 else 0.0


def _session_moves(outcomes) -> int:
    last: dict[str, int] = {}
    moves = 0
    for outcome in outcomes:
        previous = last.get(outcome.session_id)
        moves += previous is not None and previous != outcome.replica
        last[outcome.session_id] = outcome.replica
    return moves


def print_summaries(report: Report, title: str, summaries: Sequence[PolicySummary]) -> None:
    columns = [
        "policy",
        "hit %",
        "hbm %",
        "host %",
        "nvme %",
        "remote %",
        "/oracle",
        "prefill tok/req",
        "TTFT p50 s",
        "TTFT p99 s",
        "req/s",
        "replica hit std",
        "hit CV",
        "mix CV",
        "load CV",
        "moves",
        "sim s",
    ]
    rows = []
    for s in summaries:
        tiers = [100 * s.hit_rate_by_tier[t.value] for t in HIT_TIERS]
        rows.append(
            [
                s.policy,
                100 * s.hit_rate,
                *tiers,
                s.hit_rate / s.oracle_hit_rate if s.oracle_hit_rate else 0.0,
                round(s.prefill_tokens_per_request),
                s.ttft_p50_s,
                s.ttft_p99_s,
                s.throughput_rps,
                s.spread_std,
                s.spread_cv,
                s.mix_cv,
                s.load_cv,
                s.session_moves,
                s.wall_s,
            ]
        )
    report.print_table(title, columns, rows)
    report.print_table(
        "requests per replica",
        ["policy", *(f"r{k}" for k in range(len(summaries[0].replica_requests)))],
        [[s.policy, *s.replica_requests] for s in summaries],
    )


def add_ratios(report: Report, summaries: Sequence[PolicySummary], oracle_target: bool) -> None:
    """kvstore against the oracle, against the best baseline (highest hit rate) and, for the
    spread, against the baseline of lowest spread, at the largest cache size.
    ``oracle_target``: the workload is one where kvstore must come near the oracle (the
    coding-agent workload, run with adequate capacity); the spread target always applies."""
    largest = max(s.cache_gb_per_replica for s in summaries)
    at_largest = [s for s in summaries if s.cache_gb_per_replica == largest]
    kvstore = next((s for s in at_largest if s.policy == KVSTORE), None)
    baselines = [s for s in at_largest if s.policy != KVSTORE]
    if kvstore is None:
        return
    if kvstore.oracle_hit_rate > 0:
        target = ">= 0.95" if oracle_target else None
        report.compare("kvstore_vs_oracle_hit_rate", kvstore.hit_rate, kvstore.oracle_hit_rate, "token hit rate", target)
    if not baselines:
        return
    best = max(baselines, key=lambda s: (s.hit_rate, s.policy))
    evenest = min(baselines, key=lambda s: (s.spread_cv, s.policy))
    for name, value, baseline, unit, target in (
        ("kvstore_spread_vs_lowest_spread_baseline", kvstore.spread_cv, evenest.spread_cv, "CV of per-replica hit rates", "< 1"),
        ("kvstore_vs_best_baseline_hit_rate", kvstore.hit_rate, best.hit_rate, "token hit rate", None),
        ("kvstore_vs_best_baseline_ttft_p50", kvstore.ttft_p50_s, best.ttft_p50_s, "s modelled TTFT", None),
        ("kvstore_vs_best_baseline_ttft_p99", kvstore.ttft_p99_s, best.ttft_p99_s, "s modelled TTFT", None),
        ("kvstore_vs_best_baseline_load_cv", kvstore.load_cv, best.load_cv, "CV of per-replica load", None),
    ):
        report.ratio(name, bounded_ratio(value, baseline), target)  # a zero baseline is not an infinite ratio here
        report.figures[name] = {"numerator": value, "denominator": baseline, "unit": unit}
    print(f"\nbest baseline at {largest:g} GB/replica: {best.policy} ({BASELINE_OF_RATIOS})")
    print(f"lowest-spread baseline at {largest:g} GB/replica: {evenest.policy} ({BASELINE_OF_SPREAD})")


def bounded_ratio(value: float, baseline: float) -> float:
    """value / baseline, where a zero baseline gives 1 (both zero) or a large finite number."""
    if baseline > 0:
        return value / baseline
    return 1.0 if value == 0 else _UNBOUNDED


def write_json(path: Path, config: Mapping, summaries: Sequence[PolicySummary]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"config": dict(config), "results": [dataclasses.asdict(s) for s in summaries]}
    path.write_text(json.dumps(document, indent=2) + "\n")


def plot(out_dir: Path, workload: str, summaries: Sequence[PolicySummary], ttfts: Mapping[str, np.ndarray]) -> list[Path]:
    """Hit rate against cache size (when more than one size ran), the TTFT CDF and the
    per-replica hit rates at the largest size. Returns the files written; none without
    matplotlib (an optional dependency of the dev extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    policies = list(dict.fromkeys(s.policy for s in summaries))
    sizes = sorted({s.cache_gb_per_replica for s in summaries})
    if len(sizes) > 1:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for policy in policies:
            points = sorted((s.cache_gb_per_replica, s.hit_rate) for s in summaries if s.policy == policy)
            axes.plot(*zip(*points), marker="o", label=policy)
        axes.axhline(summaries[0].oracle_hit_rate, color="black", linestyle="--", label="oracle")
        axes.set(xlabel="cache per replica (GB)", ylabel="token hit rate", title=f"{workload}: hit rate vs cache size")
        axes.legend()
        written.append(_save(plt, figure, out_dir / f"{workload}-hit-rate-vs-cache.png"))
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for policy, values in ttfts.items():
        ordered = np.sort(values)
        axes.plot(np.maximum(ordered, 1e-3), np.arange(1, len(ordered) + 1) / len(ordered), label=policy)
    axes.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title=f"{workload}: TTFT CDF at {sizes[-1]:g} GB/replica")
    axes.legend()
    written.append(_save(plt, figure, out_dir / f"{workload}-ttft-cdf.png"))
    at_largest = [s for s in summaries if s.cache_gb_per_replica == sizes[-1]]
    figure, axes = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(at_largest)
    for position, s in enumerate(at_largest):
        rates = [r if r is not None else 0.0 for r in s.replica_hit_rates]
        axes.bar(np.arange(len(rates)) + position * width, rates, width, label=s.policy)
    num_replicas = len(at_largest[0].replica_hit_rates)
    axes.set_xticks(np.arange(num_replicas) + width * (len(at_largest) - 1) / 2, [str(k) for k in range(num_replicas)])
    axes.set(
        xlabel="replica",
        ylabel="token hit rate",
        title=f"{workload}: per-replica hit rate at {sizes[-1]:g} GB/replica (idle replicas at 0)",
    )
    axes.legend(fontsize="small")
    written.append(_save(plt, figure, out_dir / f"{workload}-replica-hit-rates.png"))
    return written


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
