"""SafeCUDAGraph: PyTorch's ``torch.cuda.CUDAGraph`` whose capture cannot take the process down.

It subclasses the ``torch.cuda.CUDAGraph`` installed before ``gfxgraph.enable()``
patches anything, so ``isinstance(g, torch.cuda.CUDAGraph)`` holds and every
method and argument of the installed PyTorch is there. Its captures go
through :class:`~.capture.GraphCapture`, which adds:

* Every failure path of a capture ends the stream capture, gives back the
  capture's memory-pool reference and synchronises the capture stream *before* the
  graph is released, then raises; the next capture works.
* A capture whose region raised (inside ``torch.cuda.graph``) is discarded
  instead of kept as a partial graph, so a later ``replay()`` raises rather
  than silently running half of the work.
* A ``capture_begin`` on a stream that is already capturing is refused before
  it reaches the runtime (which would invalidate the outer capture).
* Replays are counted and timed for ``gfxgraph.stats()`` (no lock, no allocation).
* The object is safe to destroy after any failure, interpreter exit included:
  where PyTorch 2.3 - 2.12 would abort destroying it (a generator registration
  left half done, "The graph should be registered to the state"), it is kept
  alive until the process ends instead (:mod:`.capture`, step 5) and refuses
  further captures.

The public ``BridgedCUDAGraph`` is this class plus the high-level, eager-fallback
``capture(model_fn=...)`` (:mod:`hipgraph_bridge.compat`).
"""

from __future__ import annotations

import enum
import inspect
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import config, stats
from ..checks import check_cuda_generators
from .._torch_compat import OriginalCUDAGraph, base_replay, graph_context_exception
from ..platform import require_gpu, torch_build_version
from .capture import CaptureState, GraphCapture, add_hint
from .recovery import generator_states_track_graphs, is_pinned, secure_generator_registration

__all__ = ["SafeCUDAGraph", "GraphState", "OriginalCUDAGraph"]

# A CPU-only build gives torch.cuda.CUDAGraph a base whose __init__ raises.
_BASE_IS_STUB = torch_build_version()[0] is None
_SAMPLE_MASK = stats.REPLAY_SAMPLE_EVERY - 1
# capture_begin's parameters after (pool, capture_error_mode) in the installed PyTorch
_MORE_BEGIN_PARAMS = tuple(inspect.signature(OriginalCUDAGraph.capture_begin).parameters)[3:]
# PyTorch's own message for a capture into a graph that holds one (the tests compare it with the installed torch's)
_ALREADY_OWNS = "This CUDAGraph instance already owns a captured graph. To capture a new graph, create a new instance."


class GraphState(enum.Enum):
    EMPTY = "empty"  # nothing captured (new, or after reset())
    CAPTURING = "capturing"  # between capture_begin() and capture_end()
    READY = "ready"  # captured; replay() launches it
    FAILED = "failed"  # capture failed and was discarded; replay() raises
    SESSION = "session"  # held by the high-level capture(model_fn=...); replay() routes there


_STATE_OF = {CaptureState.PENDING: GraphState.EMPTY, CaptureState.CAPTURING: GraphState.CAPTURING,
             CaptureState.ENDED: GraphState.READY, CaptureState.DISCARDED: GraphState.FAILED}


class SafeCUDAGraph(OriginalCUDAGraph):  # type: ignore[misc,valid-type]
    """Drop-in ``torch.cuda.CUDAGraph`` with abort-proof capture; see the module docstring.

    Same methods, arguments and errors as PyTorch's, with the guarantees above.
    Errors are raised (serving stacks handle them), but only after the capture
    was ended cleanly. On a CPU-only build of PyTorch the object can be created
    and its methods raise :class:`~hipgraph_bridge.errors.GraphsUnavailableError`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> SafeCUDAGraph:
        if _BASE_IS_STUB:
            return object.__new__(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, keep_graph: bool = False, *args: Any, **kwargs: Any) -> None:
        if not isinstance(keep_graph, bool):
            raise TypeError(f"keep_graph: expected a bool, got {type(keep_graph).__name__}")
        if not _BASE_IS_STUB:
            super().__init__(keep_graph, *args, **kwargs)
        self._capture: GraphCapture | None = None
        self._exc_at_begin: BaseException | None = None  # the exception in flight when capture_begin ran
        self._generators: tuple[torch.Generator, ...] = ()  # registered with register_generator_state
        self._replays = stats.ReplayCounter()
        stats.track_replays(self._replays)

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> GraphState:
        """Where this graph is in its lifecycle (see :class:`GraphState`)."""
        cap = self._capture
        return GraphState.EMPTY if cap is None else _STATE_OF[cap.state]

    @property
    def failure_reason(self) -> str | None:
        """Why the last capture failed, or None."""
        cap = self._capture
        return None if cap is None else cap.failure

    def _require_native(self, what: str) -> None:
        if _BASE_IS_STUB:
            require_gpu(f"BridgedCUDAGraph.{what}()")

    def _require_empty(self, what: str) -> None:
        """Refuse a new capture on a graph that holds one; a graph still capturing loses that capture."""
        if is_pinned(self):
            raise RuntimeError(f"{what}(): this graph object is kept alive until the process ends, because "
                               "PyTorch would abort the process destroying it (a failed capture_begin or "
                               "register_generator_state left its RNG generator registration half done); "
                               "capture into a new graph object")
        state = self.state
        if state is GraphState.CAPTURING:
            assert self._capture is not None
            self._capture.discard(f"{what}() called again during this graph's capture")
            raise RuntimeError(f"{what}() called on a graph that is already capturing. gfxgraph ended and "
                               "discarded that capture, so nothing stays in capture mode (the RNG generators "
                               "included); call capture_end() before beginning another capture, or use a new graph")
        if state is GraphState.READY:
            raise RuntimeError(f"{_ALREADY_OWNS}\n[gfxgraph] call reset() first to capture into this object again")
        if state is GraphState.SESSION:
            raise RuntimeError("This graph holds a high-level capture(model_fn=...); call reset() or create a new "
                               "graph to capture again")

    # ---------------------------------------------------------------- capture
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global", *args: Any,
                      **kwargs: Any) -> None:
        """Begin capturing CUDA work on the current stream (PyTorch's arguments and errors).

        Refuses (``GraphCaptureError``) a stream that is already capturing,
        before the runtime call that would invalidate the outer capture. In
        debug or validate mode the capture records the tensors it reads, and a
        replay after one of them was freed raises. Cost: one capture-status
        query more than PyTorch's.
        """
        self._require_native("capture_begin")
        self._require_empty("capture_begin")
        if len(args) > len(_MORE_BEGIN_PARAMS):
            raise TypeError(f"capture_begin() takes at most {2 + len(_MORE_BEGIN_PARAMS)} arguments "
                            f"({2 + len(args)} given)")
        kwargs.update(zip(_MORE_BEGIN_PARAMS, args))
        # torch.cuda.graph passes check_input_liveness=False on torch >= 2.13: debug/validate still track
        track = bool(kwargs.pop("check_input_liveness", False)) or config.switches.debug or config.switches.validate
        cap = GraphCapture(self, pool=pool, capture_error_mode=capture_error_mode, generators=self._generators,
                           track_inputs=track, **kwargs)
        self._start(cap)
        self._exc_at_begin = sys.exc_info()[1]
        try:
            cap.begin()
        except BaseException:
            self._capture = None  # nothing was captured: the graph stays empty
            raise

    def capture_end(self) -> None:
        """End the capture started by ``capture_begin``.

        * The capture succeeded: the graph is ready.
        * The region raised: the partial graph is discarded, and this returns
          so the region's own exception reaches the caller. Inside
          ``torch.cuda.graph`` that is read from its ``__exit__``; called
          directly, it means an exception raised since ``capture_begin`` is in
          flight (propagating through a ``finally``, or being handled: end the
          capture outside the ``except`` block to keep what it captured).
        * PyTorch rejected the capture (a sync in the region, another stream):
          the capture is discarded and PyTorch's exception is raised, its
          message followed by a hint.

        In every failure case the stream is out of capture mode before this
        returns or raises.
        """
        self._require_native("capture_end")
        from_context, raised = graph_context_exception()
        if not from_context:
            in_flight = sys.exc_info()[1]
            raised = in_flight if in_flight is not self._exc_at_begin else None
        self._exc_at_begin = None  # do not keep its traceback (and frames) alive
        cap = self._capture
        if raised is not None and cap is not None and cap.state is CaptureState.DISCARDED:
            return  # already discarded; the region's exception is on its way
        if cap is None or cap.state is not CaptureState.CAPTURING:
            failure = self.failure_reason
            raise RuntimeError(f"capture_end() called on a graph in state {self.state.value!r}; "
                               "call capture_begin() first"
                               + (f" (the last capture failed: {failure})" if failure else ""))
        if raised is not None:
            cap.discard(f"the captured region raised {type(raised).__name__}: {raised}")
            return
        cap.end()

    def capturing(self, *, pool: Any = None, stream: torch.cuda.Stream | None = None,
                  capture_error_mode: str = "thread_local", freeze_gc: bool = False) -> GraphCapture:
        """A context manager that captures its body into this graph (the library's own way to capture).

        Makes ``stream`` current (default: capture on the current stream),
        begins, and ends on exit; a body that raises is discarded (the failure
        path runs) and its exception propagates. ``capture_error_mode`` defaults
        to ``"thread_local"``, so other threads' CUDA work carries on during the
        capture. ``freeze_gc`` keeps the garbage collector frozen for the body.
        """
        self._require_native("capturing")
        self._require_empty("capturing")
        cap = GraphCapture(self, pool=pool, stream=stream, capture_error_mode=capture_error_mode,
                           generators=self._generators, freeze_gc=freeze_gc)
        self._start(cap)
        return cap

    def _start(self, cap: GraphCapture) -> None:
        self.__dict__.pop("replay", None)
        self._capture = cap

    # ----------------------------------------------------------------- replay
    def replay(self, **kwargs: Any) -> Any:
        """Launch the captured graph on the current stream.

        The first replay of a capture installs a per-instance closure that
        answers every later call: a counter tick over PyTorch's own ``replay``
        (one replay in ``REPLAY_SAMPLE_EVERY`` also reads the clock twice).
        A graph that is not ready raises PyTorch's own error, with a hint.
        """
        if kwargs:
            raise TypeError(
                f"replay({', '.join(f'{k}=' for k in kwargs)}) needs a graph captured with the high-level "
                "capture(model_fn=...); this graph was captured with capture_begin()/capture_end() or "
                "torch.cuda.graph, so call replay() with no arguments")
        state = self.state
        if state is GraphState.READY:
            self._install_fast_replay()
            return self.__dict__["replay"]()
        self._require_native("replay")
        hint = {GraphState.FAILED: f"this graph's capture failed and was discarded ({self.failure_reason}); "
                                   "capture it again",
                GraphState.CAPTURING: "replay() was called during the capture; call capture_end() first"}
        try:
            OriginalCUDAGraph.replay(self)  # PyTorch refuses a graph without a successful capture
        except Exception as exc:
            raise add_hint(exc, hint.get(state, "capture the graph first")) from None
        raise RuntimeError(f"replay() on a graph in state {state.value!r} ran; this PyTorch did not refuse it")

    def replay_parts(self) -> tuple[Callable[[Any], None], Callable[[], int], int, Callable[[int], None]]:
        """What :meth:`replay` does, for a caller's own hot loop: ``(launch, tick, mask, record)``.

        ``launch(graph)`` replays without any check; ``tick()`` counts the replay, and when
        ``tick() & mask`` is 0 the caller times the launch with ``time.perf_counter_ns`` and passes
        the nanoseconds to ``record``, as :meth:`replay` does. Valid while the graph is ready
        (the caller must drop the parts when it is reset or recaptured); raises ``RuntimeError`` otherwise.
        """
        if self.state is not GraphState.READY:
            raise RuntimeError(f"replay_parts() on a graph in state {self.state.value!r}; expected a ready graph")
        if self._capture is not None and self._capture.liveness is not None:
            # captured in debug/validate mode: the launch keeps the freed-input check replay() has
            self._install_fast_replay()
            fast = self.__dict__["replay"]
            return (lambda g: fast()), (lambda: 1), 1, stats.record_replay_ns  # tick & mask != 0: fast() counts
        return base_replay, self._replays.tick, _SAMPLE_MASK, stats.record_replay_ns

    def _install_fast_replay(self) -> None:
        # On a slow host each attribute read is ~50 ns against a ~5 us launch, so the
        # state check and counter live in closure cells. The closure exists only while
        # READY: every state change pops it first.
        tick = self._replays.tick
        base, record, now, mask = base_replay, stats.record_replay_ns, time.perf_counter_ns, _SAMPLE_MASK
        # weak: the closure lives in this graph's __dict__, and a strong reference would make
        # a cycle that keeps a dropped graph (and its pool) until a full collection
        graph = weakref.ref(self)
        cls = type(self)
        liveness = self._capture.liveness if self._capture is not None else None
        if liveness is not None:  # debug/validate mode on a torch without check_input_liveness
            checked = base

            def base(g: Any) -> None:
                freed = liveness.freed()
                if freed:
                    raise RuntimeError(f"replay(): {len(freed)} tensor(s) the graph reads were freed after the "
                                       f"capture ({'; '.join(freed[:3])}); their memory may hold other data now. "
                                       "Keep captured inputs alive and copy new data into them")
                checked(g)

        def replay(**kwargs: Any) -> Any:
            if kwargs:
                return cls.replay(graph(), **kwargs)
            if tick() & mask:
                base(graph())
                return None
            t0 = now()
            base(graph())
            record(now() - t0)
            return None

        replay.__doc__ = SafeCUDAGraph.replay.__doc__
        self.__dict__["replay"] = replay

    # ------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Delete the captured graph (and discard an unfinished capture first)."""
        self._require_native("reset")
        self.__dict__.pop("replay", None)
        cap, self._capture = self._capture, None
        if cap is not None and cap.state is CaptureState.CAPTURING:
            cap.discard("reset() during capture")
        else:
            super().reset()

    def __del__(self) -> None:
        # Releasing a graph mid-capture is what aborts processes: end the capture first.
        try:
            cap = self.__dict__.get("_capture")
            if cap is not None and cap.state is CaptureState.CAPTURING:
                cap.discard("graph released during capture", graph=self)
            if "_replays" in self.__dict__:
                stats.retire_replays(self._replays)
        except BaseException:
            pass
        base_del = getattr(OriginalCUDAGraph, "__del__", None)
        if base_del is not None and not _BASE_IS_STUB:
            try:
                base_del(self)
            except BaseException:
                pass

    def register_generator_state(self, generator: Any) -> None:
        """Register a generator so its random stream advances per replay (same as PyTorch's).

        Where PyTorch (2.3 - 2.12) would register half-way and leave a graph whose
        destruction aborts the process, this refuses first (a call while the current
        stream is capturing) or keeps the graph alive until exit (a failure part-way,
        such as running out of memory under a memory fraction); see :mod:`.capture`.
        """
        self._require_native("register_generator_state")
        check_cuda_generators("register_generator_state", (generator,))
        if generator_states_track_graphs() and torch.cuda.is_current_stream_capturing():
            # CUDAGeneratorState::register_graph's assertNotCapturing throws after the graph took the state
            raise RuntimeError("Cannot register the state during capturing stage.\n[gfxgraph] register generators "
                               "before capture_begin(); gfxgraph refused before PyTorch's half-done registration "
                               "would make this graph abort the process when destroyed")
        try:
            super().register_generator_state(generator)
        except BaseException:
            secure_generator_registration(self, (generator,), why="register_generator_state() failed")
            raise
        self._generators = (*self._generators, generator)

    def register_generators(self, generators: Sequence[torch.Generator]) -> None:
        """:meth:`register_generator_state` for each of ``generators``."""
        for gen in generators:
            self.register_generator_state(gen)

    def pool(self) -> Any:
        """This graph's memory-pool handle (pass it to another capture to share memory)."""
        self._require_native("pool")
        try:
            return super().pool()
        except Exception as exc:  # PyTorch's own refusal, with what gfxgraph knows after it
            failed = self.state is GraphState.FAILED
            raise add_hint(exc, f"this graph's capture failed ({self.failure_reason}); it owns no pool" if failed
                           else "capture the graph first") from None

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

    def __repr__(self) -> str:
        failure = self.failure_reason
        extra = f", failure={failure!r}" if failure else ""
        return f"{type(self).__name__}(state={self.state.value}{extra})"
