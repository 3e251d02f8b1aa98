"""The worker half of the vLLM connector: moves KV between vLLM's paged cache and the
daemon's shared-memory slab, one layer at a time.

Loading: ``start_load`` leases the stored blocks of every request of the step (one round
trip each; the daemon promotes NVMe blocks and verifies them first) and queues one copy
per layer on the copy engine: a CUDA stream, so layer i+1 is copied while the forward pass
computes layer i and ``wait_for_layer`` makes the compute stream wait for that layer's
copy; on CPU (``HostCopies``) the copies run there and then, on this thread, with vLLM's
compute threads, which would otherwise hold every core. Blocks the lease does
not cover (evicted since the scheduler's lookup, or failed verification) are reported
as load errors and vLLM recomputes them.

Saving: at a step's first ``save_layer`` the blocks that step fills are reserved (one
round trip); each layer is copied into the reserved slots by the copy engine as soon as
the forward pass has written it. ``finish_step`` decides whether the step's saves are
trusted (below) and, with ``defer_saves`` (the default), leaves the rest to the commit
thread (``vllm_saves``): it waits for the layer copies and commits, while the engine goes
on with its next step; a finished request's blocks stay with vLLM until its saves are
over (``finished_sending``). Without ``defer_saves``, ``finish_step`` waits and commits.
On a CPU cache with ``defer_saves`` nothing is reserved or copied during the step: the
copies would run on this thread and hold back the step's tokens (a prompt's first token
waited for every layer's copy), so ``finish_step`` queues the trusted saves and the next
step's ``start_load`` reserves and copies them before it writes any block — the blocks
are still the requests' (running, or kept by vLLM until ``finished_sending``; a
preemption runs them first) — and commits them without waiting for the answers.

No save is computed on a block that did not load. Under tensor parallelism a block that
fails on one rank poisons every rank's KV computed after it (the layers' outputs are
all-reduced), so at the end of each step with loads the ranks agree, with one all-reduce
on the CPU group, on the first failed block of every load; all of them report the same
blocks to vLLM, which rolls the requests back and recomputes. A save whose ``reads`` (the
blocks it attends to that a step still in flight loads: the request's own loaded prefix,
a block shared with another request's load) include a failed block is aborted — in the
failing step and in the next, which async scheduling may have planned before vLLM knew;
the recompute, planned after the rollback, saves those blocks right.

Prefill/decode handoffs (``vllm_handoff``): the sender's layer copies share the copy
engine and its handoffs are cancelled in a step whose loads failed; a step waits for its
copies only, the decode daemon's acknowledgement is waited for on the sender's thread,
with the sender's own client; the receiver runs on its own thread and reports through
``finished_receiving``.

Owner: vLLM's worker thread calls every method (and runs the CPU copies); the commit
thread only runs the commits queued here, and is the only writer of ``saved_blocks``, ``commit_s`` and
``aborted_saves`` while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvstore.client import KVStoreClient, Lease, PendingSave
from kvstore.connectors.vllm_compat import (
    EngineGeometry,
    cache_writer,
    check_cpu_binding,
    check_kv_cache,
    connector_logger,
    layer_index,
    log_failure,
    tp_min,
    worker_tp_rank,
)
from kvstore.connectors.vllm_handoff import HandoffReceiver, HandoffSender
from kvstore.connectors.vllm_layout import (
    BlockOrder,
    BlockRun,
    CopyJob,
    CudaCopies,
    HostCopies,
    LayerCopier,
    runs_of,
    runs_on,
    wait_all,
)
from kvstore.connectors.vllm_meta import (
    LOAD_WINDOW_STEPS,
    ConnectorSettings,
    KVStoreConnectorMetadata,
    SaveProgress,
    SaveSpec,
    namespace_for,
)
from kvstore.connectors.vllm_saves import DeferredSaves
from kvstore.errors import InvalidArgument, KVStoreError

__all__ = ["WorkerSide", "WorkerCounters"]

logger = connector_logger(__name__)


@dataclass
class WorkerCounters:
    loaded_blocks: int = 0
    failed_blocks: int = 0  # promised by the scheduler, not loadable: recomputed
    saved_blocks: int = 0
    aborted_saves: int = 0
    save_wait_s: float = 0.0  # how long the steps waited for their saves (copies and commits)
    lease_s: float = 0.0  # the loads' lease round trips to the daemon, on the worker thread
    reserve_s: float = 0.0  # the saves' reservation round trips, on the worker thread
    commit_s: float = 0.0  # waiting for the save copies and committing (the commit thread with defer_saves)
    handoff_wait_s: float = 0.0  # how long the steps waited for their handoffs (copies, not the decode daemon)
    handoff_blocks_sent: int = 0
    handoff_blocks_received: int = 0
    handoff_failures: int = 0


class WorkerSide:
    def __init__(self, settings: ConnectorSettings, geometry: EngineGeometry, vllm_config: Any) -> None:
        self._settings = settings
        self._vllm_config = vllm_config
        self._geometry = geometry
        self._client: KVStoreClient | None = None
        self._digest = b""
        self._caches: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self._copier: LayerCopier | None = None
        self._block_bytes = 0
        self._copies: HostCopies | CudaCopies = HostCopies()  # CudaCopies once a CUDA cache registers
        self._device: torch.device | None = None  # the caches' CUDA device
        self._saves_blocks = True  # False on the MLA ranks that only read (register decides)
        self._sender: HandoffSender | None = None  # PD producer
        self._sender_client: KVStoreClient | None = None  # the sender's session: its handoffs finish beside the steps
        self._receiver: HandoffReceiver | None = None  # loads beside the steps: PD consumer, slow tiers
        self._loaded_beside_steps = 0  # of the receiver's blocks_loaded, those counted already
        self._deferred = DeferredSaves() if settings.defer_saves else None
        # this step's state, cleared by finish_step
        self._leases: list[Lease] = []
        self._layer_loads: list[CopyJob] = []
        self._saves: list[tuple[SaveSpec, PendingSave]] | None = None
        self._save_runs: list[BlockRun] = []
        self._layer_saves: list[CopyJob] = []
        self._saved_layers: set[int] = set()
        self._first_failed: dict[int, int] = {}  # metadata.loads index -> position of its first block not loaded
        self._failed_this_step: set[int] = set()
        self._failed_recently: dict[int, int] = {}  # engine block that failed to load -> step it failed in
        self._step = 0
        self._load_errors: set[int] = set()
        self.counters = WorkerCounters()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        if len(ordered) != self._geometry.num_layers:
            raise InvalidArgument(
                f"vLLM registered {len(ordered)} KV cache layers but the model has {self._geometry.num_layers}; "
                "models with layers that share or skip KV are not supported by the kvstore connector."
            )
        for name, cache in ordered:
            check_kv_cache(name, cache, self._geometry)
        self._layer_of = {name: index for index, (name, _) in enumerate(ordered)}
        self._caches = [cache for _, cache in ordered]
        tp_rank = worker_tp_rank()
        namespace = namespace_for(self._geometry, tp_rank, self._settings.tenant_salt)
        # MLA: every rank holds the same latent KV; rank 0 saves it, every rank loads it
        self._saves_blocks = self._geometry.kv_planes == 2 or tp_rank == 0
        on_gpu = any(cache.is_cuda for cache in self._caches)  # then this process pins its own mapping of the slab
        if not on_gpu:
            check_cpu_binding(logger, self._geometry.tp_size)
        self._client = KVStoreClient(
            self._settings.socket_path, timeout_s=self._settings.daemon_timeout_s, require_daemon=False, pin_for_gpu=on_gpu
        )
        self._digest = self._client.ensure_namespace(namespace)
        geometry = self._geometry
        orders = [
            BlockOrder.discover(
                cache_writer(self._vllm_config, name, geometry),
                tuple(cache.shape[1:]),
                cache.dtype,
                geometry.num_kv_heads,
                geometry.block_size,
                geometry.head_dim,
                f"KV cache layer {name}",
                geometry.kv_planes,
                like=cache,
                input_dtype=getattr(torch, geometry.model_dtype),
                element_dtype=getattr(torch, geometry.dtype),
            )
            for name, cache in ordered
        ]
        self._copier = LayerCopier(namespace.layout, self._caches[0].dtype, orders)
        self._block_bytes = namespace.layout.block_bytes
        if on_gpu:
            self._copies.shutdown()
            self._device = self._caches[0].device
            self._copies = CudaCopies(self._device)
        timeout = self._settings.handoff_timeout_s
        self._sender_client = KVStoreClient(
            self._settings.socket_path, timeout_s=self._settings.daemon_timeout_s, require_daemon=False, pin_for_gpu=on_gpu
        )
        sender_digest = self._sender_client.ensure_namespace(namespace)
        self._sender = HandoffSender(self._sender_client, sender_digest, self._copier, self._copies, timeout, tp_rank)
        self._receiver = HandoffReceiver(self._settings.socket_path, namespace, self._copier, self._caches, timeout, tp_rank)
        logger.info(
            "kvstore: worker registered %d layers (block copies: %s), namespace %s, daemon node %s",
            len(ordered),
            ", ".join(sorted({order.copies for order in orders})),
            namespace.id,
            self._client.node_id,
        )

    # -- loading ---------------------------------------------------------------------------
    def start_load(self, metadata: KVStoreConnectorMetadata) -> None:
        if self._deferred is not None:
            self._deferred.run_later()  # the earlier steps' saves, before this step writes any block
        runs: list[BlockRun] = []
        for index, spec in enumerate(metadata.loads):
            if not spec.in_step:
                self._receiver.start(spec)  # beside the steps: reported through finished_receiving
                continue
            lease = self._acquire(spec.hashes)
            self._leases.append(lease)
            loaded = lease.num_blocks
            if loaded < len(spec.hashes):
                self._first_failed[index] = loaded
                logger.warning(
                    "kvstore: request %s: %d of %d blocks are no longer loadable; vLLM recomputes them",
                    spec.req_id,
                    len(spec.hashes) - loaded,
                    len(spec.hashes),
                )
            if loaded:
                runs += runs_of(spec.block_ids[:loaded], lease.views, self._block_bytes)
                self.counters.loaded_blocks += loaded
        if runs:
            if self._device is not None:
                runs = runs_on(self._device, runs, self._block_bytes)
            self._layer_loads = [
                self._copies.submit_load(self._copier.load, cache, layer, runs) for layer, cache in enumerate(self._caches)
            ]

    def wait_for_layer(self, layer_name: str) -> None:
        if self._layer_loads:
            # a failed copy is reported (and its blocks recomputed) by finish_step
            self._layer_loads[self._layer_of[layer_name]].wait_on_device()

    def finished_receiving(self) -> set[str]:
        """Requests whose handoff is over; the blocks it did not fill become load errors."""
        if self._receiver is None:
            return set()
        finished, failed = self._receiver.take_finished()
        self._load_errors |= failed
        self.counters.failed_blocks += len(failed)
        loaded = self._receiver.blocks_loaded  # written by its thread: read once
        self.counters.loaded_blocks += loaded - self._loaded_beside_steps
        self._loaded_beside_steps = loaded
        self.counters.handoff_blocks_received = self._receiver.blocks_received
        return finished

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saving ----------------------------------------------------------------------------
    def save_layer(self, layer_name: str, metadata: KVStoreConnectorMetadata) -> None:
        layer = self._layer_of[layer_name]
        if metadata.handoffs:
            self._sender.layer_written(metadata.handoffs, self._caches[layer], layer)
        if not metadata.saves or not self._saves_blocks:
            return
        self._saved_layers.add(layer)
        if self._copies_after_step:
            return  # copied at the next step's start (finish_step)
        if self._saves is None:
            self._saves = [(spec, pending) for spec in metadata.saves if (pending := self._reserve(spec)) is not None]
            self._save_runs = [
                run
                for spec, pending in self._saves
                for run in runs_of([spec.block_ids[i] for i in pending.indices], pending.views, self._block_bytes)
            ]
            if self._device is not None:
                self._save_runs = runs_on(self._device, self._save_runs, self._block_bytes)
        if self._save_runs:
            self._layer_saves.append(self._copies.submit_save(self._copier.save, self._caches[layer], layer, self._save_runs))

    def finish_step(self, metadata: KVStoreConnectorMetadata) -> None:
        """End of the forward pass: loads are done, so release their leases; agree with
        the other ranks on what failed to load; decide which saves of the step are trusted
        (every layer copied, no block it attends to failed to load) and commit those — now,
        or on the commit thread with ``defer_saves``."""
        # every queued copy is waited for, even after one failed: a copy still running reads
        # slots whose leases are released below
        error = wait_all(self._layer_loads)
        if error is not None:  # some layers hold bytes of unknown state: recompute them all
            logger.warning("kvstore: a layer copy from the slab failed (%s); vLLM recomputes the step's loads", error)
            self._first_failed = {index: 0 for index, spec in enumerate(metadata.loads) if spec.in_step}
        self._agree_on_failed_loads(metadata)
        for lease in self._leases:
            self._release(lease)
        if self._sender is not None:  # registered: steps before that (profiling) move nothing
            untrusted = bool(self._failed_this_step) or any(
                block in self._failed_recently for spec in metadata.handoffs for block in spec.block_ids
            )
            began = time.perf_counter()
            self._sender.finish_step(abandon=untrusted)
            self.counters.handoff_wait_s += time.perf_counter() - began
            self._count_handoffs()
        # decided now, on every rank alike: the failed loads are agreed
        all_layers = len(self._saved_layers) == len(self._caches)
        saves = [
            (spec, pending, all_layers and not any(block in self._failed_recently for block in spec.reads))
            for spec, pending in self._saves or ()
        ]
        began = time.perf_counter()
        if self._deferred is None:
            self._commit(self._layer_saves, saves)
        elif metadata.saves and self._copies_after_step:
            self._save_after_step(metadata, all_layers)
        elif metadata.saves:
            commit = partial(self._commit, self._layer_saves, saves) if saves else None
            self._deferred.submit((spec.req_id for spec in metadata.saves), self._layer_saves, commit)
        self.counters.save_wait_s += time.perf_counter() - began
        self._leases, self._layer_loads = [], []
        self._saves, self._save_runs, self._layer_saves, self._saved_layers = None, [], [], set()
        self._first_failed, self._failed_this_step = {}, set()
        self._step += 1

    @property
    def _copies_after_step(self) -> bool:
        """A CPU cache's saves are copied at the start of the next step: the copies run on
        this thread, and in their own step they would delay its tokens (a prompt's first)."""
        return self._deferred is not None and isinstance(self._copies, HostCopies)

    def _save_after_step(self, metadata: KVStoreConnectorMetadata, all_layers: bool) -> None:
        """Queue the step's trusted saves for the next step's start (``DeferredSaves.run_later``);
        the others are dropped before they reserve anything."""
        trusted = []
        for spec in metadata.saves if self._saves_blocks else ():
            if all_layers and not any(block in self._failed_recently for block in spec.reads):
                trusted.append(spec)
            else:
                self.counters.aborted_saves += 1
                logger.warning("kvstore: not saving %d blocks of request %s: this step's KV is not trusted", len(spec.hashes), spec.req_id)
        req_ids = (spec.req_id for spec in metadata.saves)
        if trusted:
            self._deferred.submit_later(req_ids, partial(self._copy_out, trusted))
        else:
            self._deferred.submit(req_ids, [], None)

    def _copy_out(self, specs: list[SaveSpec]) -> tuple[list[CopyJob], None]:
        """Reserve the saves' slots, copy every layer of their blocks into them (a step
        after the one that computed them) and commit them without waiting for the answers
        (the next call on the client reads them): the blocks are not read any more."""
        saves = [(spec, pending) for spec in specs if (pending := self._reserve(spec)) is not None]
        runs = [
            run
            for spec, pending in saves
            for run in runs_of([spec.block_ids[i] for i in pending.indices], pending.views, self._block_bytes)
        ]
        copies = []
        if runs:
            copies = [self._copies.submit_save(self._copier.save, cache, layer, runs) for layer, cache in enumerate(self._caches)]
        self._commit(copies, [(spec, pending, True) for spec, pending in saves], detached=True)
        return copies, None

    def _commit(self, copies: list[CopyJob], saves: list[tuple[SaveSpec, PendingSave, bool]], detached: bool = False) -> None:
        """Once the step's layer copies are done, commit each save that is trusted and abort
        the others (a reservation is given back only when no copy writes into it any more).
        ``detached``: the commits' answers are not waited for."""
        began = time.perf_counter()
        error = wait_all(copies)
        if error is not None:
            logger.error("kvstore: a layer copy into the slab failed, not saving this step: %s", error)
        for spec, pending, trusted in saves:
            self._finish_save(spec, pending, trusted and error is None, detached or self._deferred is None)
        self.counters.commit_s += time.perf_counter() - began

    # -- deferred saves: vLLM keeps a finished request's blocks until they are over ------------
    def flush_saves(self, metadata: KVStoreConnectorMetadata) -> None:
        """Before a step runs: a preempted request's blocks may be another's in it."""
        if self._deferred is not None and metadata.preempted_saving:
            self._deferred.flush_copies()

    def finished_sending(self, metadata: KVStoreConnectorMetadata | None) -> set[str]:
        if self._deferred is None:
            return set()
        return self._deferred.finished_sending(metadata.delayed_frees if metadata is not None else ())

    def save_progress(self) -> SaveProgress | None:
        settled = self._deferred.settled() if self._deferred is not None else {}
        return SaveProgress(settled) if settled else None

    def wait_for_saves(self) -> None:
        """Return once every save queued so far has ended (its counters are final)."""
        if self._deferred is not None:
            self._deferred.wait()
        if self._client is not None:
            self._client.collect_detached()  # the commits sent on this thread: their answers are counted
        if self._sender is not None:
            self._sender.wait()
            self._count_handoffs()

    def _count_handoffs(self) -> None:
        self.counters.handoff_blocks_sent = self._sender.blocks_sent
        self.counters.handoff_failures = self._sender.num_failures + self._receiver.failures

    def _agree_on_failed_loads(self, metadata: KVStoreConnectorMetadata) -> None:
        """Every rank's first failed block of every load, the lowest of them all: the
        ranks report, and abort saves over, the same blocks. All ranks see the same
        metadata, so they all take part in the all-reduce or all skip it."""
        # a failure older than the load window is known to vLLM's scheduler, which planned its recompute
        self._failed_recently = {block: step for block, step in self._failed_recently.items() if step > self._step - LOAD_WINDOW_STEPS}
        loads = [(index, spec) for index, spec in enumerate(metadata.loads) if spec.in_step]
        if not loads:
            return
        first_failed = [self._first_failed.get(index, len(spec.block_ids)) for index, spec in loads]
        if self._geometry.tp_size > 1:
            first_failed = tp_min(first_failed)
        for (index, spec), position in zip(loads, first_failed):
            for block in spec.block_ids[:position]:
                self._failed_recently.pop(block, None)  # loaded right this time
            failed = spec.block_ids[position:]
            if failed and index not in self._first_failed:
                logger.warning(
                    "kvstore: request %s: another rank could not load %d of its blocks; vLLM recomputes them", spec.req_id, len(failed)
                )
            self._failed_this_step.update(failed)
            self._failed_recently.update(dict.fromkeys(failed, self._step))
        self._load_errors |= self._failed_this_step
        self.counters.failed_blocks += len(self._failed_this_step)

    def close(self) -> None:
        self._copies.shutdown()
        if self._deferred is not None:
            self._deferred.close()  # its commits use the client
        if self._sender is not None:
            self._sender.close()  # its handoffs finish on its client
            self._sender_client.close()
        if self._receiver is not None:
            self._receiver.close()
        if self._client is not None:
            self._client.close()

    def _committed(self, req_id: str, num_blocks: int, stored: int | None, error: str) -> None:
        """The answer to a commit sent without waiting (on the thread of the call that read it)."""
        if stored is None:
            logger.warning("kvstore: saving %d blocks of request %s failed: %s", num_blocks, req_id, error)
        else:
            self.counters.saved_blocks += stored

    # -- helpers: every daemon error becomes a miss or a skipped save ------------------------
    def _acquire(self, hashes: Sequence[bytes]) -> Lease:
        began = time.perf_counter()
        try:
            return self._client.acquire(self._digest, hashes)
        except KVStoreError as exc:
            log_failure(logger, "lease failed, the blocks will be recomputed", exc)
            return Lease((), ())
        finally:
            self.counters.lease_s += time.perf_counter() - began

    def _release(self, lease: Lease) -> None:
        try:
            self._client.release(lease)
        except KVStoreError as exc:
            log_failure(logger, "release failed (the daemon frees the lease when the connection goes)", exc)

    def _reserve(self, spec: SaveSpec) -> PendingSave | None:
        began = time.perf_counter()
        try:
            pending = self._client.begin_save(self._digest, spec.hashes, spec.parent_hash)
        except KVStoreError as exc:
            log_failure(logger, f"cannot reserve {len(spec.hashes)} blocks, not saving them", exc)
            return None
        finally:
            self.counters.reserve_s += time.perf_counter() - began
        return pending

    def _finish_save(self, spec: SaveSpec, pending: PendingSave, complete: bool, detached: bool) -> None:
        try:
            if complete and detached:
                # on the worker thread: its answer is not waited for (the next call on the client reads it)
                self._client.commit_detached(pending, partial(self._committed, spec.req_id, len(pending.indices)))
            elif complete:
                self.counters.saved_blocks += self._client.commit(pending)
            else:
                self._client.abort(pending)
                self.counters.aborted_saves += 1
                logger.warning(
                    "kvstore: not saving %d blocks of request %s: this step's KV is not trusted", len(pending.indices), spec.req_id
                )
        except KVStoreError as exc:
            log_failure(logger, f"saving {len(pending.indices)} blocks of request {spec.req_id} failed", exc)
