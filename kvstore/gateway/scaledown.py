"""``GET /kvstore/drain-plan``: the router's answer to which replica is cheapest to lose
(kvstore/scaledown.py). Each node's daemon is asked for its unique cache value
(``Admin.CacheValue``, kvstore/api/cache_values.py), concurrently, and the router adds
what only it knows: the distinct tokens of the live sessions it placed on the node
(index/live.py), in KV bytes of the engines' namespace.

The nodes are every daemon the index lists and every configured replica; a replica whose
daemon is not in the index, or does not answer, is listed as unknown. A daemon is asked at
its replica's ``daemon`` address where one is configured (``router.index = "daemons"``),
else at the address the index lists, with the replica's ``daemon_token``, else
``$KVSTORE_TOKEN``, else (a daemon on this host) the token a daemon of this user generated.

Query parameters: ``half_life_s`` (default: each daemon's ``server.cache_value_half_life_s``)
and ``timeout_s``, each daemon's deadline (default 10, at most 60). With API keys, a
request must present one, like the router's other ``/kvstore/`` endpoints; any tenant's key
will do: the plan names nodes and byte counts, no tenant's data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvstore.api.cache_values import DAEMON_KIND, ask_daemon
from kvstore.cache_value import check_half_life
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.gateway.auth import presented_key
from kvstore.gateway.openai_errors import openai_error
from kvstore.paths import token_for
from kvstore.scaledown import Standing, plan_document, rank

if TYPE_CHECKING:
    from kvstore.gateway.app import Gateway

__all__ = ["PATH", "DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "drain_plan_route"]

PATH = "/kvstore/drain-plan"
DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 60.0
_UNAUTHORIZED = "Incorrect or missing API key: send a key of this router's as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')."


def drain_plan_route(gateway: Gateway) -> Route:
    async def drain_plan(request: Request) -> Response:
        keys = gateway.config.api_keys
        presented = presented_key(request.headers)
        if keys and (not presented or keys.tenant_of(presented) is None):
            return openai_error(401, _UNAUTHORIZED, code="invalid_api_key", headers={"www-authenticate": "Bearer"})
        try:
            half_life_s = _number(request, "half_life_s", None)
            if half_life_s is not None:
                check_half_life(half_life_s)
        except InvalidArgument as exc:
            return openai_error(400, str(exc), param="half_life_s")
        try:
            timeout_s = _number(request, "timeout_s", DEFAULT_TIMEOUT_S)
            if not 0 < timeout_s <= MAX_TIMEOUT_S:
                raise InvalidArgument(f"timeout_s must lie in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout_s}.")
        except InvalidArgument as exc:
            return openai_error(400, str(exc), param="timeout_s")
        try:
            standings = await plan(gateway, half_life_s, timeout_s)
        except KVStoreError as exc:  # the index does not answer
            return openai_error(503, f"The block-location index did not answer: {exc}", "service_unavailable")
        return JSONResponse(plan_document(rank(standings), half_life_s))

    return Route(PATH, drain_plan, methods=["GET"])


async def plan(gateway: Gateway, half_life_s: float | None, timeout_s: float) -> list[Standing]:
    """Every node's standing, with the live sessions ``gateway`` placed on it."""
    config = gateway.config
    indexed = {n.node_id: n.grpc_address for n in await gateway.index.nodes() if n.kind == DAEMON_KIND}
    replicas = {r.node_id: r for r in config.replicas}
    asked = []
    for node_id in sorted(indexed.keys() | replicas.keys()):
        replica = replicas.get(node_id)
        address = replica.daemon if replica is not None and replica.daemon else indexed.get(node_id, "")
        token = replica.daemon_token if replica is not None and replica.daemon_token else (token_for(address) if address else "")
        asked.append(ask_daemon(node_id, address, token, half_life_s, timeout_s))
    standings = await asyncio.gather(*asked)
    now = time.monotonic()  # the clock the router records live sessions on
    namespace = config.namespace
    return [
        dataclasses.replace(s, live_bytes=gateway.live.tokens_on(s.node_id, now) * namespace.block_bytes // namespace.block_size)
        for s in standings
    ]


def _number(request: Request, name: str, default: float | None) -> float | None:
    """The query parameter ``name`` as a finite number, ``default`` where it is absent."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(f"{name} must be a number of seconds, got {raw!r}.") from None
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number of seconds, got {raw!r}.")
    return value
