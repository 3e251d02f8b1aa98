"""Which transport a daemon runs, from its ``[transport]`` config."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstore.errors import TransportUnavailable
from kvstore.transport.auth import PeerAuth
from kvstore.transport.base import Transport
from kvstore.transport.config import TransportConfig
from kvstore.transport.tcp import TcpTransport

__all__ = ["open_transport"]

logger = logging.getLogger(__name__)


def open_transport(config: TransportConfig, on_refused: Callable[[str], None] | None = None) -> Transport | None:
    """``off``: none; ``tcp``; ``ucx`` (TransportUnavailable, saying what to install, without
    ucxx); ``auto``: UCX where ucxx imports and loads libucx, TCP otherwise (and TCP where
    the fleet uses TLS, which UCX does not carry). ``on_refused(reason)`` counts the peer
    connections refused before any request."""
    if config.kind == "off":
        return None
    auth = PeerAuth.from_config(config, on_refused)
    if config.kind == "tcp" or (config.kind == "auto" and config.uses_tls):
        return TcpTransport(config, auth)
    from kvstore.transport.ucx import UcxTransport

    if config.kind == "ucx":
        return UcxTransport(config, auth)
    try:
        transport: Transport = UcxTransport(config, auth)
    except TransportUnavailable as exc:
        logger.info("transport.kind = auto: TCP, because %s", exc)
        return TcpTransport(config, auth)
    logger.info("transport.kind = auto: UCX")
    return transport
