"""How a pool answers a call whose arguments fit its layout: replay, capture on first use, or run eagerly.

Per key of constant arguments the engine keeps what it knows of the model
(:class:`KeyState`): whether padding is proven sound for it, whether it
writes state, where its outputs carry the batch. A key whose padding is
refused runs in exact-size graphs (one per batch size, in the same memory
pool), as ``reduce-overhead`` records one per shape.

A call of ``n`` rows:

1. Above the largest bucket, or without a GPU: the model on the caller's own
   arguments (reasons ``oversize``, ``no_gpu``), counted and logged once.
2. ``b`` = the smallest bucket ``>= n`` (or ``n`` itself for an unpadded key).
   A graph for ``(b, key)``: copy the arguments in (padding rows hold
   ``pad_value``), replay, slice the outputs back to ``n`` rows, copy them.
3. No graph yet (the bucket's first call):

   a. the call's own run: the model on the static buffers' first ``n`` rows,
      on the capture stream. On the key's first call it is traced
      (:class:`~hipgraph_bridge.padding.rows.RowTracer`), which decides
      whether the key may be padded, whether the model writes state, and
      where its outputs carry the batch. Its result answers the call.
   b. ``warmup_iters - 1`` more warm-up runs at ``b`` rows (none for a model
      that writes state), then the capture at ``b`` rows.
   c. a padded bucket's first call is checked: the graph is replayed with the
      padding rows poisoned (:mod:`~hipgraph_bridge.padding.confirm`) and its
      real rows compared with each other and with (a)'s result. A difference
      stops padding for the key (reason ``padding_changes_results``).

   So the model's Python runs ``warmup_iters + 1`` times on a bucket's first
   call (its own run, the warm-ups, the capture), twice for a model that writes
   state (its run, and the capture, which executes no kernel), and never on a
   replay. With ``warmup_iters=0`` a call of exactly the bucket's size runs it
   once (the capture; a replay answers), a padded one twice (the capture, and
   its own run, the check's reference). A bucket first captured at its exact
   size or ahead of time (``capture_all``) runs it once on its first padded
   call: its own run, which answers it and is the check's reference. A check
   never runs it. A capture that fails is followed by an eager run on the
   caller's arguments (the call's answer), so with ``warmup_iters=0`` such a
   call runs it twice.
4. Without a GPU, ``simulate_padding`` runs the same pipeline eagerly: the
   model on the padded buffers where a replay would be (one run per call),
   the trace deciding padding as above; the poisoned replays need a graph.

Every method runs under the pool's lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .. import config, stats
from .._torch_compat import copy_all, pytree, raw_stream_of
from ..fallbacks import Fallback, Reason
from ..graph.buckets import BucketTable
from ..graph.capture import record_on_current_stream
from ..graph.capturer import Captured, Capturer
from ..graph.ordering import CallOrder
from ..graph.weak_outputs import release_outputs
from ..log import log_once, logger
from ..padding.confirm import confirm_padding
from ..padding.entry import MISSING, Entry
from ..padding.outputs import OutputLayout, flags_to_rows
from ..padding.rows import RowTracer, RowVerdict, Rows
from ..padding.staging import FillPolicy, StaticInputs
from ..platform import probe
from ..ranks.agreement import Round
from ..ranks.decider import Decider
from ..tree import clone_tree
from ..validation import checked_against_eager
from .options import PoolOptions

__all__ = ["BucketEngine", "KeyState", "FastCall", "training_layers"]

_UNKNOWN_OUTPUTS = Fallback(Reason.UNKNOWN_OUTPUTS, "which outputs carry the batch is unknown, so a padded result "
                            "cannot be sliced back; pass batched_outputs=")


@dataclass(frozen=True)
class FastCall:
    """What a call of one batch size does once its graph is checked (no constant arguments): copy the
    tensors in, replay, return the sliced outputs. Valid while the engine's ``generation`` is ``generation``."""

    generation: int
    batch: int
    padded: bool  # the bucket is larger than the batch and its padding is filled per call: it must be clean
    dsts: tuple[torch.Tensor, ...]  # the static view of each tensor argument
    sources: tuple[int, ...]  # and the index of its leaf in the call
    graph: Any  # the bucket's SafeCUDAGraph, replayed through its replay_parts() (valid with the generation)
    parts: tuple[Any, ...]
    # the graph's device: a replay launches on that device's current stream (CUDAGraph::replay guards it)
    device: int
    outputs: tuple[Any, ...]  # the static outputs sliced to the batch
    tree: Any  # those outputs as the call returns them uncopied (None: rebuild each call)
    rebuild: Callable[[list[Any]], Any]
    engine: Callable[[], Any]  # weak reference to the engine
    live: list[bool]  # the engine's cell of this generation: [False] once it moves on (zero-copy's one check)

    def result(self, copy: bool) -> Any:
        if copy:
            outs = self.outputs
            if len(outs) == 1 and self.tree is outs[0]:  # one tensor: the common case, without the list
                return outs[0].clone()
            return self.rebuild([o.clone() if isinstance(o, torch.Tensor) else o for o in outs])
        return self.tree if self.tree is not None else self.rebuild(list(self.outputs))

    def zero_copy(self, inputs: StaticInputs, slow: Callable[[], Any]) -> Callable[[], Any] | None:
        """A zero-copy call of this batch size on ``inputs`` (the caller wrote the rows): the replay and
        its checks, or ``slow()`` (the checked call) when this fast call no longer applies. None when
        the outputs are not one fixed tree (they are rebuilt per call, off this path)."""
        batch, padded, tree, graph, live = self.batch, self.padded, self.tree, self.graph, self.live
        launch, tick, mask, record = self.parts
        engine = self.engine()
        if engine is None or tree is None or not live[0] or engine.inputs is not inputs:
            return None
        lock, order = engine.lock, engine.order
        # no reference to the engine: it holds this FastCall (the StaticIO holds the pool anyway,
        # through its checked call, so the pool lives as long as the StaticIO)
        del engine
        acquire, release, device, now = lock.acquire, lock.release, self.device, time.perf_counter_ns
        # without a handle read, every call orders (after_previous; -1 never equals its None)
        stream_of = raw_stream_of if raw_stream_of is not None else (lambda device: -1)

        # Every check runs under the pool's lock, so a concurrent call that recaptures or closes (which
        # clears ``live``, as every move of the engine's generation does) is seen; the stream check is a
        # handle comparison (CallOrder.after_previous on a change). The launch is SafeCUDAGraph.replay's
        # own, inlined. On a slow host each bytecode counts against a ~3 us launch: acquire/release
        # cost half of a ``with`` block, and one cell read replaces the engine's generation check.
        def run() -> Any:
            acquire()
            try:
                if not live[0] or config.switches.checked or (padded and inputs.dirty > batch):
                    return slow()
                if inputs.dirty < batch:
                    inputs.dirty = batch
                if stream_of(device) != order.raw:
                    order.after_previous(device)
                if tick() & mask:
                    launch(graph)
                else:
                    t0 = now()
                    launch(graph)
                    record(now() - t0)
                return tree
            finally:
                release()

        return run


@dataclass
class KeyState:
    """What the engine knows of the model for one key of constant arguments."""

    decided: bool = False  # padding allowed or refused for good
    padded: bool = False
    refusal: Fallback | None = None  # why it is not padded
    stateful: bool = False
    rows: tuple[Rows | None, ...] | None = None  # where each output leaf carries the batch
    traced: bool = False  # a trace was taken (at one row, only its state and random findings count)
    provisional: bool = False  # padded for one capture: its trace decides (the run read batch values on the host)


def _on_device_of(inputs: StaticInputs, graphs: bool) -> Any:
    """The inputs' GPU as the current device while a call stages, warms up, captures or replays: the
    capture stream, the memory pool and the kernels then all live where the buffers do, whatever
    device the caller has current (a capture on another device's stream would record nothing)."""
    if graphs:
        for buf in inputs.buffers:
            if isinstance(buf, torch.Tensor) and buf.is_cuda:
                return torch.cuda.device(buf.device)
    return contextlib.nullcontext()


def training_layers(model: Any) -> Fallback | None:
    """Why a module in training mode must not be padded (batch norm, dropout), or None."""
    if not isinstance(model, torch.nn.Module) or not model.training:
        return None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training:
            what = "normalises over the batch and updates its running statistics"
        elif isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            what = "draws a random mask per row"
        else:
            continue
        return Fallback(Reason.TRAINING_LAYERS, f"{type(m).__name__} {name or '(the model)'!r} is in training mode "
                        f"and {what}: padding rows would change the result; call model.eval() for inference "
                        "(the pool captures exact-size graphs meanwhile)")
    return None


class BucketEngine:
    """The call machinery of one :class:`~.pool.ShapeBucketPool` (module docstring)."""

    def __init__(self, model_fn: Callable[..., Any], opts: PoolOptions, decider: Decider, *, what: str,
                 lock: Any = None, verdict: RowVerdict | None = None) -> None:
        self.model_fn = model_fn
        self.opts = opts
        self.decider = decider
        self.what = what
        self.lock = lock if lock is not None else threading.RLock()  # the pool's: every call holds it
        self.padded_table = BucketTable(list(opts.buckets))
        self.exact_table = BucketTable(list(opts.buckets), exact=True)
        self.capturer = Capturer(warmup_iters=opts.warmup_iters, vram_cap=opts.vram_cap,
                                 capture_error_mode=opts.capture_error_mode, generators=opts.generators)
        self.graphs = probe().graphs_available
        self.simulate = not self.graphs and opts.simulate_padding
        self.entries: dict[tuple[int, tuple[Hashable, ...]], Entry] = {}
        self.keys: dict[tuple[Hashable, ...], KeyState] = {}
        self.inputs: StaticInputs | None = None
        self.order = CallOrder()
        self.generation = 0  # moves whenever a key's table changes or the pool is closed (the fast calls' check)
        self.live = [True]  # this generation's cell, cleared when it moves (a zero-copy closure reads only this)
        self.fast: dict[int, FastCall] = {}  # batch -> its checked call, for the key of no constants
        self._given = verdict
        self._training = training_layers(model_fn)
        self._no_gpu = Fallback(Reason.NO_GPU, probe().reason or "")

    def _next_generation(self) -> None:
        """Invalidate every fast call (ordinary and zero-copy) taken so far."""
        self.live[0] = False
        self.live = [True]
        self.generation += 1

    # ------------------------------------------------------------------ the call
    def call(self, inputs: StaticInputs, leaves: list[Any], batch: int, args: tuple[Any, ...],
             kwargs: dict[str, Any], copy: bool) -> Any:
        """Answer one call (module docstring); ``copy`` overrides ``copy_outputs``.

        Cost once a batch size's graph is checked (no constant arguments): a dict lookup, one dispatch
        copying every tensor argument in (one launch per dtype), the stream check, the replay, the
        output views (cloned when ``copy``).
        """
        fast = self.fast.get(batch)
        if fast is not None and fast.generation == self.generation and not (fast.padded and inputs.dirty > batch) \
                and not config.switches.checked:
            order = self.order
            if raw_stream_of is None or raw_stream_of(fast.device) != order.raw:
                order.after_previous(fast.device)  # before the copies: the previous call may still read them
            dsts = fast.dsts
            if len(dsts) > 1:  # one dispatch (one launch per dtype) for all of them
                copy_all(dsts, [leaves[i] for i in fast.sources])
            elif dsts and leaves[fast.sources[0]] is not dsts[0]:
                dsts[0].copy_(leaves[fast.sources[0]])
            if inputs.dirty < batch:
                inputs.dirty = batch
            launch, tick, mask, record = fast.parts
            if tick() & mask:
                launch(fast.graph)
            else:
                t0 = time.perf_counter_ns()
                launch(fast.graph)
                record(time.perf_counter_ns() - t0)
            return fast.result(copy)
        out = self._call(inputs, leaves, batch, args, kwargs, copy)
        if not inputs.layout.has_consts and (fast is None or fast.generation != self.generation):
            self._remember(inputs, batch)
        return out

    def _remember(self, inputs: StaticInputs, batch: int) -> None:
        """Keep the fast call of ``batch`` once its graph answered a call (checked, when padded)."""
        ks = self.keys.get(())
        if ks is None or not self.graphs or batch > self.opts.buckets[-1]:
            return
        bucket = (self.padded_table if ks.padded else self.exact_table)[batch]
        entry = self.entries.get((bucket, ()))
        if entry is None or entry.graph is None or entry.layout is None or entry.outputs is None \
                or entry.fallback is not None or (batch < bucket and not entry.confirmed):
            return
        layout = entry.layout
        views, tree = layout.views(entry.outputs, batch)
        plan = inputs.plan(batch, bucket)
        dsts, sources = tuple(dst for dst, _, _ in plan), tuple(i for _, i, _ in plan)
        device = dsts[0].device.index if dsts and dsts[0].device.index is not None else 0
        # padding filled once (pad_value=None) is never refilled: a larger call before does not stop this one
        filled = batch < bucket and inputs.policy is FillPolicy.ALWAYS
        self.fast[batch] = FastCall(self.generation, batch, filled, dsts, sources, entry.graph,
                                    entry.graph.replay_parts(), device, tuple(views),
                                    tree, layout.rebuild, weakref.ref(self), self.live)

    def _call(self, inputs: StaticInputs, leaves: list[Any], batch: int, args: tuple[Any, ...],
              kwargs: dict[str, Any], copy: bool) -> Any:
        with _on_device_of(inputs, self.graphs):
            return self._call_here(inputs, leaves, batch, args, kwargs, copy)

    def _call_here(self, inputs: StaticInputs, leaves: list[Any], batch: int, args: tuple[Any, ...],
                   kwargs: dict[str, Any], copy: bool) -> Any:
        opts = self.opts
        if batch > opts.buckets[-1]:
            return self._oversize(batch, args, kwargs)
        if not self.graphs and not self.simulate:
            stats.record_fallback(self._no_gpu)
            return self.eager(args, kwargs)
        key = inputs.layout.consts(leaves) if inputs.layout.has_consts else ()
        ks = self.keys.get(key)
        if ks is None:
            ks = self.keys[key] = self._new_key()
        bucket = (self.padded_table if ks.padded else self.exact_table)[batch]
        entry = self.entries.get((bucket, key))
        if self.graphs:
            self.order.after_previous()
        if entry is not None and entry.fallback is not None:
            stats.record_fallback(entry.fallback)
            return self.eager(args, kwargs)
        inputs.stage(leaves, batch, bucket)
        if entry is None:
            return self._first_call(ks, inputs, leaves, batch, bucket, key, args, kwargs, copy)
        if entry.graph is None:
            return self._validated(self._simulated(entry, ks, inputs, leaves, batch, copy), ks, args, kwargs)
        if batch < bucket and not entry.confirmed:  # the bucket's first padded call: its own run answers it
            own = self._own_run(ks, inputs, leaves, batch, key, trace=False)
            return self._answer_from_own(entry, ks, inputs, leaves, batch, own, args, kwargs, copy)
        entry.graph.replay()
        assert entry.layout is not None and entry.outputs is not None
        return self._validated(entry.layout.result(entry.outputs, batch, copy=copy, cache=True), ks, args, kwargs)

    def _validated(self, out: Any, ks: KeyState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Validation mode: a graph's (or a simulated padded run's) result compared with the model on the
        caller's own arguments; the eager one is returned on a mismatch. A stateful model is never re-run."""
        if config.switches.validate and not ks.stateful:
            return checked_against_eager(out, self.eager(args, kwargs), owner=self, what=self.what)
        return out

    def eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model on the caller's own arguments."""
        with torch.no_grad():
            return self.model_fn(*args, **kwargs)

    def _oversize(self, batch: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        largest = self.opts.buckets[-1]
        if self.opts.oversize == "error":
            raise ValueError(f"batch size {batch} is above the largest bucket {largest}; "
                             "expected at most that (or construct the pool with oversize='eager')")
        stats.record_fallback(Fallback(Reason.OVERSIZE, f"batches above the largest bucket {largest}"))
        return self.eager(args, kwargs)

    # ------------------------------------------------------------------ what the engine knows
    def _new_key(self) -> KeyState:
        ks = KeyState()
        o = self.opts
        if self._given is not None:  # the compile backend read it from the graph
            self._decide(ks, self._given, rows_known=True)
        elif o.stateful is not None and o.rows_independent is not None and o.batched_outputs is not None \
                and not callable(o.batched_outputs):
            self._decide(ks, None, rows_known=True)  # the caller said everything a trace would tell
        return ks

    def _decide(self, ks: KeyState, verdict: RowVerdict | None, *, rows_known: bool, rows_seen: int = 0,
                outputs: Any = None) -> None:
        """Settle what a trace (or the caller) says about a key; refuse padding with the reason, or allow it."""
        o = self.opts
        ks.traced = ks.traced or verdict is not None
        ks.stateful = o.stateful if o.stateful is not None else bool(verdict is not None and verdict.stateful)
        refusal: Fallback | None = None
        if self._training is not None:
            refusal = self._training
        elif ks.stateful:
            refusal = Fallback(Reason.STATEFUL, "stateful=True" if o.stateful else
                               f"{verdict.detail if verdict else ''}: the model writes state it keeps, so it is "
                               "run once per call and never padded", logging.INFO)
        elif o.rows_independent is False:
            refusal = Fallback(Reason.UNPROVEN, "rows_independent=False: never padded", logging.INFO)
        elif verdict is not None and verdict.reason == Reason.RANDOM_OPS:
            refusal = Fallback(verdict.reason, verdict.detail, logging.INFO)
        elif o.rows_independent is True:
            pass  # the caller vouches; the poisoned replays still check each bucket
        elif verdict is None or not rows_known:
            return  # not decided yet: exact sizes until a trace with more than one row
        elif verdict.host_read and self.graphs and not ks.provisional:
            # the run branched on batch values, which a capture cannot do (a host read fails it): the graph's
            # own trace decides, and the padded graph is then checked against this run
            ks.provisional, ks.padded, ks.rows = True, True, self._output_rows(verdict, outputs, rows_seen)
            return
        elif verdict.reason is not None:
            refusal = Fallback(verdict.reason, verdict.detail)
        ks.rows = self._output_rows(verdict, outputs, rows_seen)
        if refusal is None and ks.rows is None and (verdict is not None or outputs is not None):
            refusal = _UNKNOWN_OUTPUTS
        refusal = self.decider.agree_padding(len(self.keys), refusal)
        ks.decided, ks.padded, ks.refusal, ks.provisional = True, refusal is None, refusal, False
        self._next_generation()
        asked = (o.stateful and refusal is not None and refusal.reason == Reason.STATEFUL) or o.rows_independent is False
        if refusal is not None and self.opts.buckets[-1] > 1 and not asked:  # what the caller asked for is no news
            stats.record_fallback(refusal)

    def _tracer(self, inputs: StaticInputs, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int) -> RowTracer:
        """A row tracer for a run on these buffer views (``rows`` of them): batched and static inputs labelled."""
        views = pytree.tree_leaves((args, kwargs))
        kinds = inputs.layout.kinds
        return RowTracer([(t, self.opts.batch_dim) for t, kd in zip(views, kinds) if kd == "batched"],
                         [t for t, kd in zip(views, kinds) if kd == "static"], rows=rows, names=self._state_names())

    def _state_names(self) -> dict[int, str]:
        """The model's parameters and buffers by ``id``, so a trace can name the state a model writes."""
        m = self.model_fn if isinstance(self.model_fn, torch.nn.Module) else getattr(self.model_fn, "__self__", None)
        if not isinstance(m, torch.nn.Module):
            return {}
        return {id(t): name for name, t in (*m.named_parameters(), *m.named_buffers())}

    def _output_rows(self, verdict: RowVerdict | None, outputs: Any, rows_seen: int) -> tuple[Rows | None, ...] | None:
        """Where the outputs carry the batch: ``batched_outputs`` when given, else the trace's labels."""
        given = self.opts.batched_outputs
        leaves = pytree.tree_leaves(outputs) if outputs is not None else None
        if callable(given) and outputs is not None:
            given = given(outputs)
        if given is not None and leaves is not None:
            rows = flags_to_rows(given, leaves, self.opts.batch_dim)
            if verdict is not None and len(verdict.outputs) == len(rows) and not verdict.reason:
                wrong = [k for k, (r, v) in enumerate(zip(rows, verdict.outputs)) if (r is None) != (v is None)]
                if wrong:
                    logger.warning("gfxgraph: %s: batched_outputs says output leaf %d %s the batch, but the "
                                   "model's trace says it %s; using batched_outputs", self.what, wrong[0],
                                   "carries" if rows[wrong[0]] is not None else "does not carry",
                                   "does not" if rows[wrong[0]] is not None else "does")
            return rows
        if verdict is None:
            return None
        rows_out = list(verdict.outputs)
        if self.opts.rows_independent and leaves is not None and len(leaves) == len(rows_out):
            bd = self.opts.batch_dim  # vouched for: a leaf the trace could not follow carries the batch if its size says so
            rows_out = [r if r is not None else Rows(bd) if isinstance(t, torch.Tensor) and t.dim() > bd
                        and t.shape[bd] == rows_seen else None for r, t in zip(rows_out, leaves)]
        return tuple(rows_out)

    # ------------------------------------------------------------------ first call of a bucket
    def _first_call(self, ks: KeyState, inputs: StaticInputs, leaves: list[Any], batch: int, bucket: int,
                    key: tuple[Hashable, ...], args: tuple[Any, ...], kwargs: dict[str, Any], copy: bool) -> Any:
        """Capture ``bucket`` for ``key`` on its first call and answer the call (module docstring, step 3)."""
        trace = not ks.decided
        if self.simulate and not trace:
            return self._simulated_first(ks, inputs, leaves, batch, bucket, key, args, kwargs, copy)
        own: Any = MISSING
        if self.opts.warmup_iters > 0 or self.simulate:
            own = self._own_run(ks, inputs, leaves, batch, key, trace)
            if self.simulate:  # the traced run answers; the bucket's first padded run comes with the next call
                stats.record_fallback(self._no_gpu)
                return clone_tree(own) if copy else own
            bucket = (self.padded_table if ks.padded else self.exact_table)[batch]
            entry = self.entries.get((bucket, key))
            if entry is not None:  # decided just now, and that bucket has its graph already
                return self._answer_from_own(entry, ks, inputs, leaves, batch, own, args, kwargs, copy)
            inputs.stage(leaves, batch, bucket)
        entry, captured = self._capture(ks, inputs, leaves, bucket, key,
                                        trace=(trace and own is MISSING) or ks.provisional,
                                        warmups=0 if ks.stateful else self.opts.warmup_iters - 1)
        if ks.provisional:  # the capture's trace was not taken (it failed): nothing proves padding
            self._refuse(ks, Fallback(Reason.UNPROVEN, "the run read batch values on the host and the capture "
                                      "that would show the graph's own rows failed"))
        if captured.fallback is not None:
            return self._after_failure(entry, captured, ks, key, own, args, kwargs, copy)
        if own is MISSING and batch < bucket and ks.padded:  # warmup_iters=0: the padding check needs a reference
            own = self._own_run(ks, inputs, leaves, batch, key, trace=False)
        if own is not MISSING:
            return self._answer_from_own(entry, ks, inputs, leaves, batch, own, args, kwargs, copy)
        assert entry.graph is not None and entry.layout is not None and entry.outputs is not None
        entry.graph.replay()
        return self._validated(entry.layout.result(entry.outputs, batch, copy=copy, cache=True), ks, args, kwargs)

    def _own_run(self, ks: KeyState, inputs: StaticInputs, leaves: list[Any], batch: int,
                 key: tuple[Hashable, ...], trace: bool) -> Any:
        """The call's own run on its ``batch`` rows of the static buffers (traced when asked); its result.

        Its exception is the model's own on the caller's rows: it propagates
        (after telling the other ranks) and nothing is stored.
        """
        a, k = inputs.bucket_args(batch, leaves)
        fn = lambda: self.model_fn(*a, **k)  # noqa: E731
        tracer = self._tracer(inputs, a, k, batch) if trace else None
        try:
            if self.graphs:
                out = self.capturer.run(fn, tracer=tracer)
            else:
                with torch.no_grad():
                    if tracer is None:
                        out = fn()
                    else:
                        with tracer:
                            out = fn()
        except BaseException as exc:
            self.decider.leave(Round.CAPTURE_BEGIN, batch, exc)
            raise
        if tracer is not None:
            self._decide(ks, tracer.verdict(out), rows_known=batch > 1, rows_seen=batch, outputs=out)
        elif ks.rows is None and ks.decided:
            self._rows_from(ks, out, batch)
        return out

    def _rows_from(self, ks: KeyState, outputs: Any, rows_seen: int) -> None:
        """Where a decided key's outputs carry the batch, from its first outputs (``batched_outputs`` given)."""
        ks.rows = self._output_rows(None, outputs, rows_seen)
        if ks.rows is None and ks.padded:
            self._refuse(ks, _UNKNOWN_OUTPUTS)

    def _capture(self, ks: KeyState, inputs: StaticInputs, leaves: list[Any], bucket: int,
                 key: tuple[Hashable, ...], *, trace: bool, warmups: int) -> tuple[Entry, Captured]:
        """``warmups`` runs at ``bucket`` rows (one at most for a model that writes state), then its capture
        (traced when asked: the key's first run); stores the entry."""
        a, k = inputs.bucket_args(bucket, leaves)
        run = lambda: self.model_fn(*a, **k)  # noqa: E731
        warm = [run] * (min(warmups, 1) if ks.stateful else max(0, warmups))
        entry = Entry(bucket, key)
        what = f"bucket {bucket}" if bucket in self.opts.buckets else f"exact size {bucket}"
        if bucket not in self.opts.buckets:
            log_once(("exact_bucket", id(self), bucket), logging.DEBUG, "gfxgraph: %s: batch %d is not a bucket "
                     "and the model is not padded: it gets a graph of exactly %d rows", self.what, bucket, bucket)
        tracer = self._tracer(inputs, a, k, bucket) if trace else None
        if tracer is not None:
            run_traced = run

            def run() -> Any:  # noqa: F811 - the capture run, traced
                with tracer:
                    return run_traced()
        captured = self.decider.capture(self.capturer if self.graphs else None, run, what, bucket=bucket, key=key,
                                        warm=warm, stateful=ks.stateful)
        if tracer is not None and captured.fallback is None:
            self._decide(ks, tracer.verdict(captured.outputs), rows_known=bucket > 1, rows_seen=bucket,
                         outputs=captured.outputs)
        if captured.fallback is None:
            if ks.rows is None and ks.decided:
                self._rows_from(ks, captured.outputs, bucket)
            rows = ks.rows
            first, spec = pytree.tree_flatten(captured.outputs)
            entry.layout = OutputLayout(bucket, spec, rows if rows is not None and len(rows) == len(first)
                                        else (None,) * len(first))
        if captured.graph is not None:
            entry.graph = captured.graph
            entry.outputs = release_outputs(pytree.tree_leaves(captured.outputs))
        captured.outputs = None  # the graph's output memory goes back to the pool
        entry.fallback = captured.fallback
        self.entries[(bucket, key)] = entry
        return entry, captured

    def _after_failure(self, entry: Entry, captured: Captured, ks: KeyState, key: tuple[Hashable, ...], own: Any,
                       args: tuple[Any, ...], kwargs: dict[str, Any], copy: bool) -> Any:
        """A capture (or a warm-up at the bucket's size) failed: the bucket runs eagerly from now on."""
        assert captured.fallback is not None
        if captured.stage == "warm_up" and entry.size in self.opts.buckets and ks.padded:
            # the call's own rows ran, the padded ones raised: this key is not padded from now on
            entry.fallback = Fallback(Reason.PADDED_RUN_FAILED, captured.fallback.detail)
            self._refuse(ks, entry.fallback)
            del self.entries[(entry.size, key)]
        stats.record_fallback(entry.fallback or captured.fallback)
        if own is not MISSING:
            return self._own_as_result(own, copy)
        if captured.stage == "warm_up" and captured.error is not None and not self.decider.agreed:
            del self.entries[(entry.size, key)]  # the model raised on the caller's rows: its own error
            raise captured.error
        return self.eager(args, kwargs)

    def _answer_from_own(self, entry: Entry, ks: KeyState, inputs: StaticInputs, leaves: list[Any], batch: int,
                         own: Any, args: tuple[Any, ...], kwargs: dict[str, Any], copy: bool) -> Any:
        """A first call's own run is its result; a padded bucket is checked against it (no extra run)."""
        if entry.graph is not None and batch < entry.size and ks.padded and not ks.stateful and not entry.confirmed:
            inputs.stage(leaves, batch, entry.size)
            self._confirm(entry, ks, inputs, batch, own)
        if entry.graph is None or entry.layout is None:
            return self._own_as_result(own, copy)
        out = entry.warm_result(own, batch, copy=copy)
        if out is MISSING:  # the model's outputs differ from run to run: the graph answers
            logger.debug("gfxgraph: %s: the own run's outputs differ from the captured ones; replaying", self.what)
            entry.graph.replay()
            return entry.layout.result(entry.outputs, batch, copy=copy, cache=True)
        return out

    def _own_as_result(self, own: Any, copy: bool) -> Any:
        record_on_current_stream(pytree.tree_leaves(own))
        return clone_tree(own) if copy else own  # copied: it may alias the static input buffers

    # ------------------------------------------------------------------ the padding check
    def _confirm(self, entry: Entry, ks: KeyState, inputs: StaticInputs, batch: int, reference: Any) -> bool:
        """A padded bucket's check (:mod:`~hipgraph_bridge.padding.confirm`) against the call's own unpadded
        run (``reference``); False refuses padding for the key."""
        assert entry.graph is not None and entry.layout is not None and entry.outputs is not None
        layout, outputs, graph = entry.layout, entry.outputs, entry.graph
        why = self.decider.confirm(entry.size, lambda: confirm_padding(
            graph.replay, inputs.pad_regions(batch, entry.size), inputs.pad_value,
            lambda: layout.real(outputs, batch), reference=reference))
        if not why:
            entry.confirmed = True
            return True
        self._refuse(ks, Fallback(Reason.PADDING_CHANGES_RESULTS, f"bucket {entry.size} for {batch} rows: {why}; "
                                  "rows depend on each other, so calls run in graphs of their exact size"))
        return False

    def _refuse(self, ks: KeyState, why: Fallback) -> None:
        ks.decided, ks.padded, ks.refusal, ks.provisional = True, False, why, False
        self._next_generation()
        stats.record_fallback(why)

    # ------------------------------------------------------------------ without a GPU
    def _simulated_first(self, ks: KeyState, inputs: StaticInputs, leaves: list[Any], batch: int, bucket: int,
                         key: tuple[Hashable, ...], args: tuple[Any, ...], kwargs: dict[str, Any], copy: bool) -> Any:
        """A bucket's first use without a GPU: its padded run (through the ranks' capture rounds) answers."""
        entry, captured = self._capture(ks, inputs, leaves, bucket, key, trace=False, warmups=0)
        stats.record_fallback(self._no_gpu)
        if captured.fallback is not None:
            if captured.stage == "warm_up" and not self.decider.agreed:
                self.entries.pop((bucket, key), None)
                out = self.eager(args, kwargs)  # raised on the padded rows: on the caller's own, its error is theirs
                entry.fallback = Fallback(Reason.PADDED_RUN_FAILED, captured.fallback.detail)
                self.entries[(bucket, key)] = entry
                stats.record_fallback(entry.fallback)
                return out
            stats.record_fallback(captured.fallback)
            return self.eager(args, kwargs)
        assert entry.layout is not None
        return self._validated(entry.layout.result(pytree.tree_leaves(captured.warm), batch, copy=copy, cache=False),
                               ks, args, kwargs)

    def _simulated(self, entry: Entry, ks: KeyState, inputs: StaticInputs, leaves: list[Any], batch: int,
                   copy: bool) -> Any:
        """``simulate_padding`` without a GPU: the model on the padded buffers, where a replay would be."""
        assert entry.layout is not None
        a, k = inputs.bucket_args(entry.size, leaves)
        with torch.no_grad():
            outputs = self.model_fn(*a, **k)
        stats.record_fallback(self._no_gpu)
        return entry.layout.result(pytree.tree_leaves(outputs), batch, copy=copy, cache=False)

    # ------------------------------------------------------------------ ahead of time, zero-copy
    def capture_ahead(self, inputs: StaticInputs, leaves: list[Any], bucket: int, key: tuple[Hashable, ...]) -> None:
        """Capture ``bucket`` now, on what the buffers hold (``capture_all``); the key's first capture is traced."""
        if not self.graphs:
            return  # nothing to capture: calls run the padded pipeline eagerly
        with _on_device_of(inputs, True):
            self._capture_ahead(inputs, leaves, bucket, key)

    def _capture_ahead(self, inputs: StaticInputs, leaves: list[Any], bucket: int, key: tuple[Hashable, ...]) -> None:
        ks = self.keys.get(key)
        if ks is None:
            ks = self.keys[key] = self._new_key()
        trace = not ks.decided
        entry, captured = self._capture(ks, inputs, leaves, bucket, key, trace=trace, warmups=self.opts.warmup_iters)
        if captured.fallback is not None:
            logger.warning("gfxgraph: %s: %s runs eagerly: %s", self.what, f"bucket {bucket}", captured.fallback)

    def fast_io(self, batch: int, out: Any = MISSING) -> FastCall | None:
        """A zero-copy call's fast path for ``batch`` rows (else None): once its graph answered ``out``
        or, without ``out``, where a call of that size has already been checked."""
        fast = self.fast.get(batch)
        if fast is None or fast.generation != self.generation or (out is not MISSING and out is not fast.tree):
            return None
        return fast

    # ------------------------------------------------------------------ introspection
    def unpadded(self) -> dict[tuple[Hashable, ...], Fallback]:
        return {k: ks.refusal for k, ks in self.keys.items() if ks.refusal is not None}

    def close(self) -> None:
        for entry in self.entries.values():
            if entry.graph is not None:
                entry.graph.reset()
        self.entries.clear()
        self.keys.clear()
        self.fast.clear()
        self.inputs = None
        self.order.forget()
        self.capturer.release_pool()
        self._next_generation()
