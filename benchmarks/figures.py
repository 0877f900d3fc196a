"""One row of benchmarks/run's table: each benchmark prints its own lines and, when run by benchmarks/run
(NVSYMLINKD_BENCH_JSON names a file), also appends each figure there as a JSON line: what, the figure,
the floor measured in the same run, and the goal (issue 38). Imported as `figures` (a script's directory
is first on sys.path)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def use_tree() -> None:
    """This checkout's root first on sys.path (for tests.*), and NVSYMLINKD_BENCH_TREE's before it: the
    nvsymlinkd the figures are for (benchmarks/run --tree: another checkout's code, this one's benchmarks)."""
    sys.path.insert(0, str(REPO))
    tree = os.environ.get("NVSYMLINKD_BENCH_TREE")
    if tree:
        sys.path.insert(0, tree)


def emit(figure: str, value: float, floor: float | None, unit: str = "ms", goal: str = "",
         met: bool | None = None) -> None:
    """Append one figure to NVSYMLINKD_BENCH_JSON (nothing when it is not set)."""
    out = os.environ.get("NVSYMLINKD_BENCH_JSON")
    if not out:
        return
    row = {"figure": figure, "value": value, "floor": floor, "unit": unit, "goal": goal, "met": met}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def pct(values, p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


if __name__ == "__main__":
    # a module of the benchmarks, not one: say so rather than do nothing (tests/test_suite_imports.py)
    sys.exit("usage: benchmarks/run [--only NAME] (figures.py is the benchmarks' shared helper, not a benchmark)")
