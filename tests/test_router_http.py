"""`kvstore router` in front of two real vLLM (CPU) replicas.

Each replica is vLLM's OpenAI server with the kvstore connector and vLLM's own prefix
cache, whose KV events its daemon subscribes to (``[[engines]]`` of the daemon's
configuration); both daemons publish their blocks, and their engines' GPU blocks, to one
real Redis, which is the router's index and session store. The tests share the one fleet
(module fixture, replicas started in parallel) and each uses prompts and session ids of
its own; the test that kills a replica runs last.

The same two engines serve prefill/decode disaggregation: replica-a's connector is a
``kv_producer`` and replica-b's a ``kv_consumer``, which serve requests without P/D marks
as ``kv_both`` would; the main router lists both as ``both``, a second router as the
prefill and the decode replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import subprocess
import sys
import time

import httpx
import pytest
from daemon_harness import daemons, eventually
from vllm_venv import require_vllm_venv

from bench.router_fleet import (
    BLOCK,
    MAX_MODEL_LEN,
    Answer,
    KvEvents,
    digest_of,
    engine_namespace,
    engines_config,
    model_with_chat_template,
    post,
    router_config,
    start_router,
    start_servers,
    stream,
)
from kvstore.hashing import chain_hashes
from kvstore.index.base import NodeMatch
from kvstore.index.redis import RedisIndex, RedisSessionStore
from kvstore.index.scoring import engine_node_id
from kvstore.tier_kind import TierKind

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

require_vllm_venv()

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_BODY_BYTES = 1 << 20
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "run_tests", "description": "run the test suite", "parameters": {"type": "object", "properties": {}}},
    },
]


def system_prompt(topic: str, words: int = 300) -> str:
    vocabulary = ["kv", "cache", "block", "prefix", "token", "layer", "tier", "slab", "engine", "router", "store", "decode", "prefill"]
    return f"{topic}: " + " ".join(f"{vocabulary[(i * 7 + len(topic)) % len(vocabulary)]}{i % 97}" for i in range(words))


class Fleet:
    def __init__(self, model, redis_url, replicas, router, workdir):
        self.model, self.redis_url, self.replicas, self.router, self.workdir = str(model), redis_url, replicas, router, workdir
        self.model_path = model

    def replica(self, node_id: str):
        return next(r for r in self.replicas if r.node_id == node_id)

    def other(self, node_id: str):
        return next(r for r in self.replicas if r.node_id != node_id)

    def chat(self, messages: list[dict], url: str | None = None, session: str | None = None, **fields) -> Answer:
        payload = {"model": self.model, "messages": messages, "max_tokens": 8, "temperature": 0.0, "tools": TOOLS, "tool_choice": "none"}
        payload.update(fields)
        answer = post(url or self.router.url, CHAT, payload, {"x-session-id": session} if session else {})
        assert answer.status == 200, answer.body
        return answer

    def start_router(self, name: str, replicas: list | None = None, **settings):
        replicas = self.replicas if replicas is None else replicas
        return start_router(self.workdir, name, self.model_path, self.redis_url, replicas, max_body_bytes=MAX_BODY_BYTES, **settings)

    def reload_router(self, router, replicas: list, **settings) -> None:
        """Rewrite ``router``'s file (as `start_router` wrote it, with ``replicas``) and SIGHUP it."""
        port = httpx.URL(router.url).port
        router.reload(router_config(self.model_path, self.redis_url, port, replicas, max_body_bytes=MAX_BODY_BYTES, **settings))

    def matches(self, keys: list) -> dict[str, NodeMatch]:
        """What the index answers for the chain ``keys``, by node."""
        found = self._ask_index(lambda index: index.match(engine_namespace(self.model_path).digest, keys))
        return {m.node_id: m for m in found}

    def live_nodes(self) -> list[str]:
        """The nodes the index lists as live (daemons, and engines whose caches their daemons publish)."""
        return sorted(node.node_id for node in self._ask_index(lambda index: index.nodes()))

    def _ask_index(self, question):
        """The answer of ``question(index)``, on a connection to the fleet's Redis index of its own."""

        async def ask():
            index = RedisIndex.from_url(self.redis_url)
            try:
                return await question(index)
            finally:
                await index.close()

        return asyncio.run(ask())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, redis_server):
    workdir = tmp_path_factory.mktemp("router")
    model = model_with_chat_template(workdir / "model")
    kv_events = [KvEvents.in_directory(workdir, node_id) for node_id in ("replica-a", "replica-b")]
    settings = {"index.backend": redis_server.url, "transport.handoff_timeout_s": "120"}
    with daemons(workdir) as start:
        started = []
        for node_id, events in zip(("replica-a", "replica-b"), kv_events):
            config = engines_config(workdir / f"{node_id}.toml", model, events)  # the daemon subscribes to its engine
            started.append(start(node_id=node_id, extra=settings, config=config))
        disaggregated = start_servers(model, workdir, started, roles=["prefill", "decode"], kv_events=kv_events)
        replicas = [dataclasses.replace(replica, role="both") for replica in disaggregated]
        routers = []
        try:
            router = start_router(
                workdir, "router", model, redis_server.url, replicas, max_body_bytes=MAX_BODY_BYTES, tenant_cache_interval_s=0.5
            )
            routers.append(router)
            yield Fleet(model, redis_server.url, replicas, router, workdir)
        finally:
            for router in routers:
                router.stop()
            for replica in replicas:
                replica.server.kill()


def router_load(fleet: Fleet) -> list[str]:
    """The router's load gauges per replica (in flight, queued prefill tokens, the engine's
    own running and waiting requests), as exposed."""
    gauges = ("kvstore_router_in_flight", "kvstore_router_queued", "kvstore_router_engine_requests")
    return [line for line in fleet.router.metrics().splitlines() if line.startswith(gauges)]


def vllm_prompt_tokens(fleet: Fleet) -> float:
    total = 0.0
    for replica in fleet.replicas:
        text = httpx.get(f"{replica.url}/metrics", timeout=10).text
        total += sum(float(v) for v in re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE))
    return total


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_malformed_requests_get_openai_errors_without_touching_an_engine(fleet):
    before = vllm_prompt_tokens(fleet)
    url = fleet.router.url

    def error_of(path: str, status: int, **request) -> dict:
        response = httpx.post(f"{url}{path}", timeout=30, **request)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"]
        return error

    assert error_of(CHAT, 400, content=b'{"model": "x", "messages": [')["type"] == "invalid_request_error"
    assert "JSON object" in error_of(COMPLETIONS, 400, content=b"[1, 2, 3]")["message"]
    assert error_of(COMPLETIONS, 400, json={"prompt": "hello"})["param"] == "model"
    unknown = error_of(CHAT, 404, json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert unknown["code"] == "model_not_found" and fleet.model in unknown["message"]
    assert error_of(CHAT, 400, json={"model": fleet.model, "messages": []})["param"] == "messages"
    assert (
        error_of(CHAT, 400, json={"model": fleet.model, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"})["param"]
        == "stream"
    )
    assert error_of(COMPLETIONS, 400, json={"model": fleet.model, "prompt": {"text": "hi"}})["param"] == "prompt"
    oversize = error_of(COMPLETIONS, 413, json={"model": fleet.model, "prompt": "kv " * MAX_BODY_BYTES})
    assert f"{MAX_BODY_BYTES:,}" in oversize["message"]
    assert vllm_prompt_tokens(fleet) == before  # no engine computed anything
    assert metric(fleet.router.metrics(), "kvstore_router_requests_total", replica="none") >= 8


def test_the_routers_token_ids_are_the_engines_for_chat_with_tools_and_completions(fleet):
    messages = [
        {"role": "system", "content": system_prompt("ids")},
        {"role": "user", "content": "read the tier module"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "tiers/host.py"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "class HostTier: slab of fixed slots"},
        {"role": "assistant", "content": "it is a slab"},
        {"role": "user", "content": "now run the tests"},
    ]
    answers = [
        fleet.chat(messages, return_token_ids=True),
        fleet.chat(messages[:2], return_token_ids=True, tools=TOOLS[:1]),
        fleet.chat(messages, return_token_ids=True, add_generation_prompt=False, continue_final_message=False),
    ]
    engine_ids = [answer.body["prompt_token_ids"] for answer in answers]
    completion = post(
        fleet.router.url, COMPLETIONS, {"model": fleet.model, "prompt": system_prompt("text"), "max_tokens": 4, "return_token_ids": True}
    )
    assert completion.status == 200, completion.body
    answers.append(completion)
    engine_ids.append(completion.body["choices"][0]["prompt_token_ids"])
    for answer, ids in zip(answers, engine_ids):
        assert answer.headers["x-kvstore-prompt-digest"] == digest_of(ids)
        assert int(answer.headers["x-kvstore-prompt-tokens"]) == len(ids) == answer.body["usage"]["prompt_tokens"]
    assert len({digest_of(ids) for ids in engine_ids}) == len(engine_ids)  # tools, turns and flags all change the tokens


def _completions_through(url: str, fleet: Fleet, topic: str, count: int) -> None:
    """``count`` text completions through the router at ``url``: each routed by the token
    ids the engine computed (the router's digest header against the engine's ids)."""
    for i in range(count):
        payload = {"model": fleet.model, "prompt": system_prompt(f"{topic}{i}", 60 + i), "max_tokens": 2, "return_token_ids": True}
        if i % 3 == 2:
            payload["add_special_tokens"] = False
        answer = post(url, COMPLETIONS, payload)
        assert answer.status == 200, answer.body
        ids = answer.body["choices"][0]["prompt_token_ids"]
        assert answer.headers["x-kvstore-prompt-digest"] == digest_of(ids), i
        assert int(answer.headers["x-kvstore-prompt-tokens"]) == len(ids)


def test_a_router_with_the_engines_tokenizer_tokenizes_text_completions_itself(fleet):
    from kvstore.gateway.tokenizer import CHECK_FIRST

    router = fleet.start_router("router-tokenizer", tokenizer=str(fleet.model_path))
    try:
        _completions_through(router.url, fleet, "local", CHECK_FIRST + 6)
        fleet.chat([{"role": "user", "content": "hello through a router that tokenizes"}], url=router.url)
        text = router.metrics()
    finally:
        router.stop()
    # the first CHECK_FIRST prompts, and the chat request, asked an engine; the rest did not
    assert metric(text, "kvstore_router_tokenized_total", where="engine") == CHECK_FIRST + 1
    assert metric(text, "kvstore_router_tokenized_total", where="router") == 6
    assert metric(text, "kvstore_router_tokenizer_mismatches_total") == 0


def test_a_router_whose_tokenizer_disagrees_with_the_engines_stops_using_it(fleet):
    """A tokenizer.json that adds a BOS token the engines' does not: the first prompt finds
    the disagreement, and every request is still routed by the engine's token ids."""
    tokenizer = json.loads((fleet.model_path / "tokenizer.json").read_text())
    assert tokenizer["post_processor"] is None  # the engines add no special token
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}},
    }
    wrong = fleet.workdir / "wrong-tokenizer.json"
    wrong.write_text(json.dumps(tokenizer))
    router = fleet.start_router("router-wrong-tokenizer", tokenizer=str(wrong))
    try:
        _completions_through(router.url, fleet, "wrong", 4)
        text = router.metrics()
        log = router.log.read_text()
    finally:
        router.stop()
    assert metric(text, "kvstore_router_tokenizer_mismatches_total") == 1
    assert metric(text, "kvstore_router_tokenized_total", where="router") == 0
    assert metric(text, "kvstore_router_tokenized_total", where="engine") == 4
    assert "disagrees with the engines" in log and "first differing at position 0" in log


def test_a_session_log_finds_a_timestamp_in_the_system_prompt_and_a_stripped_answer_where_they_are(fleet):
    """Six turns of a chat: at turn 3 the client's system prompt gains a timestamp, at turn
    5 it sends turn 4's answer back without its first words (stripped "reasoning"). The
    router reports each divergence at the token the engine's own prompt ids first differ."""
    session = "diverging-chat"
    system = system_prompt("divergence", 120)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "look at the tier code"}]
    prompts = []
    for turn in range(1, 7):
        if turn == 3:
            messages[0] = {"role": "system", "content": system.replace("divergence:", "divergence: it is 2026-12-06 10:00,", 1)}
        words = list(range(300, 400))  # tokens the tiny tokenizer decodes to text (the model has more ids than it)
        answer = fleet.chat(messages, session=session, return_token_ids=True, tools=TOOLS[:1], ignore_eos=True, allowed_token_ids=words)
        prompts.append(answer.body["prompt_token_ids"])
        text = answer.body["choices"][0]["message"]["content"] or ""
        assert len(text) >= 2, json.dumps(answer.body)[:3000]  # an answer with something to strip
        sent_back = text[len(text) // 2 :] if turn == 4 else text
        messages += [{"role": "assistant", "content": sent_back}, {"role": "user", "content": f"next step {turn}"}]
    found = httpx.get(f"{fleet.router.url}/kvstore/sessions/{session}", timeout=10)
    assert found.status_code == 200, found.text
    turns = {t["number"]: t for t in found.json()["turns"]}
    assert [n for n, t in turns.items() if t["divergence"]] == [3, 5]
    at_3 = next(i for i, (a, b) in enumerate(zip(prompts[1], prompts[2])) if a != b)
    assert (turns[3]["divergence"]["at"], turns[3]["divergence"]["part"]) == (at_3, "system prompt")
    assert turns[3]["divergence"]["lost_tokens"] >= len(prompts[1]) - at_3
    assert turns[3]["divergence"]["after"][8] == prompts[2][at_3]  # the token ids around the point, this turn's
    assert prompts[4][: len(prompts[3])] == prompts[3]  # turn 5 extends turn 4's prompt, not its answer
    assert (turns[5]["divergence"]["at"], turns[5]["divergence"]["part"]) == (len(prompts[3]), "the last answer")
    assert all(t["done"] and sum(t["causes"].values()) == t["prompt_tokens"] - t["cached_tokens"] for t in turns.values())
    assert turns[6]["divergence"] is None and turns[6]["causes"]["diverged"] == 0


def test_a_session_stays_on_its_replica_and_its_later_turns_hit(fleet):
    messages = [{"role": "system", "content": system_prompt("turns")}, {"role": "user", "content": "first question about blocks"}]
    replicas, previous_prompt = set(), 0
    for turn in range(4):
        answer = fleet.chat(messages, session="turns-1")
        replicas.add(answer.replica)
        prompt = answer.body["usage"]["prompt_tokens"]
        if turn > 0:
            assert answer.headers["x-kvstore-route"] == "sticky"
            # everything the last turn's prompt filled, but the block its end may re-tokenize
            assert answer.cached_tokens >= (previous_prompt // BLOCK - 1) * BLOCK > 0, answer.body["usage"]
        previous_prompt = prompt
        messages += [
            {"role": "assistant", "content": answer.body["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"follow-up number {turn} on the prefix tier"},
        ]
    assert len(replicas) == 1


def test_a_cache_salt_is_hashed_as_the_engine_keys_it(fleet):
    messages = [{"role": "system", "content": system_prompt("salted")}, {"role": "user", "content": "a tenant's prompt"}]
    first = fleet.chat(messages, session="salt-1", cache_salt="tenant-x")
    time.sleep(1)  # the daemon publishes its blocks to Redis in batches
    again = fleet.chat(messages, session="salt-2", cache_salt="tenant-x")  # another session: only the index can send it there
    assert again.replica == first.replica
    # what the router expected to find is what the engine found (the engine computes a prompt's last token
    # even when every block is cached): the salted chain's keys are the connector's
    expected = min(int(again.headers["x-kvstore-expected-cached-tokens"]), again.body["usage"]["prompt_tokens"] - 1)
    assert again.cached_tokens == expected > 0
    unsalted = fleet.chat(messages, session="salt-3")
    assert int(unsalted.headers["x-kvstore-expected-cached-tokens"]) < again.cached_tokens  # never the tenant's blocks


def test_a_new_session_sharing_a_system_prompt_goes_to_the_replica_that_holds_it(fleet):
    a, b = fleet.replicas
    prompts = {a.node_id: system_prompt("held by a"), b.node_id: system_prompt("held by b")}
    for node_id, prompt in prompts.items():  # each replica computes one system prompt, bypassing the router
        fleet.chat([{"role": "system", "content": prompt}, {"role": "user", "content": "warm up"}], url=fleet.replica(node_id).url)
    time.sleep(1)  # the daemons publish their blocks to Redis in batches
    for node_id, prompt in prompts.items():
        answer = fleet.chat([{"role": "system", "content": prompt}, {"role": "user", "content": f"a new session on {node_id}"}])
        assert answer.replica == node_id
        assert answer.headers["x-kvstore-route"] == "best_cost"
        assert answer.headers["x-kvstore-session"].startswith("c:")  # derived from the conversation's start
        assert answer.cached_tokens >= int(answer.headers["x-kvstore-expected-cached-tokens"]) > 0


def test_an_engines_gpu_prefix_cache_is_in_the_index_and_the_router_sends_its_prompt_there(fleet):
    a = fleet.replicas[0]
    engine = engine_node_id("vllm", a.node_id)  # its daemon's [[engines]] name, at its node
    namespace = engine_namespace(fleet.model_path)
    messages = [{"role": "system", "content": system_prompt("gpu cache")}, {"role": "user", "content": "compute me"}]
    ids = fleet.chat(messages, url=a.url, return_token_ids=True).body["prompt_token_ids"]
    keys = chain_hashes(ids, BLOCK)

    def matches() -> dict[str, NodeMatch]:
        return fleet.matches(keys)

    # the engine's KV events put its prompt's blocks in the index as tier gpu, under its own node
    deadline = time.monotonic() + 20
    while matches().get(engine) != NodeMatch(engine, (TierKind.GPU,) * len(keys)):
        assert time.monotonic() < deadline, matches()
        time.sleep(0.2)
    # its daemon lets go of its copy: only the engine's GPU cache holds the prompt now
    command = [sys.executable, "-m", "kvstore", "--address", a.daemon.address, "evict", "--namespace", namespace.id]
    evicted = subprocess.run([*command, *(key.hex() for key in keys)], capture_output=True, text=True, timeout=60)
    assert evicted.returncode == 0, evicted.stderr
    deadline = time.monotonic() + 10
    while a.node_id in matches():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # a new session sharing the system prompt goes where the engine holds it, expecting its GPU blocks
    answer = fleet.chat([messages[0], {"role": "user", "content": "a new session, same system prompt"}], return_token_ids=True)
    # what the router saw, should it choose otherwise: the index, and each replica's load as it prices it
    seen = {"matches": matches(), "live": fleet.live_nodes(), "headers": dict(answer.headers), "router": router_load(fleet)}
    assert (answer.replica, answer.headers["x-kvstore-route"]) == (a.node_id, "best_cost"), str(seen)  # a string: shown whole
    later = answer.body["prompt_token_ids"]
    common = next((i for i, (x, y) in enumerate(zip(ids, later)) if x != y), min(len(ids), len(later)))
    assert int(answer.headers["x-kvstore-expected-cached-tokens"]) == common // BLOCK * BLOCK > 0
    assert answer.cached_tokens == common // BLOCK * BLOCK  # served from the engine's own prefix cache
    shown = subprocess.run(
        [sys.executable, "-m", "kvstore", "--address", a.daemon.address, "status"], capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and "engine vllm: connected" in shown.stdout, shown.stdout + shown.stderr


def test_a_streamed_response_through_the_router_is_token_identical_to_the_engines(fleet):
    messages = [{"role": "system", "content": system_prompt("stream")}, {"role": "user", "content": "stream me an answer"}]
    request = {
        "model": fleet.model,
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0.0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    routed = stream(fleet.router.url, CHAT, request)
    assert routed.status == 200 and routed.replica
    direct = stream(fleet.replica(routed.replica).url, CHAT, request)

    def tokens(answer: Answer) -> list[int]:
        return [t for event in answer.events for choice in event.get("choices", []) for t in choice.get("token_ids") or []]

    def text(answer: Answer) -> str:
        return "".join(choice["delta"].get("content") or "" for event in answer.events for choice in event.get("choices", []))

    assert len(tokens(routed)) == 24 and tokens(routed) == tokens(direct)
    assert text(routed) == text(direct)
    # passed through event by event, not as one body: how many events the engine makes of
    # 24 tokens depends on its timing (it coalesces a step's outputs when it runs behind),
    # so two requests are not compared event for event
    assert sum(1 for event in routed.events for choice in event.get("choices", []) if choice.get("token_ids")) > 1
    assert routed.events[0]["prompt_token_ids"] == direct.events[0]["prompt_token_ids"]
    assert routed.headers["x-kvstore-prompt-digest"] == digest_of(direct.events[0]["prompt_token_ids"])


def test_two_routers_share_sessions_through_redis(fleet):
    second = fleet.start_router("router-2")
    try:
        turn_1 = [{"role": "system", "content": system_prompt("shared")}, {"role": "user", "content": "turn one"}]
        first = fleet.chat(turn_1, session="shared-1")
        home, away = first.replica, fleet.other(first.replica)
        turn_2 = turn_1 + [{"role": "assistant", "content": first.body["choices"][0]["message"]["content"]}]
        turn_2 += [{"role": "user", "content": "turn two"}]
        fleet.chat(turn_2, url=away.url)  # the other replica now holds all of turn two …
        time.sleep(1)
        control = fleet.chat(turn_2, url=second.url, session="shared-control")
        assert control.replica == away.node_id  # … so a session the routers have not seen goes there
        for turn, url in enumerate((second.url, fleet.router.url, second.url)):
            answer = fleet.chat(turn_2, url=url, session="shared-1")
            assert (answer.replica, answer.headers["x-kvstore-route"]) == (home, "sticky"), turn
    finally:
        second.stop()


def test_metrics_attribute_tokens_to_replicas_and_tenants(fleet):
    messages = [{"role": "system", "content": system_prompt("tenant")}, {"role": "user", "content": "attribute me"}]
    payload = {"model": fleet.model, "messages": messages, "max_tokens": 4, "temperature": 0.0}
    answers = [post(fleet.router.url, CHAT, payload, {"x-tenant-id": "team-a", "x-session-id": "tenant-1"}) for _ in range(2)]
    assert all(a.status == 200 for a in answers)
    node_id = answers[0].replica
    text = fleet.router.metrics()
    assert metric(text, "kvstore_router_tenant_prompt_tokens_total", tenant="team-a") == sum(
        a.body["usage"]["prompt_tokens"] for a in answers
    )
    assert metric(text, "kvstore_router_tenant_cached_tokens_total", tenant="team-a") == answers[1].cached_tokens > 0
    assert metric(text, "kvstore_router_prompt_tokens_count", replica=node_id) >= 2
    assert 0 < metric(text, "kvstore_router_hit_rate", replica=node_id) < 1
    assert metric(text, "kvstore_router_ttft_seconds_count", replica=node_id, stream="false") >= 2
    assert metric(text, "kvstore_router_ttft_seconds_count", stream="true") >= 1  # the streaming test's
    assert metric(text, "kvstore_router_decisions_total", reason="sticky") >= 1
    assert metric(text, "kvstore_router_decisions_total", reason="best_cost") >= 1
    for replica in fleet.replicas:
        assert metric(text, "kvstore_router_replica_healthy", replica=replica.node_id) == 1
    # the cache bytes its chain holds: only team-a's requests carry this system prompt, so
    # its blocks are team-a's alone, each counted once though the daemon and the engine both hold it
    num_blocks, block_bytes = answers[0].body["usage"]["prompt_tokens"] // BLOCK, engine_namespace(fleet.model_path).block_bytes

    def team_a_cache() -> tuple[float, float]:
        text = fleet.router.metrics()
        return metric(text, "kvstore_router_tenant_cache_blocks", tenant="team-a"), metric(
            text, "kvstore_router_tenant_cache_bytes", tenant="team-a"
        )

    figures = eventually(lambda: (f := team_a_cache())[0] >= num_blocks - 1 and f, timeout_s=30)  # refreshed every 0.5 s
    assert figures, team_a_cache()
    held, held_bytes = figures
    assert num_blocks - 1 <= held <= num_blocks and held_bytes == held * block_bytes > 0
    # the same figures in `kvstore stats --fleet --router URL`, beside the daemons'
    command = [sys.executable, "-m", "kvstore", "--address", fleet.replicas[0].daemon.address, "--json", "stats", "--fleet"]
    shown = subprocess.run([*command, "--router", fleet.router.url], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert {n["node_id"] for n in document["nodes"]} == {r.node_id for r in fleet.replicas}
    row = document["router"]["replicas"][node_id]
    assert row["prompt_tokens"] >= sum(a.body["usage"]["prompt_tokens"] for a in answers) and 0 < row["hit_rate"] < 1
    assert row["ttft_p50_s"] > 0 and document["router"]["decisions"]["sticky"] >= 1
    assert document["router"]["tenants"]["team-a"]["cache_bytes"] >= (num_blocks - 1) * block_bytes


def test_draining_a_replicas_daemon_moves_its_sessions_and_the_router_follows_them(fleet):
    messages = [{"role": "system", "content": system_prompt("drained")}, {"role": "user", "content": "before the drain"}]
    first = fleet.chat(messages, session="drain-1")
    source, heir = fleet.replica(first.replica), fleet.other(first.replica)
    command = [sys.executable, "-m", "kvstore", "--address", source.daemon.address, "--json", "drain", "--to", heir.node_id]
    drained = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert drained.returncode == 0, drained.stderr
    report = json.loads(drained.stdout)
    assert report["sessions_moved"] >= 1 and report["blocks_by_peer"][heir.node_id] > 0
    messages += [{"role": "assistant", "content": first.body["choices"][0]["message"]["content"]}, {"role": "user", "content": "after"}]
    moved = fleet.chat(messages, session="drain-1")
    assert (moved.replica, moved.headers["x-kvstore-route"]) == (heir.node_id, "sticky")
    # the heir serves the session's chain from the blocks the drain copied to its daemon
    assert moved.cached_tokens >= (first.body["usage"]["prompt_tokens"] // BLOCK - 1) * BLOCK


PD_PROMPT = "prefill on one replica and decode on another " * 40


def test_the_router_runs_prefill_and_decode_on_their_replicas_with_the_kv_handed_off(fleet):
    a, b = fleet.replicas
    prefill, decode = dataclasses.replace(a, role="prefill"), dataclasses.replace(b, role="decode")
    router = start_router(fleet.workdir, "router-pd", fleet.model_path, fleet.redis_url, [prefill, decode])
    try:
        request = {"model": fleet.model, "prompt": PD_PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        request["return_token_ids"] = True
        answer = post(router.url, COMPLETIONS, request)
        assert answer.status == 200, answer.body
        assert (answer.headers["x-kvstore-prefill-replica"], answer.replica) == (prefill.node_id, decode.node_id)
        num_blocks = answer.body["usage"]["prompt_tokens"] // BLOCK
        # the decode replica loaded every full block from the handoff the router named (vLLM's
        # usage counts no cached tokens for a remote prefill, so its connector's log says it)
        handoffs = re.findall(r"loads (\d+) tokens \((\d+) blocks\) from handoff 'kvstore-router-", decode.server.log.read_text())
        assert handoffs == [(str(num_blocks * BLOCK), str(num_blocks))]
        # the tokens one replica decodes alone, computing the prompt itself: a cache salt keeps
        # it from the blocks of the handoff, in its daemon and in its own prefix cache
        alone = post(decode.url, COMPLETIONS, {**request, "cache_salt": "computed-alone"})
        assert alone.status == 200 and alone.cached_tokens == 0, alone.body
        assert alone.body["choices"][0]["token_ids"] == answer.body["choices"][0]["token_ids"]

        streamed = stream(router.url, COMPLETIONS, {**request, "prompt": PD_PROMPT + " streamed"})
        assert streamed.status == 200 and streamed.replica == decode.node_id
        tokens = [t for event in streamed.events for choice in event.get("choices", []) for t in choice.get("token_ids") or []]
        assert len(tokens) == 12
    finally:
        router.stop()


def test_a_replica_that_joins_is_warmed_and_takes_new_sessions_while_the_first_one_is_busy(fleet):
    a, b = fleet.replicas
    # this router checks its replicas at start and on SIGHUP only: the engines' own queue
    # gauges, read by a check, never count a request this test has already finished
    router = fleet.start_router("router-scale-up", replicas=[a], health_interval_s=600)
    try:
        # a prompt neither replica has seen, from its first block on: no tools, whose blocks lead
        # the other tests' prompts (and which one of them evicts from replica-a's daemon, where
        # the engine's GPU cache still serves them: what its daemon saves after them has no root
        # there, and a chain without its root is not warmed)
        system = {"role": "system", "content": system_prompt("scale up")}

        def question(name: str) -> list[dict]:  # its own text fills blocks of the session's own
            return [system, {"role": "user", "content": f"{name}: " + " ".join(f"{name}-{i}" for i in range(40))}]

        def ask(messages: list[dict], session: str) -> Answer:
            payload = {"model": fleet.model, "messages": messages, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
            answer = post(router.url, CHAT, payload, {"x-session-id": session})
            assert answer.status == 200, answer.body
            return answer

        earlier = {session: ask(question(session), session) for session in ("alpha", "beta")}
        assert {answer.replica for answer in earlier.values()} == {a.node_id}
        first_ids, second_ids = (answer.body["prompt_token_ids"] for answer in earlier.values())
        common = next(i for i, (x, y) in enumerate(zip(first_ids, second_ids)) if x != y)
        shared = chain_hashes(first_ids[: common // BLOCK * BLOCK], BLOCK)  # the system prompt's full blocks
        assert len(shared) >= 8 and len(first_ids) - len(shared) * BLOCK >= 2 * BLOCK

        def held(node_id: str) -> int:  # blocks of the shared prefix that the node's daemon holds, as the index says
            match = fleet.matches(shared).get(node_id)
            return match.num_blocks if match else 0

        def wait_until_held(node_id: str) -> None:  # daemons publish their blocks in batches
            deadline = time.monotonic() + 20
            while held(node_id) != len(shared):
                assert time.monotonic() < deadline, fleet.matches(shared)
                time.sleep(0.2)

        wait_until_held(a.node_id)
        assert held(b.node_id) == 0

        # a file that does not load is refused, and the router keeps routing to replica-a alone
        router.reload("[[router.replicas]\n")
        deadline = time.monotonic() + 20
        while metric(router.metrics(), "kvstore_router_config_reloads_total", result="refused") != 1:
            assert time.monotonic() < deadline, router.log.read_text()
            time.sleep(0.2)
        assert "configuration reload refused, the replica list stays replica-a:" in router.log.read_text()
        assert metric(router.metrics(), "kvstore_router_config_last_reload_successful") == 0

        # replica-b joins: its daemon fetches the fleet's shared prefixes, then the router lists it
        command = [sys.executable, "-m", "kvstore", "--address", b.daemon.address, "--json", "warm", "--from", a.node_id]
        warmed = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert warmed.returncode == 0, warmed.stderr
        assert json.loads(warmed.stdout)["blocks_by_peer"][a.node_id] > 0
        wait_until_held(b.node_id)
        fleet.reload_router(router, [a, b], health_interval_s=600)
        deadline = time.monotonic() + 30
        while metric(router.metrics(), "kvstore_router_replica_healthy", replica=b.node_id) != 1:
            assert time.monotonic() < deadline, router.log.read_text()
            time.sleep(0.2)
        text = router.metrics()
        assert metric(text, "kvstore_router_config_reloads_total", result="applied") == 1
        assert metric(text, "kvstore_router_config_last_reload_successful") == 1
        assert metric(text, "kvstore_router_in_flight", replica=b.node_id) == 0
        assert f"configuration reloaded: added {b.node_id}." in router.log.read_text()

        # replica-a is busy: a long answer of session alpha's streams while new sessions arrive
        turn = question("alpha") + [{"role": "assistant", "content": earlier["alpha"].body["choices"][0]["message"]["content"]}]
        busy = {"model": fleet.model, "messages": [*turn, {"role": "user", "content": "now explain every tier at length"}]}
        busy |= {"temperature": 0.0, "ignore_eos": True, "stream": True}
        busy["max_tokens"] = MAX_MODEL_LEN - earlier["alpha"].body["usage"]["prompt_tokens"] - 4 * BLOCK
        with httpx.stream("POST", f"{router.url}{CHAT}", json=busy, headers={"x-session-id": "alpha"}, timeout=120) as long:
            assert (long.status_code, long.headers["x-kvstore-replica"], long.headers["x-kvstore-route"]) == (200, a.node_id, "sticky")
            lines = long.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # its first event: it decodes on replica-a
            assert metric(router.metrics(), "kvstore_router_in_flight", replica=a.node_id) == 1
            # new sessions go where the prefix is as cheap and nothing waits: the warmed replica-b,
            # which loads the shared blocks from its daemon (it never computed them)
            for session in ("gamma", "delta"):
                new = ask(question(session), session)
                assert (new.replica, new.headers["x-kvstore-route"]) == (b.node_id, "best_cost")
                assert new.body["prompt_token_ids"][: len(shared) * BLOCK] == first_ids[: len(shared) * BLOCK]
                assert int(new.headers["x-kvstore-expected-cached-tokens"]) >= len(shared) * BLOCK
                assert new.cached_tokens >= len(shared) * BLOCK, new.body["usage"]
            # the earlier session not in flight stays where its own blocks are
            follow_up = question("beta") + [{"role": "assistant", "content": earlier["beta"].body["choices"][0]["message"]["content"]}]
            again = ask([*follow_up, {"role": "user", "content": "and the next step"}], "beta")
            assert (again.replica, again.headers["x-kvstore-route"]) == (a.node_id, "sticky")
            assert metric(router.metrics(), "kvstore_router_in_flight", replica=a.node_id) == 1  # busy all along
        deadline = time.monotonic() + 20
        while metric(router.metrics(), "kvstore_router_in_flight", replica=a.node_id) != 0:  # the stream's close reached it
            assert time.monotonic() < deadline
            time.sleep(0.2)
        text = router.metrics()
        assert metric(text, "kvstore_router_requests_total", replica=b.node_id, status="200") == 2
        assert metric(text, "kvstore_router_cached_tokens_total", replica=b.node_id) >= 2 * len(shared) * BLOCK
        assert metric(text, "kvstore_router_requests_total", replica="none") == 0
    finally:
        router.stop()


def test_killing_a_replica_mid_session_moves_the_session_without_a_client_error(fleet):
    # this router notices only through its requests: its health checks are ten minutes apart
    blind = fleet.start_router("router-blind", health_interval_s=600)
    try:
        # token ids, so that the request itself (not a /tokenize call) is what finds the replica dead
        rng = random.Random(7)
        prompt = [rng.randrange(2, 1000) for _ in range(12 * BLOCK)]

        def complete(prompt: list[int]) -> Answer:
            payload = {"model": fleet.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
            answer = post(blind.url, COMPLETIONS, payload, {"x-session-id": "kill-1"})
            assert answer.status == 200, answer.body
            return answer

        first = complete(prompt)
        doomed, survivor = fleet.replica(first.replica), fleet.other(first.replica)
        doomed.server.kill()
        prompt += first.body["choices"][0]["token_ids"] + [rng.randrange(2, 1000) for _ in range(BLOCK)]
        moved = complete(prompt)
        assert moved.replica == survivor.node_id and moved.headers["x-kvstore-route"] == "retry"
        again = complete(prompt)
        assert again.replica == survivor.node_id and again.headers["x-kvstore-route"] == "sticky"
        assert again.cached_tokens > 0  # the session's new replica computed and kept its prefix
        text = blind.metrics()
        assert metric(text, "kvstore_router_retries_total", replica=doomed.node_id) == 1
        assert metric(text, "kvstore_router_session_moves_total", reason="retry") == 1
        assert metric(text, "kvstore_router_replica_healthy", replica=doomed.node_id) == 0
    finally:
        blind.stop()

    async def moves() -> list[dict]:
        store = RedisSessionStore(fleet.redis_url)
        try:
            return await store.moves(100)
        finally:
            await store.close()

    move = next(m for m in asyncio.run(moves()) if m["session"] == "h:kill-1")
    assert (move["from"], move["to"]) == (doomed.node_id, survivor.node_id)
    assert move["reason"].startswith(f"retry after {doomed.node_id}: connect refused")
    # the router with health checks takes the dead replica out of rotation by itself
    deadline = time.monotonic() + 30
    while metric(fleet.router.metrics(), "kvstore_router_replica_healthy", replica=doomed.node_id) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    payload = {"model": fleet.model, "prompt": prompt, "max_tokens": 4}
    assert post(fleet.router.url, COMPLETIONS, payload, {"x-session-id": "kill-1"}).replica == survivor.node_id
