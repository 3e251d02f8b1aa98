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
    report = failure_report(result.stdout, result.stderr)
    assert result.returncode == 0, report
    assert " passed" in result.stdout.splitlines()[-1] and " failed" not in result.stdout.splitlines()[-1], report


def failure_report(stdout: str, stderr: str, head: int = 12000, tail: int = 3000) -> str:
    """What a failed sub-run shows here: the start of its failures section, where each
    failing assertion and its traceback stand (an engine's warnings captured after them
    can run to megabytes, and a report cut to the run's tail kept only those), then the
    run's last lines (the summary)."""
    start = stdout.find("= FAILURES =")
    if start < 0:
        start = stdout.find("= ERRORS =")
    if start < 0:
        return stdout[-head:] + stderr[-tail:]
    failures = stdout[start:]
    if len(failures) <= head + tail:
        return failures + stderr[-tail:]
    return failures[:head] + "\n[... cut ...]\n" + failures[-tail:] + stderr[-tail:]


def test_a_failure_report_keeps_the_failing_assertion_ahead_of_the_warnings_after_it():
    warnings = "WARNING MemoryObj was garbage collected\n" * 5000
    stdout = (
        "....F...\n"
        "=================================== FAILURES ===================================\n"
        "___ test_gets_miss ___\n"
        ">       assert e.remote.contains(key)\n"
        "E       AssertionError: assert False\n"
        "----------------------------- Captured log call ------------------------------\n"
        + warnings
        + "=========================== short test summary info ============================\n"
        "FAILED tests/engines/lmcache_suite.py::test_gets_miss - AssertionError\n"
        "1 failed, 7 passed in 40.1s\n"
    )
    report = failure_report(stdout, "stderr tail")
    assert "E       AssertionError: assert False" in report
    assert "1 failed, 7 passed" in report and report.endswith("stderr tail")
    assert len(report) < 20000
    # the report the test kept before: the run's tail only
    assert "AssertionError: assert False" not in stdout[-8000:]
