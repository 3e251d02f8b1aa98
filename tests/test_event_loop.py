"""The daemon's choice of event loop (server.event_loop)."""

import asyncio

import pytest

from kvstore.config import ConfigError, ServerConfig
from kvstore.daemon import _event_loop_runner


def test_auto_takes_uvloop_where_it_is_installed_and_asyncio_is_kept_when_asked_for():
    uvloop = pytest.importorskip("uvloop")
    assert _event_loop_runner("auto") is uvloop.run
    assert _event_loop_runner("uvloop") is uvloop.run
    assert _event_loop_runner("asyncio") is asyncio.run


def test_an_unknown_event_loop_is_a_config_error_that_names_the_field():
    with pytest.raises(ConfigError, match="server.event_loop"):
        ServerConfig(event_loop="trio")
