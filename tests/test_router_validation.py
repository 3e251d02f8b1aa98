"""`kvstore router` checks every field of an OpenAI request it reads before any engine sees
the request, and answers a malformed one with an OpenAI-format 400 naming the client's
field; an engine's own 4xx reaches the client in the same format, never as the engine's
dump. A real router process in front of `RecordingReplica`, a loopback HTTP server that
answers as vLLM's OpenAI server does and records every request it gets.

`RecordingReplica` and `running_router` serve test_router_auth.py too."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from daemon_harness import eventually

MODEL = "tiny"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# what vLLM answers when a chat request its router let through fails its own checks
ENGINE_REFUSES = "the engine refuses this"
VLLM_DUMP = {
    "error": {
        "message": "12 validation errors: {'type': 'string_type', 'loc': ('body', 'prompt'), 'msg': 'Input should be a valid string'}",
        "type": "Bad Request",
        "param": "body.prompt",
        "code": 400,
    }
}
MAX_MODEL_LEN = 2048
TOO_LONG = {  # vLLM's answer to a request longer than the model's context
    "error": {
        "message": f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested more.",
        "type": "BadRequestError",
        "param": "body.max_tokens",
        "code": 400,
    }
}
NAMESPACE = """
[router.namespace]
model_id = "/models/tiny"
num_layers = 2
num_kv_heads = 2
head_dim = 64
dtype = "bfloat16"
block_size = 16
"""


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


class RecordingReplica:
    """An engine replica on loopback: /health, /v1/models, /tokenize (a token per byte of
    the prompt's JSON) and both generation endpoints, each POST kept in ``received``."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._answer(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._answer(200, {})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                replica.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                request = json.loads(body)
                if self.path == "/tokenize":
                    prompt = json.dumps(request.get("messages", request.get("prompt")))
                    if ENGINE_REFUSES in prompt:
                        self._answer(400, VLLM_DUMP)
                    else:
                        self._answer(200, {"tokens": list(prompt.encode())[:2000]})
                    return
                if request.get("max_tokens", 0) > MAX_MODEL_LEN:
                    self._answer(400, TOO_LONG)
                    return
                prompt = request.get("prompt")
                num_tokens = len(prompt) if isinstance(prompt, list) else 7
                usage = {"prompt_tokens": num_tokens, "completion_tokens": 1, "total_tokens": num_tokens + 1}
                self._answer(200, {"object": "text_completion", "model": MODEL, "choices": [{"index": 0, "text": "ok"}], "usage": usage})

            def _answer(self, status: int, document: dict) -> None:
                content = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def generations(self) -> list[Received]:
        return [r for r in self.received if r.path in (CHAT, COMPLETIONS)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True, slots=True)
class RouterProcess:
    url: str
    process: subprocess.Popen
    config: Path
    log: Path


@contextlib.contextmanager
def running_router(
    workdir: Path, redis_url: str, replica: RecordingReplica, settings: str = "", env: dict[str, str] | None = None
) -> Iterator[RouterProcess]:
    """`kvstore router` in front of ``replica``, with ``settings`` (TOML lines) in [router];
    yields once it is healthy, and stops it."""
    port = unused_port()
    config = workdir / "router.toml"
    config.write_text(
        f'[router]\nport = {port}\nindex = "{redis_url}"\nhealth_interval_s = 0.5\n{settings}\n{NAMESPACE}\n'
        f'[[router.replicas]]\nurl = "{replica.url}"\nnode_id = "replica-a"\n'
    )
    log = workdir / "router.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "router", "--config", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    router = RouterProcess(f"http://127.0.0.1:{port}", process, config, log)
    try:

        def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{router.url}/health", timeout=2).status_code == 200
            return process.poll() is not None

        assert eventually(healthy, timeout_s=60) and process.poll() is None, log.read_text()
        yield router
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def replica() -> Iterator[RecordingReplica]:
    server = RecordingReplica()
    yield server
    server.close()


@pytest.fixture(scope="module")
def router(tmp_path_factory, redis_server, replica) -> Iterator[RouterProcess]:
    with running_router(tmp_path_factory.mktemp("router"), redis_server.url, replica) as started:
        yield started


def chat(*messages: dict, **fields) -> dict:
    return {"model": MODEL, "messages": list(messages), "max_tokens": 8, **fields}


USER = {"role": "user", "content": "hello"}
TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    "path, request_body, param",
    [
        (CHAT, chat({"content": "hello"}), "messages[0].role"),
        (CHAT, chat({"role": "wizard", "content": "hello"}), "messages[0].role"),
        (CHAT, chat({"role": "user", "content": 42}), "messages[0].content"),
        (CHAT, chat({"role": "user"}), "messages[0].content"),
        (CHAT, chat(USER, {"role": "user", "content": [{"type": "txet", "text": "hi"}]}), "messages[1].content[0].type"),
        (CHAT, chat({"role": "user", "content": [{"type": "text", "text": 5}]}), "messages[0].content[0].text"),
        (CHAT, chat({"role": "user", "content": ["hi"]}), "messages[0].content[0]"),
        (CHAT, chat({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}, USER), "messages[0].tool_calls[0].function"),
        (CHAT, chat(USER, tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
        (CHAT, chat(USER, tools=[TOOL, {"type": "retrieval"}]), "tools[1].type"),
        (CHAT, chat(USER, tools="read_file"), "tools"),
        (CHAT, chat(USER, tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
        (CHAT, chat(USER, max_tokens=0), "max_tokens"),
        (CHAT, chat(USER, max_tokens="8"), "max_tokens"),
        (CHAT, chat(USER, temperature=-0.5), "temperature"),
        (CHAT, chat(USER, top_p=1.5), "top_p"),
        (CHAT, chat(USER, n=0), "n"),
        (CHAT, chat(USER, stop=["\n", 2]), "stop[1]"),
        (CHAT, chat(USER, cache_salt=7), "cache_salt"),
        (CHAT, chat(), "messages"),
        (COMPLETIONS, {"model": MODEL, "prompt": 42}, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": [1, "two"]}, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": [[1, 2], [-3]]}, "prompt"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hello", "max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"model": MODEL, "prompt": "hello", "stream": "yes"}, "stream"),
    ],
)
def test_a_malformed_request_gets_an_openai_400_naming_its_field_and_no_engine_sees_it(router, replica, path, request_body, param):
    asked = len(replica.received)
    response = httpx.post(f"{router.url}{path}", json=request_body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert f"'{param}'" in error["message"] and "validation error" not in error["message"]
    assert response.headers["x-kvstore-error-source"] == "router"
    assert len(replica.received) == asked  # neither /tokenize nor the endpoint was asked


def test_valid_requests_reach_the_engine_byte_for_byte(router, replica):
    extras = {"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}, "vendor_field": [1, {"x": None}]}
    requests = [
        (CHAT, chat({"role": "system", "content": "be brief"}, USER, temperature=0.0, top_p=1, n=1, **extras)),
        (
            CHAT,
            chat(
                {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
                tools=[TOOL],
                tool_choice={"type": "function", "function": {"name": "read_file"}},
                stream=False,
            ),
        ),
        (COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 4, "stop": "\n", "logprobs": 2}),
        (COMPLETIONS, {"model": MODEL, "prompt": [[1, 2, 3], [4]], "temperature": 2}),
    ]
    for path, body in requests:
        content = json.dumps(body, separators=(",", ":")).encode()
        response = httpx.post(f"{router.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.headers["x-kvstore-replica"] == "replica-a"
        assert replica.generations()[-1] == Received(path, replica.generations()[-1].headers, content)


def test_an_engines_4xx_reaches_the_client_as_an_openai_error_naming_its_field(router, replica):
    before = len(replica.generations())
    response = httpx.post(f"{router.url}{CHAT}", json=chat({"role": "user", "content": ENGINE_REFUSES}), timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages", error
    assert "body.prompt" not in error["message"] and "validation errors" not in error["message"], error
    assert response.headers["x-kvstore-error-source"] == "engine" and response.headers["x-kvstore-replica"] == "replica-a"
    assert len(replica.generations()) == before  # only /tokenize was asked


def test_an_engines_4xx_to_the_request_itself_is_an_openai_error_with_the_routers_headers(router, replica):
    body = {"model": MODEL, "prompt": list(range(40)), "max_tokens": 10 * MAX_MODEL_LEN}
    response = httpx.post(f"{router.url}{COMPLETIONS}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens", error
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]  # the engine's sentence, which is one
    assert response.headers["x-kvstore-error-source"] == "engine" and response.headers["x-kvstore-replica"] == "replica-a"
    assert replica.generations()[-1].json() == body
