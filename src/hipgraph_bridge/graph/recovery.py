"""The steps that leave the process usable after a capture failed; :class:`.capture.GraphCapture` runs them.

Each step never raises (it logs what went wrong) because it runs while
another exception, the one the caller must see, is on its way out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .._torch_compat import OriginalCUDAGraph, end_allocate_to_pool
from ..log import logger
from ..runtime import captures_live, current_capabilities, current_runtime

__all__ = ["stream_is_capturing", "end_stream_capture", "release_capture_pool", "synchronize_quietly",
           "rearm_generators", "runtime_checks_capture", "runtime_capture_status", "capture_lost_reason"]

_STATUS_NAMES = {0: "not capturing", 1: "active", 2: "invalidated"}


def runtime_checks_capture() -> bool:
    """Whether the runtime raises at capture-unsafe calls, so a capture that survives to its end is whole.

    False on HIP before ROCm 7.14 (the capability table's ``capture_errors_raised``,
    https://github.com/pytorch/pytorch/pull/187110): gfxgraph then checks the capture
    status itself where CUDA would have raised. Cost: a cached lookup.
    """
    caps = current_capabilities()
    return caps is None or caps.capture_errors_raised


def runtime_capture_status(stream: torch.cuda.Stream) -> int | None:
    """The runtime's capture status of ``stream`` (0 none, 1 active, 2 invalidated); None when
    no runtime binding loads (nothing can be checked then)."""
    try:
        return int(current_runtime().stream_capture_status(stream.cuda_stream))
    except Exception as exc:
        logger.debug("gfxgraph: could not read the capture status of stream %#x: %s", stream.cuda_stream, exc)
        return None


def capture_lost_reason(status: int | None, when: str) -> str | None:
    """Why a capture that should be active is not (None: it is active, or the status is unknown)."""
    if status is None or status == 1:
        return None
    return (f"the runtime reports the capture {when} as {_STATUS_NAMES.get(status, f'status {status}')} "
            "without having raised an error: HIP before ROCm 7.14 does not report errors during capture "
            "(https://github.com/pytorch/pytorch/pull/187110), so the graph would miss work. A common cause is "
            "a call that is not allowed while capturing (a synchronous copy, a stream or event query)")


def stream_is_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` is in capture mode (no context is created for it)."""
    try:
        with torch.cuda.stream(stream):
            return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # a stream whose device went away cannot be capturing
        return False


def end_stream_capture(stream: torch.cuda.Stream, *, destroy: bool = True) -> bool:
    """Take ``stream`` out of capture mode through the runtime layer, discarding what was captured.

    The partial graph is never instantiated: it can hold nodes that are unsafe
    to instantiate (a conditional node whose body capture failed crashes the
    driver there); ``destroy=False`` leaks it instead of destroying it, for the
    same reason. Returns whether the stream is out of capture mode afterwards;
    False also when no runtime binding is installed.
    """
    if not stream_is_capturing(stream):
        return True
    try:
        current_runtime().end_capture_and_discard(stream.cuda_stream, destroy=destroy)
    except Exception as exc:
        logger.debug("gfxgraph: ending the capture of stream %#x through the runtime layer failed: %s",
                     stream.cuda_stream, exc)
    return not stream_is_capturing(stream)


def release_capture_pool(device: int, pool: tuple[int, int]) -> None:
    """Give back the pool reference the allocator took when the capture began."""
    released, why = end_allocate_to_pool(device, pool)
    if not released:
        logger.debug("gfxgraph: pool %s not released after a failed capture: %s", pool, why)


def synchronize_quietly(owner: object, stream: torch.cuda.Stream) -> None:
    """Wait for ``stream`` (now out of capture mode) unless another capture is live.

    A stream sync, not a device-wide one: a device sync waits on every stream,
    capturing ones of other threads included, which the runtime refuses.
    """
    if captures_live(excluding=owner):
        logger.debug("gfxgraph: skipped the stream sync after a failed capture: another capture is live")
        return
    try:
        stream.synchronize()
    except Exception as exc:
        logger.log(logging.WARNING, "gfxgraph: stream sync after failed capture raised: %s", exc)


def rearm_generators(owner: object, generators: Iterable[torch.Generator], *, device: int | None = None) -> None:
    """Take RNG generators out of capture mode after a capture that never ended.

    PyTorch's generators enter capture mode at ``capture_begin`` and leave it only
    in a successful ``capture_end``; after a failed one every later random op
    raises "Offset increment outside graph capture encountered unexpectedly".
    A tiny capture that ends successfully, with the same generators registered
    (the default one of ``device``, the capture's, always is), runs the missing epilogue.
    Skipped while another capture is live: its generator offsets would be reset.
    """
    if captures_live(excluding=owner):
        logger.warning("gfxgraph: RNG generators not re-armed after a failed capture: another capture is "
                       "live; random ops may fail until it ends")
        return
    try:
        with torch.cuda.device(torch.cuda.current_device() if device is None else device):
            scratch = torch.zeros(1, device="cuda")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            g = OriginalCUDAGraph()
            for gen in generators:
                g.register_generator_state(gen)
            with torch.cuda.stream(stream):
                g.capture_begin(capture_error_mode="thread_local")  # never disturbs other threads' work
                scratch.add_(1)
                g.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            g.reset()
    except Exception as exc:
        logger.warning("gfxgraph: could not re-arm RNG generators after a failed capture: %s", exc)
