"""The daemon's security posture: one line per surface, saying what answers whom.

Printed at start, so that an operator reads in the log what a security review would ask:
who can reach the local socket, the slab, the NVMe files, gRPC, the metrics and the peer
port, and what protects each. A surface open beyond this host without authentication is
marked OPEN; the transport refuses to start that way unless told to
(``transport.allow_unauthenticated``).
"""

from __future__ import annotations

import grp
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.transport.config import TransportConfig, is_loopback

__all__ = ["Surface", "posture", "log_posture"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Surface:
    name: str
    where: str
    who: str  # who may use it, and what protects it
    open: bool = False  # reachable beyond this host's user (or group) with no credential

    def line(self) -> str:
        return f"security posture: {self.name:<14} {self.where}: {self.who}{' [OPEN]' if self.open else ''}"


def _owner(mode: int, gid: int | None) -> str:
    user = f"uid {os.getuid()}"
    if gid is None or not mode & 0o060:
        return f"{user} only"
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return f"{user} and group {group}"


def _mode_of(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return 0


def _reach(host: str) -> str:
    if is_loopback(host):
        return "this host"
    try:
        if ipaddress.ip_address(host.strip("[]")).is_unspecified:
            return "every interface"
    except ValueError:
        pass
    return f"the network ({host})"


def _transport(config: TransportConfig, address: str) -> Surface:
    if config.kind == "off" or not address:
        return Surface("peer transport", "off", "no peer port")
    reach = _reach(config.host)
    modes = []
    if config.uses_tls:
        modes.append("mutual TLS (certificates from tls_ca; encrypted)")
    if config.peer_secret or config.peer_secret_file:
        modes.append("fleet secret (challenge-response" + ("" if config.uses_tls else "; a keyed MAC on every frame, bytes readable") + ")")
    if modes:
        return Surface("peer transport", address, f"peers authenticated by {' and '.join(modes)}; reachable from {reach}")
    exposed = not is_loopback(config.host)
    return Surface(
        "peer transport",
        address,
        f"NO peer authentication, reachable from {reach}"
        + ("; transport.allow_unauthenticated = true: anyone who reaches it can read and plant KV" if exposed else ""),
        open=exposed,
    )


def posture(
    config,
    socket_path: Path,
    slab_path: Path,
    grpc_address: str,
    grpc_token: bool,
    metrics_port: int | None,
    transport_address: str,
) -> list[Surface]:
    """Every surface of a running daemon (``config``: its DaemonConfig)."""
    server = config.server
    gid = getattr(server, "socket_gid", None)
    socket_mode = _mode_of(socket_path)
    slab_mode = _mode_of(slab_path)
    surfaces = [
        Surface("local socket", str(socket_path), f"mode {oct(socket_mode)}: {_owner(socket_mode, gid)}"),
        Surface("host slab", str(slab_path), f"mode {oct(slab_mode)}: {_owner(slab_mode, gid)} map it (all tenants' KV)"),
    ]
    if config.nvme is None:
        surfaces.append(Surface("NVMe files", "off", "no NVMe tier"))
    else:
        directory = Path(config.nvme.directory)
        mode = _mode_of(directory)
        surfaces.append(Surface("NVMe files", str(directory), f"directory mode {oct(mode)}: {_owner(mode, gid)} read the slot files"))
    grpc_host = grpc_address.rpartition(":")[0]
    surfaces.append(
        Surface(
            "gRPC",
            grpc_address,
            ("bearer token required" if grpc_token else "NO token: every caller may list, read and evict blocks")
            + f"; reachable from {_reach(grpc_host)}",
            open=not grpc_token,
        )
    )
    if metrics_port is None or metrics_port < 0:
        surfaces.append(Surface("metrics", "off", "no endpoint"))
    else:
        surfaces.append(
            Surface(
                "metrics",
                f"{server.metrics_host}:{metrics_port}",
                f"no credential (counters only; tenants named by digest); reachable from {_reach(server.metrics_host)}",
            )
        )
    surfaces.append(_transport(config.transport, transport_address))
    surfaces.append(Surface("router", "separate process", "`kvstore router` prints its own posture (API keys, tenants)"))
    return surfaces


def log_posture(surfaces: list[Surface]) -> None:
    for surface in surfaces:
        (logger.warning if surface.open else logger.info)("%s", surface.line())
    if any(s.open and s.name == "peer transport" for s in surfaces):
        logger.warning(
            "THE PEER PORT IS NOT AUTHENTICATED and listens beyond this host: anyone who reaches it can read every tenant's KV "
            "and plant KV that engines will serve. Set transport.peer_secret or mutual TLS (transport.tls_*) unless this "
            "network is trusted."
        )
