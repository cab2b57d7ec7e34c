"""Helpers the reliability cases share: outcome recording, health checks, memory readings.

Everything here runs inside a worker interpreter (``rel_worker.py``); nothing
touches the GPU at import, so the case modules import on CPU-only machines too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph, GraphState
from hipgraph_bridge import OriginalCUDAGraph
from rel_registry import Ctx, SilentWrong

__all__ = [
    "describe_exc", "attempt", "expect_raises", "capturing", "low_level", "sigint", "check_healthy",
    "Fault", "rss_bytes", "memory_sample", "run_in_thread", "unsafe_calls_from_other_thread",
    "liveness_supported", "GraphState",
]


def describe_exc(exc: BaseException | None) -> dict[str, Any] | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": str(exc).strip().splitlines()[0][:400] if str(exc) else ""}


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[BaseException | None, Any]:
    """Run ``fn``; return (the exception it raised or None, its result)."""
    try:
        return None, fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is an outcome here
        return exc, None


def expect_raises(types: type[BaseException] | tuple[type[BaseException], ...], pattern: str,
                  fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Bad-input check: ``fn`` must raise one of ``types`` with a message matching ``pattern``.

    Returns what was raised (for the JSON). Raises AssertionError otherwise, with
    "accepted silently" when nothing was raised.
    """
    exc, result = attempt(fn, *args, **kwargs)
    if exc is None:
        raise AssertionError(f"accepted silently (no exception; returned {type(result).__name__}); expected "
                             f"{_names(types)} naming what was expected (/{pattern}/)")
    if not isinstance(exc, types):
        raise AssertionError(f"expected {_names(types)} matching /{pattern}/, got {type(exc).__name__}: {exc}")
    if not re.search(pattern, str(exc), flags=re.S):
        raise AssertionError(f"raised {type(exc).__name__}, but the message does not name what was expected "
                             f"(/{pattern}/): {exc}")
    return {"raised": type(exc).__name__, "message": str(exc)[:300]}


def _names(types: Any) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in types)


def capturing(stream: torch.cuda.Stream) -> bool:
    with torch.cuda.stream(stream):
        return bool(torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def low_level(graph: Any, stream: torch.cuda.Stream, **kwargs: Any) -> Iterator[None]:
    """How serving code drives the low-level API: begin, region, end in ``finally``."""
    with torch.cuda.stream(stream):
        graph.capture_begin(**kwargs)
        try:
            yield
        finally:
            graph.capture_end()


def sigint() -> None:
    """Deliver a real SIGINT to this process (Python raises KeyboardInterrupt right after).

    The handler is (re)installed first: a worker started from a background job
    inherits SIGINT ignored, and Python then leaves it ignored.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.raise_signal(signal.SIGINT)


def run_in_thread(fn: Callable[[], Any], timeout: float = 30.0) -> dict[str, Any]:
    """Run ``fn`` in another thread and wait; return {"ok": result} or {"error": ...} or {"timeout": True}."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["ok"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["error"] = describe_exc(exc)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        out["timeout"] = True
    return out


def unsafe_calls_from_other_thread(*, device_sync: bool = True) -> dict[str, Any]:
    """From another thread: a fresh allocation (cudaMalloc: unsafe during a global capture) and,
    with ``device_sync``, a device-wide sync. A device sync waits on the capturing stream, which
    CUDA refuses in every capture mode; the modes only decide about calls such as cudaMalloc."""

    def calls() -> bool:
        if device_sync:
            torch.cuda.synchronize()
        t = torch.empty(48 << 20, dtype=torch.uint8, device="cuda")  # a new segment: cudaMalloc
        del t
        return True

    return run_in_thread(calls)


def check_healthy(streams: list[torch.cuda.Stream]) -> None:
    """After a failure: no stream capturing, no sticky error, RNG usable, captures on each stream work.

    Each stream captures through BridgedCUDAGraph (with a random op: the RNG left
    capture mode) and, on the first stream, through PyTorch's own CUDAGraph too
    (the allocator and generators are clean at the PyTorch level, not only gfxgraph's).
    """
    for st in streams:
        assert not capturing(st), f"stream {st.cuda_stream:#x} is still capturing after the failure"
    torch.cuda.synchronize()
    torch.rand(16, device="cuda")  # eager RNG works (the generator is out of capture mode)
    for i, st in enumerate(streams):
        for cls in ((BridgedCUDAGraph, OriginalCUDAGraph) if i == 0 else (BridgedCUDAGraph,)):
            x = torch.ones(1024, device="cuda")
            st.wait_stream(torch.cuda.current_stream())
            g = cls()
            with torch.cuda.stream(st):
                g.capture_begin()
                y = x * 3 + 1
                noise = torch.rand(64, device="cuda")
                g.capture_end()
            torch.cuda.current_stream().wait_stream(st)
            x.fill_(2.0)
            g.replay()
            first = noise.clone()
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, torch.full_like(x, 7.0)), f"{cls.__name__} capture on the same stream is wrong"
            assert not torch.equal(first, noise), f"{cls.__name__}: random numbers repeat across replays"
            g.reset()


class Fault:
    """Set-up and verdict of one fault-injection case.

    The case body injects the fault and checks the immediate outcome; :meth:`finish`
    then checks what every fault case promises: the failure was counted in
    ``gfxgraph.stats()`` (when ``counted``), no stream is left capturing, and the
    next capture on the same stream(s) works, random numbers included.
    """

    def __init__(self, ctx: Ctx, *, validate: bool = False) -> None:
        self.ctx = ctx
        self.observed = ctx.observed
        gfxgraph.enable(validate=validate)
        self.s = torch.cuda.Stream()
        self.x = torch.ones(1024, device="cuda")
        torch.cuda.synchronize()
        self.streams: list[torch.cuda.Stream] = [self.s]
        self.counted: bool = True
        self.silent_wrong: str | None = None
        self.before = gfxgraph.stats()

    def record(self, key: str, value: Any) -> None:
        self.observed[key] = value

    def expect(self, types: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException:
        exc, _ = attempt(fn, *args, **kwargs)
        self.observed["raised"] = describe_exc(exc)
        if exc is None:
            raise AssertionError(f"expected {_names(types)}, nothing was raised")
        if not isinstance(exc, types):
            raise AssertionError(f"expected {_names(types)}, got {type(exc).__name__}: {exc}")
        return exc

    def attempt(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[BaseException | None, Any]:
        exc, result = attempt(fn, *args, **kwargs)
        self.observed["raised"] = describe_exc(exc)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise AssertionError(f"unexpected {type(exc).__name__}")
        return exc, result

    def finish(self) -> None:
        after = gfxgraph.stats()
        delta = {k: after[k] - self.before[k] for k in ("capture_failures", "fallback_count",
                                                         "validation_failures", "capture_count")}
        self.observed["stats_delta"] = delta
        self.observed["fallback_reasons"] = after["fallback_reasons"]
        if self.counted:
            assert delta["capture_failures"] + delta["fallback_count"] + delta["validation_failures"] >= 1, \
                f"the failure was not counted in gfxgraph.stats(): {delta}"
        self.observed["current_stream_left_default"] = torch.cuda.current_stream() != torch.cuda.default_stream()
        torch.cuda.set_stream(torch.cuda.default_stream())
        check_healthy(self.streams)
        self.observed["healthy_after"] = True
        if self.silent_wrong:
            raise SilentWrong(self.silent_wrong)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_sample(*, empty_cache: bool = False) -> dict[str, int]:
    torch.cuda.synchronize()
    if empty_cache:
        torch.cuda.empty_cache()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "rss": rss_bytes()}


def liveness_supported() -> bool:
    """Whether the installed PyTorch has ``capture_begin(check_input_liveness=...)``."""
    import inspect

    try:
        return "check_input_liveness" in inspect.signature(OriginalCUDAGraph.capture_begin).parameters
    except (TypeError, ValueError):
        return False
