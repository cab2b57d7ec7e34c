"""`python -m gfxgraph script.py`, `gfxgraph run|doctor|version`, `--version`; sys.path as python sets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _warm_python
from conftest import GPU_SKIP_REASON, SRC
from gfxgraph import cli
from hipgraph_bridge import log

SCRIPT = """
import sys, json, torch
print(json.dumps({"argv": sys.argv, "name": __name__, "graph": torch.cuda.CUDAGraph.__name__}))
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture
def in_process(monkeypatch, capsys):
    """``cli.main(argv)`` in this process: (exit code, stdout, stderr); sys.path, sys.argv and the stderr
    handler put back. For what needs no fresh interpreter (a subprocess costs a torch import)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["gfxgraph"])

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse's exits (--version)
            code = exc.code if isinstance(exc.code, int) else 0
        finally:
            log.detach_stderr_handler()
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def _cli(*args: str, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m gfxgraph ARGS`` in a process of its own, forked from a warm interpreter (_warm_python:
    torch imported once, gfxgraph not; the fork starts as ``python -m`` does: argv, sys.path[0], cwd)."""
    full = {**os.environ, "PYTHONPATH": str(SRC)}
    full.update(env or {})
    return _warm_python.run(["-m", "gfxgraph", *args], env=full, cwd=cwd, timeout=120)


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


def _last_line(stderr: str) -> str:
    """The CLI's own message: the last line of stderr (PyTorch may warn at import before it)."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    return lines[-1] if lines else ""


def test_missing_script_is_one_clear_line(tmp_path: Path, in_process):
    code, _, err = in_process("run", str(tmp_path / "nope.py"))
    assert code == 2
    assert _last_line(err) == f"gfxgraph run: expected a Python script, but {str(tmp_path / 'nope.py')!r} is not a file"


def test_missing_module_is_one_clear_line(tmp_path: Path, in_process, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = in_process("run", "-m", "no_such_module_here")
    assert code == 2
    assert _last_line(err).startswith("gfxgraph run: no module named 'no_such_module_here' (searched sys.path")
    code, _, err = in_process("run", "-m", "no_such_pkg.server")
    assert code == 2 and "no module named 'no_such_pkg.server'" in _last_line(err)


def test_package_without_main_is_one_clear_line(tmp_path: Path, in_process, monkeypatch):
    (tmp_path / "lib_only_pkg_25").mkdir()
    (tmp_path / "lib_only_pkg_25" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "lib_only_pkg_25", raising=False)
    code, _, err = in_process("run", "-m", "lib_only_pkg_25")
    assert code == 2
    assert "'lib_only_pkg_25' is a package and cannot be directly executed" in _last_line(err)


def test_import_error_inside_the_module_keeps_its_traceback(tmp_path: Path):
    (tmp_path / "needs_dep.py").write_text("import not_installed_dependency_xyz\n")
    r = _cli("run", "-m", "needs_dep", cwd=tmp_path)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "No module named 'not_installed_dependency_xyz'" in r.stderr


def test_run_options_before_script_without_run(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    r = _cli("--stats", str(script), "0", "--debug")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"] == [str(script), "0", "--debug"]
    assert '"replay_count"' in r.stderr


def test_dash_m_after_the_script_belongs_to_the_script(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    r = _cli("run", str(script), "0", "-m", "x", "tail")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["argv"] == [str(script), "0", "-m", "x", "tail"]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_is_the_version_command(flag, in_process):
    code, out, err = in_process(flag)
    assert code == 0, err
    assert out == in_process("version")[1]
    assert out.startswith("gfxgraph ")


# ------------------------------------------------------------ sys.path, as python does
def _console_script(tmp_path: Path) -> Path:
    """A copy of the ``gfxgraph`` wrapper pip writes into ``bin/``: sys.path[0] is bin/, not the cwd."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "gfxgraph"
    wrapper.write_text(f"#!{sys.executable}\nimport re\nimport sys\nfrom gfxgraph.cli import main\n"
                       "if __name__ == '__main__':\n"
                       "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                       "    sys.exit(main())\n")
    wrapper.chmod(0o755)
    return wrapper


def test_console_script_finds_a_module_in_the_current_directory(tmp_path: Path):
    work = tmp_path / "work"
    (work / "srv").mkdir(parents=True)
    (work / "srv" / "__init__.py").write_text("")
    (work / "srv" / "__main__.py").write_text(SCRIPT)
    r = subprocess.run([str(_console_script(tmp_path)), "run", "-m", "srv", "5"], capture_output=True,
                       text=True, cwd=work, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert r.returncode == 5, r.stderr
    assert json.loads(r.stdout)["argv"][1:] == ["5"]


def test_console_script_puts_the_script_directory_first(tmp_path: Path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "helper_mod.py").write_text("VALUE = 'from the script directory'\n")
    (tmp_path / "app" / "main.py").write_text("import helper_mod\nprint(helper_mod.VALUE)\n")
    r = subprocess.run([str(_console_script(tmp_path)), "run", str(tmp_path / "app" / "main.py")],
                       capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "from the script directory"


def test_main_in_process_puts_the_current_directory_first(tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "cwd_probe_mod_14.py").write_text("import sys\nprint('ran', __name__, sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.setattr(sys, "argv", ["gfxgraph"])
    monkeypatch.delitem(sys.modules, "cwd_probe_mod_14", raising=False)
    try:
        assert cli.main(["run", "-m", "cwd_probe_mod_14", "a", "--b"]) == 0
    finally:
        log.detach_stderr_handler()
    assert capsys.readouterr().out == "ran __main__ ['a', '--b']\n"
    assert sys.path[0] == str(tmp_path)


def test_doctor_json_reports_why_not_ok(in_process):
    code, out, err = in_process("doctor", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert {"ok", "gpu", "arch", "rocm", "backend", "native_bridge", "vram_total_mb", "vram_free_mb",
            "details"} <= report.keys()
    if not report["ok"]:
        assert report["details"] and report["details"][0]
        assert in_process("doctor", "--strict")[0] == 1


def test_version(in_process):
    code, out, err = in_process("version")
    assert code == 0, err
    assert out.startswith("gfxgraph ") and "torch " in out


def test_bench_lists_suites_and_skips_without_gpu(in_process):
    code, out, err = in_process("bench", "--list")
    assert code == 0, err
    assert "replay_overhead" in out and "shape_bucketing" in out
    code, _, err = in_process("bench", "--suite", "nope")
    assert code == 2 and "unknown suite" in err


def test_bench_render_writes_tables(tmp_path: Path, in_process):
    src = tmp_path / "in"
    src.mkdir()
    doc = {"benchmark": "demo", "environment": {"device": "X", "torch": "t", "date": "d"},
           "figures": [{"name": "ratio", "value": 1.02, "unit": "", "target": "<= 1.05", "pass": True, "note": ""}]}
    (src / "demo.json").write_text(json.dumps(doc))
    code, _, err = in_process("bench", "--render", str(src), "--out", str(tmp_path / "out"))
    assert code == 0, err
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


# ------------------------------------------------------------------ doctor
def test_doctor_reports_a_bad_vram_cap_and_strict_fails(in_process, monkeypatch):
    monkeypatch.setenv("GFXGRAPH_VRAM_CAP", "2")  # read by each doctor run
    code, out, err = in_process("doctor")
    assert code == 0, err
    assert out.splitlines()[0].endswith("doctor: NOT OK")
    assert "  - configuration: GFXGRAPH_VRAM_CAP='2': expected a fraction of device memory in (0.0, 1.0]" in out
    report = json.loads(in_process("doctor", "--json")[1])
    assert report["ok"] is False
    assert report["config_errors"] and report["config_errors"][0].startswith("GFXGRAPH_VRAM_CAP='2'")
    assert report["details"][0] == f"configuration: {report['config_errors'][0]}"  # the first detail says why
    assert in_process("doctor", "--strict")[0] == 1


@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="CPU-only behaviour")
def test_doctor_forced_ctypes_on_cpu_torch_is_no_native_bridge():
    report = json.loads(_cli("doctor", "--json", env={"GFXGRAPH_RUNTIME": "ctypes"}).stdout)
    assert report["native_bridge"] is False
    assert any(d.startswith("native bridge: ") for d in report["details"])


# ------------------------------------------------------------------ messages that guide
def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_mistyped_command_lists_the_commands(in_process):
    code, _, err = in_process("doctr")
    line = _one_line(err)
    assert code == 2
    assert "'doctr' is neither a command nor a script file" in line
    assert "run, doctor, version, bench" in line and "did you mean 'doctor'?" in line


def test_bench_list_of_an_unknown_suite_is_one_line(in_process):
    code, out, err = in_process("bench", "--list", "--suite", "nosuch")
    assert code == 2 and not out
    line = _one_line(err)
    assert "unknown suite(s) 'nosuch'" in line and "replay_overhead" in line
    code, out, _ = in_process("bench", "--list", "--suite", "tier2")
    assert code == 0 and out.startswith("tier2") and len(out.strip().splitlines()) == 1


def test_bench_out_that_cannot_be_written_is_one_line(tmp_path: Path, in_process):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for args in (("bench", "--suite", "tier2", "--out", str(blocker / "sub")),
                 ("bench", "--render", str(tmp_path), "--out", str(blocker))):
        if args[1] == "--render":
            (tmp_path / "demo.json").write_text(json.dumps({"benchmark": "demo", "figures": []}))
        code, _, err = in_process(*args)
        line = _one_line(err)
        assert code == 2 and "cannot create the output folder" in line and str(blocker) in line, line


@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="the no-GPU message")
@pytest.mark.parametrize("suite", ["llm_decode", "hf_generate", "device_generate", None])
def test_gpu_suites_without_a_gpu_are_one_line_exit_2(tmp_path: Path, in_process, suite):
    args = ("bench", "--out", str(tmp_path / "o")) + (("--suite", suite) if suite else ())
    code, out, err = in_process(*args)
    line = _one_line(err)
    assert code == 2 and not out
    assert "measure GPU graphs and this machine has no usable GPU" in line
    assert (suite or "replay_overhead") in line


def test_bench_render_without_matplotlib_says_tables_only_and_how_to_get_plots(tmp_path: Path, in_process,
                                                                             monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed, as far as this process can tell
    doc = {"benchmark": "demo", "environment": {"device": "X", "torch": "t", "date": "d"},
           "figures": [{"name": "ratio", "value": 1.0, "unit": "", "target": None, "pass": None, "note": ""}]}
    (tmp_path / "demo.json").write_text(json.dumps(doc))
    code, out, _ = in_process("bench", "--render", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 0 and (tmp_path / "o" / "demo.md").is_file() and not list((tmp_path / "o").glob("*.png"))
    assert "wrote tables only" in out and "pip install 'gfxgraph[plot]'" in out


def test_the_plot_extra_is_declared():
    text = (SRC.parent / "pyproject.toml").read_text()
    assert 'plot = ["matplotlib' in text
