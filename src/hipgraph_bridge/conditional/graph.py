"""ConditionalGraph: branches chosen by name or by a device tensor.

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
   is made is the *strategy* (:attr:`ConditionalGraph.strategy`): ``"native"``
   (CUDA conditional nodes, no host read) and ``"supergraph"`` (the HIP
   emulation) capture one graph holding every branch (:mod:`.strategies`), so
   all branches must return the same structure, shapes and dtypes;
   ``"dispatch"`` reads the selector on the host and replays the chosen
   branch's own graph; ``"eager"`` means no GPU graphs. ``strategy="auto"``
   picks native where :func:`~.support.conditional_support` allows (the
   capability table's ``conditional_branches`` row: CUDA >= 12.8), else
   dispatch (HIP has no conditional nodes up to ROCm 7.2: ROCm/hip#3905). A selector kind's graph is captured on first use, or up front
   with ``capture(x, selectors=("bool", "index"))``.

Costs per :meth:`run`: one input copy, one graph launch, one output copy per
tensor; native adds a selector copy (device to device) and nothing on the
host. Model calls run under ``torch.no_grad()``: this is for inference.

What it will not do: run from several threads at once (calls are serialised by
a lock: one static input), accept inputs whose layout differs from the
example, or capture random-number ops inside native branches (see
:mod:`.native_nodes`).
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .. import config, stats
from .._torch_compat import pytree
from ..checks import check_bool, check_int
from ..fallbacks import Fallback, Reason
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import check_capture_mode, frozen_gc, warm_up
from ..log import logger
from ..platform import probe
from ..runtime import resolve_runtime
from ..tree import check_same_layout, clone_tree, copy_into, describe
from ..validation import checked_against_eager
from .native_nodes import side_stream
from .strategies import (
    CaptureSite,
    DeviceSelected,
    NativeSelect,
    StrategyUnavailable,
    SupergraphSelect,
    describe_layout,
    host_choice,
    output_layout,
    selector_kind,
    zero_tree,
    zeros_like_layout,
)
from .support import choose_strategy

__all__ = ["ConditionalGraph", "ConditionalState", "Strategy", "STRATEGIES", "SelectorKind", "resolve_strategy"]

Strategy = Literal["auto", "native", "supergraph", "dispatch"]
STRATEGIES: tuple[str, ...] = ("auto", "native", "supergraph", "dispatch")
SelectorKind = Literal["bool", "index"]
_KINDS = ("bool", "index")


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
    return choose_strategy(requested, STRATEGIES, native_supported=lambda s: s.branches,
                           nodes="conditional nodes", supported_nodes="IF/ELSE and SWITCH nodes",
                           fallback="dispatch", fallback_what="per-branch dispatch")


@dataclass
class _Branch:
    name: str
    fn: Callable[..., Any]
    graph: SafeCUDAGraph | None = None  # its own graph (dispatch), once captured
    outputs: Any = None  # static outputs of that graph
    layout: Any = None  # output_layout() of its outputs (None when unknown)
    reason: Reason = Reason.EAGER  # fallback reason while it runs eagerly
    failed: str | None = None  # why it runs eagerly


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
        capture_error_mode: passed to ``capture_begin``; ``"thread_local"`` (default) keeps
            the captures from breaking CUDA work in other threads.
    """

    def __init__(self, *, strategy: Strategy = "auto", copy_outputs: bool = True, warmup_iters: int = 1,
                 pool: Any = None, runtime: Any = None, capture_error_mode: str = "thread_local") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
        check_int("warmup_iters", warmup_iters)
        self.requested_strategy: str = strategy
        self.copy_outputs = check_bool("copy_outputs", copy_outputs)
        self.warmup_iters = warmup_iters
        self.capture_error_mode = check_capture_mode(capture_error_mode)
        self._pool_arg = pool
        self._runtime_arg = runtime
        self._state = ConditionalState.BUILDING
        self._branches: list[_Branch] = []
        self._index: dict[str, int] = {}
        self._strategy = "pending"
        self._strategy_reason = ""
        self._static_input: Any = None
        self._site: CaptureSite | None = None
        self._shared_outputs: Any = None
        self._device_graphs: dict[str, DeviceSelected] = {}
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
        device = next(iter(devices)).index
        with torch.cuda.device(device):
            with torch.no_grad():
                self._static_input = clone_tree(example_input)
            stream = torch.cuda.Stream(device=device)
            pool = self._pool_arg if self._pool_arg is not None else torch.cuda.graph_pool_handle()
            self._site = CaptureSite(device, stream, side_stream(device, avoid=[stream]), pool,
                                     self.capture_error_mode)
            with frozen_gc():
                for b in self._branches:
                    self._capture_branch(b)
            self._state = ConditionalState.CAPTURED
            self._check_uniform_or_close()
            logger.debug("gfxgraph: ConditionalGraph %s: strategy %s (%s)", self.branches, self._strategy,
                         self._strategy_reason)
            for kind in kinds:
                self._device_graph(kind)

    def _capture_eagerly(self, example_input: Any, reason: str) -> None:
        self._strategy, self._strategy_reason = "eager", reason
        with torch.no_grad():
            self._static_input = clone_tree(example_input)
            for b in self._branches:
                b.reason, b.failed = Reason.NO_GPU, reason
                try:
                    b.layout = output_layout(b.fn(self._static_input))
                except Exception as exc:  # it raises again, for the caller, when it is run
                    logger.warning("gfxgraph: branch %r raised on the example input: %s", b.name, exc)
        self._state = ConditionalState.CAPTURED
        self._check_uniform_or_close()

    def _run_branch(self, b: _Branch) -> Callable[[], Any]:
        x = self._static_input
        return lambda: b.fn(x)

    def _capture_branch(self, b: _Branch) -> None:
        site = self._site
        assert site is not None  # set by capture()
        try:
            with torch.no_grad():
                out = warm_up(self._run_branch(b), site.stream, self.warmup_iters)
            if out is not None:
                b.layout = output_layout(out)
            del out
        except Exception as exc:
            b.reason, b.failed = Reason.WARMUP_FAILED, f"branch {b.name!r}: {type(exc).__name__}: {exc}"
            logger.warning("gfxgraph: branch %r runs eagerly: warm-up raised %s", b.name, exc)
            return
        g = SafeCUDAGraph()
        try:
            with torch.no_grad(), g.capturing(pool=site.pool, stream=site.stream,
                                              capture_error_mode=site.capture_error_mode):
                out = b.fn(self._static_input)
        except Exception as exc:
            b.reason, b.failed = Reason.CAPTURE_FAILED, f"branch {b.name!r}: {type(exc).__name__}: {exc}"
            logger.warning("gfxgraph: branch %r runs eagerly from now on: capture failed: %s", b.name, exc)
            self._retire_pool()
            return
        b.graph, b.outputs, b.layout = g, out, output_layout(out)

    def _retire_pool(self) -> None:
        """After a failed capture PyTorch's allocator may keep recording to its pool: later
        captures go to a fresh one (unless the caller gave the pool, then it is theirs)."""
        if self._pool_arg is None and self._site is not None:
            self._site.pool = torch.cuda.graph_pool_handle()

    def _check_uniform_or_close(self) -> None:
        """Find the branches' common output layout; a forced device strategy needs one (else: closed, raises)."""
        layouts = [b.layout for b in self._branches]
        self._uniform = layouts[0] if all(lay is not None and lay == layouts[0] for lay in layouts) else None
        if self._uniform is None and self.requested_strategy in ("native", "supergraph"):
            self.close()
            raise ValueError(f"strategy={self.requested_strategy!r}: {self._layouts_differ()}")

    def _layouts_differ(self) -> str:
        described = ", ".join(f"{b.name!r}: {describe_layout(b.layout)}" for b in self._branches)
        return ("device-selected graphs write every branch into one set of outputs, so the branches must "
                f"return the same structure, shapes and dtypes; got {described}")

    # ------------------------------------------------- device-selected graphs
    def _device_graph(self, kind: str) -> DeviceSelected | None:
        """The native/supergraph graph for ``kind``, captured on first use (None: dispatch)."""
        found = self._device_graphs.get(kind)
        if found is not None or self._strategy not in ("native", "supergraph"):
            return found
        if kind == "bool" and len(self._branches) != 2:
            return None
        site = self._site
        assert site is not None
        try:
            bodies, outputs = self._bodies(kind)
            with torch.cuda.device(site.device), frozen_gc():
                if self._strategy == "native":
                    dg: DeviceSelected = NativeSelect.capture(kind, site, bodies, outputs,
                                                              [self._run_branch(b) for b in self._branches])
                else:
                    dg = SupergraphSelect.capture(site, bodies, outputs, resolve_runtime(self._runtime_arg))
        except Exception as exc:
            self._retire_pool()
            forced = self.requested_strategy == self._strategy
            if forced and isinstance(exc, StrategyUnavailable):
                raise ValueError(f"strategy={self._strategy!r}: {exc}") from exc
            why = f"{self._strategy} capture failed: {type(exc).__name__}: {exc}"
            logger.warning("gfxgraph: ConditionalGraph falls back to per-branch dispatch: %s", why)
            self._strategy, self._strategy_reason = "dispatch", why
            return None
        self._device_graphs[kind] = dg
        return dg

    def _bodies(self, kind: str) -> tuple[list[Callable[[], None]], Any]:
        """One body per branch writing into the shared outputs (plus the zero default for ``"index"``)."""
        if self._uniform is None:
            raise StrategyUnavailable(self._layouts_differ())
        if self._shared_outputs is None:
            self._shared_outputs = zeros_like_layout(self._uniform)
        outputs, x = self._shared_outputs, self._static_input
        bodies = [functools.partial(_write_into, b.fn, x, outputs) for b in self._branches]
        if kind == "index":
            bodies.append(functools.partial(zero_tree, outputs))  # index out of range
        return bodies, outputs

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
                kind = selector_kind(branch, len(self._branches))
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

    def _stage_input(self, input_tensor: Any) -> None:
        if input_tensor is not None:
            check_same_layout("input_tensor", self._static_input, input_tensor)
            copy_into(self._static_input, input_tensor)

    def _run_index(self, idx: int, input_tensor: Any) -> Any:
        b = self._branches[idx]
        if b.graph is None:
            return self._eager(b, input_tensor)
        self._stage_input(input_tensor)
        b.graph.replay()
        out = clone_tree(b.outputs) if self.copy_outputs else b.outputs
        return self._validated(out, idx)

    def _eager(self, b: _Branch, input_tensor: Any) -> Any:
        if input_tensor is not None:
            check_same_layout("input_tensor", self._static_input, input_tensor)
        stats.record_fallback(Fallback(b.reason, b.failed or ""))
        x = self._static_input if input_tensor is None else input_tensor
        with torch.no_grad():
            return b.fn(x)

    def _run_selected(self, kind: str, sel: torch.Tensor, input_tensor: Any) -> Any:
        dg = self._device_graph(kind)
        if dg is not None:
            self._stage_input(input_tensor)
            dg.launch(sel, functools.partial(host_choice, kind, sel, len(self._branches), self))
            out = clone_tree(dg.outputs) if self.copy_outputs else dg.outputs
            if config.switches.validate:
                choice = host_choice(kind, sel, len(self._branches), self)
                if choice < len(self._branches):
                    return self._validated(out, choice)
            return out
        choice = host_choice(kind, sel, len(self._branches), self)
        if choice == len(self._branches):
            return self._zeros(input_tensor)
        return self._run_index(choice, input_tensor)

    def _zeros(self, input_tensor: Any) -> Any:
        if input_tensor is not None:
            check_same_layout("input_tensor", self._static_input, input_tensor)
        if self._uniform is None:
            raise IndexError("the selector index is out of range and the branches return different "
                             "layouts, so there is no zero output to return")
        return zeros_like_layout(self._uniform)

    def _validated(self, graph_out: Any, idx: int) -> Any:
        if not config.switches.validate:
            return graph_out
        with torch.no_grad():
            eager_out = self._branches[idx].fn(self._static_input)
        return checked_against_eager(graph_out, eager_out, owner=self, what="conditional")

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release every graph and buffer (idempotent). Waits for the device first."""
        with self._lock:
            if self._state is ConditionalState.CLOSED:
                return
            site = self._site
            if site is not None:  # stream syncs: a device-wide one would break other threads' captures
                try:
                    site.stream.synchronize()
                    site.body_stream.synchronize()
                    torch.cuda.current_stream(site.device).synchronize()
                except Exception as exc:  # a broken device must not make close() raise
                    logger.debug("gfxgraph: ConditionalGraph close: sync failed: %s", exc)
            for dg in self._device_graphs.values():
                _quietly(dg.close)
            self._device_graphs.clear()
            for b in self._branches:
                if b.graph is not None:
                    _quietly(b.graph.reset)
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


def _write_into(fn: Callable[..., Any], x: Any, outputs: Any) -> None:
    copy_into(outputs, fn(x))


def _quietly(release: Callable[[], None]) -> None:
    try:
        release()
    except Exception as exc:
        logger.debug("gfxgraph: releasing a conditional graph failed: %s", exc)
