"""How a device tensor selects a branch: the strategies behind one interface.

Each strategy captures, for one selector kind (``"bool"`` or ``"index"``),
one graph that holds every branch writing into one set of shared outputs,
and :meth:`DeviceSelected.launch` runs the selected branch of it:

* :class:`NativeSelect` (CUDA >= 12.8): an IF/ELSE or SWITCH node whose value
  a one-thread kernel sets from the selector at replay. No host read, no sync.
* :class:`SupergraphSelect` (the HIP emulation, forcible on CUDA): one flat
  graph holding every branch; after one host read of the selector, the nodes
  of the other branches are disabled (``GraphNodeSetEnabled``, only when the
  choice changes) and the graph is launched. Which node types may be disabled,
  and whether a toggle must wait for the launch in flight, are the capability
  table's answers (:mod:`hipgraph_bridge.runtime.capabilities`).

The third strategy, per-branch dispatch (one host read, then the chosen
branch's own graph), needs no graph of its own: it is
:class:`~hipgraph_bridge.ConditionalGraph`'s run by index.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._torch_compat import pytree
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import warm_up
from ..log import log_once
from ..runtime import NODE_EMPTY, Runtime, capabilities_of
from .native_nodes import BodyPool, NativeConditional

__all__ = ["CaptureSite", "DeviceSelected", "NativeSelect", "SupergraphSelect", "StrategyUnavailable",
           "output_layout", "zeros_like_layout", "describe_layout", "zero_tree", "selector_kind", "host_choice"]


def output_layout(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """Structure plus, per leaf, (shape, dtype, device) for tensors or the value itself."""
    leaves, spec = pytree.tree_flatten(tree)
    return spec, tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else ("value", x)
                       for x in leaves)


def zeros_like_layout(layout: tuple[Any, tuple[Any, ...]]) -> Any:
    """New zero tensors (and the same values) in an :func:`output_layout`."""
    spec, metas = layout
    leaves = [m[1] if m[0] == "value" else torch.zeros(m[0], dtype=m[1], device=m[2]) for m in metas]
    return pytree.tree_unflatten(leaves, spec)


def describe_layout(layout: Any) -> str:
    if layout is None:
        return "unknown (the branch failed)"
    return "(" + ", ".join(f"{m[1]}{list(m[0])}" if m[0] != "value" else repr(m[1]) for m in layout[1]) + ")"


def zero_tree(tree: Any) -> None:
    """Zero every tensor of ``tree`` in place (the out-of-range default branch)."""
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            leaf.zero_()


def selector_kind(sel: torch.Tensor, n_branches: int) -> str:
    """``"bool"`` or ``"index"``: what a one-element selector tensor chooses with."""
    if sel.numel() != 1:
        raise ValueError(f"selector: expected a one-element tensor, got shape {tuple(sel.shape)}")
    if sel.dtype == torch.bool:
        if n_branches != 2:
            raise ValueError(f"a bool selector needs exactly 2 branches (true: branch 0, false: branch 1), "
                             f"got {n_branches}; pass an integer index tensor instead")
        return "bool"
    if sel.dtype.is_floating_point or sel.dtype.is_complex:
        raise TypeError(f"selector: expected a bool or integer tensor, got {sel.dtype}")
    return "index"


def host_choice(kind: str, sel: torch.Tensor, n_branches: int, owner: object) -> int:
    """The branch a selector picks, read on the host (one sync on a GPU); ``n_branches``: none (out of range)."""
    value = sel.reshape(()).item()
    if kind == "bool":
        return 0 if value else 1
    if not 0 <= value < n_branches:
        log_once(("conditional", "out_of_range", id(owner)), logging.WARNING,
                 "gfxgraph: selector index %s is outside [0, %d): no branch runs, the outputs are zeros",
                 value, n_branches)
        return n_branches
    return int(value)


class StrategyUnavailable(RuntimeError):
    """A device strategy cannot serve these branches; the graph falls back to dispatch."""


@dataclass
class CaptureSite:
    """Where a conditional graph captures: its device, streams, pool and capture mode."""

    device: int
    stream: torch.cuda.Stream
    body_stream: torch.cuda.Stream  # native bodies; distinct from ``stream``
    pool: Any
    capture_error_mode: str


class DeviceSelected(Protocol):
    """One selector kind's graph: every branch, one set of shared outputs."""

    outputs: Any

    def launch(self, selector: torch.Tensor, host_choice: Callable[[], int]) -> None:
        """Run the branch ``selector`` picks (``host_choice`` reads it on the host, where needed)."""

    def close(self) -> None: ...


class NativeSelect:
    """IF/ELSE (bool selector) or SWITCH (index selector) node; see the module docstring."""

    def __init__(self, graph: SafeCUDAGraph, outputs: Any, selector: torch.Tensor, pool: BodyPool) -> None:
        self.graph, self.outputs, self.selector, self.body_pool = graph, outputs, selector, pool

    @classmethod
    def capture(cls, kind: str, site: CaptureSite, bodies: Sequence[Callable[[], None]], outputs: Any,
                warm: Sequence[Callable[[], Any]]) -> NativeSelect:
        """Capture ``bodies`` (the last one is the out-of-range default for ``"index"``)."""
        selector = torch.zeros((), dtype=torch.bool if kind == "bool" else torch.int64,
                               device=f"cuda:{site.device}")
        pool = BodyPool(site.device)
        native = NativeConditional(device=site.device, body_stream=site.body_stream, pool=pool)
        with torch.no_grad():
            for fn in warm:  # cuBLAS and friends keep per-stream state: set it up outside the capture
                warm_up(fn, site.body_stream, 1)
        g = SafeCUDAGraph()
        with torch.no_grad(), g.capturing(pool=site.pool, stream=site.stream,
                                          capture_error_mode=site.capture_error_mode):
            if kind == "bool":
                native.if_else(selector, bodies)
            else:
                native.switch(selector, bodies[:-1], default=bodies[-1])
        return cls(g, outputs, selector, pool)

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
    def capture(cls, site: CaptureSite, bodies: Sequence[Callable[[], None]], outputs: Any,
                runtime: Runtime) -> SupergraphSelect:
        rt = runtime
        rt.stream_capture_info(site.stream.cuda_stream)  # binds and initialises it outside the capture
        site.stream.synchronize()
        g = SafeCUDAGraph(keep_graph=True)
        groups: list[list[int]] = []
        with torch.no_grad(), g.capturing(pool=site.pool, stream=site.stream,
                                          capture_error_mode=site.capture_error_mode):
            graph = rt.stream_capture_info(site.stream.cuda_stream).graph
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
