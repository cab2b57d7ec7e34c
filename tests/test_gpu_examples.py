"""The recipes in examples/ run end to end on a GPU (each in its own interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, SRC

pytestmark = pytest.mark.gpu


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(REPO)]), **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full, cwd=REPO, timeout=300)


def test_serving_runner_with_gfxgraph_env():
    r = _run([str(REPO / "examples" / "serving_runner.py")], {"GFXGRAPH": "1"})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "graph class: BridgedCUDAGraph" in r.stdout and "fallbacks=0" in r.stdout


def test_hf_static_cache_generation():
    pytest.importorskip("transformers")
    r = _run([str(REPO / "examples" / "hf_static_cache_generate.py")])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "tokens identical: True" in r.stdout


def test_run_module_launcher():
    r = _run(["-m", "gfxgraph", "run", "-m", "examples.toy_server", "--requests", "40"])
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "served 40 requests; enabled=True" in r.stdout
