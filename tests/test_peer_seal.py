"""The handshake and the seal on their own (transport/auth.py, no IO): what a completed
handshake establishes on each side, and that the seal refuses a frame that was forged,
replayed, or reflected back to the side that sent it."""

from __future__ import annotations

import os

import pytest

from kvstore.errors import CorruptBlock, PermissionDenied
from kvstore.transport.auth import ClientHandshake, PeerAuth, ServerHandshake, fleet_key
from kvstore.transport.wire import FrameHeader, block_header

KEY = fleet_key("a fleet secret of at least thirty-two characters")


def handshake(client: PeerAuth, server: PeerAuth):
    """Both sides' view of one handshake over nonces of their own."""
    left, right = ClientHandshake(client, tls=False), ServerHandshake(server, tls=False)
    reply = right.reply(left.hello())
    proof, client_side = left.finish(reply)
    return client_side, right.finish(proof if right.expects_proof else None)


def frame(sequence: int = 0) -> tuple[FrameHeader, bytes]:
    payload = os.urandom(4096)
    return block_header(9, bytes(16), bytes(range(16)), payload, sequence), payload


def test_each_side_accepts_the_others_frames_in_order():
    client, server = handshake(PeerAuth(key=KEY), PeerAuth(key=KEY))
    assert (client.by, server.by, server.role) == ("secret", "secret", "daemon")
    for sequence in range(3):
        header, payload = frame(sequence)
        signed = client.seal.sign(header, payload)
        server.seal.check_order(signed)
        server.seal.verify(signed, payload)
        answer = server.seal.sign(header, payload)
        client.seal.check_order(answer)
        client.seal.verify(answer, payload)


def test_a_frame_reflected_back_to_its_sender_is_refused():
    client, server = handshake(PeerAuth(key=KEY), PeerAuth(key=KEY))
    header, payload = frame()
    signed = client.seal.sign(header, payload)
    client.seal.check_order(signed)  # the counter alone cannot tell: both directions start at 0
    with pytest.raises(CorruptBlock, match="MAC"):
        client.seal.verify(signed, payload)


def test_forged_or_replayed_frames_are_refused():
    client, server = handshake(PeerAuth(key=KEY), PeerAuth(key=KEY))
    header, payload = frame()
    signed = client.seal.sign(header, payload)
    server.seal.check_order(signed)
    with pytest.raises(CorruptBlock, match="MAC"):
        server.seal.verify(signed, bytes([payload[0] ^ 1]) + payload[1:])
    with pytest.raises(CorruptBlock, match="where 1 was due"):
        server.seal.check_order(signed)


def test_a_reader_proves_itself_a_reader_and_nothing_else():
    reader = PeerAuth(key=KEY).for_reader()
    client, server = handshake(reader, PeerAuth(key=KEY))
    assert server.role == "reader" and client.seal is not None
    with pytest.raises(PermissionDenied):
        reader.role_key("daemon")


def test_a_wrong_or_missing_secret_fails_the_handshake_on_both_sides():
    with pytest.raises(PermissionDenied, match="did not prove"):
        handshake(PeerAuth(key=fleet_key("another secret, also thirty-two characters long")), PeerAuth(key=KEY))
    with pytest.raises(PermissionDenied, match="requires a fleet secret"):
        handshake(PeerAuth(), PeerAuth(key=KEY))
    with pytest.raises(PermissionDenied, match="did not prove"):
        handshake(PeerAuth(key=KEY), PeerAuth())
