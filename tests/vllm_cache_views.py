"""The connector's copies over the exact cache views vLLM 0.32 builds for GPU backends.

    .venv-vllm/bin/python tests/vllm_cache_views.py

Run by test_vllm_cache_views with the vLLM venv's python. For every ``KVCacheLayout``
and two specs — full attention (each (head, token) cell holds K then V, which
FlashAttention splits at ``head_size``) and MLA (one latent of
``kv_lora_rank + qk_rope_head_dim`` per token) — it allocates one CPU buffer for three
layers, places them as vLLM places them for that layout (layer-outermost: a region per
layer; block-outermost: a block holds every layer's page) and takes each layer's view
with vLLM's own ``create_kv_cache_views``: the strides a GPU backend gets. The writer is
FlashAttention's ``do_kv_cache_update`` (and the MLA cache write) in torch: their CUDA
kernels store ``key[i]`` at ``(slot // N, slot % N)`` of the backend's own split of the
view, which is what indexing the view does here.

Then, per layer: ``BlockOrder.discover`` learns the order from the writer on a scratch
block laid out like the cache; a forward pass is simulated by writing known keys and
values into some blocks; ``LayerCopier.save`` copies two runs of blocks into slab slots
and the slots must hold exactly kvstore's planes (K then V, heads × tokens × dim; or the
latent); ``LayerCopier.load`` copies them into a zeroed buffer of the same layout, which
must then hold those blocks' bytes exactly, and nothing else. Prints one JSON line per
case; exits non-zero on the first mismatch.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvstore.connectors.vllm_layout import BlockOrder, LayerCopier, runs_of
from kvstore.layout import KVLayout

LAYERS, BLOCKS, TOKENS = 3, 10, 16
HEADS, DIM = 2, 64
MLA_LATENT = 512 + 64
DTYPE = torch.bfloat16
SAVED = [2, 3, 4, 7]  # two runs: 2-4 and 7


def flash_writer(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> None:
    """FlashAttention's do_kv_cache_update: (B, H, N, 2·D) → K and V caches (B, N, H, D)."""
    key_cache, value_cache = cache.transpose(1, 2).split(DIM, dim=-1)
    slots = torch.arange(key.shape[0])
    key_cache[slots // TOKENS, slots % TOKENS] = key
    value_cache[slots // TOKENS, slots % TOKENS] = value


def mla_writer(latent: torch.Tensor, cache: torch.Tensor) -> None:
    """The MLA cache write: one latent per token slot of (B, 1, N, latent)."""
    slots = torch.arange(latent.shape[0])
    cache[slots // TOKENS, 0, slots % TOKENS] = latent[:, 0]


def layer_views(spec, layout: KVCacheLayout) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zeroed buffer and vLLM's per-layer views of it for ``layout``."""
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    shape = (LAYERS, *compute_layer_kv_cache_shape_bytes(spec, BLOCKS))
    size = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=size, layers=[f"model.layers.{i}.attn" for i in range(LAYERS)], layer_stride=strides[0], block_stride=strides[1]
    )
    return raw, create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)


def check(spec, layout: KVCacheLayout, mla: bool) -> dict:
    planes, heads, dim = (1, 1, MLA_LATENT) if mla else (2, HEADS, DIM)
    writer = mla_writer if mla else flash_writer
    store_layout = KVLayout(LAYERS, heads, dim, TOKENS, "bfloat16", planes, "HND")
    raw, views = layer_views(spec, layout)
    orders = [
        BlockOrder.discover(writer, tuple(view.shape[1:]), DTYPE, heads, TOKENS, dim, f"layer {i} ({layout.name})", planes, like=view)
        for i, view in enumerate(views)
    ]
    copier = LayerCopier(store_layout, DTYPE, orders)
    generator = torch.Generator().manual_seed(layout.value.__hash__() & 0xFFFF)
    # the forward pass: every block's tokens written, per layer, through the backend's split
    inputs = [torch.randn(planes, BLOCKS * TOKENS, heads, dim, generator=generator).to(DTYPE) for _ in views]
    for view, planes_in in zip(views, inputs):
        writer(*planes_in, view)
    slab = torch.zeros(len(SAVED) * store_layout.block_bytes, dtype=torch.uint8)
    slots = [slab[i * store_layout.block_bytes : (i + 1) * store_layout.block_bytes] for i in range(len(SAVED))]
    runs = runs_of(SAVED, slots, store_layout.block_bytes)
    for layer, view in enumerate(views):
        copier.save(view, layer, runs)
    for i, block in enumerate(SAVED):
        for layer in range(LAYERS):
            offset, length = store_layout.layer_slice(layer)
            stored = slots[i][offset : offset + length].view(DTYPE).view(planes, heads, TOKENS, dim)
            tokens = inputs[layer][:, block * TOKENS : (block + 1) * TOKENS]  # (planes, tokens, heads, dim)
            if not torch.equal(stored, tokens.transpose(1, 2)):
                raise SystemExit(f"{layout.name} {'mla' if mla else 'mha'}: block {block} layer {layer} stored the wrong planes")
    restored_raw, restored = layer_views(spec, layout)
    for layer, view in enumerate(restored):
        copier.load(view, layer, runs)
    for layer, (view, original) in enumerate(zip(restored, views)):
        if not torch.equal(view[SAVED], original[SAVED]):
            raise SystemExit(f"{layout.name}: layer {layer}: a loaded block differs from the one saved")
        others = [b for b in range(BLOCKS) if b not in SAVED]
        if view[others].any():
            raise SystemExit(f"{layout.name}: layer {layer}: a load wrote outside its blocks")
    contiguous = all(view[0].is_contiguous() for view in views)
    return {
        "layout": layout.name,
        "spec": "mla" if mla else "full attention",
        "block_contiguous": contiguous,
        "strided_copies": sum(order.strided for order in orders),
        "bytes_checked": int(slab.numel()),
        "ok": True,
    }


def main() -> None:
    full = FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=DIM, dtype=DTYPE)
    mla = MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=MLA_LATENT, dtype=DTYPE)
    for layout in KVCacheLayout:
        for spec, is_mla in ((full, False), (mla, True)):
            print(json.dumps(check(spec, layout, is_mla)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
