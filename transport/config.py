"""How a daemon talks to its peers: which transport, where it listens, how it streams, and
who may talk to it (transport/auth.py says what each way of authenticating protects)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument

__all__ = ["TransportConfig", "TRANSPORT_KINDS"]

TRANSPORT_KINDS = ("tcp", "ucx", "auto", "off")
UCX_PROGRESS_MODES = ("event", "thread", "blocking", "polling", "thread-polling")  # kvstore's, then ucxx's


@dataclass(frozen=True, slots=True)
class TransportConfig:
    kind: str = "tcp"  # "ucx" needs the [ucx] extra; "auto" takes UCX when it imports, else TCP
    host: str = "127.0.0.1"  # the address peers reach this node at (listened on and advertised)
    port: int = 0  # 0 picks a free port; the index tells peers which
    window_blocks: int = 16  # blocks in flight per transfer before the sender waits
    connect_timeout_s: float = 3.0
    fetch_deadline_s: float = 2.0  # a remote fetch returns what arrived by then
    handoff_timeout_s: float = 60.0  # an unfinished prefill→decode handoff is cancelled after this
    peer_idle_timeout_s: float = 30.0  # a peer's conversation that makes no progress this long is broken off
    max_peer_channels: int = 64  # channels peers may hold open to this daemon at once
    max_peer_channels_per_source: int = 16  # of them, from one address
    # Peer authentication. Every channel starts with a handshake; with a fleet secret, each
    # side proves it holds it (challenge and response, both ways) and, where TLS does not
    # protect the channel, every frame carries a keyed MAC. With TLS, certificates signed by
    # tls_ca authenticate both ends (mutual TLS) and the channel is encrypted. A daemon that
    # listens on, or advertises, an address other than loopback refuses to start with
    # neither, unless allow_unauthenticated says the network is trusted.
    peer_secret: str = field(default="", repr=False)  # or KVSTORE_TRANSPORT_PEER_SECRET
    peer_secret_file: str = ""  # a file holding the secret (read at start; keep it 0600)
    tls_cert: str = ""  # this node's certificate chain (PEM), presented to peers both ways
    tls_key: str = ""  # its private key (PEM)
    tls_ca: str = ""  # the CA bundle peers' certificates must chain to
    allow_unauthenticated: bool = False
    handshake_timeout_s: float = 3.0  # a connection that has not authenticated by then is closed
    # UCX tuning the daemon applies unless the environment already sets them: rendezvous by
    # put_zcopy, and kvstore's event-driven progress on the event loop (transport/
    # ucx_progress.py: polls while a transfer moves, sleeps in epoll when idle); ucxx's own
    # "thread" mode idles as cheaply but hands every completion across two threads, and
    # its "blocking" mode keeps a core busy while a receive is posted
    ucx_rndv_scheme: str = "put_zcopy"
    ucx_progress_mode: str = "event"

    def __post_init__(self) -> None:
        if self.kind not in TRANSPORT_KINDS:
            raise InvalidArgument(f"transport.kind must be one of {', '.join(TRANSPORT_KINDS)}, got {self.kind!r}.")
        if self.ucx_progress_mode not in UCX_PROGRESS_MODES:
            raise InvalidArgument(
                f"transport.ucx_progress_mode must be one of {', '.join(UCX_PROGRESS_MODES)}, got {self.ucx_progress_mode!r}."
            )
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"transport.port must lie in [0, 65535], got {self.port}.")
        if self.window_blocks <= 0 or self.max_peer_channels <= 0:
            raise InvalidArgument("transport.window_blocks and transport.max_peer_channels must be positive.")
        for name in ("connect_timeout_s", "fetch_deadline_s", "handoff_timeout_s", "peer_idle_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"transport.{name} must be positive, got {getattr(self, name)}.")
        if self.peer_secret and self.peer_secret_file:
            raise InvalidArgument("set transport.peer_secret or transport.peer_secret_file, not both.")
        if self.peer_secret and len(self.peer_secret) < MIN_SECRET_CHARS:
            raise InvalidArgument(
                f"transport.peer_secret must be at least {MIN_SECRET_CHARS} characters (e.g. `openssl rand -hex 32`); "
                f"a short secret can be guessed offline from one recorded handshake."
            )
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise InvalidArgument(
                "mutual TLS needs transport.tls_cert, transport.tls_key and transport.tls_ca together "
                "(the CA is what peers' certificates are checked against)."
            )
        if all(tls) and self.kind == "ucx":
            raise InvalidArgument(
                "TLS protects the TCP transport only; UCX peers authenticate with transport.peer_secret (and a MAC on every frame)."
            )
        if self.kind != "off" and not self.authenticates and not self.allow_unauthenticated and not is_loopback(self.host):
            raise InvalidArgument(
                f"transport.host = {self.host!r} exposes the peer port beyond this host, and nothing authenticates peers: "
                "anyone who reaches it could read or plant KV. Set transport.peer_secret (the same on every node; "
                "e.g. `openssl rand -hex 32`, or KVSTORE_TRANSPORT_PEER_SECRET) and/or transport.tls_cert, tls_key and tls_ca; "
                "or, only on a network you trust, transport.allow_unauthenticated = true."
            )

    @property
    def authenticates(self) -> bool:
        """Whether peers must prove who they are (a fleet secret, or mutual TLS)."""
        return bool(self.peer_secret or self.peer_secret_file or self.tls_cert)

    @property
    def uses_tls(self) -> bool:
        return bool(self.tls_cert)


MIN_SECRET_CHARS = 32


def is_loopback(host: str) -> bool:
    """Whether only this host can reach ``host`` (a name other than localhost may resolve anywhere)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
