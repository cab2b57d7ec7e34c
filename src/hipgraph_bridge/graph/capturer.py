"""Capturing a family of graphs: one memory pool, one side stream, warm-up, the VRAM cap.

Every graph family in the library (a pool's buckets, a piecewise frame's
pieces, a conditional graph's branches, a device loop's bodies) captures
through one :class:`Capturer`:

1. refuse a capture that would push device memory past the cap (estimated
   from the largest capture so far; reason ``vram_cap``);
2. run the warm-up runs on the capture stream, outside any capture (the last
   one's result is kept when asked: it answers the call that triggered the capture);
3. capture ``run`` into a :class:`~.bridged.SafeCUDAGraph` in the family's pool,
   with the garbage collector frozen (every failure path is the graph's own);
4. undo a capture that passed the cap after all.

A capture that failed retires the pool (PyTorch's allocator may keep
recording to it): later captures use a fresh one. A pool the caller gave is
never replaced; a capture into it after a failure raises PyTorch's error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..fallbacks import Fallback, Reason
from ..log import logger
from .bridged import SafeCUDAGraph
from .capture import check_capture_mode, warm_up
from .memory import exceeds_vram_cap, graph_pool_bytes

__all__ = ["Capturer", "Captured"]


@dataclass
class Captured:
    """The outcome of one capture.

    ``graph`` is None when the work runs eagerly (``fallback`` says why).
    ``outputs`` are the captured outputs (kept even when the graph was undone
    for the VRAM cap, for their layout); ``warm`` the last warm-up's result
    when asked for (also after a failed capture).
    """

    graph: SafeCUDAGraph | None = None
    outputs: Any = None
    warm: Any = None
    fallback: Fallback | None = None
    stage: str = ""  # where a failure happened: "warm_up" (the work raised) or "capture"
    error: Exception | None = None  # the exception of a failure


class Capturer:
    """Captures the graphs of one family (see the module docstring).

    Args:
        warmup_iters: warm-up runs before each capture (a capture may pass its own runs).
        vram_cap: fraction of device memory no capture may push use past.
        capture_error_mode: ``"thread_local"`` (default) keeps other threads' CUDA work unaffected.
        generators: extra generators registered with every graph.
        pool: a memory-pool handle to capture into (default: the capturer's own, replaced after a failure).
    """

    def __init__(self, *, warmup_iters: int = 1, vram_cap: float = 1.0, capture_error_mode: str = "thread_local",
                 generators: Sequence[torch.Generator] = (), pool: Any = None) -> None:
        self.warmup_iters = warmup_iters
        self.vram_cap = vram_cap
        self.capture_error_mode = check_capture_mode(capture_error_mode)
        self.generators = tuple(generators)
        self.seconds = 0.0
        self._given_pool = pool is not None
        self._pool_handle: Any = pool
        self._retired: list[Any] = []  # pools of earlier graphs, after a capture failure
        self._stream: torch.cuda.Stream | None = None
        self._largest_growth = 0

    @property
    def pool_handle(self) -> Any:
        """The shared memory-pool handle (None before the first capture)."""
        return self._pool_handle

    @property
    def stream(self) -> torch.cuda.Stream:
        """The side stream warm-ups and captures run on (made on first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def pool_bytes(self) -> int:
        """Bytes reserved by this family's graphs, as the caching allocator reports them."""
        pools = [p for p in (self._pool_handle, *self._retired) if p is not None]
        return graph_pool_bytes(pools) if pools else 0

    def forget_growth(self) -> None:
        self._largest_growth = 0

    def release_pool(self) -> None:
        """Every graph of the family was released: later captures use a fresh pool (PyTorch's allocator
        refuses to capture into a pool whose graphs are all gone: ``use_count > 0``). A given pool stays."""
        self._largest_growth = 0
        if not self._given_pool:
            self._pool_handle = None

    def refusal(self) -> str | None:
        """Why a capture now would pass the VRAM cap (None: it may be made)."""
        over, why = exceeds_vram_cap(self._largest_growth, self.vram_cap)
        return why if over else None

    def run(self, fn: Callable[[], Any], *, tracer: Any = None) -> Any:
        """One run of ``fn`` on the capture stream, outside any capture (a warm-up whose result is kept),
        inside ``tracer`` (a dispatch mode) when given. The caller's stream waits for it."""
        with torch.no_grad():
            if tracer is None:
                return warm_up(fn, self.stream, 1)
            with tracer:
                return warm_up(fn, self.stream, 1)

    def capture(self, run: Callable[[], Any], what: str, *, warm: Sequence[Callable[[], Any]] | None = None,
                keep_warm: bool = False, freeze_gc: bool = True, cap_checked: bool = False) -> Captured:
        """Warm up and capture ``run``; ``what`` names it in messages (``"bucket 8"``).

        ``warm``: the warm-up runs, in order (default: ``run``, ``warmup_iters`` times).
        ``keep_warm``: keep the last warm-up's result in :attr:`Captured.warm`.
        ``cap_checked``: :meth:`refusal` was asked already (the ranks agreed on it).
        Exceptions of the runs become a failed :class:`Captured`; a ``KeyboardInterrupt``
        (any ``BaseException``) propagates after the capture was ended.
        """
        why = None if cap_checked else self.refusal()
        if why is not None:
            logger.warning("gfxgraph: %s runs eagerly: %s", what, why)
            return Captured(fallback=Fallback(Reason.VRAM_CAP, f"{what}: {why}"))
        runs = [run] * self.warmup_iters if warm is None else list(warm)
        stream = self.stream
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved()
        result = Captured()
        g = SafeCUDAGraph()
        g.register_generators(self.generators)
        result.stage = "warm_up"
        try:
            with torch.no_grad():
                out = None
                for fn in runs:
                    out = None  # free the previous run's outputs first
                    out = warm_up(fn, stream, 1)
                result.warm = out if keep_warm else None
                del out  # nobody returns it otherwise: free it before capturing
                result.stage = "capture"
                with g.capturing(pool=self._pool_handle, stream=stream, capture_error_mode=self.capture_error_mode,
                                 freeze_gc=freeze_gc):
                    result.outputs = run()
        except Exception as exc:
            if result.stage == "capture":
                self._retire_pool()
                logger.warning("gfxgraph: %s runs eagerly from now on: capture failed: %s", what, exc)
                reason = Reason.CAPTURE_FAILED
            else:  # the caller decides: a bad input, or work that cannot run padded
                logger.debug("gfxgraph: %s: the work raised during warm-up: %s", what, exc)
                reason = Reason.WARMUP_FAILED
            result.outputs, result.error = None, exc
            result.fallback = Fallback(reason, f"{what}: {type(exc).__name__}: {exc}")
            return result
        except BaseException:
            self._retire_pool()
            raise
        self.seconds += time.perf_counter() - t0
        self._largest_growth = max(self._largest_growth, torch.cuda.memory_reserved() - reserved_before)
        over, why = exceeds_vram_cap(0, self.vram_cap)
        if over:  # the estimate was short: undo this capture to keep the cap
            g.reset()
            torch.cuda.empty_cache()
            logger.warning("gfxgraph: %s runs eagerly: after capture %s", what, why)
            result.fallback = Fallback(Reason.VRAM_CAP, f"{what}: after capture {why}")
            return result
        result.graph = g
        return result

    def _retire_pool(self) -> None:
        if self._given_pool:
            return  # the caller's pool: PyTorch's error names it at the next capture
        if self._pool_handle is not None:
            self._retired.append(self._pool_handle)
        self._pool_handle = None
