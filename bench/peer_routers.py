"""`vllm-router` processes for bench.fleet: the router users put in front of vLLM replicas
today, as its peer baseline.

`vllm-router` (PyPI ``vllm-router``, the ``bench`` extra: ``pip install '.[bench]'``) is a
Rust router in a Python wheel; its ``vllm-router`` launcher runs the router in process. The
policies bench.fleet runs:

- ``cache_aware``: a prefix tree of the request texts it has routed, per worker; a request
  goes to the worker whose tree shares the longest prefix with its text (above
  ``--cache-threshold``), unless the loads differ by more than the balance thresholds.
- ``kv_aware``: the workers' own KV-cache contents, from the KV events each vLLM engine
  publishes (``--kv-event-source WORKER_URL=tcp://host:port``: only ``tcp://host:port``,
  to which it connects, so vLLM binds ``tcp://*:port``); the prompt's token ids come from
  the worker's ``/v1/completions/render``, which vLLM 0.32 serves only with
  ``--enable-scale-out`` (403 without it, and the router then routes by load alone).

Each is started with its defaults apart from the policy, the workers, the ports and, for
``kv_aware``, the event sources with the engines' block size and model; ``command`` keeps
the exact command line for the report.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.router_fleet import free_port, stop_process, wait_healthy

__all__ = ["VllmRouter", "vllm_router_binary", "routing_counters"]

POLICIES = ("cache_aware", "kv_aware")


def vllm_router_binary() -> str:
    """The ``vllm-router`` launcher of this interpreter's environment (or on PATH)."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise SystemExit("vllm-router is not installed; bench.fleet's peer stacks need it: pip install '.[bench]'.")
    return found


@dataclass
class VllmRouter:
    """One running ``vllm-router``."""

    policy: str
    url: str
    metrics_url: str
    command: list[str]
    process: subprocess.Popen
    log: Path

    @classmethod
    def start(
        cls,
        workdir: Path,
        name: str,
        policy: str,
        worker_urls: list[str],
        kv_event_sources: dict[str, str] | None = None,
        block_size: int = 32,
        model: str = "",
        timeout_s: float = 120,
    ) -> VllmRouter:
        """``vllm-router --policy POLICY`` in front of ``worker_urls``; for ``kv_aware``,
        ``kv_event_sources`` maps each worker URL to its engine's ``tcp://host:port``
        publisher, ``block_size`` and ``model`` are the engines'. Returns once /health answers."""
        if policy not in POLICIES:
            raise ValueError(f"bench.fleet runs vllm-router with {POLICIES}, not {policy!r}.")
        port, metrics_port = free_port(), free_port()
        command = [
            vllm_router_binary(), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        ]  # fmt: skip
        if policy == "kv_aware":
            if not kv_event_sources or set(kv_event_sources) != set(worker_urls):
                raise ValueError("kv_aware needs one KV event source per worker.")
            for url in worker_urls:
                command += ["--kv-event-source", f"{url}={kv_event_sources[url]}"]
            command += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        log = workdir / f"{name}.log"
        with open(log, "w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        router = cls(policy, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", command, process, log)
        wait_healthy(router.url, process, log, f"vllm-router ({policy})", timeout_s, poll_s=0.2)
        return router

    def metrics(self) -> str:
        return httpx.get(self.metrics_url, timeout=10).text

    def stop(self) -> None:
        stop_process(self.process)


def routing_counters(exposition: str) -> dict[str, float]:
    """vllm-router's routing counters from its /metrics: ``vllm_router_prefix_routing_decisions_total``
    by outcome (kv_aware: ``prefix_cost``, or why it could not score), ``vllm_router_kv_routing_inputs_total``
    by result (``render``: the prompt's tokens came from the worker), the cache-aware tree's
    hits and misses, and the load-balancing events."""
    counters: dict[str, float] = {}
    wanted = {
        "vllm_router_prefix_routing_decisions_total": "outcome",
        "vllm_router_kv_routing_inputs_total": "result",
        "vllm_router_cache_hits_total": "",
        "vllm_router_cache_misses_total": "",
        "vllm_router_load_balancing_events_total": "",
    }
    for line in exposition.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if name not in wanted:
            continue
        label = wanted[name]
        key = name.removeprefix("vllm_router_").removesuffix("_total")
        if label and f'{label}="' in series:
            key += ":" + series.split(f'{label}="', 1)[1].split('"', 1)[0]
        counters[key] = counters.get(key, 0.0) + float(value)
    return counters
