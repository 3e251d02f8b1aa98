"""kvstore's SGLang HiCache backend against sglang's real storage interface.

The backend is built by sglang's own ``StorageBackendFactory`` from a ``dynamic`` config,
as ``--hicache-storage-backend dynamic`` does, over sglang's real ``HiCacheStorage`` base
class and real host pools (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` built on
CPU), and talks to a real `kvstore serve`. Expected values are read back through
sglang's own per-layer views of its pools, not through the backend's page mapping.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torchvision_ops import declare_missing_operators

declare_missing_operators()  # before sglang imports torchvision: see the module

from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvstore.client import KVStoreClient
from kvstore.connectors.engine_keys import engine_key_hash
from kvstore.connectors.sglang import KVStoreHiCacheStorage
from kvstore.errors import InvalidArgument

LAYERS, HEADS, HEAD_DIM, PAGE, DEVICE_TOKENS = 4, 2, 64, 16, 64
MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
MLA_DIM = 48 + 16  # kv_lora_rank + qk_rope_head_dim


def mha_pool(layout: str) -> MHATokenToKVPoolHost:
    """sglang's MHA host pool, built from device buffers the way its KV pool describes them."""
    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    buffers = KVBuffers(k=k, v=v, k_data_ptrs=_pointers(k), v_data_ptrs=_pointers(v), layout=KVBufferLayout.NHD)
    info = MHABufferInfo(
        buffers=buffers,
        page_size=PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu", device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS
    )
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    return pool


def mla_pool(layout: str) -> MLATokenToKVPoolHost:
    rows = tuple(torch.zeros(DEVICE_TOKENS, 1, MLA_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_pointers(rows),
        layer_indices=tuple(range(LAYERS)),
        device_layer_num=LAYERS,
        page_size=PAGE,
        kv_lora_rank=48,
        qk_rope_head_dim=16,
        kv_cache_dim=MLA_DIM,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    pool = MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape))
    return pool


def _pointers(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def storage_config(daemon, **fields) -> HiCacheStorageConfig:
    extra = {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang", "class_name": "KVStoreHiCacheStorage",
             "interface_v1": 1, "socket_path": str(daemon.socket), **fields.pop("extra", {})}  # fmt: skip
    values = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=False, is_page_first_layout=False, model_name="tiny-llama", extra_config=extra)  # fmt: skip
    return HiCacheStorageConfig(**{**values, **fields})


def backend(daemon, pool, **fields) -> HiCacheStorage:
    """Built as sglang's cache controller does: the factory, then the host pool."""
    made = StorageBackendFactory.create_backend("dynamic", storage_config(daemon, **fields), pool)
    made.register_mem_pool_host(pool)
    return made


def slots_of(pages: list[int]) -> torch.Tensor:
    """sglang's host_indices for whole pages: every token slot of each page, in order."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def kv_of_slots(pool, slots: torch.Tensor) -> torch.Tensor:
    """K and V of token slots as ``[layer, K/V, slot, head, dim]``, read through sglang's
    own per-layer views of the pool (``page_head`` has none: indexed by its documented
    dims ``[2, page, head, token, layer, dim]``)."""
    if pool.layout == "page_head":
        per_slot = [pool.kv_buffer[:, s // PAGE, :, s % PAGE] for s in slots.tolist()]  # [2, H, L, D] each
        return torch.stack(per_slot).permute(3, 1, 0, 2, 4)
    k = torch.stack([ref.reshape(-1, HEADS, HEAD_DIM)[slots] for ref in pool.k_data_refs])
    v = torch.stack([ref.reshape(-1, HEADS, HEAD_DIM)[slots] for ref in pool.v_data_refs])
    return torch.stack([k, v], dim=1)


def mla_rows_of_slots(pool, slots: torch.Tensor) -> torch.Tensor:
    """The latent row of each token slot and layer, ``[slot, layer, dim]``."""
    kv = pool.kv_buffer
    if pool.layout == "layer_first":  # [L, tokens, 1, D]
        return torch.stack([kv[:, s, 0] for s in slots.tolist()])
    if pool.layout == "page_first":  # [tokens, L, 1, D]
        return torch.stack([kv[s, :, 0] for s in slots.tolist()])
    return torch.stack([kv[s // PAGE, :, s % PAGE, 0] for s in slots.tolist()])  # [pages, L, page, 1, D]


def test_the_factory_builds_the_backend_from_a_dynamic_config(daemon):
    d = daemon()
    made = backend(d, mha_pool("page_first"))
    assert isinstance(made, KVStoreHiCacheStorage) and isinstance(made, HiCacheStorage)
    assert made.batch_exists(["never-stored"]) == 0


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_zero_copy_pages_round_trip_in_kvstores_layer_major_layout(daemon, layout):
    d = daemon()
    source, target = mha_pool(layout), mha_pool(layout)
    keys = [f"{layout}-page-{i}" for i in range(3)]
    writer = backend(d, source)
    assert writer.batch_set_v1(keys, slots_of([2, 3, 4])) == [True, True, True]
    assert writer.batch_exists(keys) == 3

    # the daemon holds each page as [layer][K | V] of its tokens, whatever the host layout
    with KVStoreClient(d.socket) as client:
        namespace = client.register_namespace(writer.store.namespace)
        stored = torch.empty(writer.store.namespace.block_bytes, dtype=torch.uint8)
        assert client.load(namespace, [engine_key_hash(keys[1])], [stored]) == 1
    expected = kv_of_slots(source, slots_of([3]))
    assert torch.equal(stored.view(torch.bfloat16).view(expected.shape), expected)

    reader = backend(d, target)
    assert reader.batch_get_v1(keys, slots_of([5, 6, 7])) == [True, True, True]
    assert torch.equal(kv_of_slots(target, slots_of([5, 6, 7])), kv_of_slots(source, slots_of([2, 3, 4])))
    untouched = kv_of_slots(target, slots_of([1]))
    assert not torch.equal(untouched, kv_of_slots(source, slots_of([2])))


def test_pages_written_from_one_host_layout_load_into_another(daemon):
    d = daemon()
    source = mha_pool("page_first")
    keys = ["shared-0", "shared-1"]
    assert backend(d, source).batch_set_v1(keys, slots_of([1, 2])) == [True, True]
    for layout in ("page_head", "layer_first", "page_first_direct"):
        target = mha_pool(layout)
        assert backend(d, target).batch_get_v1(keys, slots_of([4, 3])) == [True, True]
        assert torch.equal(kv_of_slots(target, slots_of([4, 3])), kv_of_slots(source, slots_of([1, 2])))


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_are_one_copy_for_every_tp_rank(daemon, layout):
    d = daemon()
    source, target = mla_pool(layout), mla_pool(layout)
    keys = ["mla-0", "mla-1"]
    assert backend(d, source, is_mla_model=True, tp_rank=0, tp_size=2).batch_set_v1(keys, slots_of([1, 2])) == [True, True]
    other_rank = backend(d, target, is_mla_model=True, tp_rank=1, tp_size=2)
    assert other_rank.batch_get_v1(keys, slots_of([3, 4])) == [True, True]
    assert torch.equal(mla_rows_of_slots(target, slots_of([3, 4])), mla_rows_of_slots(source, slots_of([1, 2])))


def test_batch_exists_and_gets_count_the_cached_prefix_only(daemon):
    d = daemon()
    pool = mha_pool("layer_first")
    store = backend(d, pool)
    assert store.batch_set_v1(["a", "b", "c"], slots_of([1, 2, 3])) == [True, True, True]
    assert store.batch_exists(["a", "b", "x", "c"]) == 2
    assert store.exists("c") and not store.exists("x")
    before = kv_of_slots(pool, slots_of([6]))
    assert store.batch_get_v1(["a", "x", "c"], slots_of([4, 5, 6])) == [True, False, False]
    assert torch.equal(kv_of_slots(pool, slots_of([4])), kv_of_slots(pool, slots_of([1])))
    assert torch.equal(kv_of_slots(pool, slots_of([6])), before)  # nothing past the miss was written


def test_keys_are_scoped_by_model_and_tp_and_pp_shard(daemon):
    d = daemon()
    keys = ["p0", "p1"]
    assert backend(d, mha_pool("page_first")).batch_set_v1(keys, slots_of([1, 2])) == [True, True]
    assert backend(d, mha_pool("page_first")).batch_exists(keys) == 2
    assert backend(d, mha_pool("page_first"), tp_rank=1, tp_size=2).batch_exists(keys) == 0
    assert backend(d, mha_pool("page_first"), tp_rank=0, tp_size=2).batch_exists(keys) == 0
    assert backend(d, mha_pool("page_first"), pp_rank=1, pp_size=2).batch_exists(keys) == 0
    assert backend(d, mha_pool("page_first"), model_name="another-model").batch_exists(keys) == 0
    assert backend(d, mha_pool("page_first"), extra={"tenant_salt": "team-b"}).batch_exists(keys) == 0


def test_the_flat_page_path_round_trips_as_sglangs_generic_transfer_uses_it(daemon):
    d = daemon()
    source, target = mha_pool("page_first"), mha_pool("page_first")
    store = backend(d, source)
    keys = ["flat-0", "flat-1"]
    # sglang's _generic_page_set: get_data_page(flat=True) of each page's first slot
    assert store.batch_set(keys, [source.get_data_page(p * PAGE) for p in (1, 2)])
    assert store.set("flat-2", source.get_data_page(3 * PAGE)) and store.exists("flat-2")
    # _generic_page_get: dummy flat pages, then set_from_flat_data_page
    pages = store.batch_get(keys + ["absent"], [target.get_dummy_flat_data_page() for _ in range(3)])
    assert pages[2] is None
    for page, slot in zip(pages[:2], (5 * PAGE, 6 * PAGE)):
        target.set_from_flat_data_page(slot, page)
    single = store.get("flat-2", target.get_dummy_flat_data_page())
    target.set_from_flat_data_page(7 * PAGE, single)
    assert torch.equal(kv_of_slots(target, slots_of([5, 6, 7])), kv_of_slots(source, slots_of([1, 2, 3])))
    assert store.get("absent", target.get_dummy_flat_data_page()) is None


def test_a_batch_is_chained_to_the_pages_sglang_names_before_it(daemon):
    d = daemon()
    store = backend(d, mha_pool("page_first"))
    assert store.batch_set_v1(["c0", "c1"], slots_of([1, 2])) == [True, True]
    assert store.batch_set_v1(["c2"], slots_of([3]), HiCacheStorageExtraInfo(prefix_keys=["c0", "c1"])) == [True]
    listing = subprocess.run(
        [sys.executable, "-m", "kvstore", "--address", d.address, "--json", "ls"], capture_output=True, text=True, check=True
    )
    parents = {b["hash"]: b["parent"] for b in json.loads(listing.stdout)["blocks"]}
    assert parents[engine_key_hash("c2").hex()] == engine_key_hash("c1").hex()
    assert parents[engine_key_hash("c1").hex()] == engine_key_hash("c0").hex()


def test_a_daemon_that_went_away_makes_calls_fail_instead_of_raising(daemon):
    d = daemon()
    pool = mha_pool("page_first")
    store = backend(d, pool)
    assert store.batch_set_v1(["g0"], slots_of([1])) == [True]
    d.stop()
    assert store.batch_exists(["g0"]) == 0 and not store.exists("g0")
    assert store.batch_get_v1(["g0"], slots_of([2])) == [False]
    assert store.batch_set_v1(["g1"], slots_of([2])) == [False]
    assert store.get("g0", pool.get_dummy_flat_data_page()) is None
    assert store.set("g1", pool.get_data_page(PAGE)) is False
    d.start()  # the same node restarted: its stopped self persisted g0 to NVMe
    assert store.batch_exists(["g0"]) == 1 and store.batch_get_v1(["g0"], slots_of([2])) == [True]


def test_misconfiguration_gets_a_sentence(daemon):
    d = daemon()
    with pytest.raises(InvalidArgument, match="MLA host pool with layout 'page_first'"):
        backend(d, mha_pool("page_first"), is_mla_model=True)  # an MHA pool declared MLA
    with pytest.raises(InvalidArgument, match="no model name"):
        backend(d, mha_pool("page_first"), model_name=None)
    store = backend(d, mha_pool("page_first"))
    assert store.batch_set_v1(["short"], torch.arange(PAGE - 1)) == [False]  # not whole pages: a failure, not a raise
    # no daemon at that path (yet): the engine starts, and its calls are misses until one is up
    absent = backend(d, mha_pool("page_first"), extra={"socket_path": str(d.socket) + ".missing"})
    assert absent.batch_exists(["g0"]) == 0 and absent.batch_set_v1(["g2"], slots_of([1])) == [False]
