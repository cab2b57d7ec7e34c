"""Shared test set-up: GPU tests carry the ``gpu`` marker and skip, with the reason, without a GPU."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

# Inductor compiles CPU kernels in a pool of worker processes by default (each one imports torch); the
# tests compile a few small graphs, in parallel pytest workers already: one compile thread each is faster.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Under `pytest -n auto` every core already runs a worker: each gets its share of the cores for torch's
# intra-op threads (OpenMP reads this when torch loads; the tests' child processes inherit it). With a
# thread per core in every worker, the threads of one op spin-wait for cores the other workers hold: a
# test of a few seconds took over a minute whenever the other worker computed too.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))


def _gpu_reason() -> str | None:
    import torch

    if not (torch.version.cuda or getattr(torch.version, "hip", None)):
        return f"needs a CUDA/ROCm build of PyTorch (this is {torch.__version__})"
    if not torch.cuda.is_available():
        return "needs a visible GPU (torch.cuda.is_available() is False)"
    return None


def __getattr__(name: str) -> str | None:
    """``GPU_SKIP_REASON``, worked out (importing torch) when it is first asked for: the xdist controller,
    which loads this file too but runs no test, never imports torch (~3 s before the workers start)."""
    if name == "GPU_SKIP_REASON":
        globals()[name] = reason = _gpu_reason()
        return reason
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _gpu_skip_reason() -> str | None:
    return globals()["GPU_SKIP_REASON"] if "GPU_SKIP_REASON" in globals() else __getattr__("GPU_SKIP_REASON")


def _freeze_what_lives() -> None:
    """Move every object alive now out of the collector's way (``gc.freeze``): each ``gc.collect()`` a test or
    fixture makes, and each full collection Python starts during dynamo's tracing, then walks only what the
    tests made since (about 6x faster here). Dynamo's caches are dropped and garbage collected first, so only
    what the session keeps (modules, their globals) is frozen, never a test's compiled subgraphs."""
    global _unfrozen
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    gc.collect()
    gc.freeze()
    _unfrozen = False


# gc.get_freeze_count() walks every frozen object (~25 ms with torch loaded, more with dynamo: a tenth of a
# second per test, spent in every test's set-up); whether anything unfroze them since is noted here instead.
_unfrozen = True
_gc_unfreeze = gc.unfreeze


def _unfreeze_and_note() -> None:
    global _unfrozen
    _unfrozen = True
    _gc_unfreeze()


gc.unfreeze = _unfreeze_and_note  # a capture's frozen_gc() (capture_all runs one on a CPU too) unfreezes all


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.enable()
    _freeze_what_lives()  # what collection imported: torch, dynamo, transformers, the package


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "no":  # a process that collects (an xdist worker, a plain run)
        # Collection imports torch, dynamo, transformers: each of the dozen full collections Python starts
        # meanwhile walks all of it (1-2 s per worker). Garbage made meanwhile is collected once, at its end.
        gc.disable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_gfxgraph_state():
    """Each test starts disabled with zeroed stats, and leaves it that way (and the session's objects frozen)."""
    import gfxgraph

    if _unfrozen:  # a capture's frozen_gc() (capture_all runs one on a CPU too) unfroze all
        _freeze_what_lives()
    gfxgraph.disable()
    gfxgraph.reset_stats()
    yield
    gfxgraph.disable()
    gfxgraph.reset_stats()


def run_python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120,
               args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (abort-prone cases: a SIGABRT shows as a failure)."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
                "PYTHONUNBUFFERED": "1"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *(args or [])],
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def run_python_warm(code: str, *, env: dict[str, str] | None = None, timeout: float = 120,
                    args: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` run as ``run_python`` runs it, in a process forked from a warm interpreter that has imported
    torch and nothing of gfxgraph (``_warm_python``): for checks of what gfxgraph does at and after its import
    (environment variables, logging, exit), without paying ``import torch`` in every child. The environment is
    the CLI tests' (``PYTHONPATH`` names src first), so one warm interpreter serves them all."""
    import _warm_python

    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)}
    full_env.update(env or {})
    return _warm_python.run(["-c", textwrap.dedent(code), *(args or [])], env=full_env, timeout=timeout)


@pytest.fixture
def py():
    return run_python


@pytest.fixture
def warm_py():
    return run_python_warm
