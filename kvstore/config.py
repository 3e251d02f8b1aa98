"""The daemon's configuration: one typed object, validated once.

Sources, later ones winning: embedded defaults (sized from this machine's free memory and
disk) ← a TOML file ← ``KVSTORE_<SECTION>_<FIELD>`` environment variables ← command-line
``--set section.field=value`` (and the CLI's named flags). Sections: ``server``, ``host``,
``nvme``, ``manager``, ``index``, ``routing``, ``transport``; the file alone lists the
engines on this host (``[[engines]]``, kvstore/engines_config.py). Sizes accept ``"8GiB"``-style strings. Every error names the field::

    [server]
    socket_path = "/run/kvstore/kvstore.sock"
    grpc_port = 50551
    auth_token = "…"           # or KVSTORE_SERVER_AUTH_TOKEN

    [host]
    capacity_bytes = "16GiB"

    [nvme]
    directory = "/mnt/nvme0/kvstore"
    capacity_bytes = "1TiB"

    [manager]
    eviction_policy = "leaf-first-lru"

    [index]
    backend = "rediss://redis.internal:6380/0"
    tls_ca = "/etc/kvstore/redis-ca.pem"      # the CA that signed Redis's certificate
    tls_cert = "/etc/kvstore/node.pem"         # where Redis demands client certificates
    tls_key = "/etc/kvstore/node.key"
    username = "kvstore"                       # a Redis ACL user
    # password: KVSTORE_INDEX_PASSWORD
"""

from __future__ import annotations

import dataclasses
import grp
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.cache_value import DEFAULT_HALF_LIFE_S, MAX_HALF_LIFE_S
from kvstore.errors import InvalidArgument
from kvstore.paths import default_cache_dir, default_socket_path, default_token_path
from kvstore.tiers.host import HostTierConfig
from kvstore.tiers.manager import TierManagerConfig
from kvstore.tiers.nvme import NvmeTierConfig
from kvstore.transport.config import TransportConfig

if TYPE_CHECKING:
    from kvstore.engines_config import EngineConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "ServerConfig",
    "IndexConfig",
    "RoutingConfig",
    "DaemonConfig",
    "load_config",
    "read_toml",
    "parse_size",
    "parse_overrides",
    "index_config_for",
]

GiB = 1024**3
MiB = 1024**2
_PAGE = 64 * MiB
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


MAX_SPIN_US = 10_000.0


class ConfigError(InvalidArgument):
    """A configuration value is missing, malformed or out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket_path: Path = field(default_factory=lambda: default_socket_path())
    socket_mode: int = 0o600
    # with socket_mode 0o660: the group that may connect and map the host slab (a name or a
    # number; "" is the daemon's primary group); the socket, its state file and the slab get it
    socket_group: str = ""
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50551  # 0 picks a free port (written to the state file)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9551  # 0 picks a free port, -1 disables the endpoint
    auth_token: str = ""
    # where the daemon keeps the token it generates when auth_token is empty (0600); local
    # clients of the same user read it from there (kvstore/paths.py)
    auth_token_file: Path = field(default_factory=lambda: default_token_path())
    node_id: str = field(default_factory=socket.gethostname)
    drain_timeout_s: float = 10.0
    # engines' clients check every loaded block against its writer's checksum (a hash pass
    # per load, in the engine process); off, blocks are checked where they leave the
    # daemon's trust: demotion to NVMe, NVMe reads, peers
    verify_loads: bool = False
    # how often the daemon samples its event loop's lateness (kvstore_event_loop_lag_seconds)
    loop_lag_interval_ms: float = 100.0
    # "auto": uvloop where it is installed (a dependency on Linux and macOS; a local round
    # trip costs ~20 µs less than on asyncio's own loop), else asyncio's; or either by name
    event_loop: str = "auto"
    # after answering an engine the loop keeps polling its sockets this long before it
    # sleeps: an engine's requests come in runs (a scheduler looks up each waiting request,
    # then loads, then saves), and a loop woken from sleep answers each ~35 µs later on a
    # VM (kvstore_loop_polling_seconds counts the CPU it costs). 0: sleep at once; where
    # the daemon may run on one CPU only it never polls (it would keep the engine waiting),
    # nor while no CPU of the host is idle (it would take one from the engines' compute)
    spin_us: float = 200.0
    # the survivors of every full garbage collection are frozen, so a collection walks only
    # what is new (kvstore/gcpolicy.py); every this many seconds everything is thawed and
    # collected once (cyclic garbage among frozen objects). 0: never; -1: CPython's own policy
    gc_full_interval_s: float = 3600.0
    # scale-down (kvstore/cache_value.py): the half-life of a block's weight in this node's
    # unique cache value, and how often the daemon measures that value for its metric
    # (kvstore_unique_cache_value_bytes: a walk of the catalogue and a match of its chains in
    # the index, so not on every scrape); Admin.CacheValue measures on demand
    cache_value_half_life_s: float = DEFAULT_HALF_LIFE_S
    cache_value_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if self.socket_mode not in (0o600, 0o660):
            raise ConfigError(f"server.socket_mode must be 0o600 or 0o660, got {oct(self.socket_mode)}.")
        if self.socket_group and self.socket_mode != 0o660:
            raise ConfigError("server.socket_group applies only in group mode; set server.socket_mode = 0o660 as well, or leave it empty.")
        self.socket_gid  # noqa: B018 (an unknown group is a ConfigError at load, not at start)
        if not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"server.grpc_port must lie in [0, 65535], got {self.grpc_port}.")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"server.metrics_port must lie in [-1, 65535], got {self.metrics_port}.")
        if not self.node_id:
            raise ConfigError("server.node_id must not be empty.")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"server.drain_timeout_s must not be negative, got {self.drain_timeout_s}.")
        if not 0.1 <= self.loop_lag_interval_ms <= 60_000:
            raise ConfigError(f"server.loop_lag_interval_ms must lie in [0.1, 60000], got {self.loop_lag_interval_ms}.")
        if not (self.gc_full_interval_s in (-1, 0) or 60 <= self.gc_full_interval_s <= 7 * 86_400):
            raise ConfigError(
                "server.gc_full_interval_s must be -1 (CPython's own collector), 0 (never thaw) or lie in [60, 604800] seconds, "
                f"got {self.gc_full_interval_s}."
            )
        if not 0 <= self.spin_us <= MAX_SPIN_US:
            raise ConfigError(f"server.spin_us must lie in [0, {MAX_SPIN_US:g}], got {self.spin_us}.")
        if self.event_loop not in ("auto", "uvloop", "asyncio"):
            raise ConfigError(f"server.event_loop must be 'auto', 'uvloop' or 'asyncio', got {self.event_loop!r}.")
        if not 0 < self.cache_value_half_life_s <= MAX_HALF_LIFE_S:
            raise ConfigError(
                f"server.cache_value_half_life_s must lie in (0, {MAX_HALF_LIFE_S:g}] seconds, got {self.cache_value_half_life_s}."
            )
        if not 0.1 <= self.cache_value_interval_s <= 86_400:
            raise ConfigError(f"server.cache_value_interval_s must lie in [0.1, 86400] seconds, got {self.cache_value_interval_s}.")

    @property
    def socket_gid(self) -> int | None:
        """The group of the socket, its state file and the slab in group mode; None in private mode."""
        if self.socket_mode != 0o660:
            return None
        if not self.socket_group:
            return os.getegid()
        if self.socket_group.isdigit():
            gid = int(self.socket_group)
        else:
            try:
                gid = grp.getgrnam(self.socket_group).gr_gid
            except KeyError:
                raise ConfigError(
                    f"server.socket_group names no group of this host: {self.socket_group!r}; give a group name or number."
                ) from None
        if os.geteuid() != 0 and gid not in {os.getegid(), *os.getgroups()}:
            raise ConfigError(
                f"server.socket_group is {self.socket_group!r}, a group the daemon's user is not in; add the user to it first."
            )
        return gid

    @property
    def grpc_address(self) -> str:
        return f"{self.grpc_host}:{self.grpc_port}"


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Where the block-location index lives and how this node keeps it current."""

    backend: str = "embedded"  # or redis://host:port/db, rediss://…, redis+cluster://host:port
    lease_ttl_s: float = 10.0  # a node silent this long vanishes from every answer
    heartbeat_interval_s: float = 3.0
    publish_interval_s: float = 0.1  # block events are sent in batches at most this stale
    max_batch_events: int = 10_000
    # Who Redis is and who we are to it (rediss:// only): the CA that signed its certificate,
    # and this node's certificate and key where Redis demands one (tls-auth-clients).
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # a Redis ACL user; the password is best given as KVSTORE_INDEX_PASSWORD, never on a command line
    username: str = ""
    password: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.backend != "embedded" and not self.backend.startswith(("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")):
            raise ConfigError(
                'index.backend must be "embedded" or a redis://, rediss://, redis+cluster:// or rediss+cluster:// URL, '
                f"got {_redacted(self.backend)!r}."
            )
        self._check_access()
        if self.lease_ttl_s <= 0 or not 0 < self.heartbeat_interval_s < self.lease_ttl_s:
            raise ConfigError(
                f"index.heartbeat_interval_s ({self.heartbeat_interval_s}) must be positive and shorter than "
                f"index.lease_ttl_s ({self.lease_ttl_s})."
            )
        if self.publish_interval_s <= 0 or self.max_batch_events <= 0:
            raise ConfigError("index.publish_interval_s and index.max_batch_events must be positive.")

    def _check_access(self) -> None:
        tls_files = {"tls_ca": self.tls_ca, "tls_cert": self.tls_cert, "tls_key": self.tls_key}
        given = [name for name, path in tls_files.items() if path is not None]
        if given and not self.backend.startswith("rediss"):
            raise ConfigError(f"index.{given[0]} is set, but index.backend is not a rediss:// URL: TLS settings need a rediss:// backend.")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("index.tls_cert and index.tls_key go together: give both (a client certificate and its key) or neither.")
        for name in given:
            path = tls_files[name]
            if not os.access(path, os.R_OK) or not Path(path).is_file():
                raise ConfigError(f"index.{name} = {str(path)!r} cannot be read: give the path of a readable PEM file.")
        if (self.username or self.password) and self.backend == "embedded":
            raise ConfigError("index.username and index.password are for a Redis backend; the embedded index has no users.")
        if self.username and not self.password:
            raise ConfigError(f"index.username is {self.username!r} but index.password is empty: set KVSTORE_INDEX_PASSWORD.")
        userinfo = self.backend.partition("://")[2].partition("/")[0].rpartition("@")[0]
        if userinfo and (self.username or self.password):
            raise ConfigError(
                "index.username or index.password is set and the index.backend URL carries credentials too: give them in one place."
            )


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The cost model `Index.Route` scores candidates with (see index/scoring.py)."""

    prefill_tokens_per_s: float = 10_000.0
    attention_context_tokens: float = 64_000.0
    host_bytes_per_s: float = 20e9
    nvme_bytes_per_s: float = 5e9
    remote_bytes_per_s: float = 10e9
    decode_s_per_request: float = 0.5
    remote_fetch: bool = True
    margin_s: float = 0.5
    margin_ratio: float = 0.25
    session_ttl_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_tokens_per_s",
            "attention_context_tokens",
            "host_bytes_per_s",
            "nvme_bytes_per_s",
            "remote_bytes_per_s",
            "session_ttl_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"routing.{name} must be positive, got {getattr(self, name)}.")
        for name in ("decode_s_per_request", "margin_s", "margin_ratio"):
            if getattr(self, name) < 0:
                raise ConfigError(f"routing.{name} must not be negative, got {getattr(self, name)}.")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    server: ServerConfig
    host: HostTierConfig
    nvme: NvmeTierConfig | None  # None: memory only
    manager: TierManagerConfig
    index: IndexConfig = IndexConfig()
    routing: RoutingConfig = RoutingConfig()
    transport: TransportConfig = TransportConfig()
    engines: tuple[EngineConfig, ...] = ()  # whose KV events the daemon subscribes to


def _redacted(url: str) -> str:
    """``url`` with the password of its user part, if any, left out."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:…@{host}" if at and ":" in userinfo else url


def parse_size(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size in bytes, got {value!r}.")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f'{name} must be a size such as 8589934592 or "8GiB", got {value!r}.')
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def _default_host_capacity(shm_dir: Path) -> int:
    """A quarter of available memory, never more than 80% of the shared-memory filesystem."""
    available = 4 * GiB
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        shm_free = shutil.disk_usage(shm_dir).free
    except OSError:
        shm_free = available
    return max(_PAGE, min(available // 4, shm_free * 4 // 5) // _PAGE * _PAGE)


def _default_nvme_capacity(directory: Path) -> int:
    """A tenth of the free disk under the cache directory, at most 64 GiB: the slot files
    are preallocated (a later write never finds the disk full), so a default must leave
    the disk to its other users; a larger tier is configured (``nvme.capacity_bytes``).
    Slot files a previous run left there count as free, so a restart keeps its size."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if directory.is_dir():
        free += sum(path.stat().st_size for path in directory.glob("slots-*.dat") if path.is_file())
    return max(_PAGE, min(free // 10, 64 * GiB) // _PAGE * _PAGE)


_SECTIONS = {
    "server": ServerConfig,
    "host": HostTierConfig,
    "nvme": NvmeTierConfig,
    "manager": TierManagerConfig,
    "index": IndexConfig,
    "routing": RoutingConfig,
    "transport": TransportConfig,
}
_EXTRA_NVME_KEYS = {"enabled"}
# sections of the same file that other kvstore processes read (`kvstore router`'s), or
# that only the file can give (the engines: an array of tables)
_OTHER_SECTIONS = {"router", "engines"}


def _fields(section: str) -> dict[str, dataclasses.Field]:
    fields = {f.name: f for f in dataclasses.fields(_SECTIONS[section])}
    if section == "host":
        fields.pop("reclaim_stale")  # the daemon decides: it reclaims what a crashed run left
    return fields


def _coerce(section: str, name: str, raw: Any) -> Any:
    """Turn a TOML, environment or flag value into the field's type."""
    where = f"{section}.{name}"
    if section == "nvme" and name == "enabled":
        return _as_bool(raw, where)
    kind = str(_fields(section)[name].type)
    if name.endswith("_bytes"):
        return parse_size(raw, where)
    if "Path" in kind:
        return Path(str(raw)).expanduser()
    if kind == "bool":
        return _as_bool(raw, where)
    try:
        if kind == "int":
            return int(str(raw), 0) if isinstance(raw, str) else int(raw)
        if kind == "float":
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{where} must be a{'n integer' if kind == 'int' else ' number'}, got {raw!r}.") from exc
    return str(raw)


def _as_bool(raw: Any, where: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{where} must be true or false, got {raw!r}.")


def _merge(target: dict[str, dict[str, Any]], source: Mapping[str, Any], origin: str) -> None:
    for section, values in source.items():
        if section in _OTHER_SECTIONS:
            continue
        if section not in _SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{section}]; known sections: {', '.join(_SECTIONS)}.")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: [{section}] must be a table of settings.")
        allowed = set(_fields(section)) | (_EXTRA_NVME_KEYS if section == "nvme" else set())
        for name, raw in values.items():
            if name not in allowed:
                raise ConfigError(f"{origin}: unknown setting {section}.{name}; known: {', '.join(sorted(allowed))}.")
            target[section][name] = _coerce(section, name, raw)


def _from_env(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for key, value in environ.items():
        if not key.startswith("KVSTORE_") or key in ("KVSTORE_CONFIG", "KVSTORE_ADDRESS", "KVSTORE_TOKEN"):
            continue
        section, _, name = key[len("KVSTORE_") :].lower().partition("_")
        if section in _OTHER_SECTIONS:
            continue
        if section not in _SECTIONS:
            raise ConfigError(f"environment variable {key}: unknown section {section!r}; known: {', '.join(_SECTIONS)}.")
        found[section][name] = value
    return {s: v for s, v in found.items() if v}


INDEX_ACCESS_FIELDS = ("tls_ca", "tls_cert", "tls_key", "username", "password")


def index_config_for(backend: str, environ: Mapping[str, str] | None = None) -> IndexConfig:
    """The index config of a process that reads the index without a daemon's config (the
    router): ``backend`` with the TLS files and credentials a daemon would take from its
    environment (``KVSTORE_INDEX_TLS_CA``, ``…_TLS_CERT``, ``…_TLS_KEY``, ``…_USERNAME``,
    ``…_PASSWORD``)."""
    found = _from_env(os.environ if environ is None else environ).get("index", {})
    access = {name: _coerce("index", name, found[name]) for name in INDEX_ACCESS_FIELDS if name in found}
    return IndexConfig(backend=backend, **access)


def parse_overrides(pairs: list[str]) -> dict[str, dict[str, Any]]:
    """``["host.capacity_bytes=8GiB", …]`` as sections of settings."""
    found: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set expects section.field=value, got {pair!r}.")
        found.setdefault(section, {})[name] = value
    return found


def read_toml(path: Path | str) -> dict[str, Any]:
    """The TOML document at ``path``; a file that cannot be read or parsed is a ConfigError with a sentence."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc.strerror}.") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}.") from exc


def load_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> DaemonConfig:
    """Defaults ← TOML file ← environment ← overrides, validated into a DaemonConfig."""
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    if path is None and environ.get("KVSTORE_CONFIG"):
        path = Path(environ["KVSTORE_CONFIG"])
    document: dict[str, Any] = read_toml(path) if path is not None else {}
    if path is not None:
        _merge(values, document, str(path))
    _merge(values, _from_env(environ), "environment")
    if overrides:
        _merge(values, overrides, "command line")

    try:
        server = ServerConfig(**values["server"])
        host_values = dict(values["host"])
        host_dir = Path(host_values.get("directory", HostTierConfig.__dataclass_fields__["directory"].default))
        host_values.setdefault("capacity_bytes", _default_host_capacity(host_dir))
        # one segment per daemon instance: named after its socket, which is unique per host
        socket_tag = xxhash.xxh64_hexdigest(str(server.socket_path).encode())[:8]
        host_values.setdefault("name", f"kvstore-{server.node_id}-{socket_tag}".replace("/", "_"))
        host = HostTierConfig(reclaim_stale=True, **host_values)
        nvme_values = dict(values["nvme"])
        nvme: NvmeTierConfig | None = None
        if nvme_values.pop("enabled", True):
            nvme_values.setdefault("directory", default_cache_dir() / "nvme")
            nvme_values.setdefault("capacity_bytes", _default_nvme_capacity(Path(nvme_values["directory"])))
            nvme = NvmeTierConfig(**nvme_values)
        manager = TierManagerConfig(**values["manager"])
        index = IndexConfig(**values["index"])
        routing = RoutingConfig(**values["routing"])
        transport = TransportConfig(**values["transport"])
        from kvstore.engines_config import engines_from  # it reads ConfigError from here

        engines = engines_from(document.get("engines", []), server.node_id, index.lease_ttl_s, index.heartbeat_interval_s)
    except ConfigError:
        raise
    except InvalidArgument as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    except TypeError as exc:
        raise ConfigError(f"invalid configuration: {exc}.") from exc
    return DaemonConfig(
        server=server, host=host, nvme=nvme, manager=manager, index=index, routing=routing, transport=transport, engines=engines
    )
