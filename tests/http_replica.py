"""A small engine replica for the router's tests that need no engine: an HTTP server
answering /health, /v1/models, /metrics and /v1/completions (whose text names the replica), as
the router asks a vLLM OpenAI server. Run as
``python tests/http_replica.py NAME MODEL [GATE [HEADERS_GATE]]``; it prints the port it
listens on, then serves until killed.

A streamed completion (``"stream": true``) is answered as vLLM answers one: the headers
at once, then the first token's event only once the prompt is computed — here, once the
file GATE exists (at once without one), which a test creates when the "prefill" should
end — then the usage and ``[DONE]``. With HEADERS_GATE, even the headers wait for that
file (an engine slow to answer at all).

It keeps a prefix cache as vLLM's does, without eviction: the whole blocks (of
``BLOCK_TOKENS``) of every prompt it computed; a prompt's usage reports as cached the
longest prefix of whole blocks it holds, less one block when that would be the whole
prompt (an engine computes at least the last token). ``POST /reset_prefix_cache`` empties
it (vLLM's endpoint of that name).

Its /metrics reports vLLM's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
as vLLM does: the completions it has received and not finished, whoever sent them. A
completion finishes, as in vLLM's scheduler, when its last token is computed, before the
server writes that token to the client."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BLOCK_TOKENS = 16  # the router tests' block size (test_engine_subscriptions.BLOCK)


class _PrefixCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: set[tuple[int, ...]] = set()  # every cached whole-block prefix

    def serve(self, prompt: list[int]) -> int:
        """The prompt's cached tokens; its whole blocks are cached from now on."""
        whole = len(prompt) // BLOCK_TOKENS
        with self._lock:
            cached = 0
            while cached < whole and tuple(prompt[: (cached + 1) * BLOCK_TOKENS]) in self._blocks:
                cached += 1
            for k in range(cached + 1, whole + 1):
                self._blocks.add(tuple(prompt[: k * BLOCK_TOKENS]))
        tokens = cached * BLOCK_TOKENS
        return tokens - BLOCK_TOKENS if tokens and tokens == len(prompt) else tokens

    def reset(self) -> None:
        with self._lock:
            self._blocks.clear()


class _Running:
    """The completions received and not finished: what vLLM's scheduler holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def start(self):
        """One more; returns the callable that finishes it (once, however often called)."""
        with self._lock:
            self._count += 1
        finished = False

        def finish() -> None:
            nonlocal finished
            with self._lock:
                if not finished:
                    finished = True
                    self._count -= 1

        return finish

    def exposition(self, model: str) -> bytes:
        with self._lock:
            count = self._count
        labels = f'{{engine="0",model_name="{model}"}}'
        return (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {float(count)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} 0.0\n"
        ).encode()


def serve(name: str, model: str, gate: Path | None = None, headers_gate: Path | None = None) -> None:
    running = _Running()
    cache = _PrefixCache()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, {})
            elif self.path == "/v1/models":
                self._answer(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            elif self.path == "/metrics":
                content = running.exposition(model)
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)
            else:
                self._answer(404, {"error": {"message": f"{self.path} is not served here"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            if self.path == "/reset_prefix_cache":
                cache.reset()
                self._answer(200, {})
                return
            if self.path != "/v1/completions":
                self._answer(404, {"error": {"message": f"{self.path} is not served here"}})
                return
            prompt = body.get("prompt")
            num_tokens = len(prompt) if isinstance(prompt, list) else 0
            cached = cache.serve(prompt) if isinstance(prompt, list) else 0
            usage = {"prompt_tokens": num_tokens, "completion_tokens": 1, "total_tokens": num_tokens + 1}
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
            finish = running.start()
            try:
                if body.get("stream") is True:
                    self._stream(name, usage, finish)
                    return
                finish()
                self._answer(200, {"object": "text_completion", "model": model, "choices": [{"index": 0, "text": name}], "usage": usage})
            finally:
                finish()  # whatever ended it (a client gone mid-answer, say) ends it on the engine too

        def _answer(self, status: int, document: dict) -> None:
            content = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def _stream(self, text: str, usage: dict, finish) -> None:
            _wait_for(headers_gate)
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            self.wfile.flush()
            _wait_for(gate)
            finish()  # its one token is computed: it leaves the batch before the client reads it
            token = {"object": "text_completion", "model": model, "choices": [{"index": 0, "text": text}]}
            for event in (token, {"object": "text_completion", "model": model, "choices": [], "usage": usage}):
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *_args) -> None:  # the router's health checks would fill the log
            pass

    def _wait_for(path: Path | None) -> None:
        deadline = time.monotonic() + 60
        while path is not None and not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    gates = [Path(argument) for argument in sys.argv[3:5]]
    serve(sys.argv[1], sys.argv[2], *gates)
