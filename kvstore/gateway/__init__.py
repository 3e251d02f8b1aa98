"""`kvstore router`: the OpenAI-compatible, prefix- and session-aware front door for engine
replicas (app.py), its configuration (config.py), reloaded on SIGHUP (reload.py), its
clients' API keys and tenants (auth.py), the requests it accepts (validation.py) and the
errors it answers (openai_errors.py), its metrics (metrics.py) and the cache bytes held per
tenant (tenant_cache.py)."""

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
    uvicorn.run(build_app(config, load), host=config.host, port=config.port, log_level="warning", lifespan="on", access_log=False)
