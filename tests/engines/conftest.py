"""Fixtures of the SGLang and LMCache connector suites (run in .venv-engines by
tests/test_engine_connectors.py). Nothing here imports an engine: the main test run
loads this file too while it walks tests/."""

from __future__ import annotations

import pytest
from daemon_harness import daemons


@pytest.fixture
def daemon(tmp_path):
    """``daemon(**settings)`` starts a real `kvstore serve` with extra ``--set`` settings."""
    with daemons(tmp_path) as start:
        yield lambda **settings: start(extra=settings)
