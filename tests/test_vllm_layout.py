"""BlockOrder: learning an engine's in-block KV order from its cache-write kernel.

The writers here stand in for vLLM's CPU kernels (the real ones are exercised by
test_vllm_e2e against a reference forward pass): one stores K and V alike (one view
covers both planes, as in the GPU layouts), one stores K transposed like the ``vec``
kernel, one packs K in pairs of dims like a VNNI/AMX layout (affine only once the dims
are cut in tiles: the tiled path), one scrambles K (no tiling describes it: the gather
path), and broken ones that lose or duplicate elements.
"""

import threading

import pytest
import torch

from kvstore.connectors.vllm_layout import BlockOrder, CopyJob, HostCopies, LayerCopier, runs_of, wait_all
from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout

HEADS, TOKENS, DIM = 2, 32, 64
SHAPE = (HEADS, TOKENS, 2 * DIM)  # vLLM CPU: (heads, block_size, 2·head_size) per block


def transposed_k_writer(key, value, scratch):
    """Per head: K as (dim, tokens), then V as (tokens, dim)."""
    block = scratch[0].view(HEADS, 2, TOKENS * DIM)
    block[:, 0] = key.permute(1, 2, 0).reshape(HEADS, -1)
    block[:, 1] = value.permute(1, 0, 2).reshape(HEADS, -1)


def plain_writer(key, value, scratch):
    """Per head: K as (tokens, dim), then V the same way: one view covers both planes."""
    block = scratch[0].view(HEADS, 2, TOKENS * DIM)
    block[:, 0] = key.permute(1, 0, 2).reshape(HEADS, -1)
    block[:, 1] = value.permute(1, 0, 2).reshape(HEADS, -1)


def paired_k_writer(key, value, scratch):
    """Per head: K as (dim/2, tokens, 2) pairs, then V as (tokens, dim)."""
    block = scratch[0].view(HEADS, 2, TOKENS * DIM)
    block[:, 0] = key.view(TOKENS, HEADS, DIM // 2, 2).permute(1, 2, 0, 3).reshape(HEADS, -1)
    block[:, 1] = value.permute(1, 0, 2).reshape(HEADS, -1)


SCRAMBLE = torch.randperm(TOKENS * DIM, generator=torch.Generator().manual_seed(0))


def scrambled_k_writer(key, value, scratch):
    """Per head: K's (token, dim) elements in a fixed random order, then V as (tokens, dim)."""
    block = scratch[0].view(HEADS, 2, TOKENS * DIM)
    block[:, 0] = key.permute(1, 0, 2).reshape(HEADS, -1)[:, SCRAMBLE]
    block[:, 1] = value.permute(1, 0, 2).reshape(HEADS, -1)


def reference_planes(native: torch.Tensor, writer) -> torch.Tensor:
    """(2, heads, tokens, dim) planes of a block, by inverting the writer element by element."""
    planes = torch.empty(2, HEADS, TOKENS, DIM, dtype=native.dtype)
    block = native.view(HEADS, 2, TOKENS * DIM)
    if writer is transposed_k_writer:
        planes[0] = block[:, 0].view(HEADS, DIM, TOKENS).transpose(1, 2)
    elif writer is plain_writer:
        planes[0] = block[:, 0].view(HEADS, TOKENS, DIM)
    elif writer is scrambled_k_writer:
        planes[0].view(HEADS, -1)[:, SCRAMBLE] = block[:, 0]
    else:
        planes[0] = block[:, 0].view(HEADS, DIM // 2, TOKENS, 2).permute(0, 2, 1, 3).reshape(HEADS, TOKENS, DIM)
    planes[1] = block[:, 1].view(HEADS, TOKENS, DIM)
    return planes


@pytest.mark.parametrize("writer", [plain_writer, transposed_k_writer, paired_k_writer, scrambled_k_writer])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_saved_planes_are_k_then_v_head_major_and_load_restores_the_block(writer, dtype):
    order = BlockOrder.discover(writer, SHAPE, dtype, HEADS, TOKENS, DIM, "layer 0")
    cache = torch.randn(6, *SHAPE).to(dtype)
    # two blocks in the middle, into rows that lie apart (slots of a slab): views must honour offsets and strides
    rows = torch.zeros(2, 3 * 2 * HEADS * TOKENS * DIM, dtype=dtype)[:, 5 : 5 + 2 * HEADS * TOKENS * DIM]
    order.save(cache[3:5], rows)
    for row, block in zip(rows, cache[3:5]):
        assert torch.equal(row.view(2, HEADS, TOKENS, DIM), reference_planes(block, writer))
    restored = torch.zeros(6, *SHAPE, dtype=dtype)
    order.load(rows, restored[1:3])
    assert torch.equal(restored[1:3], cache[3:5])
    assert not restored[[0, 3, 4, 5]].any()  # nothing outside the target blocks was touched


def test_planes_laid_out_alike_copy_through_one_view_the_transposed_through_one_each_the_packed_through_tiles():
    copies = {
        writer.__name__: BlockOrder.discover(writer, SHAPE, torch.bfloat16, HEADS, TOKENS, DIM, "x").copies
        for writer in (plain_writer, transposed_k_writer, paired_k_writer, scrambled_k_writer)
    }
    assert copies == {
        "plain_writer": "one view",
        "transposed_k_writer": "a view per plane",
        "paired_k_writer": "tiled views",
        "scrambled_k_writer": "gather",
    }


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


def test_runs_join_blocks_whose_slots_are_adjacent_listing_ids_that_are_not_consecutive():
    slab = torch.zeros(10 * 100, dtype=torch.uint8)
    slots = [slab[i * 100 : (i + 1) * 100] for i in (0, 1, 2, 5, 6, 7)]
    runs = runs_of([7, 8, 9, 12, 11, 10], slots, block_bytes=100)
    # 7-9 adjacent in both; 12's slot is not next to 9's; 12, 11, 10 count down (vLLM's free order)
    assert [(r.first_block, r.count) for r in runs] == [(7, 3), (12, 3)]
    assert runs[0].block_ids is None and runs[1].block_ids.tolist() == [12, 11, 10]
    assert runs[1].first_slot.data_ptr() == slots[3].data_ptr()


@pytest.mark.parametrize("writer", [plain_writer, transposed_k_writer, paired_k_writer, scrambled_k_writer])
def test_the_layer_copier_moves_one_layer_of_every_run_and_nothing_else(writer):
    layout = KVLayout(num_layers=3, num_kv_heads=HEADS, head_dim=DIM, block_size=TOKENS, dtype="bfloat16", inner_order="HND")
    orders = [BlockOrder.discover(writer, SHAPE, torch.bfloat16, HEADS, TOKENS, DIM, f"layer {i}") for i in range(3)]
    copier = LayerCopier(layout, torch.bfloat16, orders)
    slab = torch.zeros(8 * layout.block_bytes, dtype=torch.uint8)
    slot_of = {block: slab[i * layout.block_bytes : (i + 1) * layout.block_bytes] for i, block in enumerate([4, 5, 6, 9])}
    caches = [torch.randn(12, *SHAPE).bfloat16() for _ in range(3)]
    blocks = [4, 5, 6, 9]
    runs = runs_of(blocks, [slot_of[b] for b in blocks], layout.block_bytes)
    assert len(runs) == 1 and runs[0].block_ids.tolist() == blocks
    copier.save(caches[1], 1, runs)
    for block in blocks:
        offset, length = layout.layer_slice(1)
        stored = slot_of[block][offset : offset + length].view(torch.bfloat16).view(2, HEADS, TOKENS, DIM)
        assert torch.equal(stored, reference_planes(caches[1][block], writer))
        assert not slot_of[block][: layout.layer_slice(1)[0]].any()  # layer 0 untouched
    restored = torch.zeros(12, *SHAPE, dtype=torch.bfloat16)
    copier.load(restored, 1, runs)
    assert torch.equal(restored[blocks], caches[1][blocks])
    assert not restored[[b for b in range(12) if b not in blocks]].any()


@pytest.mark.parametrize("writer", [plain_writer, transposed_k_writer, paired_k_writer, scrambled_k_writer])
@pytest.mark.parametrize("blocks", [[3, 4, 5, 6], [9, 8, 7, 6], [2, 10, 5, 0]], ids=["consecutive", "counting-down", "any-order"])
def test_a_run_of_adjacent_slots_round_trips_whatever_order_its_blocks_are_in(blocks, writer):
    layout = KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, block_size=TOKENS, dtype="bfloat16", inner_order="HND")
    orders = [BlockOrder.discover(writer, SHAPE, torch.bfloat16, HEADS, TOKENS, DIM, f"layer {i}") for i in range(2)]
    copier = LayerCopier(layout, torch.bfloat16, orders)
    slab = torch.zeros(len(blocks) * layout.block_bytes, dtype=torch.uint8)
    slots = [slab[i * layout.block_bytes : (i + 1) * layout.block_bytes] for i in range(len(blocks))]
    runs = runs_of(blocks, slots, layout.block_bytes)
    assert len(runs) == 1
    cache = torch.randn(12, *SHAPE).bfloat16()
    copier.save(cache, 1, runs)
    for block, slot in zip(blocks, slots):  # each slot holds its own block, in store order
        offset, length = layout.layer_slice(1)
        stored = slot[offset : offset + length].view(torch.bfloat16).view(2, HEADS, TOKENS, DIM)
        assert torch.equal(stored, reference_planes(cache[block], writer))
    restored = torch.zeros(12, *SHAPE, dtype=torch.bfloat16)
    copier.load(restored, 1, runs)
    assert torch.equal(restored[blocks], cache[blocks])
    assert not restored[[b for b in range(12) if b not in blocks]].any()


def test_host_copies_run_at_once_on_the_calling_thread_in_order():
    """No thread of kvstore's runs torch work beside vLLM's compute threads (a second OpenMP
    team slowed the engine's forward pass): each copy is done when it is handed over."""
    copies = HostCopies()
    ran: list[tuple[str, str]] = []
    load = copies.submit_load(lambda: ran.append(("load", threading.current_thread().name)))
    assert load.done() and ran == [("load", threading.current_thread().name)]
    save = copies.submit_save(lambda: ran.append(("save", threading.current_thread().name)))
    assert save.done() and [what for what, _ in ran] == ["load", "save"]
    assert {name for _, name in ran} == {threading.current_thread().name}
    assert wait_all([load, save]) is None
    copies.shutdown()


def test_a_failed_copy_hands_its_error_to_the_waiter():
    copies = HostCopies()

    def broken():
        raise RuntimeError("slab view out of range")

    job = copies.submit_load(broken)  # raises nothing into the engine here
    assert isinstance(job.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="out of range"):
        job.result()


def test_a_copy_no_thread_has_started_runs_on_the_waiting_thread_once():
    """A job queued elsewhere (a copy engine that runs jobs later) that nobody has started
    is run by the first thread that waits for it, and only once."""
    ran_on: list[str] = []
    job = CopyJob(lambda: ran_on.append(threading.current_thread().name), ())
    other = threading.Thread(target=job.run, name="late-runner")
    assert job.exception() is None
    other.start()
    other.join()
    assert ran_on == [threading.current_thread().name]


def test_after_a_failed_copy_the_copies_behind_it_are_waited_for():
    """The worker releases a step's leases once its copies are done; a copy that is still
    running after an earlier one failed reads slots that must not be let go yet."""
    release = threading.Event()
    finished = []

    def failing():
        raise RuntimeError("the copy of layer 0 failed")

    def slow():
        release.wait(5)
        finished.append(True)

    jobs = [CopyJob(failing, ()), CopyJob(slow, ())]
    for job in jobs:
        threading.Thread(target=job.run).start()
    threading.Timer(0.3, release.set).start()
    error = wait_all(jobs)
    assert isinstance(error, RuntimeError) and finished == [True]


@pytest.mark.parametrize("element", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_held_in_a_byte_tensor_is_learned_from_its_fp8_values(element):
    """fp8 caches are uint8 tensors: the probe writes bf16 digits, reads them back as fp8
    (e5m2's two mantissa bits hold 0…7 exactly, not 0…15), and copies move the bytes."""

    def fp8_writer(key, value, scratch):
        block = scratch[0].view(element).view(HEADS, 2, TOKENS * DIM)
        block[:, 0] = key.permute(1, 2, 0).reshape(HEADS, -1).to(element)
        block[:, 1] = value.permute(1, 0, 2).reshape(HEADS, -1).to(element)

    order = BlockOrder.discover(
        fp8_writer, SHAPE, torch.uint8, HEADS, TOKENS, DIM, "layer 0", input_dtype=torch.bfloat16, element_dtype=element
    )
    cache = torch.randint(0, 256, (4, *SHAPE), dtype=torch.uint8)
    rows = torch.zeros(2, 2 * HEADS * TOKENS * DIM, dtype=torch.uint8)
    order.save(cache[1:3], rows)
    for row, block in zip(rows, cache[1:3]):
        assert torch.equal(row.view(2, HEADS, TOKENS, DIM), reference_planes(block, transposed_k_writer))
    restored = torch.zeros_like(cache)
    order.load(rows, restored[:2])
    assert torch.equal(restored[:2], cache[1:3])
