"""Which node of the fleet is cheapest to lose (pure core): the ranking that `kvstore drain
--plan` prints, that `kvstore drain --auto` acts on, and that the router serves
(``GET /kvstore/drain-plan``, kvstore/gateway/scaledown.py).

A node's cost is what the fleet loses with it::

    cost_bytes = value_bytes + live_bytes

- ``value_bytes``: its unique cache weighted by recent use (kvstore/cache_value.py), which
  each daemon measures itself (``Admin.CacheValue``).
- ``live_bytes``: the KV bytes of the distinct context of the live sessions whose affinity
  points at it (index/live.py: their tokens × the namespace's bytes per token). A live
  session will send its context again, so that context counts whole, whatever its blocks'
  idle time, on top of the cache: the sum counts a live session's own unique blocks twice,
  erring toward keeping the nodes that serve live sessions. Only the router knows live
  sessions' contexts; a plan built from the daemons alone has none (``None``).

Cheapest first, ties by node id. A node whose figure is not known (it did not answer, or
nobody knows its address) comes last with the reason, and is never the one chosen: it
might hold anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvstore.cache_value import CacheValue

__all__ = ["Standing", "rank", "cheapest", "reason", "plan_document"]


@dataclass(frozen=True, slots=True)
class Standing:
    """One node in a plan: its figure, or why it is not known."""

    node_id: str
    address: str = ""  # its daemon's gRPC address, where a drain is asked
    value: CacheValue | None = None  # None: not known (``error`` says why)
    live_bytes: int | None = None  # None: the planner does not know the node's live sessions
    error: str = ""

    @property
    def known(self) -> bool:
        return self.value is not None

    @property
    def cost_bytes(self) -> float | None:
        if self.value is None:
            return None
        return self.value.value_bytes + (self.live_bytes or 0)


def rank(standings: Iterable[Standing]) -> list[Standing]:
    """Known nodes cheapest first (ties by node id), then the unknown ones by node id."""
    standings = list(standings)
    known = sorted((s for s in standings if s.known), key=lambda s: (s.cost_bytes, s.node_id))
    unknown = sorted((s for s in standings if not s.known), key=lambda s: s.node_id)
    return known + unknown


def cheapest(ranked: list[Standing]) -> Standing | None:
    """The node to drain first: the cheapest known one of a `rank`ed plan; None when none is known."""
    return ranked[0] if ranked and ranked[0].known else None


def reason(ranked: list[Standing]) -> str:
    """A sentence saying why `cheapest` is the one, and which nodes were not weighed."""
    first = cheapest(ranked)
    unknown = [s for s in ranked if not s.known]
    not_weighed = "; not known, so never chosen: " + ", ".join(f"{s.node_id} ({s.error})" for s in unknown) if unknown else ""
    if first is None:
        return ("no node's cache value is known" if ranked else "the index lists no daemon") + not_weighed + "."
    value = first.value
    assert value is not None  # cheapest() returns known nodes only
    why = (
        f"{first.node_id} is the cheapest to lose: {_size(first.cost_bytes or 0.0)} of weighted cache "
        f"({value.unique_blocks} of its {value.total_blocks} blocks, {_size(value.unique_bytes)}, held by no other daemon"
    )
    why += f"; live sessions {_size(first.live_bytes)})" if first.live_bytes is not None else ")"
    runner_up = ranked[1] if len(ranked) > 1 and ranked[1].known else None
    why += f", against {_size(runner_up.cost_bytes or 0.0)} for {runner_up.node_id}, the next" if runner_up else ", the only node weighed"
    return why + not_weighed + "."


def plan_document(ranked: list[Standing], half_life_s: float | None) -> dict[str, Any]:
    """The plan as JSON: what the CLI prints with --json and the router answers. Byte figures
    are rounded to whole bytes; the order is the unrounded one's."""
    first = cheapest(ranked)
    nodes = [_node_document(s) for s in ranked]
    lonely = [s.node_id for s in ranked if s.value is not None and s.value.num_peers == 0]
    notes = []
    if lonely and len(ranked) > 1:
        notes.append(
            f"{', '.join(lonely)} see{'s' if len(lonely) == 1 else ''} no other daemon in {'its' if len(lonely) == 1 else 'their'} index, "
            "so every block counts as unique there: the daemons of a fleet share one index (index.backend = a redis:// URL)."
        )
    return {
        "half_life_s": half_life_s,
        "cheapest": first.node_id if first else None,
        "reason": reason(ranked),
        "nodes": nodes,
        "notes": notes,
    }


def _node_document(standing: Standing) -> dict[str, Any]:
    document: dict[str, Any] = {"node_id": standing.node_id, "address": standing.address, "known": standing.known}
    value = standing.value
    if value is None:
        document["error"] = standing.error
        return document
    document.update(
        cost_bytes=round(standing.cost_bytes or 0.0),
        value_bytes=round(value.value_bytes),
        unique_bytes=value.unique_bytes,
        unique_blocks=value.unique_blocks,
        total_bytes=value.total_bytes,
        total_blocks=value.total_blocks,
        num_peers=value.num_peers,
        half_life_s=value.half_life_s,
        live_bytes=standing.live_bytes,
    )
    return document


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"
