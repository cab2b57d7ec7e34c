"""The branches of a conditional graph: their per-branch graphs, the static input, runs by index.

:class:`BranchSet` is what every selection strategy (:mod:`.strategies`)
works on. It owns

1. the branches (a name and a callable each) and the one static input all
   their graphs read;
2. one graph per branch, captured through the family's
   :class:`~hipgraph_bridge.graph.capturer.Capturer` (one pool, one side
   stream, warm-up, the failure path); a branch whose warm-up or capture
   fails keeps its :class:`~hipgraph_bridge.fallbacks.Fallback` and runs eagerly;
3. a run by index: stage the input, replay the branch's graph, copy the outputs;
4. what device-selected graphs need from the branches: their common output
   layout and one body per branch writing into one set of shared outputs.

Costs of :meth:`BranchSet.run_index`: one input copy per tensor, one replay,
one output copy per tensor (none with ``copy_outputs=False``).
What it will not do: choose a branch (a strategy does) or lock (the graph does).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import config, stats
from .._torch_compat import pytree
from ..fallbacks import Fallback, Reason
from ..graph.bridged import SafeCUDAGraph
from ..graph.capturer import Capturer
from ..log import log_once, logger
from ..tree import check_same_layout, clone_tree, copy_into
from ..validation import checked_against_eager

__all__ = ["Branch", "BranchSet", "StrategyUnavailable", "output_layout", "zeros_like_layout", "describe_layout",
           "zero_tree", "selector_kind", "host_choice"]


class StrategyUnavailable(RuntimeError):
    """A device strategy cannot serve these branches; the graph falls back to dispatch."""


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


@dataclass
class Branch:
    name: str
    fn: Callable[..., Any]
    graph: SafeCUDAGraph | None = None  # its own graph, once captured
    outputs: Any = None  # static outputs of that graph
    layout: Any = None  # output_layout() of its outputs (None when unknown)
    fallback: Fallback | None = None  # why it runs eagerly (None: it has a graph, or was never captured)


class BranchSet:
    """The branches of one conditional graph and their per-branch graphs (see the module docstring).

    Args:
        capturer: the family's capturer (its pool, side stream and warm-up runs).
        copy_outputs: :meth:`finish` returns copies of static outputs (else the buffers).
    """

    def __init__(self, capturer: Capturer, *, copy_outputs: bool = True) -> None:
        self.capturer = capturer
        self.copy_outputs = copy_outputs
        self.items: list[Branch] = []
        self.index: dict[str, int] = {}
        self.static_input: Any = None
        self.device: int | None = None  # the CUDA device of the graphs (None: not captured on a GPU)
        self.uniform: Any = None  # the branches' common output layout, when they share one
        self._shared_outputs: Any = None

    def __len__(self) -> int:
        return len(self.items)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.items]

    def add(self, name: str, fn: Callable[..., Any]) -> None:
        self.index[name] = len(self.items)
        self.items.append(Branch(name, fn))

    # ---------------------------------------------------------------- capture
    def capture(self, example_input: Any, device: int) -> None:
        """Clone ``example_input`` into the static input and capture every branch (under ``device``)."""
        self.device = device
        with torch.no_grad():
            self.static_input = clone_tree(example_input)
        for b in self.items:
            self._capture_branch(b)
        self._find_uniform()

    def _capture_branch(self, b: Branch) -> None:
        x = self.static_input

        def run() -> Any:
            return b.fn(x)

        def warm() -> Any:  # a warm-up keeps only the layout of its outputs (it answers no call)
            return output_layout(b.fn(x))

        what = f"branch {b.name!r}"
        captured = self.capturer.capture(run, what, warm=[warm] * self.capturer.warmup_iters, keep_warm=True)
        if captured.warm is not None:
            b.layout = captured.warm
        if captured.outputs is not None:
            b.layout = output_layout(captured.outputs)
        if captured.graph is None:
            b.fallback = captured.fallback or Fallback(Reason.EAGER, what)
            if captured.stage == "warm_up":  # the capturer leaves the notice to the caller
                logger.warning("gfxgraph: %s runs eagerly: warm-up raised %s", what, captured.error)
            return
        b.graph, b.outputs = captured.graph, captured.outputs

    def run_once_eagerly(self, example_input: Any, fallback: Fallback) -> None:
        """Without graphs: clone the example, run each branch on it once (its layout), mark it eager."""
        with torch.no_grad():
            self.static_input = clone_tree(example_input)
            for b in self.items:
                b.fallback = fallback
                try:
                    b.layout = output_layout(b.fn(self.static_input))
                except Exception as exc:  # it raises again, for the caller, when it is run
                    logger.warning("gfxgraph: branch %r raised on the example input: %s", b.name, exc)
        self._find_uniform()

    def _find_uniform(self) -> None:
        layouts = [b.layout for b in self.items]
        self.uniform = layouts[0] if all(lay is not None and lay == layouts[0] for lay in layouts) else None

    def layouts_differ(self) -> str:
        described = ", ".join(f"{b.name!r}: {describe_layout(b.layout)}" for b in self.items)
        return ("device-selected graphs write every branch into one set of outputs, so the branches must "
                f"return the same structure, shapes and dtypes; got {described}")

    # ------------------------------------------------------- device selection
    def branch_runs(self) -> list[Callable[[], Any]]:
        """Each branch on the static input (the warm-up runs of a graph that holds them all)."""
        x = self.static_input
        return [functools.partial(b.fn, x) for b in self.items]

    def bodies(self, kind: str) -> tuple[list[Callable[[], None]], Any]:
        """One body per branch writing into the shared outputs (plus the zero default for ``"index"``).

        Raises:
            StrategyUnavailable: the branches do not share one output layout.
        """
        if self.uniform is None:
            raise StrategyUnavailable(self.layouts_differ())
        if self._shared_outputs is None:
            self._shared_outputs = zeros_like_layout(self.uniform)
        outputs, x = self._shared_outputs, self.static_input
        bodies = [functools.partial(_write_into, b.fn, x, outputs) for b in self.items]
        if kind == "index":
            bodies.append(functools.partial(zero_tree, outputs))  # index out of range
        return bodies, outputs

    def choice(self, kind: str, sel: torch.Tensor) -> int:
        """:func:`host_choice` for these branches (``len(self)``: out of range)."""
        return host_choice(kind, sel, len(self.items), self)

    # -------------------------------------------------------------------- run
    def stage_input(self, input_tensor: Any) -> None:
        """Copy ``input_tensor`` into the static input (None: leave it as it is)."""
        if input_tensor is not None:
            check_same_layout("input_tensor", self.static_input, input_tensor)
            copy_into(self.static_input, input_tensor)

    def run_index(self, idx: int, input_tensor: Any) -> Any:
        """Run branch ``idx``: its graph (staged input, replay, outputs) or eagerly when it has none."""
        b = self.items[idx]
        if b.graph is None:
            return self._eager(b, input_tensor)
        self.stage_input(input_tensor)
        b.graph.replay()
        return self.finish(b.outputs, idx)

    def finish(self, static_outputs: Any, idx: int) -> Any:
        """The outputs of branch ``idx``'s replay: copied unless ``copy_outputs=False``; compared with
        the branch run eagerly when validation is on."""
        out = clone_tree(static_outputs) if self.copy_outputs else static_outputs
        if not config.switches.validate:
            return out
        return self._validated(out, idx)

    def finish_selected(self, static_outputs: Any, kind: str, sel: torch.Tensor) -> Any:
        """:meth:`finish` for a device-selected replay: the selector is read on the host only when
        validation is on (an out-of-range index, whose outputs are zeros, is not compared)."""
        out = clone_tree(static_outputs) if self.copy_outputs else static_outputs
        if not config.switches.validate:
            return out
        idx = self.choice(kind, sel)
        return self._validated(out, idx) if idx < len(self.items) else out

    def _validated(self, out: Any, idx: int) -> Any:
        with torch.no_grad():
            eager_out = self.items[idx].fn(self.static_input)
        return checked_against_eager(out, eager_out, owner=self, what="conditional")

    def _eager(self, b: Branch, input_tensor: Any) -> Any:
        if input_tensor is not None:
            check_same_layout("input_tensor", self.static_input, input_tensor)
        stats.record_fallback(b.fallback or Fallback(Reason.EAGER))
        x = self.static_input if input_tensor is None else input_tensor
        with torch.no_grad():
            return b.fn(x)

    def zeros(self, input_tensor: Any) -> Any:
        """The outputs of an out-of-range index: zeros in the common layout."""
        if input_tensor is not None:
            check_same_layout("input_tensor", self.static_input, input_tensor)
        if self.uniform is None:
            raise IndexError("the selector index is out of range and the branches return different "
                             "layouts, so there is no zero output to return")
        return zeros_like_layout(self.uniform)

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release every branch graph and buffer (the caller waited for the device)."""
        for b in self.items:
            if b.graph is not None:
                quietly(b.graph.reset)
            b.graph = b.outputs = None
        self.static_input = self._shared_outputs = None


def _write_into(fn: Callable[..., Any], x: Any, outputs: Any) -> None:
    copy_into(outputs, fn(x))


def quietly(release: Callable[[], None]) -> None:
    """Run a release step; log, never raise, when it fails (close() must not raise)."""
    try:
        release()
    except Exception as exc:
        logger.debug("gfxgraph: releasing a conditional graph failed: %s", exc)
