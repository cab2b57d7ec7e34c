"""BridgedCUDAGraph: ``torch.cuda.CUDAGraph`` that cannot take the process down.

It subclasses the ``torch.cuda.CUDAGraph`` that was installed when this
module was first imported (before ``gfxgraph.enable()`` patches anything), so
``isinstance(g, torch.cuda.CUDAGraph)`` holds and every method and argument
of the installed PyTorch is there. What it adds:

* Every failure path of a capture ends the stream capture, releases the
  capture's memory-pool reference and synchronises the device *before* the
  graph is released, then raises; the next capture on the same stream works.
* A capture whose region raised is discarded instead of being kept as a
  partial graph, so a later ``replay()`` raises rather than silently running
  half of the work.
* A ``capture_begin`` on a stream that is already capturing is refused before
  it reaches the runtime (which would invalidate the outer capture).
* Replays are counted and timed for ``gfxgraph.stats()`` (no lock, no allocation).
* The seed's high-level API: ``capture(model_fn=..., ...)`` and
  ``replay(input_tensor=..., batch_size=..., branch=...)``, which fall back to
  eager execution instead of raising (see :mod:`.captured_callable`).
"""

from __future__ import annotations

import itertools
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import stats as _stats
from .capture_state import (
    GraphState,
    capture_on_stream,
    end_stream_capture,
    rearm_generators,
    register_capture,
    release_capture_pool,
    stream_is_capturing,
    synchronize_quietly,
    unregister_capture,
)
from .errors import GraphCaptureError
from .log import logger
from .platform import require_gpu

__all__ = ["BridgedCUDAGraph", "OriginalCUDAGraph"]

# Captured at first import, before enable() can swap torch.cuda.CUDAGraph.
OriginalCUDAGraph: type = torch.cuda.graphs.CUDAGraph
# A CPU-only build gives torch.cuda.CUDAGraph a stub base whose __init__ raises.
_BASE_IS_STUB = not (torch.version.cuda or getattr(torch.version, "hip", None))

def _pick_base_replay() -> Any:
    """The installed replay, skipping PyTorch's Python wrapper when it only delegates.

    The wrapper frame is about 150 ns of the hot path on a slow host; calling the
    C++ method directly is the same operation. If the wrapper does more (newer
    PyTorch checks input liveness there), it is kept.
    """
    py_replay = OriginalCUDAGraph.replay
    cpp_replay = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)
    code = getattr(py_replay, "__code__", None)
    if cpp_replay is not None and code is not None and set(code.co_names) <= {"super", "replay"}:
        return cpp_replay
    return py_replay


_base_replay = _pick_base_replay()
_now = time.perf_counter_ns
_record_replay = _stats.record_replay_ns
_SAMPLE_MASK = _stats.REPLAY_SAMPLE_EVERY - 1
_READY = GraphState.READY
_CAPTURE_MODES = ("global", "thread_local", "relaxed")
# What PyTorch's caching allocator says when a pool id cannot be captured into again.
_DEAD_POOL_MESSAGES = ("already recording to mempool_id", "use_count > 0")


class BridgedCUDAGraph(OriginalCUDAGraph):  # type: ignore[misc,valid-type]
    """Drop-in ``torch.cuda.CUDAGraph`` with abort-proof capture and eager fallback.

    Low-level API (``capture_begin``/``capture_end``/``replay``/``reset``/
    ``pool``/``instantiate``/``raw_cuda_graph``/...): same semantics and errors
    as PyTorch's, with the guarantees in the module docstring. Errors are raised
    (serving stacks handle them), but only after the capture was ended cleanly.

    High-level API (``capture(model_fn=...)``/``replay(input_tensor=...)``):
    never raises for a capture or replay failure; it runs ``model_fn`` eagerly,
    counts the fallback and logs its reason once.

    On a CPU-only build of PyTorch the object can be created; the low-level
    methods raise :class:`~hipgraph_bridge.errors.GraphsUnavailableError` and the
    high-level API runs eagerly.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> BridgedCUDAGraph:
        if _BASE_IS_STUB:
            return object.__new__(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, keep_graph: bool = False, *args: Any, **kwargs: Any) -> None:
        if not isinstance(keep_graph, bool):
            raise TypeError(f"keep_graph: expected a bool, got {type(keep_graph).__name__}")
        if not _BASE_IS_STUB:
            super().__init__(keep_graph, *args, **kwargs)
        self._state = GraphState.EMPTY
        self._keep_graph = keep_graph
        self._failure: str | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._capture_pool: tuple[int, int] | None = None
        self._capture_device = -1
        self._capture_t0 = 0.0
        self._exc_at_begin: BaseException | None = None
        self._session: Any = None  # high-level capture session, when used
        # replays: next() on an itertools.count is one atomic C call (no attribute
        # writes, exact under concurrent replays); _replays reads it
        self._ticks = itertools.count()
        self._ticks_base = 0
        self._generators: tuple[Any, ...] = ()  # registered with register_generator_state
        # Set when a conditional body capture inside this capture failed: the partial graph
        # must then be leaked, never destroyed or instantiated (the driver crashes on it).
        self._unsafe_partial_graph = False

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> GraphState:
        """Where this graph is in its lifecycle (see :class:`GraphState`)."""
        return self._state

    @property
    def failure_reason(self) -> str | None:
        """Why the last capture failed, or None."""
        return self._failure

    def _require_native(self, what: str) -> None:
        if _BASE_IS_STUB:
            require_gpu(f"BridgedCUDAGraph.{what}()")

    # ---------------------------------------------------------------- capture
    def capture_begin(
        self,
        pool: Any = None,
        capture_error_mode: str = "global",
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Begin capturing CUDA work on the current stream.

        Same arguments as PyTorch's. Refuses (``GraphCaptureError``) a stream
        that is already capturing, before the runtime call that would
        invalidate the outer capture. Cost: one capture-status query more than
        PyTorch's.
        """
        self._require_native("capture_begin")
        if capture_error_mode not in _CAPTURE_MODES:
            raise ValueError(
                f"capture_error_mode: expected one of {', '.join(_CAPTURE_MODES)}, "
                f"got {capture_error_mode!r}"
            )
        if self._state is GraphState.CAPTURING:
            raise RuntimeError(
                "capture_begin() called on a graph that is already capturing; "
                "call capture_end() first"
            )
        if self._state is _READY or self._state is GraphState.SESSION:
            raise RuntimeError(
                "This graph already holds a captured graph (state "
                f"{self._state.value}); call reset() or create a new graph to capture again"
            )
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            raise RuntimeError(
                "capture_begin(): CUDA graphs must be captured on a non-default stream; "
                "run the capture under `with torch.cuda.stream(torch.cuda.Stream()):` "
                "(replaying on the default stream is fine)"
            )
        if torch.cuda.is_current_stream_capturing():
            owner = capture_on_stream(stream)
            who = "another gfxgraph capture" if owner is not None else "a capture gfxgraph does not own"
            raise GraphCaptureError(
                f"capture_begin(): stream {stream.cuda_stream:#x} is already capturing ({who}). "
                "Nested capture on one stream is not supported by the runtime; end the outer "
                "capture first, or compose graphs with hipgraph_bridge.GraphCompositor. "
                "The outer capture is untouched."
            )
        if pool is None:
            # Our own handle, so a failed capture's pool reference can be released.
            pool = torch.cuda.graph_pool_handle()
        elif not (isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(v, int) for v in pool)):
            raise TypeError("pool: expected a handle from torch.cuda.graph_pool_handle() or another graph's "
                            f"pool() (a pair of ints), got {pool!r}")
        self._capture_stream = stream
        self._capture_pool = (int(pool[0]), int(pool[1]))
        self._capture_device = torch.cuda.current_device()
        self._exc_at_begin = sys.exc_info()[1]
        self._failure = None
        self._unsafe_partial_graph = False
        register_capture(stream, self)
        self._capture_t0 = time.perf_counter()
        self._state = GraphState.CAPTURING
        try:
            super().capture_begin(pool, capture_error_mode, *args, **kwargs)
        except BaseException as exc:
            self._discard(f"capture_begin failed: {exc}", capture_ended=False)
            if any(m in str(exc) for m in _DEAD_POOL_MESSAGES):
                raise GraphCaptureError(
                    f"capture_begin(): the memory pool {self._capture_pool} cannot take another capture: a "
                    "capture into it failed earlier, or every graph in it was released, and PyTorch's "
                    "allocator does not recover such a pool. Pass a fresh torch.cuda.graph_pool_handle() "
                    f"(allocator said: {str(exc).splitlines()[0]})"
                ) from exc
            raise

    def capture_end(self) -> None:
        """End the capture started by ``capture_begin``.

        * Capture succeeded and the region did not raise: the graph is ready.
        * The region raised (an exception is propagating through a
          ``with torch.cuda.graph(...)`` block): the partial graph is discarded,
          and this returns so the region's own exception reaches the caller.
        * The runtime rejected the capture (``.item()``, a sync, an illegal call
          in the region): the capture is ended and discarded, and
          ``GraphCaptureError`` is raised with the runtime's message.

        In every failure case the stream is out of capture mode and the device
        synchronised before this returns or raises.
        """
        self._require_native("capture_end")
        in_flight = sys.exc_info()[1]
        region_raised = in_flight is not None and in_flight is not self._exc_at_begin
        if self._state is GraphState.FAILED and region_raised:
            return
        if self._state is not GraphState.CAPTURING:
            raise RuntimeError(
                f"capture_end() called on a graph in state {self._state.value!r}; "
                "call capture_begin() first"
                + (f" (the last capture failed: {self._failure})" if self._failure else "")
            )
        stream = self._capture_stream
        assert stream is not None  # set with the CAPTURING state
        if torch.cuda.current_stream() != stream:
            self._discard("capture_end() ran on a different stream than capture_begin()",
                          capture_ended=False)
            if region_raised:
                return
            raise GraphCaptureError(
                f"capture_end() must run on the stream capture began on ({stream.cuda_stream:#x}), "
                f"but the current stream is {torch.cuda.current_stream().cuda_stream:#x}; "
                "the capture was ended and discarded"
            )
        try:
            super().capture_end()
        except BaseException as exc:
            self._discard(f"{type(exc).__name__}: {exc}", capture_ended=False)
            if region_raised:
                return
            raise GraphCaptureError(
                f"graph capture failed and was discarded: {exc}. A common cause is a call "
                "that synchronises with the host inside the captured region (.item(), .cpu(), "
                "print(tensor), torch.cuda.synchronize()); the stream is usable again"
            ) from exc
        if region_raised:
            self._discard(
                f"the captured region raised {type(in_flight).__name__}: {in_flight}",
                capture_ended=True,
            )
            return
        unregister_capture(stream, self)
        self._state = _READY
        self._install_fast_replay()
        _stats.track_replays(self)
        _stats.record_capture(time.perf_counter() - self._capture_t0)

    def _discard(self, reason: str, *, capture_ended: bool) -> None:
        """Failure path shared by every capture error: end, release, sync, reset.

        Never raises. Order matters: the stream leaves capture mode and the device
        is synchronised before the C++ graph is reset (releasing it mid-capture
        is what aborts processes).
        """
        stream = self._capture_stream
        try:
            if not capture_ended and stream is not None and stream_is_capturing(stream) \
                    and not end_stream_capture(stream, destroy=not self._unsafe_partial_graph):
                # No runtime binding: PyTorch's capture_end ends it (and instantiates the partial graph)
                try:
                    with torch.cuda.stream(stream):
                        super().capture_end()
                    capture_ended = True
                except BaseException:
                    pass
                if stream_is_capturing(stream):
                    logger.error("gfxgraph: stream %#x is still capturing after a failed capture; install "
                                 "the runtime binding (pip install 'gfxgraph[cuda]') so gfxgraph can end it",
                                 stream.cuda_stream)
            if not capture_ended and self._capture_pool is not None:
                release_capture_pool(self._capture_device, self._capture_pool)
            synchronize_quietly(self)
            try:
                super().reset()
            except BaseException as exc:
                logger.debug("gfxgraph: reset after failed capture raised: %s", exc)
            if not capture_ended:
                rearm_generators(self, self._generators, OriginalCUDAGraph)
        finally:
            unregister_capture(stream, self)
            self._remove_fast_replay()
            self._state = GraphState.FAILED
            self._failure = reason
            _stats.record_capture_failure()
            logger.warning("gfxgraph: graph capture discarded: %s", reason)

    # ----------------------------------------------------------------- replay
    def replay(
        self,
        *,
        batch_size: int | None = None,
        branch: str | int | None = None,
        input_tensor: Any = None,
    ) -> Any:
        """Launch the captured graph on the current stream.

        Low-level use (no arguments): once captured, each instance answers
        ``replay`` through a closure that costs a counter update over PyTorch's
        ``replay`` (one replay in ``REPLAY_SAMPLE_EVERY`` also reads the clock
        twice); see :meth:`_install_fast_replay`. With a high-level
        ``capture()`` session, the arguments select the bucket, branch and
        input, and the outputs are returned (see :meth:`capture`).
        """
        return self._replay_slow(batch_size, branch, input_tensor)

    def _install_fast_replay(self) -> None:
        """Answer ``self.replay`` with a closure: the hot path reads no attributes.

        On a slow host each attribute read is ~50 ns against a ~5 us launch, so
        the state check and counter live in closure cells instead. The closure
        exists only in the READY state; every state change removes it first.
        """
        tick = self._ticks.__next__
        base, record, now, mask = _base_replay, _record_replay, _now, _SAMPLE_MASK
        # A weak reference: the closure lives in this graph's __dict__, and a strong one
        # would make a cycle that keeps a dropped graph (and its pool) until a full gc.
        graph = weakref.ref(self)
        cls = type(self)

        def replay(*, batch_size: Any = None, branch: Any = None, input_tensor: Any = None) -> Any:
            if batch_size is not None or branch is not None or input_tensor is not None:
                return cls._replay_slow(graph(), batch_size, branch, input_tensor)
            if tick() & mask:
                base(graph())
                return None
            t0 = now()
            base(graph())
            record(now() - t0)
            return None

        replay.__doc__ = BridgedCUDAGraph.replay.__doc__
        self.__dict__["replay"] = replay

    def _remove_fast_replay(self) -> None:
        self.__dict__.pop("replay", None)

    @property
    def _replays(self) -> int:
        """Replays since capture (or the last ``reset_stats``); read by ``gfxgraph.stats()``."""
        # itertools.count: next() is atomic under the GIL and its repr is "count(N)"
        return int(repr(self._ticks)[6:-1]) - self._ticks_base

    @_replays.setter
    def _replays(self, value: int) -> None:
        self._ticks_base = int(repr(self._ticks)[6:-1]) - value

    def _launch(self) -> None:
        """Replay without the state check; high-level sessions call it after their own checks."""
        if next(self._ticks) & _SAMPLE_MASK:
            _base_replay(self)
            return
        t0 = _now()
        _base_replay(self)
        _record_replay(_now() - t0)

    def _replay_slow(self, batch_size: Any, branch: Any, input_tensor: Any) -> Any:
        if self._state is GraphState.SESSION:
            return self._session.replay(batch_size=batch_size, branch=branch,
                                        input_tensor=input_tensor)
        if self._state is _READY:
            raise TypeError(
                "replay(batch_size=/branch=/input_tensor=) needs a graph captured with the "
                "high-level capture(model_fn=...); this graph was captured with "
                "capture_begin()/capture_end() or torch.cuda.graph, so call replay() with no arguments"
            )
        self._require_native("replay")
        if self._state is GraphState.FAILED:
            raise RuntimeError(f"replay(): this graph's capture failed and was discarded ({self._failure}); "
                               "capture it again")
        if self._state is GraphState.CAPTURING:
            raise RuntimeError("replay() called during capture; call capture_end() first")
        raise RuntimeError("replay() called before any capture; capture the graph first")

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Delete the captured graph (and end an unfinished capture first)."""
        self._require_native("reset")
        self._remove_fast_replay()
        _stats.retire_replays(self)
        if self._state is GraphState.CAPTURING:
            self._discard("reset() during capture", capture_ended=False)
        else:
            super().reset()
        if self._session is not None:
            self._session.close()
            self._session = None
        self._state = GraphState.EMPTY
        self._failure = None

    def __del__(self) -> None:
        # Releasing a graph mid-capture is what aborts processes: end it first.
        try:
            if getattr(self, "_state", None) is GraphState.CAPTURING:
                self._discard("graph released during capture", capture_ended=False)
            if "_ticks" in self.__dict__ and self._replays:
                _stats.retire_replays(self)
        except BaseException:
            pass
        base_del = getattr(OriginalCUDAGraph, "__del__", None)
        if base_del is not None and not _BASE_IS_STUB:
            try:
                base_del(self)
            except BaseException:
                pass

    def register_generator_state(self, generator: Any) -> None:
        """Register a generator so its random stream advances per replay (same as PyTorch's)."""
        self._require_native("register_generator_state")
        if not isinstance(generator, torch.Generator) or generator.device.type != "cuda":
            # PyTorch's C++ side crashes (SIGSEGV) on a CPU generator: refuse it here
            raise TypeError("register_generator_state: expected a CUDA torch.Generator "
                            f"(torch.Generator(device='cuda')), got {generator!r}")
        super().register_generator_state(generator)
        self._generators = (*self._generators, generator)

    def pool(self) -> Any:
        """This graph's memory-pool handle (pass it to another capture to share memory)."""
        self._require_native("pool")
        if self._state is GraphState.FAILED:
            raise RuntimeError(f"pool(): this graph's capture failed ({self._failure}); it owns no pool")
        return super().pool()

    def instantiate(self) -> None:
        """Instantiate the captured graph (``keep_graph=True``). Same as PyTorch's."""
        self._require_native("instantiate")
        super().instantiate()

    def raw_cuda_graph(self) -> int:
        self._require_native("raw_cuda_graph")
        return super().raw_cuda_graph()

    def raw_cuda_graph_exec(self) -> int:
        self._require_native("raw_cuda_graph_exec")
        return super().raw_cuda_graph_exec()

    # ------------------------------------------------------------ high level
    def capture(
        self,
        *,
        model_fn: Callable[..., Any] | None = None,
        example_input: Any = None,
        dynamic_shapes: bool = False,
        buckets: Any = None,
        conditional_branches: dict[str, Callable[..., Any]] | None = None,
        copy_outputs: bool = True,
        warmup_iters: int = 2,
        pool: Any = None,
    ) -> Any:
        """The seed's high-level capture: a context manager that falls back to eager.

        Static shapes::

            g = BridgedCUDAGraph()
            with g.capture(model_fn=model, example_input=x) as cap:
                pass                      # model_fn(cap.static_input) is captured on exit
            y = g.replay(input_tensor=x2)  # copies x2 in, replays, returns the output

        The body may instead capture its own work and set ``cap.output``.

        ``dynamic_shapes=True`` (with ``model_fn`` and optional ``buckets``)
        routes to a :class:`~hipgraph_bridge.ShapeBucketPool`; then
        ``replay(input_tensor=x)`` accepts any batch size up to the largest bucket.
        ``conditional_branches={name: fn}`` routes to a
        :class:`~hipgraph_bridge.ConditionalGraph`; ``replay(branch=name, input_tensor=x)``.

        Args:
            copy_outputs: return a copy of the outputs on every replay (default),
                so a later replay never overwrites what the caller holds. ``False``
                returns the graph's static outputs (faster; valid until the next replay).
        """
        from .captured_callable import open_session

        if self._state is GraphState.CAPTURING:
            raise RuntimeError("capture() called while this graph is capturing")
        if self._session is not None or self._state is _READY:
            if _BASE_IS_STUB:  # nothing native to release without a GPU
                self._session.close()
                self._session = None
                self._state = GraphState.EMPTY
            else:
                self.reset()
        session = open_session(
            self,
            model_fn=model_fn,
            example_input=example_input,
            dynamic_shapes=dynamic_shapes,
            buckets=buckets,
            conditional_branches=conditional_branches,
            copy_outputs=copy_outputs,
            warmup_iters=warmup_iters,
            pool=pool,
        )
        self._session = session
        return session

    def _enter_session_state(self) -> None:
        """Called by a high-level session once it owns this graph's replays."""
        self._remove_fast_replay()
        self._state = GraphState.SESSION

    def __repr__(self) -> str:
        extra = f", failure={self._failure!r}" if self._failure else ""
        return f"BridgedCUDAGraph(state={self._state.value}{extra})"
