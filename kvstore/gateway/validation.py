"""The OpenAI requests the router serves, as pydantic models: every field the router reads,
or that an engine would refuse, is checked here before any engine sees the request.

The models check; they do not rewrite. Fields they do not name (vLLM's sampling
extensions, a vendor's own) are allowed, and the router forwards the client's bytes, not
a re-serialized model. Types are strict — ``"8"`` is not a ``max_tokens`` — because the
engine reads the same JSON and must not see what the router would have coerced. Ranges
are OpenAI's (temperature in [0, 2], top_p in (0, 1], n >= 1, max_tokens >= 1).

A failure becomes one `BadRequest` naming the client's field as OpenAI does
(``messages[0].content[1].type``), with a sentence of what the field must be: the first
of pydantic's errors, its union branches (tagged here ``~name``) dropped from the path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from kvstore.gateway.prompts import TEXT_PART_TYPES, BadRequest

__all__ = ["validate_request"]

# vLLM's chat content parts that carry media (renderers/chat_utils.py): routed unkeyed (prompts.py)
_MEDIA_PART_TYPES = ("image_url", "input_image", "image_embeds", "input_audio", "audio_url", "video_url", "file")
_PART_TYPES = (*TEXT_PART_TYPES, *_MEDIA_PART_TYPES)
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_TOOL_CHOICES = ("none", "auto", "required")

NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]


class _Open(BaseModel):
    """Fields not named here pass through untouched: the engine reads them, not the router."""

    model_config = ConfigDict(extra="allow", strict=True)


# -- content parts ---------------------------------------------------------------------------
class TextPart(_Open):
    type: StrictStr = "text"  # one of vLLM's text parts; an untyped {"text": …} is text too
    text: StrictStr


class ImageUrl(_Open):
    url: StrictStr


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageUrl


class MediaPart(_Open):
    """Another medium: its payload is the engine's to check (the router does not key it)."""

    type: StrictStr


class UnknownPart(_Open):
    """A part of no known type: validating it names the allowed types."""

    type: Literal[_PART_TYPES]


def _part_kind(part: Any) -> str | None:
    if not isinstance(part, Mapping):
        return None
    kind = part.get("type", "text" if "text" in part else None)
    if kind in ("text", "input_text", "output_text"):
        return "~text"
    if kind == "image_url":
        return "~image"
    return "~other" if kind in _PART_TYPES else "~unknown"


ContentPart = Annotated[
    Annotated[TextPart, Tag("~text")]
    | Annotated[ImagePart, Tag("~image")]
    | Annotated[MediaPart, Tag("~other")]
    | Annotated[UnknownPart, Tag("~unknown")],
    Discriminator(_part_kind, custom_error_type="part", custom_error_message="a content part must be an object with a type"),
]


def _content_kind(content: Any) -> str | None:
    if isinstance(content, str):
        return "~str"
    return "~parts" if isinstance(content, list) else None


Content = Annotated[
    Annotated[StrictStr, Tag("~str")] | Annotated[list[ContentPart], Tag("~parts")],
    Discriminator(_content_kind, custom_error_type="content", custom_error_message="must be a string or a list of content parts"),
]


# -- messages --------------------------------------------------------------------------------
class FunctionCall(_Open):
    name: NonEmptyStr
    arguments: StrictStr


class ToolCall(_Open):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Open):
    role: Literal["system", "developer"]
    content: Content
    name: StrictStr | None = None


class UserMessage(_Open):
    role: Literal["user"]
    content: Content
    name: StrictStr | None = None


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: Content | None = None  # None where it only calls tools
    tool_calls: list[ToolCall] | None = None
    name: StrictStr | None = None


class ToolMessage(_Open):
    role: Literal["tool"]
    content: Content
    tool_call_id: StrictStr


class FunctionMessage(_Open):
    role: Literal["function"]
    content: Content | None = None
    name: StrictStr


class UnknownRole(_Open):
    """A message without a known role: validating it names the allowed roles."""

    role: Literal[_ROLES]


def _role(message: Any) -> str | None:
    if not isinstance(message, Mapping):
        return None
    role = message.get("role")
    return f"~{'system' if role == 'developer' else role}" if role in _ROLES else "~unknown"


Message = Annotated[
    Annotated[SystemMessage, Tag("~system")]
    | Annotated[UserMessage, Tag("~user")]
    | Annotated[AssistantMessage, Tag("~assistant")]
    | Annotated[ToolMessage, Tag("~tool")]
    | Annotated[FunctionMessage, Tag("~function")]
    | Annotated[UnknownRole, Tag("~unknown")],
    Discriminator(_role, custom_error_type="message", custom_error_message="a message must be an object with a role"),
]


# -- tools -----------------------------------------------------------------------------------
class FunctionDefinition(_Open):
    name: NonEmptyStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Open):
    name: NonEmptyStr


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


def _string_or_other(value: Any) -> str:
    return "~str" if isinstance(value, str) else "~other"


ToolChoice = Annotated[
    Annotated[Literal[_TOOL_CHOICES], Tag("~str")] | Annotated[NamedToolChoice, Tag("~other")], Discriminator(_string_or_other)
]
Stop = Annotated[Annotated[StrictStr, Tag("~str")] | Annotated[list[StrictStr], Tag("~other")], Discriminator(_string_or_other)]


# -- the requests ----------------------------------------------------------------------------
class StreamOptions(_Open):
    include_usage: StrictBool | None = None


class _Sampling(_Open):
    """What both endpoints share: the fields the router reads, and OpenAI's ranges."""

    model: NonEmptyStr
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: StrictInt | None = None
    stop: Stop | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class CompletionRequest(_Sampling):
    prompt_embeds: Any = None  # the engine's to check: such a request is not keyed (prompts.py)
    prompt: Any = Field(default=None, validate_default=True)  # checked below, in one pass over a long list of token ids
    echo: StrictBool | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, prompt: Any, info: ValidationInfo) -> Any:
        if prompt is None and info.data.get("prompt_embeds") is None:
            raise PydanticCustomError("missing", "Field required")
        if prompt is None or _is_prompt(prompt):
            return prompt
        raise PydanticCustomError(
            "prompt", "must be a string, a list of strings, a list of token ids (integers >= 0), or a list of such lists, none empty"
        )


def _is_token_ids(value: Any) -> bool:
    # the types in one C-level pass, then the least: a 150K-token prompt costs about a millisecond
    return isinstance(value, list) and bool(value) and set(map(type, value)) == {int} and min(value) >= 0


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt)


_ADAPTERS = {"chat": TypeAdapter(ChatRequest), "completion": TypeAdapter(CompletionRequest)}


def validate_request(kind: str, payload: Mapping[str, Any]) -> None:
    """Raise `BadRequest` naming the first field of ``payload`` (a ``kind`` request: "chat"
    or "completion") that is not as OpenAI's API defines it."""
    try:
        _ADAPTERS[kind].validate_python(payload)
    except ValidationError as exc:
        raise _bad_request(exc.errors(include_url=False)[0]) from None


def _param(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "~user", "content")`` as OpenAI names it: ``messages[0].content``
    (every union here is tagged, its branches named ``~…``)."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not part.startswith("~"):
            param += f".{part}" if param else part
    return param


def _bad_request(error: Mapping[str, Any]) -> BadRequest:
    param = _param(tuple(error["loc"]))
    if error["type"] == "missing":
        return BadRequest(f"Missing required parameter: '{param}'.", param, code="missing_required_parameter")
    sentence = str(error["msg"]).removeprefix("Value error, ")
    return BadRequest(f"Invalid value for '{param}': {sentence[0].lower()}{sentence[1:]}.", param, code="invalid_value")
