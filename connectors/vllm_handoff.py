"""Prefill → decode through the daemons' handoff, for the vLLM connector's PD roles.

Producer (prefill instance): in the step that completes a prompt, the step's first
``save_layer`` opens a handoff of the prompt's full blocks to the decode daemon; each
layer is copied from vLLM's cache into the handoff's staging slots by the worker's copy
engine as soon as the forward pass wrote it, and announced (``handoff_layers_ready``) once its
copy is done, so the daemon streams layer i while the engine computes layer i+1. The
step's end waits for the step's copies only: the engine's blocks can be freed as soon as
the step ends, the bytes are in the handoff's staging slots by then, which the daemon
owns until the handoff closes. The tail of the transfer is waited for beside the steps,
on the sender's thread (``handoff_finish``, up to ``handoff_timeout_s``; the blocks then
stay cached on the prefill node too); a failure or a timeout there is logged and counted,
and the decode instance, whose daemon never gets the whole handoff, recomputes.

Loads beside the steps (``HandoffReceiver``, for both kinds of asynchronous load): a
request whose hit reads a slow tier (NVMe) is leased on a background thread — the daemon
promotes and verifies its blocks meanwhile — copied into the engine's blocks and
reported finished; blocks the lease did not cover are load errors, recomputed. And on a
decode instance, a request arrives with the transfer id and is loaded
asynchronously — a background thread (with its own daemon connection: the handoff
belongs to the session that receives it) waits for the handoff, checks that it carries
the block hashes this instance computed for the prompt, copies each layer into the
engine's blocks as it arrives and reports the request finished; blocks it could not
fill (fewer sent, other hashes, a transfer that broke off) are reported as load errors
and recomputed.

With tensor parallelism every rank hands off its own KV heads under its own namespace,
as its own handoff: the daemons see ``TRANSFER_ID/rankN``.

Owners: ``HandoffSender`` — vLLM's worker thread (its copies run on the worker's copy
thread; its thread only finishes or cancels the handoffs queued to it, and is the only
writer of ``blocks_sent`` and ``failures_beside_steps``). Its client is its own (a
handoff belongs to the session that opened it), so a handoff waiting for its decode
daemon holds up the worker's loads and saves nowhere; the next handoff's opening waits
behind it, as calls on one connection do. ``HandoffReceiver`` — its methods on the worker thread, its transfers on its
own thread, which alone uses its client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace

import torch

from kvstore.client import KVStoreClient
from kvstore.connectors.vllm_compat import connector_logger
from kvstore.connectors.vllm_layout import BlockRun, CopyJob, CudaCopies, HostCopies, LayerCopier, runs_of
from kvstore.connectors.vllm_meta import HandoffSpec, LoadSpec
from kvstore.errors import KVStoreError
from kvstore.namespace import Namespace

__all__ = ["HandoffSender", "HandoffReceiver", "rank_transfer_id"]

logger = connector_logger(__name__)


def rank_transfer_id(transfer_id: str, tp_rank: int) -> str:
    """The daemons' id for one tensor-parallel rank's share of a request's handoff."""
    return f"{transfer_id}/rank{tp_rank}"


@dataclass
class _Outgoing:
    spec: HandoffSpec
    runs: list[BlockRun]
    layers_announced: int = 0
    failed: bool = False


@dataclass
class _StepSends:
    handoffs: list[_Outgoing] = field(default_factory=list)
    copies: list[tuple[int, CopyJob]] = field(default_factory=list)  # (layer, its copy), in layer order


class HandoffSender:
    def __init__(
        self, client: KVStoreClient, digest: bytes, copier: LayerCopier, copies: HostCopies | CudaCopies, timeout_s: float, tp_rank: int
    ) -> None:
        self._tp_rank = tp_rank
        self._client = client
        self._digest = digest
        self._copier = copier
        self._copies = copies
        self._timeout_s = timeout_s
        self._step: _StepSends | None = None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-handoff-send")
        self._finishing: list[Future[None]] = []  # handoffs queued to the finisher, in step order
        self.blocks_sent = 0
        self.failures = 0  # on the worker thread
        self.failures_beside_steps = 0  # on the finisher: refused, failed or timed out at the end

    def layer_written(self, specs: Sequence[HandoffSpec], cache: torch.Tensor, layer: int) -> None:
        """The forward pass wrote ``layer``: announce earlier layers whose copies are done,
        queue this one's copy (opening the step's handoffs at its first layer)."""
        if self._step is None:
            self._step = _StepSends([outgoing for spec in specs if (outgoing := self._open(spec)) is not None])
        self._announce_copied(wait=False)
        runs = [run for outgoing in self._step.handoffs if not outgoing.failed for run in outgoing.runs]
        if runs:
            self._step.copies.append((layer, self._copies.submit_save(self._copier.save, cache, layer, runs)))

    def finish_step(self, abandon: bool) -> None:
        """Wait for the step's copies (no engine block is read after this) and announce
        the remaining layers; queue every handoff of the step to be finished beside the
        steps — or, with ``abandon`` (the step read KV that failed to load), cancelled.
        An abandoned handoff's last layer is never announced (its copy is announced only
        here), so the decode daemon never holds all of it, however late the cancel comes."""
        if self._step is None:
            return
        if abandon:
            for outgoing in self._step.handoffs:
                if not outgoing.failed:
                    self._mark_failed(outgoing, "this step's KV is not trusted")
        self._announce_copied(wait=True)
        for outgoing in self._step.handoffs:
            settle = self._cancel if outgoing.failed else self._finish
            self._finishing.append(self._finisher.submit(settle, outgoing))
        self._finishing = [future for future in self._finishing if not future.done()]
        self._step = None

    @property
    def num_failures(self) -> int:
        return self.failures + self.failures_beside_steps

    def wait(self) -> None:
        """Return once every handoff queued so far is finished or cancelled."""
        wait_futures(self._finishing)
        self._finishing = []

    def close(self) -> None:
        """Finish the handoffs still queued (each within the timeout), then stop."""
        self._finisher.shutdown(wait=True)

    def _open(self, spec: HandoffSpec) -> _Outgoing | None:
        spec = replace(spec, transfer_id=rank_transfer_id(spec.transfer_id, self._tp_rank))
        try:
            sending = self._client.handoff_send(self._digest, spec.hashes, spec.transfer_id, spec.destination)
        except KVStoreError as exc:
            self.failures += 1
            logger.warning(
                "kvstore: cannot open handoff %r to %s, the decode instance will recompute: %s", spec.transfer_id, spec.destination, exc
            )
            return None
        return _Outgoing(spec, runs_of(spec.block_ids, sending.views, self._copier.block_bytes))

    def _announce_copied(self, wait: bool) -> None:
        copies = self._step.copies
        while copies and (wait or copies[0][1].done()):
            layer, copy = copies.pop(0)
            error = copy.exception()
            for outgoing in self._step.handoffs:
                if outgoing.failed:
                    continue
                if error is not None:
                    self._mark_failed(outgoing, error)
                    continue
                try:
                    self._client.handoff_layers_ready(outgoing.spec.transfer_id, layer)
                except (KVStoreError, OSError) as exc:
                    self._mark_failed(outgoing, exc)

    def _finish(self, outgoing: _Outgoing) -> None:
        spec = outgoing.spec
        try:
            stored = self._client.handoff_finish(spec.transfer_id, timeout_s=self._timeout_s)
        except (KVStoreError, OSError) as exc:  # the handoff failed or timed out: the daemon closed it
            self.failures_beside_steps += 1
            self._log_failed(outgoing, exc)
            return
        self.blocks_sent += len(spec.hashes)
        logger.info(
            "kvstore: handoff %r of request %s: %d blocks to %s (%d stored there)",
            spec.transfer_id,
            spec.req_id,
            len(spec.hashes),
            spec.destination,
            stored,
        )

    def _mark_failed(self, outgoing: _Outgoing, error: object) -> None:
        outgoing.failed = True
        self.failures += 1
        self._log_failed(outgoing, error)

    def _log_failed(self, outgoing: _Outgoing, error: object) -> None:
        logger.warning(
            "kvstore: handoff %r of request %s failed, the decode instance will recompute: %s",
            outgoing.spec.transfer_id,
            outgoing.spec.req_id,
            error,
        )

    def _cancel(self, outgoing: _Outgoing) -> None:
        try:
            self._client.handoff_cancel(outgoing.spec.transfer_id)
        except (KVStoreError, OSError):
            pass  # already closed by the daemon


class HandoffReceiver:
    def __init__(
        self,
        socket_path: str,
        namespace: Namespace,
        copier: LayerCopier,
        caches: Sequence[torch.Tensor],
        timeout_s: float,
        tp_rank: int,
    ) -> None:
        self._tp_rank = tp_rank
        self._socket_path = socket_path
        self._namespace = namespace
        self._copier = copier
        self._caches = caches
        self._timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-handoff")
        self._client: KVStoreClient | None = None  # the receiving thread's own
        self._jobs: dict[str, Future[set[int]]] = {}
        self._stream = torch.cuda.Stream(caches[0].device) if caches and caches[0].is_cuda else None
        self.blocks_received = 0
        self.blocks_loaded = 0  # from the store, beside the steps
        self.failures = 0

    def start(self, spec: LoadSpec) -> None:
        if spec.transfer_id is None:  # from the store
            self._jobs[spec.req_id] = self._executor.submit(self._load_stored, spec)
            return
        spec = replace(spec, transfer_id=rank_transfer_id(spec.transfer_id, self._tp_rank))
        self._jobs[spec.req_id] = self._executor.submit(self._receive, spec)

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose handoff is over (landed or not), and the engine blocks it did not fill."""
        finished, failed = set(), set()
        for req_id, job in list(self._jobs.items()):
            if job.done():
                del self._jobs[req_id]
                finished.add(req_id)
                failed |= job.result()
        return finished, failed

    def close(self) -> None:
        self._executor.shutdown(wait=True)  # the receiving thread is done with its client after this
        if self._client is not None:
            self._client.close()

    def _receive(self, spec: LoadSpec) -> set[int]:
        """Runs on the receiving thread; returns the engine blocks left unfilled."""
        try:
            client = self._connect()
            digest = self._namespace.digest
            receiving = client.handoff_receive(digest, spec.transfer_id, timeout_s=self._timeout_s)
        except KVStoreError as exc:
            return self._failed(spec, spec.block_ids, exc)
        try:
            first = spec.first_block
            sent = list(receiving.hashes[first : first + len(spec.hashes)])
            # the prefill instance must have hashed the same tokens: only the agreeing prefix is used
            usable = next((k for k, (ours, theirs) in enumerate(zip(spec.hashes, sent)) if ours != theirs), len(sent))
            runs = runs_of(spec.block_ids[:usable], receiving.views[first : first + usable], self._copier.block_bytes)
            self._copy_in(runs, lambda layer: client.handoff_wait_layers(spec.transfer_id, layer + 1, timeout_s=self._timeout_s))
        except Exception as exc:  # a transfer or a copy that broke: nothing of it is trusted
            return self._failed(spec, spec.block_ids, exc)
        finally:
            try:
                client.handoff_close(spec.transfer_id)
            except (KVStoreError, OSError):
                pass  # the transfer already failed; the daemon freed it
        self.blocks_received += usable
        if usable < len(spec.hashes):
            return self._failed(spec, spec.block_ids[usable:], "the handoff holds other or fewer blocks than the prompt")
        return set()

    def _load_stored(self, spec: LoadSpec) -> set[int]:
        """Runs on the receiving thread: lease the blocks (the daemon promotes them from
        NVMe, verified, meanwhile), copy every layer into the engine's blocks, release;
        returns the engine blocks left unfilled."""
        try:
            client = self._connect()
            lease = client.acquire(self._namespace.digest, spec.hashes)
        except KVStoreError as exc:
            return self._failed(spec, spec.block_ids, exc)
        loaded = lease.num_blocks
        try:
            self._copy_in(runs_of(spec.block_ids[:loaded], lease.views, self._copier.block_bytes))
        except Exception as exc:  # a copy that broke: nothing of it is trusted
            return self._failed(spec, spec.block_ids, exc)
        finally:
            try:
                client.release(lease)
            except KVStoreError:
                pass  # the daemon frees the lease with the connection
        self.blocks_loaded += loaded
        if loaded < len(spec.hashes):
            return self._failed(spec, spec.block_ids[loaded:], "no longer loadable (evicted, or failed its checksum)")
        return set()

    def _copy_in(self, runs: list[BlockRun], before_layer=None) -> None:
        """Every layer of ``runs`` into the engine's caches; on CUDA on this thread's own
        stream, done before this returns (the engine reads the blocks once told)."""
        if not runs:
            return
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for layer, cache in enumerate(self._caches):
                if before_layer is not None:
                    before_layer(layer)
                self._copier.load(cache, layer, runs)
        if self._stream is not None:
            self._stream.synchronize()

    def _failed(self, spec: LoadSpec, block_ids: Sequence[int], why: object) -> set[int]:
        self.failures += 1
        logger.warning(
            "kvstore: %s of request %s: %d blocks not loaded (%s); vLLM recomputes them",
            "load" if spec.transfer_id is None else f"handoff {spec.transfer_id!r}",
            spec.req_id,
            len(block_ids),
            why,
        )
        return set(block_ids)

    def _connect(self) -> KVStoreClient:
        if self._client is None:
            self._client = KVStoreClient(self._socket_path)
            self._client.register_namespace(self._namespace)
        return self._client
