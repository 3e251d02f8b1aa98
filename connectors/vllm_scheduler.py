"""The scheduler half of the vLLM connector: how much of a prompt kvstore can supply, and
which blocks each step loads and saves.

Keys are kvstore's chained block hashes of the prompt's token ids under this engine's
namespace, so any engine with the same model, layout and salt finds them — no engine
hash (and no ``PYTHONHASHSEED``) is involved.

A hit is counted only when every tensor-parallel rank's namespace holds the blocks in a
tier the workers can load from (HBM, host, NVMe); blocks held by peers or by an engine's
own GPU cache are not loadable here and end the hit. The lookup holds the blocks it
counted from eviction (tiers/holds.py) until the worker has loaded them: the hold is
released once the load window (``LOAD_WINDOW_STEPS``) after the step that loads them has
passed, when vLLM takes none of the hit, when the request is looked up again or finishes,
and at ``lookup_hold_s`` at the latest. What could still fail (a block failing its
checksum, a tier failing) is reported by the worker and recomputed, never served.

With ``defer_saves`` a step's saves are committed after the step (vllm_saves): a request
that finishes while a save of it may still copy out of its blocks keeps them —
``finished`` answers True and the next step's metadata names it in ``delayed_frees`` —
until every rank reports it in ``finished_sending``. What may still be in flight is known
from the ranks' ``SaveProgress``: every rank settles each step that saved a request, so
a request whose steps are all settled on every rank is freed at once.

Prefill/decode disaggregation (``kv_producer`` / ``kv_consumer``), with a proxy passing
vLLM's ``kv_transfer_params``: on the prefill instance a request marked
``do_remote_decode`` hands its full prompt blocks to the decode daemon
(``kvstore_destination``, or the configured ``handoff_destination``) in the step that
completes its prompt, and ``request_finished`` returns the transfer's parameters for
the decode request; on the decode instance a request marked ``do_remote_prefill`` with a
``kvstore_transfer_id`` is loaded asynchronously from that handoff. Requests without
these marks are served as ``kv_both`` on either instance.

Owner: vLLM's scheduler thread; nothing here is shared with other threads.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvstore.client import KVStoreClient
from kvstore.connectors.vllm_compat import (
    EngineGeometry,
    ScheduledRequest,
    block_extra_keys,
    connector_logger,
    first_group_block_ids,
    log_failure,
    preempted_requests,
    prompt_token_ids,
    scheduled_requests,
    transfer_params,
)
from kvstore.connectors.vllm_meta import (
    DESTINATION,
    LOAD_WINDOW_STEPS,
    TRANSFER_ID,
    ConnectorSettings,
    HandoffSpec,
    KVStoreConnectorMetadata,
    LoadSpec,
    SaveProgress,
    SaveSpec,
    namespace_for,
)
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.hashing import BlockHash, chain_hashes
from kvstore.tier_kind import TierKind

__all__ = ["SchedulerSide", "SchedulerCounters"]

logger = connector_logger(__name__)
_LOADABLE_TIERS = frozenset({TierKind.HBM, TierKind.HOST, TierKind.NVME})


@dataclass
class SchedulerCounters:
    lookups: int = 0
    lookup_failures: int = 0  # daemon unreachable or refusing: counted as misses
    external_hit_tokens: int = 0  # tokens promised to vLLM (loaded, or recomputed on failure)
    saved_blocks_planned: int = 0
    handoffs_sent: int = 0
    handoffs_received: int = 0
    async_loads: int = 0  # loads from a slow tier (NVMe), beside the steps
    lookup_s: float = 0.0  # the lookups' round trips to the daemon, on the scheduler thread


@dataclass
class _Request:
    prompt: list[int]
    hashes: list[BlockHash]
    block_ids: list[int]
    first_hit_block: int = 0  # where the last lookup started (vLLM's local hit)
    hit_tiers: tuple[TierKind, ...] = ()  # tier of each block of the last lookup's hit
    params: dict | None = None  # the request's kv_transfer_params
    handoff: HandoffSpec | None = None  # PD producer: the handoff opened for it
    handoff_tried: bool = False  # PD consumer: once only; a retry (failure, preemption) uses the store
    keyed: bool = True  # False: its extra hash keys could not be encoded, so kvstore neither loads nor saves it
    hold_id: int = 0  # the daemon's hold on the blocks its last lookup counted (0: none)
    load_hold: int = 0  # that hold once its load is planned inside a step (released after the load window)
    loads_async: bool = False  # its hit reads a slow tier: loaded beside the steps
    unsettled_saves: int = 0  # its steps' saves times the ranks, less those the ranks settled (defer_saves)


class SchedulerSide:
    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry, role: str) -> None:
        self._block_size = geometry.block_size
        self._settings = settings
        self._role = role
        # the engine starts and serves whether or not the daemon is up: a daemon that is away is misses
        self._client = KVStoreClient(settings.socket_path, timeout_s=settings.daemon_timeout_s, require_daemon=False)
        # one namespace per rank; MLA's ranks share one (the same latent KV on every rank)
        self._digests = list(
            dict.fromkeys(
                self._client.ensure_namespace(namespace_for(geometry, rank, settings.tenant_salt)) for rank in range(geometry.tp_size)
            )
        )
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadSpec] = []
        self._recent_loads: deque[frozenset[int]] = deque(maxlen=LOAD_WINDOW_STEPS)  # engine blocks loaded per step
        self._loading_holds: list[int] = []  # holds of the loads of the step being planned
        self._holds_in_flight: deque[list[int]] = deque()  # per step of the load window, its loads' holds
        self._holds_to_release: list[int] = []
        self._num_ranks = geometry.tp_size  # every rank settles every save, an MLA rank that only reads too
        self._delayed_frees: list[str] = []  # finished since the last metadata, blocks kept for their saves
        self._frees_pending: set[str] = set()  # blocks kept until the ranks report them in finished_sending
        self.counters = SchedulerCounters()

    # -- admission -------------------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's block-aligned local hit) that
        kvstore will supply, and whether they arrive asynchronously (a handoff).

        Whole blocks — except that vLLM must compute at least one token, so a hit
        covering the whole prompt stops one token short (the last block is still loaded
        whole; the recomputed token's KV lands in its own slot)."""
        state = self._state(request)
        if not state.keyed:
            return 0, False
        first = num_computed_tokens // self._block_size
        num_full = len(state.prompt) // self._block_size
        state.first_hit_block = first
        receiving = self._receives_handoff(state)
        if receiving:
            state.hit_tiers = (TierKind.REMOTE,) * max(0, num_full - first)
        else:
            state.hit_tiers = self._loadable_prefix(state, state.hashes[first:num_full]) if num_full > first else ()
        hit_end = min((first + len(state.hit_tiers)) * self._block_size, len(state.prompt) - 1)
        num_tokens = max(0, hit_end - first * self._block_size)
        slow = self._settings.async_load_tiers
        state.loads_async = not receiving and any(tier in slow for tier in state.hit_tiers[: -(-num_tokens // self._block_size)])
        return num_tokens, (receiving or state.loads_async) and num_tokens > 0

    def hit_tiers(self, req_id: str) -> tuple[TierKind, ...]:
        state = self._requests.get(req_id)
        return state.hit_tiers if state is not None else ()

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if num_external_tokens <= 0:
            self._drop_hold(state)  # vLLM took none of the hit
            return
        if state.hold_id and not state.loads_async:
            self._loading_holds.append(state.hold_id)  # released once this step's loads are done
            state.load_hold, state.hold_id = state.hold_id, 0  # (an asynchronous load's when the request is scheduled: _track)
        block_ids = first_group_block_ids(blocks.get_block_ids())
        first = state.first_hit_block
        stop = first + -(-num_external_tokens // self._block_size)
        hashes, targets = tuple(state.hashes[first:stop]), tuple(block_ids[first:stop])
        if self._receives_handoff(state):
            state.handoff_tried = True
            self._loads.append(LoadSpec(request.request_id, hashes, targets, state.params[TRANSFER_ID], first))
            self.counters.handoffs_received += 1
            source = f"handoff {state.params[TRANSFER_ID]!r}"
        else:
            self._loads.append(LoadSpec(request.request_id, hashes, targets, first_block=first, asynchronous=state.loads_async))
            self.counters.async_loads += state.loads_async
            source = "kvstore, beside the steps" if state.loads_async else "kvstore"
        self.counters.external_hit_tokens += num_external_tokens
        logger.info(
            "kvstore: request %s loads %d tokens (%d blocks) from %s after a local hit of %d tokens",
            request.request_id,
            num_external_tokens,
            stop - first,
            source,
            first * self._block_size,
        )

    # -- per step --------------------------------------------------------------------------
    def build_metadata(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        metadata = KVStoreConnectorMetadata(loads=self._loads, delayed_frees=self._delayed_frees)
        self._loads, self._delayed_frees = [], []
        metadata.preempted_saving = any(
            self._requests[req_id].unsettled_saves for req_id in preempted_requests(scheduler_output) if req_id in self._requests
        )
        self._recent_loads.append(frozenset(block for spec in metadata.loads if spec.in_step for block in spec.block_ids))
        # the loads planned LOAD_WINDOW_STEPS steps ago have run: vLLM has their step's output
        self._holds_in_flight.append(self._loading_holds)
        self._loading_holds = []
        while len(self._holds_in_flight) > LOAD_WINDOW_STEPS:
            self._holds_to_release += self._holds_in_flight.popleft()
        recent_loads = frozenset().union(*self._recent_loads)
        for scheduled in scheduled_requests(scheduler_output):
            state = self._track(scheduled)
            if state is None:
                continue
            handoff = self._handoff_of(scheduled, state)
            if handoff is not None:  # the handoff stores the blocks on this node too
                metadata.handoffs.append(handoff)
                continue
            save = self._save_of(scheduled, state, recent_loads)
            if save is not None:
                metadata.saves.append(save)
                self.counters.saved_blocks_planned += len(save.hashes)
                if self._settings.defer_saves:
                    state.unsettled_saves += self._num_ranks
        self._flush_releases()
        return metadata

    def finished(self, request: Any) -> tuple[bool, dict | None]:
        """Whether vLLM keeps the request's blocks until the ranks report it (a save of it
        may still copy out of them), and the kv_transfer_params a decode instance needs
        (PD producer), else None."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        delayed = state.unsettled_saves > 0
        if delayed:
            self._delayed_frees.append(request.request_id)
            self._frees_pending.add(request.request_id)
        # looked up and never loaded, or loaded in a step whose output vLLM has: an engine
        # that goes idle after this request leaves nothing held
        self._drop_hold(state)
        if state.load_hold:
            for holds in (self._loading_holds, *self._holds_in_flight):
                if state.load_hold in holds:
                    holds.remove(state.load_hold)
                    self._release(state.load_hold)
        self._flush_releases()
        if state.handoff is None:
            return delayed, None
        return delayed, {
            "do_remote_prefill": True,
            TRANSFER_ID: state.handoff.transfer_id,
            DESTINATION: state.handoff.destination,
            "kvstore_num_blocks": len(state.handoff.hashes),
        }

    def workers_reported(self, progress: Any, finished_sending: set[str] | None) -> None:
        """A step's output: the saves the ranks settled (``SaveProgress``, summed over the
        ranks), and the finished requests whose blocks vLLM frees now."""
        if isinstance(progress, SaveProgress):
            for req_id, count in progress.settled.items():
                state = self._requests.get(req_id)
                if state is not None:  # else finished already: its blocks wait for finished_sending
                    state.unsettled_saves -= count
                    assert state.unsettled_saves >= 0, (req_id, state.unsettled_saves)
        self._frees_pending.difference_update(finished_sending or ())

    def frees_pending(self) -> bool:
        """Whether blocks kept for saves come back soon: vLLM waits for them rather than
        preempting a request."""
        return bool(self._frees_pending)

    def close(self) -> None:
        self._client.close()  # the daemon ends this connection's holds with it

    # -- helpers ---------------------------------------------------------------------------
    def _state(self, request: Any) -> _Request:
        """The request's state, its block keys covering its tokens and everything else that
        changes their KV (cache salt, LoRA adapter, multimodal inputs: vllm_compat.block_extra_keys)."""
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = prompt_token_ids(request)
            try:
                extra_keys, keyed = block_extra_keys(request, self._block_size), True
            except InvalidArgument as exc:
                logger.warning("kvstore: request %s is not cached: %s", request.request_id, exc)
                extra_keys, keyed = None, False
            hashes = chain_hashes(prompt, self._block_size, extra_keys=extra_keys) if keyed else []
            state = _Request(prompt, hashes, [], params=transfer_params(request), keyed=keyed)
            self._requests[request.request_id] = state
        return state

    def _receives_handoff(self, state: _Request) -> bool:
        params = state.params or {}
        return (
            self._role == "kv_consumer"
            and bool(params.get("do_remote_prefill"))
            and bool(params.get(TRANSFER_ID))
            and not state.handoff_tried
        )

    def _loadable_prefix(self, state: _Request, hashes: list[BlockHash]) -> tuple[TierKind, ...]:
        """Tiers of the blocks of ``hashes`` that every rank can load, from the first
        block on; per block, the slowest tier any rank holds it in. The blocks found are
        held for the load (``state.hold_id``), replacing the request's earlier hold; holds
        waiting to be released go in the same round trip."""
        self.counters.lookups += 1
        per_rank: list[tuple[TierKind, ...]] = []
        self._drop_hold(state)
        release, self._holds_to_release = self._holds_to_release, []
        began = time.perf_counter()
        try:
            held = self._client.lookup_held(self._digests, hashes, self._settings.lookup_hold_s, release)
            state.hold_id = held.hold_id
            for found in held.results:  # every rank, one round trip
                tiers = found.tiers
                loadable = next((i for i, tier in enumerate(tiers) if tier not in _LOADABLE_TIERS), len(tiers))
                per_rank.append(tiers[:loadable])
        except KVStoreError as exc:
            self._holds_to_release = release + self._holds_to_release  # again later: a release twice is harmless
            self.counters.lookup_failures += 1
            log_failure(logger, "lookup failed, treating it as a miss", exc)
            return ()
        finally:
            self.counters.lookup_s += time.perf_counter() - began
        return tuple(max(tiers, key=lambda tier: tier.rank) for tiers in zip(*per_rank))

    def _release(self, hold_id: int) -> None:
        if hold_id:
            self._holds_to_release.append(hold_id)

    def _drop_hold(self, state: _Request) -> None:
        """Let go of the request's lookup hold, if it has one (released with the next round trip)."""
        self._release(state.hold_id)
        state.hold_id = 0

    def _flush_releases(self) -> None:
        """Send the releases no lookup of this step carried (one notice, no answer awaited).
        A daemon that is away has ended the holds with their connection already."""
        release, self._holds_to_release = self._holds_to_release, []
        if release:
            try:
                self._client.release_holds(release)
            except KVStoreError as exc:
                log_failure(logger, "releasing lookup holds failed; they end at their deadline", exc)

    def _track(self, scheduled: ScheduledRequest) -> _Request | None:
        """The request's state with this step's block table applied. A request the lookup
        never saw has no keys (they need the request itself: its salt, adapter, inputs),
        so it is neither loaded nor saved."""
        state = self._requests.get(scheduled.req_id)
        if state is None or not state.keyed:
            return None
        self._drop_hold(state)  # scheduled: an asynchronous load's is over
        if scheduled.block_ids is not None:
            if scheduled.replaces_block_ids:
                state.block_ids = list(scheduled.block_ids)
            else:
                state.block_ids.extend(scheduled.block_ids)
        return state

    def _save_of(self, scheduled: ScheduledRequest, state: _Request, recent_loads: frozenset[int]) -> SaveSpec | None:
        """The prompt blocks this step's forward pass fills, or None.

        Derived from vLLM's own progress (tokens computed before the step plus those
        scheduled in it), so a step rolled back after a failed load simply saves the
        recomputed blocks later. ``recent_loads``: engine blocks loaded by the steps of
        the load window; those this request attends to become the save's ``reads``
        (its own loaded prefix, and blocks it shares with another request's load)."""
        computed_after = min(scheduled.num_computed_tokens + scheduled.num_scheduled_tokens, len(state.prompt))
        first = scheduled.num_computed_tokens // self._block_size
        stop = min(computed_after // self._block_size, len(state.block_ids))
        if stop <= first:
            return None
        parent = state.hashes[first - 1] if first else None
        reads = tuple(block for block in state.block_ids[:first] if block in recent_loads) if recent_loads else ()
        return SaveSpec(scheduled.req_id, tuple(state.hashes[first:stop]), tuple(state.block_ids[first:stop]), parent, reads)

    def _handoff_of(self, scheduled: ScheduledRequest, state: _Request) -> HandoffSpec | None:
        """PD producer: every full prompt block, in the step that completes the prompt."""
        params = state.params or {}
        if self._role != "kv_producer" or not params.get("do_remote_decode") or state.handoff is not None:
            return None
        if scheduled.num_computed_tokens + scheduled.num_scheduled_tokens < len(state.prompt):
            return None  # an earlier chunk of the prompt
        destination = params.get(DESTINATION) or self._settings.handoff_destination
        num_full = min(len(state.prompt) // self._block_size, len(state.block_ids))
        if not destination or not num_full:
            logger.warning(
                "kvstore: request %s asks for a remote decode but %s; the decode instance will recompute it",
                scheduled.req_id,
                "names no destination (kvstore_destination or handoff_destination)" if not destination else "has no full block",
            )
            return None
        transfer_id = params.get(TRANSFER_ID) or f"kvstore-{scheduled.req_id}-{uuid.uuid4().hex[:12]}"
        state.handoff = HandoffSpec(
            scheduled.req_id, str(transfer_id), str(destination), tuple(state.hashes[:num_full]), tuple(state.block_ids[:num_full])
        )
        self.counters.handoffs_sent += 1
        return state.handoff
