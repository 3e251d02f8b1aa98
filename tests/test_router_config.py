"""The router's pure parts: its configuration, session ids, tenant labels, and the Grafana
dashboard against the metrics the router exposes. (Real engines: test_router_http.py.)"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner
from prometheus_client import generate_latest

from kvstore.cli import main
from kvstore.config import ConfigError, load_config
from kvstore.gateway.config import ReplicaConfig, load_router_config, replica_changes
from kvstore.gateway.metrics import OTHER_TENANT, RouterMetrics, TenantLabels
from kvstore.gateway.prompts import BadRequest, prompt_token_ids, session_of, tokenize_request, tokens_digest
from kvstore.gateway.reload import ConfigReload
from kvstore.gateway.replicas import Replica, ReplicaSet, engine_queue
from kvstore.gateway.summary import histogram_quantile, router_summary
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

DASHBOARD = Path(__file__).resolve().parents[1] / "kvstore" / "gateway" / "grafana_dashboard.json"
CONFIG = """
[server]
node_id = "host-1"

[router]
port = 9001
index = "redis://127.0.0.1:6379/0"
session_header = "x-agent-session"
max_body_bytes = "2MiB"

[router.namespace]
model_id = "/models/tiny"
num_layers = 2
num_kv_heads = 2
head_dim = 64
dtype = "bfloat16"
block_size = 32

[[router.replicas]]
url = "http://10.0.0.1:8000"
node_id = "gpu-1"

[routing]
margin_s = 1.5
"""


def test_the_router_reads_its_section_and_the_daemon_skips_it(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text(CONFIG)
    config = load_router_config(path, {"port": "9002"}, [ReplicaConfig("http://10.0.0.2:8000", "gpu-2")])
    assert (config.port, config.session_header, config.max_body_bytes) == (9002, "x-agent-session", 2 * 1024**2)
    assert (config.tenant_cache_interval_s, config.tenant_cache_chains, config.tenant_cache_blocks) == (15.0, 64, 32_768)
    assert [r.node_id for r in config.replicas] == ["gpu-1", "gpu-2"]
    assert config.routing.margin_s == 1.5 and config.routing.remote_fetch is False
    # the namespace the vLLM connector registers for this model (HND planes, rank 0 of 1)
    assert config.namespace.digest == Namespace("/models/tiny", KVLayout(2, 2, 64, 32, "bfloat16", 2, "HND")).digest
    assert load_config(path, environ={}).server.node_id == "host-1"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"index": "embedded"}, 'or "daemons" on one host'),
        ({"max_attempts": "0"}, "router.max_attempts"),
        ({"no_such_setting": "1"}, "unknown setting router.no_such_setting"),
        ({"session_header": "X-Session"}, "lower-case"),
        ({"tenant_cache_interval_s": "0"}, "router.tenant_cache_interval_s must be a positive number of seconds, got 0.0."),
        ({"tenant_cache_chains": "-1"}, "router.tenant_cache_chains must be positive, got -1."),
        ({"tenant_cache_blocks": "ten"}, "router.tenant_cache_blocks must be a number, got 'ten'."),
        ({"tenant_cache_blocks": str(2**18 + 1)}, "router.tenant_cache_blocks must be at most 262144"),
    ],
)
def test_bad_router_settings_are_named(tmp_path, change, words):
    path = tmp_path / "kvstore.toml"
    path.write_text(CONFIG)
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_router_config(path, change)


def test_a_namespace_without_its_geometry_and_duplicate_replicas_are_refused(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text(CONFIG.replace("head_dim = 64\n", ""))
    with pytest.raises(ConfigError, match="head_dim"):
        load_router_config(path)
    path.write_text(CONFIG)
    with pytest.raises(ConfigError, match="node_id must be unique"):
        load_router_config(path, replicas=[ReplicaConfig("http://10.0.0.9:8000", "gpu-1")])


def test_a_replicas_cache_size_is_read_as_a_size_and_a_bad_one_is_named(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text(CONFIG.replace('node_id = "gpu-1"', 'node_id = "gpu-1"\ncache_bytes = "2GiB"'))
    assert load_router_config(path).replicas[0].cache_bytes == 2 * 1024**3
    path.write_text(CONFIG)
    assert load_router_config(path).replicas[0].cache_bytes == 0  # not told: no pressure term
    for bad, words in (('"lots"', "cache_bytes must be a size"), ("-1", "gpu-1's cache_bytes must be a size >= 0")):
        path.write_text(CONFIG.replace('node_id = "gpu-1"', f'node_id = "gpu-1"\ncache_bytes = {bad}'))
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_router_config(path)


ONE_HOST = CONFIG.replace('index = "redis://127.0.0.1:6379/0"', 'index = "daemons"\ndaemon_timeout_s = 0.25').replace(
    'node_id = "gpu-1"', 'node_id = "gpu-1"\ndaemon = "127.0.0.1:50551"\ndaemon_token = "s3cret"'
)


def test_one_host_without_redis_names_each_replicas_daemon(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text(ONE_HOST)
    config = load_router_config(path, replicas=[ReplicaConfig("http://10.0.0.2:8000", "gpu-2", daemon="localhost:50552")])
    assert (config.index, config.daemon_timeout_s) == ("daemons", 0.25)
    assert [(r.node_id, r.daemon, r.daemon_token) for r in config.replicas] == [
        ("gpu-1", "127.0.0.1:50551", "s3cret"),
        ("gpu-2", "localhost:50552", ""),
    ]
    assert load_router_config(path, {"daemon_timeout_s": "2"}).daemon_timeout_s == 2.0
    # the command line's --replica URL=NODE_ID@DAEMON
    result = CliRunner().invoke(main, ["router", "--index", "daemons", "--replica", "http://10.0.0.1:8000=gpu-1@127.0.0.1:0"])
    assert result.exit_code == 2 and "replica gpu-1's daemon must be the host:port" in result.output


@pytest.mark.parametrize(
    "text, replicas, words",
    [
        (
            ONE_HOST,
            [ReplicaConfig("http://10.0.0.2:8000", "gpu-2")],
            'router.index = "daemons" asks each replica\'s daemon, but replica gpu-2 names none: give it daemon = "HOST:PORT"',
        ),
        (ONE_HOST.replace('"127.0.0.1:50551"', '"127.0.0.1"'), [], "replica gpu-1's daemon must be the host:port of its daemon's gRPC API"),
        (ONE_HOST.replace('"127.0.0.1:50551"', '"http://127.0.0.1:50551"'), [], "replica gpu-1's daemon must be the host:port"),
        (ONE_HOST.replace('"127.0.0.1:50551"', '"127.0.0.1:70000"'), [], "got '127.0.0.1:70000'"),
        (ONE_HOST.replace('daemon = "127.0.0.1:50551"', ""), [], "replica gpu-1 has a daemon_token but no daemon address"),
        (ONE_HOST.replace("daemon_timeout_s = 0.25", "daemon_timeout_s = 0"), [], "router.daemon_timeout_s must be a positive number"),
    ],
)
def test_one_host_settings_that_cannot_work_are_named(tmp_path, text, replicas, words):
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_router_config(path, replicas=replicas)


GPU_2 = """
[[router.replicas]]
url = "http://10.0.0.2:8000"
node_id = "gpu-2"
"""


class Reloadable:
    """A router's configuration file, its replica set and metrics, and the SIGHUP reload over them."""

    def __init__(self, path: Path, text: str = CONFIG) -> None:
        self.path = path
        path.write_text(text)
        self.config = load_router_config(path)
        self.metrics = RouterMetrics([r.node_id for r in self.config.replicas], max_tenants=4)
        self.replicas = ReplicaSet.of(self.config.replicas, self.metrics)
        self.reload = ConfigReload(functools.partial(load_router_config, path), self.replicas, self.metrics)

    def sighup(self, text: str) -> None:
        self.path.write_text(text)
        self.config = self.reload(self.config)

    def value(self, name: str, **labels) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


def test_a_reload_adds_the_files_new_replica_out_of_rotation_and_keeps_the_running_ones(tmp_path, caplog):
    router = Reloadable(tmp_path / "kvstore.toml")
    gpu_1 = router.replicas.replicas["gpu-1"]
    gpu_1.healthy, gpu_1.in_flight = True, 2
    caplog.set_level("INFO", logger="kvstore.router")
    router.sighup(CONFIG.replace("port = 9001", "port = 9005") + GPU_2)
    assert [r.node_id for r in router.config.replicas] == ["gpu-1", "gpu-2"]
    assert router.config.port == 9001  # the socket it listens on takes a restart
    assert router.replicas.replicas["gpu-1"] is gpu_1 and gpu_1.in_flight == 2  # its state and its load stay
    assert [c.node_id for c in router.replicas.candidates(set())] == ["gpu-1"]  # gpu-2 once its health check passes
    # the new replica's series exist at once, and its requests count in the hit rates' spread
    assert router.value("kvstore_router_replica_healthy", replica="gpu-2") == 0
    assert router.value("kvstore_router_in_flight", replica="gpu-2") == 0
    router.metrics.usage("gpu-2", "t", 100, 50)
    assert router.value("kvstore_router_hit_rate", replica="gpu-2") == 0.5
    assert router.value("kvstore_router_hit_rate_spread", stat="std") == pytest.approx(0.25)
    assert router.value("kvstore_router_config_reloads_total", result="applied") == 1
    assert router.value("kvstore_router_config_last_reload_successful") == 1
    assert "configuration reloaded: added gpu-2; router.port changed too, which takes a restart" in caplog.text


def test_a_reload_takes_a_removed_replica_out_and_a_moved_one_back_to_unchecked(tmp_path):
    router = Reloadable(tmp_path / "kvstore.toml", CONFIG + GPU_2)
    for replica in router.replicas.replicas.values():
        replica.healthy = True
    gpu_1, gpu_2 = router.replicas.replicas["gpu-1"], router.replicas.replicas["gpu-2"]
    gpu_1.in_flight = 1
    before = router.config
    moved = CONFIG.split("[[router.replicas]]")[0] + GPU_2.replace("10.0.0.2", "10.0.0.3") + "[routing]\nmargin_s = 1.5\n"
    router.sighup(moved)
    changes = replica_changes(before, load_router_config(router.path))
    assert (changes.added, changes.removed, changes.changed, changes.not_applied) == ((), ("gpu-1",), ("gpu-2",), ())
    assert [r.url for r in router.config.replicas] == ["http://10.0.0.3:8000"]
    assert router.replicas.candidates(set()) == []  # gpu-2 at its new url: checked before it serves
    assert router.replicas.replicas["gpu-2"] is not gpu_2 and not router.replicas.serves(gpu_2)
    for gauge in ("kvstore_router_replica_healthy", "kvstore_router_in_flight", "kvstore_router_hit_rate"):
        assert router.value(gauge, replica="gpu-1") is None  # a replica that left has no state to show
    # gpu-1's request in flight finishes after the reload: its counters count, its gauges stay gone
    gpu_1.in_flight -= 1
    router.replicas.publish_load(gpu_1)
    router.replicas.mark_down(gpu_1, "connect refused")
    router.metrics.usage("gpu-1", "t", 100, 100)
    assert router.value("kvstore_router_in_flight", replica="gpu-1") is None
    assert router.value("kvstore_router_replica_healthy", replica="gpu-1") is None
    assert router.value("kvstore_router_cached_tokens_total", replica="gpu-1") == 100
    assert router.value("kvstore_router_hit_rate_spread", stat="std") == 0  # gpu-2 alone


@pytest.mark.parametrize(
    "text, words",
    [
        (CONFIG + "[[router.replicas]\n", "is not valid TOML"),
        (CONFIG.split("[[router.replicas]]")[0], "router.replicas is empty"),
        (CONFIG + GPU_2.replace("gpu-2", "gpu-1"), "node_id must be unique"),
        (CONFIG + GPU_2.replace("http://", "tcp://"), "url must be an http:// or https:// URL"),
        (None, "cannot read the configuration file"),
    ],
)
def test_a_reload_of_a_bad_file_is_refused_with_a_sentence_and_the_running_list_kept(tmp_path, caplog, text, words):
    router = Reloadable(tmp_path / "kvstore.toml")
    gpu_1 = router.replicas.replicas["gpu-1"]
    running = router.config
    if text is None:
        router.path.unlink()
        router.config = router.reload(router.config)
    else:
        router.sighup(text)
    assert router.config is running and router.replicas.replicas == {"gpu-1": gpu_1}
    assert router.value("kvstore_router_config_reloads_total", result="refused") == 1
    assert router.value("kvstore_router_config_reloads_total", result="applied") == 0
    assert router.value("kvstore_router_config_last_reload_successful") == 0
    assert "configuration reload refused, the replica list stays gpu-1:" in caplog.text and words in caplog.text
    router.sighup(CONFIG + GPU_2)  # the file fixed: the next SIGHUP applies it
    assert router.value("kvstore_router_config_last_reload_successful") == 1 and len(router.config.replicas) == 2


def test_a_reload_that_switches_the_index_is_refused_while_the_running_index_needs_the_old_list(tmp_path, caplog):
    """router.index takes a restart, so the running one judges the file's replicas: a one-host
    router refuses a list without daemons."""
    for running, text, words in ((ONE_HOST, CONFIG, 'router.index = "daemons" asks each replica\'s daemon, but replica gpu-1 names none'),):
        router = Reloadable(tmp_path / "kvstore.toml", running)
        before = router.config
        router.sighup(text)
        assert router.config is before and router.value("kvstore_router_config_last_reload_successful") == 0
        assert "configuration reload refused, the replica list stays gpu-1:" in caplog.text and words in caplog.text


def test_a_router_started_without_a_file_has_nothing_to_reload(tmp_path, caplog):
    router = Reloadable(tmp_path / "kvstore.toml")  # as if its settings had come from the command line
    assert ConfigReload(None, router.replicas, router.metrics)(router.config) is router.config
    assert "started without --config" in caplog.text
    assert router.value("kvstore_router_config_reloads_total", result="refused") == 0


def test_router_help_and_a_usage_error():
    runner = CliRunner()
    result = runner.invoke(main, ["router", "--help"])
    assert result.exit_code == 0 and "/v1/chat/completions" in result.output and "--replica" in result.output
    assert "SIGHUP" in result.output
    result = runner.invoke(main, ["router", "--index", "redis://x:1/0", "--replica", "no-equals-sign"])
    assert result.exit_code == 2 and "URL=NODE_ID" in result.output


def test_session_ids_come_from_the_header_the_user_or_the_conversation_start():
    system = {"role": "system", "content": "shared system prompt"}
    chat = {"messages": [system, {"role": "user", "content": "task one"}]}
    assert session_of({"x-session-id": "abc"}, "x-session-id", "chat", chat, [], 16).session_id == "h:abc"
    assert session_of({}, "x-session-id", "chat", {**chat, "user": "alice"}, [], 16).source == "user"
    derived = session_of({}, "x-session-id", "chat", chat, [], 16)
    later_turn = {"messages": [*chat["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]}
    other_task = {"messages": [system, {"role": "user", "content": "task two"}]}
    assert session_of({}, "x-session-id", "chat", later_turn, [], 16) == derived  # the same conversation, grown
    assert session_of({}, "x-session-id", "chat", other_task, [], 16) != derived  # only the system prompt shared
    hashes = chain_hashes(list(range(20 * 4)), 4)
    completion = session_of({}, "x-session-id", "completion", {}, hashes, 16)
    assert completion.session_id == f"p:{hashes[15].hex()}"
    assert session_of({}, "x-session-id", "completion", {}, [], 16) is None
    with pytest.raises(BadRequest):
        session_of({"x-session-id": "x" * 1000}, "x-session-id", "chat", chat, [], 16)


def test_what_is_tokenized_for_a_request():
    assert prompt_token_ids("completion", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_token_ids("completion", {"prompt": [[5, 6], [7]]}) == [5, 6]
    assert prompt_token_ids("completion", {"prompt": "text"}) is None
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = tokenize_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "temperature": 0})
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with pytest.raises(BadRequest, match="prompt"):
        tokenize_request("completion", {"model": "m", "prompt": 3})
    assert tokens_digest([1, 2]) != tokens_digest([2, 1])
    assert tokens_digest([1, 2**32 - 1]) == xxhash.xxh64_hexdigest(b"\x01\x00\x00\x00\xff\xff\xff\xff")  # uint32-LE
    for not_ids in ([5, True], [5, 6.0], [5, "6"], [5, None], []):  # the engine judges these, not the router's hashing
        assert prompt_token_ids("completion", {"prompt": not_ids}) is None, not_ids


def test_tenant_labels_are_bounded():
    labels = TenantLabels(2)
    assert [labels.label(t) for t in ("a", "b", "c", "a", "d")] == ["a", "b", OTHER_TENANT, "a", OTHER_TENANT]


def _exposed_metric_names() -> set[str]:
    metrics = RouterMetrics(["r1", "r2"], max_tenants=4)
    metrics.usage("r1", "tenant", 100, 60)  # every labelled family gets a child, so every series is exposed
    metrics.ttft.labels("r1", "true").observe(0.1)
    metrics.requests.labels("r1", "200").inc()
    metrics.expected_cached_tokens.labels("r1").inc(64)
    metrics.decisions.labels("sticky").inc()
    metrics.session_moves.labels("retry").inc()
    metrics.retries.labels("r2", "connect").inc()
    metrics.healthy.labels("r1").set(1)
    metrics.tenant_cache_bytes.labels("tenant").set(1 << 20)
    metrics.tenant_cache_blocks.labels("tenant").set(8)
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_metric_the_grafana_dashboard_queries_exists():
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name for panel in dashboard["panels"] for target in panel["targets"] for name in re.findall(r"\bkvstore_\w+", target["expr"])
    }
    exposed = _exposed_metric_names()
    assert len(queried) >= 12
    assert queried <= exposed, sorted(queried - exposed)
    # the list: TTFT, prompt and computed tokens, hit rate and spread, decisions, moves, tenants
    names = (
        "ttft_seconds_bucket",
        "prefill_tokens_per_request_sum",
        "prefill_tokens_total",  # by cause
        "diverged_turns_total",
        "hit_rate_spread",
        "decisions_total",
        "session_moves_total",
        "tenant_cache_bytes",
    )
    for name in names:
        assert f"kvstore_router_{name}" in queried
    assert "kvstore_router_no_such_metric" not in exposed


def test_hit_rates_per_replica_and_their_spread():
    metrics = RouterMetrics(["r1", "r2"], max_tenants=4)
    metrics.usage("r1", "t", 100, 60)
    metrics.usage("r2", "t", 100, 20)
    metrics.usage("r2", "t", 100, 0)  # r2: 20 of 200
    value = metrics.registry.get_sample_value
    assert value("kvstore_router_hit_rate", {"replica": "r1"}) == pytest.approx(0.6)
    assert value("kvstore_router_hit_rate", {"replica": "r2"}) == pytest.approx(0.1)
    assert value("kvstore_router_hit_rate_spread", {"stat": "std"}) == pytest.approx(0.25)
    assert value("kvstore_router_hit_rate_spread", {"stat": "cv"}) == pytest.approx(0.25 / 0.35)
    assert value("kvstore_router_tenant_prefill_tokens_total", {"tenant": "t"}) == 220


def test_the_engines_own_queue_counts_in_a_replicas_load():
    exposition = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0',
            "vllm:prompt_tokens_total 900.0",
        ]
    )
    assert engine_queue(exposition) == 5
    replica = Replica(ReplicaConfig("http://10.0.0.1:8000", "gpu-1"), healthy=True, in_flight=2, num_prefilling=1)
    assert replica.candidate().active_requests == 1  # only what the router sent
    replica.engine_requests = engine_queue(exposition)
    assert replica.candidate().active_requests == 3  # three more than the router's own two


def test_a_health_check_exports_the_engines_own_queue_and_a_removed_replica_loses_the_series():
    """What the router last read from an engine's /metrics (a real HTTP server) is its gauge
    ``kvstore_router_engine_requests``: the load it prices for traffic that did not pass it."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    exposition = 'vllm:num_requests_running{engine="0"} 3.0\nvllm:num_requests_waiting{engine="0"} 2.0\n'

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            pages = {"/health": b"{}", "/v1/models": json.dumps({"data": [{"id": "m"}]}).encode(), "/metrics": exposition.encode()}
            body = pages.get(self.path, b"")
            self.send_response(200 if self.path in pages else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        metrics = RouterMetrics(["r1"], max_tenants=4)
        replicas = ReplicaSet.of([ReplicaConfig(f"http://127.0.0.1:{server.server_port}", "r1")], metrics)
        value = metrics.registry.get_sample_value
        assert value("kvstore_router_engine_requests", {"replica": "r1"}) == 0  # before its first check

        async def check() -> None:
            async with httpx.AsyncClient() as client:
                await replicas.check(client, 5.0)

        asyncio.run(check())
        assert replicas.replicas["r1"].healthy
        assert value("kvstore_router_engine_requests", {"replica": "r1"}) == 5
        assert replicas.replicas["r1"].candidate().active_requests == 5
        replicas.adopt([])
        assert value("kvstore_router_engine_requests", {"replica": "r1"}) is None
    finally:
        server.shutdown()
        server.server_close()


def test_the_routers_summary_for_stats_fleet():
    metrics = RouterMetrics(["r1", "r2"], max_tenants=4)
    metrics.usage("r1", "t", 1000, 750)
    metrics.requests.labels("r1", "200").inc()
    metrics.requests.labels("none", "400").inc()  # answered by the router itself: no replica's
    for seconds in (0.02, 0.03, 0.04, 0.3):  # buckets 0.025, 0.05, 0.05, 0.5
        metrics.ttft.labels("r1", "false").observe(seconds)
    metrics.decisions.labels("sticky").inc(3)
    metrics.tenant_cache_bytes.labels("t").set(3 * 1024 + 0.5)
    metrics.tenant_cache_blocks.labels("t").set(4)
    metrics.misses("r1", "t", {"new": 100, "diverged": 150, "evicted": 0})
    metrics.diverged("message 3 (assistant)", 150)
    summary = router_summary(generate_latest(metrics.registry).decode())
    assert summary["tenants"] == {
        "t": {
            "prompt_tokens": 1000,
            "prefill_tokens": 250,
            "cached_tokens": 750,
            "cache_bytes": 3 * 1024,
            "cache_blocks": 4,
            "causes": {"new": 100, "diverged": 150},
        }
    }
    assert {c: n for c, n in summary["replicas"]["r1"]["causes"].items() if n} == {"new": 100, "diverged": 150}
    assert summary["diverged_turns"]["earlier message"] == 1.0
    r1 = summary["replicas"]["r1"]
    assert (r1["requests"], r1["prompt_tokens"], r1["prefill_tokens"], r1["cached_tokens"], r1["hit_rate"]) == (1, 1000, 250, 750, 0.75)
    assert r1["ttft_p50_s"] == pytest.approx(0.025 + 0.025 * (2 - 1) / 2)  # the 2nd of 4 lies halfway into (0.025, 0.05]
    assert 0.25 < r1["ttft_p99_s"] <= 0.5
    assert summary["replicas"]["r2"]["hit_rate"] is None and summary["decisions"] == {"sticky": 3.0}
    assert histogram_quantile(0.5, []) is None


def test_a_redis_router_replica_may_name_its_daemon_for_retention_and_retention_settings_are_checked(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text(CONFIG + "\n[router.retention]\nmin_ttl_s = 2\nmax_ttl_s = 120\nprefetch = false\n")
    config = load_router_config(path, replicas=[ReplicaConfig("http://10.0.0.2:8000", "gpu-2", daemon="127.0.0.1:50552")])
    assert config.replicas[-1].daemon == "127.0.0.1:50552"
    assert (config.retention.min_ttl_s, config.retention.max_ttl_s, config.retention.prefetch) == (2.0, 120.0, False)
    for extra, words in (
        ("min_ttl_s = 0", "router.retention.min_ttl_s must be a positive number"),
        ("min_ttl_s = 50\nmax_ttl_s = 10", "min_ttl_s (50.0) must not exceed max_ttl_s (10.0)"),
        ("prefetch = 'yes'", "router.retention.prefetch must be true or false"),
        ("ttl = 5", "unknown setting router.retention.ttl"),
    ):
        path.write_text(CONFIG + "\n[router.retention]\n" + extra + "\n")
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_router_config(path)
