"""A process for tests/test_nvme_tier.py to SIGKILL in the middle of NVMe tier writes.

    python tests/nvme_tier_writer.py DIRECTORY sync|nosync [CRASH]

Writes blocks 0, 1, 2, … whose bytes derive from their index, with ``sync_writes`` on or
off, and every fifth block frees the block written two before it, so later writes reuse
freed slots. A line is printed (and flushed) only after the call returned: ``w <index>``
once a block is committed, ``f <index>`` once it is freed. The test imports ``config``,
``block`` and ``block_hash`` from this file (with runpy) to check what a restart recovers.

With CRASH the process instead dies on its own, with exit status CRASH_EXIT_STATUS and no
cleanup, at a chosen point of the tier's write order:

- ``before CALL COUNT`` (``before fdatasync 40``): just before the COUNT-th call of
  ``os.CALL``, a crash placed exactly between two steps;
- ``cut COUNT KEEP`` (``cut 30 half``): in the COUNT-th block write (a ``pwritev`` of more
  than 4 KiB: page headers and cleared trailers are 4 KiB), after it wrote only a prefix of
  its bytes: the first half (``half``) or all but the last 4 KiB (``all-but-last-4k``), as
  a kill that cuts a buffered write short would leave.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvstore.tiers.base import BlockMeta
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig

NAMESPACE = bytes(range(16))
SIZES = (40_000, 131_072, 200_000)
MAX_BLOCKS = 5_000
CRASH_EXIT_STATUS = 86
UNIT = 4096


def config(directory: Path, sync_writes: bool = False) -> NvmeTierConfig:
    return NvmeTierConfig(Path(directory), capacity_bytes=64 << 20, page_bytes=4 << 20, file_bytes=16 << 20, sync_writes=sync_writes)


def block_hash(index: int) -> bytes:
    return xxhash.xxh3_128_digest(index.to_bytes(8, "little"))


def block(index: int) -> tuple[BlockMeta, torch.Tensor]:
    nbytes = SIZES[index % len(SIZES)]
    data = np.random.default_rng(index).integers(0, 256, nbytes, dtype=np.uint8)
    parent = block_hash(index - 1) if index else None
    return BlockMeta(NAMESPACE, block_hash(index), parent, nbytes), torch.from_numpy(data)


def prefix(buffers: list, nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` of ``buffers``, as iovecs."""
    views = []
    for buffer in buffers:
        view = memoryview(buffer)[:nbytes]
        if len(view):
            views.append(view)
        nbytes -= len(view)
    return views


def die_before_call(name: str, count: int) -> None:
    real_call = getattr(os, name)
    num_calls = 0

    def call(*args):
        nonlocal num_calls
        num_calls += 1
        if num_calls == count:
            os._exit(CRASH_EXIT_STATUS)
        return real_call(*args)

    setattr(os, name, call)


def die_in_block_write(count: int, keep: str) -> None:
    real_pwritev = os.pwritev
    num_block_writes = 0

    def pwritev(fd, buffers, offset):
        nonlocal num_block_writes
        total = sum(len(buffer) for buffer in buffers)
        if total > UNIT:
            num_block_writes += 1
        if total <= UNIT or num_block_writes != count:
            return real_pwritev(fd, buffers, offset)
        # whole 4 KiB units, which O_DIRECT takes
        kept = total // 2 // UNIT * UNIT if keep == "half" else total - UNIT
        real_pwritev(fd, prefix(buffers, kept), offset)
        os._exit(CRASH_EXIT_STATUS)

    os.pwritev = pwritev


def main(directory: Path, sync_writes: bool) -> None:
    tier = NvmeTier(config(directory, sync_writes))
    slots = {}
    for index in range(MAX_BLOCKS):
        meta, data = block(index)
        slot = tier.allocate(meta.nbytes)
        if slot is None:
            break
        tier.write(slot, data, meta)
        slots[index] = slot
        print(f"w {index}", flush=True)
        if index % 5 == 4:
            tier.free(slots.pop(index - 2))
            tier.wait_freed()  # the trailer is zeroed in the I/O pool; a kill before that may bring the block back, intact
            print(f"f {index - 2}", flush=True)
    print("full", flush=True)
    time.sleep(600)  # stay alive: the test means to kill a live process


if __name__ == "__main__":
    crash = sys.argv[3:]
    if crash[:1] == ["before"]:
        die_before_call(crash[1], int(crash[2]))
    elif crash[:1] == ["cut"]:
        die_in_block_write(int(crash[1]), crash[2])
    main(Path(sys.argv[1]), sys.argv[2] == "sync")
