"""Tier throughput against same-run baselines.

    python -m bench.tiers [--quick] [--json] [--dir PATH]

For each block size (256 KiB, 1 MiB, 4 MiB):
- host tier: put = reserve → copy into the shared-memory slot, each block's XXH3-64 taken
  beside the copy (a batch of 4 MiB or more hashes its sources on a helper thread while the
  caller's thread copies: the put uses the second core, the baseline one; with one core each
  256 KiB chunk is hashed right after its copy, while in cache) → commit, get = acquire → copy out → release, both through the tier
  manager, in batches of 64 blocks, against single-thread memcpy of the same blocks between
  private torch tensors (target ≥ 0.8×). The put does beyond the memcpy: the checksum of
  every byte and the bookkeeping (slots, catalogue, eviction policy, events). Baseline, put
  and get passes take turns, best of 5 (7 without ``--quick``) each;
- NVMe tier: put and get of the same blocks through the tier (trailers, checksums, the
  I/O pool), against a raw baseline that does the tier's I/O without the tier (target ≥
  0.7×): one ``pwrite`` / ``preadv`` per block at its own offset of one preallocated file,
  opened with the tier's flags (O_DIRECT where the filesystem takes it), submitted on a
  pool of the tier's ``io_threads`` as the tier submits, with the tier's sync policy (the
  default writes without ``fdatasync``; with ``sync_writes`` each block is synced), and
  the page cache written back and dropped before every read pass on both sides (a no-op
  under O_DIRECT); plus demotion (host → NVMe) and promotion (NVMe → host) through the
  tier manager, in GB/s of the blocks each actually moved (the manager's move counters),
  the cache dropped before the promotion.
Then: eviction throughput (blocks/s, capacity-driven, through the tier manager),
bookkeeping bytes per cached block, the zstd+shuffle ratio on fp16 KV-like data, and the
daemon's garbage-collection pause (kvstore/gcpolicy.py): a catalogue of 64K cached blocks
(256K without ``--quick``) in one process with torch and the tier manager imported, a
quarter of it then replaced three times over (evicted and stored again: the turnover
after which CPython runs a full collection), each round ended by a full collection; the
longest pause of any collection (automatic ones included, timed by a gc callback) under
CPython's own policy against the same under the daemon's, in the same run
(``gc_longest_pause_vs_cpython``, target ≤ 0.2).
"""

from __future__ import annotations

import gc
import math
import mmap
import os
import shutil
import tempfile
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench.report import Report, best_in_turns, best_of, gbps, parse_args, timed
from kvstore.gcpolicy import GcPolicy
from kvstore.hashing import chain_hashes
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tier_kind import TierKind
from kvstore.tiers.base import BlockMeta, copy_bytes
from kvstore.tiers.host import HostTier, HostTierConfig
from kvstore.tiers.manager import TierManager, TierManagerConfig
from kvstore.tiers.memory import VirtualTier
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig

KiB, MiB = 1024, 1024 * 1024
BLOCK_SIZES = (256 * KiB, MiB, 4 * MiB)
BATCH = 64


def namespace_for(block_bytes: int) -> Namespace:
    layer_bytes = 2 * 16 * 8 * 128 * 2  # K and V, 16 tokens, 8 heads, head_dim 128, fp16
    layout = KVLayout(num_layers=block_bytes // layer_bytes, num_kv_heads=8, head_dim=128, block_size=16)
    assert layout.block_bytes == block_bytes
    return Namespace("bench-model", layout)


def blocks_of(tensor: torch.Tensor, block_bytes: int) -> list[torch.Tensor]:
    return list(tensor.view(-1, block_bytes).unbind(0))


def batches(items: list, size: int = BATCH):
    return [items[i : i + size] for i in range(0, len(items), size)]


# -- host tier ------------------------------------------------------------------------
def bench_host(block_bytes: int, total_bytes: int, repeats: int) -> dict:
    num_blocks = total_bytes // block_bytes
    src = torch.empty(total_bytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty(total_bytes, dtype=torch.uint8).fill_(0)
    srcs, dsts = blocks_of(src, block_bytes), blocks_of(dst, block_bytes)

    def copy_blocks(from_blocks, to_blocks):
        for a, b in zip(from_blocks, to_blocks):
            copy_bytes(b, a)

    one_copy = best_of(repeats, lambda: timed(lambda: copy_bytes(dst, src)))

    namespace = namespace_for(block_bytes)
    hashes = chain_hashes(np.arange(num_blocks * 16, dtype=np.int64), 16)
    page = max(64 * MiB, block_bytes)
    host = HostTier(
        HostTierConfig(
            capacity_bytes=math.ceil(total_bytes / page + 1) * page, name=f"kvstore-bench-{uuid.uuid4().hex[:8]}", page_bytes=page
        )
    )
    manager = TierManager(TierManagerConfig(high_watermark=1.0, low_watermark=0.9), [host])
    manager.register_namespace(namespace)
    digest = namespace.digest
    try:

        def put_all():
            manager.evict()
            start = time.perf_counter()
            for hash_batch, src_batch in zip(batches(hashes), batches(srcs)):
                manager.put(digest, hash_batch, src_batch)  # reserve → copy into the slots → commit
            return time.perf_counter() - start

        def get_all():
            start = time.perf_counter()
            for hash_batch, dst_batch in zip(batches(hashes), batches(dsts)):
                lease = manager.acquire(digest, hash_batch)
                for block, dst_block in zip(lease.blocks, dst_batch):
                    host.read(block.slot, dst_block, BlockMeta(digest, block.block_hash, None, block_bytes))
                manager.release(lease.id)
            return time.perf_counter() - start

        # the three passes take turns, so that a change in the machine's load mid-run weighs on all of them alike
        baseline, put, get = best_in_turns(repeats, [lambda: timed(lambda: copy_blocks(srcs, dsts)), put_all, get_all])
        assert torch.equal(dst, src), "the host tier returned different bytes"
    finally:
        manager.close()
    return {
        "tier": "host",
        "block_bytes": block_bytes,
        "baseline_gbps": gbps(total_bytes, baseline),
        "one_copy_gbps": gbps(total_bytes, one_copy),
        "put_gbps": gbps(total_bytes, put),
        "get_gbps": gbps(total_bytes, get),
    }


# -- NVMe tier ------------------------------------------------------------------------
def nvme_capacity(block_bytes: int, num_blocks: int, page_bytes: int) -> int:
    slots_per_page = (page_bytes - 4096) // (block_bytes + 4096)
    return (math.ceil(num_blocks / slots_per_page) + 1) * page_bytes


def raw_file_io(directory: Path, src: torch.Tensor, dst: torch.Tensor, block_bytes: int, tier: NvmeTier) -> tuple[float, float]:
    """The NVMe tier's I/O without the tier: one ``pwrite`` / ``preadv`` of each block's
    bytes at its own offset of one preallocated file, opened with the tier's flags (O_DIRECT
    where the tier uses it), submitted on a pool of the tier's ``io_threads`` as the tier
    submits its blocks, with the tier's sync policy (an ``fdatasync`` per block only with
    ``sync_writes``), and nothing read from the page cache (dropped before each read pass,
    as for the tier)."""
    path = directory / "raw-baseline.dat"
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if tier.uses_direct_io else 0)
    fd = os.open(path, flags, 0o600)
    src_view, dst_view = memoryview(src.numpy()), memoryview(dst.numpy())
    offsets = range(0, src.numel(), block_bytes)
    sync = tier.config.sync_writes

    def write_one(offset: int) -> None:
        os.pwrite(fd, src_view[offset : offset + block_bytes], offset)
        if sync:
            os.fdatasync(fd)

    def read_one(offset: int) -> None:
        os.preadv(fd, [dst_view[offset : offset + block_bytes]], offset)

    pool = ThreadPoolExecutor(tier.config.io_threads)
    try:
        os.posix_fallocate(fd, 0, src.numel())
        write = best_of(2, lambda: timed(lambda: list(pool.map(write_one, offsets))))

        def read() -> float:
            drop_page_cache([path])
            return timed(lambda: list(pool.map(read_one, offsets)))

        return write, best_of(2, read)
    finally:
        pool.shutdown()
        os.close(fd)
        path.unlink()


def drop_page_cache(paths) -> None:
    """Write back and drop the cached pages of ``paths`` (a no-op for O_DIRECT files,
    which have none), so that the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_aligned(nbytes: int) -> torch.Tensor:
    """A page-aligned buffer, as host-tier slots are (O_DIRECT needs aligned memory)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def bench_nvme(directory: Path, block_bytes: int, total_bytes: int) -> dict:
    num_blocks = total_bytes // block_bytes
    src = page_aligned(total_bytes)
    src.copy_(torch.randint(0, 256, (total_bytes,), dtype=torch.uint8))
    dst = page_aligned(total_bytes)
    page = max(64 * MiB, 2 * (block_bytes + 4096))
    config = NvmeTierConfig(
        directory=directory / "nvme", capacity_bytes=nvme_capacity(block_bytes, num_blocks, page), page_bytes=page, file_bytes=16 * page
    )
    tier = NvmeTier(config)
    raw_write, raw_read = raw_file_io(directory, src, dst, block_bytes, tier)
    namespace = namespace_for(block_bytes)
    hashes = chain_hashes(np.arange(num_blocks * 16, dtype=np.int64), 16)
    metas = [BlockMeta(namespace.digest, h, None, block_bytes) for h in hashes]
    srcs, dsts = blocks_of(src, block_bytes), blocks_of(dst, block_bytes)
    slots: list = []

    def put_all() -> float:
        # best of two passes, as for the raw baseline: the second pass overwrites the slots
        # the first one wrote (freed in reverse, the slab hands back the same pages in the
        # same order), the steady state of a cache that has filled once; the first write
        # into a preallocated but never written extent costs ~50% more on ext4
        for slot in reversed(slots):
            tier.free(slot)
        slots[:] = [tier.allocate(block_bytes) for _ in range(num_blocks)]
        assert all(slots), "the NVMe tier was sized too small for the benchmark"
        return timed(lambda: [f.result() for f in [tier.submit_write(s, b, m) for s, b, m in zip(slots, srcs, metas)]])

    def get_all() -> float:
        drop_page_cache(sorted(config.directory.glob("*.dat")))
        return timed(lambda: [f.result() for f in [tier.submit_read(s, b, m) for s, b, m in zip(slots, dsts, metas)]])

    try:
        put = best_of(2, put_all)
        dst.zero_()
        get = best_of(2, get_all)
        assert torch.equal(dst, src), "the NVMe tier returned different bytes"
        mode = "O_DIRECT" if tier.uses_direct_io else "buffered"
    finally:
        tier.close()
        shutil.rmtree(config.directory)
    moves = bench_moves(directory, namespace, hashes, srcs, block_bytes)
    return {
        "tier": "nvme",
        "block_bytes": block_bytes,
        "io_mode": mode,
        "raw_write_gbps": gbps(total_bytes, raw_write),
        "raw_read_gbps": gbps(total_bytes, raw_read),
        "put_gbps": gbps(total_bytes, put),
        "get_gbps": gbps(total_bytes, get),
        **moves,
    }


def bench_moves(directory: Path, namespace: Namespace, hashes, srcs, block_bytes: int) -> dict:
    """Demotion and promotion of every block through the tier manager."""
    total_bytes = len(srcs) * block_bytes
    page = max(64 * MiB, 2 * (block_bytes + 4096))
    host = HostTier(
        HostTierConfig(
            capacity_bytes=(math.ceil(total_bytes / page) + 1) * page, name=f"kvstore-bench-{uuid.uuid4().hex[:8]}", page_bytes=page
        )
    )
    nvme_config = NvmeTierConfig(
        directory=directory / "moves", capacity_bytes=nvme_capacity(block_bytes, len(srcs), page), page_bytes=page, file_bytes=16 * page
    )
    nvme = NvmeTier(nvme_config)
    config = TierManagerConfig(high_watermark=0.02, low_watermark=0.01, demote_on_commit=False)
    manager = TierManager(config, [host, nvme])
    manager.register_namespace(namespace)
    counters = manager.counters
    try:
        for hash_batch, src_batch in zip(batches(hashes), batches(srcs)):
            manager.put(namespace.digest, hash_batch, src_batch)
        demote = timed(manager.relieve_pressure)
        num_demoted = counters["demoted_host_to_nvme"]
        drop_page_cache(sorted(nvme_config.directory.glob("*.dat")))
        promote = timed(lambda: manager.acquire(namespace.digest, hashes, tier=TierKind.HOST))
        num_promoted = counters["promoted_nvme_to_host"]
        assert manager.lookup(namespace.digest, hashes) == [TierKind.HOST] * len(hashes)
        assert num_promoted == num_demoted > 0
    finally:
        manager.close()
        shutil.rmtree(nvme_config.directory)
    # from the blocks each direction moved: the few that stay in the host tier (under its low watermark) are not counted
    return {
        "demoted_bytes": num_demoted * block_bytes,
        "demote_gbps": gbps(num_demoted * block_bytes, demote),
        "promote_gbps": gbps(num_promoted * block_bytes, promote),
    }


# -- bookkeeping ----------------------------------------------------------------------
def bench_eviction(num_blocks: int) -> dict:
    """Capacity-driven eviction: every put into a full tier evicts one leaf."""
    namespace = namespace_for(256 * KiB)
    host = VirtualTier(TierKind.HOST, num_blocks * 256 * KiB, 64 * MiB)
    manager = TierManager(TierManagerConfig(high_watermark=1.0, low_watermark=0.9), [host])
    manager.register_namespace(namespace)
    digest = namespace.digest
    chains = [chain_hashes(np.arange(64 * 16) + 100_000 * c, 16) for c in range(2 * num_blocks // 64)]
    for hashes in chains[: len(chains) // 2]:
        manager.commit(manager.reserve(digest, hashes).id)
    before = manager.counters["evicted_capacity"]
    seconds = timed(lambda: [manager.commit(manager.reserve(digest, hashes).id) for hashes in chains[len(chains) // 2 :]])
    evicted = manager.counters["evicted_capacity"] - before
    return {"evictions": evicted, "evictions_per_s": evicted / seconds}


def bench_overhead(num_blocks: int) -> dict:
    namespace = namespace_for(256 * KiB)
    tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    host = VirtualTier(TierKind.HOST, num_blocks * 256 * KiB, 64 * MiB)
    manager = TierManager(TierManagerConfig(high_watermark=1.0, low_watermark=0.9), [host])
    manager.register_namespace(namespace)
    for c in range(num_blocks // 64):
        manager.commit(manager.reserve(namespace.digest, chain_hashes(np.arange(64 * 16) + 100_000 * c, 16)).id)
    manager.events.drain()
    end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"blocks": len(manager.catalogue), "bytes_per_block": (end - start) / len(manager.catalogue)}


def bench_gc(num_blocks: int) -> dict:
    """The longest collection pause while a quarter of the catalogue turns over and in the
    full collection that follows, without and with the daemon's policy: the same blocks,
    the same turnover, every collection (automatic ones included) timed by a gc callback."""
    namespace = namespace_for(256 * KiB)
    host = VirtualTier(TierKind.HOST, num_blocks * 256 * KiB, 64 * MiB)
    manager = TierManager(TierManagerConfig(high_watermark=1.0, low_watermark=0.9), [host])
    manager.register_namespace(namespace)
    chains = [chain_hashes(np.arange(64 * 16) + 100_000 * c, 16) for c in range(num_blocks // 64)]
    fresh = [chain_hashes(np.arange(64 * 16) + 100_000 * c + 7, 16) for c in range(len(chains) // 4)]
    for hashes in chains:
        manager.commit(manager.reserve(namespace.digest, hashes).id)
    manager.events.drain()
    rounds = [0]

    def longest_pause(freeze: bool) -> float:
        pauses: list[float] = []
        policy = GcPolicy(0, lambda generation, seconds: pauses.append(seconds), freeze=freeze)
        policy.install()
        try:
            for _ in range(3):
                old, new = (chains, fresh) if rounds[0] % 2 == 0 else (fresh, chains)
                rounds[0] += 1
                for retired, stored in zip(old[: len(fresh)], new):
                    manager.evict(namespace.digest, retired)
                    manager.commit(manager.reserve(namespace.digest, stored).id)
                manager.events.drain()
                gc.collect(2)
        finally:
            policy.uninstall()
        return max(pauses)

    gc.collect()
    cpython = longest_pause(freeze=False)
    bounded = longest_pause(freeze=True)
    return {"gc_blocks": len(manager.catalogue), "gc_longest_pause_cpython_s": cpython, "gc_longest_pause_policy_s": bounded}


def bench_compression(directory: Path, num_blocks: int) -> dict:
    block_bytes = MiB
    # KV-like values: normally distributed fp16, as attention keys and values are
    data = torch.randn(num_blocks * block_bytes // 2, generator=torch.Generator().manual_seed(0)).half().view(torch.uint8)
    config = NvmeTierConfig(
        directory=directory / "zstd", capacity_bytes=nvme_capacity(block_bytes, num_blocks, 64 * MiB), compression="zstd"
    )
    tier = NvmeTier(config)
    namespace = namespace_for(block_bytes)
    hashes = chain_hashes(np.arange(num_blocks * 16, dtype=np.int64), 16)
    try:
        srcs = blocks_of(data, block_bytes)
        metas = [BlockMeta(namespace.digest, h, None, block_bytes) for h in hashes]
        slots = [tier.allocate(block_bytes) for _ in srcs]
        seconds = timed(lambda: [f.result() for f in [tier.submit_write(s, b, m) for s, b, m in zip(slots, srcs, metas)]])
        out = torch.empty(block_bytes, dtype=torch.uint8)
        tier.read(slots[0], out, metas[0])
        assert torch.equal(out, srcs[0])
        ratio = tier.bytes_in / tier.bytes_stored
    finally:
        tier.close()
        shutil.rmtree(config.directory)
    return {"zstd_ratio": ratio, "zstd_put_gbps": gbps(num_blocks * block_bytes, seconds)}


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: p.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where NVMe files go (a real disk, not tmpfs)"),
    )
    torch.set_num_threads(1)
    total = (64 if args.quick else 512) * MiB
    repeats = 2 if args.quick else 3
    report = Report("tiers")
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir))
    try:
        host_rows, nvme_rows = [], []
        for block_bytes in BLOCK_SIZES:
            host = bench_host(block_bytes, total, repeats + 3 if args.quick else repeats + 4)
            nvme = bench_nvme(scratch, block_bytes, total)
            report.results += [host, nvme]
            label = f"{block_bytes // KiB}KiB"
            report.compare(f"host_put_vs_memcpy_{label}", host["put_gbps"], host["baseline_gbps"], "GB/s", ">= 0.8")
            report.compare(f"host_get_vs_memcpy_{label}", host["get_gbps"], host["baseline_gbps"], "GB/s", ">= 0.8")
            report.compare(f"nvme_put_vs_raw_{label}", nvme["put_gbps"], nvme["raw_write_gbps"], "GB/s", ">= 0.7")
            report.compare(f"nvme_get_vs_raw_{label}", nvme["get_gbps"], nvme["raw_read_gbps"], "GB/s", ">= 0.7")
            host_rows.append(
                [
                    label,
                    host["baseline_gbps"],
                    host["one_copy_gbps"],
                    host["put_gbps"],
                    host["get_gbps"],
                    host["put_gbps"] / host["baseline_gbps"],
                    host["get_gbps"] / host["baseline_gbps"],
                ]
            )
            nvme_rows.append(
                [
                    label,
                    nvme["io_mode"],
                    nvme["raw_write_gbps"],
                    nvme["put_gbps"],
                    nvme["raw_read_gbps"],
                    nvme["get_gbps"],
                    nvme["put_gbps"] / nvme["raw_write_gbps"],
                    nvme["get_gbps"] / nvme["raw_read_gbps"],
                    nvme["demote_gbps"],
                    nvme["promote_gbps"],
                ]
            )
        report.print_table(
            f"host tier (GB/s, {total // MiB} MiB per size; baseline: single-thread memcpy of the same blocks between private tensors; "
            "put adds each block's XXH3-64, taken on a helper thread beside the copy, and the bookkeeping)",
            ["block", "memcpy", "1 copy", "put", "get", "put/memcpy", "get/memcpy"],
            host_rows,
        )
        report.print_table(
            "NVMe tier (GB/s; baseline: raw pwrite / preadv of the same blocks, one call each, with the tier's flags, "
            "I/O threads and sync policy, page cache dropped before reads on both sides; demote / promote: bytes moved)",
            ["block", "mode", "raw wr", "put", "raw rd", "get", "put/raw", "get/raw", "demote", "promote"],
            nvme_rows,
        )
        eviction = bench_eviction(8_192 if args.quick else 65_536)
        overhead = bench_overhead(16_384 if args.quick else 131_072)
        compression = bench_compression(scratch, 16 if args.quick else 64)
        collection = bench_gc(65_536 if args.quick else 262_144)
        report.results += [eviction, overhead, compression, collection]
        report.compare(
            "gc_longest_pause_vs_cpython",
            collection["gc_longest_pause_policy_s"] * 1e3,
            collection["gc_longest_pause_cpython_s"] * 1e3,
            "ms",
            "<= 0.2",
        )
        report.ratio("evictions_per_s", eviction["evictions_per_s"])
        report.ratio("bookkeeping_bytes_per_block", overhead["bytes_per_block"])
        report.ratio("zstd_ratio_fp16", compression["zstd_ratio"])
        report.print_table(
            "bookkeeping",
            ["evictions/s", "bytes per cached block", "zstd+shuffle ratio (fp16 randn)", "zstd put GB/s"],
            [[eviction["evictions_per_s"], overhead["bytes_per_block"], compression["zstd_ratio"], compression["zstd_put_gbps"]]],
        )
        report.print_table(
            f"longest garbage-collection pause while a quarter of {collection['gc_blocks']} cached blocks turns over (ms)",
            ["CPython's policy", "the daemon's (kvstore/gcpolicy.py)", "daemon/CPython"],
            [
                [
                    collection["gc_longest_pause_cpython_s"] * 1e3,
                    collection["gc_longest_pause_policy_s"] * 1e3,
                    collection["gc_longest_pause_policy_s"] / collection["gc_longest_pause_cpython_s"],
                ]
            ],
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report.emit(args.json)


if __name__ == "__main__":
    main()
