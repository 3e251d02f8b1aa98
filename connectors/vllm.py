"""kvstore as a vLLM KV connector (``KVConnectorBase_V1``).

Load it with::

    KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.connectors.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket_path": "/run/kvstore/kvstore.sock", "tenant_salt": ""},
    )

(a prefill instance also sets ``"handoff_destination"``: the decode daemon's node id or
transport address, unless each request names it in ``kvstore_destination``).

``kv_both`` offloads every full prompt block to the local daemon as the forward pass
writes it and, for a new request, loads the longest prefix the daemon holds beyond
vLLM's own prefix-cache hit, layer by layer. ``kv_producer`` / ``kv_consumer`` add
prefill/decode disaggregation through the daemons' handoff (``vllm_handoff``): a
request the proxy marks ``do_remote_decode`` streams its prompt's KV, layer by layer, to
the decode instance's daemon, and the decode instance loads it asynchronously when the
same request arrives there marked ``do_remote_prefill`` with the ``kvstore_transfer_id``
that ``request_finished`` returned on the prefill instance.

A step's saves end after the step (``defer_saves``, the default; ``vllm_saves``): a
request that finishes with a save still in flight keeps its blocks until every rank
reports it in ``finished_sending``. On a GPU engine the copies run on a stream beside the
step and a commit thread commits them; on a CPU engine the next step copies them out on
the engine's thread before it computes, and commits without waiting for the answer (a
commit thread would only take a core from the engine's OpenMP team), so a prompt's first
token never waits for its saves. ``defer_saves: false`` makes each step wait for its own.

The scheduler half (``vllm_scheduler``) decides what each step loads, saves and hands
off; the worker half (``vllm_worker``) moves the bytes; ``vllm_compat`` holds everything
tied to one vLLM version. This class only routes vLLM's calls to the half that runs in
its process.

A block that cannot be loaded after all is reported through
``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"`` vLLM
recomputes it (vLLM's default, ``"fail"``, fails the request instead).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvstore.connectors.vllm_compat import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    cache_hit_sources,
    check_supported,
    connector_logger,
    engine_geometry,
)
from kvstore.connectors.vllm_meta import ConnectorSettings, KVStoreConnectorMetadata
from kvstore.connectors.vllm_scheduler import SchedulerSide
from kvstore.connectors.vllm_times import HookTimes, timed_hook
from kvstore.connectors.vllm_worker import WorkerSide
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVStoreConnector"]

logger = connector_logger(__name__)
_ROLES = ("kv_both", "kv_producer", "kv_consumer")


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_role not in _ROLES:
            raise InvalidArgument(f"kv_role {transfer.kv_role!r} is not supported by the kvstore connector; use one of {_ROLES}.")
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "kvstore: kv_load_failure_policy=%r fails a request whose cached block cannot be loaded "
                "(evicted, or failed its checksum); set 'recompute' to recompute it instead",
                transfer.kv_load_failure_policy,
            )
        check_supported(vllm_config, kv_cache_config)
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        if settings.defer_saves is None:  # both halves resolve it alike, from the same configuration
            settings = dataclasses.replace(settings, defer_saves=True)
        self._settings = settings
        geometry = engine_geometry(vllm_config, settings.model_id or None)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(settings, geometry, transfer.kv_role)
        else:
            self._worker = WorkerSide(settings, geometry, vllm_config)
        self._hook_times: HookTimes | None = None
        if settings.hook_times_dir:
            side = self._scheduler or self._worker
            role = "scheduler" if self._scheduler is not None else "worker"
            self._hook_times = HookTimes(settings.hook_times_dir, role, lambda: side.counters)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout ``kv_cache_layout`` names, or None for the backend's own. vLLM uses it
        where every attention backend of the model supports it, and otherwise warns and
        keeps the backend's first choice (the CPU backend supports only ``LBHNC``); the
        worker logs which one the engine runs (``register_kv_caches``)."""
        transfer = vllm_config.kv_transfer_config
        extra = transfer.kv_connector_extra_config if transfer is not None else {}
        return ConnectorSettings.from_extra_config(extra or {}).kv_cache_layout or None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always: loads and saves run layer by layer (``wait_for_layer_load``,
        ``save_kv_layer``), which a full CUDA graph — vLLM's choice for uniform-decode
        batches, which a whole-prompt hit becomes — would skip on replay."""
        return True

    # -- scheduler side --------------------------------------------------------------------
    @timed_hook
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    @timed_hook
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    @timed_hook
    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        hit_tiers = self._scheduler.hit_tiers(request.request_id)
        return cache_hit_sources(hit_tiers, num_external_tokens, self._vllm_config.cache_config.block_size)

    @timed_hook
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_metadata(scheduler_output)

    @timed_hook
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # True: its saves still copy out of its blocks (a handed-off request's bytes are
        # in kvstore's slots by the end of its last step, so its blocks are freed at once)
        return self._scheduler.finished(request)

    @timed_hook
    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.workers_reported(connector_output.kv_connector_worker_meta, connector_output.finished_sending)

    @timed_hook
    def has_pending_block_frees(self) -> bool:
        return self._scheduler.frees_pending()

    # -- worker side -----------------------------------------------------------------------
    @timed_hook
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
        self._worker.flush_saves(kv_connector_metadata)

    @timed_hook
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        asked = self._settings.kv_cache_layout
        running = self._vllm_config.cache_config.kv_cache_layout
        if asked and running != asked:
            logger.warning(
                "kvstore: kv_cache_layout asked vLLM for %s; the attention backend does not support it and runs %s, "
                "which the connector copies as well",
                asked,
                running,
            )
        else:
            logger.info("kvstore: the engine's KV cache layout is %s", running)
        self._worker.register(kv_caches)

    @timed_hook
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load(self._metadata())

    @timed_hook
    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer(layer_name)

    @timed_hook
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name, self._metadata())

    @timed_hook
    def wait_for_save(self) -> None:
        self._worker.finish_step(self._metadata())

    @timed_hook
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        metadata = self._metadata() if self.has_connector_metadata() else None
        return self._worker.finished_sending(metadata), self._worker.finished_receiving()

    @timed_hook
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.save_progress()

    @timed_hook
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._hook_times is not None:
            self._hook_times.write()
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()

    def _metadata(self) -> KVStoreConnectorMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVStoreConnectorMetadata)
        return metadata
