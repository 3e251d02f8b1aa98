"""BlockOrder: learning an engine's in-block KV order from its cache-write kernel.

The writers here stand in for vLLM's CPU kernels (the real ones are exercised by
test_vllm_e2e against a reference forward pass): one stores K transposed like the
``vec`` kernel, one packs K in pairs of dims like a VNNI/AMX layout (not affine: the
gather path), and broken ones that lose or duplicate elements.
"""

import pytest
import torch

from kvstore.connectors.vllm_layout import BlockOrder
from kvstore.errors import InvalidArgument

HEADS, TOKENS, DIM = 2, 32, 64
SHAPE = (HEADS, TOKENS, 2 * DIM)  # vLLM CPU: (heads, block_size, 2·head_size) per block


def transposed_k_writer(key, value, scratch):
    """Per head: K as (dim, tokens), then V as (tokens, dim)."""
    block = scratch[0].view(HEADS, 2, TOKENS * DIM)
    block[:, 0] = key.permute(1, 2, 0).reshape(HEADS, -1)
    block[:, 1] = value.permute(1, 0, 2).reshape(HEADS, -1)


def paired_k_writer(key, value, scratch):
    """Per head: K as (dim/2, tokens, 2) pairs, then V as (tokens, dim)."""
    block = scratch[0].view(HEADS, 2, TOKENS * DIM)
    block[:, 0] = key.view(TOKENS, HEADS, DIM // 2, 2).permute(1, 2, 0, 3).reshape(HEADS, -1)
    block[:, 1] = value.permute(1, 0, 2).reshape(HEADS, -1)


def reference_planes(native: torch.Tensor, writer) -> torch.Tensor:
    """(2, heads, tokens, dim) planes of a block, by inverting the writer element by element."""
    planes = torch.empty(2, HEADS, TOKENS, DIM, dtype=native.dtype)
    block = native.view(HEADS, 2, TOKENS * DIM)
    if writer is transposed_k_writer:
        planes[0] = block[:, 0].view(HEADS, DIM, TOKENS).transpose(1, 2)
    else:
        planes[0] = block[:, 0].view(HEADS, DIM // 2, TOKENS, 2).permute(0, 2, 1, 3).reshape(HEADS, TOKENS, DIM)
    planes[1] = block[:, 1].view(HEADS, TOKENS, DIM)
    return planes


@pytest.mark.parametrize("writer", [transposed_k_writer, paired_k_writer])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_saved_planes_are_k_then_v_head_major_and_load_restores_the_block(writer, dtype):
    order = BlockOrder.discover(writer, SHAPE, dtype, HEADS, TOKENS, DIM, "layer 0")
    cache = torch.randn(5, *SHAPE).to(dtype)
    planes = torch.empty(2 * HEADS * TOKENS * DIM, dtype=dtype)
    order.save(cache[3], planes)  # a block in the middle: views must honour its offset
    assert torch.equal(planes.view(2, HEADS, TOKENS, DIM), reference_planes(cache[3], writer))
    restored = torch.zeros(5, *SHAPE, dtype=dtype)
    order.load(planes, restored[2])
    assert torch.equal(restored[2], cache[3])
    assert not restored[[0, 1, 3, 4]].any()  # nothing outside the target block was touched


def test_the_transposed_layout_copies_through_strided_views_and_the_packed_one_through_the_index():
    assert BlockOrder.discover(transposed_k_writer, SHAPE, torch.bfloat16, HEADS, TOKENS, DIM, "x")._strided is not None
    assert BlockOrder.discover(paired_k_writer, SHAPE, torch.bfloat16, HEADS, TOKENS, DIM, "x")._strided is None


def test_a_kernel_that_leaves_elements_unwritten_is_refused():
    def half_writer(key, value, scratch):
        scratch[0].view(HEADS, 2, TOKENS * DIM)[:, 0] = key.permute(1, 2, 0).reshape(HEADS, -1)

    with pytest.raises(InvalidArgument, match="layer 7: .*plain elements"):
        BlockOrder.discover(half_writer, SHAPE, torch.bfloat16, HEADS, TOKENS, DIM, "layer 7")


def test_a_kernel_that_stores_an_element_twice_is_refused():
    def duplicating_writer(key, value, scratch):
        block = scratch[0].view(HEADS, 2, TOKENS * DIM)
        block[:, 0] = key.permute(1, 2, 0).reshape(HEADS, -1)
        block[:, 1] = key.permute(1, 2, 0).reshape(HEADS, -1)  # V never stored, K twice

    with pytest.raises(InvalidArgument, match="once per block"):
        BlockOrder.discover(duplicating_writer, SHAPE, torch.bfloat16, HEADS, TOKENS, DIM, "layer 0")


def test_a_block_of_the_wrong_size_is_refused():
    with pytest.raises(InvalidArgument, match="holds 4096 elements, not the 8192"):
        BlockOrder.discover(transposed_k_writer, (HEADS, TOKENS, DIM), torch.bfloat16, HEADS, TOKENS, DIM, "layer 0")
