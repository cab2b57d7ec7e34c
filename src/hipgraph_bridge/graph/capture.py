"""The one capture primitive: every capture in the library goes through :class:`GraphCapture`.

A :class:`GraphCapture` captures the work issued on one stream into one
PyTorch graph object (``torch.cuda.CUDAGraph`` or a subclass) and owns
everything around it: the stream and memory pool it begins on, the whole
failure path, and the capture statistics. Its states::

    PENDING --begin()--> CAPTURING --end()--> ENDED
                            |
                            +-- discard(), or end() rejected --> DISCARDED

Use it as a context manager (a region that raises is discarded and its
exception propagates) or call :meth:`begin`/:meth:`end` yourself (what
``SafeCUDAGraph.capture_begin``/``capture_end`` do). The failure path
(:meth:`discard`) never raises and runs, in this order:

1. take the stream out of capture mode without instantiating the partial graph;
2. give back the pool reference the allocator took at begin;
3. synchronise the capture stream (a stream sync, skipped while another capture is live);
4. reset the graph object (the partial graph is dropped, or leaked when unsafe);
5. when ``capture_begin`` itself raised: make the graph's RNG registration whole, or else
   keep the graph object alive until the process ends (below);
6. re-arm the RNG generators (their capture epilogue never ran);
7. count the failure, log it.

Afterwards the next capture, on any stream, and eager random ops work, and
the graph object is safe to destroy at any time, interpreter exit included.

Step 5 (PyTorch 2.3 - 2.11, and 2.12 treated alike; aten/src/ATen/cuda/):
``CUDAGraph::capture_begin`` (CUDAGraph.cpp) starts by registering the graph
with the default generator, in two halves (``CUDAGeneratorImpl::register_graph``
in CUDAGeneratorImpl.cpp: the state into the graph's
``captured_generator_states_``, then the graph into the state's
``registered_graphs_``). The second half allocates the state's seed and offset
tensors when no other graph holds the state, and under
``torch.cuda.set_per_process_memory_fraction`` that allocation can fail:
``capture_begin`` raises an out-of-memory error, and the graph keeps a state
that does not know it. ``CUDAGraph::~CUDAGraph()`` calls
``CUDAGeneratorState::unregister_graph`` for each of its states, whose
``TORCH_CHECK(..., "The graph should be registered to the state")`` then
throws inside a destructor: ``std::terminate``, SIGABRT, whenever the graph
object is released (at interpreter exit at the latest). Stock PyTorch aborts
the same way. gfxgraph registers the generator again (both halves are
idempotent); when that fails too, the graph object is pinned
(:func:`~.recovery.pin_graph`): a leak of the object, never of a memory pool,
rather than an abort. A pinned ``SafeCUDAGraph`` refuses further captures.

Where the runtime does not raise during capture (HIP before ROCm 7.14; the
capability table's ``capture_errors_raised``), a capture also checks the
stream's capture status where CUDA would have raised: right after
``capture_begin`` and before ``capture_end``. A capture the runtime no longer
reports as active is discarded with :class:`GraphCaptureError` instead of
ending as a graph that misses work.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import stats
from .._torch_compat import OriginalCUDAGraph, has_check_input_liveness
from ..errors import GraphCaptureError
from ..log import logger
from ..runtime import capture_owner, register_capture, unregister_capture
from .liveness import InputLiveness
from .recovery import capture_lost_reason, end_stream_capture, is_pinned, prepare_rearm, rearm_generators, \
    release_capture_pool, runtime_capture_status, runtime_checks_capture, secure_default_registration, \
    stream_is_capturing, synchronize_quietly

__all__ = ["GraphCapture", "CaptureState", "CAPTURE_MODES", "check_capture_mode", "capture_on_stream", "add_hint",
           "side_stream", "frozen_gc", "warm_up", "record_on_current_stream"]

CAPTURE_MODES = ("global", "thread_local", "relaxed")
# What PyTorch's caching allocator says when a pool id cannot be captured into again.
_DEAD_POOL_MESSAGES = ("already recording to mempool_id", "use_count > 0")


def _begin_hint(exc: BaseException, pool: tuple[int, int] | None) -> str:
    text = str(exc)
    if "non-default stream" in text:
        return "run the capture under `with torch.cuda.stream(torch.cuda.Stream()):`; gfxgraph took the RNG " \
               "generators back out of capture mode"
    if any(m in text for m in _DEAD_POOL_MESSAGES):
        return (f"the memory pool {pool} cannot take another capture: a capture into it failed earlier, or "
                "every graph in it was released, and PyTorch's allocator does not recover such a pool; pass a "
                "fresh torch.cuda.graph_pool_handle()")
    return "gfxgraph ended what had begun; the stream is usable again"


class CaptureState(enum.Enum):
    PENDING = "pending"  # created; begin() next
    CAPTURING = "capturing"  # between begin() and end()
    ENDED = "ended"  # the graph holds the capture
    DISCARDED = "discarded"  # failed; the failure path ran (see failure)


def check_capture_mode(mode: object) -> str:
    if mode not in CAPTURE_MODES:
        raise ValueError(f"capture_error_mode: expected one of {', '.join(CAPTURE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def capture_on_stream(stream: int) -> GraphCapture | None:
    """The library's capture running on the raw ``stream`` handle, if any."""
    owner = capture_owner(stream)
    return owner if isinstance(owner, GraphCapture) else None


def add_hint(exc: BaseException, hint: str) -> BaseException:
    """``exc`` with ``hint`` on a line after its own message: same object, type and traceback.

    PyTorch's and the runtime's own messages pass through verbatim (code matches
    on them); gfxgraph's advice follows them.
    """
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0].rstrip()}\n[gfxgraph] {hint}", *exc.args[1:])
    elif not exc.args:
        exc.args = (f"[gfxgraph] {hint}",)
    return exc


class GraphCapture:
    """One stream capture into ``graph``, with its failure path; see the module docstring.

    Args:
        graph: the PyTorch graph object to capture into (held weakly: its owner keeps it).
        pool: a memory-pool handle to capture into (default: a new one, so that a
            failed capture's pool reference can be given back).
        stream: the stream to capture on. The context manager makes it current;
            :meth:`begin` requires it to be current already (default: the current stream).
        capture_error_mode: ``"thread_local"`` (default: other threads' CUDA work is
            not affected by this capture), ``"global"`` or ``"relaxed"``.
        generators: the generators registered with ``graph``, re-armed after a failure.
        freeze_gc: keep the garbage collector frozen inside the context manager.
        track_inputs: record the tensors the capture reads without owning them, so a
            replay can refuse to run after one was freed (:attr:`liveness`). PyTorch's
            own ``check_input_liveness`` where the installed torch has it, else
            :class:`~.liveness.InputLiveness`.
        check_capture_status: check the stream's capture status after begin and before
            end (one runtime query each). None (default): where the capability table says
            the runtime does not raise during capture (HIP before ROCm 7.14); True forces
            the check (the HIP path, run on CUDA).
        capture_kwargs: further ``capture_begin`` arguments of the installed PyTorch.
    """

    def __init__(self, graph: Any, *, pool: Any = None, stream: torch.cuda.Stream | None = None,
                 capture_error_mode: str = "thread_local", generators: Sequence[torch.Generator] = (),
                 freeze_gc: bool = False, track_inputs: bool = False, check_capture_status: bool | None = None,
                 **capture_kwargs: Any) -> None:
        if not isinstance(graph, OriginalCUDAGraph):
            raise TypeError(f"graph: expected a torch.cuda.CUDAGraph, got {type(graph).__name__}")
        if pool is not None and not (isinstance(pool, tuple) and len(pool) == 2
                                     and all(isinstance(v, int) for v in pool)):
            raise TypeError("pool: expected a handle from torch.cuda.graph_pool_handle() or another graph's "
                            f"pool() (a pair of ints), got {pool!r}")
        self._graph = weakref.ref(graph)
        self.mode = capture_error_mode  # an unknown mode is PyTorch's to refuse, with its own message
        self.stream = stream
        self.pool: tuple[int, int] | None = None if pool is None else (int(pool[0]), int(pool[1]))
        self.generators = tuple(generators)
        self.state = CaptureState.PENDING
        self.failure: str | None = None
        self.seconds = 0.0
        self.liveness: InputLiveness | None = None
        self._freeze_gc = freeze_gc
        self._check_status = not runtime_checks_capture() if check_capture_status is None \
            else bool(check_capture_status)
        self._kwargs = capture_kwargs
        if track_inputs and has_check_input_liveness:
            self._kwargs.setdefault("check_input_liveness", True)
        elif track_inputs:
            self.liveness = InputLiveness()
        self._device = -1
        self._t0 = 0.0
        self._open = False  # the runtime capture is open (begun, not yet ended by PyTorch)
        self._unsafe = False
        self._begin_raised = False  # capture_begin raised: its RNG registration may be half done
        self._liveness_active = False  # the liveness mode is entered (exited once: end() then discard())
        self._contexts: contextlib.ExitStack | None = None

    # ------------------------------------------------------------------ begin / end
    def begin(self) -> None:
        """Begin capturing on the current stream (which must be ``stream`` when one was given).

        Refuses a stream that is already capturing (``GraphCaptureError``)
        before the runtime call that would invalidate the outer capture. What
        PyTorch itself refuses (the default stream, an unknown mode, a dead
        pool) raises PyTorch's own exception, with a hint after its message,
        once the failure path has run. Cost: one capture-status query more than
        PyTorch's ``capture_begin``.
        """
        if self.state is not CaptureState.PENDING:
            raise RuntimeError(f"GraphCapture.begin() needs state 'pending', but it is {self.state.value!r}: "
                               "create a new GraphCapture to capture again")
        stream = torch.cuda.current_stream()
        if self.stream is not None and stream != self.stream:
            raise RuntimeError("GraphCapture.begin(): the current stream is not the capture's stream; "
                               "use the capture as a context manager, or make its stream current first")
        self.stream = stream
        if torch.cuda.is_current_stream_capturing():
            who = "another gfxgraph capture" if capture_on_stream(stream.cuda_stream) is not None \
                else "a capture gfxgraph does not own"
            raise GraphCaptureError(
                f"capture_begin(): stream {stream.cuda_stream:#x} is already capturing ({who}). "
                "Nested capture on one stream is not supported by the runtime; end the outer "
                "capture first, or compose graphs with hipgraph_bridge.GraphCompositor. "
                "The outer capture is untouched.")
        if self.pool is None:
            handle = torch.cuda.graph_pool_handle()
            self.pool = (int(handle[0]), int(handle[1]))
        self._device = torch.cuda.current_device()
        prepare_rearm(self._device)  # so that a failure path allocates nothing (once per device)
        register_capture(stream.cuda_stream, self)
        self._t0 = time.perf_counter()
        self.state, self._open = CaptureState.CAPTURING, True
        try:
            OriginalCUDAGraph.capture_begin(self._target(), self.pool, self.mode, **self._kwargs)
        except BaseException as exc:
            self._begin_raised = True
            self.discard(f"capture_begin failed: {exc}")
            hint = _begin_hint(exc, self.pool)
            if is_pinned(self._graph()):
                hint += ("; this graph object is kept alive until the process ends (PyTorch would abort the "
                         "process destroying it): capture into a new one")
            raise add_hint(exc, hint) from None
        if self._check_status:
            self._require_active("after capture_begin")
        if self.liveness is not None:
            self.liveness.__enter__()
            self._liveness_active = True

    def end(self) -> None:
        """End the capture: the graph holds it from now on.

        Raises:
            RuntimeError: not capturing.
            Whatever PyTorch raises when it rejects the capture (a sync such as
            ``.item()`` in the region invalidated it; ``capture_end`` on another
            stream), unchanged but for a hint after the message: the failure path
            ran first, so the stream is usable again.
        """
        if self.state is not CaptureState.CAPTURING:
            raise RuntimeError(f"capture_end() called on a capture in state {self.state.value!r}; "
                               "call capture_begin() first"
                               + (f" (the last capture failed: {self.failure})" if self.failure else ""))
        stream = self.stream
        assert stream is not None  # set by begin()
        on_stream = torch.cuda.current_stream() == stream
        self._stop_liveness()
        if self._check_status:
            self._require_active("at capture_end")
        try:
            OriginalCUDAGraph.capture_end(self._target())
        except BaseException as exc:
            self.discard(f"{type(exc).__name__}: {exc}")
            if not on_stream:
                raise add_hint(exc, f"capture_end() must run on the stream the capture began on "
                                    f"({stream.cuda_stream:#x}); gfxgraph ended and discarded the capture, "
                                    "so the stream is usable again") from None
            raise add_hint(exc, "gfxgraph ended and discarded the capture; the stream is usable again. A common "
                                "cause is a call that synchronises with the host inside the captured region "
                                "(.item(), .cpu(), print(tensor), torch.cuda.synchronize())") from None
        self._open = False
        unregister_capture(stream.cuda_stream, self)
        self.state = CaptureState.ENDED
        self.seconds = time.perf_counter() - self._t0
        stats.record_capture(self.seconds)

    def _require_active(self, when: str) -> None:
        """Where CUDA would have raised: discard a capture the runtime no longer reports as active."""
        stream = self.stream
        assert stream is not None  # set by begin()
        reason = capture_lost_reason(runtime_capture_status(stream), f"of stream {stream.cuda_stream:#x} {when}")
        if reason is not None:
            self.discard(reason)
            raise GraphCaptureError(f"{reason}. gfxgraph ended and discarded the capture; the stream is usable "
                                    "again")

    def _stop_liveness(self) -> None:
        if self.liveness is not None and self._liveness_active:
            self._liveness_active = False
            try:
                self.liveness.__exit__(None, None, None)
            except Exception as exc:  # the mode stack was disturbed by the region: keep ending the capture
                logger.debug("gfxgraph: leaving the input-liveness mode raised: %s", exc)

    # ------------------------------------------------------------------ failure path
    def mark_partial_graph_unsafe(self) -> None:
        """The graph now holds a node whose body capture failed (a conditional body):
        if this capture fails, end it without instantiating or destroying the graph (it is leaked)."""
        self._unsafe = True

    def discard(self, reason: str, *, graph: Any = None) -> None:
        """Run the failure path (module docstring) and mark the capture discarded. Never raises.

        ``graph``: pass the graph object when calling from its finaliser (the
        capture holds it weakly). Discarding an ended capture drops its graph
        (a region that raised after the runtime capture closed).

        Afterwards the graph object is safe to destroy. After a ``capture_begin``
        that raised, that can take keeping the object alive until the process
        ends (step 5 of the module docstring): a deliberate leak of the Python
        object and PyTorch's C++ graph object, which hold no graph and no memory
        pool then (:func:`~.recovery.pinned_graphs` lists them), because
        destroying it would abort the process.
        """
        if self.state is CaptureState.DISCARDED:
            return
        target = graph if graph is not None else self._graph()
        stream = self.stream
        was_open = self._open
        self._stop_liveness()
        try:
            if was_open and stream is not None:
                self._close_runtime_capture(stream, target)
            if was_open and self.pool is not None:
                release_capture_pool(self._device, self.pool)
            if stream is not None:
                synchronize_quietly(self, stream)
            if target is not None:
                try:
                    OriginalCUDAGraph.reset(target)
                except BaseException as exc:
                    logger.debug("gfxgraph: reset after failed capture raised: %s", exc)
            # False: the default generator's registration could not be completed, so capture_begin
            # stopped before its capture_prologue and no generator is in capture mode
            registered = True
            if self._begin_raised and target is not None:
                registered = secure_default_registration(target, self._device, why=reason)
            if was_open and registered:
                rearm_generators(self, self.generators, device=self._device)
        finally:
            self._open = False
            if stream is not None:
                unregister_capture(stream.cuda_stream, self)
            self.state, self.failure = CaptureState.DISCARDED, reason
            stats.record_capture_failure()
            logger.warning("gfxgraph: graph capture discarded: %s", reason)

    def _close_runtime_capture(self, stream: torch.cuda.Stream, target: Any) -> None:
        if end_stream_capture(stream, destroy=not self._unsafe):  # also True when it was not capturing
            return
        # No runtime binding: PyTorch's capture_end ends it (and instantiates the partial graph).
        if target is not None and not self._unsafe:
            try:
                with torch.cuda.stream(stream):
                    OriginalCUDAGraph.capture_end(target)
            except BaseException:
                pass
        if stream_is_capturing(stream):
            logger.error("gfxgraph: stream %#x is still capturing after a failed capture; install the runtime "
                         "binding (pip install 'gfxgraph[cuda]') so gfxgraph can end it", stream.cuda_stream)

    def _target(self) -> Any:
        target = self._graph()
        if target is None:
            raise RuntimeError("GraphCapture: the graph object was released")
        return target

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> GraphCapture:
        contexts = contextlib.ExitStack()
        if self.stream is not None:
            contexts.enter_context(torch.cuda.stream(self.stream))
        if self._freeze_gc:
            contexts.enter_context(frozen_gc())
        try:
            self.begin()
        except BaseException:
            contexts.close()
            raise
        self._contexts = contexts
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        contexts, self._contexts = self._contexts, None
        try:
            if exc is not None:
                self.discard(f"the captured region raised {type(exc).__name__}: {exc}")
            elif self.state is CaptureState.CAPTURING:
                self.end()
        finally:
            if contexts is not None:
                contexts.close()

    def __repr__(self) -> str:
        extra = f", failure={self.failure!r}" if self.failure else ""
        return f"GraphCapture(state={self.state.value}, mode={self.mode}{extra})"


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = True  # the collector's state at the outermost entry


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Keep the garbage collector from running during a capture.

    A collection in the middle of a capture walks every Python object (slow
    with a large model) and can run finalisers that touch CUDA, invalidating
    the capture; existing objects are moved to the permanent generation so even
    an explicit ``gc.collect()`` skips them. Nested and concurrent uses
    (captures in several threads) share one freeze, undone when the last ends.
    The end unfreezes every object, as the serving stacks' capture loops do, so
    a freeze the process made itself earlier is undone too (some interpreters
    start with frozen objects, so an earlier freeze cannot be told apart).
    """
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
            gc.freeze()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0:
                gc.unfreeze()
                if _gc_was_enabled:
                    gc.enable()


def side_stream(stream: torch.cuda.Stream | None = None) -> torch.cuda.Stream:
    """``stream``, or a new stream that first waits for the current one (captures need a non-default stream)."""
    if stream is not None:
        return stream
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return s


def warm_up(fn: Callable[[], Any], stream: torch.cuda.Stream, iters: int) -> Any:
    """Run ``fn()`` ``iters`` times on ``stream`` after the current stream's work; return the last result.

    The caller's stream waits for the runs, and the host for ``stream`` (a
    stream sync, never a device-wide one: that would break captures running
    in other threads). Warming up on the capture stream sets up what libraries
    keep per stream (cuBLAS workspaces) outside the capture.
    """
    out = None
    if iters <= 0:
        return out
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(iters):
                out = None  # free the previous run's outputs before the next
                out = fn()
    finally:  # also after a failed run: what ran on ``stream`` is ordered before the caller's next work
        torch.cuda.current_stream().wait_stream(stream)
    stream.synchronize()
    return out


def record_on_current_stream(leaves: Sequence[Any]) -> None:
    """Tensors a warm-up made on the capture stream, now read on the caller's: keep the allocator
    from reusing their memory on the capture stream before the caller's stream is done with them."""
    on_gpu = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_cuda]
    if not on_gpu:  # a simulated capture's outputs (CPU tensors): no stream to record
        return
    current = torch.cuda.current_stream()
    for t in on_gpu:
        t.record_stream(current)
