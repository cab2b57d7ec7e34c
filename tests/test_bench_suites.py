"""The benchmark suites ship in the package (gfxgraph.suites): found, listed and importable on CPU,
from a source checkout and from an installed copy, outside the repository."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _warm_python
from conftest import REPO, SRC
from gfxgraph.bench import find_suites, suite_summary
from gfxgraph.suites._common import write_diagnostic

SUITES_DIR = SRC / "gfxgraph" / "suites"
SUITE_FILES = sorted(p.stem for p in SUITES_DIR.glob("*.py") if not p.name.startswith("_"))


# Each child is a process of its own, forked from a warm interpreter started with the same options and
# PYTHONPATH (_warm_python: torch imported once, gfxgraph not; the fork starts as python -c / -m does).
def _py(code: str, *, cwd: Path, pythonpath: Path | str = SRC) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return _warm_python.run(["-W", "ignore", "-c", code], cwd=cwd, env=env, timeout=300)


def _cli(*args: str, cwd: Path, pythonpath: Path | str = SRC) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return _warm_python.run(["-W", "ignore", *args], cwd=cwd, env=env, timeout=300)


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


_IMPORT_EACH = """
import importlib, json, os, sys, torch
for name in sys.argv[1:]:
    path, env, mods = list(sys.path), dict(os.environ), set(sys.modules)
    cuda = torch.cuda.is_initialized()
    m = importlib.import_module("gfxgraph.suites." + name)
    new = set(sys.modules) - mods  # what this import brought in (not what an earlier suite did)
    print(json.dumps({"name": name, "cuda_initialized": torch.cuda.is_initialized() and not cuda,
                      "path_changed": sys.path != path,
                      "env_changed": sorted(set(os.environ.items()) ^ set(env.items())),
                      "main": callable(getattr(m, "main", None)),
                      "transformers": "transformers" in new, "matplotlib": "matplotlib" in new}), flush=True)
"""


@pytest.fixture(scope="module")
def suite_imports(tmp_path_factory) -> dict[str, dict]:
    """Every suite imported in one new process (forked from a warm interpreter that imported torch, nothing of
    gfxgraph), one after another; each import's side effects are what changed across it (one process instead
    of one per suite: the torch import is paid once)."""
    names = ["_common", *SUITE_FILES]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = _warm_python.run(["-W", "ignore", "-c", _IMPORT_EACH, *names], cwd=tmp_path_factory.mktemp("imports"),
                         env=env, timeout=300)
    got = {d["name"]: d for d in (json.loads(line) for line in r.stdout.splitlines() if line.startswith("{"))}
    assert r.returncode == 0 and len(got) == len(names), r.stderr[-3000:]
    return got


@pytest.mark.parametrize("name", SUITE_FILES + ["_common"])
def test_suite_imports_on_cpu_without_side_effects(name: str, suite_imports):
    got = dict(suite_imports[name])
    del got["name"]
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


# ------------------------------------------------------------------ prefill: runs per model, merged
def _prefill_result(model: str) -> dict:
    """What a prefill child reports for one model (figures invented, structure as the suite writes it)."""
    lengths = [3, 40, 100, 700, 9, 260]
    res = {"model": model, "slow_stream": 3, "params": 1, "stream_lengths": lengths, "mixed_lengths": [[5, 9]],
           "contenders": ["eager", "piecewise", "default", "reduce-overhead"]}
    for k, mode in enumerate(res["contenders"]):
        n = 3 if mode == "reduce-overhead" else len(lengths)
        ms = [(1.0 + k / 10) * (1 + x / 100) for x in lengths[:n]]
        res[mode] = {"mode": mode, "stream_requests": n, "mixed_batches": 1, "stream_total_s": 10.0 + k,
                     "checkpoint_total_s": 1.0 + k, "stream_ms": ms, "graph_bytes": 2**20 * k, "mixed_ms": [2.0],
                     "mixed_total_s": 1.0, "stream_max_diff": 0.01, "stream_within_tol": True,
                     "mixed_max_diff": 0.02, "mixed_within_tol": True, "first_pass_max_diff": 0.01}
    return res


def _prefill_run(monkeypatch: pytest.MonkeyPatch, model: str, out: Path) -> dict:
    from gfxgraph.suites import prefill

    monkeypatch.setattr(prefill, "run_child", lambda name, args: _prefill_result(name))
    monkeypatch.setattr(sys, "argv", ["prefill", "--models", model, "--out", str(out)])
    prefill.main()
    return json.loads((out / "prefill.json").read_text())


def test_prefill_runs_of_one_model_each_merge_into_one_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    a = _prefill_run(monkeypatch, "llama-small", tmp_path / "A")
    b = _prefill_run(monkeypatch, "llama-1.5b", tmp_path / "B")
    stale = {**b, "figures": []}  # the merge recomputes the figures from the results, it does not copy them
    (tmp_path / "B" / "prefill.json").write_text(json.dumps(stale))
    r = _cli("-m", "gfxgraph.suites.prefill", "--merge", "A/prefill.json", "B/prefill.json", "--out", "C",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    merged = json.loads((tmp_path / "C" / "prefill.json").read_text())
    assert merged["figures"] == a["figures"] + b["figures"]
    assert [res["model"] for res in merged["results"]] == ["llama-small", "llama-1.5b"]
    assert merged["environment"] == a["environment"] and merged["requests"] == a["requests"]
    assert [m["path"] for m in merged["merged_from"]] == ["A/prefill.json", "B/prefill.json"]
    assert [m["models"] for m in merged["merged_from"]] == [["llama-small"], ["llama-1.5b"]]
    names = [f["name"] for f in merged["figures"]]
    assert "llama-1.5b: piecewise / default steady latency, prompts 1-64 tokens (3)" in names
    assert "llama-small: piecewise total / reduce-overhead total, first 3 requests" in names
    assert "wrote C/prefill.json" in r.stdout


def test_prefill_merge_refuses_reports_that_do_not_form_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from gfxgraph.suites._prefill_report import merge

    a = _prefill_run(monkeypatch, "llama-small", tmp_path / "A")
    again = tmp_path / "again.json"
    again.write_text(json.dumps(a))
    with pytest.raises(ValueError, match="each model in one run only, got llama-small twice"):
        merge([tmp_path / "A" / "prefill.json", again], str(tmp_path / "C"))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**a, "results": [_prefill_result("llama-1.5b")], "quick": True}))
    with pytest.raises(ValueError, match="quick=True.*expected runs of the same settings"):
        merge([tmp_path / "A" / "prefill.json", other], str(tmp_path / "C"))
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "llm_decode"}))
    r = _cli("-m", "gfxgraph.suites.prefill", "--merge", "A/prefill.json", "x.json", "--out", "C", cwd=tmp_path)
    assert r.returncode == 2 and "expected a prefill.json written by gfxgraph.suites.prefill, got x.json" in r.stderr
    r = _cli("-m", "gfxgraph.suites.prefill", "--merge", "A/prefill.json", "--out", "C", cwd=tmp_path)
    assert r.returncode == 2 and "expected at least two prefill.json files, got 1" in r.stderr
    assert not (tmp_path / "C").exists()


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether process ``pid`` ended (exited, or a zombie not yet reaped by its new parent)."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "\nState:\tZ" in state:
            return True
        time.sleep(0.05)
    return False


def test_prefill_child_killed_by_its_timeout_keeps_the_contenders_it_finished(tmp_path: Path):
    from gfxgraph.suites import prefill
    from gfxgraph.suites._prefill_report import figures_of

    head = {k: v for k, v in _prefill_result("llama-small").items() if k in
            ("model", "slow_stream", "params", "stream_lengths", "mixed_lengths", "contenders")}
    eager = _prefill_result("llama-small")["eager"]
    pid_file = tmp_path / "helper.pid"
    helper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = f"""
import json, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {helper!r}])  # a compile worker, say: in the child's process group
while not __import__("os").path.exists({str(pid_file)!r}):
    time.sleep(0.05)
print({prefill._HEAD!r} + json.dumps({head!r}), flush=True)
print({prefill._MARK!r} + json.dumps({{"mode": "eager", "result": {eager!r}}}), flush=True)
time.sleep(120)
"""
    t0 = time.perf_counter()
    res = prefill.run_collect("llama-small", [sys.executable, "-c", script], env=None, timeout=3)
    assert time.perf_counter() - t0 < 30
    assert _gone(int(pid_file.read_text())), "the child's own child outlived the timeout"
    assert res["eager"] == eager and res["contenders"] == head["contenders"]
    assert res["piecewise"] == {"error": "the child was killed after the 3 s timeout (--child-timeout) while this "
                                         "contender ran"}
    assert res["default"]["error"].startswith("not started: the child was killed")
    assert res["incomplete"].endswith("finished: eager; not finished: piecewise, default, reduce-overhead")
    names = [f["name"] for f in figures_of([res])]
    assert "llama-small: incomplete run" in names and "llama-small eager: steady latency, median over the stream" \
        in names and "llama-small piecewise: failed" in names
    r = prefill.run_collect("llama-small", [sys.executable, "-c", "import sys; sys.exit(3)"], env=None, timeout=30)
    assert r == {"model": "llama-small", "error": "the child exited with status 3"}


def test_prefill_child_prints_each_contender_as_it_finishes_and_progress_on_stderr(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    from gfxgraph.suites import prefill
    from gfxgraph.suites._prefill_report import figures_of

    monkeypatch.setattr(prefill, "DEVICE", "cpu")
    monkeypatch.setattr(prefill, "MAX_LEN", 12)
    monkeypatch.setattr(prefill, "warm_compilers", lambda: None)
    monkeypatch.setitem(prefill.CONFIGS, "llama-small",
                        dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256))
    prefill.child("llama-small", 4, 2, 2, ["eager", "no-such-mode"])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith(prefill._HEAD) and all(ln.startswith(prefill._MARK) for ln in lines[1:]), out
    res = prefill.collect("llama-small", out, None)
    assert len(res["eager"]["stream_ms"]) == 4 and len(res["eager"]["mixed_ms"]) == 2
    assert "error" in res["no-such-mode"] and "incomplete" not in res
    assert any(f["name"] == "llama-small no-such-mode: failed" for f in figures_of([res]))
    assert "prefill llama-small eager: start [" in err and "s into eager, " in err
    assert "prefill llama-small eager: done: stream total" in err and "prefill llama-small no-such-mode: failed" in err


def _device_generate_case(own_topk_ms: float) -> dict:
    """A device_generate case's results as run_case writes them (numbers made up for the verdict logic)."""
    from gfxgraph.suites.device_generate import CHUNKS, SAMPLE_K, SAMPLING

    mode = {"tokens_per_s": 100.0, "tokens_equal_eager": True, "agreement": 1.0, "first_divergence": None,
            "new_tokens": 256}
    r = {k: dict(mode) for k in ("eager", "hand-written graph", "pool", *(f"device K={c}" for c in CHUNKS),
                                 *(f"device K={SAMPLE_K} {s}" for s in SAMPLING))}
    step = {"loop_ms_per_token": 1.02, "own_step_graph_ms": 1.0, "step_graph_ms": 1.0, "ratio_to_own_step_graph": 1.02,
            "ratio_to_step_graph": 1.02}
    topk = {"loop_ms_per_token": 1.05, "own_step_graph_ms": own_topk_ms, "step_graph_ms": 1.0,
            "ratio_to_own_step_graph": 1.05 / own_topk_ms, "ratio_to_step_graph": 1.05}
    r["step_time"] = {"step_graph_ms": 1.0, "greedy": step, "sample t=0.8": step, "sample top-k 50 top-p 0.9": topk}
    return r


def test_device_generate_gives_no_verdict_where_the_loop_beats_its_own_step_graph():
    from gfxgraph.suites.device_generate import case_figures

    def verdict(own_ms: float) -> dict:
        figs = case_figures("m", 1, _device_generate_case(own_ms))
        return next(f for f in figs if "top-k" in f["name"] and "its own step graph" in f["name"])

    assert verdict(1.03)["pass"] is True and "NO VERDICT" not in verdict(1.03)["note"]
    assert verdict(1.0)["pass"] is False  # 1.05: over the target
    broken = verdict(1.4)  # the loop, which runs this graph's work and more, 25% faster: the graph is not trusted
    assert broken["pass"] is None and "NO VERDICT" in broken["note"]


def test_gpu_time_per_replay_refuses_a_torch_without_a_sleep_kernel(monkeypatch: pytest.MonkeyPatch):
    import gfxgraph.suites._common as common

    monkeypatch.setattr(common, "gpu_sleep", lambda cycles: False)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    calls = []
    with pytest.raises(RuntimeError, match="no GPU sleep kernel"):
        common.gpu_ms_per_replay(lambda: calls.append(1), 100)
    assert len(calls) == 8  # only the calls that measure how long queueing takes ran


def test_a_diagnostic_is_written_after_the_devices_name_and_torchs_version(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    path = write_diagnostic(str(tmp_path / "out"), "probe", {"method": "m", "results": {"a": 1}})
    assert path == str(tmp_path / "out" / "probe.json")
    doc = json.loads(Path(path).read_text())
    assert list(doc) == ["device", "torch", "method", "results"]
    assert doc["device"] == "a GPU" and doc["torch"] == torch.__version__ and doc["results"] == {"a": 1}
