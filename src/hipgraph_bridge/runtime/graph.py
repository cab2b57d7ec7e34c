"""Pythonic owners of runtime handles: the graph being built, the executable graph, nodes, events.

* :class:`Graph` (``cudaGraph_t``/``hipGraph_t``) is the builder: add
  child-graph nodes, clone, instantiate. A graph taken from PyTorch
  (:meth:`Graph.from_torch`) is borrowed: PyTorch keeps owning it, and the
  ``Graph`` keeps the PyTorch graph object (and with it the memory pool its
  kernels read and write) alive.
* :class:`GraphExec` (``cudaGraphExec_t``) is the executable: launch, upload,
  update in place, swap a child's parameters.
* :class:`GraphNode` is a node of one graph; it keeps that graph alive.
* :class:`Event` is a timing-free event used to know when a launch is done.

Ownership: each owned handle has one release path, shared by ``close()``
(idempotent) and a ``weakref.finalize`` that holds no reference to its owner;
see :mod:`._lifetime` for what happens during a capture and at exit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..log import logger
from ._base import ExecUpdateOutcome, Runtime
from ._lifetime import attach_finalizer, drain_deferred
from ._select import resolve_runtime

__all__ = ["Graph", "GraphExec", "GraphNode", "Event", "stream_handle", "as_graph"]


def stream_handle(stream: Any = None) -> int:
    """The raw ``cudaStream_t``/``hipStream_t`` of ``stream`` as an int.

    Accepts a ``torch.cuda.Stream`` (or ``ExternalStream``, anything with an
    int ``cuda_stream``), a raw handle (int), or None for the current stream.
    Cost: None reads ``torch.cuda.current_stream()`` (about a microsecond);
    pass a stream or an int on hot paths.
    """
    if stream is None:
        return int(torch.cuda.current_stream().cuda_stream)
    if isinstance(stream, bool):
        raise TypeError("stream: expected a torch.cuda.Stream, a raw stream handle (int) or None, "
                        "got bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"stream: expected a non-negative raw stream handle, got {stream}")
        return stream
    ptr = getattr(stream, "cuda_stream", None)
    if isinstance(ptr, int):
        return ptr
    raise TypeError("stream: expected a torch.cuda.Stream, a raw stream handle (int) or None, "
                    f"got {type(stream).__name__}")


class _Owned:
    """A runtime handle with one release path (``close()`` and the finalizer)."""

    _KIND = ""

    def __init__(self, runtime: Runtime, handle: int, *, owned: bool) -> None:
        if not isinstance(handle, int) or isinstance(handle, bool) or handle <= 0:
            raise ValueError(f"handle: expected a non-NULL {self._KIND} handle (positive int), "
                             f"got {handle!r}")
        self._rt = runtime
        self._handle = handle
        self._closed = False
        self._finalizer = attach_finalizer(self, runtime, self._KIND, handle) if owned else None

    @property
    def runtime(self) -> Runtime:
        return self._rt

    @property
    def handle(self) -> int:
        """The raw handle; raises ``RuntimeError`` once closed."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed; its {self._KIND} handle was "
                               "released. Create a new one")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owned(self) -> bool:
        """Whether closing this object destroys the handle (False for borrowed graphs)."""
        return self._finalizer is not None

    def close(self) -> None:
        """Release the handle (idempotent; never raises; deferred during a live capture)."""
        self._closed = True
        fin = self._finalizer
        if fin is not None:
            fin()  # a finalizer runs at most once
        drain_deferred()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._handle:#x}"
        return f"<{type(self).__name__} {state} ({self._rt.name})>"


@dataclass(frozen=True, eq=False)
class GraphNode:
    """A node of ``graph`` (keeps the graph alive while the node is referenced)."""

    handle: int
    graph: Graph


class Graph(_Owned):
    """A graph being built (``cudaGraph_t``/``hipGraph_t``).

    Create with :meth:`create` (empty, owned), :meth:`from_torch` (a PyTorch
    graph captured with ``keep_graph=True``, borrowed), :meth:`adopt` (take
    ownership of a raw handle) or :meth:`borrow`.
    """

    _KIND = "graph"

    def __init__(self, handle: int, *, runtime: Runtime, owned: bool, keepalive: Any = None) -> None:
        super().__init__(runtime, handle, owned=owned)
        self._keepalive = keepalive

    @classmethod
    def create(cls, *, runtime: Runtime | str | None = None) -> Graph:
        """A new empty graph. Cost: one runtime call."""
        rt = resolve_runtime(runtime)
        drain_deferred()
        return cls(rt.graph_create(), runtime=rt, owned=True)

    @classmethod
    def adopt(cls, handle: int, *, runtime: Runtime | str | None = None) -> Graph:
        """Own ``handle`` (destroyed when this object is closed or collected)."""
        return cls(handle, runtime=resolve_runtime(runtime), owned=True)

    @classmethod
    def borrow(cls, handle: int, *, runtime: Runtime | str | None = None, keepalive: Any = None) -> Graph:
        """Use ``handle`` without owning it; ``keepalive`` is held as long as this object."""
        return cls(handle, runtime=resolve_runtime(runtime), owned=False, keepalive=keepalive)

    @classmethod
    def from_torch(cls, torch_graph: Any, *, runtime: Runtime | str | None = None) -> Graph:
        """Borrow the ``cudaGraph_t`` of a PyTorch graph captured with ``keep_graph=True``.

        The PyTorch graph object is kept alive by the returned ``Graph``: its
        memory pool holds the tensors the graph's kernels use.

        Raises:
            TypeError: ``torch_graph`` is not a ``torch.cuda.CUDAGraph``.
            ValueError: it was not captured with ``keep_graph=True`` or its capture has not ended.
        """
        raw = getattr(torch_graph, "raw_cuda_graph", None)
        if raw is None or not callable(raw):
            raise TypeError("expected a torch.cuda.CUDAGraph captured with keep_graph=True or a "
                            f"hipgraph_bridge Graph, got {type(torch_graph).__name__}")
        try:
            handle = int(raw())
        except RuntimeError as exc:
            raise ValueError(
                "expected a torch.cuda.CUDAGraph(keep_graph=True) whose capture has ended; "
                f"raw_cuda_graph() refused: {exc}"
            ) from exc
        if handle == 0:
            raise ValueError("expected a captured torch.cuda.CUDAGraph(keep_graph=True); "
                             "raw_cuda_graph() returned NULL")
        return cls(handle, runtime=resolve_runtime(runtime), owned=False, keepalive=torch_graph)

    def close(self) -> None:
        """Destroy the graph if owned, and drop what it keeps alive (idempotent)."""
        super().close()
        self._keepalive = None

    @property
    def keepalive(self) -> Any:
        """The object this graph keeps alive (the PyTorch graph for :meth:`from_torch`)."""
        return self._keepalive

    def add_child(self, child: Graph, *, after: Sequence[GraphNode] = ()) -> GraphNode:
        """Add ``child`` as a child-graph node that runs after the nodes in ``after``.

        The runtime clones ``child`` into this graph; the clone's kernels use
        the same memory as ``child``'s, so the caller keeps ``child``'s owner alive.
        Cost: one runtime call plus the clone.
        """
        if not isinstance(child, Graph):
            raise TypeError(f"child: expected a Graph, got {type(child).__name__}")
        deps: list[int] = []
        for node in after:
            if not isinstance(node, GraphNode):
                raise TypeError(f"after: expected GraphNode items, got {type(node).__name__}")
            if node.graph is not self:
                raise ValueError("after: every node must belong to this graph")
            if node.handle not in deps:
                deps.append(node.handle)  # the runtime rejects duplicate dependencies
        return GraphNode(self._rt.graph_add_child(self.handle, deps, child.handle), self)

    def node_count(self) -> int:
        """Number of top-level nodes (a child-graph node counts as one)."""
        return self._rt.graph_node_count(self.handle)

    def clone(self) -> Graph:
        """An owned copy (parameters copied; same memory addresses)."""
        return Graph(self._rt.graph_clone(self.handle), runtime=self._rt, owned=True,
                     keepalive=self._keepalive)

    def instantiate(self, *, flags: int = 0, upload_stream: Any = None,
                    track_completion: bool = False) -> GraphExec:
        """Instantiate this graph into a new :class:`GraphExec`.

        Args:
            flags: instantiate flags (same values on CUDA and HIP, e.g. 1 =
                auto-free-on-launch).
            upload_stream: when given, upload the executable on that stream
                right away, so the first launch does not pay for it.
            track_completion: record an event after each launch so that
                :meth:`GraphExec.wait_idle` can wait for the last one.

        Cost: the runtime's instantiation (tens of microseconds to milliseconds).
        """
        drain_deferred()
        exec_ = GraphExec(self._rt.graph_instantiate(self.handle, flags), runtime=self._rt,
                          source=self, track_completion=track_completion)
        if upload_stream is not None and self._rt.capabilities.upload:
            exec_.upload(upload_stream)
        return exec_


def as_graph(obj: Any, runtime: Runtime | str | None = None) -> Graph:
    """A :class:`Graph` for ``obj``: a ``Graph`` as is, a PyTorch graph borrowed."""
    if isinstance(obj, Graph):
        if obj.closed:
            raise ValueError("expected an open Graph, got a closed one")
        return obj
    return Graph.from_torch(obj, runtime=runtime)


class Event(_Owned):
    """A timing-free event (``cudaEventDisableTiming``)."""

    _KIND = "event"

    def __init__(self, handle: int, *, runtime: Runtime) -> None:
        super().__init__(runtime, handle, owned=True)

    @classmethod
    def create(cls, *, runtime: Runtime | str | None = None) -> Event:
        rt = resolve_runtime(runtime)
        return cls(rt.event_create(), runtime=rt)

    def record(self, stream: Any = None) -> None:
        self._rt.event_record(self.handle, stream if type(stream) is int else stream_handle(stream))

    def query(self) -> bool:
        """Whether all work recorded into the event is done (no host wait)."""
        return self._rt.event_query(self.handle)

    def synchronize(self) -> None:
        """Block the host until the recorded work is done."""
        self._rt.event_synchronize(self.handle)

    def make_wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for the recorded work (no host wait)."""
        self._rt.stream_wait_event(stream if type(stream) is int else stream_handle(stream),
                                   self.handle)


class GraphExec(_Owned):
    """An executable graph (``cudaGraphExec_t``/``hipGraphExec_t``).

    Launches of one executable are ordered after each other by the runtime;
    to run two launches concurrently, instantiate twice.
    """

    _KIND = "exec"

    def __init__(self, handle: int, *, runtime: Runtime, source: Graph | None = None,
                 track_completion: bool = False) -> None:
        super().__init__(runtime, handle, owned=True)
        self._source = source
        self._done: Event | None = Event(runtime.event_create(), runtime=runtime) \
            if track_completion else None
        self._launched = False

    @property
    def tracks_completion(self) -> bool:
        """Whether each launch records an event (see :meth:`wait_idle`)."""
        return self._done is not None

    @property
    def source(self) -> Graph | None:
        """The graph whose parameters this executable currently runs (kept alive)."""
        return self._source

    def launch(self, stream: Any = None) -> None:
        """Launch on ``stream`` (a torch stream, a raw int handle, or None = current).

        Hot path: one runtime call (two with ``track_completion``); pass an int
        stream handle to skip the current-stream lookup. No lock, no logging.
        """
        s = stream if type(stream) is int else stream_handle(stream)
        if self._closed:
            raise RuntimeError("GraphExec is closed; instantiate the graph again")
        self._rt.exec_launch(self._handle, s)
        done = self._done
        if done is not None:
            self._rt.event_record(done._handle, s)
            self._launched = True

    def mark_launched(self, stream: Any = None) -> None:
        """Note a launch made on the device (a kernel on ``stream`` tail-launched this executable):
        :meth:`wait_idle` then waits for work queued on ``stream`` so far, which includes it."""
        done = self._done
        if done is not None:
            self._rt.event_record(done._handle, stream if type(stream) is int else stream_handle(stream))
            self._launched = True

    def upload(self, stream: Any = None) -> None:
        """Upload the executable to the device on ``stream`` without running it."""
        self._rt.exec_upload(self.handle, stream if type(stream) is int else stream_handle(stream))

    def is_idle(self) -> bool:
        """Whether the last tracked launch finished (True if never launched or untracked)."""
        if self._done is None or not self._launched:
            return True
        return self._done.query()

    def wait_idle(self) -> None:
        """Block until the last launch finished (needs ``track_completion=True``; else no-op)."""
        if self._done is not None and self._launched and not self._done.query():
            self._done.synchronize()

    def update(self, graph: Graph) -> ExecUpdateOutcome:
        """Try to update this executable in place from ``graph`` (same topology).

        No fallback here: a refusal is returned (see
        :func:`hipgraph_bridge.exec_update.apply_update` for the fallback).
        On success this executable keeps ``graph`` alive instead of its old source.
        Precondition on HIP: no launch of this executable is in flight (call
        :meth:`wait_idle`); CUDA documents in-flight launches as unaffected.
        """
        if not isinstance(graph, Graph):
            raise TypeError(f"graph: expected a Graph, got {type(graph).__name__}")
        outcome = self._rt.exec_update(self.handle, graph.handle)
        if outcome.ok:
            self._source = graph
        return outcome

    def set_child(self, node: GraphNode, child: Graph) -> None:
        """Give child-graph ``node`` the parameters of ``child`` (same topology as before).

        Raises:
            GraphRuntimeError: the runtime refused (e.g. the child's topology changed).
        """
        if not isinstance(node, GraphNode):
            raise TypeError(f"node: expected a GraphNode, got {type(node).__name__}")
        if not isinstance(child, Graph):
            raise TypeError(f"child: expected a Graph, got {type(child).__name__}")
        self._rt.exec_set_child(self.handle, node.handle, child.handle)

    def close(self) -> None:
        """Release the executable (idempotent, never raises).

        With ``track_completion`` it first waits for the last launch: HIP does
        not document destroying an executable in flight (CUDA frees it when
        the launch completes).
        """
        if not self._closed and self._done is not None:
            try:
                self.wait_idle()
            except Exception as exc:  # a broken device must not make close() raise
                logger.debug("gfxgraph: waiting for the last launch before close failed: %s", exc)
        super().close()
        self._source = None
        if self._done is not None:
            self._done.close()
