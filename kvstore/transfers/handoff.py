"""Prefill → decode handoff: one request's blocks, streamed layer by layer.

The producer's engine writes layer i of every block into staging slots and says so
(``layers_ready``); its daemon sends those layer slices to the consumer's daemon while the
engine computes layer i+1. The consumer's daemon receives them into its own staging
slots, verifies each frame, and raises its *ready layer* mark, which the consumer's
engine waits on before it runs layer i. When every layer has arrived, both daemons also
store the blocks in their tiers (the prefix is reusable on both nodes afterwards).

A handoff is addressed by a transfer id (the engine's request id, carried by the
router from the prefill request to the decode request). It completes, fails (peer gone,
bad frame), is cancelled by either engine, or times out; in every case both sides free
their staging slots and the channel.

    OutgoingHandoff   producer side: staging slots + the sender task
    IncomingHandoff   consumer side: staging slots + per-block layer progress

Owner: the daemon's event loop (kvstore/transfers/service.py creates and drives both).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence

import torch

from kvstore.errors import CorruptBlock, TransferFailed
from kvstore.hashing import BlockHash
from kvstore.layout import KVLayout
from kvstore.tiers.slab import Slot
from kvstore.transport.base import Channel
from kvstore.transport.peer import buffer_of
from kvstore.transport.wire import FrameHeader

__all__ = ["HandoffState", "OutgoingHandoff", "IncomingHandoff"]


class HandoffState(enum.Enum):
    OPEN = "open"
    COMPLETE = "complete"
    FAILED = "failed"


class _Handoff:
    def __init__(
        self,
        transfer_id: str,
        wire_id: int,
        digest: bytes,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        layout: KVLayout,
        slots: list[Slot],
        views: list[torch.Tensor],
        deadline: float,
    ) -> None:
        self.transfer_id = transfer_id
        self.wire_id = wire_id
        self.digest = digest
        self.hashes = list(hashes)
        self.parent = parent
        self.layout = layout
        self.slots = slots
        self.views = views
        self.deadline = deadline
        self.state = HandoffState.OPEN
        self.error = ""
        self.changed = asyncio.Event()  # set (and replaced) on every progress or state change
        # the channel its layers travel on while it may still touch the staging slots
        self.channel: Channel | None = None

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def fail(self, reason: str) -> None:
        if self.state is HandoffState.OPEN:
            self.state, self.error = HandoffState.FAILED, reason
            self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def raise_if_failed(self) -> None:
        if self.state is HandoffState.FAILED:
            raise TransferFailed(f"handoff {self.transfer_id!r} failed: {self.error}")


class OutgoingHandoff(_Handoff):
    """Producer side. ``ready`` queues layer ranges for the sender task, in order."""

    def __init__(self, *args, destination: str) -> None:
        super().__init__(*args)
        self.destination = destination
        self.layers_ready = 0  # layers the engine has written
        self.layers_sent = 0
        self.pending: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.num_stored_remote = 0

    def mark_ready(self, first_layer: int, num_layers: int) -> None:
        """The engine finished layers [first, first+n); they must follow what came before."""
        if first_layer != self.layers_ready or num_layers <= 0 or first_layer + num_layers > self.num_layers:
            raise TransferFailed(
                f"handoff {self.transfer_id!r}: layers must be handed over in order; expected layer {self.layers_ready} "
                f"next, got [{first_layer}, {first_layer + num_layers}) of {self.num_layers}."
            )
        self.layers_ready += num_layers
        self.pending.put_nowait((first_layer, num_layers))

    def layer_payloads(self, first_layer: int, num_layers: int) -> list[tuple[int, bytes, memoryview, None]]:
        """The layer range of every block, to send; checksummed as they go out (the engine
        wrote them just now)."""
        offset, length = self.layout.layers_slice(first_layer, first_layer + num_layers)
        return [(seq, h, buffer_of(view[offset : offset + length]), None) for seq, (h, view) in enumerate(zip(self.hashes, self.views))]

    def complete(self, num_stored: int) -> None:
        self.state = HandoffState.COMPLETE
        self.num_stored_remote = num_stored
        self._notify()


class IncomingHandoff(_Handoff):
    """Consumer side: which layers of which block have arrived verified."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.next_layer = [0] * len(self.hashes)  # per block: layers [0, n) arrived
        self.ready_layers = 0  # min over blocks: what a reader may use
        self.attached = False  # a consumer engine holds the staging views
        self.reader_done = False  # a consumer attached and let go: nobody will read them again
        self.storing = False  # every layer arrived and the blocks are being copied into the tiers
        self.num_stored = 0  # blocks stored in this node's tiers once every layer arrived

    def destination_for(self, header: FrameHeader) -> memoryview:
        """Where a BLOCK frame's payload goes; CorruptBlock if it does not fit this handoff."""
        seq = header.sequence
        if seq >= len(self.hashes) or header.key != self.hashes[seq]:
            raise CorruptBlock(f"handoff {self.transfer_id!r}: a frame names block #{seq}, which this handoff does not hold.")
        if header.num_layers <= 0 or header.first_layer != self.next_layer[seq] or header.first_layer + header.num_layers > self.num_layers:
            raise CorruptBlock(
                f"handoff {self.transfer_id!r}: block #{seq} expected layer {self.next_layer[seq]} next, got "
                f"[{header.first_layer}, {header.first_layer + header.num_layers})."
            )
        offset, length = self.layout.layers_slice(header.first_layer, header.first_layer + header.num_layers)
        return buffer_of(self.views[seq][offset : offset + length])

    def arrived(self, header: FrameHeader) -> None:
        """A frame's layers arrived verified. The last layer is announced by ``complete``,
        once the blocks are stored, so that no reader lets go of the staging before then."""
        self.next_layer[header.sequence] = header.first_layer + header.num_layers
        ready = min(self.next_layer)
        if ready != self.ready_layers and ready < self.num_layers:
            self.ready_layers = ready
            self._notify()

    @property
    def all_arrived(self) -> bool:
        return min(self.next_layer) == self.num_layers

    def complete(self) -> None:
        if self.state is HandoffState.OPEN:
            self.state = HandoffState.COMPLETE
            self.ready_layers = self.num_layers
            self._notify()

    async def wait_layers(self, stop_layer: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ready_layers < stop_layer:
            self.raise_if_failed()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransferFailed(f"handoff {self.transfer_id!r}: layer {stop_layer - 1} did not arrive within {timeout_s}s.")
            changed = self.changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
