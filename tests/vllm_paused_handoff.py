"""A real vLLM PD producer (in this process) whose decode daemons stop answering mid-
handoff; run in the vLLM venv by tests/test_vllm_e2e.py:

    .venv-vllm/bin/python tests/vllm_paused_handoff.py PLAN.json CHECKS.jsonl

The plan names two decode daemons, each as {"destination", "pid"}; right after the
producer opens a handoff to one of them, the script stops it:

1. "paused" (SIGSTOP): the request finishes while its decode daemon is stopped — the
   step did not wait for it — and once the daemon is resumed (SIGCONT) the handoff lands;
2. "dead" (SIGKILL): the request finishes, its blocks are back in vLLM's free pool at
   once, the handoff fails beside the steps (counted, not raised) and the engine serves
   on.

Each check writes one JSON line {"case", "ok", ...} to CHECKS.jsonl (not to stdout,
where vLLM's own lines go); the last line is {"kv_transfer_params": ...} of the paused
request, for the decode instance; the exit status is 0 when all checks pass.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from vllm.distributed.kv_transfer import get_kv_transfer_group

from bench.vllm_engine import serve, start_engine

plan = json.loads(open(sys.argv[1]).read())
checks = open(sys.argv[2], "w")
results: list[dict] = []


def write(line: dict) -> None:
    checks.write(json.dumps(line) + "\n")
    checks.flush()


def check(case: str, ok: bool, **detail) -> None:
    results.append({"case": case, "ok": bool(ok), **detail})
    write(results[-1])


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


llm = start_engine(plan)
pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
worker = get_kv_transfer_group()._worker
sender = worker._sender
paused, dead = plan["paused"], plan["dead"]
stops = {paused["destination"]: (paused["pid"], signal.SIGSTOP), dead["destination"]: (dead["pid"], signal.SIGKILL)}
real_open = sender._open


def open_then_stop(spec):
    outgoing = real_open(spec)
    pid, signum = stops.pop(spec.destination, (None, None))
    if pid is not None:
        os.kill(pid, signum)
    return outgoing


sender._open = open_then_stop
paused_prompt, dead_prompt, after_prompt = plan["prompts"]
free_blocks = pool.get_num_free_blocks()


def hand_off(prompt: list[int], transfer_id: str, destination: str) -> dict:
    params = {"do_remote_decode": True, "kvstore_transfer_id": transfer_id, "kvstore_destination": destination}
    return serve(llm, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})


# 1. paused: the request is over while its decode daemon is stopped
sent = hand_off(paused_prompt, "pd-paused", paused["destination"])
check("paused: the request finished while its decode daemon was stopped", process_state(paused["pid"]) == "T", seconds=sent["seconds"])
check("paused: nothing acknowledged yet", sender.blocks_sent == 0 and sender.num_failures == 0, sent=sender.blocks_sent)
time.sleep(1.0)
os.kill(paused["pid"], signal.SIGCONT)
sender.wait()
num_blocks = sent["kv_transfer_params"]["kvstore_num_blocks"]
check(
    "paused: the handoff lands once the daemon resumes",
    sender.blocks_sent == num_blocks and sender.num_failures == 0,
    sent=sender.blocks_sent,
)

# 2. dead: the blocks are free at once, the failure comes beside the steps, the engine serves on
began = time.monotonic()
hand_off(dead_prompt, "pd-dead", dead["destination"])
check("dead: the request's blocks are free when it finishes", pool.get_num_free_blocks() == free_blocks, free=pool.get_num_free_blocks())
sender.wait()
check("dead: the handoff failed, counted, within the timeout", sender.num_failures == 1, seconds=time.monotonic() - began)
after = serve(llm, {"prompt": after_prompt, "max_tokens": 4})
check("dead: the engine serves on", len(after["tokens"]) == 4)
worker.wait_for_saves()
check(
    "the counters",
    worker.counters.handoff_failures == 1 and worker.counters.handoff_blocks_sent == num_blocks,
    wait_s=worker.counters.handoff_wait_s,
)
write({"kv_transfer_params": sent["kv_transfer_params"]})
sys.exit(0 if all(result["ok"] for result in results) else 1)
