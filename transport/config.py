"""How a daemon talks to its peers: which transport, where it listens, how it streams."""

from __future__ import annotations

from dataclasses import dataclass

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
    max_peer_channels: int = 64
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
        for name in ("connect_timeout_s", "fetch_deadline_s", "handoff_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"transport.{name} must be positive, got {getattr(self, name)}.")
