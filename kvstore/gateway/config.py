"""The HTTP router's configuration: the ``[router]`` section of a kvstore TOML file.

One typed object, validated once. The same file may configure a daemon too (the daemon
skips ``[router]``); the router reads ``[router]``, its ``[router.namespace]`` and
``[[router.replicas]]``, and the cost model from ``[routing]`` (kvstore.config.RoutingConfig)::

    [router]
    port = 8000
    index = "redis://127.0.0.1:6379/0"   # where the replicas' daemons publish their blocks

    [router.namespace]                   # what the engines' kvstore connector derives
    model_id = "/models/qwen"            # vLLM's --model (or the connector's model_id)
    num_layers = 28
    num_kv_heads = 4                     # per tensor-parallel rank
    head_dim = 128
    dtype = "bfloat16"
    block_size = 32                      # vLLM's --block-size

    [[router.replicas]]
    url = "http://10.0.0.1:8000"         # the engine's OpenAI server
    node_id = "gpu-host-1"               # its kvstore daemon's server.node_id

    [routing]
    remote_fetch = false                 # the vLLM connector loads only what its own daemon holds

One host without Redis: ``index = "daemons"``, and each replica names its daemon's gRPC
address (and the daemon's server.auth_token, when it has one); the router asks those
daemons, whose index is embedded, under ``daemon_timeout_s`` a call (index/daemons.py).
With a Redis index a replica may name its daemon too: the router then keeps its sessions'
chains there through their pauses (``[router.retention]``, retention.py).
Sessions then live in this router's memory: run one router replica in this mode::

    [router]
    index = "daemons"

    [[router.replicas]]
    url = "http://127.0.0.1:8001"
    node_id = "gpu-0"
    daemon = "127.0.0.1:50551"           # its kvstore daemon's server.grpc_port
    daemon_token = ""                    # its server.auth_token, if set

Clients with API keys (auth.py): each key names a tenant, the tenant of every request that
presents it; ``salt_from_tenant`` sets each request's ``cache_salt`` from its tenant, so that
tenants never share KV (the secret comes from ``KVSTORE_ROUTER_SALT_SECRET`` or a file)::

    [router]
    api_keys_file = "/etc/kvstore/router-keys.toml"   # "sk-…" = "team-a"; and/or KVSTORE_ROUTER_API_KEYS
    salt_from_tenant = true
    salt_secret_file = "/etc/kvstore/router-salt"     # else KVSTORE_ROUTER_SALT_SECRET

The router needs each prompt's token ids; by default it asks an engine's ``/tokenize``.
Given the model's tokenizer file, it tokenizes text completions itself — no round trip on
the request's path — and keeps checking its answers against the engines' (tokenizer.py)::

    [router]
    tokenizer = "/models/qwen/tokenizer.json"   # or the model's directory
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.config import ConfigError, RoutingConfig, parse_size, read_toml
from kvstore.engines_config import namespace_from
from kvstore.gateway.auth import KEYS_ENV, MIN_SECRET_BYTES, SALT_SECRET_ENV, ApiKeys, load_api_keys, load_salt_secret
from kvstore.index.base import MAX_CHAIN_BLOCKS
from kvstore.namespace import Namespace

__all__ = [
    "DAEMONS_INDEX",
    "ReplicaChanges",
    "ReplicaConfig",
    "RouterConfig",
    "load_router_config",
    "namespace_from",
    "replica_changes",
]

_ROLES = ("both", "prefill", "decode")
DAEMONS_INDEX = "daemons"  # router.index for one host: ask each replica's daemon
_LOADED = ("api_keys", "salt_secret", "routing")  # read from their own files and variables, never set in [router]
_RELOADED = ("replicas", "api_keys", "api_keys_file")  # what a SIGHUP adopts (reload.py)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    url: str
    node_id: str
    role: str = "both"
    # host:port of its daemon's gRPC API: asked for matches with router.index = "daemons";
    # sent sessions' retention and prefetches ([router.retention]) with any index
    daemon: str = ""
    daemon_token: str = ""  # that daemon's server.auth_token, when it has one
    # the KV bytes its daemon and engine keep for the engines' namespace (host tier, plus
    # the engine's GPU prefix cache where it is on): routing prices what a new session's
    # context would evict there (index/scoring.py); 0: not known, no such term
    cache_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"router.replicas: url must be an http:// or https:// URL, got {self.url!r}.")
        if not isinstance(self.node_id, str) or not self.node_id:
            raise ConfigError(f"router.replicas: replica {self.url} needs the node_id of its kvstore daemon.")
        if self.role not in _ROLES:
            raise ConfigError(f"router.replicas: role must be one of {', '.join(_ROLES)}, got {self.role!r}.")
        if isinstance(self.cache_bytes, bool) or not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ConfigError(f"router.replicas: replica {self.node_id}'s cache_bytes must be a size >= 0, got {self.cache_bytes!r}.")
        if self.daemon:
            _check_address(self.daemon, self.node_id)
        elif self.daemon_token:
            raise ConfigError(f"router.replicas: replica {self.node_id} has a daemon_token but no daemon address to send it to.")


def _check_address(address: str, node_id: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() or c == "/" for c in host):
        raise ConfigError(
            f"router.replicas: replica {node_id}'s daemon must be the host:port of its daemon's gRPC API "
            f'(server.grpc_port), e.g. "127.0.0.1:50551", got {address!r}.'
        )


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """``[router.retention]``: used for the replicas that name their daemon (``daemon``)."""

    enabled: bool = True
    prefetch: bool = True  # ask the chosen replica's daemon to bring the chain back at a turn's start
    first_ttl_s: float = 60.0  # while the router has seen fewer than 32 pauses end
    min_ttl_s: float = 5.0
    max_ttl_s: float = 600.0  # a daemon cuts a longer one to its manager.max_retain_s
    margin: float = 2.0  # times the longest recent pause

    def __post_init__(self) -> None:
        for name in ("first_ttl_s", "min_ttl_s", "max_ttl_s", "margin"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ConfigError(f"router.retention.{name} must be a positive number, got {value!r}.")
        if self.min_ttl_s > self.max_ttl_s:
            raise ConfigError(f"router.retention.min_ttl_s ({self.min_ttl_s}) must not exceed max_ttl_s ({self.max_ttl_s}).")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    replicas: tuple[ReplicaConfig, ...]
    namespace: Namespace
    index: str  # redis://… (a fleet's index, shared by every router replica), or "daemons" (one host)
    host: str = "127.0.0.1"
    port: int = 8000
    session_header: str = "x-session-id"
    tenant_header: str = "x-tenant-id"  # without api_keys, the client names its tenant here (else a digest of its credential)
    max_tenants: int = 32  # tenants beyond this many share the label "other"
    session_prefix_blocks: int = 16  # completions without an id: the session is the first this many blocks
    max_body_bytes: int = 16 * 1024**2
    max_attempts: int = 3  # replicas tried for one request before the client sees an error
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 300.0
    health_interval_s: float = 2.0
    tenant_cache_interval_s: float = 15.0  # how often the cache bytes per tenant are measured
    tenant_cache_chains: int = 64  # per tenant label: the last this many distinct chains count
    tenant_cache_blocks: int = 32_768  # per tenant label: at most this many blocks of them (16 bytes each)
    daemon_timeout_s: float = 0.5  # index "daemons": a daemon that has not answered by then holds nothing
    routing: RoutingConfig = RoutingConfig(remote_fetch=False)
    api_keys_file: str = ""  # key → tenant (auth.py); with KVSTORE_ROUTER_API_KEYS, what api_keys holds
    salt_from_tenant: bool = False  # each request's cache_salt is its tenant's (auth.tenant_salt), the client's replaced
    salt_secret_file: str = ""  # the secret of tenant salts; else KVSTORE_ROUTER_SALT_SECRET
    # the model's tokenizer.json (or its directory): text completions are tokenized in the
    # router, checked against the engines (tokenizer.py); "": every prompt asks an engine's /tokenize
    tokenizer: str = ""
    # miss attribution and the session log (misses.py, session_log.py): the block keys of the
    # chains the fleet computed kept to tell an evicted block from a new one (~100 bytes
    # each), the sessions whose turns are kept, and whether an operator reading a session
    # sees the decoded text around a divergence (tenants' data) besides its token ids
    seen_blocks: int = 262_144
    session_log_sessions: int = 1000
    session_text: bool = False
    # [router.retention]: sessions' chains kept on their replica's daemon through their
    # pauses and brought back at their next turn (retention.py; replicas naming their daemon)
    retention: RetentionConfig = RetentionConfig()
    api_keys: ApiKeys = ApiKeys()  # none: every client is let in, and names its own tenant (tenant_header)
    salt_secret: bytes = dataclasses.field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("router.replicas is empty: name at least one engine replica (url and node_id).")
        for what, values in (("url", [r.url for r in self.replicas]), ("node_id", [r.node_id for r in self.replicas])):
            if len(set(values)) != len(values):
                raise ConfigError(f"router.replicas: each replica's {what} must be unique.")
        if self.index == DAEMONS_INDEX:
            missing = [r.node_id for r in self.replicas if not r.daemon]
            if missing:
                raise ConfigError(
                    f'router.index = "daemons" asks each replica\'s daemon, but replica {", ".join(missing)} names none: '
                    'give it daemon = "HOST:PORT" (its daemon\'s server.grpc_port).'
                )
        elif not self.index.startswith(("redis://", "rediss://", "redis+cluster://")):
            raise ConfigError(
                "router.index must be the redis:// URL the replicas' daemons publish to (index.backend), "
                f'or "daemons" on one host whose daemons keep an embedded index; got {self.index!r}.'
            )
        if not 0 <= self.port < 65536:
            raise ConfigError(f"router.port must lie in [0, 65536), got {self.port}.")
        for name in (
            "max_tenants",
            "session_prefix_blocks",
            "max_body_bytes",
            "max_attempts",
            "tenant_cache_chains",
            "tenant_cache_blocks",
            "seen_blocks",
            "session_log_sessions",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"router.{name} must be positive, got {getattr(self, name)}.")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "health_interval_s", "tenant_cache_interval_s", "daemon_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"router.{name} must be a positive number of seconds, got {getattr(self, name)}.")
        if self.tenant_cache_blocks > MAX_CHAIN_BLOCKS:
            raise ConfigError(
                f"router.tenant_cache_blocks must be at most {MAX_CHAIN_BLOCKS} (the longest chain the index matches), "
                f"got {self.tenant_cache_blocks}."
            )
        for name in ("session_header", "tenant_header"):
            if not getattr(self, name) or getattr(self, name) != getattr(self, name).strip().lower():
                raise ConfigError(f"router.{name} must be a non-empty lower-case header name, got {getattr(self, name)!r}.")
        if self.salt_from_tenant and not self.api_keys:
            raise ConfigError(
                f"router.salt_from_tenant needs API keys (router.api_keys_file or {KEYS_ENV}): without them a client names its "
                "own tenant, and so its salt."
            )
        if self.salt_from_tenant and len(self.salt_secret) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"router.salt_from_tenant needs a secret of at least {MIN_SECRET_BYTES} bytes in {SALT_SECRET_ENV} or "
                "router.salt_secret_file, the same on every router replica (e.g. openssl rand -hex 32)."
            )


def _coerce(name: str, raw: Any, kind: Any) -> Any:
    kind = str(kind)
    if name.endswith("_bytes"):
        return parse_size(raw, f"router.{name}")
    if kind == "bool":
        if not isinstance(raw, bool) and str(raw).lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"router.{name} must be true or false, got {raw!r}.")
        return raw if isinstance(raw, bool) else str(raw).lower() in ("true", "1")
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"router.{name} must be a number, got {raw!r}.") from exc
    return str(raw)


def _replica_value(name: str, raw: Any) -> Any:
    return parse_size(raw, f"router.replicas: {name}") if name == "cache_bytes" else str(raw)


def _routing(values: Mapping[str, Any]) -> RoutingConfig:
    fields = {f.name: f for f in dataclasses.fields(RoutingConfig)}
    settings: dict[str, Any] = {"remote_fetch": False}
    for name, raw in values.items():
        if name not in fields:
            raise ConfigError(f"unknown setting routing.{name}; known: {', '.join(sorted(fields))}.")
        if str(fields[name].type) == "bool":
            if not isinstance(raw, bool) and str(raw).lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"routing.{name} must be true or false, got {raw!r}.")
            settings[name] = raw if isinstance(raw, bool) else str(raw).lower() in ("true", "1")
        else:
            try:
                settings[name] = float(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"routing.{name} must be a number, got {raw!r}.") from exc
    return RoutingConfig(**settings)


def _retention(values: Any) -> RetentionConfig:
    if not isinstance(values, Mapping):
        raise ConfigError("router.retention must be a table ([router.retention]).")
    fields = {f.name: f for f in dataclasses.fields(RetentionConfig)}
    settings: dict[str, Any] = {}
    for name, raw in values.items():
        if name not in fields:
            raise ConfigError(f"unknown setting router.retention.{name}; known: {', '.join(sorted(fields))}.")
        if str(fields[name].type) == "bool":
            if not isinstance(raw, bool):
                raise ConfigError(f"router.retention.{name} must be true or false, got {raw!r}.")
            settings[name] = raw
        else:
            try:
                settings[name] = float(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"router.retention.{name} must be a number, got {raw!r}.") from exc
    return RetentionConfig(**settings)


def load_router_config(
    path: Path | None = None, overrides: Mapping[str, Any] | None = None, replicas: Sequence[ReplicaConfig] = ()
) -> RouterConfig:
    """``[router]`` of the file at ``path`` ← ``overrides`` (``{"port": 9000, …}``); replicas
    given here are added to the file's."""
    document: dict[str, Any] = read_toml(path) if path is not None else {}
    section = dict(document.get("router", {}))
    section.update(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(RouterConfig)}
    settings: dict[str, Any] = {}
    for name, raw in section.items():
        if name in ("replicas", "namespace", "retention"):
            continue
        if name not in fields or name in _LOADED:
            known = sorted(set(fields) - set(_LOADED))
            raise ConfigError(f"unknown setting router.{name}; known: {', '.join(known)}.")
        settings[name] = _coerce(name, raw, fields[name].type)
    listed = section.get("replicas", [])
    if not isinstance(listed, list) or not all(isinstance(r, Mapping) for r in listed):
        raise ConfigError("router.replicas must be an array of tables ([[router.replicas]] with url and node_id).")
    try:
        found = [ReplicaConfig(**{k: _replica_value(k, v) for k, v in r.items()}) for r in listed]
    except TypeError as exc:
        raise ConfigError(
            f"router.replicas: {exc}; a replica has url, node_id and optionally role, daemon, daemon_token and cache_bytes."
        ) from exc
    settings["replicas"] = (*found, *replicas)
    settings["namespace"] = namespace_from(section.get("namespace", {}))
    settings["routing"] = _routing(document.get("routing", {}))
    settings["retention"] = _retention(section.get("retention", {}))
    settings.setdefault("index", "")
    settings["api_keys"] = load_api_keys(settings.get("api_keys_file", ""), os.environ)
    settings["salt_secret"] = load_salt_secret(settings.get("salt_secret_file", ""), os.environ)
    return RouterConfig(**settings)


@dataclass(frozen=True, slots=True)
class ReplicaChanges:
    """What a reloaded configuration changes: its replica list against the running one
    (by node id), and the other settings it changes, which apply only at the next start
    (the API keys apply at once, and are not listed: their count is logged)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]  # the same node id at another url or in another role
    not_applied: tuple[str, ...]  # router settings that differ: the running ones stay

    def describe(self) -> str:
        listed = (("added", self.added), ("removed", self.removed), ("changed", self.changed))
        parts = [f"{what} {', '.join(ids)}" for what, ids in listed if ids]
        sentence = "; ".join(parts) if parts else "the replica list is unchanged"
        if self.not_applied:
            sentence += f"; {', '.join(self.not_applied)} changed too, which takes a restart: kept as they were"
        return sentence


def replica_changes(current: RouterConfig, new: RouterConfig) -> ReplicaChanges:
    before = {r.node_id: r for r in current.replicas}
    after = {r.node_id: r for r in new.replicas}
    not_applied = tuple(
        "routing" if f.name == "routing" else f"router.{f.name}"
        for f in dataclasses.fields(RouterConfig)
        if f.name not in _RELOADED and getattr(current, f.name) != getattr(new, f.name)
    )
    return ReplicaChanges(
        added=tuple(node_id for node_id in after if node_id not in before),
        removed=tuple(node_id for node_id in before if node_id not in after),
        changed=tuple(node_id for node_id, r in after.items() if node_id in before and before[node_id] != r),
        not_applied=not_applied,
    )
