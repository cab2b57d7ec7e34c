"""Exec update: re-capture into an existing executable graph instead of instantiating a new one.

When a graph is captured again with the same topology (same nodes in the
same order; kernel arguments, pointers and scalars may differ), the runtime's
``GraphExecUpdate`` rewrites the parameters of the existing executable graph
instead of instantiating a new one, which is much cheaper. When the runtime
refuses (topology changed, unsupported change) the graph is instantiated
anew, and the reason, with the runtime's own result name, is logged and
returned.

* :func:`apply_update`: one update-or-reinstantiate step on a :class:`GraphExec`.
* :class:`UpdatableGraph`: an executable graph you launch and re-capture in place.

Both strategies run the same code on CUDA and HIP; ``strategy="reinstantiate"``
forces the fallback so it is tested on any hardware. ``"auto"`` asks the
capability table first (:mod:`hipgraph_bridge.runtime.capabilities`): on HIP
it re-instantiates, because ``hipGraphExecUpdate`` has reported silent stale
updates, a kernel-argument leak and a quadratic cost, and no ROCm release is
known to carry the fixes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import side_stream
from ..log import log_once, logger
from ..platform import require_gpu
from ..runtime import Graph, GraphExec, Runtime, as_graph, capabilities_of, resolve_runtime, stream_handle

__all__ = ["UpdateResult", "UpdateStrategy", "apply_update", "check_update_strategy",
           "UpdatableGraph", "Recapture"]

UpdateStrategy = Literal["auto", "reinstantiate"]
_STRATEGIES = ("auto", "reinstantiate")


@dataclass(frozen=True)
class UpdateResult:
    """How one update was applied.

    Attributes:
        method: ``"exec_update"`` (in place) or ``"reinstantiate"`` (new executable).
        result: the runtime's update result name when an exec update was tried
            (e.g. ``"cudaGraphExecUpdateSuccess"``,
            ``"hipGraphExecUpdateErrorTopologyChanged"``; ``"unknown"`` when the
            binding does not report it), else None.
        reason: why the exec update was not used (None when it was).
        seconds: host time spent updating or re-instantiating.
    """

    method: Literal["exec_update", "reinstantiate"]
    result: str | None
    reason: str | None
    seconds: float


def check_update_strategy(strategy: object) -> UpdateStrategy:
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy: expected one of {', '.join(_STRATEGIES)}, got {strategy!r}")
    return strategy  # type: ignore[return-value]


def apply_update(exec_: GraphExec, graph: Graph, *, strategy: UpdateStrategy = "auto",
                 flags: int = 0, upload_stream: Any = None) -> tuple[GraphExec, UpdateResult]:
    """Make ``exec_`` run ``graph``: in place when the runtime allows, else anew.

    Waits first for ``exec_``'s last tracked launch (HIP does not document
    updates of an executable in flight as safe; this costs nothing when it is
    idle). Returns the executable to use from now on: ``exec_`` itself when
    updated in place, or a new one (``exec_`` is then closed; it was idle).

    Args:
        strategy: ``"auto"`` tries ``GraphExecUpdate`` first where the capability
            table trusts it (not on HIP: see the module docstring);
            ``"reinstantiate"`` forces a new instantiation (the fallback path).
        flags: instantiate flags for a re-instantiation.
        upload_stream: when given, a new executable is uploaded on it.
    """
    strategy = check_update_strategy(strategy)
    rt: Runtime = exec_.runtime
    t0 = time.perf_counter()
    exec_.wait_idle()
    result: str | None = None
    caps = capabilities_of(rt)
    by_table = False
    if strategy == "reinstantiate":
        reason = "strategy='reinstantiate' was requested"
    elif not caps.exec_update:
        reason = f"{rt.prefix}GraphExecUpdate is not used on {caps.label}: {caps.why('exec_update')}"
        by_table = True
    elif not rt.capabilities.exec_update:
        reason = f"{rt.prefix}GraphExecUpdate is not available in {rt.binding}"
    else:
        outcome = exec_.update(graph)
        result = outcome.result
        if outcome.ok:
            return exec_, UpdateResult("exec_update", result, None, time.perf_counter() - t0)
        reason = (f"{rt.prefix}GraphExecUpdate refused the graph: {outcome.error}: "
                  f"{outcome.message} (result {outcome.result})")
    new = graph.instantiate(flags=flags, upload_stream=upload_stream,
                            track_completion=exec_.tracks_completion)
    exec_.close()
    seconds = time.perf_counter() - t0
    if by_table:  # the same reason every time: once at INFO, then at DEBUG
        if not log_once(("exec_update", "table", caps.label), logging.INFO,
                        "gfxgraph: re-instantiating executable graphs instead of updating them: %s", reason):
            logger.debug("gfxgraph: re-instantiated the executable graph: %s", reason)
    else:
        level = logging.DEBUG if strategy == "reinstantiate" else logging.INFO
        logger.log(level, "gfxgraph: re-instantiated the executable graph instead of updating it: %s",
                   reason)
    return new, UpdateResult("reinstantiate", result, reason, seconds)


class Recapture:
    """Handle yielded by :meth:`UpdatableGraph.recapture`; ``result`` is set on exit."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph  # the SafeCUDAGraph being captured
        self.result: UpdateResult | None = None


class UpdatableGraph:
    """An executable graph that is launched, then re-captured and updated in place.

    Workflow:

    1. Capture a ``torch.cuda.CUDAGraph(keep_graph=True)`` (or
       ``SafeCUDAGraph(keep_graph=True)``) and pass it in; it is instantiated once.
    2. :meth:`launch` on any stream.
    3. Capture the work again (same topology: same ops in the same order,
       possibly other tensors or scalars), either yourself followed by
       :meth:`update`, or inside ``with ug.recapture():``. The executable is
       updated in place; if the runtime refuses, it is re-instantiated and
       :class:`UpdateResult` says why.

    Memory: the executable reads the tensors of the graph it was last updated
    from, so that PyTorch graph (and its pool) is kept alive here.

    What it will not do: update while one of its launches is in flight
    (``update`` waits for the last one), or run graphs with RNG ops correctly
    across launches (PyTorch advances the RNG offsets only in its own
    ``replay()``; graphs launched here reuse the captured offsets).
    """

    def __init__(self, graph: Any, *, runtime: Runtime | str | None = None,
                 strategy: UpdateStrategy = "auto", upload: bool = True) -> None:
        self._rt = resolve_runtime(runtime)
        self._strategy = check_update_strategy(strategy)
        self._upload = bool(upload)
        g = as_graph(graph, self._rt)
        upload_stream = stream_handle(None) if self._upload else None
        self._exec: GraphExec | None = g.instantiate(upload_stream=upload_stream,
                                                     track_completion=True)
        self.last_result: UpdateResult | None = None
        self.updates = 0
        self.reinstantiations = 0

    @property
    def exec(self) -> GraphExec:
        if self._exec is None:
            raise RuntimeError("UpdatableGraph is closed; create a new one")
        return self._exec

    @property
    def strategy(self) -> UpdateStrategy:
        return self._strategy

    def launch(self, stream: Any = None) -> None:
        """Launch on ``stream`` (None = current). Hot path: two runtime calls."""
        self.exec.launch(stream)

    def update(self, graph: Any) -> UpdateResult:
        """Run ``graph`` from now on (a PyTorch graph with ``keep_graph=True`` or a Graph).

        Waits for the last launch, then exec update or re-instantiation (see
        :func:`apply_update`). Cost: tens of microseconds for an update,
        more for an instantiation.
        """
        g = as_graph(graph, self._rt)
        upload_stream = stream_handle(None) if self._upload else None
        self._exec, result = apply_update(self.exec, g, strategy=self._strategy,
                                          upload_stream=upload_stream)
        if result.method == "exec_update":
            self.updates += 1
        else:
            self.reinstantiations += 1
        self.last_result = result
        return result

    @contextlib.contextmanager
    def recapture(self, *, pool: Any = None, stream: Any = None,
                  capture_error_mode: str = "thread_local") -> Iterator[Recapture]:
        """Capture the body into a new ``keep_graph`` graph, then :meth:`update` from it.

        ``pool`` defaults to a fresh private pool (sharing one with the graph
        in use would let the capture reuse memory the running graph reads).
        The result is in the yielded handle's ``result`` after the block.
        """
        require_gpu("UpdatableGraph.recapture")
        # The caller's ``with`` body into a kept graph (the update reads its nodes), warmed up by the
        # caller: the one capture primitive directly, not graph.capturer.Capturer (see compositor.stage).
        g = SafeCUDAGraph(keep_graph=True)
        handle = Recapture(g)
        with g.capturing(pool=pool, stream=side_stream(stream), capture_error_mode=capture_error_mode):
            yield handle
        handle.result = self.update(g)

    def close(self) -> None:
        """Release the executable (idempotent)."""
        if self._exec is not None:
            self._exec.close()
            self._exec = None

    def __enter__(self) -> UpdatableGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
