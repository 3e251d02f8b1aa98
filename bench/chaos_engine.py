"""One engine of the chaos run: saves and loads growing-prefix chains through the real
client and checks every byte it loads.

    python -m bench.chaos_engine '<json settings>'   (started by bench/chaos.py)

Each operation is one of:

- a turn: look up a session's prefix, load it (sometimes letting the daemon fetch what it
  misses from its peer through the index), check it, then save the blocks past it
  (``save``, or in place: ``begin_save`` → write the slot views → ``commit``);
- a remote read: ``load(allow_remote=True, source=…)`` of a session the other daemon's
  engines write, so blocks cross between daemons (through the driver's byte-flipping
  proxy on one side);
- an in-place read: ``acquire``, check the slot views while leased, ``release``.

Every block a load reports as loaded is compared with the bytes its key must hold
(bench/chaos_workload.py); a mismatch is written to the stats file at once, with what the
bytes were instead. Faults the driver asks for by signal:

- SIGUSR1: the next save reserves a scratch chain and never commits it (the daemon must
  reclaim the reservation when its TTL passes; the session stays open);
- SIGUSR2: the next save is an in-place save that stalls halfway for longer than the
  reservation TTL, then writes the rest of its slot views and commits (the daemon must
  refuse the late commit, and no other block may be hurt by the late writes).

Any kvstore error (KVStoreError) or OSError from a dead, stopped or restarting daemon is
a failed operation: the client is dropped and a new one made after a backoff. Anything
else is counted as an unexpected error (a finding) and handled the same way, so the
engine lives on. Counters are cumulative for this process and appended as one JSON line
after every operation to the stats file (O_APPEND), so a SIGKILL loses at most the
operation in flight.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.chaos_workload import BLOCK_BYTES, NAMESPACE, Workload, describe_mismatch, expected_bytes, scratch_chain, wrong_bytes
from kvstore.client import KVStoreClient
from kvstore.errors import KVStoreError, ReservationExpired
from kvstore.paths import state_path_for

__all__ = ["EngineSettings", "main"]


@dataclass(frozen=True)
class EngineSettings:
    socket: str
    engine_id: int
    incarnation: int
    seed: int
    stats_path: str
    stop_path: str
    write_sessions: list[int]
    read_sessions: list[int]
    remote_source: str  # "" lets the daemon find the peer through the index
    timeout_s: float
    reservation_ttl_s: float
    fetch_deadline_s: float
    workload: dict = field(default_factory=dict)


class Engine:
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.workload = Workload(**settings.workload)
        self.rng = np.random.default_rng([settings.seed, settings.engine_id, settings.incarnation])
        self.counters: dict[str, int] = {}
        self.client: KVStoreClient | None = None
        self.digest = b""
        self.daemon_pid: int | None = None
        self.backoff_s = 0.05
        self.abandon_next = False
        self.stall_next = False
        self.abandoned: list[object] = []  # kept so the reservations are never committed or aborted
        self.scratch_serial = 0
        self.phase = "idle"
        self.stats_fd = os.open(settings.stats_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.buffers = [torch.zeros(BLOCK_BYTES, dtype=torch.uint8) for _ in range(self.workload.chain_blocks)]
        signal.signal(signal.SIGUSR1, self._on_abandon)
        signal.signal(signal.SIGUSR2, self._on_stall)
        self.report()  # the driver sends SIGUSR faults only once this line exists

    def _on_abandon(self, signum, frame) -> None:
        self.abandon_next = True

    def _on_stall(self, signum, frame) -> None:
        self.stall_next = True

    # -- bookkeeping ---------------------------------------------------------------------
    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def write_line(self, record: dict) -> None:
        os.write(self.stats_fd, (json.dumps(record) + "\n").encode())

    def report(self) -> None:
        self.write_line({"kind": "stats", "t": time.time(), "counters": self.counters})

    # -- the daemon connection -------------------------------------------------------------
    def connect(self) -> bool:
        try:
            client = KVStoreClient(self.settings.socket, timeout_s=self.settings.timeout_s)
        except (KVStoreError, OSError):
            self.count("connect_failures")
            return False
        try:
            self.digest = client.register_namespace(NAMESPACE)
        except (KVStoreError, OSError):
            self.count("connect_failures")
            client.close()
            return False
        self.client = client
        self.daemon_pid = self._current_daemon_pid()
        self.count("connects")
        self.backoff_s = 0.05
        return True

    def drop_client(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # a broken client may fail to close; it is dropped all the same
                pass
        self.client = None
        self.abandoned.clear()
        time.sleep(self.backoff_s)
        self.backoff_s = min(0.5, self.backoff_s * 2)

    def _current_daemon_pid(self) -> int | None:
        try:
            return json.loads(state_path_for(Path(self.settings.socket)).read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None

    # -- checking ----------------------------------------------------------------------------
    def check(self, op: str, hashes: list[bytes], arrays: list[np.ndarray], count: int, tiers: tuple = ()) -> None:
        """Compare the first ``count`` loaded blocks with the bytes their keys must hold."""
        for index in range(count):
            wrong = wrong_bytes(arrays[index], hashes[index])
            self.count("checked_blocks")
            if not wrong:
                continue
            self.count("wrong_blocks")
            self.count("wrong_bytes", wrong)
            mismatch = describe_mismatch(arrays[index], hashes, index)
            self.write_line(
                {
                    "kind": "wrong",
                    "t": time.time(),
                    "engine": self.settings.engine_id,
                    "incarnation": self.settings.incarnation,
                    "op": op,
                    "block": hashes[index].hex(),
                    "index": index,
                    "loaded": count,
                    "tier_at_lookup": tiers[index].value if index < len(tiers) else None,
                    "wrong": mismatch.wrong,
                    "first_offset": mismatch.first_offset,
                    "all_zero": mismatch.all_zero,
                    "bytes_of_chain_index": mismatch.belongs_to,
                    "digest": mismatch.digest,
                    "daemon_pid_at_connect": self.daemon_pid,
                    "daemon_pid_now": self._current_daemon_pid(),
                }
            )

    # -- operations --------------------------------------------------------------------------
    def turn(self) -> None:
        workload, client = self.workload, self.client
        chain = workload.chain(int(self.rng.choice(self.settings.write_sessions)))
        hashes = chain[: int(self.rng.integers(workload.shared_blocks + 1, workload.chain_blocks + 1))]
        self.phase = "lookup"
        hit = client.lookup(self.digest, hashes)
        self.count("lookups")
        for tier in hit.tiers:
            self.count(f"hit_blocks_{tier.value}")
        remote = self.rng.random() < 0.2
        loaded = self.load(hashes, remote=remote, source=None, tiers=hit.tiers)
        tail = hashes[loaded:]
        if not tail:
            return
        parent = hashes[loaded - 1] if loaded else None
        if self.abandon_next:
            self.abandon_next = False
            self.abandon()
        elif self.stall_next:
            self.stall_next = False
            self.stalled_save()
        elif self.rng.random() < 0.5:
            self.phase = "save"
            stored = client.save(self.digest, tail, [torch.from_numpy(expected_bytes(h).copy()) for h in tail], parent_hash=parent)
            self.count("save_calls")
            self.count("saved_blocks", stored)
        else:
            self.phase = "save_in_place"
            pending = client.begin_save(self.digest, tail, parent_hash=parent)
            for index, view in zip(pending.indices, pending.views):
                view.numpy()[:] = expected_bytes(tail[index])
            stored = client.commit(pending)
            self.count("save_calls")
            self.count("in_place_save_calls")
            self.count("saved_blocks", stored)

    def load(self, hashes: list[bytes], remote: bool, source: str | None, tiers: tuple = ()) -> int:
        into = self.buffers[: len(hashes)]
        for buffer in into:
            buffer.zero_()  # bytes a load claims but never copied must not pass as the last load's
        self.phase = "load_remote" if remote else "load"
        loaded = self.client.load(self.digest, hashes, into, allow_remote=remote, deadline_s=self.settings.fetch_deadline_s, source=source)
        self.count("load_calls")
        self.count("loaded_blocks", loaded)
        if remote:
            self.count("remote_load_calls")
            self.count("remote_loaded_blocks", max(0, loaded - len(tiers)))
        self.check("load_remote" if remote else "load", hashes, [b.numpy() for b in into], loaded, tiers)
        return loaded

    def remote_read(self) -> None:
        workload = self.workload
        chain = workload.chain(int(self.rng.choice(self.settings.read_sessions)))
        hashes = chain[: int(self.rng.integers(1, workload.chain_blocks + 1))]
        hit = self.client.lookup(self.digest, hashes)
        self.count("lookups")
        self.load(hashes, remote=True, source=self.settings.remote_source or None, tiers=hit.tiers)

    def in_place_read(self) -> None:
        workload = self.workload
        sessions = self.settings.write_sessions + self.settings.read_sessions
        chain = workload.chain(int(self.rng.choice(sessions)))
        hashes = chain[: int(self.rng.integers(1, workload.chain_blocks + 1))]
        self.phase = "acquire"
        lease = self.client.acquire(self.digest, hashes)
        try:
            self.count("load_calls")
            self.count("in_place_load_calls")
            self.count("loaded_blocks", lease.num_blocks)
            self.check("acquire", hashes, [v.numpy() for v in lease.views], lease.num_blocks)
        finally:
            self.client.release(lease)

    def abandon(self) -> None:
        """Reserve a scratch chain and leave the reservation to expire."""
        self.phase = "abandon"
        self.scratch_serial += 1
        hashes = scratch_chain(self.settings.engine_id, self.settings.incarnation, self.scratch_serial, 4)
        pending = self.client.begin_save(self.digest, hashes)
        self.abandoned.append(pending)
        self.count("reservations_abandoned")
        self.log_scratch("abandoned", hashes, pending.indices, [])

    def stalled_save(self) -> None:
        """An in-place save that stalls past the reservation TTL halfway, then finishes."""
        self.phase = "stalled_save"
        self.scratch_serial += 1
        hashes = scratch_chain(self.settings.engine_id, self.settings.incarnation, self.scratch_serial, 6)
        pending = self.client.begin_save(self.digest, hashes)
        half = len(pending.views) // 2
        for index, view in list(zip(pending.indices, pending.views))[:half]:
            view.numpy()[:] = expected_bytes(hashes[index])
        self.count("stalled_saves")
        time.sleep(self.settings.reservation_ttl_s + 1.0)
        late = pending.indices[half:]
        self.log_scratch("stalled_save", hashes, pending.indices, late)
        for index, view in list(zip(pending.indices, pending.views))[half:]:
            view.numpy()[:] = expected_bytes(hashes[index])
        try:
            stored = self.client.commit(pending)
        except ReservationExpired:
            self.count("stale_commits_refused")
            return
        self.count("stale_commits_accepted")
        self.count("saved_blocks", stored)

    def log_scratch(self, purpose: str, hashes: list[bytes], reserved: tuple[int, ...], late: tuple[int, ...]) -> None:
        """Name a scratch chain's blocks, so that the driver can tell whose bytes a wrong block holds."""
        record = {"kind": "scratch", "t": time.time(), "engine": self.settings.engine_id, "incarnation": self.settings.incarnation}
        record.update(purpose=purpose, hashes=[h.hex() for h in hashes], reserved=list(reserved), late=list(late))
        self.write_line(record)

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        stop = Path(self.settings.stop_path)
        operations = [self.turn, self.remote_read, self.in_place_read]
        weights = np.array([0.55, 0.25, 0.20])
        while not stop.exists():
            if self.client is None and not self.connect():
                self.report()
                time.sleep(self.backoff_s)
                self.backoff_s = min(0.5, self.backoff_s * 2)
                continue
            operation = operations[int(self.rng.choice(len(operations), p=weights))]
            try:
                operation()
                self.count("ops")
            except (KVStoreError, OSError) as exc:
                self.count("failed_ops")
                self.count(f"error_{type(exc).__name__}")
                if self.counters[f"error_{type(exc).__name__}"] <= 3:  # a few sentences of each kind, for the report
                    self.write_line({"kind": "error", "t": time.time(), "engine": self.settings.engine_id, "phase": self.phase,
                                     "error": type(exc).__name__, "message": str(exc)[:300]})  # fmt: skip
                self.drop_client()
            except Exception as exc:
                self.count("failed_ops")
                self.count("unexpected_errors")
                self.write_line(
                    {
                        "kind": "unexpected",
                        "t": time.time(),
                        "engine": self.settings.engine_id,
                        "phase": self.phase,
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-2000:],
                    }
                )
                self.drop_client()
            self.phase = "idle"
            self.report()
        if self.client is not None:
            self.client.close()
        self.counters["exited_cleanly"] = 1
        self.report()


def main() -> None:
    torch.set_num_threads(1)
    Engine(EngineSettings(**json.loads(sys.argv[1]))).run()


if __name__ == "__main__":
    main()
