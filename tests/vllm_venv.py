"""The vLLM venv the engine tests run their engines in (``make vllm-venv``)."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

from bench.vllm_engine import VLLM_PYTHON


def require_vllm_venv() -> None:
    """At a test module's top: skip it without the vLLM venv — except under CI, where
    `make test` builds the venv, so its absence is an error."""
    if VLLM_PYTHON.exists():
        return
    if os.environ.get("CI"):
        raise RuntimeError(f"{VLLM_PYTHON} is missing: `make test` should have built it with `make vllm-venv`.")
    pytest.skip(f"no vLLM venv at {VLLM_PYTHON}; run `make vllm-venv`", allow_module_level=True)


def vllm_rpc_sockets() -> set[str]:
    """The IPC sockets vLLM names by UUID in the shared temporary directory (its default
    VLLM_RPC_BASE_PATH), which an engine never removes."""
    pattern = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    return {path.name for path in Path(tempfile.gettempdir()).iterdir() if pattern.fullmatch(path.name) and path.is_socket()}
