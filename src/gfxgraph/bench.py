"""``gfxgraph bench``: run the benchmark suites shipped in :mod:`gfxgraph.suites`, collect JSON, tables, plots.

Each suite is a module ``gfxgraph.suites.<name>`` run as ``python -m gfxgraph.suites.<name> --out DIR``;
it writes ``DIR/<name>.json`` (see ``gfxgraph/suites/_common.py``). This runs the chosen suites one
after another in fresh interpreters (a crash in one cannot take the others down), then writes
``DIR/<name>.md`` (the table), the suite's plots (:mod:`gfxgraph.bench_charts`, when matplotlib is
installed: ``pip install 'gfxgraph[plot]'``) and ``DIR/summary.md``. Problems the user can fix (an
unknown suite, an output folder that cannot be written, no GPU for suites that measure one) end in
one line on stderr and exit code 2, never a traceback. The suites ship with the
package, so this works from an installed gfxgraph as well as from a source checkout.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
import time
import os
from pathlib import Path

from tqdm.auto import tqdm

import gfxgraph.suites
from gfxgraph.bench_charts import charts
from gfxgraph.bench_draw import draw
from gfxgraph.suites._common import child_env
from hipgraph_bridge.log import logger
from hipgraph_bridge.platform import probe

__all__ = ["run_bench", "render_results", "find_suites", "suite_summary", "PLOT_HINT"]

PLOT_HINT = "pip install 'gfxgraph[plot]' (matplotlib)"


def _have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _output_problem(out: Path) -> str | None:
    """Why ``out`` cannot take the results (None: it exists now, a writable folder)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create the output folder {str(out)!r}: {exc.strerror or exc}"
    if not os.access(out, os.W_OK | os.X_OK):
        return f"cannot write into the output folder {str(out)!r} (permission denied)"
    return None


def find_suites() -> dict[str, str]:
    """Suite names to their module names: every public module of :mod:`gfxgraph.suites` (none imported)."""
    return {m.name: f"gfxgraph.suites.{m.name}" for m in sorted(pkgutil.iter_modules(gfxgraph.suites.__path__),
                                                                 key=lambda m: m.name)
            if not m.name.startswith("_") and not m.ispkg}


def suite_summary(module: str) -> str:
    """The first line of a suite's docstring, read from its source without importing it ("" if none)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return ""
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")))
    return doc.splitlines()[0] if doc else ""


def _table(doc: dict) -> str:
    rows = [f"## {doc['benchmark']}", "", f"{doc['environment'].get('device')} · torch "
            f"{doc['environment'].get('torch')} · {doc['environment'].get('date')}", "",
            "| figure | value | target | result |", "|---|---|---|---|"]
    for f in doc["figures"]:
        v = f["value"]
        val = f"{v:.4g} {f.get('unit', '')}".strip() if isinstance(v, (int, float)) else str(v)
        res = "-" if f["pass"] is None else ("pass" if f["pass"] else "**miss**")
        rows.append(f"| {f['name']} | {val} | {f['target'] or '-'} | {res} |")
    return "\n".join(rows) + "\n"


def _render(doc: dict, out: Path, stem: str) -> list[Path]:
    """Write ``stem``.md (the table, then the plots with their captions) and the plots; returns the PNGs."""
    pngs, notes = [], []
    for chart in charts(doc):
        path = out / f"{chart.stem}.png"
        if draw(chart, doc.get("environment", {}), path):
            pngs.append(path)
            notes.append(f"![{chart.title}]({path.name})\n\n{chart.caption}\n")
    (out / f"{stem}.md").write_text(_table(doc) + "".join(f"\n{n}" for n in notes))
    return pngs


def run_bench(*, suites: list[str] | None, out_dir: str, list_only: bool = False) -> int:
    """Run ``suites`` (default: all) into ``out_dir``; returns a process exit code."""
    available = find_suites()
    chosen = suites or list(available)
    unknown = [s for s in chosen if s not in available]
    if unknown:
        print(f"gfxgraph bench: unknown suite(s) {', '.join(map(repr, unknown))}; expected some of "
              f"{', '.join(available)} (gfxgraph bench --list)", file=sys.stderr)
        return 2
    if list_only:
        for name in chosen:
            print(f"{name:20s} {suite_summary(available[name])}")
        return 0
    out = Path(out_dir)
    problem = _output_problem(out)
    if problem is not None:
        print(f"gfxgraph bench: {problem}; pass --out DIR", file=sys.stderr)
        return 2
    plat = probe()
    if not plat.graphs_available:
        print(f"gfxgraph bench: the suite(s) {', '.join(chosen)} measure GPU graphs and this machine has no usable "
              f"GPU ({plat.reason}); run them on a GPU machine (gfxgraph bench --render DIR draws existing "
              "results anywhere)", file=sys.stderr)
        return 2
    summary = ["# gfxgraph benchmarks", ""]
    failed = 0
    for name in tqdm(chosen, desc="gfxgraph bench", unit="suite"):
        t0 = time.perf_counter()
        logger.info("gfxgraph bench: running %s", name)
        r = subprocess.run([sys.executable, "-m", available[name], "--out", str(out)], env=child_env())
        seconds = time.perf_counter() - t0
        result = out / f"{name}.json"
        if r.returncode != 0 or not result.is_file():
            failed += 1
            summary.append(f"- {name}: FAILED (exit {r.returncode}) after {seconds:.0f} s")
            continue
        doc = json.loads(result.read_text())
        plotted = _render(doc, out, name)
        misses = sum(1 for f in doc["figures"] if f["pass"] is False)
        summary.append(f"- {name}: {len(doc['figures'])} figures, {misses} targets missed, {seconds:.0f} s"
                       + (f", {len(plotted)} plots" if plotted else " (no plot: matplotlib not installed, or none)"))
    if not _have_matplotlib():
        summary.append(f"- tables only, no plots: matplotlib is not installed; for plots: {PLOT_HINT}")
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 1 if failed else 0


def render_results(in_dir: str, out_dir: str) -> int:
    """Tables and plots for every benchmark JSON in ``in_dir`` (no GPU needed)."""
    src, out = Path(in_dir), Path(out_dir)
    docs = sorted(src.glob("*.json"))
    if not docs:
        print(f"gfxgraph bench --render: no *.json in {src}", file=sys.stderr)
        return 2
    problem = _output_problem(out)
    if problem is not None:
        print(f"gfxgraph bench --render: {problem}; pass --out DIR", file=sys.stderr)
        return 2
    for path in docs:
        doc = json.loads(path.read_text())
        if "figures" not in doc:
            continue
        pngs = _render(doc, out, path.stem)
        print(f"{path.stem}: {out / (path.stem + '.md')}" + "".join(f", {p}" for p in pngs))
    if not _have_matplotlib():
        print(f"gfxgraph bench --render: wrote tables only (matplotlib is not installed); for plots: {PLOT_HINT}")
    return 0
