"""A real vLLM engine (in this process) whose saves end after their step; run in the vLLM
venv by tests/test_vllm_e2e.py:

    .venv-vllm/bin/python tests/vllm_deferred_saves.py PLAN.json DAEMON_PID

On a CPU engine a step's saves are copied out and committed at the start of the next
step, so a request whose last step computed its prompt (one token asked for) finishes
with its saves still to do; the script steps the engine itself:

1. "gone": the daemon is killed (SIGKILL) before the next step: its saves fail, the
   request's blocks are freed all the same, the engine serves on. The script then prints
   {"phase": "daemon killed"} and waits for a line on stdin (the test restarts the daemon
   meanwhile); nothing of the request was stored;
2. "held": vLLM keeps the request's blocks, and the store holds none of it, until the next
   step copies and commits them; then every full block is stored and the blocks are freed.

Each check prints one JSON line {"case", "ok", ...}; the last line is {"tokens": [...]}
(what case 2's prompt decoded); the exit status is 0 when all checks pass.
"""

from __future__ import annotations

import json
import os
import signal
import sys
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


def generate(prompt: list[int], max_tokens: int = 4) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return list(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0].token_ids)


def stored_blocks(prompt: list[int]) -> int:
    with KVStoreClient(plan["connector"]["extra"]["socket_path"]) as client:
        digest = client.register_namespace(worker_namespace)
        return client.lookup(digest, chain_hashes(prompt, block_size)).num_blocks


worker_namespace = namespace_for(worker._geometry, worker_tp_rank(), "")
num_full = len(held_prompt) // block_size
free_at_start = pool.get_num_free_blocks()

# 1. the daemon dies while a finished request's saves wait for the next step
generate(gone_prompt, max_tokens=1)  # its only step computes its prompt and its last token
check("gone: the request finished before its saves", len(scheduler.requests) == 1 and stored_blocks(gone_prompt) == 0)
os.kill(daemon_pid, signal.SIGKILL)
time.sleep(1.0)
check("gone: its blocks are freed once its saves failed", eventually(lambda: not scheduler.requests))
check("gone: every block is free again", pool.get_num_free_blocks() == free_at_start, free=pool.get_num_free_blocks())
check("gone: the engine serves on", len(generate(after_prompt)) == 4)
print(json.dumps({"phase": "daemon killed"}), flush=True)
sys.stdin.readline()  # the daemon is back
time.sleep(3.0)  # the connector's clients reconnect at their next call after a backoff of 2 s at most
check("gone: nothing of it was stored", stored_blocks(gone_prompt) == 0)

# 2. a finished request keeps its blocks until its saves are over
tokens = generate(held_prompt, max_tokens=1)
held = free_at_start - pool.get_num_free_blocks()
check("held: vLLM keeps its blocks while its saves wait", len(scheduler.requests) == 1 and held >= num_full, held=held)
check("held: nothing of it is stored yet", stored_blocks(held_prompt) == 0)
check("held: its blocks are freed once its saves are over", eventually(lambda: not scheduler.requests))
check("held: every block is free again", pool.get_num_free_blocks() == free_at_start)
worker.wait_for_saves()  # the commits' answers
check("held: every full block is stored", stored_blocks(held_prompt) == num_full)
check("held: the worker counted them", worker.counters.saved_blocks >= num_full, saved=worker.counters.saved_blocks)
print(json.dumps({"tokens": tokens}), flush=True)
sys.exit(0 if all(result["ok"] for result in results) else 1)
