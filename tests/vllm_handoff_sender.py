"""The PD producer's handoff sender (connectors/vllm_handoff.py) with a fake daemon
client and real copy jobs, no engine: the step returns before the decode daemon
acknowledges, and a handoff that fails or times out beside the steps is counted, never
raised. The connector's modules import vLLM, so tests/test_vllm_handoff_sender.py runs
this in the vLLM venv:

    .venv-vllm/bin/python tests/vllm_handoff_sender.py

It prints "ok" after the last check; a failed check raises.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from kvstore.client import HandoffSend
from kvstore.connectors.vllm_handoff import HandoffSender
from kvstore.connectors.vllm_layout import HostCopies
from kvstore.connectors.vllm_meta import HandoffSpec
from kvstore.errors import TransferFailed

BLOCK_BYTES = 4


class FakeCopier:
    """Writes layer+1 into every byte of each run's slots (adjacent in ``slab``)."""

    block_bytes = BLOCK_BYTES

    def __init__(self, slab: torch.Tensor) -> None:
        self._slab = slab

    def save(self, cache: torch.Tensor, layer: int, runs) -> None:
        for run in runs:
            start = run.first_slot.data_ptr() - self._slab.data_ptr()
            self._slab[start : start + run.count * BLOCK_BYTES].fill_(layer + 1)


class FakeClient:
    """Records the calls; ``handoff_finish`` waits for ``acknowledge`` (or fails)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.acknowledge = threading.Event()
        self.finish_error: Exception | None = None
        self.slab = torch.zeros(64, dtype=torch.uint8)

    def handoff_send(self, digest, hashes, transfer_id, destination) -> HandoffSend:
        self.calls.append(("send", transfer_id))
        return HandoffSend(transfer_id, [self.slab[k * BLOCK_BYTES : (k + 1) * BLOCK_BYTES] for k in range(len(hashes))])

    def handoff_layers_ready(self, transfer_id, layer) -> None:
        self.calls.append(("ready", transfer_id, layer))

    def handoff_finish(self, transfer_id, timeout_s) -> int:
        if self.finish_error is not None:
            raise self.finish_error
        assert self.acknowledge.wait(10)
        self.calls.append(("finished", transfer_id))
        return 2

    def handoff_cancel(self, transfer_id) -> None:
        self.calls.append(("cancel", transfer_id))


@contextlib.contextmanager
def sender_on(client: FakeClient) -> Iterator[HandoffSender]:
    copies = HostCopies()
    sender = HandoffSender(client, b"digest", FakeCopier(client.slab), copies, timeout_s=5.0, tp_rank=0)
    try:
        yield sender
    finally:
        client.acknowledge.set()  # a check that failed leaves no finish waiting
        sender.close()
        copies.shutdown()


SPEC = HandoffSpec("req-1", "pd-1", "decode", (b"h1", b"h2"), (0, 1))


def run_step(sender: HandoffSender, abandon: bool = False, layers: int = 2) -> None:
    cache = torch.zeros(1)
    for layer in range(layers):
        sender.layer_written([SPEC], cache, layer)
    sender.finish_step(abandon=abandon)


def test_the_step_returns_with_the_staging_slots_filled_before_the_decode_daemon_acknowledges():
    client = FakeClient()
    with sender_on(client) as sender:
        run_step(sender)
        # every layer copied and announced inside the step; the acknowledgement is still awaited
        assert client.calls == [("send", "pd-1/rank0"), ("ready", "pd-1/rank0", 0), ("ready", "pd-1/rank0", 1)]
        assert bool((client.slab[: 2 * BLOCK_BYTES] == 2).all())  # the last layer's copy is done
        assert sender.blocks_sent == 0
        client.acknowledge.set()
        sender.wait()
        assert client.calls[-1] == ("finished", "pd-1/rank0")
        assert sender.blocks_sent == 2 and sender.num_failures == 0


def test_a_handoff_that_times_out_beside_the_steps_is_counted_and_the_next_step_hands_off_again():
    client = FakeClient()
    with sender_on(client) as sender:
        client.finish_error = TransferFailed("handoff 'pd-1/rank0' to decode did not finish within 5.0s.")
        run_step(sender)  # raises nothing into vLLM
        sender.wait()
        assert sender.num_failures == 1 and sender.blocks_sent == 0
        client.finish_error = None
        client.acknowledge.set()
        run_step(sender)
        sender.wait()
        assert sender.blocks_sent == 2 and sender.num_failures == 1


def test_a_step_whose_loads_failed_never_announces_its_last_layer_and_cancels_its_handoffs():
    client = FakeClient()
    with sender_on(client) as sender:
        run_step(sender, abandon=True)
        # the decode daemon never holds every layer, so the decode instance never loads this KV,
        # however late the cancel comes (it waits behind the handoffs finishing before it)
        assert ("ready", "pd-1/rank0", 1) not in client.calls
        sender.wait()
        assert client.calls[-1] == ("cancel", "pd-1/rank0")
        assert ("finished", "pd-1/rank0") not in client.calls
        assert sender.num_failures == 1 and sender.blocks_sent == 0


if __name__ == "__main__":
    test_the_step_returns_with_the_staging_slots_filled_before_the_decode_daemon_acknowledges()
    test_a_handoff_that_times_out_beside_the_steps_is_counted_and_the_next_step_hands_off_again()
    test_a_step_whose_loads_failed_never_announces_its_last_layer_and_cancels_its_handoffs()
    print("ok")
