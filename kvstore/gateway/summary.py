"""The router's figures for `kvstore stats --fleet --router URL`, from its /metrics text.

Per replica: requests answered, prompt tokens, prefill tokens computed, cached tokens, the
token hit rate, and TTFT p50/p99 (interpolated within the histogram's buckets as
Prometheus's ``histogram_quantile`` does); for the fleet: the hit rate's spread across
replicas (std, CV), routing decisions by reason and session moves by reason. Per tenant
label: prompt, prefill (computed) and cached tokens, and the cache bytes and blocks its
recent chains hold (kvstore_router_tenant_cache_*, tenant_cache.py). Per replica and per
tenant, the prefill tokens by why they were not cached (``causes``: misses.py), and for
the fleet the session turns that broke their prefix, by the part that changed.
"""

from __future__ import annotations

import math
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvstore.errors import Unavailable

__all__ = ["router_summary", "fetch_router_summary", "histogram_quantile"]

_TENANT_FIGURES = {  # sample name → the tenant row's field
    "kvstore_router_tenant_prompt_tokens_total": "prompt_tokens",
    "kvstore_router_tenant_prefill_tokens_total": "prefill_tokens",
    "kvstore_router_tenant_cached_tokens_total": "cached_tokens",
    "kvstore_router_tenant_cache_bytes": "cache_bytes",
    "kvstore_router_tenant_cache_blocks": "cache_blocks",
}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(upper bound, count)`` buckets, sorted by bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # in the open-ended bucket: its lower edge, as Prometheus answers
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count) if count > lower_count else bound
        lower_bound, lower_count = bound, count
    return lower_bound


def router_summary(exposition: str) -> dict[str, Any]:
    replicas: dict[str, dict[str, Any]] = {}
    ttft_buckets: dict[str, dict[float, float]] = {}
    decisions: dict[str, float] = {}
    moves: dict[str, float] = {}
    tenants: dict[str, dict[str, Any]] = {}
    diverged: dict[str, float] = {}

    def replica(node_id: str) -> dict[str, Any]:
        return replicas.setdefault(node_id, {"requests": 0, "prompt_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0})

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            if sample.name == "kvstore_router_in_flight":  # every configured replica has one
                replica(labels["replica"])
            elif sample.name == "kvstore_router_requests_total" and labels.get("replica", "none") != "none":
                replica(labels["replica"])["requests"] += int(value)
            elif sample.name == "kvstore_router_prompt_tokens_sum":
                replica(labels["replica"])["prompt_tokens"] += int(value)
            elif sample.name == "kvstore_router_prefill_tokens_per_request_sum":
                replica(labels["replica"])["prefill_tokens"] += int(value)
            elif sample.name == "kvstore_router_cached_tokens_total":
                replica(labels["replica"])["cached_tokens"] += int(value)
            elif sample.name == "kvstore_router_ttft_seconds_bucket":
                bound = float(labels["le"])
                buckets = ttft_buckets.setdefault(labels["replica"], {})
                buckets[bound] = buckets.get(bound, 0.0) + value  # streamed and not, together
            elif sample.name == "kvstore_router_decisions_total":
                decisions[labels["reason"]] = value
            elif sample.name == "kvstore_router_session_moves_total":
                moves[labels["reason"]] = value
            elif sample.name == "kvstore_router_prefill_tokens_total":
                causes = replica(labels["replica"]).setdefault("causes", {})
                causes[labels["cause"]] = causes.get(labels["cause"], 0) + int(value)
            elif sample.name == "kvstore_router_tenant_prefill_tokens_by_cause_total":
                row = tenants.setdefault(labels["tenant"], dict.fromkeys(_TENANT_FIGURES.values(), 0))
                row.setdefault("causes", {})[labels["cause"]] = int(value)
            elif sample.name == "kvstore_router_diverged_turns_total":
                diverged[labels["part"]] = value
            elif sample.name in _TENANT_FIGURES:
                row = tenants.setdefault(labels["tenant"], dict.fromkeys(_TENANT_FIGURES.values(), 0))
                row[_TENANT_FIGURES[sample.name]] = int(value)
    for node_id, buckets in ttft_buckets.items():
        ordered = sorted(buckets.items())
        for name, q in (("ttft_p50_s", 0.5), ("ttft_p99_s", 0.99)):
            found = histogram_quantile(q, ordered)
            replica(node_id)[name] = None if found is None else round(found, 4)
    rates = []
    for row in replicas.values():
        row["hit_rate"] = round(row["cached_tokens"] / row["prompt_tokens"], 4) if row["prompt_tokens"] else None
        if row["hit_rate"] is not None:
            rates.append(row["hit_rate"])
    mean = sum(rates) / len(rates) if rates else 0.0
    std = (sum((r - mean) ** 2 for r in rates) / len(rates)) ** 0.5 if rates else 0.0
    return {
        "replicas": dict(sorted(replicas.items())),
        "hit_rate_std": round(std, 4),
        "hit_rate_cv": round(std / mean, 4) if mean else None,
        "decisions": decisions,
        "session_moves": moves,
        "tenants": dict(sorted(tenants.items())),
        "diverged_turns": diverged,
    }


def fetch_router_summary(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout_s) as response:
            return router_summary(response.read().decode())
    except OSError as exc:
        raise Unavailable(f"the router at {url} does not answer /metrics ({exc}); is `kvstore router` running there?") from exc
