"""`make demo`: a coding-agent session through a real `kvstore serve`, end to end.

Starts the daemon on its embedded defaults (no configuration file; only the socket and
the NVMe directory go to a scratch folder, and the NVMe tier is capped at 1 GiB so that
the demo does not preallocate half of your disk), then runs two engine processes turn by
turn: the *writer* prefills each turn's growing prompt and saves its KV blocks; the
*reader*, a second engine, finds the longest cached prefix and loads it through the
shared-memory slab instead of recomputing it. Prints per turn what was found and where,
and what that saves at an assumed prefill rate; then stops the daemon and removes
everything it made.

    python -m kvstore.demo [--turns N] [--prefill-tokens-per-s R]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvstore.errors import DaemonUnavailable
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.spawn import DaemonProcess, spawn_daemon
from kvstore.tier_kind import TierKind

# a small GQA model's KV: 8 layers, 4 KV heads of 128, fp16, 32-token blocks = 512 KiB/block
LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, block_size=32, dtype="float16")
NAMESPACE = Namespace("demo/agent-model", LAYOUT)


def prompt_for_turn(turn: int) -> np.ndarray:
    """System prompt + tool definitions, then every earlier turn's tool result."""
    rng = np.random.default_rng(7)
    prompt = [rng.integers(0, 32_000, 3_000)]
    for _ in range(turn):
        prompt.append(rng.integers(0, 32_000, int(rng.integers(400, 1_500))))
    return np.concatenate(prompt)


def kv_for(block_hash: bytes) -> torch.Tensor:
    """Deterministic stand-in for the KV an engine computes for a block."""
    seed = int.from_bytes(block_hash[:8], "little") & 0x7FFF_FFFF
    return torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def engine(socket_path: str, role: str, turn: int) -> None:
    """One engine call, in its own process: the writer saves, the reader loads."""
    from kvstore.client import KVStoreClient

    prompt = prompt_for_turn(turn)
    hashes = chain_hashes(prompt, LAYOUT.block_size)
    with KVStoreClient(socket_path) as client:
        digest = client.register_namespace(NAMESPACE)
        found = client.lookup(digest, hashes)
        if role == "writer":
            missing = hashes[found.num_blocks :]
            parent = hashes[found.num_blocks - 1] if found.num_blocks else None
            stored = client.save(digest, missing, [kv_for(h) for h in missing], parent_hash=parent)
            print(json.dumps({"stored": stored}))
            return
        into = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8) for _ in range(found.num_blocks)]
        started = time.perf_counter()
        loaded = client.load(digest, hashes[: found.num_blocks], into)
        seconds = time.perf_counter() - started
        if not all(torch.equal(t, kv_for(h)) for t, h in zip(into[:loaded], hashes)):
            raise SystemExit("demo: a loaded block differs from what was saved — this is a bug, please report it")
        tiers = [t.value for t in found.tiers[:loaded]]
        print(json.dumps({"tokens": len(prompt), "loaded": loaded, "load_s": seconds, "tiers": tiers}))


def run_engine(socket_path: Path, role: str, turn: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.demo", "--engine", role, "--socket", str(socket_path), "--turn", str(turn)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"demo: the {role} engine failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def start_daemon(workdir: Path) -> DaemonProcess:
    settings = {"server.grpc_port": 0, "server.metrics_port": 0, "nvme.directory": workdir / "nvme", "nvme.capacity_bytes": "1GiB"}
    try:
        return spawn_daemon(workdir / "kvstore.sock", settings, workdir / "daemon.log")
    except DaemonUnavailable as exc:
        raise SystemExit(f"demo: {exc}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description="kvstore demo: a growing agent session through kvstore serve")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0, help="assumed prefill rate of the engine")
    parser.add_argument("--engine", choices=("writer", "reader"), help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--turn", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine(args.socket, args.engine, args.turn)
        return

    workdir = Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    daemon = None
    try:
        print("starting kvstore serve on embedded defaults …", flush=True)
        daemon = start_daemon(workdir)
        socket_path, state = daemon.socket_path, daemon.state
        print(
            f"daemon {state['node_id']} (pid {state['pid']}): socket {socket_path}, gRPC {state['grpc_address']}, "
            f"metrics :{state['metrics_port']}"
        )
        block_bytes = LAYOUT.block_bytes
        print(
            f"\n{LAYOUT.block_bytes // 1024} KiB KV blocks of {LAYOUT.block_size} tokens; "
            "a writer engine saves each turn, a reader engine loads it\n"
        )
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hit':>5} {'host MiB':>9} {'nvme MiB':>9} {'load s':>7} {'saved s':>8}")
        total_tokens = total_hit = 0
        total_saved_s = 0.0
        for turn in range(1, args.turns + 1):
            run_engine(socket_path, "writer", turn)
            read = run_engine(socket_path, "reader", turn)
            hit_tokens = read["loaded"] * LAYOUT.block_size
            by_tier = {kind: read["tiers"].count(kind.value) * block_bytes / 2**20 for kind in (TierKind.HOST, TierKind.NVME)}
            saved_s = hit_tokens / args.prefill_tokens_per_s - read["load_s"]
            total_tokens += read["tokens"]
            total_hit += hit_tokens
            total_saved_s += saved_s
            print(
                f"{turn:>4} {read['tokens']:>7} {hit_tokens:>7} {hit_tokens / read['tokens']:>5.0%} "
                f"{by_tier[TierKind.HOST]:>9.1f} {by_tier[TierKind.NVME]:>9.1f} {read['load_s']:>7.3f} {saved_s:>8.2f}"
            )
        print(
            f"\nthe reader found {total_hit / total_tokens:.0%} of its prompt tokens in kvstore and skipped "
            f"{total_saved_s:.1f} s of prefill at {args.prefill_tokens_per_s:,.0f} tokens/s (net of load time)"
        )
        stats = subprocess.run([sys.executable, "-m", "kvstore", "--socket", str(socket_path), "stats"], capture_output=True, text=True)
        print("\n$ kvstore stats\n" + stats.stdout)
    finally:
        if daemon is not None:
            print(f"daemon stopped (exit {daemon.stop()}); removing {workdir}")
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
