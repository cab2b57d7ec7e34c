"""The high-level, eager-fallback capture, ``BridgedCUDAGraph.capture(model_fn=...)``, as three thin sessions.

* :class:`StaticSession`: one graph of fixed shapes (a captured callable with eager fallback).
* :class:`BucketSession`: ``dynamic_shapes=True``, a :class:`~hipgraph_bridge.ShapeBucketPool`.
* :class:`ConditionalSession`: ``conditional_branches={...}``, a :class:`~hipgraph_bridge.ConditionalGraph`.

Workflow of a static session:

1. ``__enter__``: clone ``example_input`` into a static input, warm
   ``model_fn`` up on a side stream (cuBLAS workspaces, lazy inits) and begin
   capturing on that stream, with the garbage collector frozen.
2. The ``with`` body runs under capture. If it leaves ``cap.output`` unset,
   ``model_fn(cap.static_input)`` is captured on exit.
3. ``__exit__``: end the capture. Any failure (the body raised, the runtime
   rejected the capture) ends the capture cleanly and turns the session into
   an eager one: counted, logged once with its reason, exception suppressed.
   ``KeyboardInterrupt``/``SystemExit`` are never suppressed.
4. ``replay(input_tensor=x)``: check ``x`` against the static input, copy it
   in, launch, return a copy of the outputs (``copy_outputs=False`` returns the
   static outputs, overwritten by the next replay). In validation mode the
   eager result is computed too, compared, and returned on a mismatch.

What it will not do: accept an input whose shape differs from the example
(use ``dynamic_shapes=True``), or hide a failure when there is no
``model_fn`` to fall back to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from .. import config, stats
from .._torch_compat import pytree
from ..bucketing.pool import ShapeBucketPool
from ..checks import check_bool, check_int
from ..conditional.graph import ConditionalGraph, ConditionalState
from ..fallbacks import Fallback, Reason
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import GraphCapture, warm_up
from ..log import logger
from ..platform import probe
from ..tree import check_same_layout, clone_tree, copy_into, describe
from ..validation import checked_against_eager

__all__ = ["Session", "StaticSession", "BucketSession", "ConditionalSession", "open_session"]


class Session(Protocol):
    """What ``BridgedCUDAGraph`` holds after ``capture(model_fn=...)``."""

    @property
    def mode(self) -> str: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool: ...

    def replay(self, *, batch_size: Any = None, branch: Any = None, input_tensor: Any = None) -> Any: ...

    def close(self) -> None: ...


def open_session(*, model_fn: Any, example_input: Any, dynamic_shapes: bool, buckets: Any,
                 conditional_branches: Any, copy_outputs: bool, warmup_iters: int, pool: Any) -> Session:
    """The session for ``BridgedCUDAGraph.capture``'s arguments (validated here)."""
    if model_fn is not None and not callable(model_fn):
        raise TypeError(f"model_fn: expected a callable, got {type(model_fn).__name__}")
    check_int("warmup_iters", warmup_iters)
    check_bool("copy_outputs", copy_outputs)
    check_bool("dynamic_shapes", dynamic_shapes)
    if dynamic_shapes and conditional_branches:
        raise ValueError("capture(): dynamic_shapes and conditional_branches cannot be combined")
    if dynamic_shapes:
        return BucketSession(model_fn=model_fn, buckets=buckets, copy_outputs=copy_outputs,
                             warmup_iters=warmup_iters, example_input=example_input)
    if conditional_branches:
        return ConditionalSession(branches=conditional_branches, example_input=example_input,
                                  copy_outputs=copy_outputs, warmup_iters=warmup_iters)
    if buckets is not None:
        raise ValueError("capture(): buckets= needs dynamic_shapes=True")
    return StaticSession(model_fn=model_fn, example_input=example_input, copy_outputs=copy_outputs,
                         warmup_iters=warmup_iters, pool=pool)


class StaticSession:
    """One graph of fixed shapes with eager fallback; see the module docstring."""

    def __init__(self, *, model_fn: Callable[..., Any] | None, example_input: Any, copy_outputs: bool,
                 warmup_iters: int, pool: Any) -> None:
        if example_input is not None:
            leaves = pytree.tree_leaves(example_input)
            if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
                raise TypeError(f"example_input: expected a tensor or a pytree of tensors, "
                                f"got {describe(example_input)}")
        self.model_fn = model_fn
        self.example_input = example_input
        self.static_input: Any = None
        self.output: Any = None
        self.copy_outputs = copy_outputs
        self._warmup_iters = warmup_iters
        self._pool = pool
        self._graph: SafeCUDAGraph | None = None
        self._capture: GraphCapture | None = None
        self._mode = "pending"  # -> "graph" | "eager" | "interrupted"
        self._fallback: Fallback | None = None

    @property
    def mode(self) -> str:
        """``"graph"`` once captured, ``"eager"`` after a fallback."""
        return self._mode

    @property
    def fallback_reason(self) -> str:
        """Why this session runs eagerly ("" while it replays a graph)."""
        return "" if self._fallback is None else str(self._fallback)

    def _to_eager(self, reason: Reason, detail: str) -> None:
        self._mode, self._fallback = "eager", Fallback(reason, detail)
        stats.record_fallback(self._fallback)

    # ------------------------------------------------------------- capture
    def __enter__(self) -> StaticSession:
        plat = probe()
        if not plat.graphs_available:
            self.static_input = self.example_input
            self._to_eager(Reason.NO_GPU, plat.reason or "")
            return self
        if self.example_input is not None:
            for leaf in pytree.tree_leaves(self.example_input):
                if leaf.device.type != "cuda":
                    raise ValueError(f"example_input: expected tensors on a CUDA device, got {describe(leaf)}")
            self.static_input = clone_tree(self.example_input)
        stream = torch.cuda.Stream()
        model_fn, x = self.model_fn, self.static_input
        try:
            if model_fn is not None and x is not None:
                warm_up(lambda: model_fn(x), stream, self._warmup_iters)
        except Exception as exc:
            self._to_eager(Reason.WARMUP_FAILED, f"{type(exc).__name__}: {exc}")
            return self
        self._graph = SafeCUDAGraph()
        capture = self._graph.capturing(pool=self._pool, stream=stream, freeze_gc=True)  # thread-local mode
        try:
            capture.__enter__()
        except Exception as exc:
            self._to_eager(Reason.CAPTURE_FAILED, f"{type(exc).__name__}: {exc}")
            return self
        self._capture = capture
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        capture, self._capture = self._capture, None
        if capture is None:
            return False  # the body ran eagerly; its own errors are real errors
        failure = exc
        if failure is None and self.output is None and self.model_fn is not None and self.static_input is not None:
            try:
                self.output = self.model_fn(self.static_input)
            except BaseException as body_exc:
                failure = body_exc
        try:
            capture.__exit__(None if failure is None else type(failure), failure, None)
        except Exception as end_exc:  # PyTorch rejected the capture at its end (already discarded)
            failure = end_exc
        if failure is None:
            self._mode = "graph"
            logger.debug("gfxgraph: captured %s", self._graph)
            return False
        if not isinstance(failure, Exception) or self.model_fn is None:
            # KeyboardInterrupt/SystemExit, or nothing to fall back to: propagate.
            self._mode = "interrupted"
            if failure is not exc:
                raise failure
            return False
        self.output = None
        self._to_eager(Reason.CAPTURE_FAILED, f"{type(failure).__name__}: {failure}")
        return True

    # -------------------------------------------------------------- replay
    def replay(self, *, batch_size: Any = None, branch: Any = None, input_tensor: Any = None) -> Any:
        if batch_size is not None or branch is not None:
            raise TypeError("replay(): batch_size= needs capture(dynamic_shapes=True) and branch= needs "
                            "capture(conditional_branches=...); this graph has one static shape")
        if self._mode == "pending":
            raise RuntimeError("replay() called before the capture() block finished")
        if self._mode == "interrupted":
            raise RuntimeError("replay(): the capture() block was interrupted and its capture discarded; "
                               "capture again")
        if self._mode == "eager":
            return self._run_eager(input_tensor, count=True)
        if input_tensor is not None:
            if self.static_input is None:
                raise TypeError("replay(input_tensor=...): this graph was captured without example_input, "
                                "so it has no static input to copy into")
            check_same_layout("input_tensor", self.static_input, input_tensor)
            copy_into(self.static_input, input_tensor)
        assert self._graph is not None
        try:
            self._graph.replay()
        except Exception as exc:
            self._to_eager(Reason.REPLAY_FAILED, f"{type(exc).__name__}: {exc}")
            return self._run_eager(input_tensor, count=False)
        out = clone_tree(self.output) if self.copy_outputs else self.output
        if config.switches.validate and self.model_fn is not None:
            x = input_tensor if input_tensor is not None else self.static_input
            return checked_against_eager(out, self.model_fn(x), owner=self, what="graph")
        return out

    def _run_eager(self, input_tensor: Any, *, count: bool) -> Any:
        if self.model_fn is None:
            raise RuntimeError(f"graph capture failed ({self.fallback_reason}) and capture() got no model_fn "
                               "to run eagerly; pass model_fn= to capture()")
        if input_tensor is not None and self.static_input is not None:  # the same check as a replay's
            check_same_layout("input_tensor", self.static_input, input_tensor)
        if count and self._fallback is not None:
            stats.record_fallback(self._fallback)
        x = input_tensor if input_tensor is not None else self.static_input
        if x is None:
            return self.model_fn()
        return self.model_fn(x)

    def close(self) -> None:
        if self._graph is not None:
            self._graph.reset()  # during a capture this discards it
        self._graph = None
        self.static_input = None
        self.output = None


class BucketSession:
    """``capture(dynamic_shapes=True, ...)``: a :class:`ShapeBucketPool` behind the high-level API.

    ``with g.capture(dynamic_shapes=True, model_fn=m, buckets=[...], example_input=x):``
    captures every bucket on exit when ``example_input`` is given (lazily otherwise);
    ``g.replay(input_tensor=x)`` runs any batch size; ``g.replay(batch_size=n)``
    replays bucket(n) on what is already in the static input buffers.
    """

    def __init__(self, *, model_fn: Any, buckets: Any, copy_outputs: bool, warmup_iters: int,
                 example_input: Any) -> None:
        if model_fn is None:
            raise TypeError("capture(dynamic_shapes=True) needs model_fn= (the function to bucket)")
        self.pool = ShapeBucketPool(model_fn, buckets, copy_outputs=copy_outputs, warmup_iters=warmup_iters)
        self.example_input = example_input

    @property
    def mode(self) -> str:
        """``"graph"`` with a GPU, ``"eager"`` without one."""
        return "graph" if probe().graphs_available else "eager"

    def __enter__(self) -> BucketSession:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None and self.example_input is not None:
            self.pool.capture_all(self.example_input)
        return False

    def replay(self, *, batch_size: Any = None, branch: Any = None, input_tensor: Any = None) -> Any:
        if branch is not None:
            raise TypeError("replay(branch=...) needs capture(conditional_branches=...)")
        if input_tensor is not None:
            if batch_size is not None:
                n = input_tensor.shape[self.pool.batch_dim] if isinstance(input_tensor, torch.Tensor) else None
                if n != batch_size:
                    raise ValueError(f"batch_size={batch_size} disagrees with input_tensor's batch size {n}")
            return self.pool(input_tensor)
        if batch_size is None:
            raise TypeError("replay() on a dynamic_shapes capture needs input_tensor= or batch_size=")
        return self.pool.replay_buffers(batch_size)

    def close(self) -> None:
        self.pool.close()


class ConditionalSession:
    """``capture(conditional_branches={...}, example_input=x)``: a :class:`ConditionalGraph` behind it.

    ``with g.capture(conditional_branches={"a": fa, "b": fb}, example_input=x):`` captures
    every branch on exit; ``g.replay(branch="a", input_tensor=x)`` runs one (``branch``
    may also be an index or a one-element device tensor). Falls back to eager per branch.
    """

    def __init__(self, *, branches: Any, example_input: Any, copy_outputs: bool, warmup_iters: int) -> None:
        if not isinstance(branches, dict):
            raise TypeError(f"conditional_branches: expected a dict of name -> callable, got "
                            f"{type(branches).__name__}")
        if example_input is None:
            raise TypeError("capture(conditional_branches=...) needs example_input= (the static input "
                            "every branch reads)")
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
