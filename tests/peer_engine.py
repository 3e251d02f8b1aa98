"""An engine process for transport tests: remote loads and prefill → decode handoffs
through the real client, printing one JSON line (or one per layer with --progress).

    python peer_engine.py SOCKET fetch SEED NUM_BLOCKS [SOURCE]
    python peer_engine.py SOCKET produce SEED NUM_BLOCKS TRANSFER DESTINATION [SECONDS_PER_LAYER]
    python peer_engine.py SOCKET consume SEED NUM_BLOCKS TRANSFER
"""

import json
import sys
import time

import torch
from engine_proc import LAYOUT, NAMESPACE, kv_for

from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError
from kvstore.hashing import chain_hashes


def hashes_for(seed: int, num_blocks: int) -> list[bytes]:
    return chain_hashes([(seed * 7919 + i) % 50_000 for i in range(num_blocks * LAYOUT.block_size)], LAYOUT.block_size)


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    socket_path, mode, seed, num_blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    args = sys.argv[5:]
    hashes = hashes_for(seed, num_blocks)
    with KVStoreClient(socket_path) as client:
        digest = client.register_namespace(NAMESPACE)
        if mode == "fetch":
            into = [torch.empty(LAYOUT.block_bytes // 2, dtype=torch.float16) for _ in hashes]
            started = time.perf_counter()
            loaded = client.load(digest, hashes, into, allow_remote=True, deadline_s=20, source=args[0] if args else None)
            seconds = time.perf_counter() - started
            intact = all(torch.equal(t, kv_for(h)) for t, h in zip(into[:loaded], hashes))
            emit(loaded=loaded, intact=intact, seconds=seconds)
        elif mode == "produce":
            transfer, destination = args[0], args[1]
            per_layer_s = float(args[2]) if len(args) > 2 else 0.0
            sending = client.handoff_send(digest, hashes, transfer, destination)
            data = [kv_for(h).view(torch.uint8) for h in hashes]
            for layer in range(LAYOUT.num_layers):
                time.sleep(per_layer_s)  # the forward pass computing this layer
                offset, length = LAYOUT.layer_slice(layer)
                for view, block in zip(sending.views, data):
                    view[offset : offset + length] = block[offset : offset + length]
                client.handoff_layers_ready(transfer, layer)
                emit(layer=layer)
            emit(stored=client.handoff_finish(transfer, timeout_s=30))
        elif mode == "consume":
            transfer = args[0]
            receiving = client.handoff_receive(digest, transfer, timeout_s=30)
            expected = [kv_for(h).view(torch.uint8) for h in receiving.hashes]
            try:
                for layer in range(LAYOUT.num_layers):
                    client.handoff_wait_layers(transfer, layer + 1, timeout_s=30)
                    offset, length = LAYOUT.layer_slice(layer)
                    intact = all(
                        torch.equal(v[offset : offset + length], e[offset : offset + length]) for v, e in zip(receiving.views, expected)
                    )
                    emit(layer=layer, intact=intact)
            except KVStoreError as exc:
                emit(error=type(exc).__name__, message=str(exc))
                return
            client.handoff_close(transfer)
            emit(done=True, blocks=receiving.num_blocks, cached=client.lookup(digest, hashes).num_blocks)
        else:
            raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
