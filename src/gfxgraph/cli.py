"""The ``gfxgraph`` command (also ``python -m gfxgraph``).

    gfxgraph run [--debug] [--validate] [--stats] script.py [args...]
    gfxgraph run [options] -m package.module [args...]
    python -m gfxgraph [options] script.py [args...]   same as ``run`` (also with -m)
    gfxgraph doctor [--json] [--strict]  report GPU graph health
    gfxgraph version (or --version)      versions of gfxgraph, torch and the runtime
    gfxgraph bench [--suite NAME] [--out DIR]   run the benchmark suites (gfxgraph.suites)

Options of ``run`` go before the script; everything after it is the script's.
As ``python`` does, ``-m`` puts the current directory first on ``sys.path`` and
a script path puts the script's directory there.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import importlib.util
import json
import logging
import os
import runpy
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

import torch

import gfxgraph
from gfxgraph.bench import render_results, run_bench
from hipgraph_bridge.config import read_enable_mode
from hipgraph_bridge.log import attach_stderr_handler, logger
from hipgraph_bridge.platform import probe
from hipgraph_bridge.runtime.capability_report import capability_report

_COMMANDS = ("run", "doctor", "version", "bench")
_RUN_FLAGS = {
    "--debug": "enable(debug=True)",
    "--validate": "enable(validate=True): compare replays with eager",
    "--stats": "print gfxgraph.stats() to stderr at exit",
}
_RUN_OPTIONS = (*_RUN_FLAGS, "-m")  # `python -m gfxgraph --stats script.py` means run


def _configure_logging(default: int | None) -> None:
    """gfxgraph's records on stderr (unless the script configures logging); ``default`` when no level is set."""
    attach_stderr_handler()
    if default is not None and logger.level == logging.NOTSET:  # GFXGRAPH_LOG_LEVEL was not set
        logger.setLevel(default)


class _VersionAction(argparse.Action):
    """``--version``: the ``version`` command, then exit (like argparse's own version action)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print versions (the version command) and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        parser.exit(_cmd_version(namespace))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gfxgraph", description="Safe GPU graph capture/replay for PyTorch.")
    p.add_argument("-V", "--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script or module with gfxgraph enabled")
    for flag, text in _RUN_FLAGS.items():
        run.add_argument(flag, action="store_true", help=text)
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module as __main__ (like python -m)")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args...] (or the module's args with -m)")
    doctor = sub.add_parser("doctor", help="report GPU graph health (captures and verifies a small graph)")
    doctor.add_argument("--json", action="store_true", help="print the health_check() dict as JSON")
    doctor.add_argument("--strict", action="store_true", help="exit with 1 when the check is not ok")
    sub.add_parser("version", help="print versions")
    bench = sub.add_parser("bench", help="run the benchmark suites and write JSON, tables, plots")
    bench.add_argument("--suite", action="append", help="benchmark name (repeatable); default: all")
    bench.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    bench.add_argument("--list", action="store_true", help="list the suites and exit")
    bench.add_argument("--render", metavar="DIR", help="write tables and plots for the JSON already in DIR "
                       "(e.g. benchmarks/results) into --out, without running anything")
    return p


def _module_problem(name: str) -> str | None:
    """Why ``python -m name`` could not find what to run (None: it can), without running it.

    Importing the parent packages runs their ``__init__``; an error raised there
    other than the module being absent is the user's and propagates.
    """
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            if importlib.util.find_spec(f"{name}.__main__") is None:
                return f"no module named {name}.__main__; {name!r} is a package and cannot be directly executed"
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            spec = None
        else:
            raise
    except ValueError as exc:  # an empty or relative name
        return f"{name!r} is not a module name ({exc})"
    if spec is None:
        return (f"no module named {name!r} (searched sys.path, which starts with the current "
                f"directory {os.getcwd()})")
    return None


def _run_module(module: str, module_args: list[str]) -> int:
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in ("", cwd):
        sys.path.insert(0, cwd)  # what `python -m` does; a console script starts with its bin/ there
    problem = _module_problem(module)
    if problem is not None:
        print(f"gfxgraph run: {problem}", file=sys.stderr)
        return 2
    sys.argv = [module, *module_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _run_script(target: list[str]) -> int:
    if not target:
        print("gfxgraph run: expected a script path (or -m MODULE)", file=sys.stderr)
        return 2
    script, *script_args = target
    if not os.path.isfile(script):
        print(f"gfxgraph run: expected a Python script, but {script!r} is not a file", file=sys.stderr)
        return 2
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # what `python script.py` does
    runpy.run_path(script, run_name="__main__")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    _configure_logging(None)
    env_mode = read_enable_mode()
    gfxgraph.enable(debug=args.debug or env_mode == "debug", validate=args.validate or env_mode == "validate")
    if args.stats:
        atexit.register(lambda: print(json.dumps(gfxgraph.stats(), indent=2, default=str), file=sys.stderr))
    if args.module:
        return _run_module(args.module, args.target)
    return _run_script(args.target)


def _cmd_doctor(args: argparse.Namespace) -> int:
    _configure_logging(None)
    report = gfxgraph.health_check()
    report["capabilities"] = capability_report()  # the capability table for this machine, with warnings
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"gfxgraph {gfxgraph.__version__} doctor: {'OK' if report['ok'] else 'NOT OK'}")
        for key in ("backend", "gpu", "arch", "torch", "runtime_version", "native_bridge", "device_launch",
                    "vram_total_mb", "vram_free_mb", "capture_us", "replay_us"):
            if key in report:
                print(f"  {key:16s} {report[key]}")
        for line in report["details"]:
            print(f"  - {line}")
        for line in report["capabilities"]["lines"]:
            print(f"  {line}")
    return 1 if (args.strict and not report["ok"]) else 0


def _cmd_version(_: argparse.Namespace) -> int:
    p = probe()
    print(f"gfxgraph {gfxgraph.__version__}")
    print(f"torch {torch.__version__} (backend: {p.backend or 'none'}, runtime: {p.runtime_version or '-'})")
    try:
        print(f"cuda-bindings {version('cuda-bindings')}")
    except PackageNotFoundError:
        print("cuda-bindings not installed (graph nodes, exec update and conditional nodes on CUDA need: pip install 'gfxgraph[cuda]')")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    _configure_logging(logging.INFO)
    if args.render:
        return render_results(args.render, args.out)
    return run_bench(suites=args.suite, out_dir=args.out, list_only=args.list)


def _normalise(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``argv`` with ``run`` made explicit, and the arguments after ``-m MODULE`` split off.

    ``python -m gfxgraph [run options] script.py`` means ``run``. Only ``-m``
    among the options before the script counts: everything after ``-m MODULE``
    (or after the script) belongs to the program, options included.
    """
    if argv and argv[0] not in _COMMANDS and (argv[0] in _RUN_OPTIONS or not argv[0].startswith("-")):
        argv = ["run", *argv]
    if not argv or argv[0] != "run":
        return argv, None
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "-m":
            return argv[:i + 2], argv[i + 2:]
        if not arg.startswith("-"):
            break  # the script: the rest is its own
    return argv, None


def _unknown_command(argv: list[str]) -> str | None:
    """The one-line error for a first word that is neither a command, an option, nor a script file."""
    if not argv or argv[0] in _COMMANDS or argv[0].startswith("-") or os.path.isfile(argv[0]):
        return None
    word = argv[0]
    if word.endswith(".py") or os.sep in word:  # meant as a script: run's own message names it
        return None
    near = difflib.get_close_matches(word, _COMMANDS, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (f"gfxgraph: {word!r} is neither a command nor a script file; commands: {', '.join(_COMMANDS)} "
            f"(gfxgraph COMMAND --help), or gfxgraph [run] script.py{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    A first word that is neither a command nor a file (a typo such as ``doctr``)
    prints one line listing the commands and returns 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    problem = _unknown_command(argv)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    argv, module_args = _normalise(argv)
    args = _parser().parse_args(argv)
    if module_args is not None:
        args.target = module_args
    handler = {"run": _cmd_run, "doctor": _cmd_doctor, "version": _cmd_version, "bench": _cmd_bench}
    return handler[args.command](args)
