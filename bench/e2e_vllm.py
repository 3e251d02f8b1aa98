"""Time to first token of a repeated long prompt on a real vLLM (CPU): recompute vs vLLM's
ExampleConnector vs kvstore, in the same run.

    python -m bench.e2e_vllm [--quick] [--json]

A random Llama (``bench.vllm_model``: "mid", ~60 M parameters, so an 8K-token prefill
takes seconds on two cores; "tiny" with ``--quick``) is served by three engine processes
(``bench.vllm_engine``, prefix caching off, the same model and plan), one per setting:

- recompute: no connector; every request prefills its whole prompt;
- example: vLLM's built-in ``ExampleConnector`` (per-layer safetensors files on local
  disk, keyed by the whole prompt);
- kvstore: ``KVStoreConnector`` against a real ``kvstore serve`` daemon.

Each engine serves a warm-up prompt, then every test prompt twice; the second request of
a prompt finds it cached (except under recompute), and its wall time with
``max_tokens=1`` is its TTFT. Reported: median TTFT per setting and the ratios
kvstore/recompute (target ≤ 0.3) and kvstore/example (target < 1.0). The second
request's output token must be the first request's, or the run fails.

Duration on two cores: ``--quick`` ≈ 45–60 s (three engine starts dominate; 2K-token
prompts on the tiny model); full ≈ 4–6 min.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.report import Report, parse_args
from bench.vllm_engine import build_model, engine_process
from kvstore.spawn import spawn_daemon

MiB = 1024 * 1024
BLOCK = 32


def prompts(num_prompts: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(num_prompts)]


def plan(model: Path, tests: list[list[int]], warmup: list[int], connector: dict | None) -> dict:
    requests = [{"prompt": warmup, "max_tokens": 1}]
    for prompt in tests:
        requests += [{"prompt": prompt, "max_tokens": 1}, {"prompt": prompt, "max_tokens": 1}]
    max_len = max(len(p) for p in tests) + 64
    return {"model": str(model), "block_size": BLOCK, "max_model_len": max_len, "connector": connector, "requests": requests}


def second_request_ttfts(report: dict, name: str) -> list[float]:
    results = report["results"][1:]
    firsts, seconds = results[0::2], results[1::2]
    for first, second in zip(firsts, seconds):
        if first["tokens"] != second["tokens"]:
            raise SystemExit(f"{name}: the cached request decoded {second['tokens']}, the first {first['tokens']}")
    return [r["seconds"] for r in seconds]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    size, length, num_prompts = ("tiny", 2048, 1) if args.quick else ("mid", 8192, 3)
    vocab = 1024 if args.quick else 4096
    report = Report("e2e_vllm")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-e2e-vllm-"))
    try:
        model = build_model(workdir / "model", size)
        tests, warmup = prompts(num_prompts, length, vocab, seed=1), prompts(1, 256, vocab, seed=2)[0]
        example_dir = workdir / "example-connector"
        example_dir.mkdir()
        daemon = spawn_daemon(workdir / "kvstore.sock", {
            "server.grpc_port": 0, "server.metrics_port": -1, "nvme.enabled": "false",
            "host.capacity_bytes": (256 if args.quick else 1024) * MiB,
        }, workdir / "daemon.log")
        settings = {
            "recompute": None,
            "example": {"name": "ExampleConnector", "role": "kv_both",
                        "extra": {"shared_storage_path": str(example_dir)}},
            "kvstore": {"name": "KVStoreConnector", "module": "kvstore.connectors.vllm", "role": "kv_both",
                        "extra": {"socket_path": str(daemon.socket_path)}},
        }
        ttft: dict[str, float] = {}
        try:
            for name, connector in settings.items():
                engine = engine_process(plan(model, tests, warmup, connector), workdir, name)
                samples = second_request_ttfts(engine, name)
                ttft[name] = statistics.median(samples)
                first = statistics.median(r["seconds"] for r in engine["results"][1::2])
                report.results.append({"setting": name, "ttft_s": round(ttft[name], 4), "first_request_s": round(first, 4),
                                       "samples_s": [round(s, 4) for s in samples], "startup_s": round(engine["startup_s"], 1),
                                       "connector": engine["connector"]})
                print(f"{name:>10}: TTFT of the repeated {length}-token prompt {ttft[name] * 1e3:8.1f} ms "
                      f"(first request {first * 1e3:8.1f} ms, engine start {engine['startup_s']:.1f} s)")
        finally:
            daemon.stop()
        report.ratio("kvstore_over_recompute", ttft["kvstore"] / ttft["recompute"], "<= 0.3")
        report.ratio("kvstore_over_example", ttft["kvstore"] / ttft["example"], "< 1.0")
        report.emit(args.json)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
