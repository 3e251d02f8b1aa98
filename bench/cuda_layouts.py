"""KV caches laid out as vLLM 0.32's GPU backends lay them out, on any device, without vLLM.

Shared by the CUDA copy-engine tests (tests/test_cuda_copies.py) and ``bench.gpu_copies``
(the GPU machine has no vLLM). ``LAYOUTS`` are the stride orders of vLLM's
``KVCacheLayout`` (the physical order of the logical ``[L, B, H, N, C]`` axes);
tests/vllm_cache_views.py checks the copier against vLLM's own ``create_kv_cache_views``
on CPU, and tests/test_cuda_copies.py checks these views against the same CPU copies.
"""

from __future__ import annotations

import torch

LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layer_views(
    order: tuple[int, ...], layers: int, blocks: int, heads: int, tokens: int, content: int, dtype: torch.dtype, device
) -> list[torch.Tensor]:
    """One zeroed buffer, as per-layer ``[B, H, N, C]`` views with ``order``'s strides."""
    logical = (layers, blocks, heads, tokens, content)
    raw = torch.zeros([logical[axis] for axis in order], dtype=dtype, device=device)
    view = raw.permute(*(order.index(axis) for axis in range(5)))
    return [view[layer] for layer in range(layers)]


def flash_writer(head_dim: int, tokens: int):
    """FlashAttention's do_kv_cache_update in torch: (B, H, N, 2·D) → K and V caches
    (B, N, H, D), key[i] and value[i] written at token slot i."""

    def write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor) -> None:
        key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
        slots = torch.arange(key.shape[0], device=cache.device)
        key_cache[slots // tokens, slots % tokens] = key
        value_cache[slots // tokens, slots % tokens] = value

    return write


def mla_writer(tokens: int):
    """The MLA cache write: one latent per token slot of (B, 1, N, latent)."""

    def write(latent: torch.Tensor, cache: torch.Tensor) -> None:
        slots = torch.arange(latent.shape[0], device=cache.device)
        cache[slots // tokens, 0, slots % tokens] = latent[:, 0]

    return write
