"""``gfxgraph bench``: run the benchmarks in ``benchmarks/`` and collect JSON, tables and plots.

Each suite is a script ``benchmarks/<name>.py`` that takes ``--out DIR`` and writes
``DIR/<name>.json`` (see ``benchmarks/_common.py``). This runs the chosen suites one after
another in fresh interpreters (a crash in one cannot take the others down), then writes
``DIR/<name>.md`` (the table) and ``DIR/<name>.png`` (figures against their targets, when
matplotlib is installed: ``pip install 'gfxgraph[bench]'``) and ``DIR/summary.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from hipgraph_bridge.log import logger
from hipgraph_bridge.platform import probe

__all__ = ["run_bench", "render_results", "find_suites"]


def _bench_dir() -> Path | None:
    here = Path(__file__).resolve()
    for candidate in (Path.cwd() / "benchmarks", here.parents[2] / "benchmarks"):
        if (candidate / "_common.py").is_file():
            return candidate
    return None


def find_suites() -> dict[str, Path]:
    """Benchmark scripts by name (``benchmarks/*.py`` without a leading underscore)."""
    d = _bench_dir()
    if d is None:
        return {}
    return {p.stem: p for p in sorted(d.glob("*.py")) if not p.name.startswith("_")}


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


def _plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib  # optional: the bench extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figs = [f for f in doc["figures"] if isinstance(f["value"], (int, float))]
    if not figs:
        return False
    height = max(2.5, 0.32 * len(figs) + 1)
    fig, ax = plt.subplots(figsize=(10, height))
    colors = ["#999999" if f["pass"] is None else ("#2a9d8f" if f["pass"] else "#e76f51") for f in figs]
    ax.barh(range(len(figs)), [f["value"] for f in figs], color=colors)
    ax.set_yticks(range(len(figs)))
    ax.set_yticklabels([f"{f['name']} [{f.get('unit') or 'x'}]" for f in figs], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("symlog")
    ax.set_title(f"{doc['benchmark']} — green: meets target, red: misses, grey: no target", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_bench(*, suites: list[str] | None, out_dir: str, list_only: bool = False) -> int:
    """Run ``suites`` (default: all) into ``out_dir``; returns a process exit code."""
    available = find_suites()
    if not available:
        print("gfxgraph bench: no benchmarks/ folder found; run it from a source checkout of gfxgraph",
              file=sys.stderr)
        return 2
    if list_only:
        for name, path in available.items():
            print(f"{name:20s} {path}")
        return 0
    chosen = suites or list(available)
    unknown = [s for s in chosen if s not in available]
    if unknown:
        print(f"gfxgraph bench: unknown suite(s) {unknown}; expected some of {sorted(available)}", file=sys.stderr)
        return 2
    plat = probe()
    if not plat.graphs_available:
        print(f"gfxgraph bench: every suite measures GPU graphs and this machine has none ({plat.reason}); "
              f"nothing to run. Suites: {', '.join(chosen)}")
        return 0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bench_dir = next(iter(available.values())).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(bench_dir.parent / "src"), str(bench_dir),
                                                       os.environ.get("PYTHONPATH", "")])}
    summary = ["# gfxgraph benchmarks", ""]
    failed = 0
    for name in tqdm(chosen, desc="gfxgraph bench", unit="suite"):
        t0 = time.perf_counter()
        logger.info("gfxgraph bench: running %s", name)
        r = subprocess.run([sys.executable, str(available[name]), "--out", str(out)], env=env)
        seconds = time.perf_counter() - t0
        result = out / f"{name}.json"
        if r.returncode != 0 or not result.is_file():
            failed += 1
            summary.append(f"- {name}: FAILED (exit {r.returncode}) after {seconds:.0f} s")
            continue
        doc = json.loads(result.read_text())
        (out / f"{name}.md").write_text(_table(doc))
        plotted = _plot(doc, out / f"{name}.png")
        misses = sum(1 for f in doc["figures"] if f["pass"] is False)
        summary.append(f"- {name}: {len(doc['figures'])} figures, {misses} targets missed, {seconds:.0f} s"
                       + ("" if plotted else " (no plot: matplotlib not installed)"))
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
    out.mkdir(parents=True, exist_ok=True)
    for path in docs:
        doc = json.loads(path.read_text())
        if "figures" not in doc:
            continue
        (out / f"{path.stem}.md").write_text(_table(doc))
        plotted = _plot(doc, out / f"{path.stem}.png")
        print(f"{path.stem}: {out / (path.stem + '.md')}" + (f", {out / (path.stem + '.png')}" if plotted else ""))
    return 0
