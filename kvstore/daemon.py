"""`kvstore serve`: one asyncio process per host that owns the tiers.

Start: reclaim what a crashed run left (a socket nobody answers on, the host tier's
shared-memory file), open the tiers (a broken NVMe directory is reported and the node
runs from memory), serve the local protocol on the Unix socket (mode 0600/0660, in a
directory no other user owns or can write), the gRPC API on TCP (behind server.auth_token,
else a token generated once per user: kvstore/paths.py), the peer transport (TCP or UCX:
remote fetch, handoff, drain) and Prometheus
metrics over HTTP, and write a state file next to the socket
(pid, addresses) so that the CLI and tests find ports chosen at start. The node registers
with the block-location index (embedded, or Redis for a fleet) and publishes its block
events there (kvstore/publisher.py); routers ask it through `Index.Match` / `Index.Route`.
It subscribes to the KV events of each engine of its configuration (``[[engines]]``,
kvstore/engines.py), so that their GPU prefix caches are in the same index.

Stop (SIGTERM or SIGINT): stop accepting, give in-flight gRPC calls ``drain_timeout_s``
to finish, close client sessions (their leases and reservations are released), end the
engines' subscriptions (each takes its engine out of the index), leave the index, move the
host tier's blocks to NVMe so that a restart serves them, close the tiers (the shared
memory file is removed) and remove the socket and the state file.

Every tier operation runs on the event loop's thread: the tier manager has one owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
from pathlib import Path

from kvstore.cache_meter import CacheValueMeter
from kvstore.config import DaemonConfig
from kvstore.engines import EngineMetrics, EngineSubscriptions
from kvstore.errors import KVStoreError, TierUnavailable
from kvstore.gcpolicy import GcPolicy
from kvstore.index.backends import check_access, open_index
from kvstore.index.base import NodeInfo
from kvstore.local_server import LocalServer
from kvstore.metrics import Metrics
from kvstore.node import Node
from kvstore.paths import check_daemon_dir, load_or_create_token, state_path_for, write_state
from kvstore.posture import log_posture, posture
from kvstore.prefetch import Prefetcher
from kvstore.publisher import IndexPublisher
from kvstore.router import Router
from kvstore.steps import run_steps
from kvstore.tiers.host import HostTier
from kvstore.tiers.manager import TierManager
from kvstore.tiers.nvme import NvmeTier
from kvstore.transfers.service import TransferService
from kvstore.transport.factory import open_transport

__all__ = ["run", "serve"]

logger = logging.getLogger("kvstore.daemon")
HOUSEKEEPING_PERIOD_S = 0.25


def _reclaim_socket(path: Path) -> None:
    """Remove a socket left by a crashed daemon; refuse to start beside a live one."""
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        logger.warning("removing stale socket %s left by a daemon that did not stop cleanly", path)
        path.unlink()
        state_path_for(path).unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise KVStoreError(f"another kvstore daemon is serving on {path}; stop it or configure another socket_path.")


def _share_with_group(paths: tuple[Path, ...], gid: int) -> None:
    """Give the socket and the host slab to the socket's group: a member connects and maps
    the slab read-write (an engine copies into it), which the group then trusts with the
    KV of every tenant of this daemon."""
    for path in paths:
        try:
            os.chown(path, -1, gid)
            os.chmod(path, 0o660)
        except OSError as exc:
            raise KVStoreError(
                f"cannot give {path} to group {gid} ({exc.strerror}); the daemon's user must be a member of server.socket_group."
            ) from exc


def _open_tiers(config: DaemonConfig) -> list:
    tiers: list = [HostTier(config.host)]
    if config.nvme is not None:
        try:
            tiers.append(NvmeTier(config.nvme))
        except TierUnavailable as exc:
            logger.error("NVMe tier disabled, serving from memory only: %s", exc)
    return tiers


def _allocation_line(tier: HostTier | NvmeTier) -> str:
    """What a tier takes from the machine, where, and what becomes of it at stop."""
    if isinstance(tier, HostTier):
        return (
            f"host tier: {_gib(tier.config.capacity_bytes)} of shared memory reserved in {tier.path} "
            "(removed when the daemon stops; host.capacity_bytes sets it)"
        )
    files = tier.slot_paths
    return (
        f"NVMe tier: {_gib(tier.capacity_bytes)} preallocated in {len(files)} slot file(s) under {tier.config.directory} "
        f"({'O_DIRECT' if tier.uses_direct_io else 'buffered I/O'}; kept for the next start, removed by `kvstore clean` "
        "once the daemon is stopped; nvme.capacity_bytes sets it)"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


async def serve(config: DaemonConfig, ready: asyncio.Event | None = None) -> None:
    from kvstore.api.server import create_grpc_server  # grpc is imported only by the daemon

    server_config = config.server
    socket_path = Path(server_config.socket_path)
    socket_gid = server_config.socket_gid  # None: only this user; else the group that may connect and map the slab
    check_daemon_dir(socket_path.parent, 0o700 if socket_gid is None else 0o750, socket_gid)
    _reclaim_socket(socket_path)
    if not server_config.auth_token:  # gRPC is never open to every local user: a token of this user's own
        server_config = dataclasses.replace(server_config, auth_token=load_or_create_token(server_config.auth_token_file))
    # first, so that settings Redis refuses stop the daemon before it holds any memory
    index, sessions = open_index(config.index)
    await check_access(config.index, index)

    # demotion waits for NVMe: the daemon runs it in the background (housekeeping), never inside a commit
    tiers = _open_tiers(config)
    for tier in tiers:
        logger.info("%s", _allocation_line(tier))
    manager = TierManager(dataclasses.replace(config.manager, demote_on_commit=False), tiers)
    metrics = Metrics()
    node = Node(server_config.node_id, manager, metrics)
    loop = asyncio.get_running_loop()
    manager.on_io_done(_Reaper(loop, manager).io_done)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    transport = open_transport(config.transport, metrics.refused_peer)
    transfers = None if transport is None else TransferService(node, transport, config.transport, index)
    transport_address = "" if transfers is None else await transfers.start()

    host = manager.tier(manager.tier_kinds[0])
    slab_path = str(host.path)
    local = LocalServer(node, slab_path, transfers, server_config.verify_loads, server_config.spin_us / 1e6)
    old_umask = os.umask(0o177 if server_config.socket_mode == 0o600 else 0o117)
    try:
        local_server = await loop.create_unix_server(local.protocol, str(socket_path))
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, server_config.socket_mode)
    if socket_gid is not None:
        _share_with_group((socket_path, Path(slab_path)), socket_gid)

    router = Router(node, index, sessions, config.routing)
    engines = EngineSubscriptions(config.engines, index)
    engine_metrics = EngineMetrics()
    metrics.registry.register(engine_metrics)
    cache_meter = CacheValueMeter(manager, index, node.node_id, server_config.cache_value_half_life_s, server_config.cache_value_interval_s)
    metrics.registry.register(cache_meter)
    prefetcher = Prefetcher(node, transfers)
    grpc_server, grpc_port = create_grpc_server(node, router, server_config, transfers, engines.counters, prefetcher)
    await grpc_server.start()
    node_info = NodeInfo(node.node_id, grpc_address=f"{server_config.grpc_host}:{grpc_port}", transport_address=transport_address)
    publisher = IndexPublisher(index, node_info, manager, config.index)
    publishing = asyncio.create_task(publisher.run(stop))
    engines.start()
    metrics_port = _start_metrics(metrics, server_config.metrics_host, server_config.metrics_port)
    state = {
        "pid": os.getpid(),
        "node_id": node.node_id,
        "socket": str(socket_path),
        "grpc_address": f"{server_config.grpc_host}:{grpc_port}",
        "transport_address": transport_address,
        "metrics_port": metrics_port,
        "host_slab": slab_path,
    }
    state_mode = 0o600 if socket_gid is None else 0o640
    write_state(socket_path, {**state, "auth_token_file": str(server_config.auth_token_file)}, state_mode, socket_gid)
    logger.info(
        "kvstore serving: socket %s, gRPC %s, transport %s, metrics %s",
        socket_path,
        state["grpc_address"],
        transport_address or "off",
        metrics_port,
    )
    surfaces = posture(
        config, socket_path, Path(slab_path), state["grpc_address"], bool(server_config.auth_token), metrics_port, transport_address
    )
    log_posture(surfaces)
    interval = server_config.gc_full_interval_s
    gc_policy = GcPolicy(max(0.0, interval), metrics.gc_pause, freeze=interval >= 0)
    gc_policy.install()

    def refresh() -> None:
        engine_metrics.update(engines)
        gc_policy.housekeeping()
        metrics.gc_frozen(gc_policy.frozen_objects)

    housekeeping = asyncio.create_task(_housekeeping(node, transfers, refresh, stop))
    demotion = asyncio.create_task(_demotion(manager, stop))
    probing = asyncio.create_task(_probe_loop_lag(metrics, server_config.loop_lag_interval_ms / 1000, stop))
    metering = asyncio.create_task(cache_meter.run(stop))
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        logger.info("stopping: draining requests")
        # every step is attempted whatever the ones before did: the blocks must reach NVMe
        local_server.close()
        await _attempt("stopping the gRPC server", grpc_server.stop(grace=server_config.drain_timeout_s))
        await _attempt("ending the prefetches", prefetcher.close())
        await _attempt("closing the engines' connections", local.close())  # no request reaches the tiers after this
        for task in (housekeeping, demotion, probing, publishing, metering):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await _attempt("ending the engines' KV event subscriptions", engines.stop())
        await _attempt("leaving the index", publisher.leave())
        if transfers is not None:
            await _attempt("closing the transport", transfers.close())
        await _attempt("closing the index", index.close())
        try:
            node.close_all_sessions()
            manager.wait_moves()
            persisted = manager.persist()
            logger.info("moved %d memory blocks to NVMe before stopping", persisted)
        except Exception:
            logger.exception("moving memory blocks to NVMe failed; the ones not moved are lost to the restart")
        finally:
            manager.close()
            gc_policy.uninstall()
            socket_path.unlink(missing_ok=True)
            state_path_for(socket_path).unlink(missing_ok=True)
        logger.info("stopped")


async def _attempt(what: str, step) -> None:
    try:
        await step
    except Exception:
        logger.exception("%s failed; stopping anyway", what)


async def _housekeeping(node: Node, transfers: TransferService | None, refresh, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            node.housekeeping()
            refresh()
            if transfers is not None:
                transfers.housekeeping()
        except Exception:  # a failed tick must not stop the daemon
            logger.exception("housekeeping failed")
        await asyncio.sleep(HOUSEKEEPING_PERIOD_S)


async def _demotion(manager: TierManager, stop: asyncio.Event) -> None:
    """Keep every tier under its high watermark, demoting off the loop: a step's NVMe writes
    are awaited while the loop serves everything else."""
    while not stop.is_set():
        try:
            await run_steps(manager.relieve_pressure_steps())
        except Exception:  # a failed round must not stop the daemon
            logger.exception("demotion failed")
        await asyncio.sleep(HOUSEKEEPING_PERIOD_S)


async def _probe_loop_lag(metrics: Metrics, interval_s: float, stop: asyncio.Event) -> None:
    """Sample how late the loop runs a timer: every request waits at least that long."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        metrics.loop_lag.observe(max(0.0, loop.time() - due))


class _Reaper:
    """Applies the outcome of NVMe moves on the loop's thread as their I/O ends: the I/O
    threads only schedule it, once per burst of completions."""

    def __init__(self, loop: asyncio.AbstractEventLoop, manager: TierManager) -> None:
        self._loop, self._manager = loop, manager
        self._lock = threading.Lock()
        self._scheduled = False

    def io_done(self) -> None:  # on an I/O thread
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is gone
            self._loop.call_soon_threadsafe(self._reap)

    def _reap(self) -> None:
        with self._lock:
            self._scheduled = False
        self._manager.reap()


def _start_metrics(metrics: Metrics, host: str, port: int) -> int | None:
    if port < 0:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server.server_port


def run(config: DaemonConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _event_loop_runner(config.server.event_loop)(serve(config))


def _event_loop_runner(choice: str):
    """uvloop's ``run`` where it is asked for or, with "auto", installed; else asyncio's."""
    if choice == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise KVStoreError("server.event_loop is 'uvloop' but uvloop is not installed; pip install uvloop, or choose 'auto'.") from None
        return asyncio.run
    return uvloop.run
