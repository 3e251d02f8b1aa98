"""`make demo`: a coding-agent session against kvstore's tiers, end to end on this machine.

An agent's prompt grows every turn (system prompt + tool definitions + every earlier tool
result). Each turn the "engine" hashes the prompt into chained block keys, asks the tier
manager for the longest cached prefix, loads those blocks (promoting any that were
demoted to NVMe), and saves the blocks it had to compute. A small host tier forces
demotion to NVMe; at the end the node restarts and the NVMe tier's catalogue comes back
from the slot headers alone.

    python -m kvstore.demo [--turns N] [--prefill-tokens-per-s R]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tiers.base import TierKind
from kvstore.tiers.host import HostTier, HostTierConfig
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig

MiB = 1024 * 1024
# a small GQA model's KV: 8 layers, 4 KV heads of 128, fp16, 32-token blocks = 512 KiB/block
LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=32, dtype="float16")
NAMESPACE = Namespace("demo/agent-model", LAYOUT)


def fake_kv(block_hash: bytes) -> torch.Tensor:
    """Deterministic stand-in for the KV an engine would compute for a block."""
    seed = int.from_bytes(block_hash[:8], "little") & 0x7FFF_FFFF
    return torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def make_manager(nvme_dir: Path, shm_name: str) -> TierManager:
    host = HostTier(HostTierConfig(capacity_bytes=48 * MiB, name=shm_name, page_bytes=8 * MiB))
    nvme = NvmeTier(NvmeTierConfig(directory=nvme_dir, capacity_bytes=512 * MiB, page_bytes=16 * MiB, file_bytes=128 * MiB))
    manager = TierManager(TierManagerConfig(high_watermark=0.9, low_watermark=0.7), [host, nvme])
    manager.register_namespace(NAMESPACE)
    return manager


def run_turn(manager: TierManager, prompt: np.ndarray) -> dict:
    hashes = chain_hashes(prompt, LAYOUT.block_size)
    digest = NAMESPACE.digest
    tiers_before = manager.lookup(digest, hashes)
    num_hit = 0
    while num_hit < len(hashes):  # a lease holds what fits in the host tier; load in rounds
        lease = manager.acquire(digest, hashes[num_hit:])
        if not lease.blocks:
            break
        for view, block_hash in zip(manager.lease_views(lease), hashes[num_hit:]):
            if not torch.equal(view, fake_kv(block_hash)):
                raise SystemExit("demo: a loaded block differs from what was saved — this is a bug, please report it")
        num_hit += len(lease.blocks)
        manager.release(lease.id)
    missing = hashes[num_hit:]
    parent = hashes[num_hit - 1] if num_hit else None
    manager.put(digest, missing, [fake_kv(h) for h in missing], parent_hash=parent)
    return {
        "blocks": len(hashes),
        "hit": num_hit,
        "from_host": sum(t is TierKind.HOST for t in tiers_before[:num_hit]),
        "from_nvme": sum(t is TierKind.NVME for t in tiers_before[:num_hit]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="kvstore demo: a growing agent session over host + NVMe tiers")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0, help="assumed prefill rate of the engine")
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    workdir = Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    shm_name = f"kvstore-demo-{uuid.uuid4().hex[:8]}"
    manager = make_manager(workdir / "nvme", shm_name)
    block_bytes = LAYOUT.block_bytes
    prompt = rng.integers(0, 32_000, 3_000)  # system prompt + tool definitions
    total_hit_tokens = total_tokens = 0
    print(f"kvstore demo: {LAYOUT.block_bytes // 1024} KiB blocks of {LAYOUT.block_size} tokens; host tier 48 MiB, NVMe tier 512 MiB")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hit':>6} {'host MiB':>9} {'nvme MiB':>9} {'saved s':>8}")
    try:
        for turn in range(1, args.turns + 1):
            prompt = np.concatenate([prompt, rng.integers(0, 32_000, int(rng.integers(400, 1_500)))])
            result = run_turn(manager, prompt)
            hit_tokens = result["hit"] * LAYOUT.block_size
            total_hit_tokens += hit_tokens
            total_tokens += len(prompt)
            print(
                f"{turn:>4} {len(prompt):>7} {hit_tokens:>7} {hit_tokens / len(prompt):>6.0%} "
                f"{result['from_host'] * block_bytes / MiB:>9.1f} {result['from_nvme'] * block_bytes / MiB:>9.1f} "
                f"{hit_tokens / args.prefill_tokens_per_s:>8.2f}"
            )
        stats = {s.kind.value: s for s in manager.tier_stats()}
        print(
            f"\nsession: {total_hit_tokens / total_tokens:.0%} of prompt tokens served from cache, "
            f"{total_hit_tokens / args.prefill_tokens_per_s:.1f} s of prefill saved at {args.prefill_tokens_per_s:,.0f} tokens/s"
        )
        print(f"tiers now: host {stats['host'].num_blocks} blocks, nvme {stats['nvme'].num_blocks} blocks")
        persisted = manager.persist()
        print(f"planned restart: {persisted} host blocks persisted to NVMe, host tier released")
        manager.close()

        started = time.perf_counter()
        manager = make_manager(workdir / "nvme", shm_name)
        restart_s = time.perf_counter() - started
        recovered = manager.counters["blocks_recovered"]
        result = run_turn(manager, prompt)
        print(
            f"restart: {recovered} blocks recovered from NVMe slot headers in {restart_s:.2f} s; "
            f"the last prompt now hits {result['hit'] * LAYOUT.block_size} of {len(prompt)} tokens"
        )
    finally:
        manager.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
