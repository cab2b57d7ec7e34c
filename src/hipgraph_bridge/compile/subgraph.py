"""One dynamo subgraph, compiled once and served through batch-bucket graphs.

Workflow of :class:`CompiledSubgraph`:

1. Read the FX graph (:func:`.plan.analyze`): which inputs carry the batch,
   which are parameters/buffers (read in place), which are other tensors
   (copied into static buffers), which ints are sizes (set to the *bucket*
   size inside graphs), and which outputs carry the batch.
2. Compile (:func:`.compiler.compile_graph`). A frame in which dynamo
   specialised every shape runs the traced graph eagerly until its
   ``static_compile_after``-th call, then compiles: such frames serve one
   batch size, and compiling each of them up front would double the compile time.
3. Serve calls through a :class:`~hipgraph_bridge.ShapeBucketPool` per
   variant (non-batch shapes and constants): copy in, pad, replay, slice.
4. Fall back to the compiled function without graphs, counted and logged
   once per cause, where graphs would be wrong or impossible (see
   :meth:`CompiledSubgraph._why_ungraphed` and the first padded call's check).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import config, stats
from .._torch_compat import aot_mutated_inputs, pointers_equal, pytree
from ..bucketing.buckets import default_buckets
from ..bucketing.pool import ShapeBucketPool
from ..log import log_once, logger
from ..platform import probe
from ..validation import outputs_match
from .compiler import compile_graph
from .options import BackendOptions
from .plan import GraphPlan, analyze, fx_mutated_inputs

__all__ = ["CompiledSubgraph", "SubgraphState", "live_subgraphs", "compile_counts"]


class SubgraphState(enum.Enum):
    LAZY = "lazy"  # every shape specialised: the traced graph runs eagerly until static_compile_after
    GRAPHED = "graphed"  # compiled, served through bucket pools
    UNGRAPHED = "ungraphed"  # compiled, called directly (reason in CompiledSubgraph.reason)


@dataclass
class _Variant:
    """One graph set of a subgraph: for one combination of non-batch shapes and constants."""

    pool: ShapeBucketPool
    owned: list[tuple[int, torch.Tensor]]  # (input index, static buffer) copied into per call
    padding_checked: bool = False  # a padded result was compared with an unpadded run


class CompiledSubgraph:
    """One dynamo subgraph, compiled once, served through batch-bucket graphs (module docstring).

    Cost per graphed call over a bare replay: the pool's (flatten, lock, copy
    in, pad, copy out) plus a data-pointer check of the parameters (the graph
    reads them in place, so a replaced parameter means re-capture) and a lock.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], opts: BackendOptions) -> None:
        self.opts = opts
        self.plan: GraphPlan = analyze(gm, example_inputs, batch_dim=opts.batch_dim)
        self._gm: torch.fx.GraphModule | None = gm
        self._lock = threading.RLock()
        self._fn: Callable[..., Any] = gm.forward  # the traced graph as it is, until compiled
        self.compiler: str | None = None
        self.compile_seconds = 0.0
        self.state = SubgraphState.LAZY
        self.reason: str | None = None  # fallback key while UNGRAPHED
        self.detail = ""
        self._level = logging.WARNING
        self._variants: dict[tuple[Any, ...], _Variant] = {}
        self._lazy_calls = 0
        self._writes_state = False  # the graph writes to ref inputs (set at compile)
        p = self.plan
        # tensors dynamo tied to the batch, then those that merely equal it (checked per call)
        self._batched_idx = p.indices("batched") + [i for i in p.indices("batch_like")
                                                     if isinstance(example_inputs[i], torch.Tensor)]
        self._follow = [(s.index, isinstance(example_inputs[s.index], torch.Tensor))
                        for s in p.slots if s.kind == "batch_like"]
        self._ref_idx = p.indices("ref")
        self._ref_ptrs = _ref_pointers(example_inputs, self._ref_idx)
        self._owned_idx = p.indices("owned")
        self._derived = [(s.index, *s.source) for s in p.slots
                         if s.kind in ("batch_int", "shape_int", "batch_like") and s.source is not None]
        self._first = p.first_batched
        bd = opts.batch_dim
        # what makes a call need another graph set: varying non-batch shapes, constant arguments
        self._key_parts: list[tuple[int, int | None]] = [
            (s.index, bd if s.kind in ("batched", "batch_like") else None) for s in p.slots
            if s.varies and s.kind in ("batched", "owned", "batch_like")]
        self._key_parts += [(i, _CONST) for i in p.indices("const")]
        self.buckets = self._choose_buckets()
        _registry.add(self)
        if p.static and opts.static_compile_after > 1:
            return  # LAZY: compile on the static_compile_after-th call
        self._compile(example_inputs)

    # ----------------------------------------------------------- compile
    def _choose_buckets(self) -> list[int]:
        p, o = self.plan, self.opts
        base = list(o.buckets) if o.buckets else default_buckets(o.max_batch_size)
        if p.fixed_batch is not None:  # the frame serves exactly this size: no padding possible
            return [p.fixed_batch] if p.fixed_batch <= base[-1] else []
        lo, hi = p.batch_range
        return [b for b in base if b >= lo and (hi is None or b <= hi)]

    def _compile(self, args: list[Any]) -> None:
        gm = self._gm
        assert gm is not None
        fx_mutated = fx_mutated_inputs(gm)
        t0 = time.perf_counter()
        fn, self.compiler, failure = compile_graph(gm, args, self.opts, on_cpu=self.plan.devices == {"cpu"})
        seconds = time.perf_counter() - t0
        self.compile_seconds += seconds
        _registry.count_compile(seconds)
        mutated = aot_mutated_inputs(len(args)) if self.compiler != "eager" else None
        if mutated is None:
            mutated = fx_mutated
        # called like dynamo calls a backend's function: with *args. (`_boxed_call` is no guide: AOT's
        # wrapper copies the flag from the boxed function it wraps but takes *args itself.)
        self._fn = fn
        self._gm = None
        # writes to in-place inputs (a KV cache, a step counter) are fine in a graph, but the
        # subgraph must then run exactly once per call: no unpadded re-run to check padding
        self._writes_state = bool(mutated)
        why = self._why_ungraphed(mutated, failure)
        if why is None:
            self.state = SubgraphState.GRAPHED
        else:
            self._ungraph(*why)
        logger.debug("gfxgraph backend: compiled a subgraph with %s in %.2f s (%s%s)", self.compiler,
                     self.compile_seconds, self.state.value, f": {self.reason}" if self.reason else "")

    def _why_ungraphed(self, mutated: frozenset[int], failure: str) -> tuple[str, str, int] | None:
        p, o = self.plan, self.opts
        if not o.graphs:
            return "graphs_off", "options={'graphs': False}", logging.DEBUG
        if failure:
            return "compile_failed", failure, logging.WARNING
        if p.requires_grad:
            return ("training", "grad mode is on and an input requires grad: the compiled function runs "
                    "without graphs (backward works); call under torch.no_grad() or torch.inference_mode(), "
                    "or requires_grad_(False), for graphs", logging.INFO)
        if p.unsupported is not None:
            return (*p.unsupported, logging.WARNING)
        copied = sorted(i for i in mutated if p.slots[i].kind != "ref")
        if copied:
            names = ", ".join(p.slots[i].name for i in copied)
            return ("input_mutation", f"the graph writes to its input(s) {names}, which a graph reads from "
                    "static copies, so the writes would not reach them (parameters, buffers and "
                    "mark_static_address tensors, read in place, may be written)", logging.WARNING)
        if probe().graphs_available and p.devices != {"cuda"}:
            return ("cpu_inputs", f"inputs on {', '.join(sorted(p.devices))}: graphs need every tensor "
                    "input on the GPU", logging.INFO)
        if not self.buckets:
            what = (f"the fixed batch size {p.fixed_batch}" if p.fixed_batch is not None
                    else f"the batch sizes this frame admits {p.batch_range}")
            return "oversize", f"no bucket fits {what}", logging.INFO
        return None

    def _ungraph(self, reason: str, detail: str, level: int) -> None:
        self.state = SubgraphState.UNGRAPHED
        self.reason, self.detail, self._level = reason, detail, level
        self.close()

    # -------------------------------------------------------------- call
    def __call__(self, *args: Any) -> Any:
        """Run the subgraph on dynamo's flat inputs (hot path when GRAPHED)."""
        state = self.state
        if state is SubgraphState.GRAPHED:
            out = self._graphed(args)
            if out is not _UNGRAPHED:
                return out
            state = self.state
        if state is SubgraphState.UNGRAPHED:
            stats.record_fallback(self.reason or "ungraphed", self.detail, level=self._level)
            return self._fn(*args)
        return self._lazy(args)

    def _lazy(self, args: tuple[Any, ...]) -> Any:
        with self._lock:
            if self.state is SubgraphState.LAZY:
                self._lazy_calls += 1
                if self._lazy_calls >= self.opts.static_compile_after:
                    self._compile(list(args))
        if self.state is not SubgraphState.LAZY:
            return self(*args)
        stats.record_fallback("static_shape_warmup", "a frame with every shape specialised runs the traced "
                               f"graph eagerly until its call {self.opts.static_compile_after}",
                               level=logging.DEBUG)
        return self._fn(*args)

    def _graphed(self, args: tuple[Any, ...]) -> Any:
        with self._lock:
            if self.state is not SubgraphState.GRAPHED:  # another thread just gave up on graphs
                return _UNGRAPHED
            if self._ref_idx and not pointers_equal(args, self._ref_ptrs, self._ref_idx):
                self._rebind(args)
            if self._follow and not self._follows_batch(args):
                stats.record_fallback("batch_mismatch", "a size that usually equals the batch size differs "
                                       "from it in this call")
                return self._fn(*args)
            key = self._key(args) if self._key_parts else ()
            v = self._variants.get(key)
            if v is None:
                v = self._new_variant(key, args)
                if v is None:
                    if self.state is SubgraphState.GRAPHED:  # over max_variants: this call only
                        stats.record_fallback("max_variants", f"more than {self.opts.max_variants} shape/"
                                               "constant variants of one subgraph")
                        return self._fn(*args)
                    return _UNGRAPHED
            if self._writes_state and not self._exact_bucket(v, args):
                stats.record_fallback("padded_state_write", "a subgraph that writes to its parameters or "
                                       "buffers runs without graphs at batch sizes that are not a bucket: "
                                       "padding rows could write to that state (pass options={'buckets': "
                                       "[...]} with the sizes you run)")
                return self._fn(*args)
            for i, buf in v.owned:
                buf.copy_(args[i])
            out = v.pool(*[args[i] for i in self._batched_idx])
            if self.plan.int_outputs:
                out = self._fix_int_outputs(out, args)
            if not v.padding_checked or config.switches.validate:
                out = self._check_padding(v, out, args)
            return out

    def _check_padding(self, v: _Variant, out: Any, args: tuple[Any, ...]) -> Any:
        """Compare the first padded result with an unpadded run of the compiled function (and, in
        validate mode, every result, returning the unpadded one).

        Padding is only sound when rows are independent; a reduction over the
        batch (``x - x.mean(0)``) cannot be read from the graph, but the first
        padded call shows it. The comparison is by relative norm per output, so
        rounding differences between GEMMs of two sizes do not count, while a
        changed row does. Costs one extra run and a host sync, once per variant.
        """
        batch = args[self._first].shape[self.opts.batch_dim]
        bucket = v.pool.bucket_for(batch)
        padded = bucket is not None and bucket > batch
        validate = config.switches.validate
        if self._writes_state:  # a second run would advance the state twice
            v.padding_checked = True
            if validate:
                log_once(("gfxgraph-backend-novalidate", id(self)), logging.INFO,
                         "gfxgraph backend: a subgraph that writes to its parameters or buffers is not "
                         "validated (comparing would run it twice)")
            return out
        if not padded and not validate:
            return out
        unpadded = self._fn(*args)
        if validate:
            ok, _ = outputs_match(out, unpadded)
            stats.record_validation(ok)
        if padded and not v.padding_checked:
            v.padding_checked = True
            why = _padding_changed(out, unpadded)
            if why:
                self._ungraph("padding_changes_results", f"batch {batch} padded to {bucket}: {why}; rows depend "
                              "on each other (a reduction over the batch?) or the graph is random",
                              logging.WARNING)
                return unpadded
        return unpadded if validate else out

    def _exact_bucket(self, v: _Variant, args: tuple[Any, ...]) -> bool:
        """No padding for this call (a batch above every bucket counts: the pool runs it unpadded)."""
        batch = args[self._first].shape[self.opts.batch_dim]
        bucket = v.pool.bucket_for(batch)
        return bucket is None or bucket == batch

    def _follows_batch(self, args: tuple[Any, ...]) -> bool:
        """Whether every batch_like input equals the batch size in this call (so padding it is sound)."""
        bd = self.opts.batch_dim
        batch = args[self._first].shape[bd]
        return all((args[i].shape[bd] if is_tensor else args[i]) == batch for i, is_tensor in self._follow)

    def _key(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Which graph set serves this call (its non-batch shapes and constants)."""
        parts: list[Any] = []
        for i, mode in self._key_parts:
            v = args[i]
            if mode == _CONST:
                parts.append(v)
            elif mode is None:
                parts.append(tuple(v.shape))
            else:  # a batched tensor: its shape without the batch
                shape = tuple(v.shape)
                parts.append(shape[:mode] + shape[mode + 1:])
        return tuple(parts)

    def _rebind(self, args: tuple[Any, ...]) -> None:
        """A parameter or buffer moved (replaced, ``.data`` reassigned): the graphs read the old memory."""
        log_once(("gfxgraph-backend-rebind", id(self)), logging.INFO,
                 "gfxgraph backend: parameters or buffers of a compiled subgraph moved; re-capturing its graphs")
        self.close()
        self._ref_ptrs = _ref_pointers(args, self._ref_idx)

    def _new_variant(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> _Variant | None:
        if len(self._variants) >= self.opts.max_variants:
            return None
        bad = [self.plan.slots[i].name for i in self._batched_idx if not args[i].is_contiguous()]
        if bad:  # the pool's buffers are contiguous; the compiled code expects these strides
            self._ungraph("strided_input", f"batched input(s) {', '.join(bad)} are not contiguous",
                          logging.WARNING)
            return None
        template: list[Any] = list(args)
        owned = []
        for i in self._owned_idx:
            template[i] = buf = args[i].detach().clone()  # keeps the strides the compiled code expects...
            if buf.stride() != args[i].stride():  # ...unless they overlap (expanded): no static copy has them
                self._ungraph("strided_input", f"input {self.plan.slots[i].name} has overlapping strides "
                              f"{args[i].stride()}", logging.WARNING)
                return None
            owned.append((i, buf))
        for i in self._batched_idx:
            template[i] = None  # never keep the caller's tensors alive
        for i, _j, _d in self._derived:
            template[i] = None
        o = self.opts
        # which outputs carry the batch comes from the FX graph: the pool's probe at another batch size
        # could lie outside what the frame's guards admit (dynamo specialises size 1)
        pool = ShapeBucketPool(self._runner(template), self.buckets,
                               batched_outputs=_leaf_flags(self.plan.batched_outputs), stateful=self._writes_state,
                               batch_dim=o.batch_dim, pad_value=o.pad_value, copy_outputs=o.copy_outputs,
                               oversize="eager", warmup_iters=o.warmup_iters, vram_cap=o.vram_cap, progress=False)
        v = self._variants[key] = _Variant(pool, owned)
        return v

    def _runner(self, template: list[Any]) -> Callable[..., Any]:
        """The model the pool captures: batched views (at bucket size) in, the full input list rebuilt.

        Runs only at warm-up, capture and eager fallback, never on replay.
        Sizes derived from the batch are read from the views, so inside a
        graph they are the bucket size.
        """
        fn, batched_idx, derived = self._fn, self._batched_idx, self._derived

        def run(*batched: torch.Tensor) -> Any:
            full = list(template)
            for i, t in zip(batched_idx, batched):
                full[i] = t if t.is_contiguous() else t.contiguous()  # batch_dim > 0: views are strided
            for i, j, d in derived:
                full[i] = full[j].shape[d]
            return fn(*full)

        return run

    def _fix_int_outputs(self, out: Any, args: tuple[Any, ...]) -> Any:
        """Symbolic ints among the outputs were captured at bucket size: recompute them for this call."""
        vals = list(out)
        for io in self.plan.int_outputs:
            subs = {sym: (args[j] if d is None else args[j].shape[d]) for sym, j, d in io.sources}
            vals[io.position] = subs[io.expr] if io.expr in subs else int(io.expr.xreplace(subs))
        return tuple(vals) if isinstance(out, tuple) else vals

    # ------------------------------------------------------- introspection
    @property
    def captured_buckets(self) -> list[int]:
        """Buckets with a captured graph, over every variant."""
        return sorted({b for v in list(self._variants.values()) for b in v.pool.captured_buckets})

    def graph_count(self) -> int:
        """Captured graphs over every variant."""
        return sum(len(v.pool.captured_buckets) for v in list(self._variants.values()))

    def pool_bytes(self) -> int:
        """Graph-pool bytes held by this subgraph's graphs (allocator figures)."""
        return sum(v.pool.pool_bytes() for v in list(self._variants.values()))

    def close(self) -> None:
        """Release every graph and static buffer; a later call captures again. Idempotent."""
        with self._lock:
            variants, self._variants = self._variants, {}
            for v in variants.values():
                v.pool.close()

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return (f"CompiledSubgraph(state={self.state.value}{why}, compiler={self.compiler}, "
                f"buckets={self.buckets}, captured={self.captured_buckets})")


_UNGRAPHED = object()  # _graphed's answer when the subgraph just turned UNGRAPHED

# relative-norm tolerance of the padding check: well above rounding (GEMMs of two sizes sum in
# different orders), well below what one changed row does to an output
_PADDING_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def _padding_changed(padded: Any, unpadded: Any) -> str:
    """Why two output pytrees differ beyond rounding ("" when they agree)."""
    a_leaves, a_spec = pytree.tree_flatten(padded)
    b_leaves, b_spec = pytree.tree_flatten(unpadded)
    if a_spec != b_spec:
        return f"output structure {a_spec} vs {b_spec}"
    for k, (a, b) in enumerate(zip(a_leaves, b_leaves)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {k}: {a!r} vs {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {k}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return f"output {k}: integer values differ"
            continue
        wide = torch.complex128 if a.is_complex() else torch.float64
        fa, fb = a.detach().to(wide), b.detach().to(wide)
        finite = torch.isfinite(fb)
        if not torch.equal(torch.isfinite(fa), finite):
            return f"output {k}: non-finite values in different places"
        fa, fb = fa[finite], fb[finite]
        rel = ((fa - fb).norm() / fb.norm().clamp_min(1e-30)).item()
        if rel > _PADDING_RTOL.get(a.dtype, 1e-3):
            return f"output {k}: relative difference {rel:.3g}"
    return ""


_CONST = -1  # key-part mode of a constant argument (else a tensor's batch dim, or None: its whole shape)


def _leaf_flags(top_flags: tuple[bool, ...]) -> Callable[[Any], list[bool] | None]:
    """The pool's per-leaf batched flags from the plan's per-output ones (None: outputs unlike the plan)."""

    def flags(outputs: Any) -> list[bool] | None:
        tops = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        if len(tops) != len(top_flags):
            return None
        return [f for o, f in zip(tops, top_flags) for _ in pytree.tree_leaves(o)]

    return flags


def _ref_pointers(args: Sequence[Any], idx: list[int]) -> list[int | None]:
    """Data pointers of the ref inputs, by input position (None elsewhere)."""
    ptrs: list[int | None] = [None] * len(args)
    for i in idx:
        ptrs[i] = args[i].data_ptr()
    return ptrs


class _Registry:
    """Live subgraphs (weakly held) and compile counters, for the backend's stats."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: weakref.WeakSet[CompiledSubgraph] = weakref.WeakSet()
        self.compiles = 0
        self.compile_seconds = 0.0

    def add(self, sub: CompiledSubgraph) -> None:
        with self.lock:
            self.live.add(sub)

    def count_compile(self, seconds: float) -> None:
        with self.lock:
            self.compiles += 1
            self.compile_seconds += seconds

    def subgraphs(self) -> list[CompiledSubgraph]:
        with self.lock:
            return list(self.live)


_registry = _Registry()


def live_subgraphs() -> list[CompiledSubgraph]:
    """The live subgraphs (state, reason, buckets, captured graphs)."""
    return _registry.subgraphs()


def compile_counts() -> tuple[int, float]:
    """(compilations, seconds compiling) in this process."""
    with _registry.lock:
        return _registry.compiles, _registry.compile_seconds
