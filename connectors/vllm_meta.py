"""What the vLLM connector is configured with and what its two halves tell each other.

- ``ConnectorSettings``: ``kv_connector_extra_config`` validated once;
- ``namespace_for``: the kvstore namespace of one tensor-parallel rank of this engine;
- ``KVStoreConnectorMetadata``: the scheduler's per-step instructions to the workers —
  which blocks to load into which engine blocks, which to save.

Metadata crosses vLLM's own scheduler→worker channel, so it holds only plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvstore.connectors.vllm_compat import STORE_INNER_ORDER, EngineGeometry, KVConnectorMetadata
from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.paths import default_socket_path

_DEFAULT_HANDOFF_TIMEOUT_S = 60.0

__all__ = ["ConnectorSettings", "namespace_for", "LoadSpec", "SaveSpec", "KVStoreConnectorMetadata"]


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    socket_path: str  # the local daemon's Unix socket
    tenant_salt: str = ""  # tenants with different salts never share blocks
    model_id: str = ""  # overrides the model path in the namespace (same weights, other paths)
    handoff_timeout_s: float = _DEFAULT_HANDOFF_TIMEOUT_S  # PD: how long a decode instance waits for a prefill's KV

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> "ConnectorSettings":
        known = {"socket_path", "tenant_salt", "model_id", "handoff_timeout_s"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(
                f"kv_connector_extra_config has unknown key(s) {', '.join(unknown)}; the kvstore connector reads "
                f"{', '.join(sorted(known))}."
            )
        timeout = extra.get("handoff_timeout_s", _DEFAULT_HANDOFF_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgument(f"handoff_timeout_s must be a positive number of seconds, got {timeout!r}.")
        for key in ("socket_path", "tenant_salt", "model_id"):
            if not isinstance(extra.get(key, ""), str):
                raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be a string.")
        return cls(
            socket_path=extra.get("socket_path") or str(default_socket_path()),
            tenant_salt=extra.get("tenant_salt", ""),
            model_id=extra.get("model_id", ""),
            handoff_timeout_s=float(timeout),
        )


def namespace_for(geometry: EngineGeometry, tp_rank: int, tenant_salt: str) -> Namespace:
    layout = KVLayout(
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        block_size=geometry.block_size,
        dtype=geometry.dtype,
        kv_planes=2,
        inner_order=STORE_INNER_ORDER,
    )
    return Namespace(geometry.model_id, layout, tp_rank, geometry.tp_size, 0, geometry.pp_size, tenant_salt)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy the stored blocks ``hashes`` into the engine blocks ``block_ids`` (same order)."""

    req_id: str
    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the engine blocks ``block_ids`` (full once this step's forward pass ran)
    under ``hashes``; ``parent_hash`` is the hash of the block before the first."""

    req_id: str
    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    parent_hash: BlockHash | None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
