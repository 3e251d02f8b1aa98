"""The `Tier` interface: a place that holds block bytes in fixed-size slots.

A tier knows nothing about keys, prefixes or eviction (that is the tier manager's job);
it hands out slots, moves bytes in and out of them, and reports how full it is.

    Tier
    ├── MemoryTier (tiers/memory.py)   slots over a byte tensor; `view()` is zero-copy
    │   └── HostTier (tiers/host.py)    a shared-memory file other processes map by name
    ├── NvmeTier  (tiers/nvme.py)       preallocated slot files with verified headers
    └── VirtualTier (tiers/memory.py)   capacity accounting only, for the routing simulator
"""

from __future__ import annotations

import abc
import ctypes
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xxhash

from kvstore.errors import InvalidArgument
from kvstore.hashing import BlockHash
from kvstore.tier_kind import TierKind
from kvstore.tiers.slab import Slot

__all__ = [
    "BlockMeta",
    "Tier",
    "TierStats",
    "block_checksum",
    "copy_all",
    "copy_checksummed",
    "copy_all_checksummed",
    "checksums_beside",
    "byte_view",
    "copy_bytes",
]

CHECKSUM_CHUNK_BYTES = 256 * 1024  # copy-and-hash granule: a chunk is still in cache (L2) when it is hashed
# from here a batch is hashed on the helper thread beside its copy, or half of it copied there
HELPER_BATCH_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a tier may record next to a block's bytes (the NVMe tier writes it in the slot
    header so that its catalogue survives a restart)."""

    namespace: bytes
    block_hash: BlockHash
    parent_hash: BlockHash | None
    nbytes: int
    # XXH3-64 of the bytes as their writer committed them, where known: a tier that writes
    # a copy (NVMe, on demotion) checks it and refuses bytes that changed since (CorruptBlock)
    checksum: int | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class TierStats:
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    num_blocks: int

    @property
    def occupancy(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


class Tier(abc.ABC):
    kind: TierKind
    # False only for VirtualTier, which accounts capacity without storing bytes
    holds_bytes: bool = True

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> Slot | None:
        """A free slot that holds ``nbytes``, or None when the tier is full."""

    def allocate_many(self, nbytes: int, count: int) -> list[Slot]:
        """Up to ``count`` free slots that hold ``nbytes`` each; fewer when the tier fills."""
        slots: list[Slot] = []
        while len(slots) < count and (slot := self.allocate(nbytes)) is not None:
            slots.append(slot)
        return slots

    @abc.abstractmethod
    def free(self, slot: Slot) -> None:
        """Return a slot; its bytes are no longer valid."""

    @abc.abstractmethod
    def write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> None:
        """Copy ``src`` (a flat uint8 tensor of ``meta.nbytes`` bytes) into ``slot``."""

    @abc.abstractmethod
    def read(self, slot: Slot, dst: torch.Tensor, meta: BlockMeta) -> None:
        """Copy the block in ``slot`` into ``dst`` (flat uint8, ``meta.nbytes`` long).
        Raises CorruptBlock when the stored bytes fail verification."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """Capacity and occupancy right now."""

    def submit_write(self, slot: Slot, src: torch.Tensor, meta: BlockMeta) -> Future[None]:
        """`write`, possibly in the background. Memory tiers finish before returning;
        the NVMe tier runs it in its I/O thread pool so that many writes overlap."""
        return _run_now(self.write, slot, src, meta)

    def submit_read(self, slot: Slot, dst: torch.Tensor, meta: BlockMeta) -> Future[None]:
        """`read`, possibly in the background (see `submit_write`)."""
        return _run_now(self.read, slot, dst, meta)

    def close(self) -> None:  # noqa: B027 (optional: most tiers hold nothing to release)
        """Release OS resources; the default holds none."""


def _run_now(operation, slot: Slot, tensor: torch.Tensor, meta: BlockMeta) -> Future[None]:
    future: Future[None] = Future()
    try:
        operation(slot, tensor, meta)
    except BaseException as exc:  # handed to whoever waits on the future, as an executor would
        future.set_exception(exc)
    else:
        future.set_result(None)
    return future


def block_checksum(data: torch.Tensor) -> int:
    """XXH3-64 of a flat uint8 CPU tensor's bytes: what a block's writer commits, and what
    every copy of it is checked against (the NVMe tier and the transport use the same)."""
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()))


def copy_checksummed(dst_address: int, landed: memoryview, src_address: int) -> int:
    """Copy ``len(landed)`` bytes from ``src_address`` to ``dst_address`` (``landed`` is a
    view of the destination) and return their XXH3-64, each cache-sized chunk hashed right
    after its copy, while it is still in cache: ~0.2 of a copy's time on top of it, against
    ~0.6 for a second pass over memory, and on the caller's thread (a helper thread gains
    only where a core is free)."""
    nbytes = len(landed)
    if nbytes <= CHECKSUM_CHUNK_BYTES:
        ctypes.memmove(dst_address, src_address, nbytes)
        return xxhash.xxh3_64_intdigest(landed)
    state = xxhash.xxh3_64()
    for offset in range(0, nbytes, CHECKSUM_CHUNK_BYTES):
        end = min(offset + CHECKSUM_CHUNK_BYTES, nbytes)
        ctypes.memmove(dst_address + offset, src_address + offset, end - offset)
        state.update(landed[offset:end])
    return state.intdigest()


def copy_all_checksummed(destinations: Sequence[int], sources: Sequence[torch.Tensor]) -> list[int]:
    """Copy each host-memory source (a flat uint8 tensor) to its destination address and
    return the XXH3-64 of each block, each cache-sized chunk hashed right after its copy
    (`copy_checksummed`).

    A batch of ``HELPER_BATCH_BYTES`` or more, on a host with a CPU idle now
    (``spare_cpu_now``), is cut in two runs of whole blocks of about equal bytes, the first copied and
    hashed on the helper thread while this one does the second (``ctypes.memmove`` and
    xxhash release the GIL): 0.99-1.24x a single-thread memcpy of the same blocks on this
    2-core host (256 KiB, 1 and 4 MiB blocks, 512 MiB), against 0.86-0.96x for the helper
    hashing every source while this thread copied them all (both threads then read the
    sources from memory). A smaller batch, or one on a busy host, is copied here. A checksum of the
    source that the destination does not match (a source changed under the copy) is
    caught wherever the block is verified: a miss, never data."""
    spans = [(destination, source.data_ptr(), source.numel()) for destination, source in zip(destinations, sources)]
    total = sum(nbytes for _, _, nbytes in spans)
    if total < HELPER_BATCH_BYTES or not spare_cpu_now():
        return _copy_each_checksummed(spans)
    half, taken = 0, 0
    while half < len(spans) - 1 and taken + spans[half][2] <= total // 2:
        taken += spans[half][2]
        half += 1
    helping = _helper().submit(_copy_each_checksummed, spans[:half])
    try:
        second = _copy_each_checksummed(spans[half:])
    finally:
        first = helping.result()  # the caller may reuse or release every byte once this returns
    return first + second


def _copy_each_checksummed(spans: Sequence[tuple[int, int, int]]) -> list[int]:
    return [copy_checksummed(destination, bytes_at(destination, nbytes), source) for destination, source, nbytes in spans]


def copy_all(copies: Sequence[tuple[int, int, int]]) -> None:
    """``memmove`` each ``(destination, source, nbytes)`` of host memory.

    A batch of ``HELPER_BATCH_BYTES`` or more, on a host with a CPU idle now
    (``spare_cpu_now``), is cut in two halves of equal bytes (a block may be cut in two) and the first is
    copied on the helper thread while this one copies the second (``ctypes.memmove``
    releases the GIL): one thread alone moves 9.5-10 GB/s on this 2-core host, two
    11-14 GB/s (1 MiB blocks, 128 MiB). A smaller batch, or one on a busy host, is copied here."""
    total = sum(nbytes for _, _, nbytes in copies)
    if total < HELPER_BATCH_BYTES or not spare_cpu_now():
        _copy_each(copies)
        return
    first, second, taken = [], [], 0
    for destination, source, nbytes in copies:
        share = min(nbytes, max(0, total // 2 - taken))
        if share:
            first.append((destination, source, share))
            taken += share
        if share < nbytes:
            second.append((destination + share, source + share, nbytes - share))
    helping = _helper().submit(_copy_each, first)
    try:
        _copy_each(second)
    finally:
        helping.result()  # the caller may reuse or release every byte once this returns


def _copy_each(copies: Sequence[tuple[int, int, int]]) -> None:
    for destination, source, nbytes in copies:
        ctypes.memmove(destination, source, nbytes)


def bytes_at(address: int, nbytes: int) -> memoryview:
    """A view of ``nbytes`` of host memory at ``address`` (~0.3 µs; a tensor's ``numpy()``
    view costs ~1 µs). The caller keeps the memory alive while the view is used."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address))


def has_spare_core() -> bool:
    """Whether this process may run on two CPUs or more: where it may not, polling or a
    helper thread would only take the CPU from the work it waits on."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) > 1


_SPARE_CORE = has_spare_core()
_IDLE_SAMPLE_S = 0.25  # how often the host's idle time is read again
_IDLE_CPUS_TO_SPARE = 0.5  # idle CPUs (on average over the last sample) that make one spare


class _IdleCpus:
    """How many CPUs the host left idle lately, from the first line of ``/proc/stat`` (the
    kernel's time accounting over every CPU), read again at most every ``_IDLE_SAMPLE_S``.

    Polling for an answer, or splitting a copy onto a helper thread, pays only where a CPU
    would otherwise idle. Where every CPU is busy — vLLM's CPU engines bind an OpenMP
    thread to each core and spin between steps — the poll or the helper takes a core from
    the very work it waits on: an OpenMP team with one thread preempted stalls at its next
    barrier, so the engine's step slows by far more than the CPU time taken. Races between
    threads only ever read one sample or the next, both true of the recent past."""

    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self._stat_path = stat_path
        self._last: tuple[float, int, int] | None = None  # (when, idle ticks, all ticks)
        self._spare = _SPARE_CORE

    def spare(self) -> bool:
        if not _SPARE_CORE:
            return False
        now = time.monotonic()
        last = self._last
        if last is not None and now - last[0] < _IDLE_SAMPLE_S:
            return self._spare
        try:
            with open(self._stat_path, "rb") as stat:
                fields = [int(value) for value in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return self._spare  # not Linux: the affinity alone says
        idle, total = fields[3] + fields[4], sum(fields[:8])  # idle + iowait, over user … steal
        if last is not None and total > last[2]:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            self._spare = (idle - last[1]) / (total - last[2]) * cpus >= _IDLE_CPUS_TO_SPARE
        self._last = (now, idle, total)
        return self._spare


_IDLE_CPUS = _IdleCpus()


def spare_cpu_now() -> bool:
    """Whether a CPU of this host is idle now (over the last quarter second or so), so that
    a poll or a helper thread runs on it rather than in the way of the work it serves."""
    return _IDLE_CPUS.spare()


def checksums_beside(buffers: Sequence[memoryview]) -> Future[list[int]]:
    """The XXH3-64 of each buffer, taken on a helper thread while the caller goes on (xxhash
    releases the GIL: a copy of the same bytes on this thread runs beside it, on a host
    with a core to spare, at almost no cost). The caller keeps the buffers unchanged and
    alive until the future is done."""
    return _helper().submit(_checksums_of, list(buffers))


def _helper() -> ThreadPoolExecutor:
    """The process's helper thread: checksums and half-batches of copies beside the caller."""
    global _HELPER
    with _HELPER_LOCK:
        if _HELPER is None:
            _HELPER = ThreadPoolExecutor(1, thread_name_prefix="kvstore-helper")
    return _HELPER


def _checksums_of(buffers: list[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(buffer) for buffer in buffers]


_HELPER: ThreadPoolExecutor | None = None
_HELPER_LOCK = threading.Lock()


def _forget_helper_in_child() -> None:
    """A forked child has no helper thread (only the parent's executor, whose queue no one
    would serve): it starts its own on first use."""
    global _HELPER, _HELPER_LOCK
    _HELPER, _HELPER_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_helper_in_child)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor of any dtype as a flat uint8 view (no copy)."""
    if not tensor.is_contiguous():
        raise InvalidArgument("block tensors must be contiguous; call .contiguous() first.")
    if tensor.dtype is torch.uint8 and tensor.dim() == 1:
        return tensor  # already one: a reshape costs ~1 µs, paid per block on the save path
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy equal-sized flat uint8 tensors. Between CPU tensors this is one libc memmove:
    measured ~20% faster than ``Tensor.copy_`` for 256 KiB blocks on one core, whose
    dispatch costs a few microseconds per call."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src, non_blocking=True)
