"""Pytest glue: parametrize over the case table; run the units in fresh interpreters, in parallel.

The first test that needs a result runs every unit the session selected (and can
run here) in parallel, like ``gfxgraph.suites.reliability`` does, and caches the
results; each test then asserts its own case's verdict. ``known_issue`` cases are
``xfail(strict=True)``: a fix (or a drift) makes them XPASS, which fails the run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import rel_harness
import rel_registry

_cache: dict[str, dict[str, dict[str, Any]]] = {}


def params(where: str) -> list[Any]:
    out = []
    for c in rel_registry.cases():
        if c.where != where:
            continue
        marks = [pytest.mark.xfail(reason=f"known issue: {c.known_issue}", strict=True)] if c.known_issue else []
        out.append(pytest.param(c.name, id=c.name, marks=marks))
    return out


def _selected_units(session: pytest.Session, gpu_ok: bool) -> list[str]:
    names = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "case_name" not in callspec.params:
            continue
        c = rel_registry.get(callspec.params["case_name"])
        if c.where == "gpu" and not gpu_ok:
            continue
        names.add(c.unit)
    return sorted(names)


@pytest.fixture(scope="session")
def reliability_results(request: pytest.FixtureRequest) -> Any:
    from conftest import GPU_SKIP_REASON

    def get(case_name: str) -> dict[str, Any]:
        c = rel_registry.get(case_name)
        if c.unit not in _cache:
            todo = [u for u in _selected_units(request.session, GPU_SKIP_REASON is None) if u not in _cache]
            if c.unit not in todo:
                todo.append(c.unit)
            workers = int(os.environ.get("GFXGRAPH_RELIABILITY_WORKERS", "8"))
            with pytest.MonkeyPatch.context() as mp:  # nested interpreters forked from a warm one (see rel_registry)
                mp.setenv(rel_registry.WARM_ENV, str(Path(__file__).resolve().parents[1] / "_warm_python.py"))
                results = rel_harness.run_units(todo, scale=rel_registry.scale(), workers=workers)
            for r in results:
                _cache.setdefault(r["unit"], {})[r["name"]] = r
        return _cache[c.unit][case_name]

    return get


def check(result: dict[str, Any]) -> None:
    """Turn a case result into the pytest outcome."""
    status = result["status"]
    if status == "skip":
        pytest.skip(result.get("error") or "skipped")
    if status != "pass":
        detail = result.get("error") or ""
        tail = result.get("stderr_tail") or ""
        pytest.fail(f"{result['name']}: {status}\n{detail}\n--- observed: {result.get('observed')}\n"
                    f"--- stderr (tail):\n{tail[-3000:]}", pytrace=False)
