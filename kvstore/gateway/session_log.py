"""Each session's turns as the router saw them: prefix stability and where a prompt broke.

An agent's prompt should extend its previous turn's — the same system prompt, tools and
history, then the answer and a new message — so that everything before the new message
is cached. A client that changes the past (a date in the system prompt, reasoning
stripped from an earlier answer, tools reordered) breaks the prefix at that point, and
every later token is computed again. For each turn of a session the router records
(`SessionLog`):

- whether its prompt extends the previous turn's prompt and answer; if not, the first
  token position where it diverges (``diverged_at``), how many tokens the session had
  sent from there on (``lost_tokens``: the previous prompt's tail and its answer, cached
  and now useless), and which part of the conversation changed (``part``): ``tools``,
  ``system prompt``, ``message N (role)`` for an earlier message, ``the last answer``
  (the previous turn's answer as the client sent it back differs from what the engine
  generated), ``the template`` (the messages are the same, their tokens are not: the
  chat template renders something else, e.g. the date), or ``prompt`` (a completion);
- the token ids around the point, a few on each side, of both turns (tenants' data: the
  router's API shows them to the session's own tenant, and decoded text only where the
  operator enables it: ``router.session_text``);
- its prompt, cached and computed tokens and the computed tokens by cause (misses.py).

Comparisons are of token ids (the router has them to route) and, for chat requests, of
digests of each message and of the tools; an answer is kept as a digest of its text and
tool calls. Memory is bounded: at most ``max_sessions`` sessions (the least recently
seen forgotten first), ``max_turns`` turns each, and ``max_tokens`` token ids of
previous prompts in all.

Pure and synchronous; owner: the router's event loop.
"""

from __future__ import annotations

import array
import collections
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import xxhash

from kvstore.errors import InvalidArgument

__all__ = ["Answer", "Divergence", "SessionLog", "Turn", "answer_digest", "first_difference", "message_digests"]

_AROUND = 8  # token ids shown on each side of a divergence


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a turn's prompt stopped extending the previous turn's."""

    at: int  # the first token position that differs
    lost_tokens: int  # the positions the session had sent from there on (prompt and answer)
    part: str  # the part of the conversation that changed (see the module's docstring)
    before: tuple[int, ...] = ()  # the previous prompt's token ids around the point
    after: tuple[int, ...] = ()  # this prompt's


@dataclass(slots=True)
class Turn:
    number: int  # 1 for the session's first request the router saw
    at_s: float  # wall-clock time it was routed
    replica: str
    prompt_tokens: int
    cached_tokens: int = 0
    causes: dict[str, int] = field(default_factory=dict)  # computed tokens by cause (misses.py)
    divergence: Divergence | None = None  # None: it extends the previous turn (or is the first)
    done: bool = False  # its answer's usage has been seen
    # its messages' and tools' digests, which the next turn compares with (not shown)
    messages: tuple[int, ...] | None = field(default=None, repr=False)
    tools: int | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["causes"] = dict(self.causes)
        shown["divergence"] = None if self.divergence is None else asdict(self.divergence)
        return shown


@dataclass(frozen=True, slots=True)
class Answer:
    """What the router learnt of a turn's answer: its length and, for a chat answer, a digest
    of its text and tool calls (None when the router did not see them)."""

    completion_tokens: int = 0
    digest: int | None = None


class _Session:
    __slots__ = ("tenant", "turns", "tokens", "messages", "tools", "answer", "seen_s", "routed", "finished")

    def __init__(self, tenant: str, max_turns: int) -> None:
        self.tenant = tenant
        self.turns: collections.deque[Turn] = collections.deque(maxlen=max_turns)
        self.tokens = array.array("I")  # the last finished turn's prompt
        self.messages: tuple[int, ...] | None = None  # its messages' digests (chat)
        self.tools: int | None = None
        self.answer = Answer()
        self.seen_s = 0.0
        self.routed = 0  # turns routed, the first numbered 1
        self.finished = 0  # the number of the latest turn whose answer is in (its prompt is `tokens`)


def first_difference(a: array.array, b: array.array) -> int:
    """The length of the longest common prefix of two token arrays (a binary search over
    slices compared as memory)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    view_a, view_b = memoryview(a).cast("B"), memoryview(b).cast("B")
    size = a.itemsize
    while low < high:
        middle = (low + high) // 2
        if view_a[low * size : (middle + 1) * size] == view_b[low * size : (middle + 1) * size]:
            low = middle + 1
        else:
            high = middle
    return low


def message_digests(messages: Any) -> tuple[int, ...] | None:
    """A digest of each chat message as sent (None for a request without messages)."""
    if not isinstance(messages, list):
        return None
    return tuple(xxhash.xxh64_intdigest(json.dumps(m, sort_keys=True, separators=(",", ":"), default=str).encode()) for m in messages)


def answer_digest(content: Any, tool_calls: Any = None) -> int:
    """A digest of an assistant message's text and tool calls (names and arguments), as a
    client sends it back: how it was generated and how it is echoed compare equal."""
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    calls = []
    for call in tool_calls if isinstance(tool_calls, list) else ():
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        calls.append([function.get("name"), function.get("arguments")])
    return xxhash.xxh64_intdigest(json.dumps([content or "", calls], separators=(",", ":"), default=str).encode())


class SessionLog:
    def __init__(self, max_sessions: int = 1000, max_turns: int = 64, max_tokens: int = 16 * 1024 * 1024) -> None:
        for name, value in (("max_sessions", max_sessions), ("max_turns", max_turns), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"SessionLog.{name} must be a positive integer, got {value!r}.")
        self.max_sessions, self.max_turns, self.max_tokens = max_sessions, max_turns, max_tokens
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()
        self._tokens = 0  # token ids kept, over all sessions

    def __len__(self) -> int:
        return len(self._sessions)

    # -- a turn's life ---------------------------------------------------------------------
    def begin(
        self,
        session_id: str,
        tenant: str,
        replica: str,
        token_ids: Sequence[int],
        payload: Mapping[str, Any],
    ) -> tuple[Turn, int, int]:
        """A turn routed to ``replica``: its record (with its divergence from the previous
        turn, if any), and for the miss attribution the tokens it kept of the previous
        prompt and the positions the session had sent (misses.RouteView)."""
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session(tenant, self.max_turns)
            while len(self._sessions) > self.max_sessions:
                self._drop(next(iter(self._sessions)))
        self._sessions.move_to_end(session_id)
        session.seen_s = time.time()
        session.routed += 1
        tokens = array.array("I", token_ids)
        messages, tools = message_digests(payload.get("messages")), _tools_digest(payload)
        turn = Turn(session.routed, session.seen_s, replica, len(token_ids), messages=messages, tools=tools)
        session.turns.append(turn)
        if not session.tokens:
            return turn, 0, 0
        previous = session.tokens
        kept = first_difference(previous, tokens)
        answer = session.answer
        sent = len(previous)
        if kept < len(previous):
            sent += answer.completion_tokens  # the answer's positions too, computed after the point
            part = _changed_part(session, messages, tools, payload)
            turn.divergence = self._divergence(kept, sent - kept, part, previous, tokens)
        elif self._answer_changed(session, messages, payload):
            sent += answer.completion_tokens
            turn.divergence = self._divergence(len(previous), answer.completion_tokens, "the last answer", previous, tokens)
        return turn, kept, sent

    def finish(self, session_id: str, turn: Turn, token_ids: Sequence[int], answer: Answer) -> None:
        """The turn's answer is in: its usage recorded in ``turn``, and its prompt the one the
        session's next turn is compared with (its digests as `begin` took them)."""
        turn.done = True
        session = self._sessions.get(session_id)
        if session is None or turn.number < session.finished:
            return  # forgotten, or a later turn of the session finished first
        session.finished = turn.number
        self._tokens -= len(session.tokens)
        session.tokens = array.array("I", token_ids)
        session.messages, session.tools = turn.messages, turn.tools
        self._tokens += len(session.tokens)
        session.answer = answer
        while self._tokens > self.max_tokens and self._sessions:
            oldest = next(iter(self._sessions))
            if oldest == session_id and len(self._sessions) == 1:
                break
            self._drop(oldest)

    # -- what an operator reads ------------------------------------------------------------
    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The sessions kept, most recent first (of ``tenant`` alone when given)."""
        rows = []
        for session_id, session in reversed(self._sessions.items()):
            if tenant is not None and session.tenant != tenant:
                continue
            turns = list(session.turns)
            rows.append(
                {
                    "session": session_id,
                    "tenant": session.tenant,
                    "turns": session.routed,
                    "last_seen_s": session.seen_s,
                    "replica": turns[-1].replica if turns else "",
                    "prompt_tokens": sum(t.prompt_tokens for t in turns if t.done),
                    "cached_tokens": sum(t.cached_tokens for t in turns if t.done),
                    "prefill_tokens": sum(t.prompt_tokens - t.cached_tokens for t in turns if t.done),
                    "divergences": sum(1 for t in turns if t.divergence is not None),
                    "lost_tokens": sum(t.divergence.lost_tokens for t in turns if t.divergence is not None),
                }
            )
        return rows

    def session(self, session_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        session = self._sessions.get(session_id)
        if session is None or (tenant is not None and session.tenant != tenant):
            return None
        return {"session": session_id, "tenant": session.tenant, "turns": [t.as_dict() for t in session.turns]}

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _divergence(at: int, lost: int, part: str, previous: array.array, tokens: array.array) -> Divergence:
        window = slice(max(at - _AROUND, 0), at + _AROUND)
        return Divergence(at, max(lost, 0), part, tuple(previous[window]), tuple(tokens[window]))

    @staticmethod
    def _answer_changed(session: _Session, messages: tuple[int, ...] | None, payload: Mapping[str, Any]) -> bool:
        """Whether the previous turn's answer, as this chat request sends it back, differs from
        what the engine generated (False where either is not known)."""
        if session.answer.digest is None or messages is None or session.messages is None:
            return False
        sent = payload.get("messages")
        position = len(session.messages)
        if not isinstance(sent, list) or len(sent) <= position or not isinstance(sent[position], Mapping):
            return False
        echoed = sent[position]
        if echoed.get("role") != "assistant":
            return False
        return answer_digest(echoed.get("content"), echoed.get("tool_calls")) != session.answer.digest

    def _drop(self, session_id: str) -> None:
        session = self._sessions.pop(session_id)
        self._tokens -= len(session.tokens)


def _tools_digest(payload: Mapping[str, Any]) -> int | None:
    tools = payload.get("tools")
    return None if tools is None else xxhash.xxh64_intdigest(json.dumps(tools, sort_keys=True, default=str).encode())


def _changed_part(session: _Session, messages: tuple[int, ...] | None, tools: int | None, payload: Mapping[str, Any]) -> str:
    """Which part of the conversation a divergence fell in, from the messages' digests."""
    if messages is None or session.messages is None:
        return "prompt"
    if tools != session.tools:
        return "tools"
    sent = payload.get("messages")
    for i, (before, now) in enumerate(zip(session.messages, messages)):
        if before != now:
            role = sent[i].get("role") if isinstance(sent[i], Mapping) else None
            return "system prompt" if i == 0 and role in ("system", "developer") else f"message {i} ({role})"
    if len(messages) < len(session.messages):
        return f"message {len(messages)} (dropped)"
    return "the template"
