"""Shared test set-up: GPU tests carry the ``gpu`` marker and skip, with the reason, without a GPU."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

# Inductor compiles CPU kernels in a pool of worker processes by default (each one imports torch); the
# tests compile a few small graphs, in parallel pytest workers already: one compile thread each is faster.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _gpu_reason() -> str | None:
    if not (torch.version.cuda or getattr(torch.version, "hip", None)):
        return f"needs a CUDA/ROCm build of PyTorch (this is {torch.__version__})"
    if not torch.cuda.is_available():
        return "needs a visible GPU (torch.cuda.is_available() is False)"
    return None


GPU_SKIP_REASON = _gpu_reason()


def _freeze_what_lives() -> None:
    """Move every object alive now out of the collector's way (``gc.freeze``): each ``gc.collect()`` a test or
    fixture makes, and each full collection Python starts during dynamo's tracing, then walks only what the
    tests made since (about 6x faster here). Dynamo's caches are dropped and garbage collected first, so only
    what the session keeps (modules, their globals) is frozen, never a test's compiled subgraphs."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    _freeze_what_lives()  # what collection imported: torch, dynamo, transformers, the package


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_gfxgraph_state():
    """Each test starts disabled with zeroed stats, and leaves it that way (and the session's objects frozen)."""
    import gfxgraph

    if gc.get_freeze_count() == 0:  # a capture's frozen_gc() (capture_all runs one on a CPU too) unfroze all
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


@pytest.fixture
def py():
    return run_python
