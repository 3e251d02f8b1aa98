"""An engine process for daemon tests: saves, loads or holds the blocks of a prompt
through the real client, and prints one JSON line with what happened.

    python engine_proc.py SOCKET save|load|hold SEED NUM_BLOCKS
"""

import json
import sys
import time

import torch

from kvstore.client import KVStoreClient
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")  # 32 KiB blocks
NAMESPACE = Namespace("test/tiny-llama", LAYOUT, tenant_salt="tests")


def kv_for(block_hash: bytes) -> torch.Tensor:
    seed = int.from_bytes(block_hash[:4], "little")
    return torch.randn(LAYOUT.block_bytes // 2, generator=torch.Generator().manual_seed(seed)).half()


def main() -> None:
    socket_path, mode, seed, num_blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    hashes = chain_hashes([(seed * 7919 + i) % 50_000 for i in range(num_blocks * LAYOUT.block_size)], LAYOUT.block_size)
    with KVStoreClient(socket_path) as client:
        digest = client.register_namespace(NAMESPACE)
        if mode == "save":
            result = {"stored": client.save(digest, hashes, [kv_for(h) for h in hashes])}
        elif mode == "load":
            into = [torch.empty(LAYOUT.block_bytes // 2, dtype=torch.float16) for _ in hashes]
            loaded = client.load(digest, hashes, into)
            intact = all(torch.equal(t, kv_for(h)) for t, h in zip(into[:loaded], hashes))
            result = {"loaded": loaded, "intact": intact, "lookup": client.lookup(digest, hashes).num_blocks}
        elif mode == "hold":
            lease = client.acquire(digest, hashes)
            print(json.dumps({"held": lease.num_blocks}), flush=True)
            time.sleep(600)
            return
        else:
            raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
