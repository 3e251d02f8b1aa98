"""SGLang HiCache storage backend (L3) on the local kvstore daemon.

Load it with SGLang's dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "socket_path": "/run/kvstore/kvstore.sock"}'

``interface_v1`` makes SGLang call ``batch_get_v1`` / ``batch_set_v1``, which copy
between the registered host pool and the daemon's shared slab directly (one strided copy
each way, no bounce buffer); without it SGLang uses ``batch_get`` / ``batch_set`` with
flat page tensors. ``socket_path`` and ``tenant_salt`` are optional.

A page is one kvstore block in kvstore's layer-major layout, whatever the host pool's
layout (``layer_first``, ``page_first``, ``page_first_direct``, ``page_head``; MLA pools
too), so instances with different host layouts share pages. The namespace covers what
SGLang's file backend puts in its key suffix: the model (with the pool's format tag), the
TP rank and size (not for MLA, whose KV every rank replicates), the PP rank and size, the
attention context-parallel rank, plus the page geometry and dtype.

SGLang expects booleans and counts from a storage backend, never exceptions: a daemon
that is gone or full makes a call fail (logged once per kind), and a page that is absent
or fails verification is a miss, so SGLang recomputes it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstore.connectors.engine_keys import EngineKeyStore, ErrorsAsMisses, layout_dtype
from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

__all__ = ["KVStoreHiCacheStorage", "HostPoolPages"]

logger = logging.getLogger(__name__)


class HostPoolPages:
    """Views of an SGLang host pool's pages in kvstore's block shape
    ``(layers, planes, page_size, heads, head_dim)``, for each layout SGLang allocates
    (``init_kv_buffer`` of ``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost``).

    Reads only ``kv_buffer``, ``layout`` and ``page_size`` from the pool: the geometry
    follows from the buffer's shape, so nothing can disagree with the bytes."""

    # layout -> (buffer dims, axis of the token or page index, one buffer row per page?,
    #            how the page's own dims map to the block's)
    _MHA = {
        "layer_first": (5, 2, False, (1, 0, 2, 3, 4)),  # [2, L, tokens, H, D]
        "page_first": (5, 1, False, (2, 0, 1, 3, 4)),  # [2, tokens, L, H, D]
        "page_first_direct": (6, 1, True, (1, 0, 2, 3, 4)),  # [2, pages, L, page, H, D]
        "page_head": (6, 1, True, (3, 0, 2, 1, 4)),  # [2, pages, H, page, L, D]
    }
    _MLA = {
        "layer_first": (4, 1, False, (0, 1, 2, 3)),  # [L, tokens, 1, D]
        "page_first": (4, 0, False, (1, 0, 2, 3)),  # [tokens, L, 1, D]
        "page_first_direct": (5, 0, True, (0, 1, 2, 3)),  # [pages, L, page, 1, D]
    }

    def __init__(self, pool: Any, is_mla: bool) -> None:
        self.layout: str = pool.layout
        self.page_size: int = pool.page_size
        self.buffer: torch.Tensor = pool.kv_buffer
        known = self._MLA if is_mla else self._MHA
        if not isinstance(self.buffer, torch.Tensor):
            raise InvalidArgument(
                "this SGLang host pool holds no KV buffer of its own (a hybrid model's logical pool); kvstore stores MHA and MLA pools."
            )
        if self.layout not in known or self.buffer.dim() != known[self.layout][0]:
            raise InvalidArgument(
                f"kvstore cannot address an SGLang {'MLA' if is_mla else 'MHA'} host pool with layout {self.layout!r} "
                f"and a {self.buffer.dim()}-dimensional buffer; supported layouts: {', '.join(known)}."
            )
        self.is_mla = is_mla
        _, self._axis, self._row_per_page, self._order = known[self.layout]
        first = self._pool_page(0)
        self.page_shape = first.shape  # the pool's own order: SGLang's flat pages reshape to it
        self.block_shape = self.canonical(first).shape

    def kv_layout(self) -> KVLayout:
        layers, planes, tokens, heads, head_dim = self.block_shape
        return KVLayout(layers, heads, head_dim, tokens, layout_dtype(self.buffer.dtype), planes)

    def page(self, token_index: int) -> torch.Tensor:
        """The block view of the page that starts at host slot ``token_index``."""
        return self.canonical(self._pool_page(token_index))

    def flat(self, data_page: torch.Tensor) -> torch.Tensor:
        """The block view of a flat page tensor as SGLang's ``get_data_page(flat=True)``
        and ``get_dummy_flat_data_page`` make them for this pool."""
        return self.canonical(data_page.view(self.page_shape))

    def canonical(self, page: torch.Tensor) -> torch.Tensor:
        view = page.permute(self._order)
        return view.unsqueeze(1) if self.is_mla else view  # MLA: one latent plane of one head

    def _pool_page(self, token_index: int) -> torch.Tensor:
        if self._row_per_page:
            return self.buffer.select(self._axis, token_index // self.page_size)
        return self.buffer.narrow(self._axis, token_index, self.page_size)


class KVStoreHiCacheStorage(HiCacheStorage):
    """Constructed by ``StorageBackendFactory`` as ``cls(storage_config, kwargs)``; usable
    once SGLang registers its host pool (``register_mem_pool_host``), which fixes the page
    geometry and so the namespace."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        self.storage_config = storage_config
        self.socket_path: str | None = extra.get("socket_path")
        self.tenant_salt: str = str(extra.get("tenant_salt", ""))
        self.model_id = extra.get("model_id") or storage_config.model_name
        if not self.model_id:
            raise InvalidArgument("SGLang passed no model name to the kvstore backend; set model_id in its extra config.")
        self.pages: HostPoolPages | None = None
        self.store: EngineKeyStore | None = None
        self._calls = ErrorsAsMisses(logger)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        config = self.storage_config
        self.pages = HostPoolPages(mem_pool_host, config.is_mla_model)
        replicated = config.is_mla_model  # every TP rank holds the same MLA KV: one copy for all
        namespace = Namespace(
            model_id=self.model_id,
            layout=self.pages.kv_layout(),
            tp_rank=0 if replicated else config.tp_rank,
            tp_size=1 if replicated else config.tp_size,
            pp_rank=config.pp_rank,
            pp_size=config.pp_size,
            tenant_salt=f"sglang-hicache;cp={config.attn_cp_rank}/{config.attn_cp_size};{self.tenant_salt}",
        )
        if self.store is not None:
            self.store.close()
        self.store = EngineKeyStore(namespace, self.socket_path)

    # -- zero copy: the host pool <-> the daemon's slab ------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        def load() -> int:
            store, starts = self._store(), self._page_starts(keys, host_indices)
            return store.read(keys, lambda i: self.pages.page(starts[i]))

        return _leading(self._calls.count("load", load), len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        def store() -> int:
            store, starts = self._store(), self._page_starts(keys, host_indices)
            return store.write(keys, [self.pages.page(start) for start in starts], _parent_key(extra_info))

        return _leading(self._calls.count("store", store), len(keys))

    # -- flat page tensors (SGLang's path without interface_v1) ---------------------------
    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        loaded = self._calls.count("load", lambda: self._store().read(keys, lambda i: self.pages.flat(target_locations[i])))
        return [target if index < loaded else None for index, target in enumerate(target_locations)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any | None = None, target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        return self._calls.count("store", lambda: self._store().write(keys, [self.pages.flat(value) for value in values])) == len(keys)

    # -- presence ------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of leading keys cached (SGLang fetches a consecutive prefix)."""
        return self._calls.count("lookup", lambda: self._store().num_cached(keys))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    # -- helpers -------------------------------------------------------------------------
    def _store(self) -> EngineKeyStore:
        if self.store is None:
            raise InvalidArgument("the kvstore HiCache backend has no host pool yet; SGLang registers it with register_mem_pool_host.")
        return self.store

    def _page_starts(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        page_size = self.pages.page_size
        if host_indices.numel() != len(keys) * page_size:
            raise InvalidArgument(f"{len(keys)} page keys need {len(keys) * page_size} host indices, got {host_indices.numel()}.")
        return host_indices[::page_size].tolist()


def _leading(count: int, total: int) -> list[bool]:
    return [index < count for index in range(total)]


def _parent_key(extra_info: HiCacheStorageExtraInfo | None) -> str | None:
    """The page before the batch in SGLang's prefix chain, when SGLang passes it."""
    prefix = extra_info.prefix_keys if extra_info is not None else None
    return prefix[-1] if prefix else None
