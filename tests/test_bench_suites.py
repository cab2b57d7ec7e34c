"""The benchmark suites ship in the package (gfxgraph.suites): found, listed and importable on CPU,
from a source checkout and from an installed copy, outside the repository."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SRC
from gfxgraph.bench import find_suites, suite_summary

SUITES_DIR = SRC / "gfxgraph" / "suites"
SUITE_FILES = sorted(p.stem for p in SUITES_DIR.glob("*.py") if not p.name.startswith("_"))


def _py(code: str, *, cwd: Path, pythonpath: Path | str = SRC) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def _cli(*args: str, cwd: Path, pythonpath: Path | str = SRC) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-W", "ignore", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_every_suite_module_is_found_with_its_summary():
    assert SUITE_FILES, "no suites in src/gfxgraph/suites"
    found = find_suites()
    assert sorted(found) == SUITE_FILES
    assert all(module == f"gfxgraph.suites.{name}" for name, module in found.items())
    assert suite_summary("gfxgraph.suites.replay_overhead").startswith("Host time per replay")


def test_bench_list_from_outside_the_checkout_imports_no_suite(tmp_path: Path):
    r = _cli("-m", "gfxgraph", "bench", "--list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    assert listed == SUITE_FILES
    # listing reads the package, it does not import (or run) the suites
    code = ("import sys; from gfxgraph.bench import run_bench; run_bench(suites=None, out_dir='x', list_only=True); "
            "print(sorted(m for m in sys.modules if m.startswith('gfxgraph.suites.')))")
    r = _py(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['gfxgraph.suites._common']"


@pytest.mark.parametrize("name", SUITE_FILES + ["_common"])
def test_suite_imports_on_cpu_without_side_effects(name: str, tmp_path: Path):
    code = f"""
import os, sys, json, torch
path, env = list(sys.path), dict(os.environ)
import gfxgraph.suites.{name} as m
print(json.dumps({{"cuda_initialized": torch.cuda.is_initialized(), "path_changed": sys.path != path,
                  "env_changed": sorted(set(os.environ.items()) ^ set(env.items())),
                  "main": callable(getattr(m, "main", None)),
                  "transformers": "transformers" in sys.modules, "matplotlib": "matplotlib" in sys.modules}}))
"""
    r = _py(code, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"cuda_initialized": False, "path_changed": False, "env_changed": [],
                   "main": name != "_common", "transformers": False, "matplotlib": False}


@pytest.mark.parametrize("name", SUITE_FILES)
def test_suite_imports_the_package_not_plain_sibling_names(name: str):
    tree = ast.parse((SUITES_DIR / f"{name}.py").read_text())
    siblings = {p.stem for p in SUITES_DIR.glob("*.py")}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            assert node.module.split(".")[0] not in siblings, f"{name}: from {node.module} import ..."
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] not in siblings, f"{name}: import {alias.name}"
    main_guard = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert main_guard, f"{name}: no `if __name__ == \"__main__\"` guard (run as python -m gfxgraph.suites.{name})"


def test_suite_runs_as_a_module_from_anywhere(tmp_path: Path):
    r = _cli("-m", "gfxgraph.suites.shape_bucketing", "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--out" in r.stdout and "--quick" in r.stdout


def test_compile_backend_children_run_this_module():
    from gfxgraph.suites import compile_backend

    assert compile_backend.MODULE == compile_backend.__name__ == "gfxgraph.suites.compile_backend"


def test_reliability_finds_its_cases_in_the_checkout(tmp_path: Path):
    r = _cli("-m", "gfxgraph.suites.reliability", "--list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bad_input" in r.stdout


def test_device_run_sh_runs_the_suites_as_modules():
    text = (REPO / "tools" / "device_run.sh").read_text()
    assert 'python3 -m "gfxgraph.suites.$name" --out "$OUT"' in text
    assert "cd benchmarks" not in text


def test_committed_results_stay_in_benchmarks_results():
    assert sorted(p.stem for p in (REPO / "benchmarks" / "results").glob("*.json"))
    assert not list((REPO / "benchmarks").glob("*.py")), "suites belong in src/gfxgraph/suites"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gfxgraph built and installed from a copy of the checkout into a bare folder (no source tree beside it)."""
    pytest.importorskip("setuptools")
    root = tmp_path_factory.mktemp("install")
    copy = root / "checkout"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(SRC, copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    site = root / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "--target", str(site), str(copy)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"cannot build the package here: {r.stderr.strip()[-300:]}")
    return site


def test_installed_package_holds_every_suite(installed: Path):
    shipped = sorted(p.stem for p in (installed / "gfxgraph" / "suites").glob("*.py") if not p.name.startswith("_"))
    assert shipped == SUITE_FILES
    assert (installed / "gfxgraph" / "suites" / "_common.py").is_file()


def test_installed_bench_lists_and_imports_every_suite(installed: Path, tmp_path: Path):
    r = _cli("-m", "gfxgraph", "bench", "--list", cwd=tmp_path, pythonpath=installed)
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines() if line.strip()] == SUITE_FILES
    code = "import importlib, gfxgraph.bench as b; [importlib.import_module(m) for m in b.find_suites().values()]; " \
           "import gfxgraph.suites as s; print(s.__file__)"
    r = _py(code, cwd=tmp_path, pythonpath=installed)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(installed))


def test_installed_reliability_says_it_needs_a_checkout(installed: Path, tmp_path: Path):
    r = _cli("-m", "gfxgraph.suites.reliability", "--list", cwd=tmp_path, pythonpath=installed)
    assert r.returncode == 2
    assert "tests/reliability of a source checkout" in r.stderr
    assert "Traceback" not in r.stderr
