"""The SGLang and LMCache connector suites, run in .venv-engines.

sglang (installed without its dependencies) and LMCache (which pins numpy, setuptools
and CUDA libraries of its own) live in their own venv, which `make test` builds
(`make engines-venv`). Each suite runs there in a pytest of its own; a failure shows
that run's report here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINES_PYTHON = ROOT / ".venv-engines" / "bin" / "python"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.mark.parametrize("suite", ["sglang", "lmcache"])
def test_connector_suite(suite):
    if not ENGINES_PYTHON.exists():
        pytest.fail(f"{ENGINES_PYTHON} is missing; `make engines-venv` builds it (`make test` does so itself).")
    command = [
        str(ENGINES_PYTHON),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::DeprecationWarning",
        f"tests/engines/{suite}_suite.py",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1100)
    report = result.stdout[-8000:] + result.stderr[-4000:]
    assert result.returncode == 0, report
    assert " passed" in result.stdout.splitlines()[-1] and " failed" not in result.stdout.splitlines()[-1], report
