"""Run reliability units in fresh interpreters, in parallel, and classify how each case ended.

Classification of one case (see :mod:`rel_registry` for the case's own verdicts):

* ``abort``: the interpreter was killed by a signal (SIGABRT, SIGSEGV, ...) while
  running the case, or after it (at exit) in a single-case unit.
* ``hang``: the unit ran past its timeout; the case that had started is the one
  blamed, cases that never started are ``hang`` too (they could not run).
* ``crash``: the interpreter exited with an error code and no verdict.
* otherwise the verdict the case reported.

Every unit runs with a clean gfxgraph environment (``GFXGRAPH*``/``HGB_*``
variables removed), ``PYTHONPATH`` = ``src`` + this folder, and
``GFXGRAPH_RELIABILITY_SCALE`` set to the requested scale.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import rel_registry
from rel_worker import MARK, TIMEOUT_ENV

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SRC = REPO / "src"
WORKER = HERE / "rel_worker.py"
_CLEARED_ENV = ("GFXGRAPH", "GFXGRAPH_VRAM_CAP", "GFXGRAPH_LIB", "GFXGRAPH_RUNTIME", "GFXGRAPH_LOG_LEVEL",
                "HGB_LOG_LEVEL")
NOT_PASSING = ("fail", "abort", "hang", "crash", "silent_wrong")


def worker_env(scale: float, timeout: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env[rel_registry.SCALE_ENV] = repr(scale)
    env[TIMEOUT_ENV] = repr(timeout)
    return env


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def run_unit(unit: str, *, scale: float = 1.0, timeout: float | None = None,
             python: str = sys.executable) -> list[dict[str, Any]]:
    """Run ``unit`` in a fresh interpreter; one result dict per case of the unit."""
    members = rel_registry.units()[unit]
    limit = timeout if timeout is not None else rel_registry.unit_timeout(members)
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, str(WORKER), unit], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=worker_env(scale, limit), cwd=str(REPO), start_new_session=True)
    hung = False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        hung = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and anything it started
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
    wall = time.perf_counter() - t0
    rc = proc.returncode
    verdicts: dict[str, dict[str, Any]] = {}
    started: list[str] = []
    for line in out.splitlines():
        if not line.startswith(MARK):
            continue
        doc = json.loads(line[len(MARK):])
        if "start" in doc:
            started.append(doc["start"])
        else:
            verdicts[doc["case"]] = doc
    single = len(members) == 1
    results = []
    for c in members:
        r: dict[str, Any] = {**c.describe(), "returncode": rc, "unit_seconds": round(wall, 2)}
        v = verdicts.get(c.name)
        if v is not None:
            r.update(status=v["status"], seconds=v["seconds"], observed=v["observed"], error=v["error"])
            if single and rc is not None and rc < 0:
                r["status"] = "abort"
                r["error"] = f"the case finished ({v['status']}) but the interpreter was then killed by " \
                             f"{_signal_name(rc)} (teardown)\n{r['error'] or ''}"
            elif single and hung:
                r["status"] = "hang"
                r["error"] = f"the case finished ({v['status']}) but the interpreter did not exit within " \
                             f"{limit:.0f} s"
            elif single and rc not in (0, None) and r["status"] == "pass":
                r["status"] = "crash"
                r["error"] = f"the case passed but the interpreter exited with code {rc}"
        else:
            r.update(seconds=None, observed={})
            was_running = bool(started) and started[-1] == c.name
            if hung:
                r["status"] = "hang"
                r["error"] = (f"no verdict within {limit:.0f} s" if was_running
                              else f"not reached: the unit hung (in {started[-1] if started else 'start-up'})")
            elif rc is not None and rc < 0:
                r["status"] = "abort" if (was_running or single) else "crash"
                r["error"] = (f"interpreter killed by {_signal_name(rc)}" if was_running or single
                              else f"not reached: the unit aborted in {started[-1] if started else 'start-up'}")
            else:
                r["status"] = "crash"
                r["error"] = f"no verdict; interpreter exit code {rc}"
        if r["status"] != "pass":
            r["stderr_tail"] = err[-6000:]
            r["stdout_tail"] = "\n".join(l for l in out.splitlines() if not l.startswith(MARK))[-2000:]
        results.append(r)
    return results


def run_units(names: list[str], *, scale: float = 1.0, workers: int = 8,
              progress: bool = False) -> list[dict[str, Any]]:
    """Run ``names`` in parallel (expensive units first); results in registry order."""
    table = rel_registry.units()
    order = sorted(names, key=lambda u: -max(c.cost for c in table[u]))
    done: dict[str, list[dict[str, Any]]] = {}

    def one(unit: str) -> tuple[str, list[dict[str, Any]]]:
        res = run_unit(unit, scale=scale)
        if progress:
            bad = [r for r in res if r["status"] in NOT_PASSING]
            tag = "ok" if not bad else ", ".join(f"{r['name']}={r['status']}" for r in bad)
            print(f"  [{res[0]['unit_seconds']:6.1f} s] {unit}: {tag}", flush=True)
        return unit, res

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for unit, res in pool.map(one, order):
            done[unit] = res
    out: list[dict[str, Any]] = []
    for name in table:
        if name in done:
            out.extend(done[name])
    return out


def summarize(results: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per category (and ``total``): cases, passed, failed, aborts, hangs, silent_wrong, skipped."""
    keys = ("cases", "passed", "failed", "aborts", "hangs", "silent_wrong", "skipped")
    rows = {cat: dict.fromkeys(keys, 0) for cat in (*rel_registry.CATEGORIES, "total")}
    column = {"pass": "passed", "fail": "failed", "crash": "failed", "abort": "aborts", "hang": "hangs",
              "silent_wrong": "silent_wrong", "skip": "skipped"}
    for r in results:
        for cat in (r["category"], "total"):
            rows[cat]["cases"] += 1
            rows[cat][column[r["status"]]] += 1
    return rows


def format_table(rows: dict[str, dict[str, int]]) -> str:
    head = "| category | cases | passed | failed | aborts | hangs | silent-wrong | skipped |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for cat, row in rows.items():
        if row["cases"] or cat == "total":
            name = f"**{cat}**" if cat == "total" else cat
            lines.append(f"| {name} | {row['cases']} | {row['passed']} | {row['failed']} | {row['aborts']} | "
                         f"{row['hangs']} | {row['silent_wrong']} | {row['skipped']} |")
    return "\n".join(lines)
