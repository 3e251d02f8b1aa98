"""The `kvstore` command: run the daemon, inspect and control it.

Every command but `serve`, `clean` and `version` talks to a daemon's gRPC API. The address comes
from ``--address``, else ``$KVSTORE_ADDRESS``, else the state file the daemon wrote next
to its socket (``--socket`` / ``$KVSTORE_SERVER_SOCKET_PATH`` / the default path). The
bearer token comes from ``--token`` or ``$KVSTORE_TOKEN``, else from the token file that a
daemon of this user generated (named in its state file; kvstore/paths.py).

Output is a human-readable table, or one JSON document with ``--json``. Exit codes:

    0  done                         3  no daemon answers at that address
    1  the daemon refused (a sentence says why)   4  the daemon wants a valid token
    2  bad command line             5  the daemon does not implement this yet
"""

from __future__ import annotations

import functools
import json
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvstore.errors import KVStoreError

EXIT_OK, EXIT_REJECTED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_UNAUTHENTICATED, EXIT_UNIMPLEMENTED = 0, 1, 2, 3, 4, 5
_EXIT_BY_CODE = {
    "UNAVAILABLE": EXIT_UNREACHABLE,
    "DEADLINE_EXCEEDED": EXIT_UNREACHABLE,
    "UNAUTHENTICATED": EXIT_UNAUTHENTICATED,
    "UNIMPLEMENTED": EXIT_UNIMPLEMENTED,
}
_TIERS = ("gpu", "hbm", "host", "nvme", "remote")


class Context:
    def __init__(self, address: str | None, socket_path: str | None, token: str | None, as_json: bool) -> None:
        self.address = address
        self.socket_path = socket_path
        self.token = token
        self.token_file: Path | None = None  # the one the daemon's state file names
        self.as_json = as_json
        self.router: tuple[str, str | None] = ("", None)  # `kvstore sessions`: the router's URL and API key

    def client(self):
        from kvstore.api.client import connect
        from kvstore.paths import token_for

        address = self.resolve_address()
        token = self.token if self.token is not None else token_for(address, self.token_file)
        return connect(address, token=token)

    def resolve_address(self) -> str:
        """The daemon's gRPC address: given, or from its state file, which also names the
        token file the daemon generated (sent when no token is given)."""
        if self.address:
            return self.address
        from kvstore.paths import default_socket_path, read_state

        state = read_state(Path(self.socket_path) if self.socket_path else default_socket_path())
        self.token_file = Path(state["auth_token_file"]) if state.get("auth_token_file") else None
        return state["grpc_address"]

    def emit(self, document: Any, human: Callable[[], None]) -> None:
        if self.as_json:
            click.echo(json.dumps(document, indent=None, sort_keys=True))
        else:
            human()


def _fail(message: str, code: int) -> None:
    click.echo(f"kvstore: {message}", err=True)
    sys.exit(code)


def _guarded(function: Callable) -> Callable:
    """Turn kvstore and API errors into a sentence and an exit code, never a traceback."""

    def wrapper(*args, **kwargs):
        from kvstore.api.client import ApiError

        try:
            return function(*args, **kwargs)
        except ApiError as exc:
            _fail(str(exc), _EXIT_BY_CODE.get(exc.code, EXIT_REJECTED))
        except KVStoreError as exc:
            unreachable = "is `kvstore serve` running" in str(exc)
            _fail(str(exc), EXIT_UNREACHABLE if unreachable else EXIT_REJECTED)

    wrapper.__name__ = function.__name__
    wrapper.__doc__ = function.__doc__
    return wrapper


def _hex_list(values: tuple[str, ...], what: str) -> list[bytes]:
    from kvstore.hashing import parse_block_hash

    try:
        return [parse_block_hash(v) for v in values]
    except KVStoreError as exc:
        raise click.BadParameter(str(exc), param_hint=what) from None


def _namespace_id(value: str | None) -> bytes:
    if not value:
        return b""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not hex; namespace ids are 32 hex digits as `kvstore ls` prints them.", param_hint="--namespace"
        ) from None
    if len(raw) != 16:
        raise click.BadParameter("namespace ids are 32 hex digits.", param_hint="--namespace")
    return raw


def _tier_proto(name: str | None):
    from kvstore.api.v1 import kvstore_pb2 as pb

    return None if name is None else pb.Tier.Value(f"TIER_{name.upper()}")


def _tier_name(value: int) -> str:
    from kvstore.api.v1 import kvstore_pb2 as pb

    return pb.Tier.Name(value).removeprefix("TIER_").lower()


def _table(columns: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--address", envvar="KVSTORE_ADDRESS", help="gRPC address of the daemon (host:port).")
@click.option(
    "--socket", "socket_path", envvar="KVSTORE_SERVER_SOCKET_PATH", help="the daemon's Unix socket; its state file gives the address."
)
@click.option("--token", envvar="KVSTORE_TOKEN", help="bearer token, when the daemon requires one.")
@click.option("--json", "as_json", is_flag=True, help="print one JSON document instead of a table.")
@click.pass_context
def main(ctx: click.Context, address: str | None, socket_path: str | None, token: str | None, as_json: bool) -> None:
    """kvstore: a tiered KV-cache store for LLM inference fleets."""
    ctx.obj = Context(address, socket_path, token, as_json)


@main.command()
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), envvar="KVSTORE_CONFIG", help="TOML configuration file."
)
@click.option("--set", "settings", multiple=True, metavar="SECTION.FIELD=VALUE", help="override one setting (repeatable).")
def serve(config_path: Path | None, settings: tuple[str, ...]) -> None:
    """Run the daemon on this host (until SIGTERM).

    Its peer port listens on loopback by default. On any other transport.host it refuses
    to start unless peers authenticate: transport.peer_secret_file (or
    KVSTORE_TRANSPORT_PEER_SECRET, the same on every node) and/or mutual TLS
    (transport.tls_cert, tls_key, tls_ca); transport.allow_unauthenticated = true runs it
    open on a network you trust. At start it logs one 'security posture:' line per surface.
    """
    from kvstore.config import load_config, parse_overrides
    from kvstore.daemon import run

    try:
        config = load_config(config_path, overrides=parse_overrides(list(settings)))
    except KVStoreError as exc:
        _fail(str(exc), EXIT_USAGE)
    try:
        run(config)
    except KVStoreError as exc:
        _fail(str(exc), EXIT_REJECTED)


@main.command()
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), envvar="KVSTORE_CONFIG", help="TOML configuration file."
)
@click.option("--set", "settings", multiple=True, metavar="SECTION.FIELD=VALUE", help="override one setting (repeatable).")
@click.option("--dry-run", is_flag=True, help="name what would be removed, remove nothing.")
@click.pass_obj
def clean(ctx: Context, config_path: Path | None, settings: tuple[str, ...], dry_run: bool) -> None:
    """Remove a stopped daemon's NVMe slot files and shared memory (refused while it runs).

    Takes the configuration `kvstore serve` was started with, to find its files."""
    from kvstore.cleanup import remove_leftovers
    from kvstore.config import load_config, parse_overrides

    overrides = ([f"server.socket_path={ctx.socket_path}"] if ctx.socket_path else []) + list(settings)
    try:
        config = load_config(config_path, overrides=parse_overrides(overrides))
    except KVStoreError as exc:
        _fail(str(exc), EXIT_USAGE)
    try:
        removed = remove_leftovers(config, dry_run)
    except KVStoreError as exc:
        _fail(str(exc), EXIT_REJECTED)
    document = {"removed": [str(path) for path in removed.paths], "bytes": removed.num_bytes, "dry_run": dry_run}

    def human() -> None:
        verb = "would remove" if dry_run else "removed"
        for path in removed.paths:
            click.echo(f"{verb} {path}")
        click.echo(f"{verb} {len(removed.paths)} file(s), {_size(removed.num_bytes)}" if removed.paths else "nothing to remove")

    ctx.emit(document, human)


@main.command()
def version() -> None:
    """Print kvstore's version."""
    from importlib.metadata import version as package_version

    from kvstore.version import API_VERSION, LOCAL_PROTOCOL_VERSION

    ctx = click.get_current_context().obj
    document = {"version": package_version("kvstore"), "api": API_VERSION, "local_protocol": LOCAL_PROTOCOL_VERSION}
    ctx.emit(document, lambda: click.echo(f"kvstore {document['version']} (API {API_VERSION}, local protocol {LOCAL_PROTOCOL_VERSION})"))


def _stats_document(client) -> dict:
    from kvstore.api.v1 import kvstore_pb2 as pb

    response = client.admin.Stats(pb.StatsRequest())
    return {
        "node_id": response.node_id,
        "uptime_s": round(response.uptime_s, 3),
        "tiers": [
            {
                "tier": _tier_name(t.tier),
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "blocks": t.num_blocks,
                "occupancy": round(t.occupancy, 4),
            }
            for t in response.tiers
        ],
        "failed_tiers": [_tier_name(t) for t in response.failed_tiers],
        "blocks": response.num_blocks,
        "namespaces": response.num_namespaces,
        "leases": response.num_leases,
        "reservations": response.num_reservations,
        "sessions": response.num_sessions,
        "counters": dict(sorted(response.counters.items())),
        "problems": list(response.problems),  # why health says NOT_SERVING
    }


def _print_stats(document: dict, with_counters: bool = True) -> None:
    click.echo(
        f"node {document['node_id']}  up {document['uptime_s']:.0f} s  {document['blocks']} blocks in {document['namespaces']} namespaces"
    )
    _table(
        ["tier", "used", "capacity", "occupancy", "blocks"],
        [[t["tier"], _size(t["used_bytes"]), _size(t["capacity_bytes"]), f"{t['occupancy']:.1%}", t["blocks"]] for t in document["tiers"]],
    )
    if document["failed_tiers"]:
        click.echo(f"FAILED tiers (out of service until restart): {', '.join(document['failed_tiers'])}")
    click.echo(f"leases {document['leases']}  reservations {document['reservations']}  sessions {document['sessions']}")
    for line in _engine_lines(document["counters"]):
        click.echo(line)
    if with_counters:  # `kvstore stats`; `status` stops at the tiers (its --json has the counters too)
        click.echo("counters")
        for name, value in document["counters"].items():
            click.echo(f"  {name:<32} {value}")


def _engine_lines(counters: dict[str, int]) -> list[str]:
    """A line per engine whose KV events the daemon subscribes to (kvstore/engines.py's counters)."""
    names = [key[len("engine_") : -len("_connected")] for key in counters if key.startswith("engine_") and key.endswith("_connected")]
    lines = []
    for name in names:
        row = {field: counters.get(f"engine_{name}_{field}", 0) for field in ("connected", "batches", "gaps", "batches_lost", "blocks")}
        age_ms = counters.get(f"engine_{name}_last_event_age_ms", -1)
        age = "no event yet" if age_ms < 0 else f"last event {age_ms / 1000:.1f} s ago"
        lines.append(
            f"engine {name}: {'connected' if row['connected'] else 'NOT connected'}, {row['blocks']} GPU blocks indexed, "
            f"{row['batches']} batches, {row['gaps']} gaps ({row['batches_lost']} batches lost), {age}"
        )
    return lines


@main.command()
@click.pass_obj
@_guarded
def status(ctx: Context) -> None:
    """Is the daemon serving? Node, uptime and tier occupancy."""
    with ctx.client() as client:
        serving = client.health()
        document = {"status": serving, **_stats_document(client)}
    ctx.emit(
        document,
        lambda: (
            click.echo(f"kvstore at {client.address}: {serving}"),
            [click.echo(problem) for problem in document["problems"]],
            _print_stats(document, with_counters=False),
        ),
    )


def _fleet_document(ctx: Context, client) -> dict:
    """Every live daemon's lookup hit rate, the fleet's, and their spread across nodes."""
    from kvstore.api.client import ApiError, connect
    from kvstore.api.v1 import kvstore_pb2 as pb

    nodes = []
    for info in client.index.Nodes(pb.NodesRequest()).nodes:
        if info.kind != "kvstore" or not info.grpc_address:
            continue  # engines' GPU caches answer no stats
        row: dict[str, Any] = {"node_id": info.node_id, "address": info.grpc_address}
        try:
            with connect(info.grpc_address, token=ctx.token) as peer:
                counters = peer.admin.Stats(pb.StatsRequest()).counters
        except ApiError as exc:
            row["error"] = str(exc)
            nodes.append(row)
            continue
        hit, missed = counters.get("lookup_hit_tokens", 0), counters.get("lookup_missed_tokens", 0)
        row.update(hit_tokens=hit, missed_tokens=missed, hit_rate=round(hit / (hit + missed), 4) if hit + missed else None)
        nodes.append(row)
    rates = [n["hit_rate"] for n in nodes if n.get("hit_rate") is not None]
    hit = sum(n.get("hit_tokens", 0) for n in nodes)
    asked = hit + sum(n.get("missed_tokens", 0) for n in nodes)
    mean = sum(rates) / len(rates) if rates else 0.0
    std = (sum((r - mean) ** 2 for r in rates) / len(rates)) ** 0.5 if rates else 0.0
    return {
        "nodes": nodes,
        "fleet_hit_rate": round(hit / asked, 4) if asked else None,
        "hit_rate_std": round(std, 4),
        "hit_rate_cv": round(std / mean, 4) if mean else None,
    }


def _print_fleet(document: dict) -> None:
    _table(
        ["node", "address", "hit rate", "hit tokens", "missed tokens"],
        [
            [
                n["node_id"],
                n["address"],
                "unreachable" if "error" in n else ("-" if n["hit_rate"] is None else f"{n['hit_rate']:.1%}"),
                n.get("hit_tokens", ""),
                n.get("missed_tokens", ""),
            ]
            for n in document["nodes"]
        ],
    )
    fleet = document["fleet_hit_rate"]
    cv = document["hit_rate_cv"]
    click.echo(
        f"fleet hit rate {'-' if fleet is None else f'{fleet:.1%}'}; spread across nodes: std {document['hit_rate_std']:.3f}, "
        f"CV {'-' if cv is None else f'{cv:.3f}'}"
    )


def _print_router(document: dict) -> None:
    columns = ["replica", "requests", "prompt tokens", "prefill tokens", "hit rate", "TTFT p50", "TTFT p99"]
    rows = []
    for node_id, r in document["replicas"].items():
        rate = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        ttft = [f"{r[k]:.3f} s" if r.get(k) is not None else "-" for k in ("ttft_p50_s", "ttft_p99_s")]
        rows.append([node_id, r["requests"], r["prompt_tokens"], r["prefill_tokens"], rate, *ttft])
    click.echo("router:")
    _table(columns, rows)
    cv = document["hit_rate_cv"]
    click.echo(f"hit-rate spread across replicas: std {document['hit_rate_std']:.3f}, CV {'-' if cv is None else f'{cv:.3f}'}")
    click.echo(f"decisions {document['decisions']}  session moves {document['session_moves']}")
    causes = {node_id: r.get("causes", {}) for node_id, r in document["replicas"].items()}
    if any(causes.values()):
        from kvstore.gateway.metrics import MISS_CAUSES

        names = [c for c in MISS_CAUSES if any(by.get(c) for by in causes.values())]
        click.echo("prefill tokens by why they were not cached:")
        _table(["replica", *names], [[node_id, *(by.get(c, 0) for c in names)] for node_id, by in causes.items()])
    if document.get("diverged_turns"):
        click.echo(f"session turns that broke their prefix, by the part that changed: {document['diverged_turns']}")
    if document["tenants"]:
        columns = ["tenant", "prompt tokens", "prefill tokens", "cached tokens", "cache bytes held", "cache blocks"]
        rows = [
            [name, t["prompt_tokens"], t["prefill_tokens"], t["cached_tokens"], _size(t["cache_bytes"]), t["cache_blocks"]]
            for name, t in document["tenants"].items()
        ]
        _table(columns, rows)


@main.command()
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="print again every SECONDS until interrupted.")
@click.option("--fleet", is_flag=True, help="every live node in the index: hit rate per node, the fleet's, and its spread.")
@click.option("--router", "router_url", metavar="URL", help="with --fleet: also the figures of the kvstore router at URL.")
@click.pass_obj
@_guarded
def stats(ctx: Context, watch: float | None, fleet: bool, router_url: str | None) -> None:
    """Counters and occupancy of the daemon (or of the fleet)."""
    if router_url and not fleet:
        _fail("--router goes with --fleet.", EXIT_USAGE)
    with ctx.client() as client:
        while True:
            if fleet:
                document = _fleet_document(ctx, client)
                if router_url:
                    from kvstore.gateway.summary import fetch_router_summary

                    document["router"] = fetch_router_summary(router_url)

                def human(document=document) -> None:
                    _print_fleet(document)
                    if "router" in document:
                        _print_router(document["router"])

                ctx.emit(document, human)
            else:
                document = _stats_document(client)
                ctx.emit(document, functools.partial(_print_stats, document))
            if watch is None:
                return
            try:
                time.sleep(watch)
            except KeyboardInterrupt:
                return
            if not ctx.as_json:
                click.echo()


def _router_get(router_url: str, path: str, key: str | None, timeout_s: float = 10.0) -> Any:
    """A GET of the router's JSON API; exits with the router's sentence on an error."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{router_url.rstrip('/')}{path}", headers={"authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {exc.code}"
        _fail(message, EXIT_UNAUTHENTICATED if exc.code == 401 else EXIT_REJECTED)
    except OSError as exc:
        _fail(f"the router at {router_url} does not answer ({exc}); is `kvstore router` running there?", EXIT_UNREACHABLE)


_ROUTER_URL = click.option(
    "--router", "router_url", default="http://127.0.0.1:8000", show_default=True, envvar="KVSTORE_ROUTER", help="the kvstore router's URL."
)
_ROUTER_KEY = click.option("--key", envvar="KVSTORE_ROUTER_KEY", help="an API key of the router's: its tenant's sessions alone.")


@main.group(invoke_without_command=True)
@_ROUTER_URL
@_ROUTER_KEY
@click.option("--tenant", help="only this tenant's sessions (a router without API keys).")
@click.pass_context
def sessions(click_ctx: click.Context, router_url: str, key: str | None, tenant: str | None) -> None:
    """The agent sessions the router keeps: turns, cached and computed tokens, and the turns
    whose prompt did not extend the previous one (`kvstore sessions show ID` says where)."""
    click_ctx.obj.router = (router_url, key)
    if click_ctx.invoked_subcommand is not None:
        return
    query = f"?tenant={urllib.parse.quote(tenant)}" if tenant else ""
    rows = _router_get(router_url, f"/kvstore/sessions{query}", key)["sessions"]
    ctx: Context = click_ctx.obj
    if ctx.as_json:
        click.echo(json.dumps({"sessions": rows}, sort_keys=True))
        return
    columns = ["session", "tenant", "turns", "replica", "prompt tokens", "cached", "prefill", "divergences", "tokens lost"]
    _table(
        columns,
        [
            [r["session"], r["tenant"], r["turns"], r["replica"], r["prompt_tokens"], r["cached_tokens"], r["prefill_tokens"]]
            + [r["divergences"], r["lost_tokens"]]
            for r in rows
        ],
    )


@sessions.command(name="show")
@click.argument("session_id")
@click.pass_obj
def sessions_show(ctx: Context, session_id: str) -> None:
    """One session's turns: per turn its replica, tokens, the computed tokens by cause, and
    where its prompt diverged from the previous turn's (position, tokens lost, the part of
    the conversation, the token ids around the point; their text where the router's
    router.session_text allows)."""
    router_url, key = ctx.router
    document = _router_get(router_url, f"/kvstore/sessions/{urllib.parse.quote(session_id, safe='')}", key)
    if ctx.as_json:
        click.echo(json.dumps(document, sort_keys=True))
        return
    click.echo(f"session {document['session']} (tenant {document['tenant']})")
    rows = []
    for turn in document["turns"]:
        causes = ", ".join(f"{cause} {n}" for cause, n in turn["causes"].items() if n) or "-"
        divergence = turn.get("divergence")
        where = "extends the previous turn" if divergence is None else f"diverged at token {divergence['at']} in {divergence['part']}"
        if divergence is not None:
            where += f", {divergence['lost_tokens']} tokens lost"
        rows.append([turn["number"], turn["replica"], turn["prompt_tokens"], turn["cached_tokens"], causes, where])
    _table(["turn", "replica", "prompt tokens", "cached", "computed by cause", "prefix"], rows)
    for turn in document["turns"]:
        divergence = turn.get("divergence")
        if divergence is None:
            continue
        click.echo(f"turn {turn['number']}: before {divergence['before']} after {divergence['after']}")
        if divergence.get("before_text") is not None:
            click.echo(f"  before {divergence['before_text']!r}\n  after  {divergence['after_text']!r}")


@main.command(name="ls")
@click.option("--namespace", help="only this namespace (32 hex digits).")
@click.option("--tier", type=click.Choice(_TIERS), help="only blocks in this tier.")
@click.option("--min-idle", type=float, help="only blocks unused for at least this many seconds.")
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True, help="blocks per page.")
@click.option("--page-token", default="", help="continue from a previous page.")
@click.pass_obj
@_guarded
def list_blocks(ctx: Context, namespace: str | None, tier: str | None, min_idle: float | None, limit: int, page_token: str) -> None:
    """List cached blocks, oldest first."""
    from kvstore.api.v1 import kvstore_pb2 as pb

    request = pb.ListBlocksRequest(namespace_id=_namespace_id(namespace), page_size=limit, page_token=page_token)
    if tier is not None:
        request.tier = _tier_proto(tier)
    if min_idle is not None:
        request.min_idle_s = min_idle
    with ctx.client() as client:
        response = client.admin.ListBlocks(request)
    blocks = [
        {"namespace": b.namespace_id.hex(), "hash": b.block_hash.hex(), "parent": b.parent_hash.hex(), "tier": _tier_name(b.tier),
         "nbytes": b.nbytes, "age_s": round(b.age_s, 3), "idle_s": round(b.idle_s, 3), "pinned": b.pinned, "leases": b.leases}
        for b in response.blocks
    ]  # fmt: skip
    document = {"blocks": blocks, "total": response.total, "next_page_token": response.next_page_token}

    def human() -> None:
        _table(
            ["namespace", "hash", "tier", "size", "idle s", "pinned"],
            [
                [b["namespace"][:12], b["hash"], b["tier"], _size(b["nbytes"]), f"{b['idle_s']:.1f}", "yes" if b["pinned"] else ""]
                for b in blocks
            ],
        )
        more = f"; next page: --page-token {response.next_page_token}" if response.next_page_token else ""
        click.echo(f"{len(blocks)} of {response.total} blocks{more}")

    ctx.emit(document, human)


def _read_tokens(path: Path) -> list[int]:
    text = path.read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise click.BadParameter(
            f"{path} must hold token ids: a JSON list or whitespace-separated integers ({exc}).", param_hint="--tokens"
        ) from None
    if not all(isinstance(v, int) for v in values):
        raise click.BadParameter(f"{path} must hold integer token ids only.", param_hint="--tokens")
    return values


@main.command()
@click.option("--namespace", required=True, help="namespace id (32 hex digits).")
@click.option(
    "--tokens",
    "tokens_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="file of token ids (JSON list or whitespace-separated).",
)
@click.argument("hashes", nargs=-1)
@click.pass_obj
@_guarded
def lookup(ctx: Context, namespace: str, tokens_file: Path | None, hashes: tuple[str, ...]) -> None:
    """How much of a prompt's prefix is cached, and in which tiers."""
    from kvstore.api.v1 import kvstore_pb2 as pb

    if (tokens_file is None) == (not hashes):
        raise click.UsageError("give either --tokens FILE or block hashes, not both and not neither.")
    request = pb.LookupRequest(namespace_id=_namespace_id(namespace))
    if tokens_file is not None:
        request.token_ids.ids.extend(_read_tokens(tokens_file))
    else:
        request.block_hashes.hashes.extend(_hex_list(hashes, "HASHES"))
    with ctx.client() as client:
        response = client.store.Lookup(request)
    document = {
        "matched_blocks": response.matched_blocks,
        "matched_tokens": response.matched_tokens,
        "tiers": {_tier_name(c.tier): c.blocks for c in response.tier_counts},
    }
    ctx.emit(
        document,
        lambda: click.echo(
            f"{response.matched_blocks} blocks ({response.matched_tokens} tokens) cached: "
            + ", ".join(f"{k} {v}" for k, v in document["tiers"].items())
        ),
    )


@main.command()
@click.option("--namespace", help="only this namespace (32 hex digits).")
@click.option("--tier", type=click.Choice(_TIERS), help="only blocks in this tier.")
@click.option("--min-idle", type=float, help="only blocks unused for at least this many seconds.")
@click.option("--all", "evict_all", is_flag=True, help="every block (required when no filter is given).")
@click.argument("hashes", nargs=-1)
@click.pass_obj
@_guarded
def evict(ctx: Context, namespace: str | None, tier: str | None, min_idle: float | None, evict_all: bool, hashes: tuple[str, ...]) -> None:
    """Drop blocks; leased and pinned blocks are skipped."""
    from kvstore.api.v1 import kvstore_pb2 as pb

    if hashes and not namespace:
        raise click.UsageError("evicting by hash needs --namespace.")
    request = pb.EvictRequest(namespace_id=_namespace_id(namespace), block_hashes=_hex_list(hashes, "HASHES"), all=evict_all)
    if tier is not None:
        request.tier = _tier_proto(tier)
    if min_idle is not None:
        request.min_idle_s = min_idle
    with ctx.client() as client:
        response = client.admin.Evict(request)
    document = {"evicted": response.evicted, "skipped": response.skipped}
    ctx.emit(document, lambda: click.echo(f"evicted {response.evicted} blocks; skipped {response.skipped} (leased or pinned)"))


def _pin_command(name: str, rpc: str, verb: str):
    @main.command(
        name=name, help=f"{name.capitalize()} blocks (by hash) so that eviction {'skips them' if name == 'pin' else 'may take them again'}."
    )
    @click.option("--namespace", required=True, help="namespace id (32 hex digits).")
    @click.argument("hashes", nargs=-1, required=True)
    @click.pass_obj
    @_guarded
    def command(ctx: Context, namespace: str, hashes: tuple[str, ...]) -> None:
        from kvstore.api.v1 import kvstore_pb2 as pb

        request_type = pb.PinRequest if name == "pin" else pb.UnpinRequest
        with ctx.client() as client:
            response = getattr(client.admin, rpc)(
                request_type(namespace_id=_namespace_id(namespace), block_hashes=_hex_list(hashes, "HASHES"))
            )
        ctx.emit({verb: response.count}, lambda: click.echo(f"{verb} {response.count} of {len(hashes)} blocks"))

    return command


_pin_command("pin", "Pin", "pinned")
_pin_command("unpin", "Unpin", "unpinned")


def _move_summary(verb: str, document: dict) -> str:
    peers = ", ".join(f"{node} {count}" for node, count in sorted(document.get("blocks_by_peer", {}).items())) or "none"
    return (
        f"{verb} {document.get('moved_blocks', 0)} blocks ({document.get('moved_bytes', 0)} bytes); "
        f"{document.get('remaining_blocks', 0)} left behind; by peer: {peers}; "
        f"sessions moved: {document.get('sessions_moved', 0)}"
    )


@main.command()
@click.option("--to", "targets", multiple=True, help="peer node ids to move blocks to (default: any with room).")
@click.option("--max-bytes", type=int, default=0, help="stop after moving this many bytes (0: no limit).")
@click.option("--plan", "show_plan", is_flag=True, help="rank the fleet's nodes, cheapest to lose first; drain nothing.")
@click.option("--auto", "auto", is_flag=True, help="drain the node --plan ranks cheapest (whichever it is), and say why.")
@click.option(
    "--half-life",
    type=float,
    metavar="SECONDS",
    help="with --plan/--auto: the half-life of a block's weight by idle time (default: each daemon's, 600 s unless configured).",
)
@click.option(
    "--router",
    "router_url",
    metavar="URL",
    help="with --plan/--auto: the plan of the kvstore router at URL, which weighs live sessions too.",
)
@click.option("--key", envvar="KVSTORE_ROUTER_KEY", help="with --router: an API key of the router's, where it has keys.")
@click.option(
    "--timeout",
    type=click.FloatRange(0.1, 60),
    default=10.0,
    show_default=True,
    help="with --plan/--auto: seconds each daemon has to answer; one that does not is listed as unknown.",
)
@click.pass_obj
@_guarded
def drain(
    ctx: Context,
    targets: tuple[str, ...],
    max_bytes: int,
    show_plan: bool,
    auto: bool,
    half_life: float | None,
    router_url: str | None,
    key: str | None,
    timeout: float,
) -> None:
    """Copy this node's most valuable blocks to peers and move its sessions, before it is removed.

    --plan ranks the fleet's nodes by what the fleet would lose with each: the bytes of the
    blocks no other daemon holds, each weighted by 2^(-idle/half-life) (pinned blocks whole),
    plus, with --router, the context of the live sessions the router placed there. --auto
    drains the cheapest known node (not necessarily the one at --address); a node that does
    not answer is listed as unknown and never chosen.
    """
    from kvstore.api.v1 import kvstore_pb2 as pb

    if show_plan and auto:
        raise click.UsageError("give --plan (rank the nodes) or --auto (drain the cheapest), not both.")
    planning = show_plan or auto
    if not planning:
        given = [name for name, value in (("--half-life", half_life), ("--router", router_url), ("--key", key)) if value is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} goes with --plan or --auto.")
        with ctx.client() as client:
            response = client.admin.Drain(pb.DrainRequest(target_node_ids=list(targets), max_bytes=max_bytes))
        document = _message_document(response)
        ctx.emit(document, lambda: click.echo(_move_summary("moved", document)))
        return
    if show_plan and (targets or max_bytes):
        raise click.UsageError("--plan drains nothing: --to and --max-bytes go with --auto or a plain drain.")
    if key and not router_url:
        raise click.UsageError("--key goes with --router.")
    if half_life is not None:
        from kvstore.cache_value import check_half_life

        try:
            check_half_life(half_life)
        except KVStoreError as exc:
            raise click.BadParameter(str(exc), param_hint="--half-life") from None
    plan = _drain_plan(ctx, half_life, router_url, key, timeout)
    if show_plan:
        ctx.emit(plan, lambda: _print_plan(plan))
        return
    chosen = next((n for n in plan["nodes"] if n["node_id"] == plan["cheapest"]), None)
    if chosen is None:
        _fail(f"no node to drain: {plan['reason']}", EXIT_REJECTED)
    if not chosen["address"]:
        _fail(f"{chosen['node_id']} is the cheapest to lose, but the plan names no gRPC address to ask it to drain.", EXIT_REJECTED)
    from kvstore.api.client import connect

    with connect(chosen["address"], token=ctx.token) as client:
        response = client.admin.Drain(pb.DrainRequest(target_node_ids=list(targets), max_bytes=max_bytes))
    report = _message_document(response)
    document = {"drained": chosen["node_id"], "address": chosen["address"], "reason": plan["reason"], "report": report, "plan": plan}
    ctx.emit(
        document,
        lambda: click.echo(f"drained {chosen['node_id']} ({chosen['address']}): {plan['reason']}\n{_move_summary('moved', report)}"),
    )


def _drain_plan(ctx: Context, half_life: float | None, router_url: str | None, key: str | None, timeout: float) -> dict:
    """The plan as JSON (kvstore/scaledown.py): the router's, or built from the daemons the
    index of the daemon at --address lists, each asked for its cache value."""
    if router_url:
        query = {"timeout_s": timeout} | ({"half_life_s": half_life} if half_life is not None else {})
        return _router_get(router_url, f"/kvstore/drain-plan?{urllib.parse.urlencode(query)}", key, timeout + 10)
    from kvstore.api.cache_values import daemon_standings
    from kvstore.api.v1 import kvstore_pb2 as pb
    from kvstore.scaledown import plan_document, rank

    with ctx.client() as client:
        nodes = list(client.index.Nodes(pb.NodesRequest()).nodes)
    return plan_document(rank(daemon_standings(nodes, ctx.token, half_life, timeout)), half_life)


def _print_plan(plan: dict) -> None:
    rows = []
    for node in plan["nodes"]:
        if not node["known"]:
            rows.append([node["node_id"], "unknown", "", "", "", "", node["address"] or "-", node["error"]])
            continue
        live = "-" if node["live_bytes"] is None else _size(node["live_bytes"])
        blocks = f"{node['unique_blocks']}/{node['total_blocks']}"
        rows.append([node["node_id"], _size(node["cost_bytes"]), _size(node["value_bytes"]), _size(node["unique_bytes"]), blocks, live])
        rows[-1] += [node["address"], ""]
    _table(["node", "cost", "cache value", "unique", "unique blocks", "live sessions", "address", "not known because"], rows)
    click.echo(plan["reason"])
    for note in plan["notes"]:
        click.echo(f"note: {note}")


@main.command()
@click.option("--from", "sources", multiple=True, help="peer node ids to warm from (default: every live peer).")
@click.option("--max-bytes", type=int, default=0, help="stop after fetching this many bytes (0: no limit).")
@click.pass_obj
@_guarded
def warm(ctx: Context, sources: tuple[str, ...], max_bytes: int) -> None:
    """Fetch the fleet's hottest shared prefixes into this node."""
    from kvstore.api.v1 import kvstore_pb2 as pb

    with ctx.client() as client:
        response = client.admin.Warm(pb.WarmRequest(source_node_ids=list(sources), max_bytes=max_bytes))
    document = _message_document(response)
    ctx.emit(document, lambda: click.echo(_move_summary("fetched", document)))


def _message_document(response) -> dict:
    document = {field.name: value for field, value in response.ListFields()}
    if "blocks_by_peer" in document:
        document["blocks_by_peer"] = dict(document["blocks_by_peer"])
    return document


@main.command()
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="KVSTORE_CONFIG",
    help="TOML file with a [router] section.",
)
@click.option("--host", help="address to listen on (router.host).")
@click.option("--port", type=int, help="port to listen on (router.port).")
@click.option(
    "--index", help='the redis:// index the replicas\' daemons publish to, or "daemons" on one host without Redis (router.index).'
)
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    metavar="URL=NODE_ID[@DAEMON]",
    help="an engine replica, its daemon's node id and, with --index daemons, that daemon's gRPC host:port (repeatable).",
)
@click.option("--set", "settings", multiple=True, metavar="FIELD=VALUE", help="override one router.FIELD setting (repeatable).")
def router(
    config_path: Path | None, host: str | None, port: int | None, index: str | None, replicas: tuple[str, ...], settings: tuple[str, ...]
) -> None:
    """Run the OpenAI-compatible HTTP router in front of engine replicas (until SIGTERM).

    It serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics,
    sends each request to the replica whose cache holds most of its prefix (the cost
    model of `Index.Route`), keeps sessions on their replica, and retries another when
    one fails before answering. Needs the [router] extra (pip install 'kvstore[router]').

    Scale up or down without a restart: edit the [[router.replicas]] of the --config
    file and send the router SIGHUP (kill -HUP PID). It reads the file again (with this
    command line's --replica and --set over it), adopts the replica list, and logs what
    changed: a new replica enters rotation at its first passing health check, a removed
    one leaves at once (its sessions move at their next request). Other settings take a
    restart. A file that does not load is refused, logged, and the running list kept.
    kvstore_router_config_reloads_total{result} and
    kvstore_router_config_last_reload_successful on /metrics say how it went.

    One host without Redis: --index daemons (router.index = "daemons"), each replica
    naming its daemon (daemon = "127.0.0.1:50551", and daemon_token when the daemon has
    a server.auth_token), each daemon with index.backend = "embedded". The router asks
    the candidates' daemons for their cached prefix, under router.daemon_timeout_s a
    call (one that does not answer holds nothing), and keeps sessions in its memory:
    run one router replica so; several that share sessions need a redis:// index.

    Multi-tenant: API keys in router.api_keys_file (or KVSTORE_ROUTER_API_KEYS,
    tenant:key,…) name each request's tenant; a request without a known key gets an
    OpenAI 401. --set salt_from_tenant=true (with KVSTORE_ROUTER_SALT_SECRET) sets each
    request's cache_salt from its tenant, so tenants never share KV.
    """
    try:
        from kvstore.gateway import ReplicaConfig, load_router_config, run_router
        from kvstore.gateway.config import DAEMONS_INDEX
    except ImportError as exc:
        _fail(f"the router needs its extra: pip install 'kvstore[router]' ({exc}).", EXIT_USAGE)
    overrides: dict[str, Any] = {}
    for pair in settings:
        name, sep, value = pair.partition("=")
        if not sep:
            _fail(f"--set expects FIELD=VALUE (a router setting), got {pair!r}.", EXIT_USAGE)
        overrides[name.strip().removeprefix("router.")] = value
    for name, value in (("host", host), ("port", port), ("index", index)):
        if value is not None:
            overrides[name] = value
    try:
        given = []
        for pair in replicas:
            url, sep, named = pair.rpartition("=")
            if not sep:
                _fail(f"--replica expects URL=NODE_ID or URL=NODE_ID@DAEMON, got {pair!r}.", EXIT_USAGE)
            node_id, _at, daemon = named.partition("@")
            given.append(ReplicaConfig(url, node_id, daemon=daemon))
        config = load_router_config(config_path, overrides, given)
    except KVStoreError as exc:
        _fail(str(exc), EXIT_USAGE)
    click.echo(f"kvstore router on http://{config.host}:{config.port} in front of {', '.join(r.url for r in config.replicas)}", err=True)
    if config.index == DAEMONS_INDEX:
        click.echo(
            "kvstore router: asking each replica's daemon for its cached prefix; sessions live in this router's memory "
            "(one router replica; several that share sessions need a redis:// index).",
            err=True,
        )
    run_router(config, functools.partial(load_router_config, config_path, overrides, given) if config_path is not None else None)


if __name__ == "__main__":
    main()
