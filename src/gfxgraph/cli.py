"""The ``gfxgraph`` command (also ``python -m gfxgraph``).

    gfxgraph run script.py [args...]     run a script with gfxgraph enabled
    gfxgraph run -m package.module [args...]
    python -m gfxgraph script.py [args...]   same as ``run``
    gfxgraph doctor [--json] [--strict]  report GPU graph health
    gfxgraph version                     versions of gfxgraph, torch and the runtime
    gfxgraph bench [--suite NAME] [--out DIR]   run the benchmark suites (gfxgraph.suites)

Options of ``run`` go before the script; everything after it is the script's.
"""

from __future__ import annotations

import argparse
import atexit
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
from hipgraph_bridge.config import read_enable_mode, read_log_level
from hipgraph_bridge.platform import probe

_COMMANDS = ("run", "doctor", "version", "bench")


def _configure_logging(default: int) -> None:
    logger = logging.getLogger("gfxgraph")
    if not any(getattr(h, "_gfxgraph_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[gfxgraph] %(levelname)s: %(message)s"))
        handler._gfxgraph_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    level = read_log_level()
    logger.setLevel(level if level is not None else default)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gfxgraph", description="Safe GPU graph capture/replay for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script or module with gfxgraph enabled")
    run.add_argument("--debug", action="store_true", help="enable(debug=True)")
    run.add_argument("--validate", action="store_true", help="enable(validate=True): compare replays with eager")
    run.add_argument("--stats", action="store_true", help="print gfxgraph.stats() to stderr at exit")
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


def _cmd_run(args: argparse.Namespace) -> int:
    _configure_logging(logging.WARNING)
    env_mode = read_enable_mode()
    gfxgraph.enable(debug=args.debug or env_mode == "debug", validate=args.validate or env_mode == "validate")
    if args.stats:
        atexit.register(lambda: print(json.dumps(gfxgraph.stats(), indent=2, default=str), file=sys.stderr))
    if args.module:
        sys.argv = [args.module, *args.target]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return 0
    if not args.target:
        print("gfxgraph run: expected a script path (or -m MODULE)", file=sys.stderr)
        return 2
    script, *script_args = args.target
    if not os.path.isfile(script):
        print(f"gfxgraph run: expected a Python script, but {script!r} is not a file", file=sys.stderr)
        return 2
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    _configure_logging(logging.WARNING)
    report = gfxgraph.health_check()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"gfxgraph {gfxgraph.__version__} doctor: {'OK' if report['ok'] else 'NOT OK'}")
        for key in ("backend", "gpu", "arch", "torch", "runtime_version", "native_bridge",
                    "vram_total_mb", "vram_free_mb", "capture_us", "replay_us"):
            if key in report:
                print(f"  {key:16s} {report[key]}")
        for line in report["details"]:
            print(f"  - {line}")
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in _COMMANDS and not argv[0].startswith("-"):
        argv = ["run", *argv]  # python -m gfxgraph script.py args...
    module_args: list[str] = []
    if argv and argv[0] == "run" and "-m" in argv:
        # everything after `-m MODULE` belongs to the module, options included
        i = argv.index("-m")
        argv, module_args = argv[:i + 2], argv[i + 2:]
    args = _parser().parse_args(argv)
    if module_args:
        args.target = module_args
    handler = {"run": _cmd_run, "doctor": _cmd_doctor, "version": _cmd_version, "bench": _cmd_bench}
    return handler[args.command](args)
