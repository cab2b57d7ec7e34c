"""`python -m gfxgraph script.py`, `gfxgraph run|doctor|version`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import SRC

SCRIPT = """
import sys, json, torch
print(json.dumps({"argv": sys.argv, "name": __name__, "graph": torch.cuda.CUDAGraph.__name__}))
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(SRC)}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "gfxgraph", *args], capture_output=True, text=True,
                          env=full, timeout=120)


def test_module_runs_script_as_main_with_its_argv_and_exit_code(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    r = _cli(str(script), "7", "--flag", "x")
    assert r.returncode == 7, r.stderr
    out = json.loads(r.stdout)
    assert out == {"argv": [str(script), "7", "--flag", "x"], "name": "__main__", "graph": "BridgedCUDAGraph"}


def test_run_subcommand_and_options_before_script(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    r = _cli("run", "--stats", str(script), "0", "--stats")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"] == [str(script), "0", "--stats"]
    assert '"replay_count"' in r.stderr  # --stats printed at exit


def test_run_module(tmp_path: Path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text(SCRIPT)
    r = _cli("run", "-m", "mypkg.server", "3", env={"PYTHONPATH": f"{SRC}{os.pathsep}{tmp_path}"})
    assert r.returncode == 3, r.stderr
    out = json.loads(r.stdout)
    assert out["name"] == "__main__" and out["argv"][1:] == ["3"] and out["graph"] == "BridgedCUDAGraph"


def test_script_exception_gives_nonzero_exit(tmp_path: Path):
    script = tmp_path / "bad.py"
    script.write_text("raise ValueError('boom')\n")
    r = _cli(str(script))
    assert r.returncode == 1
    assert "ValueError: boom" in r.stderr


def test_missing_script_is_a_clear_error(tmp_path: Path):
    r = _cli("run", str(tmp_path / "nope.py"))
    assert r.returncode == 2
    assert "expected a Python script" in r.stderr


def test_doctor_json_reports_why_not_ok():
    r = _cli("doctor", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert {"ok", "gpu", "arch", "rocm", "backend", "native_bridge", "vram_total_mb", "vram_free_mb",
            "details"} <= report.keys()
    if not report["ok"]:
        assert report["details"] and report["details"][0]
        strict = _cli("doctor", "--strict")
        assert strict.returncode == 1


def test_version():
    r = _cli("version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("gfxgraph ") and "torch " in r.stdout


def test_bench_lists_suites_and_skips_without_gpu():
    r = _cli("bench", "--list")
    assert r.returncode == 0, r.stderr
    assert "replay_overhead" in r.stdout and "shape_bucketing" in r.stdout
    bad = _cli("bench", "--suite", "nope")
    assert bad.returncode == 2 and "unknown suite" in bad.stderr


def test_bench_render_writes_tables(tmp_path: Path):
    src = tmp_path / "in"
    src.mkdir()
    doc = {"benchmark": "demo", "environment": {"device": "X", "torch": "t", "date": "d"},
           "figures": [{"name": "ratio", "value": 1.02, "unit": "", "target": "<= 1.05", "pass": True, "note": ""}]}
    (src / "demo.json").write_text(json.dumps(doc))
    r = _cli("bench", "--render", str(src), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    table = (tmp_path / "out" / "demo.md").read_text()
    assert "| ratio | 1.02 | <= 1.05 | pass |" in table


def test_run_module_passes_its_options_through(tmp_path: Path):
    pkg = tmp_path / "srv"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(SCRIPT)
    r = _cli("run", "-m", "srv", "0", "--requests", "40", env={"PYTHONPATH": f"{SRC}{os.pathsep}{tmp_path}"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"][1:] == ["0", "--requests", "40"]
