"""Why a replica computed each prompt token it did not find cached: the router's miss
attribution (kvstore_router_prefill_tokens{cause,replica}).

When a request's answer reports its cached tokens, the router splits the rest of the
prompt — the tokens the engine computed, positions ``[cached, prompt)`` — into causes,
from what it knew when it routed the request (`RouteView`):

- ``not_loaded``: the chosen replica held these blocks (its daemon or its engine's cache,
  as the index said) and the engine computed them anyway — a partial block, a load that
  failed or came too late, a hold that expired, the engine's own eviction since;
- ``elsewhere``: another replica held them and the chosen one did not — routing chose
  load over cache, the session moved, or fetching from peers is off;
- ``evicted``: no replica held them, but the fleet had computed them before (an earlier
  request's chain, within the router's memory of `SeenBlocks`);
- ``diverged``: the session had sent these positions before with other tokens — its
  prompt does not extend its previous turn's (session_log.py says where and why);
- ``new``: none of these — a new message, a new tool result, a new session's own
  context; and the prompt's last partial block, which no cache keeps.

Each token has exactly one cause, checked in that order, so the causes add up to the
prompt tokens less the cached ones: the engine's own count of what it computed. (The
router counts a request it could not key — multimodal inputs — as ``unkeyed``, and does
not attribute prefill/decode disaggregated requests.) A
block's cause is decided by prefix lengths alone — the chain's keys are chained, so a
replica holding block k of it holds the whole prefix up to k (index/base.NodeMatch).

Pure and synchronous; owner: the router's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash

__all__ = ["CAUSES", "RouteView", "SeenBlocks", "attribute"]

CAUSES = ("new", "diverged", "evicted", "elsewhere", "not_loaded")
_KEY_BYTES = 8  # of a block key, in SeenBlocks: a false "seen" once in 2^64 lookups


@dataclass(frozen=True, slots=True)
class RouteView:
    """What the router knew of a request's prompt when it routed it."""

    num_blocks: int = 0  # the prompt's whole blocks (the keyed chain)
    chosen_blocks: int = 0  # of them, the leading blocks the chosen replica held
    elsewhere_blocks: int = 0  # the most leading blocks any other replica held
    seen_blocks: int = 0  # the leading blocks the fleet had computed before (SeenBlocks)
    kept_tokens: int = 0  # the leading tokens the session's previous prompt had alike
    sent_tokens: int = 0  # the positions the session sent before: its previous prompt (and answer, when known changed)

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"RouteView.{name} must be a count >= 0, got {value!r}.")


def attribute(view: RouteView, prompt_tokens: int, cached_tokens: int, block_size: int) -> dict[str, int]:
    """The computed tokens of a prompt of ``prompt_tokens`` whose first ``cached_tokens``
    the engine found cached, by cause (every cause present, 0 where none): they add up to
    ``prompt_tokens - cached_tokens``."""
    if block_size < 1 or prompt_tokens < 0 or cached_tokens < 0:
        raise InvalidArgument(f"attribute needs counts >= 0 and a block size >= 1, got {prompt_tokens}, {cached_tokens}, {block_size}.")
    computed_from = min(cached_tokens, prompt_tokens)
    whole = min(view.num_blocks, prompt_tokens // block_size)
    ends = []  # the blocks' causes as consecutive spans of positions, in order of precedence
    end = 0
    for cause, blocks in (("not_loaded", view.chosen_blocks), ("elsewhere", view.elsewhere_blocks), ("evicted", view.seen_blocks)):
        reach = max(end, min(blocks, whole) * block_size)
        ends.append((end, reach, cause))
        end = reach
    diverged_from, diverged_to = max(view.kept_tokens, end), min(view.sent_tokens, prompt_tokens)
    if diverged_to > diverged_from:
        ends.append((end, diverged_from, "new"))
        ends.append((diverged_from, diverged_to, "diverged"))
        end = diverged_to
    ends.append((end, prompt_tokens, "new"))
    causes = dict.fromkeys(CAUSES, 0)
    for start, stop, cause in ends:
        causes[cause] += max(min(stop, prompt_tokens) - max(start, computed_from), 0)
    return causes


class SeenBlocks:
    """The block keys of chains the fleet computed, the most recent ``capacity`` of them:
    `prefix` answers how many leading blocks of a chain the fleet had computed. A chain's
    keys are recorded last block first, so that the oldest entries to go are a chain's
    last blocks and what is kept of it is always a prefix."""

    def __init__(self, capacity: int = 262_144) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgument(f"SeenBlocks needs a capacity of at least 1 block, got {capacity!r}.")
        self.capacity = capacity
        self._keys: dict[bytes, None] = {}  # in recording order, oldest first

    def __len__(self) -> int:
        return len(self._keys)

    def record(self, hashes: Sequence[BlockHash]) -> None:
        keys = self._keys
        for key in reversed(hashes[: self.capacity]):
            short = key[:_KEY_BYTES]
            keys.pop(short, None)
            keys[short] = None
        while len(keys) > self.capacity:
            del keys[next(iter(keys))]

    def prefix(self, hashes: Sequence[BlockHash]) -> int:
        """The leading blocks of ``hashes`` recorded (a binary search: what is kept of a
        recorded chain is a prefix of it)."""
        low, high = 0, len(hashes)
        while low < high:
            middle = (low + high + 1) // 2
            if hashes[middle - 1][:_KEY_BYTES] in self._keys:
                low = middle
            else:
                high = middle - 1
        return low
