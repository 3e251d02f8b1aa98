"""A seeded, synthetic coding-agent workload: long, growing, shared prefixes.

Every session belongs to an agent *variant* whose system prompt and tool definitions are
the same in every one of its sessions (so their block keys are shared fleet-wide). A
session opens with that shared part plus a task (issue text, repository snippets) of its
own, then loops: the model answers (a few hundred tokens, mostly tool calls), the tool
runs, and the next request resends the whole context with the answer and the tool result
appended. When the next request would not fit the model window the agent compacts: the
history is replaced by a summary after the shared part, which breaks every prefix past it
(the summarising call itself is not emitted: it would be one more whole-prefix hit).

Token content is never materialised. A context is a list of segments (a seed and a
length); a full block is described by the pieces of segments it covers, ``(seed low,
seed high, offset, length)`` as uint32 words, and keyed with kvstore's own chain,
``key[i] = hash_block(key[i-1], words of block i)``. Equal segments at equal offsets give
equal keys, which is all the simulator needs. Shared prompts are seeded from the variant's
name alone, so they are also equal across workload seeds, as a product's prompt would be.

Timing is open loop (the simulator's latency does not feed back): the next turn arrives
after the answer's decode time at `decode_tokens_per_s` plus an exponential tool/think
time. Session starts are a Poisson process. All draws come from numpy generators spawned
from one `SeedSequence`, one per session, so a session does not change when the number
of sessions does.

Defaults and where they come from: DESIGN.md ("30K-token contexts that grow to 150K over
fifty turns, with the same system prompt and tool definitions in every call") fixes the
start (shared + task ≈ 30K), the turn count (median 45, mean ≈ 51) and the growth per
turn (tool result + answer ≈ 2.4K mean, so ≈ 150K after fifty turns); the routing-simulator
issue gives the shared prompt (10K-25K tokens), tool results (log-normal, hundreds to
several thousand tokens), answers (a few hundred) and gaps (seconds to tens of seconds).
The rest are choices, noted where they are made.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import xxhash

from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash, hash_block

__all__ = [
    "AgentVariant",
    "LogNormal",
    "CodingAgentConfig",
    "CodingAgentWorkload",
    "DEFAULT_VARIANTS",
    "PRESETS",
]


@dataclass(frozen=True, slots=True)
class LogNormal:
    """An integer drawn log-normally around ``median`` and clipped to ``[low, high]``."""

    median: float
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.sigma >= 0 and 0 <= self.low <= self.high):
            raise InvalidArgument(f"{self} needs median > 0, sigma >= 0 and 0 <= low <= high.")

    def sample(self, rng: np.random.Generator) -> int:
        value = round(self.median * math.exp(self.sigma * rng.standard_normal()))
        return min(max(value, self.low), self.high)


@dataclass(frozen=True, slots=True)
class AgentVariant:
    """One agent product: its system prompt + tool definitions, and its share of sessions."""

    name: str
    shared_prefix_tokens: int
    weight: float


# Spread over the 10K-25K range: a lean CLI agent, a typical IDE agent, and one
# with many connected tool servers, each adding its own schemas.
DEFAULT_VARIANTS = (
    AgentVariant("lean-cli", 11_000, 0.3),
    AgentVariant("ide", 17_000, 0.5),
    AgentVariant("many-tools", 24_000, 0.2),
)


@dataclass(frozen=True, slots=True)
class CodingAgentConfig:
    seed: int = 0
    num_sessions: int = 200  # ~10K requests: minutes in the simulator (see PRESETS)
    # One new session every 5 s; sessions last ≈ 8.5 minutes, so ≈ 100 run at once with
    # ≈ 8M tokens of live context: more KV than a few replicas' HBM holds, so placement matters.
    session_rate_per_s: float = 0.2
    variants: tuple[AgentVariant, ...] = DEFAULT_VARIANTS
    # Task + repository snippets; with the mean shared prefix (≈ 16.4K) a session starts ≈ 30K.
    task_tokens: LogNormal = LogNormal(12_000, 0.5, 2_000, 40_000)
    num_turns: LogNormal = LogNormal(45, 0.5, 5, 150)
    # 5th-95th percentile ≈ 250-6,700 tokens: a grep hit to a long test log or file read.
    tool_result_tokens: LogNormal = LogNormal(1_300, 1.0, 50, 16_000)
    output_tokens: LogNormal = LogNormal(250, 0.7, 16, 2_000)
    summary_tokens: LogNormal = LogNormal(4_000, 0.4, 1_000, 12_000)
    # 160K usable: DESIGN.md's 150K peak sits just below it, so the longest third compacts.
    context_window_tokens: int = 160_000
    decode_tokens_per_s: float = 60.0  # one stream of a large model on a busy replica
    tool_time_mean_s: float = 5.0  # exponential: mostly seconds, a test run tens of seconds
    # 512 as in Mooncake's traces: a 150K context is ~300 keys, not ~10K, per request.
    block_tokens: int = 512

    def __post_init__(self) -> None:
        positive = {
            "num_sessions": self.num_sessions,
            "session_rate_per_s": self.session_rate_per_s,
            "context_window_tokens": self.context_window_tokens,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "tool_time_mean_s": self.tool_time_mean_s,
            "block_tokens": self.block_tokens,
        }
        for name, value in positive.items():
            if not value > 0:
                raise InvalidArgument(f"{name} must be positive, got {value}.")
        if not self.variants:
            raise InvalidArgument("at least one agent variant is needed.")
        if len({variant.name for variant in self.variants}) != len(self.variants):
            raise InvalidArgument("agent variant names must be unique: their prompts are seeded by name.")
        if any(v.shared_prefix_tokens <= 0 or not v.weight > 0 for v in self.variants):
            raise InvalidArgument("every variant needs shared_prefix_tokens > 0 and weight > 0.")
        if self.num_turns.low < 1:
            raise InvalidArgument("num_turns.low must be at least 1.")
        # A fresh or compacted context plus one answer must fit, or compaction cannot help.
        largest_fresh = max(v.shared_prefix_tokens for v in self.variants) + max(self.task_tokens.high, self.summary_tokens.high)
        if largest_fresh + self.output_tokens.high > self.context_window_tokens:
            raise InvalidArgument(
                f"context_window_tokens={self.context_window_tokens} cannot hold a fresh context "
                f"of up to {largest_fresh} tokens plus an answer of {self.output_tokens.high}."
            )


PRESETS: Mapping[str, CodingAgentConfig] = MappingProxyType(
    {
        "quick": CodingAgentConfig(num_sessions=32),  # ~1.6K requests, for --quick
        "default": CodingAgentConfig(),
        "large": CodingAgentConfig(num_sessions=800, session_rate_per_s=0.8),
    }
)


@dataclass(slots=True)
class _Context:
    """A session's prompt: append-only segments, keys of its full blocks computed lazily.

    Owned by one session generator; replaced, never edited, on compaction.
    """

    block_tokens: int
    segment_starts: list[int] = field(default_factory=list)
    segment_seeds: list[int] = field(default_factory=list)
    num_tokens: int = 0
    keys: list[BlockHash] = field(default_factory=list)

    def append(self, seed: int, num_tokens: int) -> None:
        self.segment_starts.append(self.num_tokens)
        self.segment_seeds.append(seed)
        self.num_tokens += num_tokens

    def block_hashes(self) -> tuple[BlockHash, ...]:
        # Full blocks never change once full (segments are only appended), so keys
        # computed for earlier turns stay valid and only the new ones are hashed.
        parent = self.keys[-1] if self.keys else None
        for block in range(len(self.keys), self.num_tokens // self.block_tokens):
            parent = hash_block(parent, self._block_words(block))
            self.keys.append(parent)
        return tuple(self.keys)

    def _block_words(self, block: int) -> list[int]:
        begin, end = block * self.block_tokens, (block + 1) * self.block_tokens
        words: list[int] = []
        segment_ends = self.segment_starts[1:] + [self.num_tokens]
        segment = bisect_right(self.segment_starts, begin) - 1
        position = begin
        while position < end:
            piece_end = min(end, segment_ends[segment])
            seed = self.segment_seeds[segment]
            offset = position - self.segment_starts[segment]
            words += [seed & 0xFFFFFFFF, seed >> 32, offset, piece_end - position]
            position = piece_end
            segment += 1
        return words


class CodingAgentWorkload:
    """The requests of `CodingAgentConfig.num_sessions` agent sessions, in arrival order."""

    def __init__(self, config: CodingAgentConfig = CodingAgentConfig()) -> None:
        self.config = config

    def requests(self) -> Iterator[Request]:
        """Every request of every session, merged by arrival time; the same on every call."""
        config = self.config
        seed_sequences = np.random.SeedSequence(config.seed).spawn(config.num_sessions + 1)
        schedule_rng = np.random.default_rng(seed_sequences[0])
        weights = np.array([variant.weight for variant in config.variants], dtype=float)
        weights /= weights.sum()
        sessions = []
        start_s = 0.0
        for index in range(config.num_sessions):
            variant = config.variants[int(schedule_rng.choice(len(config.variants), p=weights))]
            rng = np.random.default_rng(seed_sequences[index + 1])
            sessions.append(self._session(f"s{index:05d}", start_s, variant, rng))
            start_s += schedule_rng.exponential(1.0 / config.session_rate_per_s)
        # Ties (none in practice: times are continuous) break by session index.
        return heapq.merge(*sessions, key=lambda request: request.arrival_s)

    def _session(self, session_id: str, start_s: float, variant: AgentVariant, rng: np.random.Generator) -> Iterator[Request]:
        config = self.config
        num_turns = config.num_turns.sample(rng)
        context = self._fresh_context(variant, config.task_tokens.sample(rng), rng)
        arrival_s = start_s
        for _ in range(num_turns):
            num_output_tokens = config.output_tokens.sample(rng)
            if context.num_tokens + num_output_tokens > config.context_window_tokens:
                context = self._fresh_context(variant, config.summary_tokens.sample(rng), rng)
            yield Request(
                arrival_s=arrival_s,
                session_id=session_id,
                block_hashes=context.block_hashes(),
                num_prompt_tokens=context.num_tokens,
                num_output_tokens=num_output_tokens,
                block_tokens=config.block_tokens,
            )
            # The answer and the tool result enter the context as one segment: the split
            # between them never matters to a block key.
            context.append(_draw_seed(rng), num_output_tokens + config.tool_result_tokens.sample(rng))
            arrival_s += num_output_tokens / config.decode_tokens_per_s + rng.exponential(config.tool_time_mean_s)

    def _fresh_context(self, variant: AgentVariant, num_own_tokens: int, rng: np.random.Generator) -> _Context:
        """The variant's shared prompt followed by this session's own task or summary."""
        context = _Context(self.config.block_tokens)
        context.append(_variant_seed(variant), variant.shared_prefix_tokens)
        context.append(_draw_seed(rng), num_own_tokens)
        return context


def _draw_seed(rng: np.random.Generator) -> int:
    return int(rng.integers(0, 2**64, dtype=np.uint64))


def _variant_seed(variant: AgentVariant) -> int:
    return xxhash.xxh3_64_intdigest(b"kvstore/agent-variant/" + variant.name.encode())
