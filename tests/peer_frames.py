"""Frames a raw test peer writes and reads on a daemon's peer port, for tests that send
what no daemon would (tests/test_peer_hardening.py, tests/test_fuzz_peer.py).

``peer_connection`` is the one place such a peer connects: it authenticates through the
handshake (tests/peer_wire.py) and keeps the seal its frames must carry where the daemon
requires a fleet secret; every frame goes out through ``send_frame``, which signs it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from peer_wire import open_raw

from kvstore.transport.auth import PeerAuth, Seal
from kvstore.transport.wire import HEADER_BYTES, FrameHeader, FrameKind, control_header, decode_control, encode_control


@dataclass
class RawPeer:
    sock: socket.socket
    seal: Seal | None

    def close(self) -> None:
        self.sock.close()


def peer_connection(address: str, auth: PeerAuth | None = None, receive_buffer: int | None = None) -> RawPeer:
    """A connection to the peer port at ``address``, past the handshake."""
    sock, seal = open_raw(address, auth, timeout_s=10.0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # replies shorter than a header are read as they come
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a small frame after a large one goes at once
    if receive_buffer is not None:  # caps the window: a peer that stops reading stalls its sender sooner
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    return RawPeer(sock, seal)


def send_frame(peer: RawPeer, header: FrameHeader, payload: bytes = b"", tamper=None) -> None:
    """Send a frame, signed where the channel is sealed; ``tamper(frame bytes)`` changes it on the way."""
    if peer.seal is not None:
        header = peer.seal.sign(header, payload)
    frame = header.pack() + payload
    peer.sock.sendall(tamper(frame) if tamper is not None else frame)


def send_message(peer: RawPeer, message: Any, kind: FrameKind = FrameKind.CONTROL, transfer_id: int = 7) -> None:
    payload = encode_control(message)
    send_frame(peer, control_header(kind, transfer_id, payload), payload)


def recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        data += chunk
    return bytes(data)


def recv_frame(peer: RawPeer) -> tuple[FrameHeader, bytes]:
    header = FrameHeader.unpack(recv_exactly(peer.sock, HEADER_BYTES))
    return header, recv_exactly(peer.sock, header.length)


def recv_reply(peer: RawPeer) -> tuple[FrameKind, Any]:
    header, payload = recv_frame(peer)
    return header.kind, decode_control(header, payload)
