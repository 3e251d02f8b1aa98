"""The vLLM worker's deferred saves (connectors/vllm_saves.py), with real copy jobs that
run on a thread of the test's (as a CUDA stream runs them, after the step) and commits
that the test holds: no vLLM needed."""

from __future__ import annotations

import threading

from kvstore.connectors.vllm_layout import CopyJob
from kvstore.connectors.vllm_saves import DeferredSaves


def held_copy(release: threading.Event, log: list[str], name: str) -> CopyJob:
    def copy() -> None:
        assert release.wait(10)
        log.append(name)

    job = CopyJob(copy, ())
    threading.Thread(target=job.run, daemon=True).start()
    return job


def test_a_step_commits_only_after_its_copies_and_its_requests_finish_only_after_the_commit():
    saves, log = DeferredSaves(), []
    copied, committing, committed = threading.Event(), threading.Event(), threading.Event()
    try:
        job = held_copy(copied, log, "copy")

        def commit() -> None:
            log.append("commit")
            committing.set()
            assert committed.wait(10)

        saves.submit(["a", "b"], [job], commit)
        assert saves.finished_sending(["a"]) == set()  # its copy still runs
        copied.set()
        assert committing.wait(10) and log == ["copy", "commit"]
        saves.flush_copies()  # the copies are done: a preempted request's blocks may be reused
        assert saves.finished_sending([]) == set() and saves.settled() == {}  # the commit still runs
        committed.set()
        saves.wait()
        assert saves.settled() == {"a": 1, "b": 1}  # one step each, counted once
        assert saves.settled() == {}
        assert saves.finished_sending([]) == {"a"}  # delayed earlier, reported once
        assert saves.finished_sending(["b"]) == {"b"}
        assert saves.finished_sending([]) == set()
    finally:
        copied.set()
        committed.set()
        saves.close()


def test_a_request_is_finished_once_every_step_that_saved_it_is_over():
    saves, gates = DeferredSaves(), [threading.Event(), threading.Event()]
    try:
        for gate in gates:  # two chunks of one prompt, one step each
            saves.submit(["a"], [], lambda gate=gate: gate.wait(10))
        gates[1].set()
        assert saves.finished_sending(["a"]) == set()
        gates[0].set()
        saves.wait()
        assert saves.finished_sending([]) == {"a"}
    finally:
        for gate in gates:
            gate.set()
        saves.close()


def test_a_rank_with_nothing_to_commit_settles_the_step_at_once():
    saves = DeferredSaves()
    try:
        saves.submit(["a"], [], None)  # an MLA rank that only reads, a reservation the daemon refused
        assert saves.settled() == {"a": 1}
        assert saves.finished_sending(["a", "never-saved"]) == {"a", "never-saved"}
    finally:
        saves.close()


def test_a_commit_that_raises_is_logged_and_its_requests_finish(caplog):
    saves = DeferredSaves()
    try:

        def commit() -> None:
            raise RuntimeError("the slab went away")

        saves.submit(["a"], [], commit)
        saves.wait()
        assert saves.finished_sending(["a"]) == {"a"}
        assert "committing a step's saves failed" in caplog.text
    finally:
        saves.close()


def test_saves_copied_after_their_step_copy_at_the_next_step_on_its_thread_then_commit():
    saves, log = DeferredSaves(), []
    committed = threading.Event()
    try:

        def copy_out():
            log.append(("copy", threading.current_thread().name))
            job = CopyJob(lambda: log.append(("slab", threading.current_thread().name)), ())
            job.run()  # a CPU cache's copy: at once, on the calling thread
            return [job], lambda: (log.append(("commit", threading.current_thread().name)), committed.wait(10))

        saves.submit_later(["a"], copy_out)
        assert log == [] and saves.settled() == {}
        assert saves.finished_sending(["a"]) == set()  # its blocks are kept: nothing is copied yet
        saves.run_later()  # the next step's start
        here = threading.current_thread().name
        assert log[:2] == [("copy", here), ("slab", here)]
        assert saves.finished_sending([]) == set()  # the commit still runs
        committed.set()
        saves.wait()
        assert log[2][0] == "commit" and log[2][1] != here  # on the commit thread
        assert saves.settled() == {"a": 1}
        assert saves.finished_sending([]) == {"a"}
        saves.run_later()
        assert len(log) == 3  # once
    finally:
        committed.set()
        saves.close()


def test_a_preemption_or_a_wait_runs_the_copies_left_for_the_next_step():
    saves, copied = DeferredSaves(), []
    try:
        saves.submit_later(["a"], lambda: (copied.append("a"), ([], lambda: None))[1])
        saves.flush_copies()  # before a step that may hand a preempted request's blocks to another
        assert copied == ["a"]
        saves.submit_later(["b"], lambda: (copied.append("b"), ([], lambda: None))[1])
        saves.wait()
        assert copied == ["a", "b"] and saves.finished_sending(["a", "b"]) == {"a", "b"}
    finally:
        saves.close()


def test_copies_never_run_are_dropped_at_close_and_a_failed_copy_out_finishes_its_requests(caplog):
    saves, copied = DeferredSaves(), []

    def failing():
        raise RuntimeError("the daemon went away")

    saves.submit_later(["a"], failing)
    saves.run_later()
    assert "copying a step's saves out of the engine's blocks failed" in caplog.text
    assert saves.finished_sending(["a"]) == {"a"}
    saves.submit_later(["b"], lambda: (copied.append("b"), ([], lambda: None))[1])
    saves.close()
    assert copied == []  # it reserved nothing: nothing to give back
    assert saves.settled() == {"b": 1}


def test_a_step_whose_copies_committed_already_settles_as_they_end():
    saves, copied = DeferredSaves(), []
    try:
        saves.submit_later(["a"], lambda: (copied.append("a"), ([], None))[1])  # a CPU cache's: commits sent, answers unread
        assert saves.finished_sending(["a"]) == set()
        saves.run_later()
        assert copied == ["a"] and saves.settled() == {"a": 1}
        assert saves.finished_sending([]) == {"a"}
    finally:
        saves.close()
