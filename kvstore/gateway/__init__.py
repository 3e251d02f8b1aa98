"""`kvstore router`: the OpenAI-compatible, prefix- and session-aware front door for engine
replicas (app.py), its configuration (config.py), reloaded on SIGHUP (reload.py), its
clients' API keys and tenants (auth.py), the requests it accepts (validation.py) and the
errors it answers (openai_errors.py), its metrics (metrics.py), the cache bytes held per
tenant (tenant_cache.py) and which replica is cheapest to lose (scaledown.py)."""

from collections.abc import Callable

from kvstore.gateway.config import ReplicaConfig, RouterConfig, load_router_config

__all__ = ["ReplicaConfig", "RouterConfig", "load_router_config", "run_router"]


def run_router(config: RouterConfig, load: Callable[[], RouterConfig] | None = None) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers); on SIGHUP, ``load`` the
    configuration again and adopt its replica list."""
    import logging

    import uvicorn

    from kvstore.gateway.app import build_app

    # the router's own sentences (replicas in and out of rotation, reloads) on stderr; not
    # the root logger's, which would add a line per health-check request of httpx
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("kvstore").addHandler(handler)
    logging.getLogger("kvstore").setLevel(logging.INFO)
    for line in posture_lines(config):
        logging.getLogger("kvstore.gateway").info("%s", line)
    uvicorn.run(build_app(config, load), host=config.host, port=config.port, log_level="warning", lifespan="on", access_log=False)


def posture_lines(config: RouterConfig) -> list[str]:
    """The router's security posture, a line per surface: who may send requests, whose
    tenant a request is, and what /metrics shows."""
    where = f"http://{config.host}:{config.port}"
    if config.api_keys:
        clients = f"an API key is required ({len(config.api_keys.digests)} keys); a request's tenant is its key's"
        salted = "cache_salt is the tenant's (tenants never share KV)" if config.salt_from_tenant else "cache_salt as the client sent it"
        clients += f"; {salted}"
    else:
        clients = f"NO API keys: every client that reaches it is served and names its own tenant ({config.tenant_header}) [OPEN]"
    return [
        f"security posture: router API     {where}/v1: {clients}",
        f"security posture: router metrics {where}/metrics: no credential (tenant names as labels); keep it on the operators' network",
    ]
