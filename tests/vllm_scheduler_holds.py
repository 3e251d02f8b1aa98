"""The vLLM scheduler side's lookup holds, driven step by step like vLLM's scheduler drives
it, against a real daemon (run in the vLLM venv by tests/test_vllm_scheduler.py):

    .venv-vllm/bin/python tests/vllm_scheduler_holds.py SOCKET METRICS_PORT

Each check prints one JSON line {"case", "ok", ...}; the exit status is 0 when all pass.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import replace
from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from kvstore.client import KVStoreClient
from kvstore.connectors.vllm_compat import EngineGeometry
from kvstore.connectors.vllm_meta import LOAD_WINDOW_STEPS, ConnectorSettings, namespace_for
from kvstore.connectors.vllm_scheduler import SchedulerSide
from kvstore.hashing import chain_hashes
from kvstore.tier_kind import TierKind

BLOCK_SIZE = 32
GEOMETRY = EngineGeometry("test/holds-model", 2, 2, 64, BLOCK_SIZE, "bfloat16", tp_size=2, pp_size=1, model_dtype="bfloat16")
PROMPT_BLOCKS = 24
FLOOD_BLOCKS = 4000  # more than the daemon's host tier holds (its NVMe tier is off)

socket_path, metrics_port = sys.argv[1], int(sys.argv[2])
results: list[dict] = []


def check(case: str, ok: bool, **detail) -> None:
    results.append({"case": case, "ok": bool(ok), **detail})
    print(json.dumps(results[-1]), flush=True)


def holds_now() -> float:
    """The daemon's gauge of lookup holds (refreshed by its housekeeping, every 0.25 s)."""
    time.sleep(0.6)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("kvstore_lookup_holds "))


def request(req_id: str, seed: int) -> Request:
    tokens = [(seed * 7919 + i) % 30_000 for i in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None)


def blocks_of(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


EMPTY_STEP = SimpleNamespace(
    num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]), preempted_req_ids=None
)

writer = KVStoreClient(socket_path)
digests = [writer.register_namespace(namespace_for(GEOMETRY, rank, "")) for rank in range(GEOMETRY.tp_size)]
block_bytes = namespace_for(GEOMETRY, 0, "").block_bytes


def store(req: Request) -> list[bytes]:
    hashes = chain_hashes(req.prompt_token_ids, BLOCK_SIZE)
    for digest in digests:
        writer.save(digest, hashes, [torch.full((block_bytes,), i % 251, dtype=torch.uint8) for i in range(len(hashes))])
    return hashes


def flood(seed: int) -> None:
    """Another engine's saves: enough to evict every block nobody holds."""
    for start in range(0, FLOOD_BLOCKS, 200):
        tokens = [(seed * 104_729 + start * BLOCK_SIZE + i) % 30_000 for i in range(200 * BLOCK_SIZE)]
        hashes = chain_hashes(tokens, BLOCK_SIZE, extra_keys=None)
        for digest in digests:
            writer.save(digest, hashes, [torch.zeros(block_bytes, dtype=torch.uint8)] * len(hashes))


def loadable(hashes: list[bytes]) -> int:
    """What a worker's load gets now, in blocks (the fewest over the ranks)."""
    worker = KVStoreClient(socket_path)
    try:
        for digest in digests:
            worker.register_namespace(namespace_for(GEOMETRY, digests.index(digest), ""))
        into = [torch.empty(block_bytes, dtype=torch.uint8) for _ in hashes]
        return min(worker.load(digest, hashes, into) for digest in digests)
    finally:
        worker.close()


def looked_up(req_id: str, seed: int) -> Request:
    """A request whose prompt is stored, after the scheduler's lookup of it."""
    req = request(req_id, seed)
    store(req)
    scheduler.num_new_matched_tokens(req, 0)
    return req


settings = ConnectorSettings(socket_path=socket_path, lookup_hold_s=60.0)
scheduler = SchedulerSide(settings, GEOMETRY, "kv_both")

# 1. counted, flooded, loaded whole; released once the load window has passed
first = request("r1", 1)
hashes = store(first)
tokens, asynchronous = scheduler.num_new_matched_tokens(first, 0)
check("the lookup counts the stored prompt", tokens == PROMPT_BLOCKS * BLOCK_SIZE and not asynchronous, tokens=tokens)
scheduler.num_new_matched_tokens(first, 0)  # vLLM asks again while the request waits for room
check("a request looked up again holds once", holds_now() == 1)
flood(1)
scheduler.after_alloc(first, blocks_of(list(range(PROMPT_BLOCKS + 1))), tokens)
metadata = scheduler.build_metadata(EMPTY_STEP)
check("the step loads what was counted", [len(spec.hashes) for spec in metadata.loads] == [PROMPT_BLOCKS])
loaded = loadable(hashes)
check("the blocks counted survive a flood", loaded == PROMPT_BLOCKS, loaded=loaded)
for _ in range(LOAD_WINDOW_STEPS - 1):
    scheduler.build_metadata(EMPTY_STEP)
check("held through the load window", holds_now() == 1)
scheduler.build_metadata(EMPTY_STEP)
check("released once the load window has passed", holds_now() == 0)
scheduler.finished(first)

# 1b. a request that finishes right after its load's step (one token, then the engine idles)
early = looked_up("r1b", 11)
scheduler.after_alloc(early, blocks_of(list(range(PROMPT_BLOCKS + 1))), PROMPT_BLOCKS * BLOCK_SIZE)
scheduler.build_metadata(EMPTY_STEP)
scheduler.finished(early)
check("a request that finishes releases its load's hold at once", holds_now() == 0)

# 2. vLLM takes none of the hit (e.g. its own prefix cache covers it): released at once
second = looked_up("r2", 2)
scheduler.after_alloc(second, blocks_of([]), 0)
scheduler.build_metadata(EMPTY_STEP)
check("a hit vLLM does not take is released", holds_now() == 0)
scheduler.finished(second)

# 3. a request that finishes (aborted while waiting) before it is allocated: released
scheduler.finished(looked_up("r3", 3))
scheduler.build_metadata(EMPTY_STEP)
check("a request that finishes unscheduled is released", holds_now() == 0)

# 4. the scheduler goes away: its holds go with its connection
looked_up("r4", 4)
scheduler.close()
check("a closed scheduler holds nothing", holds_now() == 0)

# 5. a load beside the steps (a hit in a slow tier; here host is made one) keeps its hold
# until vLLM schedules the request, its load done, however many steps that takes
scheduler = SchedulerSide(replace(settings, async_load_tiers=(TierKind.HOST,)), GEOMETRY, "kv_both")
fifth = request("r5", 5)
store(fifth)
tokens, asynchronous = scheduler.num_new_matched_tokens(fifth, 0)
check("a slow tier's hit loads beside the steps", asynchronous and tokens == PROMPT_BLOCKS * BLOCK_SIZE)
block_ids = list(range(PROMPT_BLOCKS + 1))
scheduler.after_alloc(fifth, blocks_of(block_ids), tokens)
metadata = scheduler.build_metadata(EMPTY_STEP)
check("its load spec says so", [spec.asynchronous for spec in metadata.loads] == [True])
for _ in range(LOAD_WINDOW_STEPS + 2):
    scheduler.build_metadata(EMPTY_STEP)
check("held until the request is scheduled", holds_now() == 1)
scheduled = SimpleNamespace(
    num_scheduled_tokens={"r5": 5},
    scheduled_new_reqs=[SimpleNamespace(req_id="r5", num_computed_tokens=tokens, block_ids=(block_ids,))],
    scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
    preempted_req_ids=None,
)
scheduler.build_metadata(scheduled)
check("released once scheduled", holds_now() == 0)
scheduler.close()

sys.exit(0 if all(result["ok"] for result in results) else 1)
