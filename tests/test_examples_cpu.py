"""The examples run where they say they can: on this machine, eagerly when there is no GPU.

Each runs in its own process from the repository root, as the README's recipes are typed (the README's
console-script recipe in a fresh interpreter, the others forked from a warm one that imported torch: see
_warm_python); the GPU variants with their graph checks are in test_gpu_examples.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _warm_python
from conftest import GPU_SKIP_REASON, REPO, SRC

NO_GPU = GPU_SKIP_REASON is not None


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from the repository root, in a process of its own forked from a warm interpreter
    (_warm_python: torch imported once, nothing of gfxgraph; the fork starts as python does: argv, sys.path[0])."""
    # PYTHONPATH names src only: `examples` must be found from the current directory, as typed.
    full = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return _warm_python.run(args, env=full, cwd=REPO, timeout=300)


def _console_script(tmp_path: Path) -> str:
    """The wrapper pip writes for the ``gfxgraph`` entry point (sys.path[0] is its bin/)."""
    wrapper = tmp_path / "gfxgraph"
    wrapper.write_text(f"#!{sys.executable}\nimport sys\nfrom gfxgraph.cli import main\n"
                       "if __name__ == '__main__':\n    sys.exit(main())\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def _check_toy_server(r: subprocess.CompletedProcess[str], requests: int) -> None:
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert f"served {requests} requests; enabled=True max |diff|=" in r.stdout  # exit 0: below 1e-4
    if NO_GPU:
        assert "max |diff|=0.00e+00" in r.stdout  # eager against eager
        assert "toy_server: no GPU here, so every request runs eagerly on the CPU" in r.stdout
        assert f"fallbacks={requests}" in r.stdout
        assert r.stderr.count("running eagerly (reason: no_gpu)") == 1  # the first fallback, shown once


def test_readme_recipe_toy_server_through_the_console_script(tmp_path: Path):
    r = subprocess.run([_console_script(tmp_path), "run", "-m", "examples.toy_server", "--requests", "100"],
                       capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(SRC)})
    _check_toy_server(r, 100)


def test_toy_server_through_python_m_gfxgraph():
    _check_toy_server(_run(["-m", "gfxgraph", "run", "-m", "examples.toy_server", "--requests", "20"]), 20)


@pytest.mark.skipif(not NO_GPU, reason="the GPU run is test_gpu_examples.py::test_serving_runner_with_gfxgraph_env")
def test_serving_runner_serves_eagerly_without_a_gpu():
    r = _run([str(REPO / "examples" / "serving_runner.py"), "--requests", "20"], {"GFXGRAPH": "1"})
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    first, second = r.stdout.splitlines()
    assert first == "serving_runner: no GPU here, so every request runs eagerly on the CPU (no graphs captured)"
    assert second.startswith("served 20 request batches eagerly in ") and second.endswith("gfxgraph enabled=True")


def test_hf_example_runs_or_names_its_missing_dependency():
    r = _run([str(REPO / "examples" / "hf_static_cache_generate.py")])
    if importlib.util.find_spec("transformers") is None:
        assert r.returncode == 1
        assert "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1] == ("hf_static_cache_generate needs transformers "
                                                    "(pip install transformers): No module named 'transformers'")
        return
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "tokens identical: True" in r.stdout
    if NO_GPU:
        assert "hf_static_cache_generate: no GPU here, so the decode step runs eagerly" in r.stdout


@pytest.mark.parametrize("path", ["toy_server/__main__.py", "serving_runner.py", "hf_static_cache_generate.py"])
def test_every_example_states_its_needs_at_the_top(path: str):
    source = (REPO / "examples" / path).read_text()
    docstring = source.split('"""')[1]
    assert "Needs: " in docstring
