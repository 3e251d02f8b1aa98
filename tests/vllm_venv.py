"""The vLLM venv the engine tests run their engines in (``make vllm-venv``)."""

from __future__ import annotations

import os

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
