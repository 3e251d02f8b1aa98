"""Errors as the OpenAI API answers them: ``{"error": {"message", "type", "param", "code"}}``.

The router's own (a malformed request, no key, no replica) say so in the header
``x-kvstore-error-source: router``. An engine's 4xx is translated, never passed on: vLLM
answers a request its models reject with pydantic's dump of every union branch it tried
(``12 validation errors: … 'loc': ('body', 'prompt')``), which names the engine's fields —
for a chat request tokenized by the router, ``body.prompt`` of a request the client never
sent. The client gets the engine's sentence where it is one short line, the field it names
as the client's (``body.messages.0.content`` → ``messages[0].content``; a field the client
did not send → its ``messages``, or a completion's ``prompt``), and
``x-kvstore-error-source: engine``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

__all__ = ["engine_error", "openai_error"]

_MAX_ENGINE_SENTENCE_CHARS = 300
_DUMP_MARKS = ("validation error", "{'", "[{", "\n")  # pydantic's or FastAPI's listing of what it tried


def openai_error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    headers: Mapping[str, str] | None = None,
    source: str = "router",
) -> JSONResponse:
    document = {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
    return JSONResponse(document, status_code=status, headers={**(headers or {}), "x-kvstore-error-source": source})


def engine_error(status: int, content: bytes, kind: str, payload: Mapping[str, Any], headers: Mapping[str, str]) -> JSONResponse:
    """An engine's 4xx answer (``content``) to a ``kind`` request ("chat" or "completion")
    as an OpenAI error naming the client's field of ``payload``."""
    sentence, engine_param = _engine_sentence(content)
    param = _client_param(engine_param, kind, payload)
    if sentence and len(sentence) <= _MAX_ENGINE_SENTENCE_CHARS and not any(mark in sentence for mark in _DUMP_MARKS):
        message = f"The engine refused the request: {sentence.rstrip('.')}."
    elif param:
        message = f"The engine refused the value of '{param}': check it against the OpenAI API and the model's limits."
    else:
        message = f"The engine refused the request (HTTP {status}); check it against the OpenAI API and the model's limits."
    return openai_error(400 if status == 422 else status, message, param=param, headers=headers, source="engine")


def _engine_sentence(content: bytes) -> tuple[str, str]:
    """(message, param) of an engine's error body, as vLLM or FastAPI write one ('' where absent)."""
    try:
        document = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return "", ""
    if not isinstance(document, dict):
        return "", ""
    error = document.get("error") if isinstance(document.get("error"), dict) else document
    detail = error.get("detail")
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):  # FastAPI's own 422
        loc = detail[0].get("loc")
        return str(detail[0].get("msg", "")), ".".join(map(str, loc)) if isinstance(loc, list) else ""
    message = error.get("message", detail if isinstance(detail, str) else "")
    param = error.get("param")
    return (message if isinstance(message, str) else ""), (param if isinstance(param, str) else "")


def _client_param(engine_param: str, kind: str, payload: Mapping[str, Any]) -> str | None:
    """``body.messages.0.content`` as the client names it: ``messages[0].content``."""
    parts = [p for p in engine_param.split(".") if p and not p[0].isupper() and "[" not in p]  # union branches are class names
    if parts[:1] == ["body"]:
        parts = parts[1:]
    if not parts:
        return None
    if parts[0] not in payload:  # a field of the router's /tokenize request, made from the client's prompt
        return "messages" if kind == "chat" else "prompt"
    param = parts[0]
    for part in parts[1:]:
        param += f"[{part}]" if part.isdigit() else f".{part}"
    return param
