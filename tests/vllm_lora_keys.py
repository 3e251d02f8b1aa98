"""The router's block extra keys against the vLLM connector's, for real vLLM requests.

    .venv-vllm/bin/python tests/vllm_lora_keys.py

Run by tests/test_router_lora.py with the vLLM venv's python. For each case it builds a
vLLM ``Request`` (with a ``LoRARequest`` and a ``cache_salt``, or either, or neither),
keys it with connectors/vllm_compat.block_extra_keys (vLLM's own
``generate_block_hash_extra_keys``, as the connector keys blocks) and the equivalent
OpenAI request with kvstore.gateway.prompts.block_extra_keys (as the router keys it), and
prints one JSON line per case: whether the two lists of keys and the two chains of block
hashes are equal, how many blocks carry a key, and the chain's last hash.
"""

from __future__ import annotations

import json

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from kvstore.connectors.vllm_compat import block_extra_keys as engine_extra_keys
from kvstore.gateway.prompts import LoraAdapter
from kvstore.gateway.prompts import block_extra_keys as router_extra_keys
from kvstore.hashing import chain_hashes

BLOCK = 32
PROMPT = [(i * 37 + 11) % 1000 for i in range(5 * BLOCK + 7)]  # five full blocks and a partial one
CASES = {
    "lora and salt": ("tuned", "/adapters/tuned-v1", "tenant-x"),
    "lora alone": ("tuned", "/adapters/tuned-v1", None),
    "another path": ("tuned", "/adapters/tuned-v2", None),
    "salt alone": (None, None, "tenant-x"),
    "neither": (None, None, None),
}


def main() -> None:
    for case, (name, path, salt) in CASES.items():
        lora = LoRARequest(lora_name=name, lora_int_id=1, lora_path=path) if name else None
        request = Request(case, PROMPT, SamplingParams(max_tokens=1), None, lora_request=lora, cache_salt=salt)
        engine = engine_extra_keys(request, BLOCK)
        payload = {"model": name or "/models/base", "prompt": PROMPT} | ({"cache_salt": salt} if salt else {})
        router = router_extra_keys(payload, len(PROMPT) // BLOCK, LoraAdapter(name, path) if name else None)
        hashes = chain_hashes(PROMPT, BLOCK, extra_keys=engine)
        same_hashes = hashes == chain_hashes(PROMPT, BLOCK, extra_keys=router)
        keyed = sum(key is not None for key in engine or ())
        result = {"case": case, "same_keys": engine == router, "same_hashes": same_hashes, "keyed_blocks": keyed}
        print(json.dumps(result | {"last_hash": hashes[-1].hex()}))


if __name__ == "__main__":
    main()
