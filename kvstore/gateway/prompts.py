"""A request's prompt as the engine will see it: its token ids, and the session it belongs to.

Token ids come from the engine's own ``/tokenize`` (vLLM's OpenAI server): the engine
applies its chat template — the model's, or the one given with ``--chat-template`` — to
all messages and the tools, exactly as it will for the request, so the router hashes the
tokens the engine's connector will hash (DESIGN.md §13). A completion whose prompt is
already token ids needs no call.

Block keys: a request's ``cache_salt`` and the LoRA adapter it names as its ``model`` are
keyed as the engine keys them (block_extra_keys). Multimodal inputs and prompt
embeddings are not: the router cannot compute vLLM's media hashes without the model's
processor, so such a request is not tokenized or hashed (unkeyed_inputs) and is routed
by load and session alone, with the reason in its routing decision.

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

from kvstore.hashing import BlockHash, token_bytes

__all__ = [
    "TEXT_PART_TYPES",
    "BadRequest",
    "LoraAdapter",
    "block_extra_keys",
    "prompt_token_ids",
    "session_of",
    "tokenize_request",
    "tokens_digest",
    "unkeyed_inputs",
]

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
# vLLM's chat content parts that are text (renderers/chat_utils.py); any other part is media
TEXT_PART_TYPES = ("text", "input_text", "output_text", "thinking", "refusal", "tool_reference")
MAX_SESSION_ID_CHARS = 256


class BadRequest(Exception):
    """The request is malformed; ``message`` says how (an OpenAI ``invalid_request_error``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of ints, bools excluded: the types checked in one C-level pass
    (~15 ns a token; a generator of isinstance checks took 50 — 8 ms a 150K-token prompt)."""
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int}


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


def _messages(payload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of message objects.", "messages")
    return messages


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
    body = {"model": model, "messages": _messages(payload)}
    for name in _CHAT_TOKENIZE_FIELDS:
        if name in payload and payload[name] is not None:
            body[name] = payload[name]
    return body


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """The LoRA adapter a request names as its ``model``, as the engines serving it load it
    (their ``/v1/models`` card: ``id`` the name, ``root`` the path)."""

    name: str
    path: str


def unkeyed_inputs(kind: str, payload: Mapping[str, Any]) -> str:
    """Why the router cannot key the request's blocks as the engine does ('' when it can):
    vLLM keys a block holding multimodal inputs by their hashes, which only its processor
    computes (from the decoded media), and prompt embeddings by their digest. Such a
    request is routed by load and session alone, never by blocks that might be another's.
    A chat content part is text when its type is one of vLLM's text parts."""
    if kind == "completion":
        return "the prompt is given as embeddings" if payload.get("prompt_embeds") is not None else ""
    for message in _messages(payload):
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            part_type = part.get("type", "text" if set(part) == {"text"} else "untyped") if isinstance(part, Mapping) else "untyped"
            if part_type not in TEXT_PART_TYPES:
                return f"multimodal inputs (a content part of type {ascii(str(part_type)[:40])})"
    return ""


def block_extra_keys(payload: Mapping[str, Any], num_blocks: int, adapter: LoraAdapter | None = None) -> list[bytes | None] | None:
    """What besides its tokens each block's KV depends on, as the vLLM connector keys it
    (connectors/vllm_compat.block_extra_keys: msgpack of vLLM's own
    ``generate_block_hash_extra_keys``): a LoRA adapter is ``("lora", name, path)`` on every
    block, a ``cache_salt`` ``("cache_salt", salt)`` on the first, after the adapter's (and,
    through the chain, in every block after it). Multimodal inputs and prompt embeddings
    are not keyed here: such requests are not hashed at all (unkeyed_inputs).
    tests/test_router_http.py checks the salted keys and tests/test_router_lora.py the
    adapter's against a real engine's."""
    salt = payload.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequest("'cache_salt' must be a string.", "cache_salt")
    lora = (("lora", adapter.name, adapter.path),) if adapter is not None else ()
    salted = (("cache_salt", salt),) if salt else ()
    if num_blocks == 0 or not (lora or salted):
        return None
    rest = msgpack.packb(lora, use_bin_type=True) if lora else None
    return [msgpack.packb(lora + salted, use_bin_type=True)] + [rest] * (num_blocks - 1)


def tokens_digest(token_ids: Sequence[int]) -> str:
    """A short fingerprint of token ids (xxh64 of their uint32-LE bytes), sent back in the
    ``x-kvstore-prompt-digest`` header so a client can check what the router hashed."""
    return xxhash.xxh64_hexdigest(token_bytes(token_ids))


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
