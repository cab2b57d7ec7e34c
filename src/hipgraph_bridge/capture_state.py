"""Capture bookkeeping shared by every capturing object.

* :class:`GraphState`: the lifecycle of one graph object.
* The registry of captures in progress, keyed by stream, so a nested
  ``capture_begin`` is refused before it can invalidate the outer capture, and
  recovery never synchronises the device under another live capture.
* :func:`end_stream_capture`: the last-resort path that takes a stream out of
  capture mode when PyTorch's own ``capture_end`` could not.
* :func:`frozen_gc`: no garbage collection in the middle of a capture.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .log import logger

__all__ = [
    "GraphState",
    "register_capture",
    "unregister_capture",
    "capture_on_stream",
    "other_captures_active",
    "stream_is_capturing",
    "end_stream_capture",
    "release_capture_pool",
    "synchronize_quietly",
    "rearm_generators",
    "frozen_gc",
]


class GraphState(enum.Enum):
    EMPTY = "empty"  # nothing captured (new, or after reset())
    CAPTURING = "capturing"  # between capture_begin() and capture_end()
    READY = "ready"  # captured; replay() launches it
    FAILED = "failed"  # capture failed and was discarded; replay() raises
    SESSION = "session"  # owned by a high-level capture(); replay() routes there


_lock = threading.Lock()
# cuda_stream pointer -> weak reference to the capturing object. Weak, so a graph
# dropped mid-capture is finalised (and its __del__ ends the capture).
_active: dict[int, weakref.ref[Any]] = {}


def register_capture(stream: torch.cuda.Stream, owner: object) -> None:
    with _lock:
        _active[stream.cuda_stream] = weakref.ref(owner)


def unregister_capture(stream: torch.cuda.Stream | None, owner: object) -> None:
    if stream is None:
        return
    with _lock:
        ref = _active.get(stream.cuda_stream)
        if ref is not None and ref() in (owner, None):
            del _active[stream.cuda_stream]


def capture_on_stream(stream: torch.cuda.Stream | int) -> object | None:
    """The gfxgraph object capturing on ``stream`` (a torch stream or a raw pointer), if any."""
    ptr = stream if isinstance(stream, int) else stream.cuda_stream
    with _lock:
        ref = _active.get(ptr)
    return None if ref is None else ref()


def other_captures_active(excluding: object) -> bool:
    with _lock:
        owners = [ref() for ref in _active.values()]
    return any(o is not None and o is not excluding for o in owners)


def stream_is_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` is in capture mode (no context is created for it)."""
    try:
        with torch.cuda.stream(stream):
            return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # a stream whose device went away cannot be capturing
        return False


def end_stream_capture(stream: torch.cuda.Stream, *, destroy: bool = True) -> bool:
    """Take ``stream`` out of capture mode through the runtime layer, discarding the graph.

    Ends the capture without instantiating what was captured: a partial graph
    can hold nodes that are unsafe to instantiate (a conditional node whose body
    capture failed crashes the driver there). Returns whether the stream is out
    of capture mode afterwards; False also when no runtime binding is installed.
    """
    if not stream_is_capturing(stream):
        return True
    try:
        from .runtime import current_runtime

        current_runtime().end_capture_and_discard(stream.cuda_stream, destroy=destroy)
    except Exception as exc:
        logger.debug("gfxgraph: ending the capture of stream %#x through the runtime layer failed: %s",
                     stream.cuda_stream, exc)
    return not stream_is_capturing(stream)


def release_capture_pool(device: int, pool: tuple[int, int]) -> None:
    """Undo the allocator's begin-allocate-to-pool of a capture that never ended.

    PyTorch's ``capture_end`` skips this when ``cudaStreamEndCapture`` fails,
    which would leave the pool referenced forever and a dead capture filter
    consulted on every allocation.
    """
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is None or release is None:
        return
    try:
        end(device, pool)
    except Exception as exc:
        # The allocator was not recording to this pool (the capture failed before
        # it began to, or after it stopped): its reference count was not taken.
        logger.debug("gfxgraph: pool %s was not being recorded to: %s", pool, exc)
        return
    try:
        release(device, pool)
    except Exception as exc:
        logger.debug("gfxgraph: releasing pool %s failed: %s", pool, exc)


def synchronize_quietly(owner: object) -> None:
    """Synchronise the device unless another capture is live (a sync would invalidate it)."""
    if other_captures_active(owner):
        logger.debug("gfxgraph: skipped device sync after failed capture: another capture is live")
        return
    try:
        torch.cuda.synchronize()
    except Exception as exc:
        logger.log(logging.WARNING, "gfxgraph: device sync after failed capture raised: %s", exc)


def rearm_generators(owner: object, generators: tuple[torch.Generator, ...], graph_cls: type) -> None:
    """Take RNG generators out of capture mode after a capture that never ended.

    PyTorch's generators enter capture mode at ``capture_begin`` and leave it only
    in a successful ``capture_end``; after a failed one every later random op
    raises "Offset increment outside graph capture encountered unexpectedly".
    A tiny capture that ends successfully, with the same generators registered
    (the device's default one always is), runs the missing epilogue.
    Skipped while another capture is live: its generator offsets would be reset.
    """
    if other_captures_active(owner):
        logger.warning("gfxgraph: RNG generators not re-armed after a failed capture: another capture is "
                       "live; random ops may fail until it ends")
        return
    try:
        scratch = torch.zeros(1, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        g = graph_cls()
        for gen in generators:
            g.register_generator_state(gen)
        with torch.cuda.stream(stream):
            g.capture_begin()
            scratch.add_(1)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        g.reset()
    except Exception as exc:
        logger.warning("gfxgraph: could not re-arm RNG generators after a failed capture: %s", exc)


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Keep the garbage collector from running during a capture.

    A collection in the middle of a capture walks every Python object (slow
    with a large model) and can run finalisers that touch CUDA; existing
    objects are moved to the permanent generation so later collections skip them.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
