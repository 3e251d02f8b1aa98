"""Replay published prefix-block traces (the Mooncake JSON-lines shape) as `Request`s.

One JSON object per line; extra fields are ignored::

    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}

``timestamp`` is the arrival time (milliseconds in Mooncake's traces; see
`TraceFormat.timestamp_unit_s`), ``hash_ids`` are remapped ids of the prompt's blocks of
`TraceFormat.block_tokens` tokens, the last one covering the partial tail when the prompt
is not a whole number of blocks (so ``len(hash_ids) == ceil(input_length / block_tokens)``;
a trace read with the wrong block size is rejected rather than silently misread).

Block keys. An id names a block's *content*; a KV block is reusable only if every block
before it matches too, so a key must identify the whole prefix. Each id stands in for the
block's tokens in kvstore's own chain (`kvstore.hashing`)::

    key[-1] = ROOT_PARENT
    key[i]  = hash_block(key[i-1], [hash_ids[i]])   # XXH3-128(CHAIN_SEED ‖ key[i-1] ‖ u32-LE id)

Equal id prefixes give equal keys; after the first differing id every key differs. Only
full blocks become `Request.block_hashes` (kvstore never keys a partial tail: it changes as
the prompt grows), unless `TraceFormat.keep_partial_block` asks for the trace's own
accounting, where the tail block counts too (that is how the traces' published hit rates
are computed: Mooncake's synthetic trace gives 64.0% of blocks with it, 65.9% without).

Sessions. The traces carry no conversation id, and routers key stickiness on one, so it is
derived, deterministically, from the order of arrival: a request *continues* the session
of the earlier request with which it shares the longest leading run of ids (the most
recent one among equals) when that run is at least `min_shared_blocks` long and covers at
least `continuation_fraction` of that earlier request's full blocks; otherwise it opens a
new session, named ``"t<line>"`` after its line in the file. Why this rule: a turn of a
conversation resends the previous turn's prompt, so it extends its predecessor's chain;
chat templates re-render the last few hundred tokens (Mooncake's synthetic trace rewrites
1-7 trailing blocks in a quarter of its follow-ups), so an exact extension is too strict, but
keeping most of the earlier prompt is not; and a new conversation that merely shares a
system prompt with an earlier, longer one stays a separate session. A rule keyed on the
first block alone would merge every conversation that shares a system prompt into one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from bench.sim.workload import Request
from kvstore.errors import InvalidArgument
from kvstore.hashing import CHAIN_SEED, ROOT_PARENT, BlockHash

__all__ = [
    "TraceFormat",
    "TraceFormatError",
    "read_trace",
    "parse_trace_lines",
    "oracle_hit_rate",
    "oracle_hit_tokens",
    "MOONCAKE_TRACE",
    "trace_folders",
    "shared_trace",
]

MOONCAKE_TRACE = "mooncake_synthetic_trace.jsonl"

_MAX_BLOCK_ID = 2**32 - 1  # ids are hashed as one uint32 "token", as kvstore hashes tokens


class TraceFormatError(InvalidArgument):
    """A trace line is malformed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """How to read a trace. Defaults fit Mooncake's published traces."""

    block_tokens: int = 512  # Mooncake's traces hash 512-token blocks (Bailian's: 16)
    timestamp_unit_s: float = 1e-3  # Mooncake's timestamps are milliseconds
    keep_partial_block: bool = False  # True reproduces the traces' published hit rates
    # Session derivation (see the module docstring): 2 blocks so that one common first block
    # (a short shared preamble) links nothing; 0.75 keeps all but one of the synthetic
    # trace's near-extensions.
    min_shared_blocks: int = 2
    continuation_fraction: float = 0.75

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise InvalidArgument(f"block_tokens must be positive, got {self.block_tokens}.")
        if not self.timestamp_unit_s > 0:
            raise InvalidArgument(f"timestamp_unit_s must be positive, got {self.timestamp_unit_s}.")
        if self.min_shared_blocks < 1:
            raise InvalidArgument(f"min_shared_blocks must be at least 1, got {self.min_shared_blocks}.")
        if not 0.0 <= self.continuation_fraction <= 1.0:
            raise InvalidArgument(f"continuation_fraction must lie in [0, 1], got {self.continuation_fraction}.")


@dataclass(frozen=True, slots=True)
class _TraceLine:
    line_no: int
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _SessionMark:
    """The most recent request whose chain passed through a key."""

    session_id: str
    num_full_blocks: int


def trace_folders() -> list[Path]:
    """Where the shared traces may be: $KVSTORE_TRACES, then shared/traces in or beside the checkout."""
    root = Path(__file__).resolve().parents[2]
    folders = [root / "shared/traces", root.parent / "shared/traces"]
    if "KVSTORE_TRACES" in os.environ:
        folders.insert(0, Path(os.environ["KVSTORE_TRACES"]))
    return folders


def shared_trace(name: str = MOONCAKE_TRACE) -> Path | None:
    """The shared trace file ``name``, or None where no folder of `trace_folders` has it."""
    return next((folder / name for folder in trace_folders() if (folder / name).is_file()), None)


def read_trace(path: str | os.PathLike[str], trace_format: TraceFormat = TraceFormat()) -> list[Request]:
    """Read a JSON-lines trace file into `Request`s in arrival order."""
    with open(path, encoding="utf-8") as lines:
        return parse_trace_lines(lines, trace_format, source=os.fspath(path))


def parse_trace_lines(lines: Iterable[str], trace_format: TraceFormat = TraceFormat(), source: str = "<trace>") -> list[Request]:
    """Parse trace lines into `Request`s, sorted by arrival (file order among equal times).

    Blank lines are skipped; any other malformed line raises `TraceFormatError` naming
    ``source`` and the 1-based line number.
    """
    parsed = [_parse_line(text, line_no, trace_format, source) for line_no, text in enumerate(lines, start=1) if text.strip()]
    # Stable: the README promises order within a conversation; sorting must keep it.
    parsed.sort(key=lambda line: line.arrival_s)
    return _to_requests(parsed, trace_format)


def oracle_hit_rate(requests: Iterable[Request], per: str = "block") -> float:
    """Hit rate of one replica with an infinite cache, serving ``requests`` in order.

    A block hits only if its key was seen before and every block before it in the same
    prompt hit (an engine loads the longest cached prefix, nothing past a miss).
    ``per="block"`` divides hit blocks by prompt blocks; ``per="token"`` divides hit
    tokens by prompt tokens (so partial tails and key-less short prompts count as misses).
    """
    if per not in ("block", "token"):
        raise InvalidArgument(f"per must be 'block' or 'token', got {per!r}.")
    num_blocks = num_hit_blocks = num_tokens = num_hit_tokens = 0
    for request, num_hits in _oracle_hits(requests):
        num_blocks += len(request.block_hashes)
        num_hit_blocks += num_hits
        num_tokens += request.num_prompt_tokens
        num_hit_tokens += min(num_hits * request.block_tokens, request.num_prompt_tokens)
    if per == "block":
        return num_hit_blocks / num_blocks if num_blocks else 0.0
    return num_hit_tokens / num_tokens if num_tokens else 0.0


def oracle_hit_tokens(requests: Iterable[Request]) -> list[int]:
    """Per request, in order, the prompt tokens the oracle of `oracle_hit_rate` serves from
    its cache: what any placement of that request could reuse at best, so a replica's
    share of them says how much reuse the requests routed to it offered."""
    return [min(num_hits * request.block_tokens, request.num_prompt_tokens) for request, num_hits in _oracle_hits(requests)]


def _oracle_hits(requests: Iterable[Request]) -> Iterator[tuple[Request, int]]:
    """Each request with the number of leading blocks one infinite cache holds when it arrives."""
    seen: set[BlockHash] = set()
    for request in requests:
        num_hits = _leading_hits(request.block_hashes, seen)
        seen.update(request.block_hashes)
        yield request, num_hits


def _leading_hits(keys: Sequence[BlockHash], seen: Container[BlockHash]) -> int:
    for index, key in enumerate(keys):
        if key not in seen:
            return index
    return len(keys)


def _to_requests(lines: Sequence[_TraceLine], trace_format: TraceFormat) -> list[Request]:
    marks: dict[BlockHash, _SessionMark] = {}
    requests: list[Request] = []
    for line in lines:
        keys = _chain_keys(line.hash_ids)
        num_full = line.num_prompt_tokens // trace_format.block_tokens
        session_id = _continued_session(keys, marks, trace_format) or f"t{line.line_no}"
        mark = _SessionMark(session_id, num_full)
        for key in keys:
            marks[key] = mark
        num_keyed = len(keys) if trace_format.keep_partial_block else num_full
        requests.append(
            Request(
                arrival_s=line.arrival_s,
                session_id=session_id,
                block_hashes=tuple(keys[:num_keyed]),
                num_prompt_tokens=line.num_prompt_tokens,
                num_output_tokens=line.num_output_tokens,
                block_tokens=trace_format.block_tokens,
            )
        )
    return requests


def _chain_keys(hash_ids: Sequence[int]) -> list[BlockHash]:
    # Same bytes as kvstore.hashing.hash_block(parent, [block_id]) without a numpy
    # round-trip per block: a trace holds hundreds of thousands of blocks.
    keys: list[BlockHash] = []
    parent = ROOT_PARENT
    digest = xxhash.xxh3_128_digest
    for block_id in hash_ids:
        parent = BlockHash(digest(CHAIN_SEED + parent + block_id.to_bytes(4, "little")))
        keys.append(parent)
    return keys


def _continued_session(keys: Sequence[BlockHash], marks: dict[BlockHash, _SessionMark], trace_format: TraceFormat) -> str | None:
    num_shared = _leading_hits(keys, marks)
    if num_shared < trace_format.min_shared_blocks:
        return None
    earlier = marks[keys[num_shared - 1]]
    if num_shared < trace_format.continuation_fraction * earlier.num_full_blocks:
        return None
    return earlier.session_id


def _parse_line(text: str, line_no: int, trace_format: TraceFormat, source: str) -> _TraceLine:
    where = f"{source}:{line_no}"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg}).") from exc
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    timestamp = _field(record, "timestamp", (int, float), where)
    num_prompt_tokens = _field(record, "input_length", (int,), where)
    num_output_tokens = _field(record, "output_length", (int,), where)
    hash_ids = _field(record, "hash_ids", (list,), where)
    if not math.isfinite(timestamp) or timestamp < 0:
        raise TraceFormatError(f"{where}: timestamp must be a finite number >= 0, got {timestamp}.")
    if num_prompt_tokens <= 0 or num_output_tokens < 0:
        raise TraceFormatError(
            f"{where}: input_length must be > 0 and output_length >= 0, got {num_prompt_tokens} and {num_output_tokens}."
        )
    for block_id in hash_ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id <= _MAX_BLOCK_ID:
            raise TraceFormatError(f"{where}: hash_ids must be integers in [0, 2**32), found {block_id!r}.")
    expected = math.ceil(num_prompt_tokens / trace_format.block_tokens)
    if len(hash_ids) != expected:
        raise TraceFormatError(
            f"{where}: {len(hash_ids)} hash_ids for {num_prompt_tokens} prompt tokens, expected "
            f"{expected} at {trace_format.block_tokens} tokens per block; is block_tokens right?"
        )
    return _TraceLine(
        line_no=line_no,
        arrival_s=float(timestamp) * trace_format.timestamp_unit_s,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        hash_ids=tuple(hash_ids),
    )


def _field(record: dict, name: str, types: tuple[type, ...], where: str):
    if name not in record:
        raise TraceFormatError(f"{where}: missing field {name!r}.")
    value = record[name]
    # bool is an int in Python; true/false is never a length or a time.
    if isinstance(value, bool) or not isinstance(value, types):
        wanted = " or ".join(t.__name__ for t in types)
        raise TraceFormatError(f"{where}: field {name!r} must be {wanted}, got {value!r}.")
    return value
