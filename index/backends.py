"""Open the index backend a configuration names: ``embedded`` or a Redis URL."""

from __future__ import annotations

from kvstore.config import IndexConfig
from kvstore.index.base import Index, SessionStore

__all__ = ["open_index"]


def open_index(config: IndexConfig) -> tuple[Index, SessionStore]:
    """The block-location index and the session store of the same backend (so that every
    router replica that shares the index shares the sessions too)."""
    if config.backend == "embedded":
        from kvstore.index.embedded import EmbeddedIndex
        from kvstore.index.sessions import EmbeddedSessionStore

        return EmbeddedIndex(), EmbeddedSessionStore()
    from kvstore.index.redis import RedisIndex, RedisSessionStore  # redis-py only where configured

    # one connection for both; the index owns it and closes it with itself
    index = RedisIndex.from_url(config.backend)
    return index, RedisSessionStore(config.backend, client=index.client)
