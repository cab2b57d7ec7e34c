"""``BridgedCUDAGraph``: the drop-in graph class, plus the high-level ``capture(model_fn=...)``.

The low-level API (``capture_begin``/``capture_end``/``replay``/...) is
:class:`~hipgraph_bridge.graph.SafeCUDAGraph`'s, unchanged. This class adds
the high-level API, which never raises for a capture or replay failure: it runs
``model_fn`` eagerly instead, counts the fallback and logs its reason once::

    g = BridgedCUDAGraph()
    with g.capture(model_fn=model, example_input=x) as cap:
        pass                      # model(static copy of x) is captured on exit
    y = g.replay(input_tensor=x2)  # copies x2 in, replays, returns a copy of the output

The high-level capture is held by a session (:mod:`.sessions`); while one is
held the graph's state is ``SESSION`` and ``replay(...)`` routes to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..graph.bridged import GraphState, SafeCUDAGraph
from .sessions import Session, open_session

__all__ = ["BridgedCUDAGraph"]


class BridgedCUDAGraph(SafeCUDAGraph):
    """Drop-in ``torch.cuda.CUDAGraph`` with abort-proof capture and an eager-fallback high-level capture.

    Low-level API: as :class:`~hipgraph_bridge.graph.SafeCUDAGraph` (PyTorch's
    semantics and errors, raised only after the capture was ended cleanly).
    High-level API: :meth:`capture` and ``replay(input_tensor=..., batch_size=..., branch=...)``.
    On a CPU-only build the object can be created; the low-level methods raise
    :class:`~hipgraph_bridge.errors.GraphsUnavailableError` and the high-level API runs eagerly.
    """

    def __init__(self, keep_graph: bool = False, *args: Any, **kwargs: Any) -> None:
        super().__init__(keep_graph, *args, **kwargs)
        self._session: Session | None = None

    @property
    def state(self) -> GraphState:
        session = self._session
        if session is None:
            return super().state
        return GraphState.FAILED if session.mode == "interrupted" else GraphState.SESSION

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
        """The high-level capture: a context manager that falls back to eager.

        Static shapes: ``with g.capture(model_fn=model, example_input=x) as cap:``
        captures ``model_fn(cap.static_input)`` on exit (or the body's own work,
        which then sets ``cap.output``); ``g.replay(input_tensor=x2)`` copies in,
        replays and returns the outputs.

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
        if super().state is GraphState.CAPTURING:
            raise RuntimeError("capture() called while this graph is capturing")
        session = open_session(model_fn=model_fn, example_input=example_input, dynamic_shapes=dynamic_shapes,
                               buckets=buckets, conditional_branches=conditional_branches,
                               copy_outputs=copy_outputs, warmup_iters=warmup_iters, pool=pool)
        self._release()
        self._session = session
        return session

    def replay(self, **kwargs: Any) -> Any:
        """Launch the graph (low-level), or with a high-level capture: select the bucket
        (``batch_size=``), branch (``branch=``) and input (``input_tensor=``), and return the outputs."""
        session = self._session
        if session is not None:
            return session.replay(**kwargs)
        return super().replay(**kwargs)

    def reset(self) -> None:
        """Delete the captured graph, or close the high-level capture."""
        if self._session is not None:
            self._release()
            return
        super().reset()

    def _release(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()
        elif super().state is not GraphState.EMPTY:
            super().reset()
