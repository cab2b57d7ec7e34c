"""Run one unit of the reliability suite in this (fresh) interpreter.

    python tests/reliability/rel_worker.py UNIT

Prints one ``START`` line before each case and one result line after it, both
prefixed with :data:`MARK`, so the parent can tell which case was running when
the interpreter died (abort) or stopped answering (hang). Exits normally: an
abort in interpreter teardown (graph destructors at exit) is seen by the parent.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback

MARK = "@@gfxgraph-reliability@@ "
TIMEOUT_ENV = "GFXGRAPH_RELIABILITY_TIMEOUT"


def _emit(doc: dict) -> None:
    sys.stdout.write(MARK + json.dumps(doc, default=repr) + "\n")
    sys.stdout.flush()


def _reset_library_state() -> None:
    try:
        import gfxgraph

        gfxgraph.disable()
        gfxgraph.reset_stats()
    except Exception:
        pass


def run_case(c, gpu: bool, scale: float) -> dict:
    from rel_registry import Ctx, SilentWrong, Skip

    ctx = Ctx(gpu=gpu, scale=scale)
    t0 = time.perf_counter()
    error = None
    try:
        c.fn(ctx)
        status = "pass"
    except SilentWrong as exc:
        status, error = "silent_wrong", str(exc)
    except Skip as exc:
        status, error = "skip", str(exc)
    except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt that escaped is a failure too
        status = "fail"
        error = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc()[-4000:]
    return {"case": c.name, "status": status, "seconds": round(time.perf_counter() - t0, 3),
            "observed": ctx.observed, "error": error}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: rel_worker.py UNIT", file=sys.stderr)
        return 2
    unit = argv[0]
    faulthandler.enable()  # a SIGSEGV/SIGABRT prints the Python stack to stderr
    timeout = float(os.environ.get(TIMEOUT_ENV, "0") or 0)
    if timeout > 10:  # dump every thread's stack shortly before the parent kills a hang
        faulthandler.dump_traceback_later(timeout - 4, exit=False)
    import rel_registry

    members = rel_registry.unit_cases(unit)
    if not members:
        print(f"rel_worker: no unit named {unit!r}", file=sys.stderr)
        return 2
    extra = rel_registry.extra_modules()
    self_test = all(c.fn.__module__ in extra for c in members)
    if self_test:
        gpu = False  # the harness self-test's cases never touch torch: their interpreter does not import it
    else:
        import torch

        gpu = bool(torch.cuda.is_available())
    scale = rel_registry.scale()
    for c in members:
        _emit({"start": c.name})
        result = run_case(c, gpu, scale)
        if not self_test:
            _reset_library_state()
        _emit(result)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
