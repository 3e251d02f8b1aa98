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

A replica's load, as routing prices it (`Replica.candidate`), is what the router knows
exactly — the requests it sent there and has not seen end, and their prompt tokens not
yet computed — and, for traffic that reaches the engine some other way, the engine's own
running + waiting requests (vLLM's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``, SGLang's alike) read from its ``/metrics`` at each check
(`EngineReading`). That figure is a sample taken at the check: the router's own requests
then in flight are in it, and stay in it until the next check even once the router has
seen them end. So the router keeps, with the figure, how many of its own requests the
engine may have counted — those in flight when the read began and those sent while it
ran — and prices as the engine's only the rest, never below 0. A request of the router's
that ends after the check then stops counting at once, where the raw figure would keep a
phantom request on the replica for a whole health interval and send a new session that
shares its cached prefix elsewhere. Counting every own request that may be in the figure
errs towards too little foreign load, never too much: a phantom drives sessions away from
their cache, a miss is corrected at the next check. The foreign figure is not aged
further: each passing check replaces it, a ``/metrics`` that stops answering 200 clears
it, and a check that fails takes the replica out of rotation, so what routing prices is
never older than one health interval (plus the check's own time). Reading the engine
again whenever a request ends would also be fresh, at the cost of a scrape of its
``/metrics`` per request; the router's own count needs none. (An engine whose own
gauges lag its scheduler — vLLM's stay put after every request is aborted at once until
its next step — shows as foreign load until they catch up.)

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

__all__ = ["EngineReading", "Replica", "ReplicaSet", "engine_queue", "served_models"]

# vLLM's gauges (SGLang's are sglang:num_running_reqs / sglang:num_queue_reqs)
_QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "sglang:num_running_reqs", "sglang:num_queue_reqs")


def engine_queue(exposition: str) -> int:
    """Requests running and waiting on an engine, from its Prometheus text."""
    total = 0.0
    for line in exposition.splitlines():
        if not line.startswith(_QUEUE_GAUGES):  # most of an engine's exposition: not looked at further
            continue
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


@dataclass(frozen=True, slots=True)
class EngineReading:
    """An engine's requests running and waiting, as its ``/metrics`` said at a health
    check, and how many of them may be the router's own: its requests in flight at some
    moment of the read (see the module docstring)."""

    requests: int = 0
    own: int = 0

    @property
    def foreign(self) -> int:
        """The engine's requests that the router did not send, as far as it can tell."""
        return max(self.requests - self.own, 0)


@dataclass(slots=True)
class Replica:
    config: ReplicaConfig
    healthy: bool = False
    models: tuple[str, ...] = ()
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters among models: name -> path
    in_flight: int = 0
    queued_tokens: int = 0  # prompt tokens of requests not answered yet, less their expected hits
    num_prefilling: int = 0
    num_sent: int = 0  # requests the router has sent it, ever: those sent while its engine is read may be in the figure
    engine: EngineReading = EngineReading()  # its engine's own figure at the last check (none before the first)

    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def engine_requests(self) -> int:
        """Running + waiting on its engine at the last check, the router's own requests then included."""
        return self.engine.requests

    @engine_requests.setter
    def engine_requests(self, requests: int) -> None:
        """The engine's figure, read now: the router's requests in flight now may be in it."""
        self.engine = EngineReading(requests, self.in_flight)

    @property
    def foreign_requests(self) -> int:
        """Requests on its engine the router did not send, at the last check."""
        return self.engine.foreign

    def sent(self, uncached_tokens: int) -> None:
        """The router sends it a request: in flight, its prompt to compute, ``uncached_tokens``
        of it in the queue routing prices, until `prefilled`."""
        self.in_flight += 1
        self.num_prefilling += 1
        self.queued_tokens += uncached_tokens
        self.num_sent += 1

    def prefilled(self, uncached_tokens: int) -> None:
        """A request it was computing has its prompt computed (or left without it): its
        ``uncached_tokens`` leave the queue routing prices."""
        self.num_prefilling -= 1
        self.queued_tokens -= uncached_tokens

    def candidate(self) -> Candidate:
        """Its load for the cost model: the requests the router sent it that are past their
        prompt, or the engine's requests the router did not send when those are more (the
        others' traffic it knows only from the last check). Its own requests count as the
        router knows them now, not as the engine's older figure may still hold them."""
        active = max(self.in_flight - self.num_prefilling, self.foreign_requests)
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
                await self._read_engine(client, replica, timeout_s)
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

    @staticmethod
    async def _read_engine(client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> None:
        """The engine's running + waiting requests, from its ``/metrics``, with the router's
        own requests that may be among them: those in flight as the read begins, and those
        sent while it runs (whether the engine counted them is not known; they are the
        router's either way). An engine that does not answer 200 gives no figure."""
        own, num_sent = replica.in_flight, replica.num_sent
        answer = await client.get(f"{replica.config.url}/metrics", timeout=timeout_s)
        own += replica.num_sent - num_sent
        replica.engine = EngineReading(engine_queue(answer.text), own) if answer.status_code == 200 else EngineReading()

    def _publish_health(self, replica: Replica) -> None:
        """What the last check (or failure) found: in rotation or not, the engine's own queue,
        and the part of it the router did not send."""
        if self.serves(replica):
            self.metrics.healthy.labels(replica.node_id).set(1 if replica.healthy else 0)
            self.metrics.engine_requests.labels(replica.node_id).set(replica.engine_requests)
            self.metrics.foreign_requests.labels(replica.node_id).set(replica.foreign_requests)
