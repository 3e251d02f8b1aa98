"""Reloading the router's configuration on SIGHUP, as nginx and Prometheus do: the file is
read again (with the command line's ``--replica`` and ``--set`` over it, as at start) and
validated whole; its replica list and its API keys (router.api_keys_file and
KVSTORE_ROUTER_API_KEYS, auth.py) are adopted, and the other settings stay as they started
(a change to one is named in the log: it takes a restart). A file that does not load is
refused with a logged sentence and the running list and keys kept.

The replica set (replicas.py) does the adopting: a new replica enters rotation at its
first passing health check; one no longer listed leaves rotation at once, and its sessions
move at their next request, the move recorded with ``moved: <replica> is not a candidate``.

Owner: the router's event loop (the signal arrives through ``loop.add_signal_handler``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from kvstore.errors import KVStoreError
from kvstore.gateway.config import RouterConfig, replica_changes
from kvstore.gateway.metrics import RouterMetrics
from kvstore.gateway.replicas import ReplicaSet

__all__ = ["ConfigReload"]

logger = logging.getLogger("kvstore.router")


class ConfigReload:
    def __init__(self, load: Callable[[], RouterConfig] | None, replicas: ReplicaSet, metrics: RouterMetrics) -> None:
        self._load = load  # None: started without a file, nothing to re-read
        self._replicas = replicas
        self._metrics = metrics

    def __call__(self, current: RouterConfig) -> RouterConfig:
        """The configuration to run with from now on: ``current`` with the file's replica
        list, or ``current`` itself when the file is refused."""
        if self._load is None:
            logger.warning("kvstore router: SIGHUP ignored: the router was started without --config, there is no file to re-read.")
            return current
        running = ", ".join(r.node_id for r in current.replicas)
        try:
            new = self._load()
            # the running settings (its index among them) judge the new list: a one-host
            # router needs each replica's daemon even if the file now names a redis:// index
            adopted = dataclasses.replace(current, replicas=new.replicas, api_keys=new.api_keys, api_keys_file=new.api_keys_file)
        except KVStoreError as exc:
            self._metrics.reloaded(applied=False)
            logger.warning("kvstore router: configuration reload refused, the replica list stays %s: %s", running, exc)
            return current
        changes = replica_changes(current, new)
        self._replicas.adopt(new.replicas)
        self._metrics.reloaded(applied=True)
        keys = len(adopted.api_keys.digests)
        logger.info("kvstore router: configuration reloaded: %s%s.", changes.describe(), f"; {keys} API keys" if keys else "")
        return adopted
