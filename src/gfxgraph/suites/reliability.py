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

    python benchmarks/reliability.py --out DIR [--quick] [--workers 8] [--only TEXT] [--list] [--strict]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for extra in (REPO / "tests" / "reliability", REPO / "src"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import torch  # noqa: E402

import rel_harness  # noqa: E402
import rel_registry  # noqa: E402
from _common import figure, parser, write  # noqa: E402

WALL_TARGET_S = 180.0


def _skipped(c: rel_registry.Case, reason: str) -> dict:
    return {**c.describe(), "status": "skip", "seconds": None, "observed": {}, "error": reason,
            "returncode": None, "unit_seconds": 0.0}


def main() -> int:
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

    table = rel_registry.units()
    if args.list:
        for c in rel_registry.cases():
            flag = f"  [known issue] {c.known_issue[:80]}..." if c.known_issue else ""
            print(f"{c.category:12s} {c.where:4s} {c.unit:40s} {c.name}: {c.kind}{flag}")
        return 0

    gpu = torch.cuda.is_available()
    chosen, skipped = [], []
    for unit, members in table.items():
        if args.only and not any(t in unit or any(t in c.name for c in members) for t in args.only):
            continue
        if rel_registry.unit_where(members) == "gpu" and not gpu:
            skipped.extend(_skipped(c, "needs a GPU (none visible)") for c in members)
            continue
        chosen.append(unit)

    cases_n = sum(len(table[u]) for u in chosen)
    print(f"reliability: {cases_n} cases in {len(chosen)} interpreters, {args.workers} at a time, scale {scale}"
          f"{'' if gpu else ' (no GPU: CPU-capable cases only)'}", flush=True)
    t0 = time.perf_counter()
    results = rel_harness.run_units(chosen, scale=scale, workers=args.workers, progress=True)
    wall = time.perf_counter() - t0
    results.extend(skipped)
    order = {c.name: i for i, c in enumerate(rel_registry.cases())}
    results.sort(key=lambda r: order[r["name"]])

    rows = rel_harness.summarize(results)
    markdown = rel_harness.format_table(rows)
    print()
    print("## reliability")
    print()
    print(markdown)
    bad = [r for r in results if r["status"] in rel_harness.NOT_PASSING]
    if bad:
        print("\nnot passing:")
        for r in bad:
            first = (r.get("error") or "").strip().splitlines()
            known = "  [known issue]" if r.get("known_issue") else ""
            print(f"  {r['status']:12s} {r['name']}: {first[0][:160] if first else ''}{known}")
    print(f"\nwall time: {wall:.1f} s\n")

    total = rows["total"]
    figures = []
    for cat in rel_registry.CATEGORIES:
        row = rows[cat]
        ran = row["cases"] - row["skipped"]
        if row["cases"]:
            figures.append(figure(f"{cat}: passed / run", row["passed"], f"== {ran}", row["passed"] == ran,
                                  note=f"{row['cases']} cases, {row['skipped']} skipped"))
    figures += [
        figure("aborts (killed by a signal)", total["aborts"], "== 0", total["aborts"] == 0),
        figure("hangs (past the timeout)", total["hangs"], "== 0", total["hangs"] == 0),
        figure("silent-wrong results", total["silent_wrong"], "== 0", total["silent_wrong"] == 0),
        figure("suite wall time", wall, f"< {WALL_TARGET_S:.0f}" if scale == 1.0 else None,
               (wall < WALL_TARGET_S) if scale == 1.0 else None, "s"),
    ]
    write(args.out, "reliability", figures, {
        "method": __doc__,
        "scale": scale,
        "workers": args.workers,
        "gpu": gpu,
        "wall_seconds": round(wall, 2),
        "table": rows,
        "table_markdown": markdown,
        "not_passing": [{"name": r["name"], "status": r["status"], "known_issue": r.get("known_issue"),
                         "error": (r.get("error") or "").strip().splitlines()[:1]} for r in bad],
        "cases": results,
    })
    return 1 if (args.strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
