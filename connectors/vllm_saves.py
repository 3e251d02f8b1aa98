"""The worker's saves that end after their step: each step's saves are committed on a
commit thread once that step's layer copies are done, and a finished request is reported
to vLLM (``finished_sending``) once every step that saved it has ended.

Why the engine blocks stay readable until then: the copies read the engine's blocks, so
vLLM must not hand them to another request before the copies are done. A request that
keeps running keeps its blocks; a finished one keeps them because the scheduler returned
True from ``request_finished`` for it (``KVStoreConnectorMetadata.delayed_frees``); a
preempted one loses them at once, so the next step waits for the copies first
(``flush_copies``) — the commits may still run after it.

Every rank records every step that plans saves, whether it copies anything or not (an
MLA rank that only reads, a reservation the daemon refused): vLLM counts a request as
sent when every rank has reported it, and the scheduler counts a request's saves as over
when every rank has settled each of its steps (``SaveProgress``).

Owner: vLLM's worker thread calls every method; the commit thread runs only the commits
queued here, and a step's record is read by the worker thread only once its future is done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from kvstore.connectors.vllm_layout import CopyJob, wait_all

__all__ = ["DeferredSaves"]

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, as vllm_compat.connector_logger; no vLLM import here


# reserves a step's slots and copies into them: the copies, and the commit to run after them
CopyOut = Callable[[], tuple[list[CopyJob], Callable[[], None] | None]]


@dataclass(frozen=True, slots=True)
class _StepSaves:
    copies: tuple[CopyJob, ...]  # the step's layer copies into the slab
    commit: Future  # waits for them, then commits or aborts each save of the step


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


class DeferredSaves:
    def __init__(self) -> None:
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-commit")
        self._steps: dict[str, list[_StepSaves]] = {}  # request -> its steps whose saves are not over (or not reported)
        self._delayed: set[str] = set()  # finished requests vLLM keeps the blocks of until they are reported
        self._later: list[tuple[CopyOut, Future]] = []  # steps whose copies wait for the next step (run_later)

    def submit(self, req_ids: Iterable[str], copies: list[CopyJob], commit: Callable[[], None] | None) -> None:
        """One step's saves, of the requests ``req_ids``: ``commit`` runs on the commit
        thread once ``copies`` are done (None: this rank has nothing to commit)."""
        if commit is None:
            step = _StepSaves((), _done())
        else:
            step = _StepSaves(tuple(copies), self._committer.submit(_after, copies, commit))
        for req_id in dict.fromkeys(req_ids):
            self._steps.setdefault(req_id, []).append(step)

    def submit_later(self, req_ids: Iterable[str], copy_out: CopyOut) -> None:
        """One step's saves whose copies wait for the start of the next step (``run_later``,
        on the worker thread): on a CPU cache every copy runs on the engine's thread, and
        run after the step they no longer delay the tokens it produced — a prompt's first
        token above all. ``copy_out`` reserves the slots and copies, and returns the copies
        and the commit that runs after them on the commit thread (None: it has committed)."""
        done: Future = Future()
        self._later.append((copy_out, done))
        step = _StepSaves((), done)
        for req_id in dict.fromkeys(req_ids):
            self._steps.setdefault(req_id, []).append(step)

    def run_later(self) -> None:
        """Copy out the saves of the steps before this one (their requests still own their
        blocks: running, or kept by vLLM until ``finished_sending``); their commits go to
        the commit thread."""
        later, self._later = self._later, []
        for copy_out, done in later:
            try:
                copies, commit = copy_out()
            except Exception:  # logged, never raised into vLLM: the step's saves are lost, its requests finish
                logger.exception("kvstore: copying a step's saves out of the engine's blocks failed")
                done.set_result(None)
                continue
            if commit is None:  # committed already: the blocks are not read any more
                done.set_result(None)
            else:
                self._committer.submit(_after_then, copies, commit, done)

    def flush_copies(self) -> None:
        """Return once no copy reads an engine block any more (their commits may still run)."""
        self.run_later()
        wait_all([copy for steps in self._steps.values() for step in steps for copy in step.copies])

    def settled(self) -> dict[str, int]:
        """Per request, how many of its steps' saves ended since the last call."""
        counts: dict[str, int] = {}
        for req_id, steps in self._steps.items():
            done = sum(step.commit.done() for step in steps)
            if done:
                counts[req_id] = done
                steps[:] = [step for step in steps if not step.commit.done()]
        for req_id in [req_id for req_id, steps in self._steps.items() if not steps]:
            del self._steps[req_id]
        return counts

    def finished_sending(self, delayed: Iterable[str]) -> set[str]:
        """Of the requests whose blocks vLLM keeps (``delayed``, and those of earlier
        calls), the ones whose saves are all over: vLLM may free their blocks."""
        self._delayed.update(delayed)
        finished = {req_id for req_id in self._delayed if all(step.commit.done() for step in self._steps.get(req_id, ()))}
        self._delayed -= finished
        for req_id in finished:
            self._steps.pop(req_id, None)
        return finished

    def wait(self) -> None:
        """Return once every save queued so far has ended."""
        self.run_later()
        wait_futures([step.commit for steps in self._steps.values() for step in steps])

    def close(self) -> None:
        """Run the commits still queued, then stop the commit thread. Copies not run yet
        are dropped: they reserved nothing."""
        later, self._later = self._later, []
        for _, done in later:
            done.set_result(None)
        self._committer.shutdown(wait=True)


def _after_then(copies: list[CopyJob], commit: Callable[[], None], done: Future) -> None:
    try:
        _after(copies, commit)
    finally:
        done.set_result(None)


def _after(copies: list[CopyJob], commit: Callable[[], None]) -> None:
    wait_all(copies)  # the commit reads the outcome of each copy itself
    try:
        commit()
    except Exception:  # logged, never raised into vLLM: the requests still finish and their blocks are freed
        logger.exception("kvstore: committing a step's saves failed")
