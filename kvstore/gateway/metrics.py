"""What the HTTP router measures, as Prometheus metrics on its ``/metrics``.

Per replica (its daemon's node id): router-observed time to first byte (TTFT for a stream;
for a non-streaming request its first byte is its whole answer), prompt tokens and the
prefill tokens the engine actually computed (its usage: prompt minus cached tokens), the
token hit rate and its spread over the fleet (standard deviation and coefficient of
variation), routing decisions by reason, session moves, retries, requests in flight, and
the engine's own running + waiting requests at the last health check with the part of them
the router did not send (what routing prices for other clients' traffic, replicas.py).
Per tenant (a header, else a digest of the API key), prompt, computed and cached tokens,
and the cache bytes and blocks its recent chains hold (tenant_cache.py); the first
``max_tenants`` tenants seen get a label each, any later one shares ``other``, so a client
cannot grow the label set without bound. Configuration reloads by result, and whether the
last one was applied (as Prometheus's own ``prometheus_config_last_reload_successful``).
A replica's series appear when it is listed, at start or by a reload; its gauges go when a
reload removes it.

Owner: the router's event loop.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.gateway.misses import CAUSES

__all__ = ["RouterMetrics", "TenantLabels", "OTHER_TENANT"]

OTHER_TENANT = "other"
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 19))  # 16 … 256K tokens
MISS_CAUSES = (*CAUSES, "unkeyed")  # and the computed tokens of requests the router could not key
DIVERGED_PARTS = ("system prompt", "tools", "earlier message", "the last answer", "the template", "prompt")
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)


class TenantLabels:
    """Tenant names as metric labels, at most ``max_tenants`` of them."""

    def __init__(self, max_tenants: int) -> None:
        self._max_tenants = max_tenants
        self._labels: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant in self._labels:
            return tenant
        if len(self._labels) < self._max_tenants:
            self._labels.add(tenant)
            return tenant
        return OTHER_TENANT


class RouterMetrics:
    def __init__(self, replica_ids: list[str], max_tenants: int) -> None:
        self.registry = CollectorRegistry()
        self.tenants = TenantLabels(max_tenants)
        r = self.registry
        self.requests = Counter(
            "kvstore_router_requests",
            "Requests answered, by replica ('none' when none served) and HTTP status",
            ["replica", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvstore_router_ttft_seconds",
            "Router-observed time to the first byte of the engine's answer",
            ["replica", "stream"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "kvstore_router_overhead_seconds",
            "The router's own time per request before the engine has it, by phase: read (the body, checked), tokenize "
            "(the prompt's token ids and block keys), lookup (the index's answer), remember (the session's placement), "
            "total (arrival to the request's sending, retries included)",
            ["phase"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokenized = Counter(
            "kvstore_router_tokenized",
            "Prompts whose token ids the router computed itself (router.tokenizer) or asked an engine's /tokenize for",
            ["where"],
            registry=r,
        )
        self.tokenizer_mismatches = Counter(
            "kvstore_router_tokenizer_mismatches",
            "Prompts router.tokenizer tokenized otherwise than an engine: at the first the router stops using it",
            registry=r,
        )
        for where in ("router", "engine"):
            self.tokenized.labels(where)
        for phase in ("read", "tokenize", "lookup", "remember", "total"):
            self.overhead.labels(phase)
        self.prompt_tokens = Histogram(
            "kvstore_router_prompt_tokens", "Prompt tokens per request (engine usage)", ["replica"], buckets=_TOKEN_BUCKETS, registry=r
        )
        self.prefill_tokens = Histogram(
            "kvstore_router_prefill_tokens_per_request",
            "Prompt tokens the engine computed per request (prompt minus cached tokens)",
            ["replica"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvstore_router_cached_tokens", "Prompt tokens served from cache (engine usage)", ["replica"], registry=r
        )
        self.expected_cached_tokens = Counter(
            "kvstore_router_expected_cached_tokens", "Cached tokens the cost model expected when routing", ["replica"], registry=r
        )
        self.prefill_by_cause = Counter(
            "kvstore_router_prefill_tokens",
            "Prompt tokens the engines computed, by why they were not cached (misses.py): new, diverged, evicted, "
            "elsewhere, not_loaded; unkeyed for requests the router could not key (multimodal inputs)",
            ["cause", "replica"],
            registry=r,
        )
        self.tenant_prefill_by_cause = Counter(
            "kvstore_router_tenant_prefill_tokens_by_cause",
            "Prompt tokens the engines computed per tenant, by why they were not cached (as kvstore_router_prefill_tokens)",
            ["tenant", "cause"],
            registry=r,
        )
        self.diverged_turns = Counter(
            "kvstore_router_diverged_turns",
            "Session turns whose prompt did not extend the previous turn's prompt and answer, by the part that changed: "
            "system prompt, tools, earlier message, the last answer, the template, prompt (a completion)",
            ["part"],
            registry=r,
        )
        self.retention_calls = Counter(
            "kvstore_router_retention_calls",
            "Calls to replicas' daemons keeping sessions' chains through their pauses (Retain, at a turn's end) and bringing "
            "them back (Prefetch, at the next turn's start), by outcome: ok, failed (no answer in time, refused), "
            "no_daemon (the replica names none), skipped (too many in flight)",
            ["call", "outcome"],
            registry=r,
        )
        self.diverged_lost_tokens = Histogram(
            "kvstore_router_diverged_lost_tokens",
            "Per diverged turn, the tokens the session had sent from the point of divergence on (cached, and now useless)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        for part in DIVERGED_PARTS:
            self.diverged_turns.labels(part)
        self.hit_rate = Gauge("kvstore_router_hit_rate", "Token hit rate per replica: cached over prompt tokens", ["replica"], registry=r)
        self.hit_rate_spread = Gauge(
            "kvstore_router_hit_rate_spread", "Spread of the replicas' hit rates: std (standard deviation) and cv", ["stat"], registry=r
        )
        self.decisions = Counter("kvstore_router_decisions", "Routing decisions by reason", ["reason"], registry=r)
        self.session_moves = Counter("kvstore_router_session_moves", "Sessions moved to another replica, by reason", ["reason"], registry=r)
        self.retries = Counter(
            "kvstore_router_retries",
            "Requests retried on the next-best replica, by the failed one and cause",
            ["replica", "cause"],
            registry=r,
        )
        self.in_flight = Gauge("kvstore_router_in_flight", "Requests in flight per replica", ["replica"], registry=r)
        self.queued_tokens = Gauge(
            "kvstore_router_queued_prefill_tokens",
            "Uncached prompt tokens of the requests a replica is still computing (its queue, as routing prices it)",
            ["replica"],
            registry=r,
        )
        self.engine_requests = Gauge(
            "kvstore_router_engine_requests",
            "Requests running and waiting on a replica's engine, as its /metrics said at the last health check: "
            "the router's own requests in flight then included, even once they end (routing prices the rest: "
            "kvstore_router_foreign_requests)",
            ["replica"],
            registry=r,
        )
        self.foreign_requests = Gauge(
            "kvstore_router_foreign_requests",
            "Requests on a replica's engine that the router did not send, as routing prices them: its engine's "
            "running and waiting at the last health check, less the router's requests in flight during that read "
            "(routing prices the more of this and the router's own requests past their prompt)",
            ["replica"],
            registry=r,
        )
        self.healthy = Gauge("kvstore_router_replica_healthy", "1 while the replica passes health checks", ["replica"], registry=r)
        self.tenant_prompt_tokens = Counter("kvstore_router_tenant_prompt_tokens", "Prompt tokens per tenant", ["tenant"], registry=r)
        self.tenant_prefill_tokens = Counter(
            "kvstore_router_tenant_prefill_tokens", "Prefill tokens computed per tenant", ["tenant"], registry=r
        )
        self.tenant_cached_tokens = Counter(
            "kvstore_router_tenant_cached_tokens", "Prefill tokens saved by the cache per tenant", ["tenant"], registry=r
        )
        self.tenant_cache_bytes = Gauge(
            "kvstore_router_tenant_cache_bytes",
            "Bytes of the fleet's resident KV blocks in the tenant's recent chains: each block once however many copies "
            "the fleet holds, a block in several tenants' chains split evenly among them (the tenants add up to the "
            "attributed total)",
            ["tenant"],
            registry=r,
        )
        self.tenant_cache_blocks = Gauge(
            "kvstore_router_tenant_cache_blocks",
            "Resident KV blocks in the tenant's recent chains, each once, a block shared with other tenants counted in full",
            ["tenant"],
            registry=r,
        )
        self.config_reloads = Counter(
            "kvstore_router_config_reloads", "Configuration reloads (SIGHUP), by result: applied or refused", ["result"], registry=r
        )
        self.config_last_reload_successful = Gauge(
            "kvstore_router_config_last_reload_successful", "1 unless the last configuration reload was refused", registry=r
        )
        self.config_last_reload_successful.set(1)
        for result in ("applied", "refused"):
            self.config_reloads.labels(result)
        self._prompt_by_replica: dict[str, int] = {}
        self._cached_by_replica: dict[str, int] = {}
        for replica_id in replica_ids:
            self.add_replica(replica_id)
        self._spread()

    def add_replica(self, replica_id: str) -> None:
        """The replica's series exist from when it joins (out of rotation until checked)."""
        for cause in MISS_CAUSES:
            self.prefill_by_cause.labels(cause, replica_id)
        self.in_flight.labels(replica_id).set(0)
        self.queued_tokens.labels(replica_id).set(0)
        self.engine_requests.labels(replica_id).set(0)
        self.foreign_requests.labels(replica_id).set(0)
        self.healthy.labels(replica_id).set(0)
        self.hit_rate.labels(replica_id).set(0)
        self._prompt_by_replica.setdefault(replica_id, 0)
        self._cached_by_replica.setdefault(replica_id, 0)
        self._spread()

    def remove_replica(self, replica_id: str) -> None:
        """A replica that left: its gauges go; its counters and histograms keep their history."""
        gauges = (self.in_flight, self.queued_tokens, self.engine_requests, self.foreign_requests, self.healthy, self.hit_rate)
        for gauge in gauges:
            gauge.remove(replica_id)
        self._prompt_by_replica.pop(replica_id, None)
        self._cached_by_replica.pop(replica_id, None)
        self._spread()

    def reloaded(self, applied: bool) -> None:
        self.config_reloads.labels("applied" if applied else "refused").inc()
        self.config_last_reload_successful.set(1 if applied else 0)

    def usage(self, replica_id: str, tenant: str, prompt_tokens: int, cached_tokens: int) -> None:
        computed = max(prompt_tokens - cached_tokens, 0)
        self.prompt_tokens.labels(replica_id).observe(prompt_tokens)
        self.prefill_tokens.labels(replica_id).observe(computed)
        self.cached_tokens.labels(replica_id).inc(cached_tokens)
        label = self.tenants.label(tenant)
        self.tenant_prompt_tokens.labels(label).inc(prompt_tokens)
        self.tenant_prefill_tokens.labels(label).inc(computed)
        self.tenant_cached_tokens.labels(label).inc(cached_tokens)
        if replica_id in self._prompt_by_replica:  # else it left while this request was in flight
            self._prompt_by_replica[replica_id] += prompt_tokens
            self._cached_by_replica[replica_id] += cached_tokens
            self._spread()

    def misses(self, replica_id: str, tenant: str, causes: dict[str, int]) -> None:
        """A request's computed tokens by cause (misses.attribute)."""
        label = self.tenants.label(tenant)
        for cause, tokens in causes.items():
            if tokens:
                self.prefill_by_cause.labels(cause, replica_id).inc(tokens)
                self.tenant_prefill_by_cause.labels(label, cause).inc(tokens)

    def diverged(self, part: str, lost_tokens: int) -> None:
        """A session turn that broke its prefix (session_log.Divergence), its part as a bounded label."""
        self.diverged_turns.labels("earlier message" if part.startswith("message ") else part).inc()
        self.diverged_lost_tokens.observe(lost_tokens)

    def _spread(self) -> None:
        """Each listed replica's hit rate, and their spread."""
        rates = []
        for node_id, prompt in self._prompt_by_replica.items():
            rate = self._cached_by_replica[node_id] / prompt if prompt else 0.0
            self.hit_rate.labels(node_id).set(rate)
            rates.append(rate)
        mean = sum(rates) / len(rates) if rates else 0.0
        std = math.sqrt(sum((rate - mean) ** 2 for rate in rates) / len(rates)) if rates else 0.0
        self.hit_rate_spread.labels("std").set(std)
        self.hit_rate_spread.labels("cv").set(std / mean if mean else 0.0)
