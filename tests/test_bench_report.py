"""Every bench prints, next to each ratio, the two figures it divides: a quotient goes
through ``Report.compare``, which keeps both, never through ``Report.ratio`` alone."""

from __future__ import annotations

import ast
from pathlib import Path

from bench.report import Report

BENCH = Path(__file__).resolve().parent.parent / "bench"


def quotients_reported_bare(source: str) -> list[str]:
    """The ``….ratio(name, a / b, …)`` calls of ``source``: a quotient without its figures."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "ratio"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.BinOp)
            and isinstance(node.args[1].op, ast.Div)
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_bench_reports_a_quotient_without_the_two_figures_it_divides():
    bare = {path.name: calls for path in sorted(BENCH.rglob("*.py")) if (calls := quotients_reported_bare(path.read_text()))}
    assert not bare, bare


def test_the_check_finds_a_bare_quotient():
    assert quotients_reported_bare("report.ratio('x', a['n'] / b['n'], '<= 0.3')")
    assert not quotients_reported_bare("report.compare('x', a['n'], b['n'], 'GB/s', '<= 0.3')")


def test_compare_prints_both_figures_beside_the_ratio(capsys):
    report = Report("fleet")
    report.compare("prefill_tokens_vs_round_robin", 244.667, 932.0, "prefill tokens / request", "<= 0.3")
    report.print_ratios()
    row = next(line for line in capsys.readouterr().out.splitlines() if "prefill_tokens_vs_round_robin" in line)
    assert row.split()[1:5] == ["0.263", "244.667", "932.000", "prefill"] and row.split()[-1] == "yes"
    figures = report.figures["prefill_tokens_vs_round_robin"]
    assert figures == {"numerator": 244.667, "denominator": 932.0, "unit": "prefill tokens / request"}
