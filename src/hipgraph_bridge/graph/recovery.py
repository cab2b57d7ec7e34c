"""The steps that leave the process usable after a capture failed; :class:`.capture.GraphCapture` runs them.

Each step never raises (it logs what went wrong) because it runs while
another exception, the one the caller must see, is on its way out.

One step is about the graph object rather than the stream:
:func:`secure_generator_registration`. PyTorch 2.3 - 2.12 registers a graph
with each RNG generator state in two halves, and a graph left with only the
first half aborts the process when it is destroyed; where the second half
cannot be done, the graph object is kept alive until the process ends
(:func:`pin_graph`: its few hundred bytes, never its memory pool).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .._torch_compat import OriginalCUDAGraph, end_allocate_to_pool, generator_states_track_graphs
from ..log import logger
from ..runtime import captures_live, current_capabilities, current_runtime

__all__ = ["stream_is_capturing", "end_stream_capture", "release_capture_pool", "synchronize_quietly",
           "rearm_generators", "prepare_rearm", "runtime_checks_capture", "runtime_capture_status",
           "capture_lost_reason", "generator_states_track_graphs", "secure_generator_registration",
           "secure_default_registration", "pin_graph", "is_pinned", "pinned_graphs"]

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


# One 4-byte tensor per device for the re-arming capture to write, made by the first capture on the
# device (prepare_rearm), so that the failure path allocates nothing: the failure is often an
# out-of-memory error, and under torch.cuda.set_per_process_memory_fraction even 4 bytes can need a
# new 2 MiB segment on the stream at hand. Kept until the process ends.
_scratch: dict[int, torch.Tensor] = {}


def prepare_rearm(device: int) -> None:
    """Make, once per device, the tensor :func:`rearm_generators` writes (outside any capture).

    Cost: a dict lookup; the first call on a device allocates 4 bytes (skipped while another
    capture is live: an allocation may need ``cudaMalloc``, unsafe during a global-mode capture).
    Never raises.
    """
    if device in _scratch or captures_live():
        return
    try:
        with torch.cuda.device(device):
            _scratch[device] = torch.zeros(1, device="cuda")
    except Exception as exc:  # out of memory already: the re-arming capture allocates it then
        logger.debug("gfxgraph: no scratch tensor for re-arming generators on device %d: %s", device, exc)


def rearm_generators(owner: object, generators: Iterable[torch.Generator], *, device: int | None = None) -> None:
    """Take RNG generators out of capture mode after a capture that never ended.

    PyTorch's generators enter capture mode at ``capture_begin`` and leave it only
    in a successful ``capture_end``; after a failed one every later random op
    raises "Offset increment outside graph capture encountered unexpectedly".
    A tiny capture that ends successfully, with the same generators registered
    (the default one of ``device``, the capture's, always is), runs the missing epilogue.
    Skipped while another capture is live: its generator offsets would be reset.
    It allocates no device memory once :func:`prepare_rearm` ran for ``device``.
    """
    if captures_live(excluding=owner):
        logger.warning("gfxgraph: RNG generators not re-armed after a failed capture: another capture is "
                       "live; random ops may fail until it ends")
        return
    generators = tuple(generators)
    try:
        dev = torch.cuda.current_device() if device is None else device
        with torch.cuda.device(dev):
            scratch = _scratch.get(dev)
            if scratch is None:
                scratch = torch.zeros(1, device="cuda")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            g = OriginalCUDAGraph()
            try:
                for gen in generators:
                    g.register_generator_state(gen)
                with torch.cuda.stream(stream):
                    g.capture_begin(capture_error_mode="thread_local")  # never disturbs other threads' work
                    scratch.add_(1)
                    g.capture_end()
            except BaseException:
                # g may hold a generator state that does not hold g (see secure_generator_registration):
                # make that whole, or keep g alive, before g goes out of scope here
                end_stream_capture(stream)
                secure_generator_registration(g, (*generators, *_default_generator(dev)),
                                              why="the capture that re-arms the RNG generators failed")
                raise
            torch.cuda.current_stream().wait_stream(stream)
            g.reset()
    except Exception as exc:
        logger.warning("gfxgraph: could not re-arm RNG generators after a failed capture: %s", exc)


# ------------------------------------------------------------------ graph objects that must not be destroyed
def _default_generator(device: int) -> tuple[torch.Generator, ...]:
    """The default CUDA generator of ``device``, as a 0- or 1-tuple (none without CUDA)."""
    gens = torch.cuda.default_generators
    return (gens[device],) if 0 <= device < len(gens) else ()


def secure_generator_registration(graph: Any, generators: Sequence[torch.Generator], *, why: str) -> bool:
    """Leave ``graph`` safe to destroy after a call that may have registered it with ``generators``
    only half-way. Returns True when the registration is whole (or this torch does not check it),
    False when ``graph`` was pinned instead (:func:`pin_graph`). Raises nothing but an interrupt
    (after pinning).

    Why (PyTorch 2.3 - 2.12, see :func:`generator_states_track_graphs`):
    ``CUDAGeneratorImpl::register_graph`` (CUDAGeneratorImpl.cpp) first adds the generator's state to
    the graph (``graph->register_generator_state(state_)``) and then the graph to the state
    (``state_->register_graph(graph)``). The second half throws part-way in two cases: the current
    stream is capturing (``assertNotCapturing``), or the state has no graph yet and allocating its
    seed and offset tensors (two ``at::empty({1})``, which take a new 2 MiB segment when the stream
    has no free cached block) fails, which is what a ``set_per_process_memory_fraction`` limit makes
    happen. ``CUDAGraph::capture_begin`` registers the default generator this way before anything
    but checking that the graph is empty. The graph then holds a state that does not hold it, and
    its destructor aborts the process.

    Repair: register each generator again through PyTorch (both halves are idempotent; the second
    allocates only when the state has no graph). Where that fails too (the memory is still not
    there), the graph object is pinned: leak rather than abort.
    """
    if not generator_states_track_graphs():
        return True
    try:
        for gen in generators:
            OriginalCUDAGraph.register_generator_state(graph, gen)
        return True
    except BaseException as exc:
        pin_graph(graph, f"{why}; registering its RNG generators again failed too ({type(exc).__name__}: {exc})")
        if not isinstance(exc, Exception):
            raise  # an interrupt: pinned first, so nothing aborts later
        return False


def secure_default_registration(graph: Any, device: int, *, why: str) -> bool:
    """:func:`secure_generator_registration` for what ``capture_begin`` registers on ``device``:
    its default generator (``get_generator_or_default`` in ``CUDAGraph::capture_begin``). Returns
    False when ``graph`` was pinned; then that registration never completed, so ``capture_begin``
    stopped before the generators' ``capture_prologue`` and they are not in capture mode."""
    return secure_generator_registration(graph, _default_generator(device), why=why)


_pinned_lock = threading.Lock()
_pinned: dict[int, Any] = {}  # id -> graph object; held, so the id is never reused


def pin_graph(graph: Any, why: str) -> None:
    """Keep ``graph`` alive until the process has ended: PyTorch would abort the process destroying it.

    A registration fails before its capture takes a memory pool (``capture_begin`` registers first),
    and a failed capture's pool reference is given back before this runs (the failure path's step 2),
    so what stays is the Python object and PyTorch's C++ graph object, without a graph or a pool
    (unless ``register_generator_state`` failed on a graph that already held a capture). The
    reference in this module is cleared with the module at interpreter exit, which would run the
    destructor then, so a second reference is taken that is never given back (``Py_IncRef``).
    Idempotent; never raises.
    """
    with _pinned_lock:
        if id(graph) in _pinned:
            return
        _pinned[id(graph)] = graph
    try:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(graph))
    except Exception as exc:  # no CPython API: the module's reference holds it until exit
        logger.debug("gfxgraph: could not take a lasting reference to a pinned graph: %s", exc)
    logger.warning("gfxgraph: a %s object is kept alive until the process ends (%s): PyTorch would abort the "
                   "process destroying it (\"The graph should be registered to the state\"). It normally holds no "
                   "graph and no memory pool; capture into a new graph object", type(graph).__name__, why)


def is_pinned(graph: Any) -> bool:
    """Whether ``graph`` is kept alive until the process ends (:func:`pin_graph`)."""
    return id(graph) in _pinned and _pinned[id(graph)] is graph


def pinned_graphs() -> tuple[Any, ...]:
    """The graph objects kept alive until the process ends, oldest first."""
    with _pinned_lock:
        return tuple(_pinned.values())
