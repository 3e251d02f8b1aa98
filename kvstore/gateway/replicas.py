"""The engine replicas behind the router: health, served models, and the load the router
itself puts on each (requests in flight, prompt tokens waiting for their first byte).

A replica is a candidate while it is healthy: its ``/health`` answered 200 at the last
check, and no request has since failed to connect to it. A failed connection takes it
out at once; the next passing check brings it back. A request is a candidate's only if
the replica serves its model: the base model or a LoRA adapter, as its ``/v1/models``
listed them at the last check (vLLM lists an adapter with ``parent`` its base model and
``root`` the path the engine keys its blocks with). Learning adapters there, rather than
from the router's configuration, follows vLLM's runtime ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` within a health interval; an adapter re-pointed in between
costs a recompute, never wrong KV (the engine keys with its own path).

The list itself changes when the router reloads its configuration (`ReplicaSet.adopt`):
a replica new to it starts unhealthy, out of rotation until its first passing check; one
no longer listed leaves at once, while its requests in flight finish on the `Replica`
they hold, which no longer writes the set's metrics.

Owner: the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvstore.gateway.config import ReplicaConfig
from kvstore.gateway.metrics import RouterMetrics
from kvstore.index.scoring import Candidate

__all__ = ["Replica", "ReplicaSet", "engine_queue", "served_models"]

# vLLM's gauges (SGLang's are sglang:num_running_reqs / sglang:num_queue_reqs)
_QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "sglang:num_running_reqs", "sglang:num_queue_reqs")


def engine_queue(exposition: str) -> int:
    """Requests running and waiting on an engine, from its Prometheus text."""
    total = 0.0
    for line in exposition.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _QUEUE_GAUGES:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return int(total)


def served_models(cards: Any) -> tuple[tuple[str, ...], dict[str, str]]:
    """The model ids of a ``/v1/models`` list's ``data``, and its LoRA adapters' paths by
    name: a card with a ``parent`` is an adapter, its ``root`` the path ("" when the card
    names none: requests for it are not keyed)."""
    if not isinstance(cards, list):
        raise ValueError("/v1/models has no list of models")
    cards = [card for card in cards if isinstance(card, dict)]
    adapters = {}
    for card in cards:
        if card.get("parent") is not None:
            root = card.get("root")
            adapters[str(card.get("id"))] = root if isinstance(root, str) else ""
    return tuple(str(card.get("id")) for card in cards), adapters


logger = logging.getLogger("kvstore.router")


@dataclass(slots=True)
class Replica:
    config: ReplicaConfig
    healthy: bool = False
    models: tuple[str, ...] = ()
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters among models: name -> path
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens of requests not answered yet, less their expected hits
    num_prefilling: int = 0
    engine_requests: int = 0  # running + waiting, as the engine's own /metrics last said (other clients' too)

    @property
    def node_id(self) -> str:
        return self.config.node_id

    def prefilled(self, uncached_tokens: int) -> None:
        """A request it was computing has its prompt computed (or left without it): its
        ``uncached_tokens`` leave the queue routing prices."""
        self.num_prefilling -= 1
        self.queued_tokens -= uncached_tokens

    def candidate(self) -> Candidate:
        """Its load for the cost model: what the router sent it, or what the engine reports
        when that is more (traffic that reached it some other way)."""
        active = max(self.in_flight - self.num_prefilling, self.engine_requests - self.in_flight)
        return Candidate(self.node_id, queued_tokens=self.queued_tokens, active_requests=max(active, 0))


@dataclass
class ReplicaSet:
    replicas: dict[str, Replica]
    metrics: RouterMetrics

    @classmethod
    def of(cls, configs: Iterable[ReplicaConfig], metrics: RouterMetrics) -> ReplicaSet:
        return cls({c.node_id: Replica(c) for c in configs}, metrics)

    def adopt(self, configs: Sequence[ReplicaConfig]) -> None:
        """Make ``configs`` the list. A replica listed as it was keeps its state (health,
        load); a new one, or one whose url or role changed, starts out of rotation."""
        adopted: dict[str, Replica] = {}
        for config in configs:
            current = self.replicas.get(config.node_id)
            adopted[config.node_id] = current if current is not None and current.config == config else Replica(config)
        for node_id in self.replicas.keys() - adopted.keys():
            self.metrics.remove_replica(node_id)
        for replica in adopted.values():
            if self.replicas.get(replica.node_id) is not replica:
                self.metrics.add_replica(replica.node_id)
        self.replicas = adopted

    def serves(self, replica: Replica) -> bool:
        """``replica`` is (still) in the list: not one a reload removed or replaced."""
        return self.replicas.get(replica.node_id) is replica

    def publish_load(self, replica: Replica) -> None:
        if self.serves(replica):
            self.metrics.in_flight.labels(replica.node_id).set(replica.in_flight)
            self.metrics.queued_tokens.labels(replica.node_id).set(replica.queued_tokens)

    def candidates(
        self, excluded: set[str], roles: tuple[str, ...] = ("both", "prefill", "decode"), model: str | None = None
    ) -> list[Candidate]:
        """Healthy replicas of ``roles`` not ``excluded`` that serve ``model`` (any, if None)."""
        return [
            r.candidate()
            for r in self.replicas.values()
            if r.healthy and r.node_id not in excluded and r.config.role in roles and (model is None or model in r.models)
        ]

    def disaggregated(self) -> bool:
        """Prefill and decode run on different replicas: some are marked each way."""
        roles = {r.config.role for r in self.replicas.values()}
        return "prefill" in roles and "decode" in roles

    def models(self) -> set[str]:
        return {model for r in self.replicas.values() if r.healthy for model in r.models}

    def healthy(self, model: str | None = None) -> list[Replica]:
        """Healthy replicas that serve ``model`` (any, if None), least loaded first."""
        serving = (r for r in self.replicas.values() if r.healthy and (model is None or model in r.models))
        return sorted(serving, key=lambda r: (r.in_flight, r.node_id))

    def adapter_paths(self, model: str) -> set[str | None]:
        """Where the healthy replicas serving ``model`` load it from as a LoRA adapter: None
        for each that serves it as its base model."""
        return {r.adapters.get(model) for r in self.healthy(model)}

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            logger.warning("kvstore router: replica %s (%s) taken out of rotation: %s", replica.node_id, replica.config.url, why)
        replica.healthy = False
        self._publish_health(replica)

    async def check(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        await asyncio.gather(*(self._check_one(client, replica, timeout_s) for replica in self.replicas.values()))

    async def run_checks(self, client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.check(client, timeout_s)

    async def _check_one(self, client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> None:
        url = replica.config.url
        try:
            health = await client.get(f"{url}/health", timeout=timeout_s)
            models = await client.get(f"{url}/v1/models", timeout=timeout_s) if health.status_code == 200 else None
            ok = models is not None and models.status_code == 200
            if ok:
                replica.models, replica.adapters = served_models(models.json().get("data", []))
                engine_metrics = await client.get(f"{url}/metrics", timeout=timeout_s)
                if engine_metrics.status_code == 200:
                    replica.engine_requests = engine_queue(engine_metrics.text)
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        else:
            why = f"/health answered {health.status_code}"
        if ok and not replica.healthy:
            logger.info("kvstore router: replica %s (%s) is healthy, serving %s", replica.node_id, url, ", ".join(replica.models))
            replica.healthy = True
        elif not ok:
            self.mark_down(replica, why)
        self._publish_health(replica)

    def _publish_health(self, replica: Replica) -> None:
        """What the last check (or failure) found: in rotation or not, and the engine's own queue."""
        if self.serves(replica):
            self.metrics.healthy.labels(replica.node_id).set(1 if replica.healthy else 0)
            self.metrics.engine_requests.labels(replica.node_id).set(replica.engine_requests)
