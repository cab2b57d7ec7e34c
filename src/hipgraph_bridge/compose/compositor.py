"""Graph compositor: captured graphs composed as child-graph nodes of one graph.

CUDA and HIP cannot nest stream captures, but both can embed a captured graph
into another as a child-graph node, with dependency edges between nodes.
:class:`GraphCompositor` builds one parent graph from any number of captured
graphs whose dependencies form a DAG, instantiates it once, and launches it
with one runtime call. A child can be hot-swapped for a newly captured graph:
``GraphExecChildGraphNodeSetParams`` rewrites its parameters in the
executable without re-instantiating when the topology is unchanged; when the
runtime refuses, the parent is rebuilt and re-instantiated and the reason is
logged and returned.

:meth:`GraphCompositor.stage` reads like nested capture::

    comp = GraphCompositor()
    with comp.stage("embed"):
        h = embed(x)
    with comp.stage("left", after=["embed"]):
        a = left(h)
    with comp.stage("right", after=["embed"]):
        b = right(h)
    with comp.stage("merge", after=["left", "right"]):
        y = a + b
    comp.instantiate()
    comp.launch()          # embed, then left and right (concurrently), then merge

Memory: a child's kernels read and write tensors in the memory pool of the
PyTorch graph it was captured into; the compositor keeps every such graph
alive as long as it holds the child. Stages share one pool only when it is
safe: a stage joins a pool when every stage already in it is among its
ancestors (so in the composed graph it runs after all of them, as in
sequential replay); a stage that may run concurrently with a pool member gets
its own pool. A hot-swapped child captured by :meth:`restage` gets a fresh pool.

What it will not do: compose graphs holding memory-allocation nodes
(``cudaMallocAsync`` allocator) or conditional nodes (the runtime refuses such
children), or advance PyTorch's RNG offsets between launches (graphs with RNG
ops produce the same random numbers every launch here).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import GraphRuntimeError
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import side_stream
from ..log import log_once, logger
from ..platform import require_gpu
from ..runtime import Graph, GraphExec, GraphNode, Runtime, as_graph, capabilities_of, resolve_runtime, \
    stream_handle

__all__ = ["GraphCompositor", "CompositorState", "SwapResult", "StageCapture", "SwapStrategy",
           "validate_dag"]

SwapStrategy = Literal["auto", "reinstantiate"]
_SWAPS = ("auto", "reinstantiate")


class CompositorState(enum.Enum):
    BUILDING = "building"  # children being added; instantiate() next
    READY = "ready"  # instantiated; launch() and replace() work
    CLOSED = "closed"


@dataclass(frozen=True)
class SwapResult:
    """How :meth:`GraphCompositor.replace` applied a new child.

    ``method`` is ``"set_params"`` (the executable was updated in place) or
    ``"reinstantiate"``; ``reason`` says why the in-place update was not used.
    """

    name: str
    method: Literal["set_params", "reinstantiate"]
    reason: str | None
    seconds: float


class StageCapture:
    """Yielded by :meth:`GraphCompositor.stage`/``restage``: the graph being captured.

    ``result`` is set after a ``restage`` block (None for ``stage``).
    """

    def __init__(self, name: str, graph: Any) -> None:
        self.name = name
        self.graph = graph
        self.result: SwapResult | None = None


def validate_dag(after: Mapping[str, Sequence[str]]) -> list[str]:
    """Topological order of a dependency mapping ``{name: names it runs after}``.

    Ties keep the mapping's insertion order. Raises ``ValueError`` naming an
    unknown dependency, or the nodes of a cycle.
    """
    for name, deps in after.items():
        for dep in deps:
            if dep not in after:
                raise ValueError(f"child {name!r} runs after {dep!r}, which is not a child; "
                                 f"expected one of {sorted(after)}")
    indegree = {name: len(set(deps)) for name, deps in after.items()}
    dependents: dict[str, list[str]] = {name: [] for name in after}
    for name, deps in after.items():
        for dep in set(deps):
            dependents[dep].append(name)
    ready = [name for name in after if indegree[name] == 0]
    order: list[str] = []
    while ready:
        name = ready.pop(0)
        order.append(name)
        for nxt in dependents[name]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    if len(order) < len(after):
        raise ValueError(f"the dependencies form a cycle: {_find_cycle(after, set(order))}; "
                         "expected a DAG (each child runs after children that do not depend on it)")
    return order


def _find_cycle(after: Mapping[str, Sequence[str]], done: set[str]) -> str:
    # Every node left over has a dependency that is also left over: walk until one repeats.
    start = next(name for name in after if name not in done)
    path = [start]
    while True:
        nxt = next(dep for dep in after[path[-1]] if dep not in done)
        if nxt in path:
            cycle = path[path.index(nxt):] + [nxt]
            return " -> ".join(repr(n) for n in cycle) + " (each runs after the next)"
        path.append(nxt)


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    if not name:
        raise ValueError("name: expected a non-empty str, got ''")
    return name


class GraphCompositor:
    """Compose captured graphs into one executable graph with DAG dependencies.

    Workflow:

    1. :meth:`add` captured graphs (``torch.cuda.CUDAGraph(keep_graph=True)``,
       ``SafeCUDAGraph(keep_graph=True)`` or runtime :class:`Graph`), or
       capture them in place with :meth:`stage`; ``after`` names the children
       each one runs after.
    2. :meth:`instantiate`: checks the DAG (unknown names, cycles), builds the
       parent graph, instantiates and uploads it once.
    3. :meth:`launch` on a stream: one runtime call for the whole composition.
    4. :meth:`replace` / :meth:`restage`: hot-swap one child.

    Args:
        runtime: a :class:`Runtime`, a kind (``"cuda-bindings"``, ``"ctypes"``)
            or None for the current runtime.
        swap: ``"auto"`` updates a swapped child in place when the runtime
            allows and the capability table trusts it (not on HIP, where each
            in-place swap takes kernel-argument space that is never reclaimed);
            ``"reinstantiate"`` always rebuilds (the fallback, forced).
        upload: upload the executable at instantiation (first launch is not slower).
    """

    def __init__(self, *, runtime: Runtime | str | None = None, swap: SwapStrategy = "auto",
                 upload: bool = True) -> None:
        if swap not in _SWAPS:
            raise ValueError(f"swap: expected one of {', '.join(_SWAPS)}, got {swap!r}")
        self._rt = resolve_runtime(runtime)
        self._swap: SwapStrategy = swap
        self._upload = bool(upload)
        self._state = CompositorState.BUILDING
        self._children: dict[str, Graph] = {}
        self._after: dict[str, tuple[str, ...]] = {}
        self._order: list[str] = []
        self._parent: Graph | None = None
        self._nodes: dict[str, GraphNode] = {}
        self._exec: GraphExec | None = None
        self._pools: list[tuple[Any, set[str]]] = []  # stage pools: (pool handle, members)
        self.last_swap: SwapResult | None = None
        self.swaps_in_place = 0
        self.reinstantiations = 0

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> CompositorState:
        return self._state

    @property
    def runtime(self) -> Runtime:
        return self._rt

    @property
    def names(self) -> list[str]:
        """Children in the order they were added."""
        return list(self._children)

    @property
    def order(self) -> list[str]:
        """Children in topological order (after :meth:`instantiate`)."""
        return list(self._order)

    @property
    def exec(self) -> GraphExec:
        self._require(CompositorState.READY, "exec")
        assert self._exec is not None  # set with READY
        return self._exec

    def child(self, name: str) -> Any:
        """What was given for ``name`` (the PyTorch graph for borrowed children)."""
        g = self._children[self._known(name)]
        return g.keepalive if g.keepalive is not None else g

    def dependencies(self, name: str) -> tuple[str, ...]:
        return self._after[self._known(name)]

    def __len__(self) -> int:
        return len(self._children)

    def __contains__(self, name: object) -> bool:
        return name in self._children

    def _require(self, state: CompositorState, what: str) -> None:
        if self._state is state:
            return
        if self._state is CompositorState.CLOSED:
            fix = "create a new GraphCompositor"
        elif state is CompositorState.READY:
            fix = "call instantiate() first"
        else:
            fix = ("children can only be added before instantiate(); use replace()/restage() "
                   "to swap one, or a new GraphCompositor")
        raise RuntimeError(f"GraphCompositor.{what}() needs state {state.value!r}, but the "
                           f"compositor is {self._state.value!r}: {fix}")

    def _known(self, name: object) -> str:
        name = _check_name(name)
        if name not in self._children:
            raise KeyError(f"no child named {name!r}; expected one of {sorted(self._children)}")
        return name

    # --------------------------------------------------------------- building
    def add(self, name: str, graph: Any, *, after: Iterable[str] = ()) -> None:
        """Add ``graph`` as child ``name``, running after the children named in ``after``.

        ``after`` may name children added later; unknown names and cycles are
        reported by :meth:`instantiate`. The graph (and its memory pool) is
        kept alive by the compositor.
        """
        self._require(CompositorState.BUILDING, "add")
        name = _check_name(name)
        if name in self._children:
            raise ValueError(f"a child named {name!r} already exists; expected a new name")
        deps = self._check_after(name, after)
        self._children[name] = as_graph(graph, self._rt)
        self._after[name] = deps

    def _check_after(self, name: str, after: Iterable[str]) -> tuple[str, ...]:
        if isinstance(after, str):
            raise TypeError(f"after: expected an iterable of child names, got the str {after!r} "
                            f"(write after=[{after!r}])")
        deps: list[str] = []
        for dep in after:
            dep = _check_name(dep)
            if dep == name:
                raise ValueError(f"child {name!r} cannot run after itself")
            if dep not in deps:
                deps.append(dep)
        return tuple(deps)

    def _ancestors(self, deps: Iterable[str]) -> set[str]:
        seen: set[str] = set()
        todo = list(deps)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(self._after.get(n, ()))
        return seen

    def _shared_pool(self, deps: Sequence[str]) -> tuple[Any, set[str]] | None:
        """A stage pool the new stage may share (every member is its ancestor), or None."""
        ancestors = self._ancestors(deps)
        for pool, members in self._pools:
            if members <= ancestors:
                return pool, members
        return None

    @contextlib.contextmanager
    def stage(self, name: str, *, after: Iterable[str] = (), stream: Any = None,
              capture_error_mode: str = "thread_local") -> Iterator[StageCapture]:
        """Capture the body as child ``name``, running after the children in ``after``.

        The body is captured into a ``SafeCUDAGraph(keep_graph=True)`` on
        ``stream`` (default: a side stream), so a failed capture is ended
        cleanly and raised. Warm the body's ops up first, as for
        ``torch.cuda.graph``. ``after`` must name children that already exist.
        """
        require_gpu("GraphCompositor.stage")
        self._require(CompositorState.BUILDING, "stage")
        name = _check_name(name)
        if name in self._children:
            raise ValueError(f"a child named {name!r} already exists; expected a new name")
        deps = self._check_after(name, after)
        unknown = [d for d in deps if d not in self._children]
        if unknown:
            raise ValueError(f"stage {name!r} runs after {unknown}, which are not children yet; "
                             f"expected names among {sorted(self._children)}")
        shared = self._shared_pool(deps)
        pool, members = shared if shared is not None else (torch.cuda.graph_pool_handle(), None)
        # Captured with the one capture primitive, not through graph.capturer.Capturer: a stage is the
        # caller's ``with`` body (the Capturer captures a callable), a child must keep its graph to be
        # composed (keep_graph=True; the Capturer's graphs drop theirs), the caller warms up as for
        # torch.cuda.graph (no warm-up here), and a compositor holds several pools chosen by the DAG
        # (a Capturer holds one). A stage that fails is not added, and a fresh pool is not kept.
        g = SafeCUDAGraph(keep_graph=True)
        cap = StageCapture(name, g)
        with g.capturing(pool=pool, stream=side_stream(stream), capture_error_mode=capture_error_mode):
            yield cap
        self._children[name] = Graph.from_torch(g, runtime=self._rt)
        self._after[name] = deps
        if members is None:
            self._pools.append((pool, {name}))
        else:
            members.add(name)

    # ---------------------------------------------------------- instantiation
    def _build(self, children: Mapping[str, Graph]) -> tuple[Graph, dict[str, GraphNode]]:
        parent = Graph.create(runtime=self._rt)
        nodes: dict[str, GraphNode] = {}
        try:
            for name in self._order:
                deps = [nodes[d] for d in self._after[name]]
                nodes[name] = parent.add_child(children[name], after=deps)
        except BaseException:
            parent.close()
            raise
        return parent, nodes

    def _instantiate_parent(self, children: Mapping[str, Graph],
                            stream: Any) -> tuple[Graph, dict[str, GraphNode], GraphExec]:
        parent, nodes = self._build(children)
        try:
            upload = stream_handle(stream) if self._upload else None
            exec_ = parent.instantiate(upload_stream=upload, track_completion=True)
        except BaseException:
            parent.close()
            raise
        return parent, nodes, exec_

    def instantiate(self, *, stream: Any = None) -> None:
        """Check the DAG, build the parent graph, instantiate it (and upload on ``stream``).

        Raises:
            ValueError: no children, an unknown dependency, or a cycle (named).
            GraphRuntimeError: the runtime refused a child or the instantiation.
        """
        self._require(CompositorState.BUILDING, "instantiate")
        if not self._children:
            raise ValueError("nothing to compose: expected at least one child; add() or stage() first")
        self._order = validate_dag(self._after)
        self._parent, self._nodes, self._exec = self._instantiate_parent(self._children, stream)
        self._state = CompositorState.READY

    # ------------------------------------------------------------------ launch
    def launch(self, stream: Any = None) -> None:
        """Launch the composition on ``stream`` (torch stream, raw int, None = current).

        Hot path: one graph launch and one event record; pass an int handle
        to skip the current-stream lookup.
        """
        exec_ = self._exec
        if exec_ is None:
            self._require(CompositorState.READY, "launch")
        exec_.launch(stream)  # type: ignore[union-attr]

    def synchronize(self) -> None:
        """Block until the last launch finished."""
        if self._exec is not None:
            self._exec.wait_idle()

    # ------------------------------------------------------------------- swap
    def replace(self, name: str, graph: Any, *, stream: Any = None) -> SwapResult:
        """Hot-swap child ``name`` for ``graph`` (captured with ``keep_graph=True``).

        Waits for the last launch, then gives the child node the new graph's
        parameters in the executable (no re-instantiation) when the runtime
        allows it (same topology and node order as the child it replaces) and
        the capability table trusts it (not on HIP).
        Otherwise the parent is rebuilt and re-instantiated (uploaded on
        ``stream``) and the runtime's reason is logged and returned. The new
        child must write the tensors later children read (they read by address).
        """
        self._require(CompositorState.READY, "replace")
        name = self._known(name)
        new = as_graph(graph, self._rt)
        t0 = time.perf_counter()
        exec_ = self.exec
        exec_.wait_idle()
        reason: str | None
        caps = capabilities_of(self._rt)
        if self._swap == "reinstantiate":
            reason = "swap='reinstantiate' was requested"
        elif not caps.child_graph_update:  # HIP: each in-place swap takes kernel-argument space for good
            reason = (f"{self._rt.prefix}GraphExecChildGraphNodeSetParams is not used on {caps.label}: "
                      f"{caps.why('child_graph_update')}")
        elif not self._rt.capabilities.child_graph_update:
            reason = (f"{self._rt.prefix}GraphExecChildGraphNodeSetParams is not available in "
                      f"{self._rt.binding}")
        else:
            try:
                exec_.set_child(self._nodes[name], new)
            except GraphRuntimeError as exc:
                reason = f"{exc.call} refused the new child: {exc.name}: {exc.explanation}"
            else:
                # The parent graph keeps the old child's clone; it is only used
                # again by a rebuild, which starts from self._children.
                self._children[name] = new
                result = SwapResult(name, "set_params", None, time.perf_counter() - t0)
                self.swaps_in_place += 1
                self.last_swap = result
                return result
        children = {**self._children, name: new}
        parent, nodes, new_exec = self._instantiate_parent(children, stream)
        old_exec, old_parent = self._exec, self._parent
        self._children, self._parent, self._nodes, self._exec = children, parent, nodes, new_exec
        old_exec.close()  # type: ignore[union-attr]
        old_parent.close()  # type: ignore[union-attr]
        result = SwapResult(name, "reinstantiate", reason, time.perf_counter() - t0)
        by_table = self._swap != "reinstantiate" and not caps.child_graph_update
        if by_table:  # the same reason every swap: once at INFO
            log_once(("hot_swap", "table", caps.label), logging.INFO,
                     "gfxgraph: the compositor re-instantiates to swap children: %s", reason)
        level = logging.DEBUG if self._swap == "reinstantiate" or by_table else logging.INFO
        logger.log(level, "gfxgraph: compositor re-instantiated to swap child %r: %s", name, reason)
        self.reinstantiations += 1
        self.last_swap = result
        return result

    @contextlib.contextmanager
    def restage(self, name: str, *, stream: Any = None,
                capture_error_mode: str = "thread_local") -> Iterator[StageCapture]:
        """Capture the body anew and hot-swap it in for child ``name`` (see :meth:`replace`).

        The capture gets a fresh memory pool: sharing the composition's pools
        could hand it memory that concurrently running children use. The
        :class:`SwapResult` is in the yielded handle's ``result`` after the block.
        """
        require_gpu("GraphCompositor.restage")
        self._require(CompositorState.READY, "restage")
        name = self._known(name)
        g = SafeCUDAGraph(keep_graph=True)  # the caller's body, kept graph: as in stage(), not a Capturer
        cap = StageCapture(name, g)
        with g.capturing(stream=side_stream(stream), capture_error_mode=capture_error_mode):
            yield cap
        cap.result = self.replace(name, g)

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release the executable and parent graph and drop the children (idempotent).

        Waits for the last launch first, so the children's memory pools are
        not given back while a launch may still use them.
        """
        if self._exec is not None:
            try:
                self._exec.wait_idle()
            except Exception as exc:  # a broken device must not make close() raise
                logger.debug("gfxgraph: compositor close: waiting for the last launch failed: %s",
                             exc)
            self._exec.close()
            self._exec = None
        if self._parent is not None:
            self._parent.close()
            self._parent = None
        self._nodes = {}
        self._children = {}
        self._pools = []
        self._state = CompositorState.CLOSED

    def __enter__(self) -> GraphCompositor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GraphCompositor(state={self._state.value}, children={self.names}, "
                f"runtime={self._rt.kind})")
