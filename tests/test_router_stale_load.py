"""The engine's own running + waiting figure against the load the router knows itself.

The router reads each engine's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
at its health checks, to price traffic that reaches the engine some other way. That figure
is a sample: a request the router sent is in it until the next check, even after the
router has seen the request end. Here the router checks its replicas every 600 s, and a
SIGHUP (a configuration reload, which checks the replicas at once) takes the sample at a
chosen moment: while a request is on replica-a. Two real http_replica engines (whose
/metrics counts the completions they have not finished), two real daemons (replica-a's
holds a shared system prompt) and the real `kvstore router` process.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from daemon_harness import daemons, eventually
from test_engine_subscriptions import BLOCK, NAMESPACE_TOML
from test_router_daemons import hold, started, unused_port

SYSTEM = list(range(20_000, 20_000 + 32 * BLOCK))  # 512 tokens: 0.05 s to compute at the default 10,000 tokens/s
ROUTER_TOML = """
[router]
port = {port}
index = "daemons"
health_interval_s = 600
daemon_timeout_s = 2
{namespace}
[[router.replicas]]
url = "{url_a}"
node_id = "replica-a"
daemon = "{daemon_a}"
daemon_token = "tok-a"

[[router.replicas]]
url = "{url_b}"
node_id = "replica-b"
daemon = "{daemon_b}"
"""


def conversation(start: int, turns: int = 1) -> list[int]:
    """The shared system prompt, then ``turns`` turns of two blocks each of a conversation's own."""
    return SYSTEM + list(range(start, start + turns * 2 * BLOCK))


@dataclass
class Fleet:
    router: str
    process: subprocess.Popen
    engines: dict[str, str]  # replica id -> its engine's url
    gate: Path  # replica-a computes no streamed prompt until this file exists
    daemons: dict = field(default_factory=dict)  # replica id -> its daemon (daemon_harness.Daemon)

    def complete(self, prompt: list[int], session: str, tenant: str) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        headers = {"x-session-id": session, "x-tenant-id": tenant}
        answer = httpx.post(f"{self.router}/v1/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer

    def gauge(self, name: str, replica: str) -> float | None:
        text = httpx.get(f"{self.router}/metrics", timeout=5).text
        found = re.search(rf'^{name}{{replica="{replica}"}} (\S+)$', text, re.MULTILINE)
        return float(found.group(1)) if found else None

    def counter(self, name: str) -> float:
        text = httpx.get(f"{self.router}/metrics", timeout=5).text
        return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))

    def check_now(self, replica: str, engine_requests: int) -> None:
        """Make the router check its replicas now (SIGHUP), and wait until it has read
        ``engine_requests`` from ``replica``'s engine."""
        self.process.send_signal(signal.SIGHUP)
        reads = eventually(lambda: self.gauge("kvstore_router_engine_requests", replica) == engine_requests)
        assert reads, self.gauge("kvstore_router_engine_requests", replica)


@contextlib.contextmanager
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Two http_replica engines beside two daemons, replica-a's holding SYSTEM, and the
    router in front of them, healthy."""
    gate = tmp_path / "prefilled"
    replica = [sys.executable, str(Path(__file__).parent / "http_replica.py")]
    with (
        daemons(tmp_path) as start,
        started([*replica, "replica-a", "tiny", str(gate)], tmp_path / "replica-a.log") as engine_a,
        started([*replica, "replica-b", "tiny"], tmp_path / "replica-b.log") as engine_b,
    ):
        a, b = start(node_id="replica-a", token="tok-a"), start(node_id="replica-b")
        hold(a, "tok-a", SYSTEM)
        engines = {
            node_id: f"http://127.0.0.1:{engine.stdout.readline().strip()}"
            for node_id, engine in (("replica-a", engine_a), ("replica-b", engine_b))
        }
        port = unused_port()
        config = tmp_path / "router.toml"
        namespace = NAMESPACE_TOML.replace("[engines.namespace]", "[router.namespace]")
        urls = {"url_a": engines["replica-a"], "url_b": engines["replica-b"], "daemon_a": a.address, "daemon_b": b.address}
        config.write_text(ROUTER_TOML.format(port=port, namespace=namespace, **urls))
        router = f"http://127.0.0.1:{port}"
        with started([sys.executable, "-m", "kvstore", "router", "--config", str(config)], tmp_path / "router.log") as process:

            def healthy() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{router}/health", timeout=2).json().get("healthy_replicas") == ["replica-a", "replica-b"]
                return False

            assert eventually(healthy, timeout_s=60), (tmp_path / "router.log").read_text()
            yield Fleet(router, process, engines, gate, {"replica-a": a, "replica-b": b})


def test_a_request_of_the_routers_that_ended_after_the_health_check_does_not_keep_load_on_its_replica(tmp_path):
    """A session's streamed request runs on replica-a when the router reads replica-a's
    engine (1 running), then ends. Until the next check the engine's figure still says 1;
    the router knows the one request was its own and has ended. A new session sharing the
    system prompt, sent at once, must go to replica-a where the prompt is cached (the
    stale figure would add a phantom request's 0.5 s decode share there, more than the
    0.05 s of computing the prompt on replica-b); so must a second tenant's session, and
    its next turn stays there."""
    with fleet(tmp_path) as f:
        body = {"model": "tiny", "prompt": conversation(30_000), "max_tokens": 1, "stream": True}
        headers = {"x-session-id": "tenant-1-first", "x-tenant-id": "tenant-1"}
        with httpx.stream("POST", f"{f.router}/v1/completions", json=body, headers=headers, timeout=30) as first:
            assert first.headers["x-kvstore-replica"] == "replica-a"  # it holds the system prompt
            f.check_now("replica-a", engine_requests=1)  # the engine counts the router's request
            f.gate.touch()
            assert first.read().decode().rstrip().endswith("data: [DONE]")
        assert eventually(lambda: f.gauge("kvstore_router_in_flight", "replica-a") == 0)
        # as reported: the engine's figure of the last check, while nothing of the router's runs
        assert f.gauge("kvstore_router_engine_requests", "replica-a") == 1

        cached = str(len(SYSTEM))
        second = f.complete(conversation(31_000), "tenant-1-second", "tenant-1")
        assert (second.headers["x-kvstore-replica"], second.headers["x-kvstore-expected-cached-tokens"]) == ("replica-a", cached)
        other = f.complete(conversation(32_000), "tenant-2-first", "tenant-2")
        assert (other.headers["x-kvstore-replica"], other.headers["x-kvstore-expected-cached-tokens"]) == ("replica-a", cached)
        next_turn = f.complete(conversation(32_000, turns=2), "tenant-2-first", "tenant-2")
        assert (next_turn.headers["x-kvstore-replica"], next_turn.headers["x-kvstore-route"]) == ("replica-a", "sticky")
        assert f.counter("kvstore_router_session_moves_total") == 0
        # what routing priced on replica-a besides its own requests: nothing
        assert f.gauge("kvstore_router_foreign_requests", "replica-a") == 0


def test_requests_that_reach_an_engine_past_the_router_still_count_until_a_check_sees_them_end(tmp_path):
    """A client of replica-a's engine that does not go through the router: its request is
    running there when the router checks (1 running, none of the router's). That is load
    the router knows only from the engine: a new session sharing the system prompt goes
    to the idle replica-b rather than queue behind it. Once a check sees it end, new
    sessions go to replica-a again."""
    with fleet(tmp_path) as f:
        body = {"model": "tiny", "prompt": conversation(40_000), "max_tokens": 1, "stream": True}
        with httpx.stream("POST", f"{f.engines['replica-a']}/v1/completions", json=body, timeout=30) as direct:
            assert direct.status_code == 200
            f.check_now("replica-a", engine_requests=1)
            assert f.gauge("kvstore_router_foreign_requests", "replica-a") == 1
            assert f.gauge("kvstore_router_in_flight", "replica-a") == 0
            busy = f.complete(conversation(41_000), "busy", "tenant-1")
            assert busy.headers["x-kvstore-replica"] == "replica-b", busy.headers
            f.gate.touch()
            assert direct.read().decode().rstrip().endswith("data: [DONE]")
        f.check_now("replica-a", engine_requests=0)
        assert f.gauge("kvstore_router_foreign_requests", "replica-a") == 0
        idle = f.complete(conversation(42_000), "idle", "tenant-1")
        assert (idle.headers["x-kvstore-replica"], idle.headers["x-kvstore-expected-cached-tokens"]) == ("replica-a", str(len(SYSTEM)))
