"""The scheduler half of the vLLM connector: how much of a prompt kvstore can supply, and
which blocks each step loads and saves.

Keys are kvstore's chained block hashes of the prompt's token ids under this engine's
namespace, so any engine with the same model, layout and salt finds them — no engine
hash (and no ``PYTHONHASHSEED``) is involved.

A hit is counted only when every tensor-parallel rank's namespace holds the blocks in a
tier the workers can load from (HBM, host, NVMe); blocks held by peers or by an engine's
own GPU cache are not loadable here and end the hit. What could still fail between the
lookup and the load (eviction, a block failing its checksum) is reported by the worker
and recomputed, never served.

Owner: vLLM's scheduler thread; nothing here is shared with other threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.connectors.vllm_compat import (
    EngineGeometry,
    ScheduledRequest,
    connector_logger,
    first_group_block_ids,
    prompt_token_ids,
    scheduled_requests,
)
from kvstore.connectors.vllm_meta import ConnectorSettings, KVStoreConnectorMetadata, LoadSpec, SaveSpec, namespace_for
from kvstore.errors import KVStoreError
from kvstore.hashing import BlockHash, chain_hashes
from kvstore.tiers.base import TierKind

__all__ = ["SchedulerSide", "SchedulerCounters"]

logger = connector_logger(__name__)
_LOADABLE_TIERS = frozenset({TierKind.HBM, TierKind.HOST, TierKind.NVME})


@dataclass
class SchedulerCounters:
    lookups: int = 0
    lookup_failures: int = 0  # daemon unreachable or refusing: counted as misses
    external_hit_tokens: int = 0  # tokens promised to vLLM (loaded, or recomputed on failure)
    saved_blocks_planned: int = 0


@dataclass
class _Request:
    prompt: list[int]
    hashes: list[BlockHash]
    block_ids: list[int]
    first_hit_block: int = 0  # where the last lookup started (vLLM's local hit)
    hit_tiers: tuple[TierKind, ...] = ()  # tier of each block of the last lookup's hit


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry, saves: bool) -> None:
        self._block_size = geometry.block_size
        self._saves = saves
        self._client = KVStoreClient(settings.socket_path)
        self._digests = [
            self._client.register_namespace(namespace_for(geometry, rank, settings.tenant_salt))
            for rank in range(geometry.tp_size)
        ]
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self.counters = SchedulerCounters()

    # -- admission -------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's block-aligned local hit) that
        kvstore holds, in whole blocks — except that vLLM must compute at least one
        token, so a hit covering the whole prompt stops one token short (the last block
        is still loaded whole; the recomputed token's KV lands in its own slot)."""
        state = self._state(request.request_id, prompt_token_ids(request))
        first = num_computed_tokens // self._block_size
        num_full = len(state.prompt) // self._block_size
        state.first_hit_block = first
        state.hit_tiers = self._loadable_prefix(state.hashes[first:num_full]) if num_full > first else ()
        hit_end = min((first + len(state.hit_tiers)) * self._block_size, len(state.prompt) - 1)
        return max(0, hit_end - first * self._block_size)

    def hit_tiers(self, req_id: str) -> tuple[TierKind, ...]:
        state = self._requests.get(req_id)
        return state.hit_tiers if state is not None else ()

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        block_ids = first_group_block_ids(blocks.get_block_ids())
        first = state.first_hit_block
        stop = first + -(-num_external_tokens // self._block_size)
        self._loads.append(LoadSpec(request.request_id, tuple(state.hashes[first:stop]), tuple(block_ids[first:stop])))
        self.counters.external_hit_tokens += num_external_tokens
        logger.info("kvstore: request %s loads %d tokens (%d blocks) from kvstore after a local hit of %d tokens",
                    request.request_id, num_external_tokens, stop - first, first * self._block_size)

    # -- per step --------------------------------------------------------------------------
    def build_metadata(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        metadata = KVStoreConnectorMetadata(loads=self._loads)
        self._loads = []
        for scheduled in scheduled_requests(scheduler_output):
            save = self._save_of(scheduled)
            if save is not None:
                metadata.saves.append(save)
                self.counters.saved_blocks_planned += len(save.hashes)
        return metadata

    def finished(self, request: Any) -> None:
        self._requests.pop(request.request_id, None)

    def close(self) -> None:
        self._client.close()

    # -- helpers ---------------------------------------------------------------------------
    def _state(self, req_id: str, prompt: list[int]) -> _Request:
        state = self._requests.get(req_id)
        if state is None:
            state = _Request(prompt, chain_hashes(prompt, self._block_size), [])
            self._requests[req_id] = state
        return state

    def _loadable_prefix(self, hashes: list[BlockHash]) -> tuple[TierKind, ...]:
        """Tiers of the blocks of ``hashes`` that every rank can load, from the first
        block on; per block, the slowest tier any rank holds it in."""
        self.counters.lookups += 1
        per_rank: list[tuple[TierKind, ...]] = []
        try:
            for digest in self._digests:
                tiers = self._client.lookup(digest, hashes).tiers
                loadable = next((i for i, tier in enumerate(tiers) if tier not in _LOADABLE_TIERS), len(tiers))
                per_rank.append(tiers[:loadable])
        except KVStoreError as exc:
            self.counters.lookup_failures += 1
            logger.warning("kvstore: lookup failed, treating it as a miss: %s", exc)
            return ()
        return tuple(max(tiers, key=lambda tier: tier.rank) for tiers in zip(*per_rank))

    def _save_of(self, scheduled: ScheduledRequest) -> SaveSpec | None:
        """The prompt blocks this step's forward pass fills, or None.

        Derived from vLLM's own progress (tokens computed before the step plus those
        scheduled in it), so a step rolled back after a failed load simply saves the
        recomputed blocks later."""
        if scheduled.prompt_token_ids is not None:
            state = self._state(scheduled.req_id, scheduled.prompt_token_ids)
        else:
            state = self._requests.get(scheduled.req_id)
            if state is None:
                return None
        if scheduled.block_ids is not None:
            if scheduled.replaces_block_ids:
                state.block_ids = list(scheduled.block_ids)
            else:
                state.block_ids.extend(scheduled.block_ids)
        if not self._saves:
            return None
        computed_after = min(scheduled.num_computed_tokens + scheduled.num_scheduled_tokens, len(state.prompt))
        first = scheduled.num_computed_tokens // self._block_size
        stop = min(computed_after // self._block_size, len(state.block_ids))
        if stop <= first:
            return None
        parent = state.hashes[first - 1] if first else None
        return SaveSpec(scheduled.req_id, tuple(state.hashes[first:stop]), tuple(state.block_ids[first:stop]), parent)
