"""ShapeBucketPool: one graph per batch-size bucket, padded inputs, one memory pool.

Serving stacks capture one graph per batch size and pad each request up to
the next captured size; ``torch.compile(mode="reduce-overhead")`` re-records a
graph per new shape instead. This is the bucketing done once, as an object.

Workflow of a call ``pool(*args, **kwargs)``:

1. Flatten the arguments and check them against the layout the first call
   fixed (:mod:`.layout`).
2. Pick the smallest bucket ``b >= B`` (:mod:`.buckets`). ``B`` above the largest
   bucket runs eagerly (reason ``oversize``) or raises with ``oversize="error"``.
3. Copy the tensors into the static buffers; rows ``[B, b)`` hold ``pad_value``
   (filled only when an earlier, larger call left real rows there: :mod:`.buffers`).
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

:meth:`~ShapeBucketPool.static_io` skips steps 1, 3 and 5's copies: the caller
writes into the buffers and reads the outputs in place (:mod:`.static_io`).

Eager calls (no GPU, oversize, a failed bucket) run the model on the caller's
own arguments; a padded call never returns what eager would not (:mod:`.padding`).
Calls are serialised by a lock, and one from another stream waits for the
previous one. :meth:`~ShapeBucketPool.capture_all` runs the model on the
example arguments: reset model state after it.

With ``process_group=`` (a model that calls torch.distributed collectives)
every rank makes each of these decisions together (:mod:`.ranks`,
:mod:`.agreed`): step 2 starts with a host round that agrees the batch size,
and a bucket's capture, VRAM-cap check, padding check and output probe end
with one, so no rank ever replays a graph while a peer runs eagerly.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from .. import config
from ..config import check_vram_cap, read_vram_cap
from ..errors import RankAgreementError
from ..graph.capture import check_capture_mode, frozen_gc
from ..log import logger
from ..platform import probe
from ..tree import clone_tree
from .agreed import agreed_probe, narrow_rows, pad_rows, slice_rows
from .buckets import BucketTable, default_buckets, validate_buckets
from .calls import BucketCalls
from .capture import BucketCapturer
from .entry import Bucket
from .buffers import StaticInputs
from .layout import CallLayout, QuickPlan, classify
from .options import check_pool_options
from .ordering import CallOrder
from .outputs import BatchedOutputs, check_batched_outputs, learn_output_layout, probe_sizes
from .padding import PaddingGuard
from .ranks import RankAgreement, RankSession, Round, as_agreement
from .static_io import StaticIO, guard_outputs

__all__ = ["ShapeBucketPool"]


def _agreement(process_group: Any, *, stateful: bool) -> RankAgreement | None:
    agreement = as_agreement(process_group)
    if agreement is not None and agreement.batch == "max" and stateful:
        raise ValueError("process_group with batch='max' and stateful=True: a stateful model is never padded, and "
                         "'max' grows a rank's batch with padding rows; expected batch='equal' or 'trusted' for a "
                         "stateful model")
    return agreement


class ShapeBucketPool(BucketCalls):
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
            probe) and never padded: a batch that is not a bucket gets a graph of exactly
            its size on first use (as ``reduce-overhead`` records one per shape), sharing the pool.
        simulate_padding: without a GPU, run calls the way a replay would (padded
            static buffers, sliced outputs) instead of on your own arguments: for
            checking what padding does to a model, on any machine. Off by default.
        process_group: for a model that calls torch.distributed collectives: a
            ``ProcessGroup`` or a :class:`~.ranks.RankAgreement` (which says how batch
            sizes are agreed, and the timeout). Every rank then picks the same bucket,
            captures in the same order, and falls back together: a capture, VRAM-cap
            refusal or padding check that fails on one rank makes every rank run that
            bucket eagerly, with the reason naming the rank (:mod:`.ranks`). Costs one
            host round per call. Build the pools in the same order on every rank.

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
        process_group: Any = None,
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
        agreement = _agreement(process_group, stateful=stateful)
        self._ranks: RankSession | None = None if agreement is None else agreement.session("ShapeBucketPool")
        self._padding = PaddingGuard(stateful=stateful, ranks=self._ranks)
        self._classify = functools.partial(classify, batch_dim=batch_dim, static_args=self.static_args)
        # a stateful model is never padded: a batch that is not a bucket gets a graph of exactly its rows
        self._table = BucketTable(self.buckets, exact=stateful)
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
        self._epoch = [0]  # debug mode: calls so far; an output view from an earlier one is stale

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing this pool's graphs (warm-ups included)."""
        return self._capturer.seconds

    # ------------------------------------------------------------------ call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this batch through its bucket's graph; see the module docstring.

        Cost over a hand-written bucket loop: checking the arguments against the
        layout, one lock, one dict lookup (and one host round with the other
        ranks under ``process_group``). Raises ``TypeError``/``ValueError`` for
        arguments that do not fit the pool (naming what was expected).
        """
        if self._ranks is not None:
            return self._agreed_call(self._ranks, args, kwargs)
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
            return self._classified_call(args, kwargs, *(classified or self._classify(args, kwargs)))

    def _classified_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any],
                         layout: CallLayout, batch: int) -> Any:
        with self._lock:
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

    def _agreed_call(self, ranks: RankSession, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call under a rank agreement: the batch round, then the call at the agreed batch size.

        Arguments that do not fit raise on this rank after telling the others
        (they raise too). Under ``batch="max"`` a rank with fewer rows than the
        agreed batch is grown to it with ``pad_value`` rows and its outputs cut back.
        """
        try:
            leaves, layout, batch = self._classify(args, kwargs)
            inputs = self._inputs
            if inputs is not None and layout != inputs.layout:
                inputs.layout.check_matches(layout)
        except BaseException as exc:
            if ranks.batch_rule != "trusted":  # the peers wait in this call's batch round
                ranks.leave(Round.BATCH, 0, exc)
            raise
        agreed, sizes = ranks.agree_batch(batch)
        if sizes and min(sizes) < agreed and (self._padding.row_coupled or config.switches.validate):
            # every rank sees the same sizes, so every rank raises here: a grown call is never compared with
            # a rank's own rows, and with rows that interact (or every result checked) it could differ unreported
            each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
            raise RankAgreementError(f"batch='max' grows the smaller ranks' calls ({each}) to {agreed} rows, but "
                                     "this model's rows interact (or validation mode is on), so a grown call "
                                     "cannot be checked against eager; expected batch='equal' with one batch size")
        if not sizes or min(sizes) == agreed:
            return self._classified_call(args, kwargs, leaves, layout, batch)
        grown = pad_rows(layout, leaves, agreed, batch_dim=self.batch_dim, pad_value=self.pad_value)
        a, k = layout.rebuild(grown)
        out = self._classified_call(a, k, grown, layout, agreed)
        flags = self._agreed_flags(ranks, out, layout, grown, agreed, sizes)  # on every rank: it may run the model
        return out if batch == agreed else slice_rows(out, flags, batch, batch_dim=self.batch_dim)

    def _agreed_flags(self, ranks: RankSession, out: Any, layout: CallLayout, leaves: list[Any], rows: int,
                      sizes: tuple[int, ...]) -> tuple[bool, ...]:
        """Which outputs carry the batch, to cut a grown call back (learnt with every rank if not known yet)."""
        consts = layout.consts(leaves) if layout.has_consts else ()
        with self._lock:
            flags = self._out_flags.get(consts)
            if flags is not None:
                return flags

            def run_at(n: int) -> Any:
                a, k = layout.rebuild(narrow_rows(layout, leaves, n, batch_dim=self.batch_dim))
                return self.model_fn(*a, **k)

            probe = functools.partial(agreed_probe, ranks, run_at, probe_sizes(rows, rows))
            learnt = learn_output_layout(out, rows, batch_dim=self.batch_dim, given=self.batched_outputs,
                                         known=None, probe=probe)
            if learnt.batched is None:
                each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
                raise ValueError(f"ShapeBucketPool: the ranks' batch sizes differ ({each}) and which outputs "
                                 "carry the batch could not be learnt, so they cannot be cut back; expected "
                                 "batched_outputs= (one flag per output leaf)")
            self._out_flags[consts] = learnt.batched
            return learnt.batched

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

    def static_io(self, batch_size: int) -> StaticIO:
        """The zero-copy way to call this pool at ``batch_size`` rows (:mod:`.static_io`).

        Write the inputs into the returned object's ``args``/``kwargs`` views and
        call its ``run()``; it returns views of the outputs, valid until the next
        call. Needs the layout fixed (one call, or :meth:`capture_all`) and no
        constant (non-tensor) arguments. Raises ``ValueError`` for a batch size
        outside ``[1, largest bucket]``; a ``StaticIO`` of a closed pool raises on ``run()``.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= self.max_bucket:
            above = isinstance(batch_size, int) and batch_size > self.max_bucket
            raise ValueError(f"batch_size: expected an int in [1, {self.max_bucket}], got {batch_size!r}"
                             + (f" (above the largest bucket {self.max_bucket})" if above else ""))
        with self._lock:
            inputs = self._inputs
            if inputs is None:
                raise RuntimeError("static_io(): the call layout is not fixed yet; call the pool once or "
                                   "capture_all(example arguments) first")
            if inputs.layout.has_consts:
                raise ValueError(f"static_io(): expected tensor arguments only, got the layout "
                                 f"{inputs.layout.describe()}; non-tensor arguments need the ordinary call")
            return StaticIO(self._run_io, inputs, batch_size, self._table[batch_size])

    def _run_io(self, io: StaticIO) -> Any:
        if self._ranks is not None:  # zero-copy views have fixed rows: every rank must run this size
            self._ranks.agree_batch(io.batch_size, exact=True)
        fast, switches = io.fast, config.switches
        if fast is not None and not (switches.validate or switches.debug):
            with self._lock:
                inputs, padded = self._inputs, fast[2]
                # still this pool's buffers, the padding still clean, and padded calls still allowed
                if inputs is io.inputs and not (padded and (inputs.dirty > io.batch_size or self._padding.row_coupled)):
                    if inputs.dirty < io.batch_size:
                        inputs.dirty = io.batch_size  # the caller wrote its rows
                    self._order.after_previous()
                    fast[0]()
                    return fast[1]
        with self._lock:
            if self._inputs is not io.inputs:
                raise RuntimeError(f"{io!r}: its pool was closed and its buffers released; ask pool.static_io() "
                                   "again")
            if switches.debug:
                io.check_intact()
            out = self._call(io.inputs, io.leaves, io.batch_size, io.args, io.kwargs, copy=False)
            entry = self._entries.get((io.bucket, ()))
            if entry is not None and entry.graph is not None and entry.layout is not None \
                    and (io.batch_size == io.bucket or entry.padding_checked) \
                    and out is entry.layout.result(entry.outputs, io.batch_size, batch_dim=self.batch_dim,
                                                   copy=False, cache=True):
                io.fast = (entry.graph.replay, out, io.batch_size < io.bucket)  # later runs skip the checks
            return guard_outputs(out, self._epoch) if switches.debug else out

    def replay_buffers(self, batch_size: int) -> Any:
        """Replay the bucket of ``batch_size`` on what the static input buffers hold now (no copies in).

        As :meth:`static_io` ``(batch_size).run()``, copied unless ``copy_outputs=False``.
        """
        out = self.static_io(batch_size).run()
        return clone_tree(out) if self.copy_outputs else out

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
