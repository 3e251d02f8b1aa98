"""Time to first token of long-prompt requests that save their KV, on a real vLLM (CPU):
saves committed beside the engine's steps (``defer_saves``, the default) vs. inside the
step that computes them, against an engine without kvstore, in the same run.

    python -m bench.vllm_saves [--quick] [--json]

Three engine processes (``bench.vllm_engine``, the "mid" model of ``bench.e2e_vllm``,
prefix caching off) are kept up side by side:

- recompute: no connector, the baseline: what saving adds is measured against it;
- deferred: ``KVStoreConnector`` with ``defer_saves`` true;
- in_step: ``KVStoreConnector`` with ``defer_saves`` false (each step waits for its saves).

Both kvstore engines save to one ``kvstore serve`` daemon under different tenant salts,
so neither finds the other's blocks. Each round sends every engine, in turn, a prompt no
engine has seen (the same one to all three) with ``max_tokens=1``: its wall time is a TTFT
whose prefill saves every full block. A setting's TTFT is the median of its samples. The
connector's ``save_wait_s`` counter says how long the worker's steps waited for their
saves, over all requests.

Target: a deferred step waits for its saves (it only queues them) less than half as long
as an in-step one. The TTFT ratios have no target: on a CPU engine the wait deferring
removes (milliseconds) is far below the prefill's run-to-run spread (tens of ms at 1K
tokens); on a GPU, where a step takes milliseconds, it is not. Duration on two cores: full (8K-token prompts) ≈ 5–8 min; ``--quick``
(1K-token prompts) ≈ 60–90 s, most of it three engine starts and the model build.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

from bench.e2e_vllm import BLOCK, prompt
from bench.report import Report, parse_args
from bench.vllm_engine import EngineProcess, build_model
from kvstore.spawn import spawn_daemon

MiB = 1024 * 1024
ROUNDS = 7


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    length = 1024 if args.quick else 8192
    report = Report("vllm_saves")
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-bench-vllm-saves-"))
    engines: dict[str, EngineProcess] = {}
    daemon = None
    try:
        model = build_model(workdir / "model", "mid")
        daemon = spawn_daemon(
            workdir / "kvstore.sock",
            {"server.grpc_port": 0, "server.metrics_port": -1, "nvme.enabled": "false", "host.capacity_bytes": 1024 * MiB},
            workdir / "daemon.log",
        )

        def kvstore(defer: bool) -> dict:
            extra = {"socket_path": str(daemon.socket_path), "tenant_salt": f"defer-{defer}", "defer_saves": defer}
            return {"name": "KVStoreConnector", "module": "kvstore.connectors.vllm", "role": "kv_both", "extra": extra}

        connectors = {"recompute": None, "deferred": kvstore(True), "in_step": kvstore(False)}
        for name, connector in connectors.items():
            plan = {"model": str(model), "block_size": BLOCK, "max_model_len": length + 64, "connector": connector}
            engines[name] = EngineProcess(plan, workdir, name)
            engines[name].serve({"prompt": prompt(256, seed=99), "max_tokens": 1})  # warm-up
        names = list(engines)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(ROUNDS):
            request = {"prompt": prompt(length, seed=1000 + round_index), "max_tokens": 1}
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                samples[name].append(engines[name].serve(request)["seconds"])
        counters = {name: engines[name].close() for name in ("deferred", "in_step")}
        ttft = {name: statistics.median(values) for name, values in samples.items()}
        requests = ROUNDS + 1  # and the warm-up
        wait = {name: counters[name]["save_wait_s"] / requests for name in counters}
        for name in names:
            report.results.append(
                {
                    "setting": name,
                    "prompt_tokens": length,
                    "ttft_s": round(ttft[name], 4),
                    "samples_s": [round(x, 4) for x in samples[name]],
                    "save_wait_per_request_s": round(wait[name], 6) if name in wait else None,
                    "startup_s": round(engines[name].startup_s, 1),
                }
            )
        report.print_table(
            "TTFT of a request that saves its prompt (median of the rounds), ms",
            ["setting", "tokens", "ttft_ms", "save_wait_ms"],
            [[name, length, ttft[name] * 1e3, wait[name] * 1e3 if name in wait else "-"] for name in names],
        )
        report.compare("deferred_over_in_step", ttft["deferred"] * 1e3, ttft["in_step"] * 1e3, "ms TTFT")
        report.compare("deferred_over_recompute", ttft["deferred"] * 1e3, ttft["recompute"] * 1e3, "ms TTFT")
        report.compare("in_step_over_recompute", ttft["in_step"] * 1e3, ttft["recompute"] * 1e3, "ms TTFT")
        report.compare("deferred_save_wait_over_in_step", wait["deferred"] * 1e3, wait["in_step"] * 1e3, "ms per request", "<= 0.5")
        report.emit(args.json)
    finally:
        for engine in engines.values():
            engine.kill()
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
