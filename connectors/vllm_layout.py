"""Where each K and V element of one engine block sits, learned from the engine itself.

kvstore stores a layer of a block as ``HND`` planes — K then V, each ``num_kv_heads ×
block_size × head_dim`` — whatever engine wrote it. vLLM's CPU backend keeps a layer
as ``(num_blocks, num_kv_heads, block_size, 2·head_size)``, but the element order inside
a block depends on the attention kernel the CPU supports (the ``vec`` kernel stores K
head_dim-major, transposed; the AMX kernel packs it for its tiles). Rather than
hard-code each kernel's packing, ``BlockOrder.discover`` has the engine's own cache-write
kernel write keys and values whose digits name their (plane, head, token, dim) into a
scratch block, reads back where each landed, and keeps the resulting gather index.
A block that is not a plain permutation of the two planes is refused.

Copies use two strided views (one per plane) when the permutation is affine in (head,
token, dim) — true of the ``vec`` kernel — and a gather/scatter through the index
otherwise. Pure torch; the engine call is injected.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvstore.errors import InvalidArgument

__all__ = ["BlockOrder", "CacheWriter"]

# writes keys and values (tokens × heads × dim each) into token slots 0… of a one-block scratch cache
CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

_DIGIT_BASE = 16  # digits 0…15 are exact in every float dtype, fp8 included


class BlockOrder:
    def __init__(self, gather: torch.Tensor, planes_shape: tuple[int, int, int]) -> None:
        self.gather = gather  # store position → element position inside the engine block
        self._planes_shape = planes_shape  # (heads, tokens, dim)
        self._strided = _affine_planes(gather, planes_shape)

    @classmethod
    def discover(cls, write: CacheWriter, block_shape: tuple[int, ...], dtype: torch.dtype,
                 num_kv_heads: int, block_size: int, head_dim: int, what: str) -> "BlockOrder":
        """Learn the order from ``write`` into blocks of ``block_shape``; ``what`` names
        the layer in errors."""
        count = 2 * num_kv_heads * block_size * head_dim
        block_elements = 1
        for size in block_shape:
            block_elements *= size
        if block_elements != count:
            raise InvalidArgument(f"{what}: a block holds {block_elements} elements, not the {count} of its K and V planes.")
        # the store position of every (plane, token, head, dim), in the order the writer takes its inputs
        position = torch.arange(count).view(2, num_kv_heads, block_size, head_dim).transpose(1, 2)
        native_position = torch.zeros(count, dtype=torch.long)
        place = 1
        while place < count:
            digits = (position // place) % _DIGIT_BASE
            scratch = torch.full((1, *block_shape), -1.0, dtype=dtype)
            write(digits[0].to(dtype).contiguous(), digits[1].to(dtype).contiguous(), scratch)
            written = scratch.view(-1).float()
            if bool((written < 0).any()) or bool((written >= _DIGIT_BASE).any()):
                raise InvalidArgument(f"{what}: the engine's cache kernel does not store K and V as plain elements; "
                                      "the kvstore connector cannot read this cache layout.")
            native_position += written.long() * place
            place *= _DIGIT_BASE
        if not torch.equal(torch.bincount(native_position, minlength=count), torch.ones(count, dtype=torch.long)):
            raise InvalidArgument(f"{what}: the engine's cache kernel does not store each K and V element once per block; "
                                  "the kvstore connector cannot read this cache layout.")
        gather = torch.empty(count, dtype=torch.long)
        gather[native_position] = torch.arange(count)
        return cls(gather, (num_kv_heads, block_size, head_dim))

    def save(self, native_block: torch.Tensor, planes: torch.Tensor) -> None:
        """Copy one engine block (one layer) into ``planes``, a flat tensor in store order."""
        flat = native_block.view(-1)
        if self._strided is None:
            torch.index_select(flat, 0, self.gather, out=planes)
            return
        target = planes.view(2, *self._planes_shape)
        for plane, (strides, offset) in enumerate(self._strided):
            target[plane].copy_(flat.as_strided(self._planes_shape, strides, flat.storage_offset() + offset))

    def load(self, planes: torch.Tensor, native_block: torch.Tensor) -> None:
        flat = native_block.view(-1)
        if self._strided is None:
            flat.index_copy_(0, self.gather, planes)
            return
        source = planes.view(2, *self._planes_shape)
        for plane, (strides, offset) in enumerate(self._strided):
            flat.as_strided(self._planes_shape, strides, flat.storage_offset() + offset).copy_(source[plane])


def _affine_planes(gather: torch.Tensor, shape: tuple[int, int, int]) -> list[tuple[tuple[int, ...], int]] | None:
    """Per plane, (strides, offset) of a view of the engine block that is that plane, or
    None when some plane's elements are not an affine image of (head, token, dim)."""
    planes = gather.view(2, *shape)
    found = []
    for plane in planes:
        offset = int(plane[0, 0, 0])
        strides = tuple(int(plane[tuple(1 if axis == a else 0 for a in range(3))]) - offset if shape[axis] > 1 else 0
                        for axis in range(3))
        grid = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
        predicted = offset + sum(g * s for g, s in zip(grid, strides))
        if not torch.equal(predicted, plane) or any(s < 0 for s in strides):
            return None
        found.append((strides, offset))
    return found
