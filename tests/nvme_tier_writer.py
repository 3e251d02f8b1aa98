"""A process for tests/test_nvme_tier.py to SIGKILL in the middle of NVMe tier writes.

    python tests/nvme_tier_writer.py DIRECTORY [CALL COUNT]

Writes blocks 0, 1, 2, … whose bytes derive from their index, and every fifth block
frees the block written two before it, so later writes reuse freed slots. A line is
printed (and flushed) only after the call returned: ``w <index>`` once a block is
committed, ``f <index>`` once it is freed. The test imports ``config``, ``block`` and
``block_hash`` from this file (with runpy) to check what a restart recovers.

With ``CALL COUNT`` (``fdatasync 40``, ``pwritev 101``) the process instead dies on its
own, with exit status CRASH_EXIT_STATUS and no cleanup, just before the COUNT-th call of
``os.CALL``: a crash placed exactly between two steps of the tier's write order.
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


def config(directory: Path) -> NvmeTierConfig:
    return NvmeTierConfig(Path(directory), capacity_bytes=64 << 20, page_bytes=4 << 20, file_bytes=16 << 20)


def block_hash(index: int) -> bytes:
    return xxhash.xxh3_128_digest(index.to_bytes(8, "little"))


def block(index: int) -> tuple[BlockMeta, torch.Tensor]:
    nbytes = SIZES[index % len(SIZES)]
    data = np.random.default_rng(index).integers(0, 256, nbytes, dtype=np.uint8)
    parent = block_hash(index - 1) if index else None
    return BlockMeta(NAMESPACE, block_hash(index), parent, nbytes), torch.from_numpy(data)


def crash_before_call(name: str, count: int) -> None:
    real_call = getattr(os, name)
    num_calls = 0

    def call(*args):
        nonlocal num_calls
        num_calls += 1
        if num_calls == count:
            os._exit(CRASH_EXIT_STATUS)
        return real_call(*args)

    setattr(os, name, call)


def main(directory: Path) -> None:
    tier = NvmeTier(config(directory))
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
            print(f"f {index - 2}", flush=True)
    print("full", flush=True)
    time.sleep(600)  # stay alive: the test means to kill a live process


if __name__ == "__main__":
    if len(sys.argv) == 4:
        crash_before_call(sys.argv[2], int(sys.argv[3]))
    main(Path(sys.argv[1]))
