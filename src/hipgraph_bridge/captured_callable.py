"""The seed's high-level capture: ``BridgedCUDAGraph.capture(model_fn=...)``.

Workflow of a static-shape session:

1. ``__enter__``: clone ``example_input`` into a static input, warm
   ``model_fn`` up on a side stream (cuBLAS workspaces, lazy inits), freeze the
   garbage collector and begin capture on that stream.
2. The ``with`` body runs under capture. If it leaves ``cap.output`` unset,
   ``model_fn(cap.static_input)`` is captured on exit.
3. ``__exit__``: end the capture. Any failure (the body raised, the runtime
   rejected the capture) ends the capture cleanly and turns the session into
   an eager one: counted, logged once with its reason, exception suppressed.
   ``KeyboardInterrupt``/``SystemExit`` are never suppressed.
4. ``replay(input_tensor=x)``: check ``x`` against the static input, copy it
   in, launch, return a copy of the outputs (``copy_outputs=False`` returns the
   static outputs, overwritten by the next replay). In validation mode the
   eager result is computed too, compared, and returned on mismatch.

What it will not do: accept an input whose shape differs from the example
(use ``dynamic_shapes=True``), or hide a failure when there is no
``model_fn`` to fall back to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from . import settings as _settings
from . import stats as _stats
from .capture_state import frozen_gc
from .errors import GraphCaptureError
from .log import logger
from .platform import probe
from .tree_utils import check_same_layout, clone_tree, copy_into, describe
from .validation import checked_against_eager

if TYPE_CHECKING:
    from .graph_manager import BridgedCUDAGraph

__all__ = ["open_session", "StaticCaptureSession", "warm_up"]


def warm_up(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], iters: int,
            stream: torch.cuda.Stream) -> None:
    """Run ``fn`` ``iters`` times on ``stream`` (after the current stream's work) and wait."""
    if iters <= 0:
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(iters):
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    stream.synchronize()


def _check_model_fn(model_fn: object) -> None:
    if model_fn is not None and not callable(model_fn):
        raise TypeError(f"model_fn: expected a callable, got {type(model_fn).__name__}")


def open_session(owner: BridgedCUDAGraph, *, model_fn: Any, example_input: Any, dynamic_shapes: bool,
                 buckets: Any, conditional_branches: Any, copy_outputs: bool, warmup_iters: int,
                 pool: Any) -> Any:
    """Pick the session type for ``BridgedCUDAGraph.capture`` from its arguments."""
    _check_model_fn(model_fn)
    if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
        raise ValueError(f"warmup_iters: expected an int >= 0, got {warmup_iters!r}")
    if not isinstance(copy_outputs, bool):
        raise TypeError(f"copy_outputs: expected a bool, got {copy_outputs!r}")
    if not isinstance(dynamic_shapes, bool):
        raise TypeError(f"dynamic_shapes: expected a bool, got {dynamic_shapes!r}")
    if dynamic_shapes and conditional_branches:
        raise ValueError("capture(): dynamic_shapes and conditional_branches cannot be combined")
    if dynamic_shapes:
        from .shape_bucketing import BucketPoolSession

        return BucketPoolSession(owner, model_fn=model_fn, buckets=buckets, copy_outputs=copy_outputs,
                                 warmup_iters=warmup_iters, example_input=example_input)
    if conditional_branches:
        from .conditional import ConditionalSession

        return ConditionalSession(owner, branches=conditional_branches, example_input=example_input,
                                  copy_outputs=copy_outputs, warmup_iters=warmup_iters)
    if buckets is not None:
        raise ValueError("capture(): buckets= needs dynamic_shapes=True")
    return StaticCaptureSession(owner, model_fn=model_fn, example_input=example_input,
                                copy_outputs=copy_outputs, warmup_iters=warmup_iters, pool=pool)


class StaticCaptureSession:
    """One graph of fixed shapes with eager fallback; see the module docstring."""

    def __init__(self, owner: BridgedCUDAGraph, *, model_fn: Callable[..., Any] | None,
                 example_input: Any, copy_outputs: bool, warmup_iters: int, pool: Any) -> None:
        if example_input is not None:
            leaves = pytree.tree_leaves(example_input)
            if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
                raise TypeError(f"example_input: expected a tensor or a pytree of tensors, "
                                f"got {describe(example_input)}")
        self._owner = owner
        self.model_fn = model_fn
        self.example_input = example_input
        self.static_input: Any = None
        self.output: Any = None
        self.copy_outputs = copy_outputs
        self._warmup_iters = warmup_iters
        self._pool = pool
        self._mode = "pending"  # -> "graph" | "eager"
        self._reason = ""
        self._detail = ""
        self._stream: torch.cuda.Stream | None = None
        self._contexts: list[Any] = []

    # ------------------------------------------------------------- capture
    @property
    def mode(self) -> str:
        """``"graph"`` once captured, ``"eager"`` after a fallback."""
        return self._mode

    @property
    def fallback_reason(self) -> str:
        """Why this session runs eagerly ("" while it replays a graph)."""
        return f"{self._reason}: {self._detail}" if self._detail else self._reason

    def _to_eager(self, reason: str, detail: str) -> None:
        self._mode = "eager"
        self._reason = reason
        self._detail = detail
        self._owner._enter_session_state()
        _stats.record_fallback(reason, detail)

    def __enter__(self) -> StaticCaptureSession:
        plat = probe()
        if not plat.graphs_available:
            self.static_input = self.example_input
            self._to_eager("no_gpu", plat.reason or "")
            return self
        if self.example_input is not None:
            for leaf in pytree.tree_leaves(self.example_input):
                if leaf.device.type != "cuda":
                    raise ValueError(f"example_input: expected tensors on a CUDA device, got {describe(leaf)}")
            self.static_input = clone_tree(self.example_input)
        self._stream = torch.cuda.Stream()
        try:
            if self.model_fn is not None and self.static_input is not None:
                warm_up(self.model_fn, (self.static_input,), {}, self._warmup_iters, self._stream)
        except Exception as exc:
            self._to_eager("warmup_failed", f"{type(exc).__name__}: {exc}")
            return self
        torch.cuda.synchronize()
        stream_ctx = torch.cuda.stream(self._stream)
        gc_ctx = frozen_gc()
        stream_ctx.__enter__()
        gc_ctx.__enter__()
        self._contexts = [gc_ctx, stream_ctx]
        try:
            self._owner.capture_begin(pool=self._pool)
        except Exception as exc:
            self._leave_contexts()
            self._to_eager("capture_failed", f"{type(exc).__name__}: {exc}")
        return self

    def _leave_contexts(self) -> None:
        contexts, self._contexts = self._contexts, []
        for ctx in contexts:
            ctx.__exit__(None, None, None)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if self._mode == "eager":
            return False  # the body ran eagerly; its own errors are real errors
        failure: BaseException | None = exc
        try:
            if failure is None and self.output is None and self.model_fn is not None \
                    and self.static_input is not None:
                try:
                    self.output = self.model_fn(self.static_input)
                except BaseException as body_exc:
                    failure = body_exc
            if failure is not None:
                self._owner._discard(f"the captured region raised {type(failure).__name__}: {failure}",
                                     capture_ended=False)
            else:
                try:
                    self._owner.capture_end()
                except GraphCaptureError as end_exc:
                    failure = end_exc
        finally:
            self._leave_contexts()
        if failure is None:
            self._mode = "graph"
            self._owner._enter_session_state()
            logger.debug("gfxgraph: captured %s", self._owner)
            return False
        if not isinstance(failure, Exception) or self.model_fn is None:
            # KeyboardInterrupt/SystemExit, or nothing to fall back to: propagate.
            if failure is not exc:
                raise failure
            return False
        self.output = None
        self._to_eager("capture_failed", f"{type(failure).__name__}: {failure}")
        return True

    # -------------------------------------------------------------- replay
    def replay(self, *, batch_size: Any = None, branch: Any = None, input_tensor: Any = None) -> Any:
        if batch_size is not None or branch is not None:
            raise TypeError("replay(): batch_size= needs capture(dynamic_shapes=True) and branch= needs "
                            "capture(conditional_branches=...); this graph has one static shape")
        if self._mode == "pending":
            raise RuntimeError("replay() called before the capture() block finished")
        if self._mode == "eager":
            return self._run_eager(input_tensor, count=True)
        if input_tensor is not None:
            if self.static_input is None:
                raise TypeError("replay(input_tensor=...): this graph was captured without example_input, "
                                "so it has no static input to copy into")
            check_same_layout("input_tensor", self.static_input, input_tensor)
            copy_into(self.static_input, input_tensor)
        try:
            self._owner._launch()
        except Exception as exc:
            self._to_eager("replay_failed", f"{type(exc).__name__}: {exc}")
            return self._run_eager(input_tensor, count=False)
        out = clone_tree(self.output) if self.copy_outputs else self.output
        if _settings.current().validate and self.model_fn is not None:
            return self._validated(out, input_tensor)
        return out

    def _run_eager(self, input_tensor: Any, *, count: bool) -> Any:
        if self.model_fn is None:
            raise RuntimeError(f"graph capture failed ({self.fallback_reason}) and capture() got no model_fn "
                               "to run eagerly; pass model_fn= to capture()")
        if count:
            _stats.record_fallback(self._reason, self._detail)
        x = input_tensor if input_tensor is not None else self.static_input
        if x is None:
            return self.model_fn()
        return self.model_fn(x)

    def _validated(self, graph_out: Any, input_tensor: Any) -> Any:
        x = input_tensor if input_tensor is not None else self.static_input
        eager_out = self.model_fn(x)  # type: ignore[misc]
        return checked_against_eager(graph_out, eager_out, owner=self, what="graph")

    def close(self) -> None:
        self.static_input = None
        self.output = None
