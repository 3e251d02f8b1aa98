"""Open the index backend a configuration names: ``embedded`` or a Redis URL, and check at
start that a Redis backend accepts this process."""

from __future__ import annotations

import asyncio
import logging

from kvstore.config import ConfigError, IndexConfig
from kvstore.errors import IndexUnavailable, InvalidArgument
from kvstore.index.base import Index, SessionStore

__all__ = ["open_index", "check_access"]

logger = logging.getLogger(__name__)

# A first contact that takes longer is left to the publisher's retries: a slow or absent
# Redis does not keep a daemon from serving its own blocks.
CHECK_ACCESS_TIMEOUT_S = 5.0


def open_index(config: IndexConfig) -> tuple[Index, SessionStore]:
    """The block-location index and the session store of the same backend (so that every
    router replica that shares the index shares the sessions too)."""
    if config.backend == "embedded":
        from kvstore.index.embedded import EmbeddedIndex
        from kvstore.index.sessions import EmbeddedSessionStore

        return EmbeddedIndex(), EmbeddedSessionStore()
    from kvstore.index.redis import RedisAccess, RedisIndex, RedisSessionStore  # redis-py only where configured

    access = RedisAccess(config.tls_ca, config.tls_cert, config.tls_key, config.username, config.password)
    # one connection for both; the index owns it and closes it with itself
    index = RedisIndex(config.backend, access=access)
    return index, RedisSessionStore(config.backend, client=index.client)


async def check_access(config: IndexConfig, index: Index) -> None:
    """Refuse settings that can never work: a ConfigError when Redis refuses this node's
    credentials or certificates, or presents one that index.tls_ca did not sign. An
    unreachable or slow Redis is only logged: the publisher keeps trying."""
    if config.backend == "embedded":
        return
    from kvstore.index.redis import RedisIndex

    assert isinstance(index, RedisIndex), "open_index opens a RedisIndex for every URL"
    try:
        async with asyncio.timeout(CHECK_ACCESS_TIMEOUT_S):
            await index.check_access()
    except InvalidArgument as exc:
        raise ConfigError(str(exc)) from exc
    except (IndexUnavailable, TimeoutError) as exc:
        logger.warning("the index does not answer yet; this node serves its own blocks and publishes once it does: %s", exc or "timed out")
