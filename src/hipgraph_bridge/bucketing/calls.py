"""How a pool answers one call whose arguments fit its layout: replay, first capture, or eager.

:class:`BucketCalls` is the call machinery of :class:`~.pool.ShapeBucketPool`
(which holds the state it reads: the options, the buffers, the entries). The
steps are those of the pool's module docstring; every method here runs under
the pool's lock.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .. import config, stats
from .._torch_compat import pytree
from ..graph.capture import record_on_current_stream
from ..graph.weak_outputs import release_outputs
from ..log import log_once, logger
from ..platform import probe
from ..tree import clone_tree
from .buckets import BucketTable
from .buffers import StaticInputs
from .agreed import agreed_capture, agreed_probe
from .capture import BucketCapturer, Captured
from .entry import MISSING, Bucket
from .layout import CallLayout, QuickPlan
from .ordering import CallOrder
from .outputs import BatchedOutputs, OutputLayout, learn_output_layout, probe_other_size, probe_sizes
from .padding import UNKNOWN_OUTPUTS, PaddingGuard
from .ranks import RankSession

__all__ = ["BucketCalls"]

_EAGER = object()  # the call ran eagerly (the result is in _last_eager): nothing to check


class BucketCalls:
    """The per-call steps of a shape-bucket pool (the state lives on the pool)."""

    model_fn: Callable[..., Any]
    buckets: list[int]
    max_bucket: int
    batch_dim: int
    pad_value: float | int | bool | None
    copy_outputs: bool
    oversize: str
    stateful: bool
    simulate_padding: bool
    batched_outputs: BatchedOutputs
    _padding: PaddingGuard
    _table: BucketTable
    _capturer: BucketCapturer
    _ranks: RankSession | None
    _graphs_available: bool
    _inputs: StaticInputs | None
    _quick: QuickPlan | None
    _entries: dict[tuple[int, tuple[Hashable, ...]], Bucket]
    _out_flags: dict[tuple[Hashable, ...], tuple[bool, ...]]
    _order: CallOrder
    _last_eager: Any
    _epoch: list[int]

    def _call(self, inputs: StaticInputs, leaves: list[Any], batch: int, args: tuple[Any, ...],
              kwargs: dict[str, Any], copy: bool | None = None) -> Any:
        """The call once its arguments fit the layout (under the lock); ``copy`` overrides ``copy_outputs``."""
        copy = self.copy_outputs if copy is None else copy
        switches = config.switches
        if switches.debug:
            self._epoch[0] += 1
        if batch > self.max_bucket:
            return self._oversize(batch, args, kwargs)
        if not self._graphs_available and not self.simulate_padding:
            stats.record_fallback("no_gpu", probe().reason or "")
            return self._eager(args, kwargs)
        bucket = self._table[batch]  # a stateful pool's table is exact: never padded (see the pool)
        consts = inputs.layout.consts(leaves) if inputs.layout.has_consts else ()
        entry = self._entries.get((bucket, consts))
        if batch < bucket:
            refusal = self._padding.refusal(consts, outputs_known=entry is None or entry.layout is None
                                            or entry.layout.known)
            if refusal is not None:
                stats.record_fallback(*refusal)
                return self._eager(args, kwargs)
        if self._graphs_available:
            self._order.after_previous()
        if entry is not None and entry.failed is not None:
            stats.record_fallback(entry.reason, entry.failed)
            return self._eager(args, kwargs)
        inputs.stage(leaves, batch)
        if entry is None:
            entry, out = self._first_call(bucket, (bucket, consts), leaves, batch, args, kwargs, copy)
        else:
            out = self._replay(entry, leaves, batch, args, kwargs, copy)
        if out is _EAGER:
            out, self._last_eager = self._last_eager, None  # not kept alive until the next eager call
            return out
        if (batch == entry.size or entry.padding_checked) and not switches.validate:
            return out  # the hot path: nothing to check
        return self._padding.answer(entry, batch, out, lambda: self._eager(args, kwargs), owner=self)

    def _replay(self, entry: Bucket, leaves: list[Any], batch: int, args: tuple[Any, ...],
                kwargs: dict[str, Any], copy: bool) -> Any:
        """The bucket's graph on the staged inputs (the padded pipeline, eagerly, when simulated)."""
        if entry.graph is None:
            return self._padded_eager(entry, leaves, batch, args, kwargs, copy)
        layout = entry.layout
        assert layout is not None and entry.outputs is not None
        if batch < entry.size and not layout.known:  # learnt at this call's capture: cannot slice
            stats.record_fallback("unknown_outputs", UNKNOWN_OUTPUTS)
            return self._ran_eagerly(args, kwargs)
        entry.graph.replay()
        return layout.result(entry.outputs, batch, batch_dim=self.batch_dim, copy=copy, cache=True)

    def _fixed_inputs(self, leaves: list[Any], layout: CallLayout) -> StaticInputs:
        """The static inputs of the fixed layout; the first call fixes it (allocating the buffers)."""
        inputs = self._inputs
        if inputs is not None:
            if layout != inputs.layout:
                inputs.layout.check_matches(layout)
            return inputs
        if self._graphs_available:
            layout.check_on("cuda")
        # a stateful model's graphs are all of exact sizes: nothing ever reads the padding rows
        inputs = self._inputs = StaticInputs(layout, leaves, self._table, batch_dim=self.batch_dim,
                                             pad_value=None if self.stateful else self.pad_value)
        if QuickPlan.applies(layout):
            self._quick = QuickPlan(layout, leaves, self.batch_dim)
        return inputs

    def _oversize(self, batch: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.oversize == "error":
            raise ValueError(f"batch size {batch} is above the largest bucket {self.max_bucket}; "
                             "expected at most that (or construct the pool with oversize='eager')")
        stats.record_fallback("oversize", f"batch {batch} > largest bucket {self.max_bucket}")
        return self._eager(args, kwargs)

    def _ran_eagerly(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._last_eager = self._eager(args, kwargs)
        return _EAGER

    def _with_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stats.record_fallback("grad", "inputs require grad with grad mode on: the model runs eagerly, backward "
                              "included (graphs here are for inference: call under torch.no_grad() or "
                              "torch.inference_mode(), or graph training with torch.cuda.make_graphed_callables)")
        return self.model_fn(*args, **kwargs)

    def _first_call(self, bucket: int, key: tuple[int, tuple[Hashable, ...]], leaves: list[Any], batch: int,
                    args: tuple[Any, ...], kwargs: dict[str, Any], copy: bool) -> tuple[Bucket, Any]:
        """Capture a bucket on its first call and answer the call (its warm-up run, when that can be)."""
        entry, captured = self._capture(bucket, key, leaves, keep_warm=True)
        warm = captured.warm
        if captured.failed is not None and captured.stage == "warm_up":
            return entry, self._after_failed_padded_run(entry, key, captured.error, args, kwargs)
        if warm is not None and entry.layout is not None:  # the capture ran (the VRAM cap may have undone it)
            out = entry.warm_result(warm, batch, batch_dim=self.batch_dim, copy=copy)
            if out is not MISSING:
                if entry.failed is not None:
                    stats.record_fallback(entry.reason, entry.failed)
                return entry, out
            if self.stateful:  # never run twice (batch == bucket here): the warm-up run is the answer
                return entry, self._warm_as_result(warm, copy)
            logger.debug("gfxgraph: bucket %d: the warm-up's outputs differ from the captured ones; "
                         "this call replays the graph (the model ran twice)", bucket)
        elif warm is not None and entry.failed is not None and bucket == batch:
            # the capture failed after a good warm-up of exactly this batch: that run is the result
            stats.record_fallback(entry.reason, entry.failed)
            return entry, self._warm_as_result(warm, copy)
        del warm, captured
        if entry.failed is not None:
            stats.record_fallback(entry.reason, entry.failed)
            return entry, self._ran_eagerly(args, kwargs)
        return entry, self._replay(entry, leaves, batch, args, kwargs, copy)

    def _after_failed_padded_run(self, entry: Bucket, key: tuple[int, tuple[Hashable, ...]],
                                 error: Exception | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model raised on the padded buffers: on the caller's own arguments, its own error is the answer.

        If the caller's arguments run, the bucket runs eagerly from now on
        (reason ``padded_run_failed``); if they raise too, the entry is
        forgotten (a bad input, not a bad bucket) and that error propagates.
        A stateful model is not run again: the buffers held exactly the
        caller's batch, and a second run would write the state twice. Under a
        rank agreement the entry is kept (every rank's pool holds the same
        entries), and ranks whose own run did not fail take this path too.
        """
        if self.stateful:
            if self._ranks is None:
                del self._entries[key]
            assert error is not None
            raise error
        try:
            out = self._ran_eagerly(args, kwargs)
        except Exception:
            if self._ranks is None:
                self._entries.pop(key, None)
            raise
        logger.warning("gfxgraph: bucket %d runs eagerly from now on: the model raised on the padded inputs "
                       "but not on the caller's own: %s", key[0], entry.failed)
        entry.reason = "padded_run_failed"
        stats.record_fallback(entry.reason, entry.failed or "")
        return out

    def _warm_as_result(self, warm: Any, copy: bool) -> Any:
        """A first call's warm-up run returned as its result (eager-like: no graph output to slice)."""
        record_on_current_stream(pytree.tree_leaves(warm))
        if copy:  # it may alias the static input buffers
            warm = clone_tree(warm)
        self._last_eager = warm
        return _EAGER

    def _note_input_writes(self, before: tuple[int, ...]) -> None:
        """The model wrote its own input buffers (in place) if their versions moved: from then on
        no padding row is trusted to hold ``pad_value``, so every padded call fills."""
        inputs = self._inputs
        if inputs is not None and not inputs.mutated and inputs.versions() != before:
            inputs.mutated = True
            inputs.dirty = self._table.largest
            logger.info("gfxgraph: the model writes its inputs in place: padding rows are refilled on every call")

    def _padded_eager(self, entry: Bucket, leaves: list[Any], batch: int, args: tuple[Any, ...],
                      kwargs: dict[str, Any], copy: bool) -> Any:
        """``simulate_padding`` without a GPU: the padded pipeline of a replay, the model run eagerly,
        with the GPU path's rules for a model that raises on the padded inputs and for unknown outputs."""
        assert self._inputs is not None
        a, k = self._inputs.bucket_args(entry.size, leaves)
        versions = self._inputs.versions()
        try:
            with torch.no_grad():
                outputs = self.model_fn(*a, **k)
        except Exception as exc:
            self._note_input_writes(versions)
            if self._ranks is not None:  # agreed at the bucket's simulated capture; a later failure is the model's
                raise
            entry.failed = f"bucket {entry.size}: {type(exc).__name__}: {exc}"
            return self._after_failed_padded_run(entry, (entry.size, entry.key), exc, args, kwargs)
        self._note_input_writes(versions)
        layout = self._output_layout(entry, outputs, leaves)
        if batch < entry.size and not layout.known:
            stats.record_fallback("unknown_outputs", UNKNOWN_OUTPUTS)
            return self._ran_eagerly(args, kwargs)
        stats.record_fallback("no_gpu", probe().reason or "")  # one reason per call
        return layout.result(pytree.tree_leaves(outputs), batch, batch_dim=self.batch_dim, copy=copy, cache=False)

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with torch.no_grad():
            return self.model_fn(*args, **kwargs)

    # --------------------------------------------------------------- capture
    def _capture(self, bucket: int, key: tuple[int, tuple[Hashable, ...]], leaves: list[Any], *,
                 keep_warm: bool, freeze_gc: bool = True) -> tuple[Bucket, Captured]:
        """Capture ``bucket`` for ``key``; the entry is stored only once its outcome is known.

        A ``KeyboardInterrupt`` (any ``BaseException``) during warm-up or capture
        leaves no entry behind, so the next call tries again; the capture itself
        was already ended cleanly by the graph. Under a rank agreement every
        rank captures or none does, the simulated path included (:mod:`.agreed`).
        """
        entry = Bucket(bucket, key[1])
        ranks = self._ranks
        if not self._graphs_available and (ranks is None or not self.simulate_padding):
            self._entries[key] = entry
            return entry, Captured()  # runs the padded pipeline eagerly (see _padded_eager)
        assert self._inputs is not None
        if bucket not in self._table.buckets:
            log_once(("exact_bucket", id(self), bucket), logging.INFO, "gfxgraph: batch %d is not a bucket and the "
                     "model is stateful (never padded): it gets a graph of exactly %d rows", bucket, bucket)
        a, k = self._inputs.bucket_args(bucket, leaves)
        versions = self._inputs.versions()
        if ranks is None:
            captured = self._capturer.capture(lambda: self.model_fn(*a, **k), bucket, keep_warm=keep_warm,
                                              freeze_gc=freeze_gc)
        else:
            captured = agreed_capture(ranks, self._capturer if self._graphs_available else None,
                                      lambda: self.model_fn(*a, **k), bucket, key, keep_warm=keep_warm,
                                      freeze_gc=freeze_gc, stateful=self.stateful)
        self._note_input_writes(versions)
        entry.reason, entry.failed = captured.reason, captured.failed
        if captured.outputs is not None:
            self._output_layout(entry, captured.outputs, leaves)
        if captured.graph is not None:
            entry.graph = captured.graph
            entry.outputs = release_outputs(pytree.tree_leaves(captured.outputs))
        captured.outputs = None  # the graph's output memory goes back to the pool
        self._entries[key] = entry
        return entry, captured

    def _output_layout(self, entry: Bucket, outputs: Any, leaves: list[Any]) -> OutputLayout:
        """Which outputs carry the batch, learnt once per constant-argument key."""
        inputs = self._inputs
        assert inputs is not None
        never_sliced = self.stateful or self.max_bucket == 1  # a stateful model is never padded, nor re-run
        probe: Callable[[], Any] | None = None
        if never_sliced:
            pass
        elif self._ranks is None:
            probe = functools.partial(probe_other_size, self.model_fn, inputs, leaves, entry.size, self.max_bucket)
        else:
            def run_at(size: int) -> Any:
                a, k = inputs.bucket_args(size, leaves)
                return self.model_fn(*a, **k)

            probe = functools.partial(agreed_probe, self._ranks, run_at, probe_sizes(entry.size, self.max_bucket))
        layout = learn_output_layout(outputs, entry.size, batch_dim=self.batch_dim, given=self.batched_outputs,
                                     known=self._out_flags.get(entry.key), probe=probe)
        if layout.batched is not None:
            self._out_flags[entry.key] = layout.batched
        entry.layout = layout
        return layout
