"""A raw TCP connection to a daemon's peer port, as a test peer (or an attacker) opens one:
authenticated by the handshake (transport/auth.py) with the credentials given, or with
none, then left to the test to write whatever frames it likes."""

from __future__ import annotations

import socket
import time

from kvstore.remote_read import PeerReader
from kvstore.transport.auth import PeerAuth, Seal
from kvstore.transport.base import split_address

__all__ = ["open_raw"]


def open_raw(address: str, auth: PeerAuth | None = None, timeout_s: float = 5.0) -> tuple[socket.socket, Seal | None]:
    """A blocking socket to ``address`` past the handshake, and the seal its frames must
    carry (None where the daemon authenticates nobody, or TLS protects the channel)."""
    host, port = split_address(address, "tcp")
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setblocking(False)
    reader = PeerReader()
    reader.auth = auth or PeerAuth()
    try:
        connection = reader._authenticate(sock, address, host, time.monotonic() + timeout_s)
    except BaseException:
        sock.close()
        raise
    connection.sock.setblocking(True)
    connection.sock.settimeout(timeout_s)
    connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # the handshake's reads left it at a header
    return connection.sock, connection.seal
