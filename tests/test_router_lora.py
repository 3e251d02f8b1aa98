"""`kvstore router` keys a LoRA adapter's requests as the engine does, and leaves
multimodal requests unkeyed.

First the pure parts: the router's extra keys, the adapters it reads from a replica's
``/v1/models``, and which replicas are candidates for an adapter's request. Then, in the
vLLM venv, the router's extra keys against the connector's (vLLM's own
``generate_block_hash_extra_keys``) for real vLLM requests (tests/vllm_lora_keys.py).
Last, real processes: one vLLM CPU engine serving a LoRA adapter (written here: a
``adapter_config.json`` and an ``adapter_model.safetensors`` of small random A/B
matrices for ``q_proj`` and ``v_proj``) with the kvstore connector, its daemon, Redis and
the router. vLLM's own prefix cache is off, so a cached token is one the connector
loaded from the daemon, under the keys it computed.
"""

from __future__ import annotations

import json
import random
import re
import struct
import subprocess
import time
from pathlib import Path

import httpx
import msgpack
import pytest
from daemon_harness import daemons
from vllm_venv import require_vllm_venv

from bench.router_fleet import BLOCK, MAX_MODEL_LEN, Answer, Replica, free_port, model_with_chat_template, post, start_router
from bench.vllm_engine import VLLM_PYTHON, ApiServer
from kvstore.gateway.config import ReplicaConfig
from kvstore.gateway.metrics import RouterMetrics
from kvstore.gateway.prompts import BadRequest, LoraAdapter, block_extra_keys, unkeyed_inputs
from kvstore.gateway.replicas import ReplicaSet, served_models

CHAT = "/v1/chat/completions"
ADAPTER = "tuned"
RANK = 8

# what vLLM 0.32's /v1/models lists for a base model and an adapter loaded with --lora-modules
CARDS = [
    {"id": "/models/base", "object": "model", "root": "/models/base", "parent": None, "max_model_len": 4096},
    {"id": ADAPTER, "object": "model", "root": "/adapters/tuned-v1", "parent": "/models/base", "max_model_len": None},
]


def test_an_adapter_is_keyed_on_every_block_and_a_salt_after_it_on_the_first():
    adapter = LoraAdapter(ADAPTER, "/adapters/tuned-v1")
    keys = block_extra_keys({"cache_salt": "tenant-x"}, 3, adapter)
    assert [msgpack.unpackb(key) for key in keys] == [
        [["lora", ADAPTER, "/adapters/tuned-v1"], ["cache_salt", "tenant-x"]],
        [["lora", ADAPTER, "/adapters/tuned-v1"]],
        [["lora", ADAPTER, "/adapters/tuned-v1"]],
    ]
    assert block_extra_keys({}, 2, adapter) == [msgpack.packb([["lora", ADAPTER, "/adapters/tuned-v1"]])] * 2
    assert block_extra_keys({}, 2, LoraAdapter(ADAPTER, "/adapters/tuned-v2")) != block_extra_keys({}, 2, adapter)
    assert block_extra_keys({"cache_salt": ""}, 2) is None and block_extra_keys({}, 0, adapter) is None
    with pytest.raises(BadRequest, match="cache_salt"):
        block_extra_keys({"cache_salt": 7}, 2, adapter)


def test_a_replicas_adapters_are_the_cards_with_a_parent():
    models, adapters = served_models(CARDS)
    assert models == ("/models/base", ADAPTER)
    assert adapters == {ADAPTER: "/adapters/tuned-v1"}
    # a card naming no path cannot be keyed: its path is empty
    assert served_models([{"id": "odd", "parent": "/models/base", "root": None}])[1] == {"odd": ""}
    with pytest.raises(ValueError):
        served_models({"id": ADAPTER})


def fleet_of(*served: list[dict]) -> ReplicaSet:
    configs = [ReplicaConfig(f"http://127.0.0.1:{9000 + i}", f"replica-{i}") for i in range(len(served))]
    replicas = ReplicaSet.of(configs, RouterMetrics([c.node_id for c in configs], 4))
    for replica, cards in zip(replicas.replicas.values(), served):
        replica.healthy = True
        replica.models, replica.adapters = served_models(cards)
    return replicas


def test_an_adapters_request_has_only_the_replicas_that_load_it_as_candidates():
    other_path = [CARDS[0], {**CARDS[1], "root": "/adapters/tuned-v2"}]
    replicas = fleet_of(CARDS, CARDS[:1], CARDS)
    assert [c.node_id for c in replicas.candidates(set(), model=ADAPTER)] == ["replica-0", "replica-2"]
    assert [c.node_id for c in replicas.candidates(set(), model="/models/base")] == ["replica-0", "replica-1", "replica-2"]
    assert [r.node_id for r in replicas.healthy(ADAPTER)] == ["replica-0", "replica-2"]  # where /tokenize knows its name
    assert replicas.adapter_paths(ADAPTER) == {"/adapters/tuned-v1"}
    assert replicas.adapter_paths("/models/base") == {None}
    # replicas that load the name from different paths key its blocks differently: the router keys none
    assert fleet_of(CARDS, other_path).adapter_paths(ADAPTER) == {"/adapters/tuned-v1", "/adapters/tuned-v2"}
    replicas.replicas["replica-2"].healthy = False
    assert [c.node_id for c in replicas.candidates(set(), model=ADAPTER)] == ["replica-0"]


def test_multimodal_inputs_and_prompt_embeddings_are_not_keyed():
    def chat(*parts) -> dict:
        return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": list(parts)}]}

    text = {"type": "text", "text": "what is this?"}
    assert unkeyed_inputs("chat", chat(text, {"text": "untyped text"}, {"type": "refusal", "refusal": "no"})) == ""
    assert unkeyed_inputs("completion", {"prompt": "hello"}) == ""
    for part in (
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://example.com/cat.mp4"}},
        {"image_url": {"url": "http://example.com/cat.png"}},  # vLLM infers the type from the key
    ):
        why = unkeyed_inputs("chat", chat(text, part))
        assert why.startswith("multimodal inputs"), part
    assert "'image_url'" in unkeyed_inputs("chat", chat({"type": "image_url", "image_url": {"url": "x"}}))
    assert unkeyed_inputs("completion", {"prompt_embeds": "AAAA"}) == "the prompt is given as embeddings"
    with pytest.raises(BadRequest, match="messages"):  # not tokenized, but checked all the same
        unkeyed_inputs("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}, "not a message"]})


def test_the_routers_extra_keys_are_the_connectors_for_real_vllm_requests():
    require_vllm_venv()
    script = Path(__file__).with_name("vllm_lora_keys.py")
    run = subprocess.run([str(VLLM_PYTHON), str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = {case["case"]: case for case in map(json.loads, (line for line in run.stdout.splitlines() if line.startswith("{")))}
    assert set(cases) == {"lora and salt", "lora alone", "another path", "salt alone", "neither"}
    assert all(case["same_keys"] and case["same_hashes"] for case in cases.values()), cases
    assert [cases[name]["keyed_blocks"] for name in ("lora and salt", "lora alone", "salt alone", "neither")] == [5, 5, 1, 0]
    # the adapter's path is in its keys: re-pointing a name at another adapter shares no block
    assert len({cases[name]["last_hash"] for name in cases}) == len(cases)


# -- real processes ---------------------------------------------------------------------------


def write_lora_adapter(directory: Path, model: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter for the Llama at ``model``: ``adapter_config.json`` and an
    ``adapter_model.safetensors`` (an 8-byte little-endian header length, a JSON header
    of dtype, shape and byte offsets per tensor, then the float32 data) holding
    ``lora_A`` (rank × in) and ``lora_B`` (out × rank) of q_proj and v_proj per layer."""
    geometry = json.loads((model / "config.json").read_text())
    hidden, head_dim = geometry["hidden_size"], geometry["head_dim"]
    outputs = {"q_proj": geometry["num_attention_heads"] * head_dim, "v_proj": geometry["num_key_value_heads"] * head_dim}
    rng = random.Random(seed)
    header: dict[str, dict] = {}
    data = bytearray()
    for layer in range(geometry["num_hidden_layers"]):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            for name, shape in ((f"{prefix}.lora_A.weight", (rank, hidden)), (f"{prefix}.lora_B.weight", (out, rank))):
                count = shape[0] * shape[1]
                header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [len(data), len(data) + 4 * count]}
                data += struct.pack(f"<{count}f", *(rng.gauss(0.0, 0.2) for _ in range(count)))
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(outputs),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def prompt_tokens_seen(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lora_request_is_hashed_as_the_engine_keys_it(tmp_path, redis_server):
    require_vllm_venv()
    model = model_with_chat_template(tmp_path / "model")
    adapter = write_lora_adapter(tmp_path / "adapter", model, RANK, seed=3)
    with daemons(tmp_path) as start:
        daemon = start(node_id="replica-a", extra={"index.backend": redis_server.url})
        connector = {"name": "KVStoreConnector", "module": "kvstore.connectors.vllm", "extra": {"socket_path": str(daemon.socket)}}
        lora = ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}", "--max-lora-rank", str(RANK), "--max-loras", "1"]
        plan = {"model": str(model), "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN, "connector": connector, "server_args": lora}
        server = ApiServer(plan, tmp_path, "replica-a", free_port(), timeout_s=400)
        router = None
        try:
            router = start_router(tmp_path, "router", model, redis_server.url, [Replica(daemon, server)])
            words = " ".join(f"adapter{i % 53} block{i % 31}" for i in range(150))
            messages = [{"role": "system", "content": words}, {"role": "user", "content": "a tuned prompt"}]

            def chat(name: str, session: str, content: list | None = None) -> Answer:
                payload = {"model": name, "messages": content or messages, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
                return post(router.url, CHAT, payload, {"x-session-id": session})

            first = chat(ADAPTER, "lora-1")
            assert first.status == 200 and first.headers["x-kvstore-route"] != "unkeyed", first.body
            time.sleep(1.5)  # the daemon publishes its blocks to Redis in batches
            again = chat(ADAPTER, "lora-2")  # another session: only the index can say what is cached
            assert again.status == 200, again.body
            # what the router expected is what the connector loaded (the engine computes a prompt's
            # last token even when every block is cached): the adapter's keys are the connector's
            expected = min(int(again.headers["x-kvstore-expected-cached-tokens"]), again.body["usage"]["prompt_tokens"] - 1)
            assert again.cached_tokens == expected > 0
            assert again.body["choices"][0]["token_ids"] == first.body["choices"][0]["token_ids"]  # the loaded KV is the adapter's
            base = chat(str(model), "lora-3")  # the base model, the same prompt: never the adapter's blocks
            assert base.status == 200 and int(base.headers["x-kvstore-expected-cached-tokens"]) < again.cached_tokens
            assert base.cached_tokens == 0

            # an unknown model is refused by the router alone, as before
            before = prompt_tokens_seen(server.url)
            unknown = chat("not-loaded", "lora-4")
            assert unknown.status == 404 and unknown.body["error"]["code"] == "model_not_found"
            assert ADAPTER in unknown.body["error"]["message"]  # the adapter is one of the models served
            assert prompt_tokens_seen(server.url) == before
            # media: routed by load and session alone, the reason said (what the engine answers is its own)
            image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
            media = chat(ADAPTER, "lora-5", [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
            assert media.headers["x-kvstore-route"] == "unkeyed" and "image_url" in media.headers["x-kvstore-unkeyed"]
            assert media.headers["x-kvstore-expected-cached-tokens"] == "0"
        finally:
            if router is not None:
                router.stop()
            server.kill()
