"""ShapeBucketPool: one graph per batch-size bucket, padding where it is proven sound, one memory pool.

Serving stacks capture one graph per batch size and pad each request up to
the next captured size; ``torch.compile(mode="reduce-overhead")`` re-records a
graph per new shape instead. This is the bucketing done once, as an object:
a small façade over its collaborators:

* :class:`~.options.PoolOptions`: every option, checked once, frozen;
* :mod:`~hipgraph_bridge.padding.layout`: the call's layout, fixed by the first call
  (``TypeError``/``ValueError`` naming what was expected for a call that differs);
* :class:`~.engine.BucketEngine`: the calls themselves (replay, capture on first
  use, the row analysis that decides padding, the padding check, eager fallbacks);
* a :class:`~hipgraph_bridge.ranks.decider.Decider`: alone, or with every rank of
  a process group (:class:`AgreedShapeBucketPool`, made when ``process_group`` is given).

Calls are serialised by a lock; one from another stream waits for the previous one.
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
from ..errors import RankAgreementError
from ..fallbacks import Fallback, Reason
from ..graph.capture import frozen_gc
from ..log import logger
from ..padding.layout import BATCHED, CallLayout, QuickPlan, classify
from ..padding.rows import RowVerdict
from ..padding.staging import StaticInputs
from ..ranks.agreement import Round
from ..platform import require_gpu
from ..ranks.decider import AgreedDecider, Decider, decider_for
from ..tree import clone_tree
from .device_sized import DeviceSizedCall
from .engine import BucketEngine
from .options import BatchedOutputs, PoolOptions
from .static_io import StaticIO, guard_outputs

__all__ = ["ShapeBucketPool", "AgreedShapeBucketPool"]


class ShapeBucketPool:
    """Callable pool of graphs, one per batch-size bucket; see the module docstring.

    Args:
        model_fn: the model; called as ``model_fn(*args, **kwargs)``.
        buckets: batch sizes to capture (validated, sorted, de-duplicated);
            default :func:`~hipgraph_bridge.graph.buckets.default_buckets` up to
            ``max_batch_size`` (256; give one or the other).
        batch_dim: the dimension that carries the batch in the inputs.
        static_args: positions (ints) or keyword names (strs) of tensor arguments
            without a batch dimension; they are copied into static buffers each call.
        pad_value: the value padding rows are filled with (default 0); None leaves
            them as the first call found them (zeros).
        copy_outputs: return copies (default). ``False`` returns views of the
            graph's static outputs: fastest, but overwritten by the next call.
        oversize: ``"eager"`` (default) runs a batch above the largest bucket
            eagerly, counted and logged once; ``"error"`` raises ``ValueError``.
        warmup_iters: runs of the model before a bucket's capture (default 1). On a
            bucket's first call the first of them is the call's own run, at its own
            batch size, and answers it; 0 captures without warm-up, then replays.
        vram_cap: fraction of device memory; a capture that would pass it runs
            eagerly instead (reason ``vram_cap``). Default: ``GFXGRAPH_VRAM_CAP`` or 0.90.
        capture_error_mode: passed to ``capture_begin``; ``"thread_local"`` (default) keeps
            the pool's captures from breaking CUDA work in other threads.
        generators: extra ``torch.Generator``\\ s to register with every graph so
            their random streams advance per replay (the default generator always is).
        progress: show a tqdm bar in :meth:`capture_all`.
        batched_outputs: one flag per output leaf saying whether it carries the batch
            (in ``batch_dim``), or a function of the outputs returning them. Default:
            read from the trace of the model's first run.
        stateful: None (default): found by the trace (a write to a tensor the call did
            not create: a buffer, a parameter, a KV cache a closure holds; or to its own
            inputs). A stateful model runs once per call (no second warm-up, no check,
            no validation re-run) and is never padded: each batch size gets a graph of
            exactly its size, in the same memory pool. True or False overrides the trace.
        rows_independent: None (default): padding is applied only where the trace
            proves rows independent, and each bucket's padding is checked on its first
            padded call. True vouches for a model the trace cannot see through (an op it
            does not know, a host read): it is padded, and the check still runs; the risk
            is a model whose rows interact in a way no padding content shows (the batch
            size used as a value, a coupling the poisons happen to miss), which then
            returns wrong rows silently. False never pads.
        simulate_padding: without a GPU, run calls the way a replay would (padded
            static buffers, sliced outputs) instead of on your own arguments: for
            checking what padding does to a model, on any machine. Off by default.
        process_group: for a model that calls torch.distributed collectives: a
            ``ProcessGroup`` or a :class:`~hipgraph_bridge.RankAgreement`. Every rank then
            picks the same bucket, captures in the same order, pads or not together,
            and falls back together (:mod:`hipgraph_bridge.ranks`). Costs one host
            round per call. Build the pools in the same order on every rank.

    Padding, state and the model's Python: :mod:`.engine`. Inputs that require
    grad, with grad mode on, run eagerly (reason ``grad``): graphs here are for
    inference; use ``torch.cuda.make_graphed_callables`` to train.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ShapeBucketPool:
        if cls is ShapeBucketPool and kwargs.get("process_group") is not None:
            cls = AgreedShapeBucketPool
        return super().__new__(cls)

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
        stateful: bool | None = None,
        rows_independent: bool | None = None,
        simulate_padding: bool = False,
        process_group: Any = None,
    ) -> None:
        _check_model(model_fn)
        opts = PoolOptions.create(buckets, max_batch_size=max_batch_size, batch_dim=batch_dim,
                                  static_args=static_args, pad_value=pad_value, copy_outputs=copy_outputs,
                                  oversize=oversize, warmup_iters=warmup_iters, vram_cap=vram_cap,
                                  capture_error_mode=capture_error_mode, generators=generators, progress=progress,
                                  batched_outputs=batched_outputs, stateful=stateful,
                                  rows_independent=rows_independent, simulate_padding=simulate_padding,
                                  process_group=process_group)
        self._setup(model_fn, opts, verdict=None, what="ShapeBucketPool")

    @classmethod
    def from_options(cls, model_fn: Callable[..., Any], options: PoolOptions, *, verdict: RowVerdict | None = None,
                     what: str = "ShapeBucketPool") -> ShapeBucketPool:
        """A pool from checked options (the compile backend's), with the row analysis given when known."""
        _check_model(model_fn)
        self = super().__new__(AgreedShapeBucketPool if options.process_group is not None else cls)
        self._setup(model_fn, options, verdict=verdict, what=what)
        return self

    def _setup(self, model_fn: Callable[..., Any], opts: PoolOptions, *, verdict: RowVerdict | None,
               what: str) -> None:
        self.model_fn = model_fn
        self.options = opts
        self._what = what
        self._decider: Decider = decider_for(opts.process_group, what)
        self._lock = threading.RLock()
        self._engine = BucketEngine(model_fn, opts, self._decider, what=what, lock=self._lock, verdict=verdict)
        self._classify = functools.partial(classify, batch_dim=opts.batch_dim, static_args=opts.static_args)
        self._quick: QuickPlan | None = None  # the hot path's flattening, for plain positional layouts
        self._epoch = [0]  # debug mode: calls so far; an output view from an earlier one is stale

    # ------------------------------------------------------------------ options
    @property
    def buckets(self) -> list[int]:
        return list(self.options.buckets)

    @property
    def max_bucket(self) -> int:
        return self.options.buckets[-1]

    @property
    def batch_dim(self) -> int:
        return self.options.batch_dim

    @property
    def copy_outputs(self) -> bool:
        return self.options.copy_outputs

    @property
    def stateful(self) -> bool:
        """Whether the model writes state it keeps (given, or found by the trace of its first call)."""
        with self._lock:
            return self.options.stateful if self.options.stateful is not None \
                else any(ks.stateful for ks in self._engine.keys.values())

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing this pool's graphs (warm-ups included)."""
        return self._engine.capturer.seconds

    # ------------------------------------------------------------------ call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this batch through its bucket's graph; see :mod:`.engine`.

        Cost over a hand-written bucket loop: checking the arguments against the
        layout, one lock, two dict lookups. Raises ``TypeError``/``ValueError`` for
        arguments that do not fit the pool (naming what was expected).
        """
        quick = self._quick
        matched = quick.match(args) if quick is not None and not kwargs else None
        classified = None if matched is not None else self._classify(args, kwargs)  # outside the lock
        with self._lock:
            engine = self._engine
            if matched is not None and self._quick is quick:
                if config.switches.debug:
                    self._epoch[0] += 1
                return engine.call(engine.inputs, matched[0], matched[1], args, kwargs,  # type: ignore[arg-type]
                                   self.options.copy_outputs)
            # the first call, another layout, inputs that require grad, or the pool was closed meanwhile
            return self._classified_call(args, kwargs, *(classified or self._classify(args, kwargs)))

    def _classified_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any],
                         layout: CallLayout, batch: int, copy: bool | None = None) -> Any:
        with self._lock:
            if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
                return self._with_grad(args, kwargs)
            if config.switches.debug:
                self._epoch[0] += 1
            engine = self._engine
            first = engine.inputs is None
            inputs = self._fixed_inputs(leaves, layout)
            try:
                return engine.call(inputs, leaves, batch, args, kwargs,
                                   self.options.copy_outputs if copy is None else copy)
            except BaseException:
                if first and not engine.entries:  # a first call that failed does not fix the layout
                    engine.inputs, self._quick = None, None
                    engine.keys.clear()
                raise

    def _with_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        stats.record_fallback(_GRAD)
        return self.model_fn(*args, **kwargs)

    def _fixed_inputs(self, leaves: list[Any], layout: CallLayout) -> StaticInputs:
        """The static inputs of the fixed layout; the first call fixes it (allocating the buffers)."""
        engine = self._engine
        inputs = engine.inputs
        if inputs is not None:
            if layout != inputs.layout:
                inputs.layout.check_matches(layout)
            return inputs
        if engine.graphs:
            layout.check_on("cuda")
        inputs = engine.inputs = StaticInputs(layout, leaves, engine.padded_table, batch_dim=self.options.batch_dim,
                                              pad_value=self.options.pad_value)
        if QuickPlan.applies(layout):
            self._quick = QuickPlan(layout, leaves, self.options.batch_dim)
        return inputs

    def capture_all(self, *example_args: Any, **example_kwargs: Any) -> dict[str, Any]:
        """Capture every bucket now, largest first (so smaller ones reuse its memory).

        The example arguments fix the layout (any batch size; their rows are
        repeated into the buffers). Shows a tqdm bar when ``progress``; the
        garbage collector stays frozen for the whole run. Logs and returns the
        time and graph-pool memory it took. Buckets that fail run eagerly later.
        Runs the model ``warmup_iters + 1`` times per bucket on the example rows
        (the first capture traced; ``min(warmup_iters, 1) + 1`` times for a model
        that writes state): reset model state after it.
        """
        leaves, layout, batch = self._classify(example_args, example_kwargs)
        with self._lock:
            engine = self._engine
            inputs = self._fixed_inputs(leaves, layout)
            if engine.graphs:
                engine.order.after_previous()  # a replay still in flight may read the buffers
            inputs.fill_example(leaves, batch)
            key = inputs.layout.consts(leaves) if inputs.layout.has_consts else ()
            todo = [b for b in reversed(self.options.buckets) if (b, key) not in engine.entries]
            graphs = engine.graphs
            t0, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0] if graphs else 0
            with frozen_gc():
                for b in tqdm(todo, desc="gfxgraph capture", unit="graph", leave=False,
                              disable=not (self.options.progress and len(todo) > 1)):
                    engine.capture_ahead(inputs, leaves, b, key)
            seconds = time.perf_counter() - t0
            report = {"buckets": len(todo), "seconds": seconds, "pool_bytes": self.pool_bytes(),
                      "captured": sum(1 for b in todo if (b, key) in engine.entries
                                      and engine.entries[(b, key)].graph is not None),
                      "device_bytes_used": (free_before - torch.cuda.mem_get_info()[0]) if free_before else 0}
        logger.info("gfxgraph: captured %d/%d buckets in %.2f s; graph pool %.1f MiB",
                    report["captured"], report["buckets"], seconds, report["pool_bytes"] / 2**20)
        return report

    # ------------------------------------------------------------------ zero-copy calls
    def static_io(self, batch_size: int) -> StaticIO:
        """The zero-copy way to call this pool at ``batch_size`` rows (:mod:`.static_io`).

        Write the inputs into the returned object's ``args``/``kwargs`` views and
        call its ``run()``; it returns views of the outputs, valid until the next
        call. Needs the layout fixed (one call, or :meth:`capture_all`) and no
        constant (non-tensor) arguments. Raises ``ValueError`` for a batch size
        outside ``[1, largest bucket]``; a ``StaticIO`` of a closed pool raises on ``run()``.
        """
        largest = self.max_bucket
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= largest:
            above = isinstance(batch_size, int) and batch_size > largest
            raise ValueError(f"batch_size: expected an int in [1, {largest}], got {batch_size!r}"
                             + (f" (above the largest bucket {largest})" if above else ""))
        with self._lock:
            inputs = self._engine.inputs
            if inputs is None:
                raise RuntimeError("static_io(): the call layout is not fixed yet; call the pool once or "
                                   "capture_all(example arguments) first")
            if inputs.layout.has_consts:
                raise ValueError(f"static_io(): expected tensor arguments only, got the layout "
                                 f"{inputs.layout.describe()}; non-tensor arguments need the ordinary call")
            io = StaticIO(self._run_io, inputs, batch_size)
            io.use(self._engine.fast_io(batch_size))  # a size already checked replays from the first run()
            return io

    def _run_io(self, io: StaticIO) -> Any:
        """A zero-copy call off its fast path (:meth:`~.engine.FastCall.zero_copy`): the checked call on the views."""
        switches = config.switches
        with self._lock:
            engine = self._engine
            if engine.inputs is not io.inputs:
                raise RuntimeError(f"{io!r}: its pool was closed and its buffers released; ask pool.static_io() "
                                   "again")
            if switches.debug:
                io.check_intact()
                self._epoch[0] += 1
            out = engine.call(io.inputs, io.leaves, io.batch_size, io.args, io.kwargs, False)
            io.use(engine.fast_io(io.batch_size, out))
            return guard_outputs(out, self._epoch) if switches.debug else out

    def device_sized(self, *example_args: Any, device_launch: bool = True, **example_kwargs: Any) -> DeviceSizedCall:
        """Calls whose row count is a device tensor: ``call = pool.device_sized(example); out = call(n, x)``.

        One host launch per call picks the bucket on the GPU and launches its
        graph from the device (CUDA 12+), where padding is proven safe; else a
        host read of ``n`` and an ordinary call, with the reason
        (:mod:`.device_sized`). Captures every bucket first (:meth:`capture_all`),
        then one device graph per bucket, each checked with poisoned padding.
        ``device_launch=False`` forces the host path (as HIP runs it).
        """
        require_gpu("ShapeBucketPool.device_sized")
        return DeviceSizedCall(self, example_args, example_kwargs, device_launch=device_launch)

    def replay_buffers(self, batch_size: int) -> Any:
        """Replay the bucket of ``batch_size`` on what the static input buffers hold now (no copies in).

        As :meth:`static_io` ``(batch_size).run()``, copied unless ``copy_outputs=False``.
        """
        out = self.static_io(batch_size).run()
        return clone_tree(out) if self.options.copy_outputs else out

    # ------------------------------------------------------------------ introspection
    @property
    def captured_buckets(self) -> list[int]:
        """Sizes with a captured graph (buckets, and exact sizes of an unpadded model), any constant key."""
        with self._lock:  # a first call in another thread may be adding entries
            return sorted({b for (b, _), e in self._engine.entries.items() if e.graph is not None})

    @property
    def failed_buckets(self) -> dict[int, str]:
        """Sizes that run eagerly, with the reason."""
        with self._lock:
            return {b: str(e.fallback) for (b, _), e in self._engine.entries.items() if e.fallback is not None}

    def bucket_for(self, batch_size: int) -> int | None:
        """The graph size a batch of ``batch_size`` rows runs in (with no constant arguments); None above the largest."""
        with self._lock:
            ks = self._engine.keys.get(())
            table = self._engine.padded_table if ks is not None and ks.padded else self._engine.exact_table
            return table.bucket_for(batch_size) if ks is not None else self._engine.padded_table.bucket_for(batch_size)

    def pool_bytes(self) -> int:
        """Bytes reserved by this pool's graphs, as the caching allocator reports them."""
        return self._engine.capturer.pool_bytes()

    @property
    def unpadded(self) -> Mapping[tuple[Hashable, ...], Fallback]:
        """Constant-argument keys that are not padded, with the reason (exact-size graphs serve them)."""
        with self._lock:
            return self._engine.unpadded()

    @property
    def row_coupled(self) -> Mapping[tuple[Hashable, ...], str]:
        """Keys not padded because their rows interact (the trace, or the padding check, showed it)."""
        return {k: f.detail for k, f in self.unpadded.items()
                if f.reason in (Reason.ROWS_COUPLED, Reason.PADDING_CHANGES_RESULTS)}

    @property
    def pool_handle(self) -> Any:
        """The shared memory-pool handle (None before the first capture)."""
        return self._engine.capturer.pool_handle

    @property
    def static_inputs(self) -> list[Any]:
        """The static buffers, per argument leaf (None for constants; empty before the first call)."""
        inputs = self._engine.inputs
        return [] if inputs is None else list(inputs.buffers)

    def close(self) -> None:
        """Release every graph and static buffer. The pool can be used again (it re-captures)."""
        with self._lock:
            self._engine.close()
            self._quick = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(buckets={self.buckets}, captured={self.captured_buckets}, "
                f"failed={sorted(self.failed_buckets)})")


_GRAD = Fallback(Reason.GRAD, "inputs require grad with grad mode on: the model runs eagerly, backward included "
                 "(graphs here are for inference: call under torch.no_grad() or torch.inference_mode(), or graph "
                 "training with torch.cuda.make_graphed_callables)")


def _check_model(model_fn: Any) -> None:
    if isinstance(model_fn, type):
        raise TypeError(f"model_fn: expected a callable model (a module instance or a function), got the class "
                        f"{model_fn.__name__} itself; instantiate it first, e.g. {model_fn.__name__}(...)")
    if not callable(model_fn):
        raise TypeError(f"model_fn: expected a callable, got {type(model_fn).__name__}")


class AgreedShapeBucketPool(ShapeBucketPool):
    """A pool whose every decision is taken with the other ranks of its process group (:mod:`hipgraph_bridge.ranks`).

    Each call starts with a host round that agrees the batch size (not with
    ``batch="trusted"``); under ``batch="max"`` a rank with fewer rows is grown
    to the agreed batch with ``pad_value`` rows and its outputs cut back.
    """

    _decider: AgreedDecider

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        decider = self._decider
        try:
            leaves, layout, batch = self._classify(args, kwargs)
            inputs = self._engine.inputs
            if inputs is not None and layout != inputs.layout:
                inputs.layout.check_matches(layout)
        except BaseException as exc:
            if decider.batch_rule != "trusted":  # the peers wait in this call's batch round
                decider.leave(Round.BATCH, 0, exc)
            raise
        agreed, sizes = decider.agree_batch(batch)
        ks = self._engine.keys.get(layout.consts(leaves) if layout.has_consts else ())
        if sizes and min(sizes) < agreed and (ks is not None and ks.decided and not ks.padded
                                              or config.switches.validate):
            # every rank sees the same sizes, so every rank raises here: a grown call is never compared with
            # a rank's own rows, and with rows that interact (or every result checked) it could differ unreported
            each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
            raise RankAgreementError(f"batch='max' grows the smaller ranks' calls ({each}) to {agreed} rows, but "
                                     "this model is not padded (or validation mode is on), so a grown call "
                                     "cannot be checked against eager; expected batch='equal' with one batch size")
        if not sizes or min(sizes) == agreed:
            return self._classified_call(args, kwargs, leaves, layout, batch)
        grown = _pad_rows(layout, leaves, agreed, batch_dim=self.options.batch_dim, pad_value=self.options.pad_value)
        a, k = layout.rebuild(grown)
        out = self._classified_call(a, k, grown, layout, agreed)
        if batch == agreed:
            return out
        ks = self._engine.keys.get(layout.consts(leaves) if layout.has_consts else ())
        rows = None if ks is None else ks.rows
        if rows is None:
            each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
            raise ValueError(f"{self._what}: the ranks' batch sizes differ ({each}) and which outputs carry the "
                             "batch is unknown, so they cannot be cut back; expected batched_outputs= (one flag "
                             "per output leaf)")
        out_leaves, spec = pytree.tree_flatten(out)
        return pytree.tree_unflatten([o.narrow(r.dim, 0, batch * r.inner) if r is not None else o
                                      for o, r in zip(out_leaves, rows)], spec)

    def static_io(self, batch_size: int) -> StaticIO:
        io = super().static_io(batch_size)
        io.use(None)  # its first run, as every one, starts with the ranks' round
        return io

    def _run_io(self, io: StaticIO) -> Any:
        self._decider.agree_batch(io.batch_size, exact=True)  # zero-copy views have fixed rows: every rank alike
        out = super()._run_io(io)
        io.use(None)  # every zero-copy call of an agreed pool starts with its round
        return out


def _pad_rows(layout: CallLayout, leaves: list[Any], rows: int, *, batch_dim: int,
              pad_value: float | int | bool | None) -> list[Any]:
    """The leaves with every batched tensor grown to ``rows`` (new rows hold ``pad_value``; 0 for None)."""
    out = []
    for leaf, kind in zip(leaves, layout.kinds):
        if kind == BATCHED and leaf.shape[batch_dim] < rows:
            shape = list(leaf.shape)
            shape[batch_dim] = rows
            grown = leaf.new_full(shape, 0 if pad_value is None else pad_value)
            grown.narrow(batch_dim, 0, leaf.shape[batch_dim]).copy_(leaf)
            leaf = grown
        out.append(leaf)
    return out
