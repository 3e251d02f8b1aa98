"""The engines beside a daemon (``[[engines]]``) and the namespace their KV is keyed in.

Each entry is one vLLM engine on this host (one per data-parallel rank) whose KV events
the daemon subscribes to, so that the blocks in the engine's own GPU prefix cache are in
the index as tier ``gpu``. The index names such an engine ``<name>@<server.node_id>``
(``kvstore.index.scoring.engine_node_id``): a router scores the engine's blocks as its
replica's, the replica whose node id is this daemon's::

    [[engines]]
    name = "vllm"                          # unique on this daemon; no "@"
    endpoint = "tcp://127.0.0.1:5557"      # vLLM's kv_events_config.endpoint (tcp://*:5557), as reachable from here
    replay_endpoint = "tcp://127.0.0.1:5558"  # optional: vLLM's replay_endpoint, to fill gaps
    topic = ""                             # vLLM's kv_events_config.topic

    [engines.namespace]                    # what the engine's kvstore connector derives
    model_id = "/models/qwen"              # vLLM's --model
    num_layers = 28
    num_kv_heads = 4                       # per tensor-parallel rank
    head_dim = 128
    dtype = "bfloat16"
    block_size = 32                        # vLLM's --block-size

vLLM binds its PUB socket for ``tcp://*:port`` and ``ipc://`` endpoints and connects it to
any other; the daemon always connects, so the engine must be given one it binds.

``namespace_from`` reads such a table for the router's ``[router.namespace]`` too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.config import ConfigError
from kvstore.errors import InvalidArgument
from kvstore.index.engine_subscriber import EngineSubscription
from kvstore.index.scoring import ENGINE_SEPARATOR, engine_node_id
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

__all__ = ["EngineConfig", "engines_from", "namespace_from", "STORE_INNER_ORDER"]

# the element order the kvstore connectors store blocks in (connectors/vllm_compat.STORE_INNER_ORDER)
STORE_INNER_ORDER = "HND"
_NAMESPACE_KEYS = {"model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "kv_planes", "tp_size", "tenant_salt"}
_NAMESPACE_REQUIRED = {"model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_size"}
_ENGINE_KEYS = {"name", "endpoint", "replay_endpoint", "topic", "namespace"}
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9a-fA-F:]+\]|[^:/\s]+):(?P<port>\d{1,5})$")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str
    subscription: EngineSubscription  # its engine_node_id is <name>@<server.node_id>
    namespace: Namespace


def namespace_from(values: Mapping[str, Any], where: str = "router.namespace") -> Namespace:
    """The namespace of a ``[… .namespace]`` table: the one the engines' connector registers
    for tensor-parallel rank 0 (every rank holds the same blocks)."""
    unknown = sorted(set(values) - _NAMESPACE_KEYS)
    if unknown:
        raise ConfigError(f"unknown setting(s) {where}.{f', {where}.'.join(unknown)}; known: {', '.join(sorted(_NAMESPACE_KEYS))}.")
    missing = sorted(_NAMESPACE_REQUIRED - set(values))
    if missing:
        raise ConfigError(f"{where} needs {', '.join(missing)} (the engines' model and KV cache geometry).")
    try:
        layout = KVLayout(
            int(values["num_layers"]),
            int(values["num_kv_heads"]),
            int(values["head_dim"]),
            int(values["block_size"]),
            str(values["dtype"]),
            int(values.get("kv_planes", 2)),
            STORE_INNER_ORDER,
        )
        tp_size = int(values.get("tp_size", 1))
        if layout.kv_planes == 1:  # MLA: one latent for every rank, a namespace that names none
            tp_size = 1
        return Namespace(str(values["model_id"]), layout, 0, tp_size, 0, 1, str(values.get("tenant_salt", "")))
    except (InvalidArgument, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _endpoint(value: Any, where: str) -> str:
    """A ZMQ endpoint this daemon connects to: tcp://host:port or ipc://path."""
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string such as tcp://127.0.0.1:5557, got {value!r}.")
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return value
    match = _TCP.match(value)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ConfigError(f"{where} must be tcp://host:port or ipc://path, got {value!r}.")
    if match["host"] in ("*", "0.0.0.0", "[::]"):
        raise ConfigError(
            f"{where} is {value!r}, an address vLLM binds; the daemon connects to the engine: name its host, "
            f"e.g. tcp://127.0.0.1:{match['port']}."
        )
    return value


def _engine(entry: Any, position: int, node_id: str, lease_ttl_s: float, heartbeat_interval_s: float) -> EngineConfig:
    where = f"engines[{position}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be a table ([[engines]] with endpoint and [engines.namespace]).")
    unknown = sorted(set(entry) - _ENGINE_KEYS)
    if unknown:
        raise ConfigError(f"unknown setting {where}.{unknown[0]}; known: {', '.join(sorted(_ENGINE_KEYS))}.")
    if "endpoint" not in entry:
        raise ConfigError(f"{where} needs endpoint: where the engine publishes its KV events (vLLM's kv_events_config.endpoint).")
    name, topic = entry.get("name", "vllm"), entry.get("topic", "")
    if not isinstance(name, str) or not name or ENGINE_SEPARATOR in name or name != name.strip():
        raise ConfigError(f"{where}.name must be a non-empty name without {ENGINE_SEPARATOR!r} or spaces around it, got {name!r}.")
    if not isinstance(topic, str):
        raise ConfigError(f"{where}.topic must be a string (vLLM's kv_events_config.topic), got {topic!r}.")
    replay = entry.get("replay_endpoint", "")
    subscription = EngineSubscription(
        endpoint=_endpoint(entry["endpoint"], f"{where}.endpoint"),
        engine_node_id=engine_node_id(name, node_id),
        topic=topic,
        replay_endpoint=_endpoint(replay, f"{where}.replay_endpoint") if replay else "",
        lease_ttl_s=lease_ttl_s,
        heartbeat_interval_s=heartbeat_interval_s,
    )
    namespace = entry.get("namespace", {})
    if not isinstance(namespace, Mapping):
        raise ConfigError(f"{where}.namespace must be a table ([engines.namespace]).")
    return EngineConfig(name, subscription, namespace_from(namespace, f"{where}.namespace"))


def engines_from(entries: Any, node_id: str, lease_ttl_s: float, heartbeat_interval_s: float) -> tuple[EngineConfig, ...]:
    """The ``[[engines]]`` of a configuration file, validated; leases as ``[index]``'s."""
    if not isinstance(entries, list):
        raise ConfigError("engines must be an array of tables: one [[engines]] per engine, with endpoint and [engines.namespace].")
    engines = tuple(_engine(entry, i, node_id, lease_ttl_s, heartbeat_interval_s) for i, entry in enumerate(entries))
    names = [engine.name for engine in engines]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"[[engines]] name {name!r} twice: give each engine a name of its own (name = …).")
    return engines
