"""A real vLLM engine (in this process) whose saves end after their step; run in the vLLM
venv by tests/test_vllm_e2e.py:

    .venv-vllm/bin/python tests/vllm_deferred_saves.py PLAN.json DAEMON_PID

The worker's commits are held at a gate, so a step's saves are still in flight when
its request finishes:

1. "gone": a request finishes while its commit waits; the daemon is killed (SIGKILL) and
   the gate opened: the commit fails, the request's blocks are freed all the same, the
   engine serves on. The script then prints {"phase": "daemon killed"} and waits for a
   line on stdin (the test restarts the daemon meanwhile);
2. "held": a request finishes while its commit waits: vLLM keeps its blocks, steps and
   all, and the store holds none of it; once the gate opens the commit lands, the worker
   reports the request and vLLM frees its blocks.

Each check prints one JSON line {"case", "ok", ...}; the last line is {"tokens": [...]}
(what case 2's prompt decoded); the exit status is 0 when all checks pass.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from vllm import SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.inputs import TokensPrompt

from bench.vllm_engine import start_engine
from kvstore.client import KVStoreClient
from kvstore.connectors.vllm_compat import worker_tp_rank
from kvstore.connectors.vllm_meta import namespace_for
from kvstore.hashing import chain_hashes

plan = json.loads(open(sys.argv[1]).read())
daemon_pid = int(sys.argv[2])
results: list[dict] = []


def check(case: str, ok: bool, **detail) -> None:
    results.append({"case": case, "ok": bool(ok), **detail})
    print(json.dumps(results[-1]), flush=True)


def eventually(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()  # what a serving engine does while vLLM keeps blocks for a connector
        time.sleep(0.05)
    return True


llm = start_engine(plan)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
pool = scheduler.kv_cache_manager.block_pool
worker = get_kv_transfer_group()._worker
block_size = plan["block_size"]
gone_prompt, held_prompt, after_prompt = plan["prompts"]

# the gate: every commit waits until it is opened
gate, commit_waiting = threading.Event(), threading.Event()
real_commit = worker._client.commit


def gated_commit(pending):
    commit_waiting.set()
    gate.wait(120)
    return real_commit(pending)


worker._client.commit = gated_commit


def generate(prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0].token_ids)


def stored_blocks(prompt: list[int]) -> int:
    with KVStoreClient(plan["connector"]["extra"]["socket_path"]) as client:
        digest = client.register_namespace(worker_namespace)
        return client.lookup(digest, chain_hashes(prompt, block_size)).num_blocks


worker_namespace = namespace_for(worker._geometry, worker_tp_rank(), "")
num_full = len(held_prompt) // block_size
free_at_start = pool.get_num_free_blocks()

# 1. the daemon dies while a request's commit is in flight
generate(gone_prompt)
check("gone: the request finished before its commit", commit_waiting.wait(30) and len(scheduler.requests) == 1)
os.kill(daemon_pid, signal.SIGKILL)
time.sleep(1.0)
gate.set()
check("gone: its blocks are freed once the commit failed", eventually(lambda: not scheduler.requests))
check("gone: every block is free again", pool.get_num_free_blocks() == free_at_start, free=pool.get_num_free_blocks())
check("gone: the engine serves on", len(generate(after_prompt)) == 4)
print(json.dumps({"phase": "daemon killed"}), flush=True)
sys.stdin.readline()  # the daemon is back
time.sleep(3.0)  # the connector's clients reconnect at their next call after a backoff of 2 s at most
check("gone: nothing of it was stored", stored_blocks(gone_prompt) == 0)

# 2. a finished request keeps its blocks until its commit lands
gate.clear()
commit_waiting.clear()
tokens = generate(held_prompt)
check("held: the request finished before its commit", commit_waiting.wait(30))
for _ in range(5):
    llm.llm_engine.step()
held = free_at_start - pool.get_num_free_blocks()
check("held: vLLM keeps its blocks while its save is in flight", len(scheduler.requests) == 1 and held >= num_full, held=held)
check("held: nothing of it is stored yet", stored_blocks(held_prompt) == 0)
gate.set()
check("held: its blocks are freed once the commit landed", eventually(lambda: not scheduler.requests))
check("held: every block is free again", pool.get_num_free_blocks() == free_at_start)
check("held: every full block is stored", stored_blocks(held_prompt) == num_full)
print(json.dumps({"tokens": tokens}), flush=True)
sys.exit(0 if all(result["ok"] for result in results) else 1)
