"""Routing simulator: N replicas whose caches are kvstore's production tier manager, one
workload, several routing policies side by side.

    python -m bench.sim [--trace PATH | --workload coding-agent|mooncake] [--replicas 8]
                        [--model kimi-k2|llama3-70b] [--cache-gb-per-replica GB]
                        [--tier-split HBM,HOST,NVME] [--policies a,b,...]
                        [--eviction leaf-first-lru|lru] [--sweep 20,40,60,80,100]
                        [--slo-ttft-p99 S [--capacity-resolution F]]
                        [--quick] [--json] [--out DIR]

Prints a table per cache size, writes ``<workload>.json`` and PNG plots into --out, and
with --json ends stdout with the benchmark contract's line. Ratios compare kvstore with
the oracle, with the best baseline (highest hit rate) and, for the spread of hit rates
across replicas, with the baseline of lowest spread, at the largest cache size run; the
oracle's target applies to the coding-agent workload, whose default capacity is meant to
be adequate (the sessions' live context fits the fleet).

With ``--slo-ttft-p99 S`` it then searches, for each policy, the highest arrival rate
(sessions per second) at which the modelled TTFT p99 stays within S seconds
(bench/sim/capacity.py: how the rate is scaled, how the search brackets and bisects), and
prints it beside round-robin's; the JSON line gets ``capacity_<policy>_vs_round_robin``
and ``capacity_kvstore_vs_best_baseline`` with both rates beside each ratio. Modelled
figures: no targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from bench.report import Report, parse_args
from bench.sim.agents import PRESETS as AGENT_PRESETS
from bench.sim.agents import CodingAgentWorkload
from bench.sim.capacity import AgentsAtRate, CapacitySearch, Probe, RateScaled, TraceAtRate, policy_capacity, report_capacities
from bench.sim.engine import SimConfig, simulate
from bench.sim.models import PRESETS as MODEL_PRESETS
from bench.sim.models import preset
from bench.sim.policies import POLICIES, make_policy
from bench.sim.replica import TierSizes
from bench.sim.report import add_ratios, plot, print_summaries, summarize, write_json
from bench.sim.traces import MOONCAKE_TRACE, oracle_hit_tokens, read_trace, shared_trace, trace_folders
from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.tiers.eviction import POLICIES as EVICTION_POLICIES

QUICK_TRACE_REQUESTS = 1000  # the first ~4 minutes of the Mooncake trace
# Default capacity per replica: the coding-agent preset keeps ~8M tokens of live context
# (agents.py), ~560 GB of Kimi K2 KV over the fleet, ~70 GB a replica before the shared
# prompts and the sessions that end; 150 GB leaves room for routing to be uneven.
DEFAULT_CACHE_GB = {"coding-agent": 150.0, "trace": 60.0}
GB = 1e9


def _options(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--trace", type=Path, help="a Mooncake-format JSON-lines trace to replay")
    source.add_argument(
        "--workload",
        choices=["coding-agent", "mooncake"],
        default="coding-agent",
        help="a generated coding-agent workload, or Mooncake's synthetic trace from shared/traces",
    )
    parser.add_argument(
        "--agent-preset", choices=sorted(AGENT_PRESETS), help="coding-agent size (default: quick with --quick, else default)"
    )
    parser.add_argument("--seed", type=int, default=0, help="coding-agent workload seed")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="kimi-k2")
    parser.add_argument(
        "--cache-gb-per-replica", type=float, help="total cache per replica over all tiers (default: 150 for coding-agent, 60 for traces)"
    )
    parser.add_argument("--tier-split", default="0.25,0.25,0.5", help="fractions of the cache in HBM, host and NVMe")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="leaf-first-lru")
    parser.add_argument("--sweep", help="comma-separated cache sizes (GB per replica) to run instead of one")
    parser.add_argument("--load-scale", type=float, default=1.0, help="multiply the arrival rate (compress time)")
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests")
    parser.add_argument("--no-remote-fetch", action="store_true", help="kvstore's replicas never fetch blocks from peers")
    parser.add_argument(
        "--kvstore-decode-s-per-request", type=float, default=0.05,
        help="the load the kvstore router expects per decoding request, in seconds (default 0.05: this time model never "
        "lets decode delay a prefill, but a real replica's iterations slow with its batch; without any such term the "
        "router piles new sessions onto the replicas that already hold their agent's system prompt)",
    )  # fmt: skip
    parser.add_argument(
        "--slo-ttft-p99", type=float, help="also search each policy's capacity: the highest rate whose TTFT p99 is within this many seconds"
    )
    parser.add_argument(
        "--capacity-resolution", type=float, help="the search's resolution, a fraction of the rate (default 0.02; 0.05 with --quick)"
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/out/sim"), help="folder for the JSON file and plots")


def main() -> None:
    args = parse_args(__doc__.split("\n\n")[0], _options)
    workload, requests, scalable = _workload(args)
    fractions = _floats(args.tier_split, "--tier-split")
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        sys.exit("--tier-split needs three fractions (HBM, host, NVMe) that add up to 1, e.g. 0.25,0.25,0.5.")
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICIES]
    if unknown:
        sys.exit(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}.")
    default_gb = DEFAULT_CACHE_GB["coding-agent" if workload == "coding-agent" else "trace"]
    sizes = _floats(args.sweep, "--sweep") if args.sweep else [args.cache_gb_per_replica or default_gb]
    search = None
    if args.slo_ttft_p99 is not None:
        if args.sweep:
            sys.exit("--slo-ttft-p99 searches at one cache size; drop --sweep or run once per size.")
        resolution = args.capacity_resolution or (0.05 if args.quick else 0.02)
        try:
            search = CapacitySearch(args.slo_ttft_p99, resolution)
        except InvalidArgument as error:
            sys.exit(str(error))
    model = preset(args.model)
    speeds = dataclasses.replace(
        model.cost_model(remote_fetch=not args.no_remote_fetch), decode_s_per_request=args.kvstore_decode_s_per_request
    )
    reusable = oracle_hit_tokens(requests)
    oracle = sum(reusable) / sum(r.num_prompt_tokens for r in requests)
    largest_prompt = max(r.num_prompt_tokens for r in requests)
    print(
        f"workload {workload}: {len(requests):,} requests, {len({r.session_id for r in requests}):,} sessions, "
        f"{sum(r.num_prompt_tokens for r in requests):,} prompt tokens, largest {largest_prompt:,}; oracle hit rate {oracle:.3f}"
    )
    print(
        f"model {model.name}: {model.bytes_per_token:,} KV bytes/token; {args.replicas} replicas; "
        f"tiers {args.tier_split} (HBM, host, NVMe); eviction {args.eviction}"
    )
    report = Report("sim")
    summaries, ttfts = [], {}
    for size in sorted(sizes):
        tier_sizes = TierSizes.split(size * GB, fractions)
        if tier_sizes.hbm_bytes < largest_prompt * model.bytes_per_token:
            print(
                f"note: at {size:g} GB/replica the HBM tier holds {tier_sizes.hbm_bytes // model.bytes_per_token:,} tokens; "
                "longer prompts are cached only in part"
            )
        config = SimConfig(model, tier_sizes, args.replicas, args.eviction, remote_fetch=not args.no_remote_fetch)
        at_size = []
        for name in policies:
            result = simulate(requests, make_policy(name, args.replicas, speeds), config)
            at_size.append(summarize(result, workload, size, reusable))
            ttfts[name] = np.array([o.ttft_s for o in result.outcomes])  # the largest size's, in the end
            print(f"  simulated {name} at {size:g} GB/replica in {result.wall_s:.1f} s", flush=True)
        print_summaries(report, f"{workload}, {model.name}, {size:g} GB/replica", at_size)
        summaries.extend(at_size)
    add_ratios(report, summaries, oracle_target=workload == "coding-agent")
    if search is not None:
        capacities = {}
        for s in summaries:  # one size: the nominal run is the search's probe at scale 1
            nominal = Probe(1.0, s.ttft_p99_s, s.hit_rate)
            capacities[s.policy] = policy_capacity(scalable, s.policy, config, speeds, search, known=[nominal])
            print(f"  searched {s.policy}'s capacity in {len(capacities[s.policy].probes)} runs", flush=True)
        report_capacities(report, capacities, scalable, search)
    for s in summaries:
        report.results.append(
            {
                "workload": s.workload,
                "policy": s.policy,
                "model": s.model,
                "cache_gb_per_replica": s.cache_gb_per_replica,
                "hit_rate": round(s.hit_rate, 4),
                "oracle_hit_rate": round(s.oracle_hit_rate, 4),
                "spread_std": round(s.spread_std, 4),
                "spread_cv": round(s.spread_cv, 4),
                "mix_cv": round(s.mix_cv, 4),
                "load_cv": round(s.load_cv, 4),
                "ttft_p50_s": round(s.ttft_p50_s, 4),
                "ttft_p99_s": round(s.ttft_p99_s, 4),
                "throughput_rps": round(s.throughput_rps, 4),
                "session_moves": s.session_moves,
            }
        )
    run_config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    json_path = args.out / f"{workload}.json"
    write_json(json_path, run_config, summaries)
    written = plot(args.out, workload, summaries, ttfts)
    print(f"\nwrote {json_path}" + "".join(f", {path}" for path in written))
    report.emit(args.json)


def _workload(args: argparse.Namespace) -> tuple[str, list[Request], RateScaled | None]:
    """The workload's name, its requests, and the same workload at any rate (for the
    capacity search; None without --slo-ttft-p99)."""
    agents = None
    if args.trace is not None or args.workload == "mooncake":
        path = args.trace or _shared_trace()
        requests = read_trace(path)
        name = path.stem
        if args.quick and args.max_requests is None:
            requests = requests[:QUICK_TRACE_REQUESTS]
    else:
        agent_preset = args.agent_preset or ("quick" if args.quick else "default")
        config = dataclasses.replace(AGENT_PRESETS[agent_preset], seed=args.seed)
        requests = list(CodingAgentWorkload(config).requests())
        name = "coding-agent"
        agents = AgentsAtRate(config)
    if args.max_requests is not None:
        requests = requests[: args.max_requests]
    if args.load_scale != 1.0:
        if args.load_scale <= 0:
            sys.exit("--load-scale must be positive.")
        requests = [dataclasses.replace(r, arrival_s=r.arrival_s / args.load_scale) for r in requests]
    if not requests:
        sys.exit("the workload has no requests.")
    if args.slo_ttft_p99 is None:
        return name, requests, None
    if agents is None:
        return name, requests, TraceAtRate(requests)
    if args.max_requests is not None or args.load_scale != 1.0:
        sys.exit("--slo-ttft-p99 on the coding-agent workload scales its session rate itself; drop --max-requests and --load-scale.")
    return name, requests, agents


def _shared_trace() -> Path:
    path = shared_trace(MOONCAKE_TRACE)
    if path is None:
        sys.exit(f"{MOONCAKE_TRACE} is in none of {', '.join(map(str, trace_folders()))}; pass --trace PATH or set KVSTORE_TRACES.")
    return path


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sys.exit(f"{flag} takes comma-separated numbers, got {text!r}.")


if __name__ == "__main__":
    main()
