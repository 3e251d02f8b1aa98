"""What the vLLM connector is configured with and what its two halves tell each other.

- ``ConnectorSettings``: ``kv_connector_extra_config`` validated once;
- ``namespace_for``: the kvstore namespace of one tensor-parallel rank of this engine;
- ``KVStoreConnectorMetadata``: the scheduler's per-step instructions to the workers —
  which blocks to load into which engine blocks (from the store, or from a prefill
  instance's handoff), which to save, which to hand off to a decode instance, and which
  finished requests keep their blocks until their saves are committed;
- ``SaveProgress``: the workers' answer, per step — the saves that are over;
- the ``kv_transfer_params`` keys a PD proxy passes with a request.

Metadata crosses vLLM's own scheduler→worker channel, so it holds only plain values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.connectors.vllm_compat import (
    KV_CACHE_LAYOUTS,
    STORE_INNER_ORDER,
    EngineGeometry,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.paths import default_socket_path
from kvstore.tier_kind import TierKind

_DEFAULT_HANDOFF_TIMEOUT_S = 60.0
_DEFAULT_DAEMON_TIMEOUT_S = 5.0
# how long the blocks a scheduler's lookup counted are held from eviction at most: the
# worker loads them a step later and the hold is released then; this bounds what a
# request that never gets scheduled (or a scheduler that stalls) keeps held
_DEFAULT_LOOKUP_HOLD_S = 30.0
_DEFAULT_ASYNC_LOAD_TIERS = ("nvme",)

__all__ = [
    "ConnectorSettings",
    "namespace_for",
    "LoadSpec",
    "SaveSpec",
    "HandoffSpec",
    "KVStoreConnectorMetadata",
    "SaveProgress",
    "TRANSFER_ID",
    "DESTINATION",
    "LOAD_WINDOW_STEPS",
]

# kv_transfer_params keys (next to vLLM's own do_remote_decode / do_remote_prefill)
TRANSFER_ID = "kvstore_transfer_id"  # names the handoff on both instances
DESTINATION = "kvstore_destination"  # the decode daemon: node id or transport address


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    socket_path: str  # the local daemon's Unix socket
    tenant_salt: str = ""  # tenants with different salts never share blocks
    model_id: str = ""  # overrides the model path in the namespace (same weights, other paths)
    handoff_timeout_s: float = _DEFAULT_HANDOFF_TIMEOUT_S  # PD: how long either side waits for the other
    handoff_destination: str = ""  # PD producer: the decode daemon, unless a request names one
    daemon_timeout_s: float = _DEFAULT_DAEMON_TIMEOUT_S  # a daemon call slower than this is a miss (or a skipped save)
    lookup_hold_s: float = _DEFAULT_LOOKUP_HOLD_S  # the longest a lookup's blocks are held for their load (≤ 600)
    # a load that reads a block from one of these tiers runs beside the engine's steps
    # (vLLM's load_kv_async): a slow tier never stalls the batch; loads of faster tiers
    # are copied layer by layer inside the step
    async_load_tiers: tuple[TierKind, ...] = tuple(map(TierKind, _DEFAULT_ASYNC_LOAD_TIERS))
    # True: a step's saves are committed beside the engine's steps and a finished request's
    # blocks are kept until they are (vLLM's delayed free); False: each step waits for its
    # saves, so the blocks are in the store when its output is — for a caller that sends
    # the next request the moment the first one's output arrives and must find it stored.
    # None (the default) is True: on a GPU the copies run on a stream the step need not wait
    # for; on a CPU the next step copies them out before it computes, so a step's tokens
    # (a prompt's first) never wait for its saves (KVStoreConnector resolves it)
    defer_saves: bool | None = None
    # a KVCacheLayout name to ask vLLM for (get_required_kvcache_layout), e.g. "BLHNC":
    # block-outermost, every layer of a block in one run, as kvstore stores a block; ""
    # keeps the attention backend's own choice. The connector copies any layout; which
    # is faster on a GPU is what bench.gpu_copies measures (its LBNHC and BLHNC rows)
    kv_cache_layout: str = ""
    # a directory where each connector half writes, about once a second, how long each of
    # vLLM's calls into it took and its counters (vllm_times); "" writes nothing
    hook_times_dir: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        known = {
            "socket_path",
            "tenant_salt",
            "model_id",
            "handoff_timeout_s",
            "handoff_destination",
            "daemon_timeout_s",
            "lookup_hold_s",
            "async_load_tiers",
            "defer_saves",
            "kv_cache_layout",
            "hook_times_dir",
        }
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(
                f"kv_connector_extra_config has unknown key(s) {', '.join(unknown)}; the kvstore connector reads "
                f"{', '.join(sorted(known))}."
            )
        timeouts = {}
        for key, default, most in (
            ("handoff_timeout_s", _DEFAULT_HANDOFF_TIMEOUT_S, 86_400.0),
            ("daemon_timeout_s", _DEFAULT_DAEMON_TIMEOUT_S, 86_400.0),
            ("lookup_hold_s", _DEFAULT_LOOKUP_HOLD_S, 600.0),
        ):
            timeouts[key] = extra.get(key, default)
            if type(timeouts[key]) not in (int, float) or not 0 < timeouts[key] <= most:
                raise InvalidArgument(f"{key} must be a positive number of seconds, at most {most:g}, got {timeouts[key]!r}.")
        for key in ("socket_path", "tenant_salt", "model_id", "handoff_destination", "hook_times_dir"):
            if not isinstance(extra.get(key, ""), str):
                raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be a string.")
        if not isinstance(extra.get("defer_saves", True), bool) and extra.get("defer_saves") is not None:
            raise InvalidArgument(
                f"kv_connector_extra_config['defer_saves'] must be true, false or null (null: true), got {extra['defer_saves']!r}."
            )
        layout = extra.get("kv_cache_layout", "")
        if layout != "" and layout not in KV_CACHE_LAYOUTS:
            raise InvalidArgument(
                f"kv_connector_extra_config['kv_cache_layout'] is one of vLLM's KV cache layouts ({', '.join(KV_CACHE_LAYOUTS)}) "
                f"or empty for the attention backend's own, got {layout!r}."
            )
        tiers = extra.get("async_load_tiers", _DEFAULT_ASYNC_LOAD_TIERS)
        loadable = {TierKind.HOST.value, TierKind.NVME.value}
        if not isinstance(tiers, (list, tuple)) or not all(isinstance(tier, str) and tier in loadable for tier in tiers):
            raise InvalidArgument(
                f"kv_connector_extra_config['async_load_tiers'] is a list of tiers out of {sorted(loadable)}, got {tiers!r}."
            )
        return cls(
            socket_path=extra.get("socket_path") or str(default_socket_path()),
            tenant_salt=extra.get("tenant_salt", ""),
            model_id=extra.get("model_id", ""),
            handoff_timeout_s=float(timeouts["handoff_timeout_s"]),
            handoff_destination=extra.get("handoff_destination", ""),
            daemon_timeout_s=float(timeouts["daemon_timeout_s"]),
            lookup_hold_s=float(timeouts["lookup_hold_s"]),
            async_load_tiers=tuple(TierKind(tier) for tier in dict.fromkeys(tiers)),
            defer_saves=extra.get("defer_saves"),
            hook_times_dir=extra.get("hook_times_dir", ""),
            kv_cache_layout=layout,
        )


def namespace_for(geometry: EngineGeometry, tp_rank: int, tenant_salt: str) -> Namespace:
    """The namespace of one tensor-parallel rank's blocks. MLA's latent KV is the same on
    every rank, so its namespace names no rank: one rank writes it, every rank reads it."""
    layout = KVLayout(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        block_size=geometry.block_size,
        dtype=geometry.dtype,
        kv_planes=geometry.kv_planes,
        inner_order=STORE_INNER_ORDER,
    )
    if geometry.kv_planes == 1:
        return Namespace(geometry.model_id, layout, 0, 1, 0, geometry.pp_size, tenant_salt)
    return Namespace(geometry.model_id, layout, tp_rank, geometry.tp_size, 0, geometry.pp_size, tenant_salt)


# Steps whose loads may have failed without the scheduler knowing yet: the step being
# built and, under async scheduling, the one still running (vLLM 0.32 keeps at most two
# batches in flight without pipeline parallelism, which the connector refuses). A save
# that attends to a block loaded in one of them names it in ``SaveSpec.reads``.
LOAD_WINDOW_STEPS = 2


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy the blocks ``hashes`` into the engine blocks ``block_ids`` (same order): from
    the store inside the step, from the store beside the steps (``asynchronous``), or —
    with a ``transfer_id`` — from that handoff (asynchronous too). ``hashes[0]`` is the
    request's block ``first_block`` (the block after vLLM's own prefix hit)."""

    req_id: str
    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    transfer_id: str | None = None
    first_block: int = 0
    asynchronous: bool = False  # from the store beside the steps (a slow tier), reported through get_finished

    @property
    def in_step(self) -> bool:
        """Copied layer by layer inside the step that carries it."""
        return self.transfer_id is None and not self.asynchronous


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the engine blocks ``block_ids`` (full once this step's forward pass ran)
    under ``hashes``; ``parent_hash`` is the hash of the block before the first."""

    req_id: str
    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    parent_hash: BlockHash | None
    # engine blocks before the first that this request attends to and that a step still
    # in flight loads: if any of them failed to load on any rank, the saved KV was
    # computed on bytes that are not the prompt's, and the save is aborted
    reads: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class HandoffSpec:
    """Hand the engine blocks ``block_ids`` (the prompt's full blocks, complete once
    this step's forward pass ran) to ``destination`` as they are written."""

    req_id: str
    transfer_id: str
    destination: str
    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    handoffs: list[HandoffSpec] = field(default_factory=list)
    # finished requests whose blocks vLLM keeps until every rank reports them in
    # ``finished_sending``: their saves may still be copying out of those blocks
    delayed_frees: list[str] = field(default_factory=list)
    # a request preempted in this step still has saves copying out of its blocks, which
    # vLLM may give to another request in this very step: the copies end before it runs
    preempted_saving: bool = False


@dataclass
class SaveProgress(KVConnectorWorkerMetadata):
    """Per request, how many of its steps' saves ended (committed, aborted or failed) on
    the ranks since their last report; vLLM sums the ranks' reports (``aggregate``)."""

    settled: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SaveProgress:
        assert isinstance(other, SaveProgress)
        settled = dict(self.settled)
        for req_id, count in other.settled.items():
            settled[req_id] = settled.get(req_id, 0) + count
        return SaveProgress(settled)
