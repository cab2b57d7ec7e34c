"""Reliability suite (issue 8): fault injection, bad input, silent corruption, soak, concurrency.

Runs every case of ``tests/reliability`` (the same case table pytest collects) in
fresh interpreters, several at once on the one GPU, and prints one table: cases
per category, passed, failed, aborts (killed by a signal), hangs (ran past the
unit's timeout), silent-wrong (a wrong result without an error), skipped. Writes
``DIR/reliability.json`` with the environment, the table and every case's
details (verdict, seconds, what it observed, error and stderr tail when it did
not pass, and the known issue it exposes, if any).

Each fault-injection, corruption, soak and concurrency case is its own
interpreter; bad-input checks (pure argument validation, no abort possible) run
grouped. ``--quick`` scales the soak and concurrency counts to 1% (the committed
run uses the full counts: 1,000,000 replays and 10,000 capture/reset cycles).
Without a GPU only the CPU-capable cases run; the others are reported skipped.

The cases are the test suite's, so this suite needs a source checkout: it looks for
``tests/reliability`` beside the ``src/`` this package was imported from, then in the current
folder, and exits with status 2 saying so when neither has it.

    python -m gfxgraph.suites.reliability --out DIR [--quick] [--workers 8] [--only TEXT] [--list] [--strict]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gfxgraph.suites._common import figure, package_root, parser, write

WALL_TARGET_S = 180.0


def case_dir() -> Path | None:
    """``tests/reliability`` of the source checkout this package comes from, else of the current folder."""
    for root in (package_root().parent, Path.cwd()):
        d = root / "tests" / "reliability"
        if (d / "rel_registry.py").is_file():
            return d
    return None


def _load(where: Path) -> tuple[ModuleType, ModuleType]:
    """The harness and the case table; they import each other by plain name, so their folder goes on sys.path."""
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return importlib.import_module("rel_harness"), importlib.import_module("rel_registry")


def _skipped(c: Any, reason: str) -> dict:
    return {**c.describe(), "status": "skip", "seconds": None, "observed": {}, "error": reason,
            "returncode": None, "unit_seconds": 0.0}


def _args() -> tuple[argparse.Namespace, float]:
    p = parser(__doc__)
    p.add_argument("--workers", type=int, default=8, help="interpreters at once (default 8)")
    p.add_argument("--scale", type=float, default=None, help="soak/concurrency count multiplier in (0, 1] "
                   "(default 1.0; 0.01 with --quick)")
    p.add_argument("--only", action="append", default=[], help="run cases whose name or unit contains TEXT "
                   "(repeatable)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--strict", action="store_true", help="exit 1 when any case did not pass")
    args = p.parse_args()
    scale = args.scale if args.scale is not None else (0.01 if args.quick else 1.0)
    if not 0.0 < scale <= 1.0:
        p.error(f"--scale: expected a number in (0, 1], got {scale}")
    return args, scale


def _choose(registry: ModuleType, only: list[str], gpu: bool) -> tuple[list[str], list[dict]]:
    """The units to run and the skipped cases' results (GPU units on a machine without one)."""
    chosen, skipped = [], []
    for unit, members in registry.units().items():
        if only and not any(t in unit or any(t in c.name for c in members) for t in only):
            continue
        if registry.unit_where(members) == "gpu" and not gpu:
            skipped.extend(_skipped(c, "needs a GPU (none visible)") for c in members)
            continue
        chosen.append(unit)
    return chosen, skipped


def _print_report(harness: ModuleType, markdown: str, results: list[dict], wall: float) -> list[dict]:
    """Print the table and every case that did not pass; returns those cases."""
    print()
    print("## reliability")
    print()
    print(markdown)
    bad = [r for r in results if r["status"] in harness.NOT_PASSING]
    if bad:
        print("\nnot passing:")
        for r in bad:
            first = (r.get("error") or "").strip().splitlines()
            known = "  [known issue]" if r.get("known_issue") else ""
            print(f"  {r['status']:12s} {r['name']}: {first[0][:160] if first else ''}{known}")
    print(f"\nwall time: {wall:.1f} s\n")
    return bad


def _figures(registry: ModuleType, rows: dict, wall: float, scale: float) -> list[dict]:
    total = rows["total"]
    figures = []
    for cat in registry.CATEGORIES:
        row = rows[cat]
        ran = row["cases"] - row["skipped"]
        if row["cases"]:
            figures.append(figure(f"{cat}: passed / run", row["passed"], f"== {ran}", row["passed"] == ran,
                                  note=f"{row['cases']} cases, {row['skipped']} skipped"))
    return figures + [
        figure("aborts (killed by a signal)", total["aborts"], "== 0", total["aborts"] == 0),
        figure("hangs (past the timeout)", total["hangs"], "== 0", total["hangs"] == 0),
        figure("silent-wrong results", total["silent_wrong"], "== 0", total["silent_wrong"] == 0),
        figure("suite wall time", wall, f"< {WALL_TARGET_S:.0f}" if scale == 1.0 else None,
               (wall < WALL_TARGET_S) if scale == 1.0 else None, "s"),
    ]


def main() -> int:
    args, scale = _args()
    where = case_dir()
    if where is None:
        print("reliability: its cases are the test suite's (tests/reliability of a source checkout of "
              f"gfxgraph); none beside {package_root()} or in {Path.cwd()}", file=sys.stderr)
        return 2
    harness, registry = _load(where)
    if args.list:
        for c in registry.cases():
            flag = f"  [known issue] {c.known_issue[:80]}..." if c.known_issue else ""
            print(f"{c.category:12s} {c.where:4s} {c.unit:40s} {c.name}: {c.kind}{flag}")
        return 0
    gpu = torch.cuda.is_available()
    chosen, skipped = _choose(registry, args.only, gpu)
    cases_n = sum(len(registry.units()[u]) for u in chosen)
    print(f"reliability: {cases_n} cases in {len(chosen)} interpreters, {args.workers} at a time, scale {scale}"
          f"{'' if gpu else ' (no GPU: CPU-capable cases only)'}", flush=True)
    t0 = time.perf_counter()
    results = harness.run_units(chosen, scale=scale, workers=args.workers, progress=True)
    wall = time.perf_counter() - t0
    results.extend(skipped)
    order = {c.name: i for i, c in enumerate(registry.cases())}
    results.sort(key=lambda r: order[r["name"]])
    rows = harness.summarize(results)
    markdown = harness.format_table(rows)
    bad = _print_report(harness, markdown, results, wall)
    write(args.out, "reliability", _figures(registry, rows, wall, scale), {
        "method": __doc__, "scale": scale, "workers": args.workers, "gpu": gpu,
        "wall_seconds": round(wall, 2), "table": rows, "table_markdown": markdown,
        "not_passing": [{"name": r["name"], "status": r["status"], "known_issue": r.get("known_issue"),
                         "error": (r.get("error") or "").strip().splitlines()[:1]} for r in bad],
        "cases": results,
    })
    return 1 if (args.strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
