"""Peer authentication: the handshake every channel starts with, and the seal on its frames.

Who may talk to a daemon's peer port, and what each mode protects against someone on the
network between two nodes:

    mode                          who may connect               bytes tampered     bytes read
    fleet secret                  holders of the secret         refused (MAC)      readable
    mutual TLS                    certificates from tls_ca      refused (TLS)      encrypted
    secret and TLS                both                          refused (TLS)      encrypted
    none (loopback, or allowed)   anyone who reaches the port   checksum only      readable

Every channel starts with a handshake of AUTH frames, before any request is served:

    connecting side                              accepting side
    AUTH {v, role, nonce_c}               →
                                          ←      AUTH {nonce_s, proof_s}
    AUTH {proof_c}                        →      (the first request follows at once)

With a fleet secret, ``proof = HMAC-SHA256(role key, side | nonce_c | nonce_s)``: each side
proves it holds the secret without sending it, over fresh nonces of both, so a recorded
handshake proves nothing later. The role key is derived from the fleet key per role: a
``daemon`` may make every request, a ``reader`` (an engine reading blocks from a peer
itself, kvstore/remote_read.py) may only fetch, so an engine never holds a credential
that could store blocks. Without TLS, both sides then derive a session key per direction
from the same nonces and every later frame carries a counter and a MAC over its header and
payload (an AES-256-GCM tag, transport/wire.py): a forged, altered, replayed, reordered
or reflected frame is refused.
With TLS, the TLS handshake comes first and authenticates both ends by certificate; the
channel protects the frames, which carry no MAC.

The handshake is sans-IO here (`ClientHandshake`, `ServerHandshake`); the daemon's
transports run it over a `Channel` (``authenticate_client``, ``authenticate_server``) and
an engine's direct read over its own socket. A handshake frame is at most
HANDSHAKE_BYTES, so a peer that has not authenticated cannot make a daemon allocate more.
A refusal is an ERROR frame with a sentence, logged once a minute per source and counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.errors import CorruptBlock, InvalidArgument, KVStoreError, PermissionDenied, TransferFailed
from kvstore.transport.wire import MAC_BYTES, FrameHeader, FrameKind, control_header, decode_control, encode_control

if TYPE_CHECKING:
    from kvstore.transport.base import Buffer, Channel
    from kvstore.transport.config import TransportConfig

__all__ = [
    "HANDSHAKE_BYTES",
    "ROLES",
    "PeerAuth",
    "Seal",
    "ClientHandshake",
    "ServerHandshake",
    "RefusalLog",
    "authenticate_client",
    "authenticate_server",
    "source_of",
    "check_handshake_header",
    "handshake_message",
]

logger = logging.getLogger(__name__)

HANDSHAKE_VERSION = 1
HANDSHAKE_BYTES = 1024  # the most an AUTH frame (or a refusal of one) may announce
NONCE_BYTES = 32
ROLES = ("daemon", "reader")
_FLEET_KEY_CONTEXT = "kvstore 2026 peer fleet key v1"
REFUSAL_LOG_INTERVAL_S = 60.0


def fleet_key(secret: str | bytes) -> bytes:
    """The key every proof derives from: the secret itself is never used as a key."""
    material = secret.encode() if isinstance(secret, str) else secret
    return blake3.blake3(material, derive_key_context=_FLEET_KEY_CONTEXT).digest()


def _role_key(key: bytes, role: str) -> bytes:
    return hmac.new(key, b"kvstore role " + role.encode(), hashlib.sha256).digest()


def _derive(role_key: bytes, label: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(role_key, label + nonce_c + nonce_s, hashlib.sha256).digest()


class Seal:
    """The MAC and counter of every frame on one authenticated channel, each direction.

    Owner: the channel it belongs to (one task sends, one receives: the counters need no lock).
    """

    __slots__ = ("_send", "_receive", "sent", "received")

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        # a key per direction: a frame reflected back to its sender fails its MAC there
        self._send, self._receive = AESGCM(send_key), AESGCM(receive_key)
        self.sent = 0
        self.received = 0

    @classmethod
    def of(cls, role_key: bytes, nonce_c: bytes, nonce_s: bytes, client_side: bool) -> Seal:
        """The seal of one side of a handshake over ``nonce_c`` and ``nonce_s``."""
        to_server = _derive(role_key, b"session client to server", nonce_c, nonce_s)
        to_client = _derive(role_key, b"session server to client", nonce_c, nonce_s)
        return cls(to_server, to_client) if client_side else cls(to_client, to_server)

    def sign(self, header: FrameHeader, payload: Buffer) -> FrameHeader:
        counted = dataclasses.replace(header, counter=self.sent)
        self.sent += 1
        return dataclasses.replace(counted, mac=self._mac(self._send, counted, payload))

    def check_order(self, header: FrameHeader) -> None:
        """CorruptBlock unless ``header`` is the next frame the peer sent (none dropped,
        replayed or reordered on the way)."""
        if header.counter != self.received:
            raise CorruptBlock(
                f"a frame arrived as number {header.counter} where {self.received} was due: "
                "frames were dropped, replayed or reordered on the way."
            )
        self.received += 1

    def verify(self, header: FrameHeader, payload: Buffer) -> None:
        if not hmac.compare_digest(self._mac(self._receive, header, payload), header.mac):
            raise CorruptBlock(f"a {header.kind.name} frame failed its MAC: it was altered on the way or forged; it was dropped.")

    @staticmethod
    def _mac(aead: AESGCM, header: FrameHeader, payload: Buffer) -> bytes:
        """The GCM tag over the header (encrypted, and the ciphertext dropped) and the payload
        (authenticated as associated data): GMAC, at memory speed where the CPU has AES and
        carry-less multiply instructions. The nonce is the frame's counter, which never
        repeats under a session key (one per direction, per connection)."""
        nonce = header.counter.to_bytes(12, "little")
        return aead.encrypt(nonce, header.signed_part(), payload if header.length else None)[-MAC_BYTES:]


@dataclass(frozen=True, slots=True)
class Authenticated:
    """What a completed handshake established about the other end."""

    role: str  # what the other end may ask for ("daemon": everything; "reader": fetch only)
    by: str  # "secret", "tls", "secret+tls" or "none"
    seal: Seal | None  # None where TLS protects the channel, or nothing authenticates it


@dataclass(frozen=True, slots=True)
class PeerAuth:
    """How this node authenticates its peers and itself: the fleet key (None: no secret),
    the TLS contexts (None: no TLS), and the role it connects as."""

    key: bytes | None = field(default=None, repr=False)
    server_tls: ssl.SSLContext | None = None
    client_tls: ssl.SSLContext | None = None
    role: str = "daemon"
    on_refused: Callable[[str], None] | None = field(default=None, compare=False)  # counts refusals by reason

    @property
    def required(self) -> bool:
        return self.key is not None or self.server_tls is not None or self.client_tls is not None

    @classmethod
    def from_config(cls, config: TransportConfig, on_refused: Callable[[str], None] | None = None) -> PeerAuth:
        """Read the secret and certificates the config names; ConfigurationError with a
        sentence for a file that cannot be read or a certificate that does not load."""
        key = None
        if config.peer_secret:
            key = fleet_key(config.peer_secret)
        elif config.peer_secret_file:
            key = fleet_key(read_secret_file(Path(config.peer_secret_file)))
        server_tls = client_tls = None
        if config.uses_tls:
            server_tls = tls_context(config.tls_cert, config.tls_key, config.tls_ca, server_side=True)
            client_tls = tls_context(config.tls_cert, config.tls_key, config.tls_ca, server_side=False)
        return cls(key, server_tls, client_tls, "daemon", on_refused)

    def role_key(self, role: str) -> bytes:
        """The key proofs for ``role`` derive from. A daemon's ``key`` is the fleet key, from
        which every role's derives; a reader's is its own role key, and proves nothing else."""
        assert self.key is not None
        if self.role == "daemon":
            return _role_key(self.key, role)
        if role != self.role:
            raise PermissionDenied(f"a {self.role} credential cannot act as a {role}.")
        return self.key

    def for_reader(self) -> PeerAuth:
        """The credentials an engine on this host reads peers' blocks with: the reader key
        (fetch only), never the fleet key."""
        key = None if self.key is None else _role_key(self.key, "reader")
        return PeerAuth(key, None, self.client_tls, "reader", None)


def read_secret_file(path: Path) -> str:
    try:
        info = path.stat()
        text = path.read_text().strip()
    except OSError as exc:
        raise InvalidArgument(f"cannot read transport.peer_secret_file {path}: {exc.strerror or exc}.") from exc
    if info.st_mode & 0o077:
        raise InvalidArgument(f"transport.peer_secret_file {path} is readable by others (mode {oct(info.st_mode & 0o777)}); chmod 600 it.")
    from kvstore.transport.config import MIN_SECRET_CHARS

    if len(text) < MIN_SECRET_CHARS:
        raise InvalidArgument(f"the secret in {path} must be at least {MIN_SECRET_CHARS} characters (e.g. `openssl rand -hex 32`).")
    return text


def tls_context(cert: str, key: str, ca: str, server_side: bool) -> ssl.SSLContext:
    """A TLS 1.3 context that presents ``cert`` and requires the other end's certificate
    to chain to ``ca``; a client also checks the peer's name against the address it dialled."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(cert, key)
        context.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgument(
            f"cannot load the transport's TLS files (tls_cert {cert}, tls_key {key}, tls_ca {ca}): {getattr(exc, 'strerror', None) or exc}."
        ) from exc
    return context


# -- the handshake, sans IO --------------------------------------------------------------------
class ClientHandshake:
    """The connecting side: ``hello()``, then ``finish(reply)`` → (the proof to send, what was established)."""

    def __init__(self, auth: PeerAuth, tls: bool) -> None:
        self.auth, self.tls = auth, tls
        self.nonce = os.urandom(NONCE_BYTES)

    def hello(self) -> dict[str, Any]:
        return {"v": HANDSHAKE_VERSION, "role": self.auth.role, "nonce": self.nonce}

    def finish(self, reply: Any) -> tuple[dict[str, Any], Authenticated]:
        if not isinstance(reply, dict) or not isinstance(reply.get("nonce"), bytes) or len(reply["nonce"]) != NONCE_BYTES:
            raise TransferFailed("the peer's handshake reply is malformed; it is not a kvstore daemon of this version.")
        nonce_s = reply["nonce"]
        proof_s = reply.get("proof")
        if self.auth.key is None:
            if proof_s is not None:
                raise PermissionDenied(
                    "the peer requires a fleet secret this node does not have; set transport.peer_secret as on the other nodes."
                )
            return {}, Authenticated("daemon", "tls" if self.tls else "none", None)
        role_key = self.auth.role_key(self.auth.role)
        expected = _derive(role_key, b"server", self.nonce, nonce_s)
        if not isinstance(proof_s, bytes) or not hmac.compare_digest(proof_s, expected):
            raise PermissionDenied("the peer did not prove it holds the fleet secret; no block is sent to or taken from it.")
        seal = None if self.tls else Seal.of(role_key, self.nonce, nonce_s, client_side=True)
        proof = {"proof": _derive(role_key, b"client", self.nonce, nonce_s)}
        return proof, Authenticated("daemon", "secret+tls" if self.tls else "secret", seal)


class ServerHandshake:
    """The accepting side: ``reply(hello)``, then ``finish(proof)`` → what was established.
    Each refusal is a PermissionDenied (or InvalidArgument) whose sentence the peer is sent."""

    def __init__(self, auth: PeerAuth, tls: bool) -> None:
        self.auth, self.tls = auth, tls
        self.nonce = os.urandom(NONCE_BYTES)
        self._hello: dict[str, Any] = {}

    def reply(self, hello: Any) -> dict[str, Any]:
        if not isinstance(hello, dict) or hello.get("v") != HANDSHAKE_VERSION:
            raise InvalidArgument(f"a channel must open with a version-{HANDSHAKE_VERSION} handshake; upgrade the peer.")
        nonce, role = hello.get("nonce"), hello.get("role")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES or role not in ROLES:
            raise InvalidArgument("the handshake's nonce or role is malformed.")
        self._hello = hello
        if self.auth.key is None:
            return {"nonce": self.nonce}
        role_key = self.auth.role_key(role)
        return {"nonce": self.nonce, "proof": _derive(role_key, b"server", nonce, self.nonce)}

    @property
    def expects_proof(self) -> bool:
        return self.auth.key is not None

    def finish(self, proof: Any) -> Authenticated:
        role = self._hello["role"]
        if self.auth.key is None:
            # no secret: TLS authenticated the other end (or nothing does, on a trusted network)
            return Authenticated(role if self.tls else "daemon", "tls" if self.tls else "none", None)
        role_key = self.auth.role_key(role)
        expected = _derive(role_key, b"client", self._hello["nonce"], self.nonce)
        if not isinstance(proof, dict) or not isinstance(proof.get("proof"), bytes) or not hmac.compare_digest(proof["proof"], expected):
            raise PermissionDenied("the peer did not prove it holds the fleet secret (transport.peer_secret differs, or none is set).")
        seal = None if self.tls else Seal.of(role_key, self._hello["nonce"], self.nonce, client_side=False)
        return Authenticated(role, "secret+tls" if self.tls else "secret", seal)


# -- over a channel ---------------------------------------------------------------------------
async def authenticate_client(channel: Channel, auth: PeerAuth, timeout_s: float) -> Authenticated:
    """Run the connecting side's handshake on ``channel`` (after TLS, where it has it) and
    seal it; TransferFailed or PermissionDenied if the peer is not one this node trusts."""
    try:
        async with asyncio.timeout(timeout_s):
            await channel.secure()
            handshake = ClientHandshake(auth, channel.encrypted)
            await _send(channel, handshake.hello())
            proof, established = handshake.finish(await _receive(channel))
            if auth.key is not None:
                await _send(channel, proof)
    except TimeoutError as exc:
        raise TransferFailed(f"the handshake with {channel.peer} did not finish within {timeout_s:g} s.") from exc
    channel.seal = established.seal
    return established


async def authenticate_server(channel: Channel, auth: PeerAuth, timeout_s: float, refusals: RefusalLog) -> Authenticated | None:
    """Run the accepting side's handshake; None (the channel is to be closed, the attempt
    logged and counted) unless the peer proved what this node requires."""
    from kvstore.transport.peer import send_error  # peer.py imports this module's users

    try:
        async with asyncio.timeout(timeout_s):
            await channel.secure()
            handshake = ServerHandshake(auth, channel.encrypted)
            await _send(channel, handshake.reply(await _receive(channel)))
            established = handshake.finish(await _receive(channel) if handshake.expects_proof else None)
    except TimeoutError:
        refusals.refused(channel.peer, "timeout", f"no handshake within {timeout_s:g} s")
        return None
    except (PermissionDenied, InvalidArgument, CorruptBlock) as exc:
        refusals.refused(channel.peer, "refused", str(exc))
        await send_error(channel, 0, exc)
        return None
    except (KVStoreError, ssl.SSLError, OSError) as exc:
        refusals.refused(channel.peer, "failed", str(exc))
        return None
    channel.seal = established.seal
    return established


async def _send(channel: Channel, message: dict[str, Any]) -> None:
    payload = encode_control(message)
    await channel.send(control_header(FrameKind.AUTH, 0, payload), payload)


async def _receive(channel: Channel) -> Any:
    header = await channel.recv_header()
    check_handshake_header(header)
    return handshake_message(header, await channel.recv_bytes(header), channel.peer)


def check_handshake_header(header: FrameHeader) -> None:
    """Before a handshake frame's payload is received: its bound (HANDSHAKE_BYTES)."""
    if header.length > HANDSHAKE_BYTES:
        raise InvalidArgument(f"a handshake frame announced {header.length} bytes, over the {HANDSHAKE_BYTES}-byte bound.")


def handshake_message(header: FrameHeader, payload: bytes, peer: str) -> Any:
    """The AUTH message a handshake frame carries; PermissionDenied for the peer's refusal,
    InvalidArgument for any other kind of frame."""
    if header.kind is FrameKind.ERROR:
        refusal = decode_control(header, payload)
        sentence = refusal[1] if isinstance(refusal, list) and len(refusal) == 2 else "a malformed refusal"
        raise PermissionDenied(f"the peer {peer} refused the handshake: {sentence}")
    if header.kind is not FrameKind.AUTH:
        raise InvalidArgument(f"a channel must open with the authentication handshake, not a {header.kind.name} frame.")
    return decode_control(header, payload)


class RefusalLog:
    """Refused connection attempts: each counted (``on_refused(reason)``), logged at most
    once a minute per source with how many there were, so a flood cannot flood the log."""

    def __init__(self, on_refused: Callable[[str], None] | None = None, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.on_refused = on_refused
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # source → (when last logged, attempts since)

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)
        source = source_of(peer)
        now = time.monotonic()
        logged, since = self._last.get(source, (float("-inf"), 0))
        if now - logged < self.interval_s:
            self._last[source] = (logged, since + 1)
            return
        if len(self._last) > 4096:  # many sources: forget the quiet ones
            self._last = {s: v for s, v in self._last.items() if now - v[0] < self.interval_s}
        self._last[source] = (now, 0)
        more = f" ({since} more attempts since the last report)" if since else ""
        logger.warning("refused a peer connection from %s (%s): %s%s", source, reason, sentence, more)


def source_of(peer: str) -> str:
    """The host part of a peer's address: attempts from one host are reported together."""
    rest = peer.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    return host if sep and port.isdigit() else rest
