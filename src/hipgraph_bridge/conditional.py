"""ConditionalGraph: branches chosen by name or by a device tensor (gap 51).

Workflow::

    cg = ConditionalGraph()
    cg.add_branch("small", small_model)
    cg.add_branch("large", large_model)
    cg.capture(x)                 # one graph per branch: one pool, one static input
    y = cg.run("large", x)        # by name (or index): replay that branch's graph
    y = cg.run(pred, x)           # by a device tensor, decided without a host sync on CUDA

1. :meth:`add_branch` registers callables ``fn(input) -> outputs``.
2. :meth:`capture` warms every branch up and captures it into its own graph;
   all graphs share one memory pool and one static input. A branch whose
   warm-up or capture fails runs eagerly from then on (counted, logged once).
3. :meth:`run` with a ``str`` name or an ``int`` index copies the input into
   the static input, replays that branch's graph and returns its outputs
   (copied unless ``copy_outputs=False``).
4. :meth:`run` with a one-element tensor selects on the device: a ``bool``
   tensor picks branch 0 when true and branch 1 when false (exactly two
   branches, like ``torch.cond``); an integer tensor is a branch index, and an
   index outside ``[0, n)`` runs no branch and returns zeros. How the choice
   is made is the *strategy* (:attr:`ConditionalGraph.strategy`):

   * ``"native"`` (CUDA >= 12.8): one graph holding an IF/ELSE or SWITCH node
     whose value a one-thread kernel sets from the tensor at replay. No host
     read, no sync. Every branch writes into one set of shared outputs, so all
     branches must return the same structure, shapes and dtypes.
   * ``"supergraph"`` (the HIP emulation, forcible on CUDA): one flat graph
     holding every branch; after one host read of the selector, the nodes of
     the other branches are disabled (``GraphNodeSetEnabled``, only when the
     choice changes) and the graph is launched. Same output rule as native.
   * ``"dispatch"`` (HIP default, forcible on CUDA): one host read of the
     selector, then the chosen branch's own graph is replayed.
   * ``"eager"``: no GPU graphs (CPU-only PyTorch, reason ``no_gpu``).

   ``strategy="auto"`` picks native when the driver and binding support it
   (one cached probe, :func:`~hipgraph_bridge.cond_nodes.conditional_support`),
   else dispatch; the choice is logged at debug. The device-selected graph of a
   selector kind (bool or index) is captured on first use, or up front with
   ``capture(x, selectors=("bool", "index"))``.

Costs per :meth:`run`: one input copy, one graph launch, one output copy per
tensor; native adds a selector copy (device to device) and nothing on the
host. Model calls run under ``torch.no_grad()``: this is for inference.

What it will not do: run from several threads at once (calls are serialised by
a lock: one static input), accept inputs whose layout differs from the
example, or capture random-number ops inside native branches (see
:mod:`.cond_nodes`).
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from . import settings as _settings
from . import stats as _stats
from .capture_state import frozen_gc
from .log import log_once, logger
from .platform import probe
from .runtime._base import NODE_EMPTY, NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET
from .tree_utils import check_same_layout, clone_tree, copy_into, describe
from .validation import checked_against_eager

__all__ = ["ConditionalGraph", "ConditionalSession", "ConditionalState", "Strategy", "STRATEGIES",
           "SelectorKind", "resolve_strategy"]

Strategy = Literal["auto", "native", "supergraph", "dispatch"]
STRATEGIES: tuple[str, ...] = ("auto", "native", "supergraph", "dispatch")
SelectorKind = Literal["bool", "index"]
_KINDS = ("bool", "index")
_TOGGLED = (NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET)


class ConditionalState(enum.Enum):
    BUILDING = "building"  # add_branch(); capture() next
    CAPTURED = "captured"  # run() works
    CLOSED = "closed"


def resolve_strategy(requested: str) -> tuple[str, str]:
    """The strategy device-selected runs use, and why (logged at debug).

    Raises:
        ValueError: ``requested`` is not one of :data:`STRATEGIES`.
        RuntimeError: ``"native"`` was forced where conditional nodes are unsupported.
    """
    from .cond_nodes import choose_strategy

    return choose_strategy(requested, STRATEGIES, native_supported=lambda s: s.branches,
                           nodes="conditional nodes", supported_nodes="IF/ELSE and SWITCH nodes",
                           fallback="dispatch",
                           fallback_what="per-branch dispatch")


def _layout(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    """Structure plus, per leaf, (shape, dtype, device) for tensors or the value itself."""
    leaves, spec = pytree.tree_flatten(tree)
    return spec, tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else ("value", x)
                       for x in leaves)


def _materialise(layout: tuple[Any, tuple[Any, ...]], *, zeros: bool) -> Any:
    spec, metas = layout
    leaves = []
    for m in metas:
        if m[0] == "value":
            leaves.append(m[1])
        else:
            make = torch.zeros if zeros else torch.empty
            leaves.append(make(m[0], dtype=m[1], device=m[2]))
    return pytree.tree_unflatten(leaves, spec)


def _zero_tree(tree: Any) -> None:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            leaf.zero_()


@dataclass
class _Branch:
    name: str
    fn: Callable[..., Any]
    graph: Any = None  # BridgedCUDAGraph once captured
    outputs: Any = None  # static outputs of that graph
    layout: Any = None  # _layout() of its outputs (None when unknown)
    reason: str = ""  # fallback reason key while it runs eagerly
    failed: str | None = None  # why it runs eagerly


@dataclass
class _DeviceGraph:
    """The graph of one selector kind for the native or supergraph strategy."""

    kind: str
    strategy: str
    graph: Any  # BridgedCUDAGraph
    outputs: Any  # shared static outputs
    selector: torch.Tensor | None = None  # native: the static selector read by the setter kernel
    pool: Any = None  # native: BodyPool of the bodies' allocations
    segments: list[list[int]] = field(default_factory=list)  # supergraph: nodes to toggle per segment
    exec_handle: int = 0
    active: int = -1  # supergraph: the enabled segment (-1: all enabled)
    done: Any = None  # supergraph on HIP: event after the last launch


class _StrategyUnavailable(RuntimeError):
    """A device strategy cannot serve these branches; the graph falls back to dispatch."""


class ConditionalGraph:
    """Branches captured as graphs in one pool, chosen by name, index or device tensor.

    See the module docstring for the workflow and the strategies.

    Args:
        strategy: ``"auto"`` (default), ``"native"``, ``"supergraph"`` or
            ``"dispatch"``: how a device tensor selects the branch.
        copy_outputs: return copies (default); ``False`` returns the static
            outputs, overwritten by the next run.
        warmup_iters: eager runs of each branch on the capture stream before capture.
        pool: a memory-pool handle to share (default: a new one).
        runtime: the runtime binding for the supergraph strategy's node calls
            (None: current; ``"ctypes"`` runs the HIP code path on CUDA).
        capture_error_mode: passed to ``capture_begin``.
    """

    def __init__(self, *, strategy: Strategy = "auto", copy_outputs: bool = True, warmup_iters: int = 1,
                 pool: Any = None, runtime: Any = None, capture_error_mode: str = "global") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
            raise ValueError(f"warmup_iters: expected an int >= 0, got {warmup_iters!r}")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError("capture_error_mode: expected one of global, thread_local, relaxed, "
                             f"got {capture_error_mode!r}")
        self.requested_strategy: str = strategy
        self.copy_outputs = bool(copy_outputs)
        self.warmup_iters = warmup_iters
        self.capture_error_mode = capture_error_mode
        self._pool_arg = pool
        self._runtime_arg = runtime
        self._state = ConditionalState.BUILDING
        self._branches: list[_Branch] = []
        self._index: dict[str, int] = {}
        self._strategy = "pending"
        self._strategy_reason = ""
        self._static_input: Any = None
        self._device = -1
        self._pool_handle: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._body_stream: torch.cuda.Stream | None = None
        self._shared_outputs: Any = None
        self._device_graphs: dict[str, _DeviceGraph] = {}
        self._uniform: Any = None  # the branches' common output layout, when they share one
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> ConditionalState:
        return self._state

    @property
    def branches(self) -> list[str]:
        """Branch names in the order they were added (their indices)."""
        return [b.name for b in self._branches]

    @property
    def strategy(self) -> str:
        """How device tensors select branches: ``native``, ``supergraph``, ``dispatch``,
        ``eager`` (no GPU), or ``pending`` before :meth:`capture`."""
        return self._strategy

    @property
    def strategy_reason(self) -> str:
        """Why :attr:`strategy` was chosen (or fell back)."""
        return self._strategy_reason

    @property
    def failed_branches(self) -> dict[str, str]:
        """Branches that run eagerly, with the reason."""
        return {b.name: f"{b.reason}: {b.failed}" for b in self._branches if b.failed is not None}

    @property
    def static_input(self) -> Any:
        """The input every graph reads (write into it and call ``run(branch)`` to skip the copy)."""
        return self._static_input

    def _require(self, state: ConditionalState, what: str) -> None:
        if self._state is state:
            return
        fixes = {ConditionalState.BUILDING: "branches can only be added before capture(); create a new "
                                            "ConditionalGraph to change them",
                 ConditionalState.CAPTURED: "call capture(example_input) first",
                 ConditionalState.CLOSED: "this ConditionalGraph was closed; create a new one"}
        fix = fixes[ConditionalState.CLOSED if self._state is ConditionalState.CLOSED else state]
        raise RuntimeError(f"ConditionalGraph.{what}() needs state {state.value!r}, but it is "
                           f"{self._state.value!r}: {fix}")

    # --------------------------------------------------------------- building
    def add_branch(self, name: str, fn: Callable[..., Any]) -> None:
        """Register branch ``name`` (its index is the number of branches before it)."""
        self._require(ConditionalState.BUILDING, "add_branch")
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        if not name:
            raise ValueError("name: expected a non-empty str, got ''")
        if name in self._index:
            raise ValueError(f"a branch named {name!r} already exists; expected a new name")
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        self._index[name] = len(self._branches)
        self._branches.append(_Branch(name, fn))

    # ---------------------------------------------------------------- capture
    def capture(self, example_input: Any, *, selectors: Iterable[SelectorKind] = ()) -> None:
        """Warm up and capture every branch on ``example_input`` (a tensor or pytree of tensors).

        ``selectors`` names the selector kinds (``"bool"``, ``"index"``) whose
        device-selected graph to capture now rather than at first use.
        Without a GPU nothing is captured: each branch runs once eagerly to
        check it, and later runs are eager (reason ``no_gpu``).

        Raises:
            TypeError/ValueError: no branches, a bad example or selector kind.
            RuntimeError: ``strategy="native"`` forced where it is unsupported.
        """
        self._require(ConditionalState.BUILDING, "capture")
        if not self._branches:
            raise ValueError("capture(): expected at least one branch; call add_branch() first")
        leaves = pytree.tree_leaves(example_input)
        if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError(f"example_input: expected a tensor or a pytree of tensors, got "
                            f"{describe(example_input)}")
        kinds = list(selectors)
        for k in kinds:
            if k not in _KINDS:
                raise ValueError(f"selectors: expected 'bool' and/or 'index', got {k!r}")
        plat = probe()
        if not plat.graphs_available:
            self._capture_eagerly(example_input, plat.reason or "no GPU")
            return
        devices = {x.device for x in leaves}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"example_input: expected tensors on one CUDA device, got {sorted(map(str, devices))}")
        self._strategy, self._strategy_reason = resolve_strategy(self.requested_strategy)
        self._device = next(iter(devices)).index
        with torch.cuda.device(self._device):
            self._capture_branches(example_input)
            self._state = ConditionalState.CAPTURED
            self._check_uniform()
            logger.debug("gfxgraph: ConditionalGraph %s: strategy %s (%s)", self.branches, self._strategy,
                         self._strategy_reason)
            for kind in kinds:
                self._device_graph(kind)

    def _capture_eagerly(self, example_input: Any, reason: str) -> None:
        self._strategy, self._strategy_reason = "eager", reason
        with torch.no_grad():
            self._static_input = clone_tree(example_input)
            for b in self._branches:
                b.reason, b.failed = "no_gpu", reason
                try:
                    b.layout = _layout(b.fn(self._static_input))
                except Exception as exc:  # it raises again, for the caller, when it is run
                    logger.warning("gfxgraph: branch %r raised on the example input: %s", b.name, exc)
        self._state = ConditionalState.CAPTURED
        self._check_uniform()

    def _capture_branches(self, example_input: Any) -> None:
        with torch.no_grad():
            self._static_input = clone_tree(example_input)
        self._pool_handle = self._pool_arg if self._pool_arg is not None else torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=self._device)
        with frozen_gc():
            for b in self._branches:
                self._capture_branch(b)

    def _warm_up(self, fn: Callable[..., Any], stream: torch.cuda.Stream, iters: int) -> Any:
        out = None
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(iters):
                out = fn(self._static_input)
        torch.cuda.current_stream(self._device).wait_stream(stream)
        return out

    def _capture_branch(self, b: _Branch) -> None:
        from .graph_manager import BridgedCUDAGraph

        stream = self._stream
        assert stream is not None  # set by _capture_branches
        try:
            out = self._warm_up(b.fn, stream, self.warmup_iters)
            if out is not None:
                b.layout = _layout(out)
            del out
            torch.cuda.synchronize(self._device)
        except Exception as exc:
            b.reason, b.failed = "warmup_failed", f"branch {b.name!r}: {type(exc).__name__}: {exc}"
            logger.warning("gfxgraph: branch %r runs eagerly: warm-up raised %s", b.name, exc)
            return
        g = BridgedCUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.stream(stream):
                g.capture_begin(pool=self._pool_handle, capture_error_mode=self.capture_error_mode)
                try:
                    out = b.fn(self._static_input)
                except BaseException as exc:
                    g._discard(f"branch {b.name!r} raised {type(exc).__name__}: {exc}", capture_ended=False)
                    raise
                g.capture_end()
            torch.cuda.current_stream(self._device).wait_stream(stream)
        except Exception as exc:
            b.reason, b.failed = "capture_failed", f"branch {b.name!r}: {type(exc).__name__}: {exc}"
            logger.warning("gfxgraph: branch %r runs eagerly from now on: capture failed: %s", b.name, exc)
            self._retire_pool()
            return
        b.graph, b.outputs, b.layout = g, out, _layout(out)

    def _retire_pool(self) -> None:
        """After a failed capture PyTorch's allocator may keep recording to its pool: later
        captures go to a fresh one (unless the caller gave the pool, then it is theirs)."""
        if self._pool_arg is None:
            self._pool_handle = torch.cuda.graph_pool_handle()

    def _check_uniform(self) -> None:
        layouts = [b.layout for b in self._branches]
        self._uniform = layouts[0] if all(lay is not None and lay == layouts[0] for lay in layouts) else None

    def _uniform_or_raise(self) -> Any:
        if self._uniform is not None:
            return self._uniform
        described = ", ".join(f"{b.name!r}: {self._describe_layout(b.layout)}" for b in self._branches)
        raise _StrategyUnavailable(
            "device-selected graphs write every branch into one set of outputs, so the branches must "
            f"return the same structure, shapes and dtypes; got {described}")

    @staticmethod
    def _describe_layout(layout: Any) -> str:
        if layout is None:
            return "unknown (the branch failed)"
        return "(" + ", ".join(f"{m[1]}{list(m[0])}" if m[0] != "value" else repr(m[1]) for m in layout[1]) + ")"

    # ------------------------------------------------- device-selected graphs
    def _device_graph(self, kind: str) -> _DeviceGraph | None:
        """The native/supergraph graph for ``kind``, captured on first use (None: dispatch)."""
        found = self._device_graphs.get(kind)
        if found is not None or self._strategy not in ("native", "supergraph"):
            return found
        if kind == "bool" and len(self._branches) != 2:
            return None
        try:
            self._uniform_or_raise()
            with torch.cuda.device(self._device), frozen_gc():
                dg = self._capture_native(kind) if self._strategy == "native" else self._capture_supergraph(kind)
        except Exception as exc:
            self._retire_pool()
            forced = self.requested_strategy == self._strategy
            if forced and isinstance(exc, _StrategyUnavailable):
                raise ValueError(f"strategy={self._strategy!r}: {exc}") from exc
            why = f"{self._strategy} capture failed: {type(exc).__name__}: {exc}"
            logger.warning("gfxgraph: ConditionalGraph falls back to per-branch dispatch: %s", why)
            self._strategy, self._strategy_reason = "dispatch", why
            return None
        self._device_graphs[kind] = dg
        return dg

    def _outputs_buffer(self) -> Any:
        if self._shared_outputs is None:
            self._shared_outputs = _materialise(self._uniform, zeros=True)
        return self._shared_outputs

    def _into(self, fn: Callable[..., Any], outputs: Any) -> None:
        copy_into(outputs, fn(self._static_input))

    def _segments(self, kind: str, outputs: Any) -> list[Callable[[], None]]:
        bodies = [functools.partial(self._into, b.fn, outputs) for b in self._branches]
        if kind == "index":
            bodies.append(functools.partial(_zero_tree, outputs))  # index out of range
        return bodies

    def _capture_native(self, kind: str) -> _DeviceGraph:
        from .cond_nodes import BodyPool, NativeConditional, side_stream
        from .graph_manager import BridgedCUDAGraph

        assert self._stream is not None
        outputs = self._outputs_buffer()
        selector = torch.zeros((), dtype=torch.bool if kind == "bool" else torch.int64,
                               device=f"cuda:{self._device}")
        if self._body_stream is None:
            self._body_stream = side_stream(self._device, avoid=[self._stream])
        pool = BodyPool(self._device)
        native = NativeConditional(device=self._device, body_stream=self._body_stream, pool=pool)
        for b in self._branches:  # cuBLAS and friends keep per-stream state: set it up outside capture
            self._warm_up(b.fn, self._body_stream, 1)
        torch.cuda.synchronize(self._device)
        bodies = self._segments(kind, outputs)
        g = BridgedCUDAGraph()
        with torch.no_grad(), torch.cuda.stream(self._stream):
            g.capture_begin(pool=self._pool_handle, capture_error_mode=self.capture_error_mode)
            try:
                if kind == "bool":
                    native.if_else(selector, bodies)
                else:
                    native.switch(selector, bodies[:-1], default=bodies[-1])
            except BaseException as exc:
                g._discard(f"native {kind} capture raised {type(exc).__name__}: {exc}", capture_ended=False)
                raise
            g.capture_end()
        torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return _DeviceGraph(kind, "native", g, outputs, selector=selector, pool=pool)

    def _runtime(self) -> Any:
        from .runtime import resolve_runtime

        return resolve_runtime(self._runtime_arg)

    def _capture_supergraph(self, kind: str) -> _DeviceGraph:
        from .graph_manager import BridgedCUDAGraph

        assert self._stream is not None
        rt = self._runtime()
        outputs = self._outputs_buffer()
        rt.stream_capture_info(self._stream.cuda_stream)  # binds and initialises it outside the capture
        torch.cuda.synchronize(self._device)
        g = BridgedCUDAGraph(keep_graph=True)
        groups: list[list[int]] = []
        with torch.no_grad(), torch.cuda.stream(self._stream):
            g.capture_begin(pool=self._pool_handle, capture_error_mode=self.capture_error_mode)
            try:
                graph = rt.stream_capture_info(self._stream.cuda_stream).graph
                seen = set(rt.graph_nodes(graph))
                for segment in self._segments(kind, outputs):
                    segment()  # each segment's nodes are those that appear while it runs
                    new = [n for n in rt.graph_nodes(graph) if n not in seen]
                    seen.update(new)
                    groups.append(new)
            except BaseException as exc:
                g._discard(f"supergraph capture raised {type(exc).__name__}: {exc}", capture_ended=False)
                raise
            g.capture_end()
        torch.cuda.current_stream(self._device).wait_stream(self._stream)
        if int(g.raw_cuda_graph()) != graph:
            raise _StrategyUnavailable("the captured graph is not the one whose nodes were recorded")
        g.instantiate()
        segments = [self._toggled_nodes(rt, group) for group in groups]
        dg = _DeviceGraph(kind, "supergraph", g, outputs, segments=segments,
                          exec_handle=int(g.raw_cuda_graph_exec()))
        if rt.name == "hip":
            dg.done = torch.cuda.Event()
        return dg

    @staticmethod
    def _toggled_nodes(rt: Any, nodes: list[int]) -> list[int]:
        out = []
        for n in nodes:
            t = rt.node_type(n)
            if t in _TOGGLED:
                out.append(n)
            elif t != NODE_EMPTY:
                raise _StrategyUnavailable(
                    f"a branch produced a graph node of type {t}; {rt.prefix}GraphNodeSetEnabled can only "
                    "disable kernel, memcpy and memset nodes")
        return out

    # -------------------------------------------------------------------- run
    def run(self, branch: str | int | torch.Tensor, input_tensor: Any = None) -> Any:
        """Run one branch on ``input_tensor`` (None: on the static input as it is).

        ``branch``: a name, an index, or a one-element tensor (bool: branch 0
        if true else branch 1; integer: index, out of range gives zeros).

        Raises:
            KeyError/IndexError: an unknown branch name or index.
            TypeError/ValueError: a bad selector, or an input unlike the example.
        """
        with self._lock:
            self._require(ConditionalState.CAPTURED, "run")
            if isinstance(branch, torch.Tensor):
                kind = self._selector_kind(branch)
                return self._run_selected(kind, branch, input_tensor)
            return self._run_index(self._branch_index(branch), input_tensor)

    def _branch_index(self, branch: object) -> int:
        if isinstance(branch, str):
            idx = self._index.get(branch)
            if idx is None:
                raise KeyError(f"no branch named {branch!r}; expected one of {self.branches}")
            return idx
        if isinstance(branch, bool) or not isinstance(branch, int):
            raise TypeError(f"branch: expected a branch name (str), an index (int) or a one-element tensor, "
                            f"got {type(branch).__name__}"
                            + (" (for a Python bool, pass 0 if pred else 1)" if isinstance(branch, bool) else ""))
        if not 0 <= branch < len(self._branches):
            raise IndexError(f"branch index {branch} is out of range; expected 0 <= index < {len(self._branches)}")
        return branch

    def _selector_kind(self, sel: torch.Tensor) -> str:
        if sel.numel() != 1:
            raise ValueError(f"selector: expected a one-element tensor, got shape {tuple(sel.shape)}")
        if sel.dtype == torch.bool:
            if len(self._branches) != 2:
                raise ValueError(f"a bool selector needs exactly 2 branches (true: branch 0, false: branch 1), "
                                 f"got {len(self._branches)}; pass an integer index tensor instead")
            return "bool"
        if sel.dtype.is_floating_point or sel.dtype.is_complex:
            raise TypeError(f"selector: expected a bool or integer tensor, got {sel.dtype}")
        return "index"

    def _stage_input(self, input_tensor: Any) -> None:
        if input_tensor is not None:
            check_same_layout("input_tensor", self._static_input, input_tensor)
            copy_into(self._static_input, input_tensor)

    def _run_index(self, idx: int, input_tensor: Any) -> Any:
        b = self._branches[idx]
        if b.graph is None:
            return self._eager(b, input_tensor)
        self._stage_input(input_tensor)
        b.graph._launch()
        out = clone_tree(b.outputs) if self.copy_outputs else b.outputs
        if _settings.current().validate:
            return self._validated(out, idx)
        return out

    def _eager(self, b: _Branch, input_tensor: Any) -> Any:
        if input_tensor is not None:
            check_same_layout("input_tensor", self._static_input, input_tensor)
        _stats.record_fallback(b.reason, b.failed or "")
        x = self._static_input if input_tensor is None else input_tensor
        with torch.no_grad():
            return b.fn(x)

    def _host_choice(self, kind: str, sel: torch.Tensor) -> int:
        """The segment a selector picks, read on the host (one sync on a GPU)."""
        value = sel.reshape(()).item()
        if kind == "bool":
            return 0 if value else 1
        n = len(self._branches)
        if not 0 <= value < n:
            log_once(("conditional", "out_of_range", id(self)), logging.WARNING,
                     "gfxgraph: selector index %s is outside [0, %d): no branch runs, the outputs are zeros",
                     value, n)
            return n
        return int(value)

    def _run_selected(self, kind: str, sel: torch.Tensor, input_tensor: Any) -> Any:
        dg = self._device_graph(kind)
        if dg is not None and dg.strategy == "native":
            self._stage_input(input_tensor)
            dg.selector.copy_(sel.reshape(()))  # type: ignore[union-attr]  # device to device: no sync
            dg.graph._launch()
            return self._device_outputs(dg, kind, sel)
        choice = self._host_choice(kind, sel)
        if dg is not None:  # supergraph
            self._stage_input(input_tensor)
            self._enable_segment(dg, choice)
            dg.graph._launch()
            if dg.done is not None:
                dg.done.record()
            return self._device_outputs(dg, kind, sel)
        if choice == len(self._branches):
            return self._zeros(input_tensor)
        return self._run_index(choice, input_tensor)

    def _device_outputs(self, dg: _DeviceGraph, kind: str, sel: torch.Tensor) -> Any:
        out = clone_tree(dg.outputs) if self.copy_outputs else dg.outputs
        if _settings.current().validate:
            choice = self._host_choice(kind, sel)
            if choice < len(self._branches):
                return self._validated(out, choice)
        return out

    def _enable_segment(self, dg: _DeviceGraph, choice: int) -> None:
        if dg.active == choice:
            return
        if dg.done is not None:
            dg.done.synchronize()  # HIP does not document toggling an executable in flight
        rt = self._runtime()
        for j, nodes in enumerate(dg.segments):
            if dg.active == -1 or j in (dg.active, choice):
                for n in nodes:
                    rt.exec_node_set_enabled(dg.exec_handle, n, j == choice)
        dg.active = choice

    def _zeros(self, input_tensor: Any) -> Any:
        if input_tensor is not None:
            check_same_layout("input_tensor", self._static_input, input_tensor)
        if self._uniform is None:
            raise IndexError("the selector index is out of range and the branches return different "
                             "layouts, so there is no zero output to return")
        return _materialise(self._uniform, zeros=True)

    def _validated(self, graph_out: Any, idx: int) -> Any:
        with torch.no_grad():
            eager_out = self._branches[idx].fn(self._static_input)
        return checked_against_eager(graph_out, eager_out, owner=self, what="conditional")

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release every graph and buffer (idempotent). Waits for the device first."""
        with self._lock:
            if self._state is ConditionalState.CLOSED:
                return
            if self._device >= 0 and torch.cuda.is_available():
                try:
                    torch.cuda.synchronize(self._device)
                except Exception as exc:  # a broken device must not make close() raise
                    logger.debug("gfxgraph: ConditionalGraph close: sync failed: %s", exc)
            for dg in self._device_graphs.values():
                _reset_quietly(dg.graph)
                if dg.pool is not None:
                    dg.pool.close()
            self._device_graphs.clear()
            for b in self._branches:
                if b.graph is not None:
                    _reset_quietly(b.graph)
                b.graph = b.outputs = None
            self._static_input = self._shared_outputs = None
            self._state = ConditionalState.CLOSED

    def __enter__(self) -> ConditionalGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ConditionalGraph(branches={self.branches}, state={self._state.value}, "
                f"strategy={self._strategy}, failed={sorted(self.failed_branches)})")


def _reset_quietly(graph: Any) -> None:
    try:
        graph.reset()
    except Exception as exc:
        logger.debug("gfxgraph: releasing a conditional graph failed: %s", exc)


class ConditionalSession:
    """``BridgedCUDAGraph.capture(conditional_branches={...}, example_input=x)``: the seed's path.

    ``with g.capture(conditional_branches={"a": fa, "b": fb}, example_input=x):`` captures
    every branch on exit (see :class:`ConditionalGraph`);
    ``g.replay(branch="a", input_tensor=x)`` runs one (``branch`` may also be
    an index or a one-element device tensor). Falls back to eager per branch.
    """

    def __init__(self, owner: Any, *, branches: Any, example_input: Any, copy_outputs: bool,
                 warmup_iters: int) -> None:
        if not isinstance(branches, dict):
            raise TypeError(f"conditional_branches: expected a dict of name -> callable, got "
                            f"{type(branches).__name__}")
        if example_input is None:
            raise TypeError("capture(conditional_branches=...) needs example_input= (the static input "
                            "every branch reads)")
        self._owner = owner
        self.graph = ConditionalGraph(copy_outputs=copy_outputs, warmup_iters=warmup_iters)
        for name, fn in branches.items():
            self.graph.add_branch(name, fn)
        self.example_input = example_input

    @property
    def strategy(self) -> str:
        return self.graph.strategy

    @property
    def mode(self) -> str:
        """``"pending"`` inside the block, then ``"graph"``, or ``"eager"`` without a GPU."""
        if self.graph.state is ConditionalState.BUILDING:
            return "pending"
        return "eager" if self.graph.strategy == "eager" else "graph"

    def __enter__(self) -> ConditionalSession:
        self._owner._enter_session_state()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self.graph.capture(self.example_input)
        return False

    def replay(self, *, batch_size: Any = None, branch: Any = None, input_tensor: Any = None) -> Any:
        if batch_size is not None:
            raise TypeError("replay(batch_size=...) needs capture(dynamic_shapes=True); this graph was "
                            "captured with conditional_branches=")
        if branch is None:
            raise TypeError("replay() on a conditional_branches capture needs branch= (a name, an index "
                            f"or a one-element tensor); branches: {self.graph.branches}")
        return self.graph.run(branch, input_tensor)

    def close(self) -> None:
        self.graph.close()
