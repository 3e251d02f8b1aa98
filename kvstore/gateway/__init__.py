"""`kvstore router`: the OpenAI-compatible, prefix- and session-aware front door for engine
replicas (app.py), its configuration (config.py), metrics (metrics.py) and the cache
bytes held per tenant (tenant_cache.py)."""

from kvstore.gateway.config import ReplicaConfig, RouterConfig, load_router_config

__all__ = ["ReplicaConfig", "RouterConfig", "load_router_config", "run_router"]


def run_router(config: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers)."""
    import uvicorn

    from kvstore.gateway.app import build_app

    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level="warning", lifespan="on", access_log=False)
