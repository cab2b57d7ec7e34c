"""Cases that die on purpose, to check the harness's classification (loaded only by the self-test).

Registered only when ``GFXGRAPH_RELIABILITY_EXTRA_CASES`` names this module; never
part of the suite's table.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import time

from rel_registry import Ctx, SilentWrong, case


@case("selftest_pass", "fault", where="any", timeout=60)
def _ok(ctx: Ctx) -> None:
    ctx.observed["ran"] = True


@case("selftest_abort", "fault", where="any", timeout=60)
def _abort(ctx: Ctx) -> None:
    os.abort()


@case("selftest_segfault", "fault", where="any", timeout=60)
def _segv(ctx: Ctx) -> None:
    ctypes.string_at(0)


@case("selftest_hang", "fault", where="any", timeout=2)  # its interpreter starts in well under a second (no torch)
def _hang(ctx: Ctx) -> None:
    time.sleep(120)


@case("selftest_exit_code", "fault", where="any", timeout=60)
def _exit(ctx: Ctx) -> None:
    os._exit(3)


@case("selftest_abort_at_exit", "fault", where="any", timeout=60)
def _abort_at_exit(ctx: Ctx) -> None:
    atexit.register(os.abort)


@case("selftest_silent_wrong", "corruption", where="any", timeout=60)
def _silent(ctx: Ctx) -> None:
    raise SilentWrong("returned stale data")


@case("selftest_assertion", "bad_input", where="any", timeout=60)
def _fail(ctx: Ctx) -> None:
    raise AssertionError("nothing raised")


@case("selftest_group_pass", "bad_input", where="any", unit="selftest_group", timeout=60)
def _g1(ctx: Ctx) -> None:
    pass


@case("selftest_group_abort", "bad_input", where="any", unit="selftest_group", timeout=60)
def _g2(ctx: Ctx) -> None:
    os.abort()


@case("selftest_group_unreached", "bad_input", where="any", unit="selftest_group", timeout=60)
def _g3(ctx: Ctx) -> None:
    pass
