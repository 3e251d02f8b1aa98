"""The benchmark contract (see DESIGN.md): ``--quick``, ``--json``, ratios against a
baseline measured in the same run, and the targets each ratio must meet.

Human-readable tables go to stdout; with ``--json`` the last line of stdout is one JSON
object ``{"bench", "ratios", "targets", "figures", "results"}``. A ratio of two
measurements is recorded with ``compare``, which keeps both figures beside it
(``figures[name]``: numerator, denominator, unit) and prints them next to the ratio —
usually the measurement over its baseline, the baseline's latency over kvstore's for a
speed-up; a figure that is itself the measure (microseconds, a count) is recorded with
``ratio``.
"""

from __future__ import annotations

import argparse
import json
import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Report", "parse_args", "best_of", "best_in_turns", "timings_in_turns", "gbps"]

_OPERATORS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a reduced run that finishes in under a minute")
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON line of ratios and targets")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def best_of(repeats: int, run: Callable[[], float]) -> float:
    """The fastest of ``repeats`` timings (seconds): the least disturbed by the rest of the machine."""
    return min(run() for _ in range(repeats))


def best_in_turns(rounds: int, runs: list[Callable[[], float]]) -> list[float]:
    """The fastest timing of each of ``runs``, which take turns for ``rounds`` rounds: a
    measurement and the baseline it is divided by see the same machine, however its load
    changes during the run."""
    return [min(seconds) for seconds in timings_in_turns(rounds, runs)]


def timings_in_turns(rounds: int, runs: list[Callable[[], float]]) -> list[list[float]]:
    """Every timing of each of ``runs``, which take turns for ``rounds`` rounds, in round order."""
    return [list(seconds) for seconds in zip(*([run() for run in runs] for _ in range(rounds)))]


def median_of(repeats: int, run: Callable[[], float]) -> float:
    return statistics.median(run() for _ in range(repeats))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


@dataclass
class Report:
    bench: str
    ratios: dict[str, float] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: list[dict[str, Any]] = field(default_factory=list)

    def ratio(self, name: str, value: float, target: str | None = None) -> None:
        self.ratios[name] = round(value, 4)
        if target is not None:
            self.targets[name] = target

    def compare(self, name: str, numerator: float, denominator: float, unit: str, target: str | None = None) -> None:
        """The ratio ``numerator / denominator`` (two figures in ``unit`` from this run),
        kept with both figures so that the reader sees what was divided."""
        self.ratio(name, numerator / denominator if denominator else float("inf"), target)
        self.figures[name] = {"numerator": round(numerator, 6), "denominator": round(denominator, 6), "unit": unit}

    def met(self, name: str) -> bool | None:
        target = self.targets.get(name)
        if target is None:
            return None
        op, threshold = target.split()
        return _OPERATORS[op](self.ratios[name], float(threshold))

    def print_table(self, title: str, columns: list[str], rows: list[list[Any]]) -> None:
        cells = [[_cell(v) for v in row] for row in rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        print(f"\n{title}")
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for row in cells:
            print("  ".join(v.rjust(w) for v, w in zip(row, widths)))

    def print_ratios(self) -> None:
        """Every ratio with the two figures it divides (where it divides two) and its target."""
        rows = []
        for name, value in self.ratios.items():
            figures = self.figures.get(name)
            numerator, denominator = ("-", "-") if figures is None else (_cell(figures["numerator"]), _cell(figures["denominator"]))
            unit = "" if figures is None else figures["unit"]
            met = self.met(name)
            verdict = "-" if met is None else "yes" if met else "NO"
            rows.append([name, value, numerator, denominator, unit, self.targets.get(name, "-"), verdict])
        self.print_table(
            "ratios (a ÷ b, both measured in this run) and targets", ["measure", "ratio", "a", "b", "unit", "target", "met"], rows
        )

    def emit(self, as_json: bool) -> None:
        self.print_ratios()
        if as_json:
            document = {
                "bench": self.bench,
                "ratios": self.ratios,
                "targets": self.targets,
                "figures": self.figures,
                "results": self.results,
            }
            print(json.dumps(document))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
