"""The reliability suite's case table, shared by pytest and ``gfxgraph.suites.reliability``.

Vocabulary:

* A **case** is one scenario with one verdict (``pass``, ``fail``, ``silent_wrong``,
  ``skip``; the harness adds ``abort``, ``hang`` and ``crash`` from the way the
  interpreter ended).
* A **unit** is what one fresh interpreter runs (``rel_worker.py UNIT``). Every
  fault-injection, corruption, soak and concurrency case is its own unit, so an
  abort or a hang is attributed to it. Pure argument-validation cases (bad input),
  where an abort is impossible, are grouped several to a unit: an interpreter
  costs ~3 s of ``import torch``.

A case function receives a :class:`Ctx`, records what it saw in ``ctx.observed``
(it ends up in the JSON) and signals its verdict by returning (pass) or raising:
``AssertionError`` (fail), :class:`SilentWrong` (a wrong result came back without
an error), :class:`Skip` (cannot run here, e.g. a second GPU is needed).

``where``: ``"gpu"`` cases need a CUDA/ROCm GPU; ``"any"`` cases also run (and
must pass) on a CPU-only machine, which is how CI covers them.

``known_issue``: the case exposes a library bug that is reported and not yet
fixed. The runner still counts the case as failing; pytest marks it
``xfail(strict=True)``, so the fix (or any drift) shows as an XPASS that fails
the run until the note is removed.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CATEGORIES", "Case", "Ctx", "SilentWrong", "Skip", "case", "cases", "units", "unit_cases", "load",
           "scale"]

CATEGORIES = ("fault", "bad_input", "corruption", "soak", "concurrency")
CASE_MODULES = ("rel_cases_fault", "rel_cases_bad_input", "rel_cases_corruption", "rel_cases_soak",
                "rel_cases_concurrency")
SCALE_ENV = "GFXGRAPH_RELIABILITY_SCALE"
EXTRA_ENV = "GFXGRAPH_RELIABILITY_EXTRA_CASES"  # comma-separated extra case modules (the harness self-test)
# the path of tests/_warm_python.py, set by the pytest glue only: the cases' nested interpreters are then forked
# from a warm one (torch imported once) instead of each importing torch
WARM_ENV = "GFXGRAPH_RELIABILITY_WARM_PYTHON"


class SilentWrong(Exception):
    """The library returned a wrong result without raising (the worst outcome)."""


class Skip(Exception):
    """The case cannot run in this environment (the reason is the message)."""


@dataclass
class Ctx:
    """What a case gets: where it runs, the soak scale, and a dict for its observations."""

    gpu: bool
    scale: float = 1.0
    observed: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    fn: Callable[[Ctx], None]
    unit: str
    where: str = "gpu"  # "gpu" | "any"
    timeout: float = 90.0  # seconds for the whole unit
    cost: float = 1.0  # scheduling hint: expensive units start first
    api: str = ""
    kind: str = ""
    known_issue: str = ""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "category": self.category, "unit": self.unit, "where": self.where,
                "api": self.api, "kind": self.kind, "known_issue": self.known_issue or None}


_CASES: dict[str, Case] = {}


def case(name: str, category: str, *, where: str = "gpu", unit: str | None = None, timeout: float = 90.0,
         cost: float = 1.0, api: str = "", kind: str = "",
         known_issue: str = "") -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    """Register the decorated function as case ``name`` (its own unit unless ``unit`` is given)."""
    if category not in CATEGORIES:
        raise ValueError(f"category: expected one of {CATEGORIES}, got {category!r}")
    if where not in ("gpu", "any"):
        raise ValueError(f"where: expected 'gpu' or 'any', got {where!r}")

    def deco(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        if name in _CASES:
            raise ValueError(f"duplicate reliability case {name!r}")
        _CASES[name] = Case(name, category, fn, unit or name, where, timeout, cost, api, kind, known_issue)
        return fn

    return deco


def extra_modules() -> list[str]:
    """The extra case modules named in ``GFXGRAPH_RELIABILITY_EXTRA_CASES``."""
    return [m.strip() for m in os.environ.get(EXTRA_ENV, "").split(",") if m.strip()]


def load() -> None:
    """Import every case module (idempotent)."""
    for mod in (*CASE_MODULES, *extra_modules()):
        importlib.import_module(mod)


def unit_cases(unit: str) -> list[Case]:
    """The cases of ``unit`` (empty if there is none). A unit of the extra case modules (the harness
    self-test) is found without importing the suite's own case modules, nor torch, which they import."""
    for mod in extra_modules():
        importlib.import_module(mod)
    found = [c for c in _CASES.values() if c.unit == unit]
    return found or units().get(unit, [])


def cases() -> list[Case]:
    load()
    return list(_CASES.values())


def get(name: str) -> Case:
    load()
    return _CASES[name]


def units() -> dict[str, list[Case]]:
    """Unit name -> its cases, in registration order."""
    out: dict[str, list[Case]] = {}
    for c in cases():
        out.setdefault(c.unit, []).append(c)
    return out


def unit_timeout(members: list[Case]) -> float:
    return max(c.timeout for c in members)


def unit_where(members: list[Case]) -> str:
    return "gpu" if any(c.where == "gpu" for c in members) else "any"


def scale() -> float:
    """Multiplier for soak and concurrency counts (``GFXGRAPH_RELIABILITY_SCALE``, default 1.0)."""
    raw = os.environ.get(SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    value = float(raw)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{SCALE_ENV}={raw!r}: expected a number in (0, 1]")
    return value
