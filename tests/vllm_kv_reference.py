"""Compare the KV blocks a vLLM instance stored in kvstore with a reference forward pass.

    .venv-vllm/bin/python tests/vllm_kv_reference.py SOCKET MODEL_DIR PROMPT.json NUM_BLOCKS [DTYPE]

Run by test_vllm_e2e with the vLLM venv's python (it needs transformers). It loads the
prompt's first NUM_BLOCKS blocks from the daemon under the namespace the connector is
expected to use (model path, DTYPE — bfloat16, or the fp8 kind of an fp8 KV cache —
HND planes, K then V), computes the same
prompt's keys and values with transformers' Llama, and prints, as JSON, the largest
difference of each plane against its reference — and of the K plane against the
reference V, which must be large (the comparison can fail).
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    socket_path, model_dir, prompt_path, num_blocks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dtype = sys.argv[5] if len(sys.argv) > 5 else "bfloat16"
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvstore.client import KVStoreClient
    from kvstore.hashing import chain_hashes
    from kvstore.layout import KVLayout
    from kvstore.namespace import Namespace

    prompt = json.loads(open(prompt_path).read())
    config = AutoConfig.from_pretrained(model_dir)
    block_size = 32
    heads, head_dim, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    layout = KVLayout(layers, heads, head_dim, block_size, dtype, 2, "HND")
    with KVStoreClient(socket_path) as client:
        digest = client.register_namespace(Namespace(model_dir, layout))
        hashes = chain_hashes(prompt, block_size)[:num_blocks]
        blocks = [torch.empty(layout.block_bytes, dtype=torch.uint8) for _ in hashes]
        loaded = client.load(digest, hashes, blocks)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        cache = model(torch.tensor([prompt[: num_blocks * block_size]]), use_cache=True).past_key_values
    stored = torch.stack([b.view(getattr(torch, dtype)).view(layers, 2, heads, block_size, head_dim).float() for b in blocks])
    # (blocks, layers, 2, heads, tokens, dim) -> (layers, 2, heads, blocks·tokens, dim)
    stored = stored.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, num_blocks * block_size, head_dim).float()
    keys = torch.stack([cache.layers[i].keys[0] for i in range(layers)]).float()
    values = torch.stack([cache.layers[i].values[0] for i in range(layers)]).float()
    print(
        json.dumps(
            {
                "loaded": loaded,
                "k_err": (stored[:, 0] - keys).abs().max().item(),
                "v_err": (stored[:, 1] - values).abs().max().item(),
                "k_vs_v_err": (stored[:, 0] - values).abs().max().item(),
                "scale": keys.abs().max().item(),
            }
        )
    )


if __name__ == "__main__":
    main()
