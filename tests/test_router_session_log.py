"""The router's session log (kvstore/gateway/session_log.py): whether each turn extends the
previous one and, where not, the point, the tokens it cost and the part that changed.
With real engines: tests/test_router_agents.py."""

from __future__ import annotations

import array

import pytest

from kvstore.errors import InvalidArgument
from kvstore.gateway.session_log import Answer, SessionLog, answer_digest, first_difference

SYSTEM = {"role": "system", "content": "you are a coding agent"}


def chat(*messages, tools=None) -> dict:
    payload = {"messages": [SYSTEM, *messages]}
    if tools is not None:
        payload["tools"] = tools
    return payload


EIGHT_TOKENS = Answer(8)


def turn(log, session, tokens, payload, answer=EIGHT_TOKENS, replica="a"):
    record, kept, sent = log.begin(session, "t", replica, tokens, payload)
    log.finish(session, record, tokens, answer)
    return record, kept, sent


def test_first_difference_is_the_common_prefix_length():
    a = array.array("I", range(1000))
    assert first_difference(a, a) == 1000
    assert first_difference(a, array.array("I", range(500))) == 500
    for at in (0, 1, 499, 998, 999):
        b = array.array("I", a)
        b[at] = 5000
        assert first_difference(a, b) == at


def test_a_prompt_that_extends_the_previous_one_is_no_divergence():
    log = SessionLog()
    first, kept, sent = turn(log, "s", list(range(100)), chat({"role": "user", "content": "hi"}))
    assert first.number == 1 and first.divergence is None and (kept, sent) == (0, 0)
    second, kept, sent = turn(log, "s", list(range(130)), chat({"role": "user", "content": "hi"}, {"role": "user", "content": "more"}))
    assert second.number == 2 and second.divergence is None and (kept, sent) == (100, 100)


def test_a_changed_system_prompt_is_reported_where_it_diverges_with_what_it_cost():
    log = SessionLog()
    turn(log, "s", list(range(100)), chat({"role": "user", "content": "hi"}), Answer(8))
    changed = {"role": "system", "content": "you are a coding agent. Today is 2026-12-06"}
    tokens = list(range(40)) + [9999] + list(range(41, 140))
    record, kept, sent = turn(log, "s", tokens, {"messages": [changed, {"role": "user", "content": "hi"}]})
    assert record.divergence.at == 40 and record.divergence.part == "system prompt"
    assert record.divergence.lost_tokens == 100 + 8 - 40  # the previous prompt's tail and its answer
    assert record.divergence.after[8] == 9999 and record.divergence.before[8] == 40
    assert (kept, sent) == (40, 108)


def test_tools_an_earlier_message_and_the_template_are_told_apart():
    log = SessionLog()
    user = {"role": "user", "content": "hi"}
    turn(log, "s", list(range(50)), chat(user, tools=[{"type": "function", "function": {"name": "read"}}]))
    record, _, _ = turn(log, "s", [1] + list(range(1, 60)), chat(user, tools=[{"type": "function", "function": {"name": "write"}}]))
    assert record.divergence.part == "tools"
    turn(log, "e", list(range(50)), chat(user, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}))
    record, _, _ = turn(
        log, "e", list(range(30)) + [7] * 30, chat(user, {"role": "assistant", "content": "k"}, {"role": "user", "content": "go"})
    )
    assert record.divergence.part == "message 2 (assistant)"
    turn(log, "d", list(range(50)), chat(user))
    record, _, _ = turn(log, "d", [3] + list(range(1, 60)), chat(user))  # same messages, other tokens
    assert record.divergence.part == "the template"
    turn(log, "c", list(range(50)), {"prompt": "x"})
    assert turn(log, "c", [5] * 60, {"prompt": "y"})[0].divergence.part == "prompt"


def test_an_answer_sent_back_otherwise_than_generated_is_the_last_answer():
    log = SessionLog()
    user = {"role": "user", "content": "fix the bug"}
    generated = "<think>look at tiers first</think>the bug is in the slab"
    turn(log, "s", list(range(100)), chat(user), Answer(20, answer_digest(generated)))
    echoed = chat(user, {"role": "assistant", "content": generated}, {"role": "user", "content": "go on"})
    record, kept, sent = turn(log, "s", list(range(140)), echoed, Answer(20, answer_digest("done")))
    assert record.divergence is None and (kept, sent) == (100, 100)  # sent back as generated
    stripped = chat(user, {"role": "assistant", "content": generated}, {"role": "user", "content": "go on"})
    stripped["messages"] += [{"role": "assistant", "content": "done"[2:]}, {"role": "user", "content": "and now?"}]
    record, kept, sent = turn(log, "s", list(range(180)), stripped)
    assert record.divergence.part == "the last answer" and record.divergence.at == 140 and record.divergence.lost_tokens == 20
    assert (kept, sent) == (140, 160)


def test_memory_is_bounded_by_sessions_and_tokens_and_tenants_see_their_own():
    log = SessionLog(max_sessions=3, max_tokens=250)
    for i in range(4):
        turn(log, f"s{i}", list(range(100)), {"prompt": "p"})
    assert len(log) == 2  # 4 sessions of 100 tokens: 3 sessions at most, 250 tokens at most
    assert [row["session"] for row in log.sessions()] == ["s3", "s2"]
    assert log.sessions(tenant="other") == [] and log.session("s3", tenant="other") is None
    assert log.session("s3")["turns"][0]["prompt_tokens"] == 100
    with pytest.raises(InvalidArgument):
        SessionLog(max_turns=0)
