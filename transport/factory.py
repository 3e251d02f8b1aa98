"""Which transport a daemon runs, from its ``[transport]`` config."""

from __future__ import annotations

import logging

from kvstore.errors import TransportUnavailable
from kvstore.transport.base import Transport
from kvstore.transport.config import TransportConfig
from kvstore.transport.tcp import TcpTransport

__all__ = ["open_transport"]

logger = logging.getLogger(__name__)


def open_transport(config: TransportConfig) -> Transport | None:
    """``off``: none; ``tcp``; ``ucx`` (TransportUnavailable, saying what to install, without
    ucxx); ``auto``: UCX where ucxx imports and loads libucx, TCP otherwise."""
    if config.kind == "off":
        return None
    if config.kind == "tcp":
        return TcpTransport(config)
    from kvstore.transport.ucx import UcxTransport

    if config.kind == "ucx":
        return UcxTransport(config)
    try:
        transport: Transport = UcxTransport(config)
    except TransportUnavailable as exc:
        logger.info("transport.kind = auto: TCP, because %s", exc)
        return TcpTransport(config)
    logger.info("transport.kind = auto: UCX")
    return transport
