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

A subgraph that needs autograd (grad mode on and an input, usually a
parameter, requiring grad) takes another path, :attr:`SubgraphState.TREES`:
inductor's CUDA-graph trees record its forward and, when backward runs, its
backward graph, as ``mode="reduce-overhead"`` does (a recording per distinct
shape, no padding, no bucket pool; trees' own rules on when a recording
replays). The trees make their graphs with ``torch.cuda.CUDAGraph``: gfxgraph's
safe class while ``gfxgraph.enable()`` is on. Each forward call of the path
watches its autograd graph; one freed without a backward having run through it
is inference in grad mode, reported once (WARNING) with the fix: under
``torch.no_grad()``/``torch.inference_mode()`` the same model gets bucketed graphs.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .. import stats
from .._torch_compat import aot_mutated_inputs, is_fake, pointers_equal, pytree, sym_expr
from ..bucketing.pool import ShapeBucketPool
from ..fallbacks import Fallback, FallsBack, Reason
from ..padding.fx import trace_graph
from ..padding.rows import RowVerdict
from ..ranks.agreement import RankSession, Round, Status, describe_failures, failures
from ..log import log_once, logger
from ..platform import probe
from .compiler import compile_graph
from .options import BackendOptions
from .plan import GraphPlan, analyze, fx_mutated_inputs

__all__ = ["CompiledSubgraph", "SubgraphState", "Analysis", "live_subgraphs", "compile_counts",
           "register_subgraph", "count_compile", "analysis_seconds"]


class SubgraphState(enum.Enum):
    LAZY = "lazy"  # every shape specialised: the traced graph runs eagerly until static_compile_after
    GRAPHED = "graphed"  # compiled, served through bucket pools
    TREES = "trees"  # needs autograd: compiled with inductor's CUDA-graph trees (forward and backward)
    UNGRAPHED = "ungraphed"  # compiled, called directly (reason in CompiledSubgraph.reason)


class Analysis(NamedTuple):
    """A subgraph's row analysis: what it was given besides the graph, and what it found. It pickles:
    a saved frame carries its analysis to the process that loads it."""

    given: tuple[Any, ...]
    verdict: RowVerdict


@dataclass
class _Variant:
    """One graph set of a subgraph: for one combination of non-batch shapes and constants."""

    pool: ShapeBucketPool
    owned: list[tuple[int, torch.Tensor]]  # (input index, static buffer) copied into per call


class CompiledSubgraph(FallsBack):
    """One dynamo subgraph, compiled once, served through batch-bucket graphs (module docstring).

    Cost per graphed call over a bare replay: the pool's (flatten, lock, copy
    in, pad, copy out) plus a data-pointer check of the parameters (the graph
    reads them in place, so a replaced parameter means re-capture) and a lock.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], opts: BackendOptions, *,
                 compiled: Callable[..., Any] | None = None, role: str = "whole",
                 compile_inputs: list[Any] | None = None, analysis: Analysis | None = None) -> None:
        """``compiled``: the function to serve instead of compiling ``gm`` (the piecewise backend's
        split module, run as one full graph); ``role``: ``"whole"``, or ``"full"`` for a graph that
        holds splitting ops (decode frames of a piecewise compile), shown in the backend's stats;
        ``compile_inputs``: what the compiler gets instead of ``example_inputs`` (a saved frame's own
        fake values, whose symbolic sizes dynamo's fake mode would have given the real ones);
        ``analysis``: the row analysis of this same graph made in another process (a saved frame's),
        used where it was made for the same inputs (:attr:`analysis`), else made again."""
        self.opts = opts
        self._compile_inputs = compile_inputs
        self.role = role
        self.calls = 0  # counted by the backend's entry point
        self._precompiled = compiled
        t0 = time.perf_counter()
        self.plan: GraphPlan = analyze(gm, example_inputs, batch_dim=opts.batch_dim)
        _registry.count_analysis(time.perf_counter() - t0)
        self._given_analysis = analysis
        # (what the row analysis was given, its verdict): set at compile, or ahead of it (analyse_ahead)
        self.analysis: Analysis | None = None
        self._gm: torch.fx.GraphModule | None = gm
        self._lock = threading.RLock()
        self._fn: Callable[..., Any] = gm.forward  # the traced graph as it is, until compiled
        self.compiler: str | None = None
        self.compile_seconds = 0.0
        self.state = SubgraphState.LAZY
        self.fallback: Fallback | None = None  # why it runs ungraphed, while UNGRAPHED
        self.verdict: RowVerdict | None = None  # the row analysis of its graph (set at compile)
        self._variants: dict[tuple[Any, ...], _Variant] = {}
        self._lazy_calls = 0
        self._writes_state = False  # the graph writes to ref inputs (set at compile)
        self.tree_calls = 0  # forward calls on the TREES path
        self.unused_backwards = 0  # TREES: autograd graphs of forward calls freed without a backward
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
        # a subgraph with collectives decides with the other ranks whether to graph (its pools agree too)
        self._ranks: RankSession | None = (opts.process_group.session("gfxgraph backend subgraph")
                                           if opts.process_group is not None and p.collectives else None)
        _registry.add(self)
        if p.static and opts.static_compile_after > 1:
            return  # LAZY: compile on the static_compile_after-th call
        self._compile(example_inputs)

    # ----------------------------------------------------------- compile
    def _choose_buckets(self) -> list[int]:
        p, o = self.plan, self.opts
        base = list(o.buckets)
        if p.fixed_batch is not None:  # the frame serves exactly this size: no padding possible
            return [p.fixed_batch] if p.fixed_batch <= base[-1] else []
        lo, hi = p.batch_range
        return [b for b in base if b >= lo and (hi is None or b <= hi)]

    def _compile(self, args: list[Any]) -> None:
        gm = self._gm
        assert gm is not None
        fx_mutated = fx_mutated_inputs(gm)
        if self.opts.graphs:  # before compiling: the graph as dynamo traced it
            self.analysis = self._row_analysis(gm, args)
            self.verdict = self.analysis.verdict
        trees = self._precompiled is None and self._wants_trees()
        t0 = time.perf_counter()
        if self._precompiled is not None:
            fn, self.compiler, failure = self._precompiled, "piecewise", ""
        else:
            fn, self.compiler, failure = compile_graph(gm, self._compile_inputs or args, self.opts,
                                                       on_cpu=self.plan.devices == {"cpu"}, trees=trees)
            self._compile_inputs = None
        seconds = time.perf_counter() - t0
        self.compile_seconds += seconds
        _registry.count_compile(seconds)
        mutated = aot_mutated_inputs(len(args)) if self.compiler in ("inductor", "aot_eager") else None
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
        if self._ranks is not None:
            why = self._agreed_why(self._ranks, why)
        if why is None:
            self.state = SubgraphState.TREES if trees else SubgraphState.GRAPHED
        else:
            self._ungraph(why)
        logger.debug("gfxgraph backend: compiled a subgraph with %s in %.2f s (%s%s)", self.compiler,
                     self.compile_seconds, self.state.value, f": {self.reason}" if self.reason else "")

    def _wants_trees(self) -> bool:
        """Whether this subgraph takes the autograd path: CUDA-graph trees (forward and backward graphs).

        It needs autograd, graphs are on, the compiler has trees (not ``"eager"``), no collective
        (trees do not agree with other ranks) and, on a GPU machine, every input on the GPU.
        """
        p, o = self.plan, self.opts
        return (p.requires_grad and o.graphs and o.compiler != "eager" and not p.collectives
                and not (probe().graphs_available and p.devices != {"cuda"}))

    def _row_analysis(self, gm: torch.fx.GraphModule, args: list[Any]) -> Analysis:
        """Whether the graph's rows are independent, from the graph itself run on fake tensors (no user
        code), or the given analysis of this graph where it was made for the same inputs."""
        p, bd = self.plan, self.opts.batch_dim
        symbols = set() if p.batch_symbol is None else {p.batch_symbol}
        for s in p.slots:
            if s.kind == "batch_like":
                f = args[s.index]
                e = sym_expr(f.shape[bd] if isinstance(f, torch.Tensor) else f)
                if e is not None:
                    symbols.add(e)
        lo, hi = p.batch_range
        batched = {i: bd for i in self._batched_idx}
        # everything the verdict depends on besides the graph (the CPU scalars' values gate branches)
        given = (tuple(batched.items()), tuple(self._ref_idx), tuple(sorted(map(str, symbols))), lo, hi,
                 tuple((i, a.item()) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dim() == 0
                       and a.device.type == "cpu" and not is_fake(a)))
        if self._given_analysis is not None and self._given_analysis.given == given:
            return self._given_analysis
        t0 = time.perf_counter()
        verdict = trace_graph(gm, args, batched=batched, refs=self._ref_idx, symbols=symbols, lo=lo, hi=hi)
        _registry.count_analysis(time.perf_counter() - t0)
        return Analysis(given, verdict)

    @property
    def lazy_calls(self) -> int:
        """Calls served by the traced graph while the subgraph waits (LAZY) for ``static_compile_after``."""
        return self._lazy_calls

    def analyse_ahead(self, args: list[Any]) -> Analysis | None:
        """The subgraph's row analysis: for a LAZY one, made now for ``args`` (a saved frame's, when saving,
        so that the file holds it), which its compile reuses where its own call's inputs give the same
        analysis inputs; for a compiled one, its compile's. None where graphs are off."""
        with self._lock:
            if self.state is SubgraphState.LAZY and self._gm is not None and self.opts.graphs:
                self.analysis = self._given_analysis = self._row_analysis(self._gm, args)
            return self.analysis

    def _why_ungraphed(self, mutated: frozenset[int], failure: str) -> Fallback | None:
        p, o = self.plan, self.opts
        if not o.graphs:
            return Fallback(Reason.GRAPHS_OFF, "options={'graphs': False}", logging.DEBUG)
        if failure:
            return Fallback(Reason.COMPILE_FAILED, failure, logging.WARNING)
        if p.requires_grad:
            return self._why_no_trees()
        if p.collectives and o.process_group is None:
            return Fallback(Reason.COLLECTIVES, f"the graph calls torch.distributed collectives "
                            f"({', '.join(p.collectives)}): a graph of it is safe only if every rank picks the same "
                            "bucket and falls back with the others; pass options={'process_group': group} (the "
                            "model's group, or a gfxgraph.RankAgreement) to graph it", logging.WARNING)
        if p.unsupported is not None:
            return Fallback(Reason(p.unsupported[0]), p.unsupported[1], logging.WARNING)
        copied = sorted(i for i in mutated if p.slots[i].kind != "ref")
        if copied:
            names = ", ".join(p.slots[i].name for i in copied)
            return Fallback(Reason.INPUT_MUTATION, f"the graph writes to its input(s) {names}, which a graph reads "
                            "from static copies, so the writes would not reach them (parameters, buffers and "
                            "mark_static_address tensors, read in place, may be written)", logging.WARNING)
        if probe().graphs_available and p.devices != {"cuda"}:
            return Fallback(Reason.CPU_INPUTS, f"inputs on {', '.join(sorted(p.devices))}: graphs need every "
                            "tensor input on the GPU", logging.INFO)
        if not self.buckets:
            what = (f"the fixed batch size {p.fixed_batch}" if p.fixed_batch is not None
                    else f"the batch sizes this frame admits {p.batch_range}")
            return Fallback(Reason.OVERSIZE, f"no bucket fits {what}", logging.INFO)
        return None

    def _why_no_trees(self) -> Fallback | None:
        """Why a subgraph that needs autograd runs without graphs (None: the trees serve it)."""
        p, o = self.plan, self.opts
        if p.collectives:
            return Fallback(Reason.COLLECTIVES, f"the graph calls torch.distributed collectives "
                            f"({', '.join(p.collectives)}) and needs autograd: CUDA-graph trees do not agree with "
                            "other ranks, so it runs compiled without graphs (backward works)", logging.WARNING)
        if o.compiler == "eager":
            return Fallback(Reason.TRAINING, "grad mode is on and an input requires grad, and "
                            "options={'compiler': 'eager'} runs the traced graph as it is: graphs for autograd "
                            "(CUDA-graph trees) need compiler 'inductor' or 'aot_eager'", logging.INFO)
        if probe().graphs_available and p.devices != {"cuda"}:
            return Fallback(Reason.CPU_INPUTS, f"inputs on {', '.join(sorted(p.devices))}: graphs need every "
                            "tensor input on the GPU", logging.INFO)
        if self._precompiled is not None:
            return Fallback(Reason.TRAINING, "grad mode is on and an input requires grad in a frame served by "
                            "its split pieces: it runs compiled without graphs (backward works)", logging.INFO)
        return None

    def _agreed_why(self, ranks: RankSession, why: Fallback | None) -> Fallback | None:
        """Graphed on every rank or on none: one round once compiled, naming the ranks that refuse."""
        mine = (Status.REFUSED, str(why)) if why is not None else (Status.OK, "")
        bad = failures(ranks.settle(Round.SUBGRAPH, len(self.plan.slots), lambda: mine))
        if why is None and bad:
            return Fallback(Reason.RANK_DISAGREES, f"other ranks run this subgraph without graphs "
                            f"({describe_failures(bad)}), so this rank does too: its collectives must run the same "
                            "way everywhere", logging.WARNING)
        return why

    def _ungraph(self, why: Fallback) -> None:
        self.state = SubgraphState.UNGRAPHED
        self.fallback = why
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
        if state is SubgraphState.TREES:
            return self._tree_call(args)
        if state is SubgraphState.UNGRAPHED:
            stats.record_fallback(self.fallback or _UNGRAPHED_FALLBACK)
            return self._fn(*args)
        return self._lazy(args)

    def _tree_call(self, args: tuple[Any, ...]) -> Any:
        """The autograd path: the trees-compiled function, its autograd graph watched for a backward."""
        self.tree_calls += 1
        if self.unused_backwards:
            _warn_inference_in_grad_mode()
        if not probe().graphs_available:
            stats.record_fallback(Fallback(Reason.NO_GPU, probe().reason or ""))
        out = self._fn(*args)
        if torch.is_grad_enabled():
            _watch_backward(self, out)
        return out

    def _lazy(self, args: tuple[Any, ...]) -> Any:
        with self._lock:
            if self.state is SubgraphState.LAZY:
                self._lazy_calls += 1
                if self._lazy_calls >= self.opts.static_compile_after:
                    self._compile(list(args))
        if self.state is not SubgraphState.LAZY:
            return self(*args)
        stats.record_fallback(Fallback(Reason.STATIC_SHAPE_WARMUP, "a frame with every shape specialised runs "
                                       f"the traced graph eagerly until its call {self.opts.static_compile_after}",
                                       logging.DEBUG))
        return self._fn(*args)

    def _graphed(self, args: tuple[Any, ...]) -> Any:
        with self._lock:
            if self.state is not SubgraphState.GRAPHED:  # another thread just gave up on graphs
                return _UNGRAPHED
            if self._ref_idx and not pointers_equal(args, self._ref_ptrs, self._ref_idx):
                self._rebind(args)
            if self._follow and not self._follows_batch(args):
                stats.record_fallback(_BATCH_MISMATCH)
                return self._fn(*args)
            key = self._key(args) if self._key_parts else ()
            v = self._variants.get(key)
            if v is None:
                v = self._new_variant(key, args)
                if v is None:
                    if self.state is SubgraphState.GRAPHED:  # over max_variants: this call only
                        stats.record_fallback(Fallback(Reason.MAX_VARIANTS, f"more than {self.opts.max_variants} "
                                                       "shape/constant variants of one subgraph"))
                        return self._fn(*args)
                    return _UNGRAPHED
            for i, buf in v.owned:
                buf.copy_(args[i])
            # the pool pads where the graph's row analysis allows it, checks a bucket's first padded call
            # with poisoned padding, validates, and never pads a subgraph that writes its state
            out = v.pool(*[args[i] for i in self._batched_idx])
            if self.plan.int_outputs:
                out = self._fix_int_outputs(out, args)
            return out

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
            self._ungraph(Fallback(Reason.STRIDED_INPUT, f"batched input(s) {', '.join(bad)} are not contiguous"))
            return None
        template: list[Any] = list(args)
        owned = []
        for i in self._owned_idx:
            template[i] = buf = args[i].detach().clone()  # keeps the strides the compiled code expects...
            if buf.stride() != args[i].stride():  # ...unless they overlap (expanded): no static copy has them
                self._ungraph(Fallback(Reason.STRIDED_INPUT, f"input {self.plan.slots[i].name} has overlapping "
                                       f"strides {args[i].stride()}"))
                return None
            owned.append((i, buf))
        for i in self._batched_idx:
            template[i] = None  # never keep the caller's tensors alive
        for i, _j, _d in self._derived:
            template[i] = None
        o = self.opts
        # a state-writing subgraph warms up at most once: that run is the call's own (the pool's rule)
        warmup = min(o.warmup_iters, 1) if self._writes_state else o.warmup_iters
        # which outputs carry the batch comes from the FX graph; whether rows are independent from the graph's
        # row analysis (a run at another batch size could lie outside what the frame's guards admit)
        pool_opts = o.pool.replace(buckets=tuple(self.buckets), batched_outputs=_leaf_flags(self.plan.batched_outputs),
                                   stateful=self._writes_state, oversize="eager", warmup_iters=warmup, progress=False,
                                   process_group=o.process_group if self.plan.collectives else None)
        pool = ShapeBucketPool.from_options(self._runner(template), pool_opts, verdict=self.verdict,
                                            what="gfxgraph backend subgraph")
        v = self._variants[key] = _Variant(pool, owned)
        return v

    def _runner(self, template: list[Any]) -> Callable[..., Any]:
        """The model the pool captures: batched views (at bucket size) in, the full input list rebuilt.

        Runs only at warm-up, capture and eager fallback, never on replay.
        Sizes derived from the batch are read from the views, so inside a
        graph they are the bucket size. Symbolic ints among the outputs come
        back as None (recomputed per call by :meth:`_fix_int_outputs`), so that a
        replay and an unpadded run agree on them.
        """
        fn, batched_idx, derived = self._fn, self._batched_idx, self._derived
        int_positions = frozenset(io.position for io in self.plan.int_outputs)

        def run(*batched: torch.Tensor) -> Any:
            full = list(template)
            for i, t in zip(batched_idx, batched):
                full[i] = t if t.is_contiguous() else t.contiguous()  # batch_dim > 0: views are strided
            for i, j, d in derived:
                full[i] = full[j].shape[d]
            out = fn(*full)
            if int_positions:
                out = type(out)(None if k in int_positions else o for k, o in enumerate(out))
            return out

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
        why = f", reason={str(self.reason)!r}" if self.reason else ""
        return (f"CompiledSubgraph(state={self.state.value}{why}, compiler={self.compiler}, "
                f"buckets={self.buckets}, captured={self.captured_buckets})")


class _BackwardWatch:
    """A pre-hook on a forward call's autograd node: notes whether a backward ran through it.

    Freed with the autograd graph; one freed before any backward ran through it counts on its
    subgraph (``unused_backwards``). ``__del__`` only counts: it may run inside any allocation,
    so the warning is logged by the subgraph's next call, never here.
    """

    __slots__ = ("sub", "ran")

    def __init__(self, sub: CompiledSubgraph) -> None:
        self.sub = weakref.ref(sub)
        self.ran = False

    def __call__(self, grad_outputs: Any) -> None:
        self.ran = True

    def __del__(self) -> None:
        if not self.ran:
            sub = self.sub()
            if sub is not None:
                sub.unused_backwards += 1


def _watch_backward(sub: CompiledSubgraph, out: Any) -> None:
    """Hook the autograd node of ``out``'s first tensor that has one (every output of an AOT-compiled
    function shares it). Cost: one small object and a hook per forward call in grad mode."""
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
            leaf.grad_fn.register_prehook(_BackwardWatch(sub))
            return


def _warn_inference_in_grad_mode() -> None:
    log_once(("gfxgraph-backend-inference-in-grad-mode",), logging.WARNING,
             "gfxgraph backend: a compiled subgraph ran in grad mode with inputs (parameters) requiring grad, and "
             "its autograd graph was freed without a backward: inference in grad mode. It is served as "
             "mode='reduce-overhead' serves it (CUDA-graph trees: a recording per batch size, and no replay while "
             "an earlier call's outputs are alive and wait for a backward). For inference, call the model under "
             "torch.no_grad() or torch.inference_mode(): gfxgraph then serves it with bucketed graphs (one per "
             "bucket, padded, one compilation for every batch size)")


_UNGRAPHED = object()  # _graphed's answer when the subgraph just turned UNGRAPHED
_UNGRAPHED_FALLBACK = Fallback(Reason.COMPILE_FAILED, "the subgraph runs compiled, without graphs")
_BATCH_MISMATCH = Fallback(Reason.BATCH_MISMATCH, "a size that usually equals the batch size differs from it in "
                           "this call")

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
        self.analysis_seconds = 0.0  # the plan and the row analysis (gfxgraph's own one-time cost)

    def add(self, sub: Any) -> None:
        with self.lock:
            self.live.add(sub)

    def count_compile(self, seconds: float) -> None:
        with self.lock:
            self.compiles += 1
            self.compile_seconds += seconds

    def count_analysis(self, seconds: float) -> None:
        with self.lock:
            self.analysis_seconds += seconds

    def subgraphs(self) -> list[CompiledSubgraph]:
        with self.lock:
            return list(self.live)


_registry = _Registry()


def live_subgraphs() -> list[CompiledSubgraph]:
    """The live subgraphs (state, reason, buckets, captured graphs)."""
    return _registry.subgraphs()


def register_subgraph(sub: Any) -> None:
    """Track ``sub`` (weakly) among the live subgraphs the backend reports on."""
    _registry.add(sub)


def count_compile(seconds: float) -> None:
    """Count one compilation that took ``seconds`` in the backend's process totals."""
    _registry.count_compile(seconds)


def analysis_seconds() -> float:
    """Seconds this process spent analysing subgraphs (input plans and row analyses)."""
    with _registry.lock:
        return _registry.analysis_seconds


def compile_counts() -> tuple[int, float]:
    """(compilations, seconds compiling) in this process."""
    with _registry.lock:
        return _registry.compiles, _registry.compile_seconds
