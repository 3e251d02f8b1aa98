"""A request's prompt as the engine will see it: its token ids, and the session it belongs to.

Token ids come from the engine's own ``/tokenize`` (vLLM's OpenAI server): the engine
applies its chat template — the model's, or the one given with ``--chat-template`` — to
all messages and the tools, exactly as it will for the request, so the router hashes the
tokens the engine's connector will hash (DESIGN.md §13). A completion whose prompt is
already token ids needs no call.

The session is, in order: the configured header (``x-session-id``), the OpenAI ``user``
field, else derived from the conversation's start — for chat, the messages up to and
including the first user message (with the tools); for a completion, its first
``session_prefix_blocks`` full blocks — so agents that send no id still stick, and two
conversations that share only a system prompt do not share a session.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from kvstore.hashing import BlockHash

__all__ = ["BadRequest", "block_extra_keys", "tokenize_request", "prompt_token_ids", "session_of", "tokens_digest"]

# what /tokenize takes besides the prompt: the fields of a chat request that change its tokens
_CHAT_TOKENIZE_FIELDS = (
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
)
MAX_SESSION_ID_CHARS = 256


class BadRequest(Exception):
    """The request is malformed; ``message`` says how (an OpenAI ``invalid_request_error``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def prompt_token_ids(kind: str, payload: Mapping[str, Any]) -> list[int] | None:
    """The token ids a completion gives itself (a list of ints, or the first of a batch of
    them); None when the engine must tokenize."""
    if kind != "completion":
        return None
    prompt = payload.get("prompt")
    if _is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and _is_token_ids(prompt[0]):
        return list(prompt[0])
    return None


def tokenize_request(kind: str, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` body that yields the token ids the engine will compute for
    ``payload`` (a completion's text prompt, or a chat request's messages and tools). A
    batch of prompts is routed by its first."""
    model = payload.get("model")
    if kind == "completion":
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest(
                "'prompt' must be a string, a list of strings, or token ids (a list of integers, or a list of such lists).", "prompt"
            )
        body: dict[str, Any] = {"model": model, "prompt": prompt}
        if "add_special_tokens" in payload:
            body["add_special_tokens"] = payload["add_special_tokens"]
        return body
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of message objects.", "messages")
    body = {"model": model, "messages": messages}
    for name in _CHAT_TOKENIZE_FIELDS:
        if name in payload and payload[name] is not None:
            body[name] = payload[name]
    return body


def block_extra_keys(payload: Mapping[str, Any], num_blocks: int) -> list[bytes | None] | None:
    """What besides its tokens each block's KV depends on, as the vLLM connector keys it
    (connectors/vllm_compat.block_extra_keys: msgpack of vLLM's own extra hash keys): a
    request's ``cache_salt`` is vLLM's ``(("cache_salt", salt),)`` on the first block,
    and through the chain every block after it. LoRA adapters and multimodal inputs are
    not keyed here: such requests are routed by their tokens alone (they find nothing).
    tests/test_router_http.py checks the salted keys against a real engine's."""
    salt = payload.get("cache_salt")
    if salt is None or salt == "" or num_blocks == 0:
        return None
    if not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string.", "cache_salt")
    return [msgpack.packb((("cache_salt", salt),), use_bin_type=True)] + [None] * (num_blocks - 1)


def tokens_digest(token_ids: Sequence[int]) -> str:
    """A short fingerprint of token ids (xxh64 of their uint32-LE bytes), sent back in the
    ``x-kvstore-prompt-digest`` header so a client can check what the router hashed."""
    return xxhash.xxh64_hexdigest(b"".join(int(t).to_bytes(4, "little") for t in token_ids))


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    source: str  # header, user, derived


def session_of(
    headers: Mapping[str, str],
    header: str,
    kind: str,
    payload: Mapping[str, Any],
    hashes: Sequence[BlockHash],
    prefix_blocks: int,
) -> Session | None:
    given = headers.get(header)
    if given:
        if len(given) > MAX_SESSION_ID_CHARS:
            raise BadRequest(f"the {header} header is longer than {MAX_SESSION_ID_CHARS} characters.")
        return Session(f"h:{given}", "header")
    user = payload.get("user")
    if isinstance(user, str) and user:
        return Session(f"u:{xxhash.xxh3_128_hexdigest(user.encode())}", "user")
    if kind == "chat":
        messages = payload["messages"]
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
        start = json.dumps([messages[: first_user + 1], payload.get("tools")], sort_keys=True, separators=(",", ":"), default=str)
        return Session(f"c:{xxhash.xxh3_128_hexdigest(start.encode())}", "derived")
    if not hashes:
        return None  # shorter than a block: nothing to stick to
    return Session(f"p:{hashes[min(prefix_blocks, len(hashes)) - 1].hex()}", "derived")
