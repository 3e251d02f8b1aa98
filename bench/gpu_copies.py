"""The vLLM connector's CUDA copy engine against raw copies of the same bytes, on a GPU.

    python -m bench.gpu_copies [--quick] [--json]

A pinned host slab of kvstore blocks (every layer of a block in one slot, HND planes)
and an engine cache of the same blocks in FlashAttention's NHD layout (``LBNHC``, K then
V in each cell; ``BLHNC``, block-outermost, as a second row), 32 layers of 8 KV heads ×
128 dims, bf16, 16-token blocks (64 KiB per layer of a block, 2 MiB per block); 512
blocks (1 GiB; 128 with --quick).

- **load** (host → GPU): ``CudaCopies.submit_load`` of every layer of every block, the
  gather kernels reading the pinned slab in place, until the last layer's event; the
  baseline is one ``cudaMemcpyAsync`` (``copy_(non_blocking=True)``) of the same bytes
  from a contiguous pinned buffer, on a stream of its own, in the same run.
- **store** (GPU → host): ``submit_save`` of every layer into the slab, against one
  raw device-to-pinned copy of the same bytes.
- **overlap**: a layer-wise load with a simulated forward pass — per layer the compute
  stream waits for that layer's event (``wait_on_device``), then runs a matmul sized to
  take about as long as the layer's copy. ``overlap`` is the total time over the
  longer of the two run alone (1.0: fully overlapped; 2.0: serial).

Each figure is the best of several runs; needs CUDA (the script says so and exits 0
without it).
"""

from __future__ import annotations

import sys
import time

import torch

from bench.cuda_layouts import LAYOUTS, flash_writer, layer_views
from bench.report import Report, gbps, parse_args
from kvstore.connectors.vllm_layout import BlockOrder, CudaCopies, LayerCopier, runs_of, runs_on
from kvstore.layout import KVLayout
from kvstore.tiers import device as device_memory

LAYERS, HEADS, DIM, TOKENS = 32, 8, 128, 16


def _cuda_time(work) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_layout(name: str, blocks: int, repeats: int) -> dict:
    dev = torch.device("cuda")
    views = layer_views(LAYOUTS[name], LAYERS, blocks, HEADS, TOKENS, 2 * DIM, torch.bfloat16, dev)
    writer = flash_writer(DIM, TOKENS)
    orders = [
        BlockOrder.discover(writer, tuple(v.shape[1:]), torch.bfloat16, HEADS, TOKENS, DIM, f"layer {i}", like=v)
        for i, v in enumerate(views)
    ]
    layout = KVLayout(LAYERS, HEADS, DIM, TOKENS, "bfloat16", 2, "HND")
    copier = LayerCopier(layout, torch.bfloat16, orders)
    slab = torch.empty(blocks * layout.block_bytes, dtype=torch.uint8)
    slab.random_(0, 256)
    if not device_memory.pin_host_memory(slab):
        raise SystemExit("cudaHostRegister failed on the bench slab")
    try:
        slots = [slab[i * layout.block_bytes : (i + 1) * layout.block_bytes] for i in range(blocks)]
        runs = runs_on(dev, runs_of(list(range(blocks)), slots, layout.block_bytes), layout.block_bytes)
        if any(run.first_slot.device.type != "cuda" for run in runs):
            raise SystemExit("this device cannot address pinned host memory in place; the copy engine goes through the host here")
        copies = CudaCopies(dev)
        nbytes = blocks * layout.block_bytes

        def load() -> list:
            return [copies.submit_load(copier.load, view, layer, runs) for layer, view in enumerate(views)]

        def save() -> list:
            return [copies.submit_save(copier.save, view, layer, runs) for layer, view in enumerate(views)]

        raw_host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        raw_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        raw_stream = torch.cuda.Stream(dev)

        def raw(copy) -> None:
            with torch.cuda.stream(raw_stream):
                copy()

        load()  # warm: kernels, index tensors
        torch.cuda.synchronize()
        t_load = min(_cuda_time(lambda: [job.result() for job in load()]) for _ in range(repeats))
        t_raw_h2d = min(_cuda_time(lambda: raw(lambda: raw_device.copy_(raw_host, non_blocking=True))) for _ in range(repeats))
        t_save = min(_cuda_time(lambda: [job.result() for job in save()]) for _ in range(repeats))
        t_raw_d2h = min(_cuda_time(lambda: raw(lambda: raw_host.copy_(raw_device, non_blocking=True))) for _ in range(repeats))

        # the simulated forward pass: one matmul per layer, sized to the layer's copy time
        per_layer = t_load / LAYERS
        size = 1024
        a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
        t_matmul = _cuda_time(lambda: [a @ a for _ in range(20)]) / 20
        reps = max(1, round(per_layer / t_matmul))

        def forward(jobs: list | None) -> None:
            for layer in range(LAYERS):
                if jobs is not None:
                    jobs[layer].wait_on_device()
                for _ in range(reps):
                    a @ a

        t_forward = min(_cuda_time(lambda: forward(None)) for _ in range(repeats))
        t_both = min(_cuda_time(lambda: forward(load())) for _ in range(repeats))
        copies.shutdown()
    finally:
        device_memory.unpin_host_memory(slab)
    return {
        "layout": name,
        "bytes": nbytes,
        "load_gbps": gbps(nbytes, t_load),
        "raw_h2d_gbps": gbps(nbytes, t_raw_h2d),
        "store_gbps": gbps(nbytes, t_save),
        "raw_d2h_gbps": gbps(nbytes, t_raw_d2h),
        "load_s": t_load,
        "forward_s": t_forward,
        "load_with_forward_s": t_both,
        "overlap": t_both / max(t_load, t_forward),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if not torch.cuda.is_available():
        print("bench.gpu_copies needs a CUDA device; this host has none")
        return
    blocks, repeats = (128, 3) if args.quick else (512, 5)
    report = Report("gpu_copies")
    rows = []
    for name in ("LBNHC", "BLHNC"):
        row = bench_layout(name, blocks, repeats)
        report.results.append(row)
        rows.append([name, row["load_gbps"], row["raw_h2d_gbps"], row["store_gbps"], row["raw_d2h_gbps"], row["overlap"]])
        report.compare(f"load_vs_raw_h2d_{name}", row["load_gbps"], row["raw_h2d_gbps"], "GB/s", ">= 0.8")
        report.compare(f"store_vs_raw_d2h_{name}", row["store_gbps"], row["raw_d2h_gbps"], "GB/s", ">= 0.8")
        report.ratio(f"overlap_{name}", row["overlap"], "<= 1.15")
    report.print_table(
        f"copy engine (GB/s, best of {repeats}, {blocks} blocks of {LAYERS} layers; raw: one cudaMemcpyAsync of the same bytes)",
        ["layout", "load", "raw h2d", "store", "raw d2h", "overlap"],
        rows,
    )
    report.emit(args.json)


if __name__ == "__main__":
    sys.exit(main())
