"""LMCache remote-storage plugin on the local kvstore daemon.

Selected through LMCache's plugin mechanism (LMCache 0.5.x)::

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore.connectors.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreRemoteConnector
      remote_storage_plugin.kvstore.socket_path: /run/kvstore/kvstore.sock   # optional
      remote_storage_plugin.kvstore.tenant_salt: team-a                      # optional

LMCache wraps the connector in its ``RemoteBackend``, which keeps chunks in its
``LocalCPUBackend`` and hands this connector whole chunks (``MemoryObj``) to put and keys
to get. A chunk is one kvstore block: its bytes are copied once, between the chunk's
memory and the daemon's shared slab, reordered on the way into kvstore's layer-major
layout (LMCache keeps ``[K/V, layer, token, hidden]``). The namespace covers the model,
the worker (as the TP shard), the chunk shape and dtype; the block hash is XXH3-128 of
``CacheEngineKey.to_string()``.

Only full chunks are stored (LMCache's default ``save_unfull_chunk: false``): a partial
last chunk changes as the prompt grows, and a fixed block size keeps every read the exact
size LMCache allocates. Batched gets return the cached prefix; a key that is absent, was
evicted, or failed verification is a miss (None), never bytes of another chunk.

The daemon calls are blocking (a memcpy through shared memory and a Unix-socket round
trip); they run in worker threads so LMCache's event loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Sequence

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore.connectors.engine_keys import EngineKeyStore, ErrorsAsMisses, layout_dtype
from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

__all__ = ["KVStoreRemoteConnector"]

logger = logging.getLogger(__name__)


class KVStoreRemoteConnector(RemoteConnector):
    """Constructed by LMCache's ``DynamicConnectorAdapter`` as
    ``cls(loop=…, local_cpu_backend=…, config=…)``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config) -> None:
        metadata = local_cpu_backend.metadata
        super().__init__(config, metadata)
        if config.save_unfull_chunk:
            raise InvalidArgument("the kvstore LMCache plugin stores full chunks only; set save_unfull_chunk: false.")
        if metadata.get_num_groups() != 1:
            raise InvalidArgument("the kvstore LMCache plugin stores chunks of one KV layer group; this model has several.")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        settings = _plugin_settings(config)
        planes, num_layers, chunk_size, hidden = self.meta_shapes[0]  # what LMCache allocates; planes: 1 with MLA
        self.num_heads, self.head_dim = metadata.kv_shape[3], metadata.kv_shape[4]
        if self.num_heads * self.head_dim != hidden:
            raise InvalidArgument(
                f"LMCache's chunks hold {hidden} values per token and layer, not {self.num_heads} heads × {self.head_dim}."
            )
        layout = KVLayout(num_layers, self.num_heads, self.head_dim, chunk_size, layout_dtype(metadata.kv_dtype), planes)
        namespace = Namespace(
            model_id=metadata.model_name,
            layout=layout,
            tp_rank=metadata.worker_id,
            tp_size=metadata.world_size,
            tenant_salt=f"lmcache;{self.meta_fmt.name};{settings.get('tenant_salt', '')}",
        )
        self.store = EngineKeyStore(namespace, settings.get("socket_path"))
        self._calls = ErrorsAsMisses(logger)

    # -- presence ------------------------------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: builtins.list[CacheEngineKey]) -> int:
        """How many leading keys are cached."""
        return self._calls.count("lookup", lambda: self.store.num_cached(_names(keys)))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: builtins.list[CacheEngineKey], pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    # -- get -----------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: builtins.list[CacheEngineKey]) -> builtins.list[MemoryObj | None]:
        found = await asyncio.to_thread(self._read, keys)
        return found + [None] * (len(keys) - len(found))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: builtins.list[CacheEngineKey]) -> builtins.list[MemoryObj]:
        return await asyncio.to_thread(self._read, keys)

    # -- put -----------------------------------------------------------------------------
    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: builtins.list[CacheEngineKey], memory_objs: builtins.list[MemoryObj]) -> None:
        """Store the full chunks (LMCache's RemoteBackend drops the references after)."""
        await asyncio.to_thread(self._write, keys, memory_objs)

    # -- the rest of LMCache's connector interface -----------------------------------------
    async def list(self) -> builtins.list[str]:
        """Keys are one-way hashes in kvstore; `kvstore ls` lists the blocks themselves."""
        return []

    async def close(self) -> None:
        self.store.close()

    # -- helpers -------------------------------------------------------------------------
    def _read(self, keys: Sequence[CacheEngineKey]) -> builtins.list[MemoryObj]:
        """The cached prefix of ``keys`` as new LMCache memory objects."""
        found: list[MemoryObj] = []

        def target(index: int) -> torch.Tensor | None:
            memory_obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if memory_obj is None:
                return None
            found.append(memory_obj)
            return self._block_view(memory_obj)

        loaded = self._calls.count("load", lambda: self.store.read(_names(keys), target))
        for unfilled in found[loaded:]:  # allocated, then the copy failed: not data
            unfilled.ref_count_down()
        return found[:loaded]

    def _write(self, keys: Sequence[CacheEngineKey], memory_objs: Sequence[MemoryObj]) -> int:
        full = [(key, obj) for key, obj in zip(keys, memory_objs) if obj.get_shapes() == self.meta_shapes]
        if len(full) < len(keys):
            logger.debug("kvstore LMCache plugin: %d partial chunks not stored", len(keys) - len(full))
        if not full:
            return 0
        return self._calls.count(
            "store", lambda: self.store.write(_names([key for key, _ in full]), [self._block_view(obj) for _, obj in full])
        )

    def _block_view(self, memory_obj: MemoryObj) -> torch.Tensor:
        """A chunk ``[planes, layers, tokens, heads × head_dim]`` seen as kvstore's block
        ``[layers, planes, tokens, heads, head_dim]`` (a view: no bytes move)."""
        planes, layers, tokens, _ = memory_obj.tensor.shape
        return memory_obj.tensor.view(planes, layers, tokens, self.num_heads, self.head_dim).transpose(0, 1)


def _names(keys: Sequence[CacheEngineKey]) -> list[str]:
    return [key.to_string() for key in keys]


def _plugin_settings(config) -> dict:
    """This plugin's ``remote_storage_plugin.<name>.*`` settings, whatever name it was
    given in ``remote_storage_plugins``."""
    extra = config.extra_config or {}
    for name in config.remote_storage_plugins or []:
        prefix = f"remote_storage_plugin.{name}."
        if extra.get(prefix + "module_path") == __name__:
            return {key[len(prefix) :]: value for key, value in extra.items() if key.startswith(prefix)}
    return {}
