"""ShapeBucketPool: one graph per batch-size bucket, padded inputs, one memory pool.

Serving stacks capture one graph per batch size and pad each request up to
the next captured size; ``torch.compile(mode="reduce-overhead")`` re-records a
graph per new shape instead. This is the bucketing done once, as an object.

Workflow of a call ``pool(*args, **kwargs)``:

1. Flatten the arguments and check them against the layout the first call
   fixed (:mod:`.layout`).
2. Pick the smallest bucket ``b >= B`` (:mod:`.buckets`). ``B`` above the largest
   bucket runs eagerly (reason ``oversize``) or raises with ``oversize="error"``.
3. Copy the tensors into the static buffers and pad rows ``[B, b)`` (:mod:`.buffers`).
4. Replay the bucket's graph. On a bucket's first use, warm up and capture
   it instead (:mod:`.capture`): the last warm-up run *is* this call's run,
   so with the default ``warmup_iters=1`` every call runs the model exactly
   once, and state the model advances (a KV cache's write position) moves as
   in eager mode. A capture that fails after the warm-up returns the
   warm-up's result when the batch filled the bucket. The model runs more
   than once for a call only with ``warmup_iters > 1``, outputs that differ
   between warm-up and capture, the probe run of :mod:`.outputs`, a bucket's
   first padded call (checked against eager, :mod:`.padding`) or validation
   mode; never for a ``stateful`` model.
5. Return the outputs sliced back to ``B`` rows, copied (``copy_outputs=True``,
   the default): every graph's output memory is handed back to the shared
   pool after capture, so 36 buckets cost about what the largest alone does,
   and any call may overwrite the static outputs of every bucket.

Eager calls (no GPU, oversize, a failed bucket) run the model on the caller's
own arguments; a padded call never returns what eager would not (:mod:`.padding`).
Calls are serialised by a lock, and one from another stream waits for the
previous one. :meth:`~ShapeBucketPool.capture_all` runs the model on the
example arguments: reset model state after it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from .. import config, stats
from .._torch_compat import pytree
from ..config import check_vram_cap, read_vram_cap
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import check_capture_mode, frozen_gc, record_on_current_stream
from ..graph.weak_outputs import release_outputs
from ..log import logger
from ..platform import probe
from ..tree import clone_tree
from .buckets import BucketTable, default_buckets, validate_buckets
from .buffers import StaticInputs
from .capture import BucketCapturer, Captured
from .entry import MISSING, Bucket
from .layout import CallLayout, QuickPlan, classify
from .options import check_pool_options
from .ordering import CallOrder
from .outputs import BatchedOutputs, OutputLayout, check_batched_outputs, learn_output_layout, probe_other_size
from .padding import UNKNOWN_OUTPUTS, PaddingGuard

__all__ = ["ShapeBucketPool"]

_EAGER = object()  # the call ran eagerly (the result is in _last_eager): nothing to check


class ShapeBucketPool:
    """Callable pool of graphs, one per batch-size bucket; see the module docstring.

    Args:
        model_fn: the model; called as ``model_fn(*args, **kwargs)``.
        buckets: batch sizes to capture (validated, sorted, de-duplicated);
            default :func:`default_buckets` up to ``max_batch_size`` (256; give one or the other).
        batch_dim: the dimension that carries the batch in inputs and outputs.
        static_args: positions (ints) or keyword names (strs) of tensor arguments
            without a batch dimension; they are copied into static buffers each call.
        pad_value: value of the padding rows (default 0); None leaves them as they are.
        copy_outputs: return copies (default). ``False`` returns views of the
            graph's static outputs: fastest, but overwritten by the next call.
        oversize: ``"eager"`` (default) runs a batch above the largest bucket
            eagerly, counted and logged once; ``"error"`` raises ``ValueError``.
        warmup_iters: eager runs on the capture stream before each capture; on a
            bucket's first call the last one is that call's run (default 1: the
            model runs once per call). 0 captures without warm-up, then replays.
        vram_cap: fraction of device memory; a capture that would pass it runs
            eagerly instead (reason ``vram_cap``). Default: ``GFXGRAPH_VRAM_CAP`` or 0.90.
        capture_error_mode: passed to ``capture_begin``; ``"thread_local"`` (default) keeps
            the pool's captures from breaking CUDA work in other threads.
        generators: extra ``torch.Generator``\\ s to register with every graph so
            their random streams advance per replay (the default generator always is).
        progress: show a tqdm bar in :meth:`capture_all`.
        batched_outputs: one flag per output leaf saying whether it carries the batch,
            or a function of the outputs returning them. Default: learnt with one
            extra eager run at another batch size (:mod:`.outputs`).
        stateful: the model writes state it keeps (a static KV cache): it is never
            run twice for one call (no validation re-run, no padding check, no output
            probe) and never padded (a batch that is not a bucket runs eagerly).
        simulate_padding: without a GPU, run calls the way a replay would (padded
            static buffers, sliced outputs) instead of on your own arguments: for
            checking what padding does to a model, on any machine. Off by default.

    Padding rules (stateful models, a model whose rows interact): :mod:`.padding`.
    Inputs that require grad, with grad mode on, run eagerly (reason ``grad``):
    graphs here are for inference; use ``torch.cuda.make_graphed_callables`` to train.
    """

    def __init__(
        self,
        model_fn: Callable[..., Any],
        buckets: Iterable[int] | None = None,
        *,
        max_batch_size: int | None = None,
        batch_dim: int = 0,
        static_args: Collection[int | str] = (),
        pad_value: float | int | bool | None = 0,
        copy_outputs: bool = True,
        oversize: Literal["eager", "error"] = "eager",
        warmup_iters: int = 1,
        vram_cap: float | None = None,
        capture_error_mode: str = "thread_local",
        generators: Sequence[torch.Generator] = (),
        progress: bool = True,
        batched_outputs: BatchedOutputs = None,
        stateful: bool = False,
        simulate_padding: bool = False,
    ) -> None:
        check_pool_options(model_fn, buckets, max_batch_size, batch_dim, oversize, warmup_iters, pad_value,
                           static_args, generators, copy_outputs=copy_outputs, progress=progress, stateful=stateful,
                           simulate_padding=simulate_padding)
        self.model_fn = model_fn
        self.buckets: list[int] = (validate_buckets(buckets) if buckets is not None
                                   else default_buckets(256 if max_batch_size is None else max_batch_size))
        self.max_bucket = self.buckets[-1]
        self.batch_dim = batch_dim
        self.static_args = frozenset(static_args)
        self.pad_value = pad_value
        self.copy_outputs = copy_outputs
        self.oversize = oversize
        self.warmup_iters = warmup_iters
        self.progress = progress
        self.batched_outputs = check_batched_outputs(batched_outputs)
        self.stateful = stateful
        self.simulate_padding = simulate_padding
        self._padding = PaddingGuard(stateful=stateful)
        self._classify = functools.partial(classify, batch_dim=batch_dim, static_args=self.static_args)
        self._table = BucketTable(self.buckets)
        self.vram_cap = read_vram_cap() if vram_cap is None else check_vram_cap(vram_cap)
        self.capture_error_mode = check_capture_mode(capture_error_mode)
        self.generators = tuple(generators)
        self._capturer = BucketCapturer(warmup_iters=warmup_iters, vram_cap=self.vram_cap,
                                        capture_error_mode=self.capture_error_mode, generators=self.generators)
        self._graphs_available = probe().graphs_available
        self._lock = threading.RLock()
        self._inputs: StaticInputs | None = None
        self._quick: QuickPlan | None = None  # the hot path's flattening, for plain positional layouts
        self._entries: dict[tuple[int, tuple[Hashable, ...]], Bucket] = {}
        self._out_flags: dict[tuple[Hashable, ...], tuple[bool, ...]] = {}  # learnt batched-output flags
        self._order = CallOrder()
        self._last_eager: Any = None  # under the lock: the result of a call that _replay/_first_call ran eagerly

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing this pool's graphs (warm-ups included)."""
        return self._capturer.seconds

    # ------------------------------------------------------------------ call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this batch through its bucket's graph; see the module docstring.

        Cost over a hand-written bucket loop: checking the arguments against the
        layout, one lock, one dict lookup. Raises ``TypeError``/``ValueError`` for
        arguments that do not fit the pool (naming what was expected).
        """
        quick = self._quick
        matched = quick.match(args) if quick is not None and not kwargs else None
        classified = None if matched is not None else self._classify(args, kwargs)  # outside the lock
        with self._lock:
            if matched is not None and self._quick is quick:
                leaves, batch = matched
                inputs = self._inputs
                assert inputs is not None  # a quick plan exists only with fixed inputs
                return self._call(inputs, leaves, batch, args, kwargs)
            # the first call, another layout, inputs that require grad, or the pool was closed meanwhile
            leaves, layout, batch = classified or self._classify(args, kwargs)
            if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
                return self._with_grad(args, kwargs)
            first = self._inputs is None
            inputs = self._fixed_inputs(leaves, layout)
            try:
                return self._call(inputs, leaves, batch, args, kwargs)
            except BaseException:
                if first and not self._entries:  # a first call that failed does not fix the layout
                    self._inputs, self._quick = None, None
                raise

    def _call(self, inputs: StaticInputs, leaves: list[Any], batch: int, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        """The call once its arguments fit the layout (under the lock)."""
        if batch > self.max_bucket:
            return self._oversize(batch, args, kwargs)
        if not self._graphs_available and not self.simulate_padding:
            stats.record_fallback("no_gpu", probe().reason or "")
            return self._eager(args, kwargs)
        bucket = self._table[batch]
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
            entry, out = self._first_call(bucket, (bucket, consts), leaves, batch, args, kwargs)
        else:
            out = self._replay(entry, leaves, batch, args, kwargs)
        if out is _EAGER:
            out, self._last_eager = self._last_eager, None  # not kept alive until the next eager call
            return out
        if (batch == entry.size or entry.padding_checked) and not config.switches.validate:
            return out  # the hot path: nothing to check
        return self._padding.answer(entry, batch, out, lambda: self._eager(args, kwargs), owner=self)

    def _replay(self, entry: Bucket, leaves: list[Any], batch: int, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        """The bucket's graph on the staged inputs (the padded pipeline, eagerly, when simulated)."""
        if entry.graph is None:
            return self._padded_eager(entry, leaves, batch, args, kwargs)
        layout = entry.layout
        assert layout is not None and entry.outputs is not None
        if batch < entry.size and not layout.known:  # learnt at this call's capture: cannot slice
            stats.record_fallback("unknown_outputs", UNKNOWN_OUTPUTS)
            return self._ran_eagerly(args, kwargs)
        entry.graph.replay()
        return layout.result(entry.outputs, batch, batch_dim=self.batch_dim, copy=self.copy_outputs, cache=True)

    def _fixed_inputs(self, leaves: list[Any], layout: CallLayout) -> StaticInputs:
        """The static inputs of the fixed layout; the first call fixes it (allocating the buffers)."""
        inputs = self._inputs
        if inputs is not None:
            if layout != inputs.layout:
                inputs.layout.check_matches(layout)
            return inputs
        if self._graphs_available:
            layout.check_on("cuda")
        inputs = self._inputs = StaticInputs(layout, leaves, self._table, batch_dim=self.batch_dim,
                                             pad_value=self.pad_value)
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
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Bucket, Any]:
        """Capture a bucket on its first call and answer the call (its warm-up run, when that can be)."""
        entry, captured = self._capture(bucket, key, leaves, keep_warm=True)
        warm = captured.warm
        if captured.failed is not None and captured.stage == "warm_up":
            return entry, self._after_failed_padded_run(entry, key, captured.error, args, kwargs)
        if warm is not None and entry.layout is not None:  # the capture ran (the VRAM cap may have undone it)
            out = entry.warm_result(warm, batch, batch_dim=self.batch_dim, copy=self.copy_outputs)
            if out is not MISSING:
                if entry.failed is not None:
                    stats.record_fallback(entry.reason, entry.failed)
                return entry, out
            if self.stateful:  # never run twice (batch == bucket here): the warm-up run is the answer
                return entry, self._warm_as_result(warm)
            logger.debug("gfxgraph: bucket %d: the warm-up's outputs differ from the captured ones; "
                         "this call replays the graph (the model ran twice)", bucket)
        elif warm is not None and entry.failed is not None and bucket == batch:
            # the capture failed after a good warm-up of exactly this batch: that run is the result
            stats.record_fallback(entry.reason, entry.failed)
            return entry, self._warm_as_result(warm)
        del warm, captured
        if entry.failed is not None:
            stats.record_fallback(entry.reason, entry.failed)
            return entry, self._ran_eagerly(args, kwargs)
        return entry, self._replay(entry, leaves, batch, args, kwargs)

    def _after_failed_padded_run(self, entry: Bucket, key: tuple[int, tuple[Hashable, ...]],
                                 error: Exception | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model raised on the padded buffers: on the caller's own arguments, its own error is the answer.

        If the caller's arguments run, the bucket runs eagerly from now on
        (reason ``padded_run_failed``); if they raise too, the entry is
        forgotten (a bad input, not a bad bucket) and that error propagates.
        A stateful model is not run again: the buffers held exactly the
        caller's batch, and a second run would write the state twice.
        """
        if self.stateful:
            del self._entries[key]
            assert error is not None
            raise error
        try:
            out = self._ran_eagerly(args, kwargs)
        except Exception:
            self._entries.pop(key, None)
            raise
        logger.warning("gfxgraph: bucket %d runs eagerly from now on: the model raised on the padded inputs "
                       "but not on the caller's own: %s", key[0], entry.failed)
        entry.reason = "padded_run_failed"
        stats.record_fallback(entry.reason, entry.failed or "")
        return out

    def _warm_as_result(self, warm: Any) -> Any:
        """A first call's warm-up run returned as its result (eager-like: no graph output to slice)."""
        record_on_current_stream(pytree.tree_leaves(warm))
        if self.copy_outputs:  # it may alias the static input buffers
            warm = clone_tree(warm)
        self._last_eager = warm
        return _EAGER

    def _padded_eager(self, entry: Bucket, leaves: list[Any], batch: int, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
        """``simulate_padding`` without a GPU: the padded pipeline of a replay, the model run eagerly,
        with the GPU path's rules for a model that raises on the padded inputs and for unknown outputs."""
        assert self._inputs is not None
        a, k = self._inputs.bucket_args(entry.size, leaves)
        try:
            with torch.no_grad():
                outputs = self.model_fn(*a, **k)
        except Exception as exc:
            entry.failed = f"bucket {entry.size}: {type(exc).__name__}: {exc}"
            return self._after_failed_padded_run(entry, (entry.size, entry.key), exc, args, kwargs)
        layout = self._output_layout(entry, outputs, leaves)
        if batch < entry.size and not layout.known:
            stats.record_fallback("unknown_outputs", UNKNOWN_OUTPUTS)
            return self._ran_eagerly(args, kwargs)
        stats.record_fallback("no_gpu", probe().reason or "")  # one reason per call
        return layout.result(pytree.tree_leaves(outputs), batch, batch_dim=self.batch_dim,
                             copy=self.copy_outputs, cache=False)

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with torch.no_grad():
            return self.model_fn(*args, **kwargs)

    # --------------------------------------------------------------- capture
    def _capture(self, bucket: int, key: tuple[int, tuple[Hashable, ...]], leaves: list[Any], *,
                 keep_warm: bool, freeze_gc: bool = True) -> tuple[Bucket, Captured]:
        """Capture ``bucket`` for ``key``; the entry is stored only once its outcome is known.

        A ``KeyboardInterrupt`` (any ``BaseException``) during warm-up or capture
        leaves no entry behind, so the next call tries again; the capture itself
        was already ended cleanly by the graph.
        """
        entry = Bucket(bucket, key[1])
        if not self._graphs_available:
            self._entries[key] = entry
            return entry, Captured()  # runs the padded pipeline eagerly (see _padded_eager)
        assert self._inputs is not None
        a, k = self._inputs.bucket_args(bucket, leaves)
        captured = self._capturer.capture(lambda: self.model_fn(*a, **k), bucket, keep_warm=keep_warm,
                                          freeze_gc=freeze_gc)
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
        probe = None if never_sliced else functools.partial(
            probe_other_size, self.model_fn, inputs, leaves, entry.size, self.max_bucket)
        layout = learn_output_layout(outputs, entry.size, batch_dim=self.batch_dim, given=self.batched_outputs,
                                     known=self._out_flags.get(entry.key), probe=probe)
        if layout.batched is not None:
            self._out_flags[entry.key] = layout.batched
        entry.layout = layout
        return layout

    def capture_all(self, *example_args: Any, **example_kwargs: Any) -> dict[str, Any]:
        """Capture every bucket now, largest first (so smaller ones reuse its memory).

        The example arguments fix the layout (any batch size; their rows are
        repeated into the buffers). Shows a tqdm bar when ``progress``; the
        garbage collector stays frozen for the whole run. Logs and returns the
        time and graph-pool memory it took. Buckets that fail run eagerly later.
        """
        leaves, layout, batch = self._classify(example_args, example_kwargs)
        with self._lock:
            inputs = self._fixed_inputs(leaves, layout)
            inputs.fill_example(leaves, batch)
            consts = inputs.layout.consts(leaves)
            todo = [b for b in reversed(self.buckets) if (b, consts) not in self._entries]
            t0, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0] if self._graphs_available else 0
            with frozen_gc():
                for b in tqdm(todo, desc="gfxgraph capture", unit="graph", leave=False,
                              disable=not (self.progress and len(todo) > 1)):
                    self._capture(b, (b, consts), leaves, keep_warm=False, freeze_gc=False)
            seconds = time.perf_counter() - t0
            report = {"buckets": len(todo), "seconds": seconds, "pool_bytes": self.pool_bytes(),
                      "captured": sum(1 for b in todo if self._entries[(b, consts)].graph is not None),
                      "device_bytes_used": (free_before - torch.cuda.mem_get_info()[0]) if free_before else 0}
        logger.info("gfxgraph: captured %d/%d buckets in %.2f s; graph pool %.1f MiB",
                    report["captured"], report["buckets"], seconds, report["pool_bytes"] / 2**20)
        return report

    def replay_buffers(self, batch_size: int) -> Any:
        """Replay the bucket of ``batch_size`` on what the static input buffers hold now (no copies in).

        Needs exactly one captured graph for that bucket (one constant-argument
        key). Returns the outputs as a call would (sliced, copied unless
        ``copy_outputs=False``).
        """
        bucket = self.bucket_for(batch_size)
        if bucket is None:
            raise ValueError(f"batch_size={batch_size} is above the largest bucket {self.max_bucket}")
        with self._lock:
            entries = [e for (b, _), e in self._entries.items() if b == bucket and e.graph is not None]
            if len(entries) != 1:
                raise RuntimeError(f"replay(batch_size={batch_size}): bucket {bucket} is not captured (or has "
                                   "several constant-argument variants); pass input_tensor= instead")
            entry = entries[0]
            assert entry.graph is not None and entry.layout is not None and entry.outputs is not None
            entry.graph.replay()
            return entry.layout.result(entry.outputs, batch_size, batch_dim=self.batch_dim,
                                       copy=self.copy_outputs, cache=True)

    # ------------------------------------------------------------ introspect
    @property
    def captured_buckets(self) -> list[int]:
        """Buckets with a captured graph (any constant-argument key)."""
        return sorted({b for (b, _), e in self._entries.items() if e.graph is not None})

    @property
    def failed_buckets(self) -> dict[int, str]:
        """Buckets that run eagerly, with the reason."""
        return {b: f"{e.reason}: {e.failed}" for (b, _), e in self._entries.items() if e.failed is not None}

    def bucket_for(self, batch_size: int) -> int | None:
        """The bucket a batch of ``batch_size`` rows runs in; None when above the largest."""
        return self._table.bucket_for(batch_size)

    def pool_bytes(self) -> int:
        """Bytes reserved by this pool's graphs, as the caching allocator reports them."""
        return self._capturer.pool_bytes()

    @property
    def row_coupled(self) -> Mapping[tuple[Hashable, ...], str]:
        """Constant-argument keys whose padded calls run eagerly because padding changed a result."""
        return self._padding.row_coupled

    @property
    def pool_handle(self) -> Any:
        """The shared memory-pool handle (None before the first capture)."""
        return self._capturer.pool_handle

    @property
    def static_inputs(self) -> list[Any]:
        """The static buffers, per argument leaf (None for constants; empty before the first call)."""
        return [] if self._inputs is None else list(self._inputs.buffers)

    def close(self) -> None:
        """Release every graph and static buffer. The pool can be used again (it re-captures)."""
        with self._lock:
            for entry in self._entries.values():
                if entry.graph is not None:
                    entry.graph.reset()
            self._entries.clear()
            self._inputs, self._quick = None, None
            self._order.forget()
            self._capturer.forget_growth()
            self._out_flags.clear()

    def __repr__(self) -> str:
        return (f"ShapeBucketPool(buckets={self.buckets}, captured={self.captured_buckets}, "
                f"failed={sorted(self.failed_buckets)})")
