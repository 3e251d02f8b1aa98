"""The PD producer's handoff sender without an engine: tests/vllm_handoff_sender.py, run
in the vLLM venv (the connector's modules import vLLM)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from vllm_venv import require_vllm_venv

from bench.vllm_engine import ENGINE_ENV, VLLM_PYTHON

require_vllm_venv()

SCRIPT = Path(__file__).with_name("vllm_handoff_sender.py")


def test_the_sender_finishes_its_handoffs_beside_the_steps():
    result = subprocess.run([str(VLLM_PYTHON), str(SCRIPT)], capture_output=True, text=True, timeout=120, env={**os.environ, **ENGINE_ENV})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
