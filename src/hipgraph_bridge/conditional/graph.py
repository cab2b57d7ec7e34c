"""ConditionalGraph: branches chosen by name or by a device tensor.

Workflow::

    cg = ConditionalGraph()
    cg.add_branch("small", small_model)
    cg.add_branch("large", large_model)
    cg.capture(x)                 # one graph per branch: one pool, one static input
    y = cg.run("large", x)        # by name (or index): replay that branch's graph
    y = cg.run(pred, x)           # by a device tensor, decided without a host sync on CUDA

1. :meth:`add_branch` registers callables ``fn(input) -> outputs``.
2. :meth:`capture` warms every branch up and captures it into its own graph,
   through one :class:`~hipgraph_bridge.graph.capturer.Capturer`: all graphs
   share one memory pool, one side stream and one static input. A branch whose
   warm-up or capture fails runs eagerly from then on (its
   :class:`~hipgraph_bridge.fallbacks.Fallback` counted, logged once).
3. :meth:`run` with a ``str`` name or an ``int`` index copies the input into
   the static input, replays that branch's graph and returns its outputs
   (copied unless ``copy_outputs=False``).
4. :meth:`run` with a one-element tensor selects on the device: a ``bool``
   tensor picks branch 0 when true and branch 1 when false (exactly two
   branches, like ``torch.cond``); an integer tensor is a branch index, and an
   index outside ``[0, n)`` runs no branch and returns zeros. How the choice
   is made is the *strategy* (:attr:`ConditionalGraph.strategy`), one
   registered class per name (:mod:`.strategies`): ``"native"`` (CUDA
   conditional nodes, no host read) and ``"supergraph"`` (the HIP emulation)
   capture one graph holding every branch, so all branches must return the
   same structure, shapes and dtypes; ``"dispatch"`` reads the selector on the
   host and replays the chosen branch's own graph; ``"eager"`` means no GPU
   graphs. ``strategy="auto"`` picks native where
   :func:`~.support.conditional_support` allows (the capability table's
   ``conditional_branches`` row: CUDA >= 12.8), else dispatch (HIP has no
   conditional nodes up to ROCm 7.2: ROCm/hip#3905); a strategy that fails to
   build falls back to dispatch. A selector kind's graph is captured on first
   use, or up front with ``capture(x, selectors=("bool", "index"))``.

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
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from .._torch_compat import pytree
from ..checks import check_bool, check_int
from ..fallbacks import Fallback, Reason
from ..graph.capturer import Capturer
from ..log import logger
from ..platform import probe
from ..tree import describe
from .branches import BranchSet, StrategyUnavailable, quietly, selector_kind
from .strategies import BranchStrategy, DeviceSelected, EagerStrategy, strategy_class, strategy_names
from .support import choose_strategy

__all__ = ["ConditionalGraph", "ConditionalState", "Strategy", "STRATEGIES", "SelectorKind", "resolve_strategy"]

Strategy = Literal["auto", "native", "supergraph", "dispatch"]
# The built-in names; a strategy registered later (strategies.register_strategy) is taken too.
STRATEGIES: tuple[str, ...] = ("auto", *strategy_names())
SelectorKind = Literal["bool", "index"]
_KINDS = ("bool", "index")


class ConditionalState(enum.Enum):
    BUILDING = "building"  # add_branch(); capture() next
    CAPTURED = "captured"  # run() works
    CLOSED = "closed"


def _requestable() -> tuple[str, ...]:
    return ("auto", *strategy_names())


def resolve_strategy(requested: str) -> tuple[str, str]:
    """The strategy device-selected runs use, and why (logged at debug).

    Raises:
        ValueError: ``requested`` is neither ``"auto"`` nor a registered strategy's name.
        RuntimeError: ``"native"`` was forced where conditional nodes are unsupported.
    """
    return choose_strategy(requested, _requestable(), native_supported=lambda s: s.branches,
                           nodes="conditional nodes", supported_nodes="IF/ELSE and SWITCH nodes",
                           fallback="dispatch", fallback_what="per-branch dispatch")


class ConditionalGraph:
    """Branches captured as graphs in one pool, chosen by name, index or device tensor.

    See the module docstring for the workflow and the strategies.

    Args:
        strategy: ``"auto"`` (default), ``"native"``, ``"supergraph"``,
            ``"dispatch"`` (or another registered strategy's name): how a device
            tensor selects the branch.
        copy_outputs: return copies (default); ``False`` returns the static
            outputs, overwritten by the next run.
        warmup_iters: eager runs of each branch on the capture stream before capture.
        pool: a memory-pool handle to share (default: the capturer's own, replaced after a failed capture).
        runtime: the runtime binding for the supergraph strategy's node calls
            (None: current; ``"ctypes"`` runs the HIP code path on CUDA).
        capture_error_mode: passed to ``capture_begin``; ``"thread_local"`` (default) keeps
            the captures from breaking CUDA work in other threads.
    """

    def __init__(self, *, strategy: Strategy = "auto", copy_outputs: bool = True, warmup_iters: int = 1,
                 pool: Any = None, runtime: Any = None, capture_error_mode: str = "thread_local") -> None:
        if strategy not in _requestable():
            raise ValueError(f"strategy: expected one of {', '.join(_requestable())}, got {strategy!r}")
        check_int("warmup_iters", warmup_iters)
        self.requested_strategy: str = strategy
        self.copy_outputs = check_bool("copy_outputs", copy_outputs)
        self.warmup_iters = warmup_iters
        self._capturer = Capturer(warmup_iters=warmup_iters, capture_error_mode=capture_error_mode, pool=pool)
        self.capture_error_mode = self._capturer.capture_error_mode
        self._runtime_arg = runtime
        self._state = ConditionalState.BUILDING
        self._branches = BranchSet(self._capturer, copy_outputs=self.copy_outputs)
        self._selection: BranchStrategy | None = None  # the strategy object, from capture()
        self._strategy = "pending"
        self._strategy_reason = ""
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> ConditionalState:
        return self._state

    @property
    def branches(self) -> list[str]:
        """Branch names in the order they were added (their indices)."""
        return self._branches.names

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
        """Branches that run eagerly, with the reason (``"reason: detail"``)."""
        return {b.name: str(b.fallback) for b in self._branches.items if b.fallback is not None}

    @property
    def static_input(self) -> Any:
        """The input every graph reads (write into it and call ``run(branch)`` to skip the copy)."""
        return self._branches.static_input

    @property
    def _device_graphs(self) -> Mapping[str, DeviceSelected]:
        """The strategy's graphs per selector kind (introspection and tests)."""
        return self._selection.graphs if self._selection is not None else {}

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
        if name in self._branches.index:
            raise ValueError(f"a branch named {name!r} already exists; expected a new name")
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        self._branches.add(name, fn)

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
        if not self._branches.items:
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
            reason = plat.reason or "no GPU"
            self._branches.run_once_eagerly(example_input, Fallback(Reason.NO_GPU, reason))
            self._use(EagerStrategy.name, reason)
            return
        devices = {x.device for x in leaves}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"example_input: expected tensors on one CUDA device, got {sorted(map(str, devices))}")
        name, why = resolve_strategy(self.requested_strategy)
        device = next(iter(devices)).index
        with torch.cuda.device(device):
            self._branches.capture(example_input, device)
            self._use(name, why)
            for kind in kinds:
                self._build(kind)

    def _use(self, name: str, why: str) -> None:
        """Adopt strategy ``name`` for the captured branches; a forced one-graph strategy needs
        branches of one output layout (else the graph is closed and ValueError raised)."""
        self._selection = strategy_class(name)(self._branches, runtime=self._runtime_arg)
        self._strategy, self._strategy_reason = name, why
        self._state = ConditionalState.CAPTURED
        requested = self.requested_strategy
        if requested != "auto" and strategy_class(requested).shares_outputs and self._branches.uniform is None:
            self.close()
            raise ValueError(f"strategy={requested!r}: {self._branches.layouts_differ()}")
        logger.debug("gfxgraph: ConditionalGraph %s: strategy %s (%s)", self.branches, name, why)

    def _build(self, kind: str) -> None:
        """Have the strategy build what ``kind`` needs; on failure fall back (a forced strategy that
        cannot serve these branches raises ValueError)."""
        selection = self._selection
        assert selection is not None  # set with CAPTURED
        try:
            selection.build(kind)
        except Exception as exc:
            if self.requested_strategy == selection.name and isinstance(exc, StrategyUnavailable):
                raise ValueError(f"strategy={selection.name!r}: {exc}") from exc
            fallback = selection.fallback or "dispatch"
            why = f"{selection.name} capture failed: {type(exc).__name__}: {exc}"
            logger.warning("gfxgraph: ConditionalGraph falls back to %s: %s", fallback, why)
            selection.close()
            self._selection = strategy_class(fallback)(self._branches, runtime=self._runtime_arg)
            self._strategy, self._strategy_reason = fallback, why

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
                self._build(kind)  # captured on first use (a failure swaps the strategy); nothing once built
                return self._selection.select(kind, branch, input_tensor)  # type: ignore[union-attr]
            return self._selection.run_index(self._branch_index(branch), input_tensor)  # type: ignore[union-attr]

    def _branch_index(self, branch: object) -> int:
        if isinstance(branch, str):
            idx = self._branches.index.get(branch)
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

    # --------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Release every graph and buffer (idempotent). Waits for the device first."""
        with self._lock:
            if self._state is ConditionalState.CLOSED:
                return
            device = self._branches.device
            if device is not None:  # stream syncs: a device-wide one would break other threads' captures
                quietly(self._capturer.stream.synchronize)
                quietly(torch.cuda.current_stream(device).synchronize)
            if self._selection is not None:
                self._selection.close()
            self._branches.close()
            self._state = ConditionalState.CLOSED

    def __enter__(self) -> ConditionalGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ConditionalGraph(branches={self.branches}, state={self._state.value}, "
                f"strategy={self._strategy}, failed={sorted(self.failed_branches)})")
