"""Ingest vLLM's KV cache events: an engine's own GPU prefix cache, as tier ``gpu``.

The wire format is vLLM's (v1, ≥ 0.8), ``vllm/distributed/kv_events.py``:
``ZmqEventPublisher`` sends each ``KVEventBatch`` on a PUB socket (default
``tcp://*:5557``, port + data-parallel rank) as the multipart message
``(topic, seq: 8-byte big-endian uint, payload)``, ``seq`` counting batches from 0. An
optional ROUTER socket replays its buffer: a DEALER sends ``(b"", start_seq)`` and gets
``(b"", seq, payload)`` per buffered batch ``>= start_seq``, then ``(b"", -1, b"")``.
``payload`` is msgspec msgpack of::

    EventBatch(ts: float, events: list, data_parallel_rank: int | None = None)
    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                medium, lora_name, extra_keys=None, group_idx=None,
                kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None)
    BlockRemoved(block_hashes, medium, group_idx=None)
    AllBlocksCleared()

Up to vLLM PR #42892 every struct is ``array_like``: an event is ``["BlockStored",
hashes, parent, …]`` with fields appended at the end over versions (``medium`` in #19737,
``lora_name`` #27577, ``extra_keys`` #33304, ``group_idx`` #37688, the spec fields
#40984). Since #42892 an event is a map tagged by ``"type"`` (``omit_defaults`` drops
unset optional fields); in the newest source the batch is no longer array_like either.
Both shapes are decoded, at both levels: the known fields read by position or by name,
anything else ignored. Block hashes are ints or bytes depending on the version; a chain's
first block has parent None.

The engine's hash function is never used: each engine hash is mapped to kvstore's chained
key, recomputed from the event's token ids (DESIGN.md §1). A block whose parent was never
seen (events lost, subscribed late) cannot be keyed and is skipped, never guessed. Blocks
whose KV depends on more than the tokens (a LoRA adapter, multimodal inputs or a cache
salt in ``extra_keys``) are skipped too: keying them by tokens would claim KV they do not
hold. Only GPU-medium events of full-attention groups describe the prefix cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgpack

from kvstore.errors import InvalidArgument
from kvstore.events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored, RemovalReason
from kvstore.hashing import BlockHash, chain_hashes
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind

__all__ = [
    "EngineHash",
    "EngineBlockStored",
    "EngineBlockRemoved",
    "EngineAllBlocksCleared",
    "EngineEventBatch",
    "decode_batch",
    "EngineEventTranslator",
]

logger = logging.getLogger(__name__)

EngineHash = int | bytes
_MAX_ENGINE_HASH_BYTES = 64
_GPU_MEDIA = (None, "GPU", "gpu")  # None: a vLLM older than the medium field
# groups whose blocks hold every token of the prefix; a sliding-window or Mamba group's
# blocks live and die on other terms and say nothing about which prefix is cached
_PREFIX_SPEC_KINDS = (None, "full_attention", "mla_attention", "sink_full_attention")


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # one entry per block, None where tokens alone key it
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class EngineAllBlocksCleared:
    pass


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineEventBatch:
    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None
    num_malformed: int = 0  # events left out: unreadable
    num_unknown: int = 0  # events left out: of a kind a newer vLLM added


# field names in declaration order (= array position after the tag), and how many are required
_LAYOUTS: dict[str, tuple[tuple[str, ...], int]] = {
    "BlockStored": (
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
        ),
        4,
    ),
    "BlockRemoved": (("block_hashes", "medium", "group_idx"), 1),
    "AllBlocksCleared": ((), 0),
}


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise InvalidArgument(f"a vLLM KV event is malformed: {what}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(value: Any, kind: type, name: str) -> Any:
    _check(value is None or (isinstance(value, kind) and not isinstance(value, bool)), f"{name} is a {type(value).__name__}")
    return value


def _engine_hash(value: Any) -> EngineHash:
    _check(
        _is_int(value) or (isinstance(value, bytes) and 0 < len(value) <= _MAX_ENGINE_HASH_BYTES),
        "a block hash is neither an int nor bytes",
    )
    return value


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    _check(isinstance(value, list), "block_hashes is not a list")
    return tuple(_engine_hash(h) for h in value)


def _decode_event(raw: Any) -> EngineEvent | None:
    """One event, or None for a kind this module does not know; raises on a malformed one."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, values = raw["type"], None
    else:
        raise InvalidArgument("a vLLM KV event is neither a tagged array nor a tagged map.")
    layout = _LAYOUTS.get(tag)
    if layout is None:
        return None
    names, num_required = layout
    if values is None:
        _check(all(name in raw for name in names[:num_required]), f"{tag} lacks a required field")
        fields = {name: raw.get(name) for name in names}
    else:
        _check(len(values) >= num_required, f"{tag} has {len(values)} fields")
        fields = dict(zip(names, values + [None] * (len(names) - len(values))))
    if tag == "AllBlocksCleared":
        return EngineAllBlocksCleared()
    hashes = _hashes(fields["block_hashes"])
    if tag == "BlockRemoved":
        return EngineBlockRemoved(hashes, _optional(fields["medium"], str, "medium"), _optional(fields["group_idx"], int, "group_idx"))
    parent = fields["parent_block_hash"]
    token_ids, block_size, extra_keys = fields["token_ids"], fields["block_size"], fields["extra_keys"]
    _check(isinstance(token_ids, list), "token_ids is not a list")
    _check(_is_int(block_size) and block_size > 0, "block_size is not a positive int")
    _check(
        extra_keys is None or (isinstance(extra_keys, list) and len(extra_keys) == len(hashes)),
        "extra_keys does not name one entry per block",
    )
    return EngineBlockStored(
        hashes,
        None if parent is None else _engine_hash(parent),
        tuple(token_ids),
        block_size,
        _optional(fields["lora_id"], int, "lora_id"),
        _optional(fields["medium"], str, "medium"),
        _optional(fields["lora_name"], str, "lora_name"),
        None if extra_keys is None else tuple(extra_keys),
        _optional(fields["group_idx"], int, "group_idx"),
        _optional(fields["kv_cache_spec_kind"], str, "kv_cache_spec_kind"),
    )


def decode_batch(payload: bytes) -> EngineEventBatch:
    """Decode one ``KVEventBatch`` payload. Raises InvalidArgument when the batch itself is
    unreadable; a malformed event inside it is left out and counted, the rest still count."""
    try:
        raw = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError) as exc:  # msgpack's errors are ValueErrors; TypeError: unhashable keys
        raise InvalidArgument(f"a vLLM KV event batch is not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    _check(isinstance(raw, list) and len(raw) >= 2, "the batch is not [ts, events, …]")
    ts, raw_events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    _check(isinstance(ts, (int, float)) and not isinstance(ts, bool) and isinstance(raw_events, list), "the batch's ts or events")
    events: list[EngineEvent] = []
    num_malformed = num_unknown = 0
    for raw_event in raw_events:
        try:
            event = _decode_event(raw_event)
        except InvalidArgument:
            num_malformed += 1
            continue
        if event is None:
            num_unknown += 1
        else:
            events.append(event)
    return EngineEventBatch(float(ts), tuple(events), rank if _is_int(rank) else None, num_malformed, num_unknown)


class EngineEventTranslator:
    """Maps one engine's block hashes to kvstore keys and its events to kvstore events.

    Owner: one subscriber (one engine, one DP rank); pure and synchronous.
    """

    def __init__(self, namespace: Namespace, max_blocks: int = 4_000_000) -> None:
        self.namespace = namespace
        self.max_blocks = max_blocks
        # (group_idx, engine hash) → (kvstore key, kvstore parent key); groups chain separately
        self.engine_to_block: dict[tuple[int, EngineHash], tuple[BlockHash, BlockHash | None]] = {}
        self._warned_block_size = False
        self.num_batches = 0
        self.num_batches_malformed = 0
        self.num_events_malformed = 0
        self.num_events_unknown = 0  # kinds a newer vLLM added
        self.num_events_ignored = 0  # another medium (CPU offload) or a group not keyed by prefix
        self.num_events_wrong_block_size = 0
        self.num_blocks_stored = 0
        self.num_blocks_unmapped = 0  # parent never seen: cannot be keyed
        self.num_blocks_unkeyable = 0  # KV depends on LoRA / extra keys, not tokens alone
        self.num_blocks_over_capacity = 0
        self.num_blocks_removed = 0
        self.num_removals_unknown = 0

    def __len__(self) -> int:
        return len(self.engine_to_block)

    def translate_payload(self, payload: bytes) -> list[BlockEvent]:
        """Decode and translate one batch; a malformed batch is counted and yields nothing."""
        try:
            batch = decode_batch(payload)
        except InvalidArgument as exc:
            self.num_batches_malformed += 1
            logger.debug("skipped a malformed vLLM KV event batch: %s", exc)
            return []
        return self.translate(batch)

    def translate(self, batch: EngineEventBatch) -> list[BlockEvent]:
        self.num_batches += 1
        self.num_events_malformed += batch.num_malformed
        self.num_events_unknown += batch.num_unknown
        out: list[BlockEvent] = []
        for event in batch.events:
            translated: BlockEvent | None
            if isinstance(event, EngineBlockStored):
                translated = self._stored(event)
            elif isinstance(event, EngineBlockRemoved):
                translated = self._removed(event)
            else:
                translated = self.clear()
            if translated is not None:
                out.append(translated)
        return out

    def clear(self) -> AllBlocksCleared:
        """Forget every mapping: the engine's prefix cache is empty."""
        self.engine_to_block.clear()
        return AllBlocksCleared()

    def catalogue(self) -> list[BlockEvent]:
        """AllBlocksCleared, then one BlockStored per mapped block: what the index must hold
        for this engine when it may have lost track of it."""
        digest, nbytes = self.namespace.digest, self.namespace.block_bytes
        stored = [BlockStored(digest, (key,), parent, TierKind.GPU, nbytes) for key, parent in self.engine_to_block.values()]
        return [AllBlocksCleared(), *stored]

    def counters(self) -> dict[str, int]:
        return {name: value for name, value in vars(self).items() if name.startswith("num_")}

    def _stored(self, event: EngineBlockStored) -> BlockStored | None:
        num_blocks = len(event.block_hashes)
        if event.medium not in _GPU_MEDIA or event.kv_cache_spec_kind not in _PREFIX_SPEC_KINDS:
            self.num_events_ignored += 1
            return None
        if event.block_size != self.namespace.block_size:
            self.num_events_wrong_block_size += 1
            if not self._warned_block_size:
                self._warned_block_size = True
                logger.warning(
                    "the engine's KV events use %d-token blocks but namespace %s has %d: its blocks are not indexed; "
                    "give the subscriber the namespace the engine actually serves.",
                    event.block_size,
                    self.namespace.id,
                    self.namespace.block_size,
                )
            return None
        if len(event.token_ids) != num_blocks * event.block_size:
            self.num_events_malformed += 1
            return None
        group = event.group_idx or 0
        parent: BlockHash | None = None
        if event.parent_hash is not None:
            entry = self.engine_to_block.get((group, event.parent_hash))
            if entry is None:
                self.num_blocks_unmapped += num_blocks
                return None
            parent = entry[0]
        num_keyable = num_blocks
        if event.lora_id is not None or event.lora_name is not None:
            num_keyable = 0
        elif event.extra_keys is not None:
            num_keyable = next((i for i, extra in enumerate(event.extra_keys) if extra is not None), num_blocks)
        self.num_blocks_unkeyable += num_blocks - num_keyable
        room = max(0, self.max_blocks - len(self.engine_to_block))
        if num_keyable > room:
            self.num_blocks_over_capacity += num_keyable - room
            num_keyable = room
        if num_keyable == 0:
            return None
        try:
            keys = chain_hashes(event.token_ids[: num_keyable * event.block_size], event.block_size, parent)
        except (ValueError, TypeError):  # token ids that are not uint32 (InvalidArgument), or ragged
            self.num_events_malformed += 1
            return None
        key_parent = parent
        for engine_hash, key in zip(event.block_hashes, keys):
            self.engine_to_block[(group, engine_hash)] = (key, key_parent)
            key_parent = key
        self.num_blocks_stored += len(keys)
        return BlockStored(self.namespace.digest, tuple(keys), parent, TierKind.GPU, self.namespace.block_bytes)

    def _removed(self, event: EngineBlockRemoved) -> BlockRemoved | None:
        if event.medium not in _GPU_MEDIA:
            self.num_events_ignored += 1
            return None
        group = event.group_idx or 0
        keys = []
        for engine_hash in event.block_hashes:
            entry = self.engine_to_block.pop((group, engine_hash), None)
            if entry is None:
                self.num_removals_unknown += 1
            else:
                keys.append(entry[0])
        if not keys:
            return None
        self.num_blocks_removed += len(keys)
        return BlockRemoved(self.namespace.digest, tuple(keys), TierKind.GPU, RemovalReason.CAPACITY)
