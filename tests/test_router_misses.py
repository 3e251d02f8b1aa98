"""The router's miss attribution (kvstore/gateway/misses.py): the causes of a request's
computed tokens from what the router knew when it routed it. The real engines' side is in
tests/test_router_agents.py."""

from __future__ import annotations

import hashlib

import pytest

from kvstore.errors import InvalidArgument
from kvstore.gateway.misses import CAUSES, RouteView, SeenBlocks, attribute

BS = 32


def chain(label: str, n: int) -> list[bytes]:
    keys, previous = [], b""
    for i in range(n):
        previous = hashlib.blake2b(previous + f"{label}{i}".encode(), digest_size=16).digest()
        keys.append(previous)
    return keys


def test_each_computed_token_has_one_cause_in_order_of_precedence():
    # a 10.5-block prompt; the engine found 2 blocks cached
    view = RouteView(num_blocks=10, chosen_blocks=3, elsewhere_blocks=5, seen_blocks=6, kept_tokens=7 * BS, sent_tokens=9 * BS)
    causes = attribute(view, prompt_tokens=10 * BS + 16, cached_tokens=2 * BS, block_size=BS)
    assert causes == {"not_loaded": BS, "elsewhere": 2 * BS, "evicted": BS, "new": BS + BS + 16, "diverged": 2 * BS}
    assert sum(causes.values()) == 8 * BS + 16 and set(causes) == set(CAUSES)


def test_what_the_engine_found_cached_is_never_a_miss():
    view = RouteView(num_blocks=4, chosen_blocks=4, elsewhere_blocks=4, seen_blocks=4)
    assert attribute(view, 4 * BS, 4 * BS - 1, BS) == dict.fromkeys(CAUSES, 0) | {"not_loaded": 1}
    assert sum(attribute(view, 4 * BS, 4 * BS, BS).values()) == 0


def test_a_new_session_is_new_and_a_diverged_one_is_diverged_up_to_what_it_sent_before():
    assert attribute(RouteView(num_blocks=3), 3 * BS, 0, BS)["new"] == 3 * BS
    # the previous prompt was 6 blocks; this one keeps 2 of them and is 8 blocks long
    view = RouteView(num_blocks=8, chosen_blocks=2, seen_blocks=2, kept_tokens=2 * BS + 5, sent_tokens=6 * BS)
    causes = attribute(view, 8 * BS, 2 * BS, BS)
    assert causes["diverged"] == 4 * BS - 5 and causes["new"] == 2 * BS + 5


def test_a_view_with_a_negative_count_is_refused():
    with pytest.raises(InvalidArgument):
        RouteView(chosen_blocks=-1)
    with pytest.raises(InvalidArgument):
        attribute(RouteView(), 10, 0, 0)


def test_seen_blocks_answer_the_longest_recorded_prefix_and_forget_chains_tail_first():
    seen = SeenBlocks(capacity=12)
    a = chain("a", 8)
    seen.record(a)
    assert seen.prefix(a) == 8 and seen.prefix(a[:5]) == 5
    b = a[:3] + chain("b", 5)  # shares a's first 3 blocks
    assert seen.prefix(b) == 3
    seen.record(chain("c", 6))  # 14 keys for 12 places: a's last two go
    assert len(seen) == 12 and seen.prefix(a) == 6
    seen.record(a[:2])  # refreshed: a's first blocks are the newest now
    seen.record(chain("d", 9))
    assert seen.prefix(a) == 2
    with pytest.raises(InvalidArgument):
        SeenBlocks(capacity=0)
