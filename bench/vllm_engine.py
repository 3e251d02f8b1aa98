"""One vLLM (CPU) engine process that serves a list of prompts and reports, as JSON.

    .venv-vllm/bin/python -m bench.vllm_engine PLAN.json REPORT.json

Used by the end-to-end tests and by ``bench.e2e_vllm``: each engine instance is a fresh
process (so nothing but kvstore can carry KV from one to the next), started with the
connector the plan names, serving the plan's requests one after another. The plan::

    {"model": DIR, "block_size": 32, "max_model_len": 8192, "prefix_caching": false,
     "connector": null | {"name": "KVStoreConnector" | "ExampleConnector",
                          "module": "kvstore.connectors.vllm" | null, "role": "kv_both",
                          "extra": {...}},
     "requests": [{"prompt": [token ids], "max_tokens": 16, "kv_transfer_params": {...}}, ...]}

The report written to REPORT.json is ``{"startup_s", "results": [{"tokens",
"num_cached_tokens", "kv_transfer_params", "seconds"}], "connector": {counters} | null}``;
``seconds`` is the wall time of the request alone, its TTFT when ``max_tokens`` is 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The venv `make vllm-venv` builds; the main venv has no vLLM.
VLLM_PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON", Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"))
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per engine: plenty for these prompts
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process: its connector is reachable
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class EngineFailed(RuntimeError):
    """An engine process exited with an error; the message ends with its log."""


def _run_vllm_python(args: list[str], log: Path, timeout_s: float) -> None:
    env = {**os.environ, **ENGINE_ENV}
    with open(log, "w") as output:
        result = subprocess.run([str(VLLM_PYTHON), *args], stdout=output, stderr=subprocess.STDOUT,
                                timeout=timeout_s, cwd=Path(__file__).resolve().parents[1], env=env)
    if result.returncode != 0:
        raise EngineFailed(f"{' '.join(args)} exited with {result.returncode}; log {log}:\n{log.read_text()[-6000:]}")


def engine_process(plan: dict, workdir: Path, name: str, timeout_s: float = 900) -> dict:
    """Serve ``plan`` in a fresh engine process (the vLLM venv's python); returns its report.
    The plan, report and the engine's log are left in ``workdir`` (NAME.json, NAME.report.json,
    NAME.log)."""
    plan_path, report_path = workdir / f"{name}.json", workdir / f"{name}.report.json"
    plan_path.write_text(json.dumps(plan))
    _run_vllm_python(["-m", "bench.vllm_engine", str(plan_path), str(report_path)], workdir / f"{name}.log", timeout_s)
    return json.loads(report_path.read_text())


def build_model(directory: Path, size: str, timeout_s: float = 600) -> Path:
    """Write the random model of ``bench.vllm_model`` into ``directory`` (once)."""
    directory.mkdir(parents=True, exist_ok=True)
    _run_vllm_python(["-m", "bench.vllm_model", str(directory), "--size", size], directory / "build.log", timeout_s)
    return directory


def _transfer_config(connector: dict | None):
    if connector is None:
        return None
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=connector["name"],
        kv_connector_module_path=connector.get("module"),
        kv_role=connector.get("role", "kv_both"),
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=connector.get("extra", {}),
    )


def _connector_counters(llm) -> dict | None:
    """The kvstore connector's counters, both halves (scheduler and worker live in this
    process with multiprocessing off); None for other connectors."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    worker = get_kv_transfer_group()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    counters = {}
    for side in (getattr(scheduler, "_scheduler", None), getattr(worker, "_worker", None)):
        if side is not None:
            counters.update(dataclasses.asdict(side.counters))
    return counters or None


def run(plan: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=plan["model"],
        dtype="bfloat16",
        block_size=plan.get("block_size", 32),
        max_model_len=plan.get("max_model_len", 4096),
        max_num_batched_tokens=plan.get("max_model_len", 4096),
        enable_prefix_caching=plan.get("prefix_caching", False),
        enforce_eager=True,
        seed=0,
        kv_transfer_config=_transfer_config(plan.get("connector")),
    )
    startup_s = time.perf_counter() - started
    results = []
    for request in plan["requests"]:
        transfer = request.get("kv_transfer_params")
        params = SamplingParams(temperature=0.0, max_tokens=request.get("max_tokens", 16), ignore_eos=True,
                                extra_args={"kv_transfer_params": transfer} if transfer else None)
        began = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=request["prompt"])], params, use_tqdm=False)[0]
        results.append({
            "tokens": list(output.outputs[0].token_ids),
            "num_cached_tokens": output.num_cached_tokens,
            "kv_transfer_params": output.kv_transfer_params,
            "seconds": time.perf_counter() - began,
        })
    return {"startup_s": startup_s, "results": results, "connector": _connector_counters(llm)}


def main() -> None:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    plan_path, report_path = Path(sys.argv[1]), Path(sys.argv[2])
    report_path.write_text(json.dumps(run(json.loads(plan_path.read_text()))))


if __name__ == "__main__":
    main()
