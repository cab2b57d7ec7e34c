"""Capturing bucket graphs: one shared memory pool, warm-up on the capture stream, the VRAM cap.

All bucket graphs capture into one memory pool (captured largest first,
smaller buckets reuse the largest one's memory). A capture that would push
device memory past the cap is not made; one that did after all is undone.
A failed capture retires the pool (PyTorch's allocator may keep recording
to it) and later captures use a fresh one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import warm_up
from ..graph.memory import exceeds_vram_cap, graph_pool_bytes
from ..log import logger

__all__ = ["BucketCapturer", "Captured"]


@dataclass
class Captured:
    """The outcome of one bucket capture.

    ``graph`` is None when the bucket runs eagerly (``reason``/``failed`` say
    why). ``outputs`` are the captured outputs (kept even when the graph was
    undone for the VRAM cap, for their layout); ``warm`` the last warm-up's
    outputs when asked for (also after a failed capture).
    """

    graph: SafeCUDAGraph | None = None
    outputs: Any = None
    warm: Any = None
    reason: str = ""
    failed: str | None = None
    stage: str = ""  # where a failure happened: "warm_up" (the model raised) or "capture"
    error: Exception | None = None  # the exception of a failure


class BucketCapturer:
    """Captures the graphs of one pool (see the module docstring)."""

    def __init__(self, *, warmup_iters: int, vram_cap: float, capture_error_mode: str,
                 generators: Sequence[torch.Generator]) -> None:
        self.warmup_iters = warmup_iters
        self.vram_cap = vram_cap
        self.capture_error_mode = capture_error_mode
        self.generators = tuple(generators)
        self.seconds = 0.0
        self._pool_handle: Any = None
        self._retired: list[Any] = []  # pools of earlier graphs, after a capture failure
        self._stream: torch.cuda.Stream | None = None
        self._largest_growth = 0

    @property
    def pool_handle(self) -> Any:
        """The shared memory-pool handle (None before the first capture)."""
        return self._pool_handle

    def pool_bytes(self) -> int:
        """Bytes reserved by this pool's graphs, as the caching allocator reports them."""
        pools = [p for p in (self._pool_handle, *self._retired) if p is not None]
        return graph_pool_bytes(pools) if pools else 0

    def forget_growth(self) -> None:
        self._largest_growth = 0

    def refusal(self, bucket: int) -> str | None:
        """Why a capture of ``bucket`` now would pass the VRAM cap (None: it may be made)."""
        over, why = exceeds_vram_cap(self._largest_growth, self.vram_cap)
        return why if over else None

    def capture(self, run: Callable[[], Any], bucket: int, *, keep_warm: bool, freeze_gc: bool,
                cap_checked: bool = False, warmup_iters: int | None = None) -> Captured:
        """Warm ``run`` up and capture it. Exceptions of ``run`` become a failed :class:`Captured`;
        a ``KeyboardInterrupt`` (any ``BaseException``) propagates after the capture was ended.
        ``cap_checked``: :meth:`refusal` was asked already (the ranks agreed on it).
        ``warmup_iters`` overrides the capturer's for this capture (a state-writing run warms up at most once)."""
        why = None if cap_checked else self.refusal(bucket)
        if why is not None:
            logger.warning("gfxgraph: bucket %d runs eagerly: %s", bucket, why)
            return Captured(reason="vram_cap", failed=f"bucket {bucket}: {why}")
        if self._stream is None:
            self._stream = torch.cuda.Stream()
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
                warm = warm_up(run, self._stream, self.warmup_iters if warmup_iters is None else warmup_iters)
                result.warm = warm if keep_warm else None
                del warm  # ahead-of-time capture: nobody returns it, so free it before capturing
                result.stage = "capture"
                with g.capturing(pool=self._pool_handle, stream=self._stream,
                                 capture_error_mode=self.capture_error_mode, freeze_gc=freeze_gc):
                    result.outputs = run()
        except Exception as exc:
            if result.stage == "capture":
                self._retire_pool()
                logger.warning("gfxgraph: bucket %d runs eagerly from now on: capture failed: %s", bucket, exc)
            else:  # the pool decides: a bad input, or a model that cannot run padded
                logger.debug("gfxgraph: bucket %d: the model raised during warm-up: %s", bucket, exc)
            result.outputs, result.error = None, exc
            result.reason, result.failed = "capture_failed", f"bucket {bucket}: {type(exc).__name__}: {exc}"
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
            logger.warning("gfxgraph: bucket %d runs eagerly: after capture %s", bucket, why)
            result.reason, result.failed = "vram_cap", f"bucket {bucket}: after capture {why}"
            return result
        result.graph = g
        return result

    def _retire_pool(self) -> None:
        if self._pool_handle is not None:
            self._retired.append(self._pool_handle)
        self._pool_handle = None
