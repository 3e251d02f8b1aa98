"""The vLLM connector's copy engine over GPU-backend cache layouts.

The same round trip runs on CPU (``HostCopies``, here and in CI) and on CUDA
(``CudaCopies``: its own load and store streams, an event per layer, the pinned slab
read and written in place by the gather/scatter kernels), for every ``KVCacheLayout``
and for MLA's latent. The CUDA tests are marked ``gpu`` and run by ``make gpu-check``.
"""

from __future__ import annotations

import pytest
import torch

from bench.cuda_layouts import LAYOUTS, flash_writer, layer_views, mla_writer
from kvstore.connectors.vllm_layout import BlockOrder, CudaCopies, HostCopies, LayerCopier, runs_of, runs_on, wait_all
from kvstore.layout import KVLayout
from kvstore.tiers import device as device_memory

LAYERS, BLOCKS, TOKENS, HEADS, DIM, LATENT = 3, 12, 16, 2, 64, 576
SAVED = [2, 3, 4, 9]  # two runs
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _round_trip(device: str, order: tuple[int, ...], mla: bool, pin: bool = True) -> int:
    """Write a forward pass's KV into views of ``order``, save SAVED through the copy
    engine, check the slab holds kvstore's planes, load them into fresh views and check
    the bytes; returns how many runs the device read in place."""
    dev = torch.device(device)
    planes, heads, dim = (1, 1, LATENT) if mla else (2, HEADS, DIM)
    content = LATENT if mla else 2 * DIM
    writer = mla_writer(TOKENS) if mla else flash_writer(DIM, TOKENS)
    views = layer_views(order, LAYERS, BLOCKS, heads, TOKENS, content, torch.bfloat16, dev)
    orders = [
        BlockOrder.discover(writer, tuple(v.shape[1:]), torch.bfloat16, heads, TOKENS, dim, f"layer {i}", planes, like=v)
        for i, v in enumerate(views)
    ]
    layout = KVLayout(LAYERS, heads, dim, TOKENS, "bfloat16", planes, "HND")
    copier = LayerCopier(layout, torch.bfloat16, orders)
    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randn(planes, BLOCKS * TOKENS, heads, dim, generator=generator).bfloat16().to(dev) for _ in views]
    for view, planes_in in zip(views, inputs):
        writer(*planes_in, view)
    slab = torch.zeros(len(SAVED) * layout.block_bytes, dtype=torch.uint8)
    pinned = pin and device_memory.pin_host_memory(slab)
    try:
        slots = [slab[i * layout.block_bytes : (i + 1) * layout.block_bytes] for i in range(len(SAVED))]
        runs = runs_of(SAVED, slots, layout.block_bytes)
        copies = CudaCopies(dev) if dev.type == "cuda" else HostCopies()
        if dev.type == "cuda":
            runs = runs_on(dev, runs, layout.block_bytes)
        in_place = sum(run.first_slot.device.type == "cuda" for run in runs)
        assert wait_all([copies.submit_save(copier.save, view, layer, runs) for layer, view in enumerate(views)]) is None
        for i, block in enumerate(SAVED):
            for layer in range(LAYERS):
                offset, length = layout.layer_slice(layer)
                stored = slots[i][offset : offset + length].view(torch.bfloat16).view(planes, heads, TOKENS, dim)
                expected = inputs[layer][:, block * TOKENS : (block + 1) * TOKENS].transpose(1, 2).cpu()
                assert torch.equal(stored, expected), (order, layer, block)
        restored = layer_views(order, LAYERS, BLOCKS, heads, TOKENS, content, torch.bfloat16, dev)
        assert wait_all([copies.submit_load(copier.load, view, layer, runs) for layer, view in enumerate(restored)]) is None
        others = [b for b in range(BLOCKS) if b not in SAVED]
        for view, original in zip(restored, views):
            assert torch.equal(view[SAVED], original[SAVED])
            assert not view[others].any()  # nothing written outside the loaded blocks
        copies.shutdown()
        return in_place
    finally:
        if pinned:
            device_memory.unpin_host_memory(slab)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mla", [False, True], ids=["flash-attention", "mla"])
def test_every_layout_round_trips_through_the_copy_engine(device, layout, mla):
    in_place = _round_trip(device, LAYOUTS[layout], mla)
    if device == "cuda":
        assert in_place == 2  # both runs read and written in the pinned slab, no host staging


@pytest.mark.gpu
def test_a_slab_this_process_did_not_pin_is_copied_through_the_host():
    assert _round_trip("cuda", LAYOUTS["LBNHC"], False, pin=False) == 0


@pytest.mark.gpu
def test_pinned_host_memory_is_read_and_written_in_place_by_the_device():
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    assert device_memory.on_device(buffer, torch.device("cuda")) is None  # not pinned: never aliased
    assert device_memory.pin_host_memory(buffer)
    try:
        alias = device_memory.on_device(buffer[4096:8192], torch.device("cuda"))
        assert alias is not None and alias.is_cuda and alias.numel() == 4096
        alias.fill_(9)
        torch.cuda.synchronize()
        assert bool((buffer[4096:8192] == 9).all()) and not buffer[:4096].any() and not buffer[8192:].any()
    finally:
        device_memory.unpin_host_memory(buffer)


@pytest.mark.gpu
def test_the_compute_stream_waits_for_its_own_layer_only_and_the_host_not_at_all():
    """Layer 1's copy is held back on the load stream (a 0.3 s spin before it); work
    queued behind layer 0's event runs and finishes while layer 1 is still copying, and
    queueing both took the host no time to speak of."""
    dev = torch.device("cuda")
    copies = CudaCopies(dev)
    source = torch.randn(1 << 20, device=dev)
    targets = [torch.empty_like(source) for _ in range(2)]

    def copy(layer: int) -> None:
        if layer == 1:
            torch.cuda._sleep(int(0.3 * torch.cuda.get_device_properties(dev).clock_rate * 1000))
        targets[layer].copy_(source)

    torch.cuda.synchronize()
    jobs = [copies.submit_load(copy, layer) for layer in range(2)]
    jobs[0].wait_on_device()
    marker = torch.cuda.Event()
    after_layer_0 = targets[0] * 2  # the "forward pass" of layer 0, on the compute stream
    marker.record()
    marker.synchronize()
    assert torch.equal(after_layer_0, source * 2)
    assert not jobs[1].done()  # layer 1 is still held back: the compute stream did not wait for it
    assert jobs[1].exception() is None and jobs[1].done()
    assert torch.equal(targets[1], source)
    copies.shutdown()


@pytest.mark.gpu
def test_a_save_waits_on_the_device_for_the_layer_the_compute_stream_writes():
    dev = torch.device("cuda")
    copies = CudaCopies(dev)
    layer = torch.zeros(1 << 22, device=dev)
    out = torch.empty(layer.shape, dtype=layer.dtype).pin_memory()
    torch.cuda._sleep(int(0.2 * torch.cuda.get_device_properties(dev).clock_rate * 1000))
    layer.fill_(3.0)  # the forward pass writes the layer after a delay
    job = copies.submit_save(lambda: out.copy_(layer, non_blocking=True))
    assert job.exception() is None
    assert bool((out == 3.0).all())
    copies.shutdown()
