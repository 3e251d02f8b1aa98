"""The vLLM connector's scheduler holds the blocks it counts until its workers load them.

tests/vllm_scheduler_holds.py runs in the vLLM venv and drives the scheduler side step by
step, as vLLM's scheduler does, against a real daemon whose host tier another writer
floods between the lookup and the load.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from daemon_harness import daemons
from vllm_venv import require_vllm_venv

from bench.vllm_engine import VLLM_PYTHON

SCRIPT = Path(__file__).with_name("vllm_scheduler_holds.py")

require_vllm_venv()
pytestmark = pytest.mark.slow


def test_the_blocks_a_scheduler_counted_are_held_until_its_load_window_has_passed(tmp_path):
    with daemons(tmp_path) as start:
        daemon = start(extra={"nvme.enabled": "false"})
        run = subprocess.run(
            [str(VLLM_PYTHON), str(SCRIPT), str(daemon.socket), str(daemon.state["metrics_port"])],
            capture_output=True,
            text=True,
            timeout=300,
        )
    cases = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and len(cases) == 14, run.stdout[-3000:] + run.stderr[-3000:]
    assert all(case["ok"] for case in cases), cases
