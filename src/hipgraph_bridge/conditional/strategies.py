"""How a device tensor selects a branch: one registered class per strategy.

A :class:`~hipgraph_bridge.ConditionalGraph` asks its strategy to
:meth:`~BranchStrategy.build` what a selector kind (``"bool"`` or
``"index"``) needs, to :meth:`~BranchStrategy.select` the branch a device
tensor picks, and to :meth:`~BranchStrategy.run_index` a branch by index;
the branches themselves and their per-branch graphs are the
:class:`~.branches.BranchSet`'s. The registered strategies:

* ``"native"`` (:class:`NativeStrategy`, CUDA >= 12.8): per selector kind,
  one graph holding an IF/ELSE or SWITCH node whose value a one-thread kernel
  sets from the selector at replay (:class:`NativeSelect`). No host read, no sync.
* ``"supergraph"`` (:class:`SupergraphStrategy`, the HIP emulation, forcible
  on CUDA): per selector kind, one flat graph holding every branch
  (:class:`SupergraphSelect`); after one host read of the selector, the
  nodes of the other branches are disabled (``GraphNodeSetEnabled``, only
  when the choice changes) and the graph is launched. Which node types may be
  disabled, and whether a toggle must wait for the launch in flight, are the
  capability table's answers (:mod:`hipgraph_bridge.runtime.capabilities`).
* ``"dispatch"`` (:class:`DispatchStrategy`): one host read, then the chosen
  branch's own graph. Needs no graph of its own; the fallback of the two above.
* ``"eager"`` (:class:`EagerStrategy`): no GPU graphs; chosen, never requested.

Both one-graph strategies write every branch into one set of shared outputs,
so the branches must return the same structure, shapes and dtypes.

A new strategy is one new class::

    @register_strategy
    class MyStrategy(BranchStrategy):
        name = "mine"
        summary = "what it does, in a line"

        def select(self, kind, sel, input_tensor): ...

``ConditionalGraph(strategy="mine")`` then uses it, and
:func:`~hipgraph_bridge.conditional.graph.resolve_strategy` returns it by name
(``"auto"`` stays native where the capability table allows, else dispatch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

from ..graph.bridged import SafeCUDAGraph
from ..graph.capturer import Capturer
from ..runtime import NODE_EMPTY, Runtime, capabilities_of, resolve_runtime
from .branches import BranchSet, StrategyUnavailable, quietly
from .native_nodes import BodyPool, NativeConditional, on_stream, side_stream

__all__ = ["BranchStrategy", "DispatchStrategy", "EagerStrategy", "NativeStrategy", "SupergraphStrategy",
           "register_strategy", "strategy_class", "strategy_names", "DeviceSelected", "NativeSelect",
           "SupergraphSelect", "StrategyUnavailable"]


# ------------------------------------------------------------------ registry
_REGISTRY: dict[str, type[BranchStrategy]] = {}


def register_strategy(cls: type[BranchStrategy]) -> type[BranchStrategy]:
    """Register ``cls`` under ``cls.name`` (a class decorator); returns ``cls``.

    Raises:
        TypeError: ``cls`` is not a :class:`BranchStrategy` subclass.
        ValueError: its name is empty, ``"auto"``, or taken by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, BranchStrategy)):
        raise TypeError(f"register_strategy: expected a BranchStrategy subclass, got {cls!r}")
    name = cls.name
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register_strategy: {cls.__name__}.name: expected a non-empty str other than 'auto', "
                         f"got {name!r}")
    taken = _REGISTRY.get(name)
    if taken is not None and taken is not cls:
        raise ValueError(f"register_strategy: the name {name!r} is taken by {taken.__name__}; expected a new name")
    _REGISTRY[name] = cls
    return cls


def strategy_names(*, requestable: bool = True) -> tuple[str, ...]:
    """Registered strategy names in registration order (``requestable=False``: also those chosen only)."""
    return tuple(n for n, cls in _REGISTRY.items() if cls.requestable or not requestable)


def strategy_class(name: str) -> type[BranchStrategy]:
    """The class registered under ``name``.

    Raises:
        ValueError: no strategy of that name.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"strategy: expected one of {', '.join(strategy_names(requestable=False))}, "
                         f"got {name!r}")
    return cls


# ---------------------------------------------------------------- the base
class DeviceSelected(Protocol):
    """One selector kind's graph: every branch, one set of shared outputs."""

    outputs: Any

    def launch(self, selector: torch.Tensor, host_choice: Callable[[], int]) -> None:
        """Run the branch ``selector`` picks (``host_choice`` reads it on the host, where needed)."""

    def close(self) -> None: ...


class BranchStrategy:
    """How a device tensor selects a branch of a :class:`~.branches.BranchSet`.

    Subclasses set :attr:`name` and :attr:`summary` and override :meth:`select`
    (and :meth:`build` when they capture something per selector kind). The
    base class selects by per-branch dispatch and runs by index through the
    branches' own graphs.

    Args:
        branches: the captured branches (their graphs, static input, capturer).
        runtime: the graph's ``runtime=`` argument (a runtime binding or a kind; None: current).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    requestable: ClassVar[bool] = True  # ConditionalGraph(strategy=name) takes it ("eager" is only chosen)
    shares_outputs: ClassVar[bool] = False  # every branch writes one set of outputs: layouts must agree
    fallback: ClassVar[str | None] = None  # the strategy that takes over when build() fails

    def __init__(self, branches: BranchSet, *, runtime: Any = None) -> None:
        self.branches = branches
        self.runtime = runtime

    def build(self, kind: str) -> None:
        """Capture what selecting with ``kind`` needs (idempotent, cheap once built).

        Raises on failure (:class:`StrategyUnavailable` when these branches cannot be served);
        the graph then switches to :attr:`fallback`.
        """

    def select(self, kind: str, sel: torch.Tensor, input_tensor: Any) -> Any:
        """Run the branch ``sel`` picks on ``input_tensor`` (None: the static input as it is).

        The base class reads ``sel`` on the host (one sync) and runs that branch
        by index; an index out of range returns zeros.
        """
        choice = self.branches.choice(kind, sel)
        if choice == len(self.branches):
            return self.branches.zeros(input_tensor)
        return self.branches.run_index(choice, input_tensor)

    def run_index(self, idx: int, input_tensor: Any) -> Any:
        """Run branch ``idx``: its own graph (or eagerly when it has none)."""
        return self.branches.run_index(idx, input_tensor)

    @property
    def graphs(self) -> Mapping[str, DeviceSelected]:
        """The graphs captured per selector kind (none for per-branch strategies)."""
        return {}

    def describe(self) -> str:
        return f"{self.name}: {self.summary}"

    def close(self) -> None:
        """Release what :meth:`build` captured (idempotent; the caller waited for the device)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, kinds={sorted(self.graphs)})"


class _OneGraphStrategy(BranchStrategy):
    """A graph per selector kind holding every branch, writing the shared outputs; kinds without one
    (a bool selector over other than two branches) are dispatched."""

    shares_outputs = True
    fallback = "dispatch"

    def __init__(self, branches: BranchSet, *, runtime: Any = None) -> None:
        super().__init__(branches, runtime=runtime)
        self._graphs: dict[str, DeviceSelected] = {}

    @property
    def graphs(self) -> Mapping[str, DeviceSelected]:
        return self._graphs

    def build(self, kind: str) -> None:
        if kind in self._graphs or (kind == "bool" and len(self.branches) != 2):
            return
        bodies, outputs = self.branches.bodies(kind)
        with torch.cuda.device(self.branches.device):
            self._graphs[kind] = self._capture(kind, bodies, outputs)

    def _capture(self, kind: str, bodies: list[Callable[[], None]], outputs: Any) -> DeviceSelected:
        raise NotImplementedError

    def select(self, kind: str, sel: torch.Tensor, input_tensor: Any) -> Any:
        dg = self._graphs.get(kind)
        if dg is None:
            return super().select(kind, sel, input_tensor)
        branches = self.branches
        branches.stage_input(input_tensor)
        dg.launch(sel, functools.partial(branches.choice, kind, sel))
        return branches.finish_selected(dg.outputs, kind, sel)

    def close(self) -> None:
        for dg in self._graphs.values():
            quietly(dg.close)
        self._graphs.clear()


# Registration order is the order of the names in messages: native, supergraph, dispatch.
@register_strategy
class NativeStrategy(_OneGraphStrategy):
    """CUDA conditional nodes; see the module docstring and :class:`NativeSelect`."""

    name = "native"
    summary = "IF/ELSE and SWITCH nodes set from the selector on the device; no host read"

    def __init__(self, branches: BranchSet, *, runtime: Any = None) -> None:
        super().__init__(branches, runtime=runtime)
        self._bodies_on: torch.cuda.Stream | None = None

    def _body_stream(self) -> torch.cuda.Stream:
        """The stream bodies are captured on: distinct from the capture stream (made on first use)."""
        if self._bodies_on is None:
            self._bodies_on = side_stream(self.branches.device, avoid=[self.branches.capturer.stream])
        return self._bodies_on

    def _capture(self, kind: str, bodies: list[Callable[[], None]], outputs: Any) -> DeviceSelected:
        return NativeSelect.capture(kind, self.branches.capturer, self._body_stream(), bodies, outputs,
                                    self.branches.branch_runs())

    def close(self) -> None:
        if self._bodies_on is not None:  # a stream sync: a device-wide one would break other threads' captures
            quietly(self._bodies_on.synchronize)
        super().close()


@register_strategy
class SupergraphStrategy(_OneGraphStrategy):
    """Every branch in one graph, the others disabled; see the module docstring and :class:`SupergraphSelect`."""

    name = "supergraph"
    summary = "one graph of every branch, the unselected ones disabled after one host read"

    def _capture(self, kind: str, bodies: list[Callable[[], None]], outputs: Any) -> DeviceSelected:
        return SupergraphSelect.capture(self.branches.capturer, bodies, outputs, resolve_runtime(self.runtime))


@register_strategy
class DispatchStrategy(BranchStrategy):
    """One host read of the selector, then the chosen branch's own graph (the base class's select)."""

    name = "dispatch"
    summary = "one host read of the selector, then the chosen branch's own graph"


@register_strategy
class EagerStrategy(BranchStrategy):
    """No GPU graphs: the chosen branch runs eagerly (each branch holds its fallback)."""

    name = "eager"
    summary = "no GPU graphs; the chosen branch runs eagerly"
    requestable = False


# ------------------------------------------------------- per-kind graphs
class NativeSelect:
    """IF/ELSE (bool selector) or SWITCH (index selector) node; see the module docstring."""

    def __init__(self, graph: SafeCUDAGraph, outputs: Any, selector: torch.Tensor, pool: BodyPool) -> None:
        self.graph, self.outputs, self.selector, self.body_pool = graph, outputs, selector, pool

    @classmethod
    def capture(cls, kind: str, capturer: Capturer, body_stream: torch.cuda.Stream,
                bodies: Sequence[Callable[[], None]], outputs: Any,
                warm: Sequence[Callable[[], Any]]) -> NativeSelect:
        """Capture ``bodies`` (the last one is the out-of-range default for ``"index"``) through ``capturer``.

        ``warm``: the branches' runs, warmed up on ``body_stream`` (cuBLAS and friends keep
        per-stream state, and the bodies are captured there, not on the capturer's stream).

        Raises:
            Exception: the capture's own error (the graph then falls back to dispatch).
        """
        device = torch.cuda.current_device()
        selector = torch.zeros((), dtype=torch.bool if kind == "bool" else torch.int64, device=f"cuda:{device}")
        # Kept local: the bodies' allocations go to a pool of their own (a body is its own capture
        # sequence, outside the capturer's pool); it lives as long as the graph.
        pool = BodyPool(device)
        native = NativeConditional(device=device, body_stream=body_stream, pool=pool)

        def run() -> None:
            if kind == "bool":
                native.if_else(selector, bodies)
            else:
                native.switch(selector, bodies[:-1], default=bodies[-1])

        captured = capturer.capture(run, f"the {kind} selection (native)",
                                    warm=[on_stream(fn, body_stream) for fn in warm])
        if captured.graph is None:
            pool.close()
            raise captured.error if captured.error is not None else RuntimeError(str(captured.fallback))
        return cls(captured.graph, outputs, selector, pool)

    def launch(self, selector: torch.Tensor, host_choice: Callable[[], int]) -> None:
        self.selector.copy_(selector.reshape(()))  # device to device: no sync
        self.graph.replay()

    def close(self) -> None:
        self.graph.reset()
        self.body_pool.close()


class SupergraphSelect:
    """Every branch in one flat graph, the unselected ones disabled; see the module docstring."""

    def __init__(self, graph: SafeCUDAGraph, outputs: Any, runtime: Runtime, segments: list[list[int]]) -> None:
        self.graph, self.outputs, self._rt, self._segments = graph, outputs, runtime, segments
        self._exec = int(graph.raw_cuda_graph_exec())
        self._active = -1  # the enabled segment (-1: all enabled)
        # CUDA documents that a toggle leaves launches in flight alone; HIP's documentation does not
        # say so, so there a toggle first waits for the last launch (the table's toggle_in_flight).
        self._done = None if capabilities_of(runtime).toggle_in_flight else torch.cuda.Event()

    @classmethod
    def capture(cls, capturer: Capturer, bodies: Sequence[Callable[[], None]], outputs: Any,
                runtime: Runtime) -> SupergraphSelect:
        """Capture ``bodies`` one after the other into one graph, in ``capturer``'s pool and on its stream.

        Not through :meth:`Capturer.capture`: the node toggles need the captured graph's nodes,
        so the graph keeps them (``keep_graph=True``, instantiated here), which the capturer's
        graphs do not. A failed capture needs no retired pool: the conditional graph falls back to
        dispatch and captures nothing more. The branches were warmed up on this stream when their
        own graphs were captured.
        """
        rt, stream = runtime, capturer.stream
        rt.stream_capture_info(stream.cuda_stream)  # binds and initialises it outside the capture
        stream.synchronize()
        g = SafeCUDAGraph(keep_graph=True)
        groups: list[list[int]] = []
        with torch.no_grad(), g.capturing(pool=capturer.pool_handle, stream=stream,
                                          capture_error_mode=capturer.capture_error_mode, freeze_gc=True):
            graph = rt.stream_capture_info(stream.cuda_stream).graph
            seen = set(rt.graph_nodes(graph))
            for body in bodies:
                body()  # each segment's nodes are those that appear while it runs
                new = [n for n in rt.graph_nodes(graph) if n not in seen]
                seen.update(new)
                groups.append(new)
        if int(g.raw_cuda_graph()) != graph:
            raise StrategyUnavailable("the captured graph is not the one whose nodes were recorded")
        g.instantiate()
        toggled = capabilities_of(rt).toggle_node_types
        return cls(g, outputs, rt, [_toggled_nodes(rt, group, toggled) for group in groups])

    def launch(self, selector: torch.Tensor, host_choice: Callable[[], int]) -> None:
        choice = host_choice()
        if self._active != choice:
            if self._done is not None:
                self._done.synchronize()
            for j, nodes in enumerate(self._segments):
                if self._active == -1 or j in (self._active, choice):
                    for n in nodes:
                        self._rt.exec_node_set_enabled(self._exec, n, j == choice)
            self._active = choice
        self.graph.replay()
        if self._done is not None:
            self._done.record()

    def close(self) -> None:
        self.graph.reset()


def _toggled_nodes(rt: Runtime, nodes: list[int], toggled: tuple[int, ...]) -> list[int]:
    """The nodes of one branch that disabling must reach; refuses a branch holding a node type that
    GraphNodeSetEnabled cannot disable (``toggled``: kernel, memcpy and memset on CUDA and HIP alike)."""
    out = []
    for n in nodes:
        t = rt.node_type(n)
        if t in toggled:
            out.append(n)
        elif t != NODE_EMPTY:
            raise StrategyUnavailable(
                f"a branch produced a graph node of type {t}; {rt.prefix}GraphNodeSetEnabled can only "
                "disable kernel, memcpy and memset nodes")
    return out
