"""Piecewise graphs: a dynamo graph split at its splitting ops, the pieces graphed per token bucket.

``torch.compile(model, backend="gfxgraph", options={"piecewise": True})``. Serving stacks
(vLLM's PIECEWISE and FULL_AND_PIECEWISE modes, SGLang, TensorRT-LLM) graph the layers
between attention ops for each token count, run attention outside the graphs on its real
shapes, and use one full graph for decode. Workflow of :class:`PiecewiseSubgraph`:

1. Find the token count to pad, a dynamic size of the inputs (:func:`find_token_symbol`).
2. Split the graph at the splitting ops (:mod:`.splitting`), compile each piece once
   (identical pieces, such as a model's layers, share one compilation) and put the parts
   (:class:`~.pieces.Piece`, :class:`~.parts.Splitter`) in the split module.
3. Per call, read the token count ``n``. ``n == 1`` (decode, every row one token) runs one
   full graph of the whole frame, attention included: nothing is padded. Otherwise the
   split module runs with every piece replaying its graph for the bucket ``b >= n``
   (piecewise). Above the largest bucket, without a GPU, or when the frame cannot be
   graphed, the pieces run compiled and unpadded, with the reason counted.
4. The first graphed call captures the largest bucket first (on its own rows, padded), so
   the smaller buckets reuse its memory: every piece of the frame captures into one pool.
5. Outputs are narrowed back to ``n`` rows and copied (``copy_outputs``).

Dynamo compiles a frame of its own for a sequence length of 1 (it specialises sizes 0 and
1); such a frame has no dynamic token count and is served whole by the batch-bucket path
of :mod:`.subgraph`, as one full graph, attention included.

What it will not do: pad a piece that writes state it keeps (a static KV cache is graphed
only at token counts that are buckets, and runs compiled otherwise); pad pieces whose rows
depend on each other (found from the graph, or by the first padded call's check); capture
ahead of time a frame that writes state; share graphs between frames.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from .. import stats
from .._torch_compat import aot_mutated_inputs, generated_forward, pointers_equal, sym_expr, sym_range
from ..fallbacks import Fallback, FallsBack, Reason
from ..graph.buckets import BucketTable, default_buckets
from ..graph.capturer import Capturer
from ..graph.ordering import CallOrder
from ..config import read_vram_cap
from ..log import log_once, logger
from ..platform import probe
from .compiler import compile_graph
from .options import BackendOptions
from .parts import CallContext, Mode, PieceEnv, Splitter, narrow, token_dims, trivial
from .pieces import Piece
from .plan import fx_mutated_inputs, is_ref
from .splitting import SplittingOps, split_graph, structure_key, tuple_output
from .subgraph import CompiledSubgraph, SubgraphState, count_compile, register_subgraph

__all__ = ["PiecewiseSubgraph", "TokenSymbol", "find_token_symbol", "piecewise_subgraph"]


@dataclass(frozen=True)
class TokenSymbol:
    """The dynamic size the piecewise backend pads: its sympy symbol and an input dim that carries it."""

    symbol: Any
    carrier: tuple[int, int]  # (input index, dim)
    example: Any  # the SymInt, for its range


def _fakes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [n.meta.get("example_value", ex) for n, ex in zip(placeholders, example_inputs)]


def find_token_symbol(gm: fx.GraphModule, example_inputs: Sequence[Any], *, token_dim: int | None,
                      batch_dim: int = 0) -> TokenSymbol | None:
    """The token count of a dynamo graph: a plain symbolic size of its first tensor input that has one.

    With ``token_dim``, that dim of the first non-parameter tensor input (None
    when it is not dynamic). Else the innermost dynamic dim of the first input
    that has one, ``batch_dim`` excepted in inputs of two dims or more: so
    ``(batch, seq)`` pads ``seq``, ``(tokens,)`` pads ``tokens``, and a decode
    step's ``(batch, 1)`` has no token count (it is served as one full graph).
    """
    for i, (f, ex) in enumerate(zip(_fakes(gm, example_inputs), example_inputs)):
        if not isinstance(f, torch.Tensor) or is_ref(ex):
            continue
        if token_dim is not None:
            if f.dim() <= token_dim:
                continue
            e = sym_expr(f.shape[token_dim])
            return TokenSymbol(e, (i, token_dim), f.shape[token_dim]) if e is not None and e.is_Symbol else None
        dims = [d for d, s in enumerate(f.shape) if (e := sym_expr(s)) is not None and e.is_Symbol]
        if not dims:
            continue
        dims = [d for d in dims if f.dim() == 1 or d != batch_dim]
        return TokenSymbol(sym_expr(f.shape[dims[-1]]), (i, dims[-1]), f.shape[dims[-1]]) if dims else None
    return None


def piecewise_subgraph(gm: fx.GraphModule, example_inputs: list[Any], opts: BackendOptions) -> Any:
    """What serves a dynamo graph under ``piecewise=True``: a :class:`PiecewiseSubgraph` when it has a
    dynamic token count (and is not training), else the whole graph as one (full) graph."""
    ops = SplittingOps(opts.splitting_ops)
    splits = any(ops.matches(n) for n in gm.graph.nodes)
    grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
    token = None if grad else find_token_symbol(gm, example_inputs, token_dim=opts.token_dim,
                                                batch_dim=opts.batch_dim)
    if token is not None:
        try:
            return PiecewiseSubgraph(gm, example_inputs, opts, token, ops)
        except _NotPiecewise as why:
            logger.info("gfxgraph backend: a frame runs as one graph instead of piecewise: %s", why)
    return CompiledSubgraph(gm, example_inputs, opts, role="full" if splits else "whole")


class _NotPiecewise(Exception):
    """A frame the piecewise path cannot serve (it is served whole instead)."""


class PiecewiseSubgraph(FallsBack):
    """One dynamo frame served piecewise (module docstring). Calls are serialised by a lock."""

    role = "piecewise"

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], opts: BackendOptions, token: TokenSymbol,
                 ops: SplittingOps) -> None:
        self.opts, self.token = opts, token
        self.state = SubgraphState.GRAPHED
        self.fallback: Fallback | None = None  # why it runs without graphs, while UNGRAPHED
        self.compiler: str | None = None
        self.compile_seconds = 0.0
        self._lock = threading.RLock()
        self._gm = gm  # kept for the full graph of a one-token call
        self._read_inputs(gm, example_inputs)
        lo, hi = sym_range(token.example, token.symbol)
        base = list(opts.token_buckets) if opts.token_buckets else default_buckets(opts.max_tokens)
        self.buckets = [b for b in base if b >= lo and (hi is None or b <= hi)]
        self._table = BucketTable(self.buckets) if self.buckets else None
        self._graphs = probe().graphs_available
        capturer = Capturer(warmup_iters=opts.warmup_iters, vram_cap=opts.vram_cap or read_vram_cap(),
                            capture_error_mode="thread_local") if self._graphs else None
        self.ctx = CallContext()
        self.env = PieceEnv(self.ctx, capturer, token.symbol, (lo, hi), self.buckets[-1] if self.buckets else 1,
                            opts.pad_value, opts.warmup_iters)
        self.split, parts = split_graph(gm, ops)
        self._forward = generated_forward(self.split)
        self.pieces: list[Piece] = []
        self.splitters: list[Splitter] = []
        self._install(parts, self._ref_positions(parts))
        self._order = CallOrder()
        self._full: CompiledSubgraph | None = None
        self._variants: set[tuple[Any, ...]] = set()
        self._complete: set[tuple[Any, ...]] = set()  # keys every piece captured, together
        # a piece that is never padded is graphed at token counts that are buckets: those calls get keys
        # of their own, so that the key's pieces all capture in one call
        self._exact_keys = any(p.block is not None for p in self.pieces)
        self._largest_first = not any(p.stateful for p in self.pieces)
        self.calls = {"piecewise": 0, "full": 0, "eager": 0}
        self.largest_first_seconds = 0.0
        self._why_ungraphed()
        register_subgraph(self)

    # -------------------------------------------------------------- build
    def _read_inputs(self, gm: fx.GraphModule, example_inputs: list[Any]) -> None:
        fakes = _fakes(gm, example_inputs)
        sym = self.token.symbol
        self._ref_idx = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and is_ref(x)]
        self._ref_ptrs: list[int | None] = [None] * len(example_inputs)
        for i in self._ref_idx:
            self._ref_ptrs[i] = example_inputs[i].data_ptr()
        self._carriers: dict[Any, tuple[int, int | None]] = {sym: self.token.carrier}
        self._consts: list[int] = []
        self._token_inputs: list[tuple[int, tuple[int, ...]]] = []  # frame tensors with token dims
        self._token_ints: list[int] = []
        self._largest_ok = True  # every token-carrying input can be padded for the largest-first capture
        needed: set[Any] = set()
        for i, f in enumerate(fakes):
            if isinstance(f, torch.Tensor):
                if i in self._ref_idx:
                    continue
                for d, s in enumerate(f.shape):
                    e = sym_expr(s)
                    if e is not None:
                        needed |= e.free_symbols
                        if e.is_Symbol:
                            self._carriers.setdefault(e, (i, d))
                dims, mixed = token_dims(f, sym)
                self._largest_ok = self._largest_ok and not mixed
                if dims:
                    self._token_inputs.append((i, dims))
            elif (e := sym_expr(f)) is not None:
                needed |= e.free_symbols
                if e.is_Symbol:
                    self._carriers.setdefault(e, (i, None))
                    if e == sym:
                        self._token_ints.append(i)
            elif not isinstance(f, torch.SymInt):
                try:
                    hash(example_inputs[i])
                except TypeError:
                    raise _NotPiecewise(f"input {i} is an unhashable {type(example_inputs[i]).__name__}") from None
                self._consts.append(i)
        missing = needed - set(self._carriers)
        if missing:
            raise _NotPiecewise(f"the sizes {sorted(map(str, missing))} are carried by no input")
        self._others = [s for s in self._carriers if s != sym]
        self.devices = frozenset(example_inputs[i].device.type for i, f in enumerate(fakes)
                                 if isinstance(f, torch.Tensor) and i not in self._ref_idx)
        outs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
        self._out_dims: list[tuple[int, ...]] = []
        for o in outs if isinstance(outs, (tuple, list)) else (outs,):
            v = o.meta.get("example_value") if isinstance(o, fx.Node) else o
            self._out_dims.append(token_dims(v, sym)[0] if isinstance(v, torch.Tensor) else ())

    def _ref_positions(self, parts: list[Any]) -> dict[str, frozenset[int]]:
        """Per part, which of its inputs are the frame's parameters/buffers (read in place)."""
        frame_ph = [n for n in self.split.graph.nodes if n.op == "placeholder"]
        ref_nodes = {frame_ph[i] for i in self._ref_idx if i < len(frame_ph)}
        calls = {n.target: n for n in self.split.graph.nodes if n.op == "call_module"}
        return {p.name: frozenset(k for k, a in enumerate(calls[p.name].args) if a in ref_nodes) for p in parts}

    def _install(self, parts: list[Any], refs: dict[str, frozenset[int]]) -> None:
        """Compile every piece (once per distinct piece) and put the parts in the split module."""
        compiled: dict[Any, tuple[Any, str, str, frozenset[int] | None]] = {}
        outputs = next(n for n in reversed(self.split.graph.nodes) if n.op == "output").args[0]
        from_piece: set[str] = set()
        for part in parts:
            if part.splitting:
                runner: Any = Splitter(part.module, self.env)
                self.splitters.append(runner)
            else:
                single = tuple_output(part.module)
                runner = self._piece(part, single, refs[part.name], compiled)
                self.pieces.append(runner)
                from_piece.add(part.name)
            self.split.__dict__[part.name] = runner  # shadows the submodule: the split module calls ours
        flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        self._out_plan = [(k, self._out_dims[k] if k < len(self._out_dims) else (), _produced_by(o) in from_piece)
                          for k, o in enumerate(flat)]

    def _piece(self, part: Any, single: bool, refs: frozenset[int], cache: dict[Any, Any]) -> Piece:
        module = part.module
        if trivial(module):
            return Piece(part.name, module, generated_forward(module), self.env, single=single, refs=refs,
                         mutated=fx_mutated_inputs(module), never=None, trivial=True)
        key = structure_key(module)
        hit = cache.get(key) if key is not None else None
        if hit is None:
            fakes = [n.meta.get("example_value") for n in module.graph.nodes if n.op == "placeholder"]
            t0 = time.perf_counter()
            fn, compiler, failure = compile_graph(module, fakes, self.opts, on_cpu=self.devices == {"cpu"})
            seconds = time.perf_counter() - t0
            self.compile_seconds += seconds
            count_compile(seconds)
            mutated = aot_mutated_inputs(len(fakes)) if compiler in ("inductor", "aot_eager") else None
            hit = (fn, compiler, failure, mutated if mutated is not None else fx_mutated_inputs(module))
            if key is not None:
                cache[key] = hit
        fn, self.compiler, failure, mutated = hit
        never = Fallback(Reason.COMPILE_FAILED, f"{part.name}: {failure}") if failure else None
        if not self.opts.graphs:
            never = Fallback(Reason.GRAPHS_OFF, "options={'graphs': False}", logging.DEBUG)
        return Piece(part.name, module, fn, self.env, single=single, refs=refs, mutated=mutated, never=never,
                     trivial=False)

    def _why_ungraphed(self) -> None:
        if not self.opts.graphs:
            self.state = SubgraphState.UNGRAPHED
            self.fallback = Fallback(Reason.GRAPHS_OFF, "options={'graphs': False}", logging.DEBUG)
        elif self._graphs and self.devices != {"cuda"}:
            self.state = SubgraphState.UNGRAPHED
            self.fallback = Fallback(Reason.CPU_INPUTS, f"inputs on {', '.join(sorted(self.devices))}: graphs need "
                                     "every tensor input on the GPU", logging.INFO)

    # --------------------------------------------------------------- call
    def __call__(self, *args: Any) -> Any:
        """Run the frame on dynamo's flat inputs: full graph, piecewise graphs, or compiled (module docstring)."""
        with self._lock:
            if self.state is not SubgraphState.GRAPHED:
                stats.record_fallback(self.fallback or Fallback(Reason.GRAPHS_OFF))
                return self._direct(args)
            i, d = self.token.carrier
            n = args[i].shape[d]
            if n == 1:  # decode: one token per row, nothing to pad; attention may sit in the graph
                self.calls["full"] += 1
                return self._full_graph(args)
            if self._ref_idx and not pointers_equal(args, self._ref_ptrs, self._ref_idx):
                self._rebind(args)
            if self._table is None or n > self._table.largest:
                stats.record_fallback(Fallback(Reason.OVERSIZE, f"token counts above the largest token bucket "
                                               f"{self.buckets[-1] if self.buckets else None}", logging.INFO))
                return self._direct(args)
            if not self._graphs and not self.opts.simulate_padding:
                stats.record_fallback(Fallback(Reason.NO_GPU, probe().reason or ""))
                return self._direct(args)
            values = {s: (args[j].shape[dim] if dim is not None else args[j]) for s, (j, dim) in self._carriers.items()}
            exact = (*(values[s] for s in self._others), *(args[j] for j in self._consts))
            if exact not in self._variants:
                if len(self._variants) >= self.opts.max_variants:
                    stats.record_fallback(Fallback(Reason.MAX_VARIANTS, f"more than {self.opts.max_variants} variants "
                                                   "(sizes other than the token count, constants) of one piecewise "
                                                   "frame"))
                    return self._direct(args)
                self._variants.add(exact)
            if self._largest_first:
                self._capture_largest(args, values, exact)
            if self._graphs:
                self._order.after_previous()
            else:
                stats.record_fallback(Fallback(Reason.NO_GPU, probe().reason or ""))  # simulate_padding: per call
            b = self._table[n]
            self.calls["piecewise"] += 1
            return self._finish(self._graphed(args, n, b, values, exact), n, b)

    def _direct(self, args: Sequence[Any]) -> Any:
        self.calls["eager"] += 1
        return self._forward(*args)

    def _graphed(self, args: Sequence[Any], n: int, b: int, values: dict[Any, int], exact: tuple[Any, ...]) -> Any:
        """Run the split module with the pieces on the graphs of the call's key (captured on its first call)."""
        ctx = self.ctx
        key = (b, n == b, *exact) if self._exact_keys else (b, *exact)
        if key not in self._complete:  # a capture call: no piece may replay a graph of an earlier one
            for p in self.pieces:
                p.drop(key)
        ctx.mode, ctx.n, ctx.b, ctx.padded, ctx.key, ctx.exact, ctx.values = (Mode.GRAPH, n, b, n != b, key, exact,
                                                                             values)
        ctx.complete, ctx.stale, ctx.blocked = key in self._complete, False, False
        ctx.ran.clear()
        try:
            out = self._forward(*args)  # the generated code: no module hooks to run
        finally:
            ctx.mode, ctx.padded = Mode.DIRECT, False
            ctx.ran.clear()
        if ctx.blocked and not self._exact_keys:  # a piece now runs unpadded: exact counts get keys of their own
            self._exact_keys = True
            self.close()
        elif ctx.stale:
            self._complete.discard(key)
        else:
            self._complete.add(key)
        return out

    def _finish(self, out: Any, n: int, b: int) -> Any:
        """Outputs narrowed to the real token count and, from graphed pieces, copied (``copy_outputs``)."""
        copy = self.opts.copy_outputs
        if n == b and not copy:
            return out
        res = list(out)
        for k, dims, from_piece in self._out_plan:
            t = res[k]
            if not isinstance(t, torch.Tensor):
                continue
            if dims and n != b:
                t = narrow(t, dims, n)
            if copy and from_piece:
                t = t.clone()
            res[k] = t
        return type(out)(res) if isinstance(out, (tuple, list)) else res[0]

    def _capture_largest(self, args: Sequence[Any], values: dict[Any, int], exact: tuple[Any, ...]) -> None:
        """Capture every piece at the largest bucket first, on the call's rows padded to it; smaller
        buckets then reuse that memory. Skipped for a frame that writes state (it would be written)."""
        self._largest_first = False
        largest, n = self.buckets[-1], values[self.token.symbol]
        if self.env.capturer is None or not self._largest_ok or self._table[n] == largest:
            return
        padded = list(args)
        for i, dims in self._token_inputs:
            a = args[i]
            shape = [largest if d in dims else s for d, s in enumerate(a.shape)]
            buf = torch.full(shape, self.opts.pad_value or 0, dtype=a.dtype, device=a.device)
            narrow(buf, dims, n).copy_(a)
            padded[i] = buf
        for i in self._token_ints:
            padded[i] = largest
        t0 = time.perf_counter()
        try:
            self._graphed(padded, largest, largest, {**values, self.token.symbol: largest}, exact)
        except Exception as exc:  # the pieces capture on first use instead
            logger.warning("gfxgraph backend: capturing the largest token bucket (%d) first failed: %s: %s",
                           largest, type(exc).__name__, exc)
        self.largest_first_seconds = time.perf_counter() - t0

    def _full_graph(self, args: Sequence[Any]) -> Any:
        """A one-token call: the whole frame as one graph, through the batch-bucket path."""
        if self._full is None:
            self._full = CompiledSubgraph(self._gm, list(args), self.opts, compiled=self._run_direct, role="full")
        return self._full(*args)

    def _run_direct(self, *args: Any) -> Any:
        return self._forward(*args)  # the context is DIRECT outside _graphed: every part runs as compiled

    def _rebind(self, args: Sequence[Any]) -> None:
        """Parameters or buffers moved: the graphs read the old memory; capture again."""
        log_once(("gfxgraph-piecewise-rebind", id(self)), logging.INFO,
                 "gfxgraph backend: parameters or buffers of a piecewise frame moved; re-capturing its graphs")
        self.close()
        for i in self._ref_idx:
            self._ref_ptrs[i] = args[i].data_ptr()

    # ------------------------------------------------------ introspection
    @property
    def captured_buckets(self) -> list[int]:
        """Token buckets with at least one captured piece graph."""
        return sorted({b for p in self.pieces for b in p.captured_buckets})

    def graph_count(self) -> int:
        return sum(p.graph_count() for p in self.pieces) + (self._full.graph_count() if self._full else 0)

    def pool_bytes(self) -> int:
        mine = self.env.capturer.pool_bytes() if self.env.capturer is not None else 0
        return mine + (self._full.pool_bytes() if self._full else 0)

    def capture_seconds(self) -> float:
        return self.env.capturer.seconds if self.env.capturer is not None else 0.0

    def report(self) -> dict[str, Any]:
        """What this frame holds: pieces and how each runs, graphs, memory, capture time, calls by path."""
        return {
            "pieces": len(self.pieces), "splitting_ops": len(self.splitters), "buckets": list(self.buckets),
            "graphs": self.graph_count(), "pool_bytes": self.pool_bytes(),
            "staging_bytes": sum(p.staging_bytes() for p in self.pieces),
            "capture_seconds": self.capture_seconds(), "largest_first_seconds": self.largest_first_seconds,
            "compile_seconds": self.compile_seconds, "calls": dict(self.calls),
            "piece_replays": sum(p.replays for p in self.pieces),
            "piece_captures": sum(p.captures for p in self.pieces),
            "piece_eager_runs": sum(p.eager_runs for p in self.pieces),
            "piece_status": [f"{p.name}: {p.status()}" for p in self.pieces],
        }

    def close(self) -> None:
        """Release every graph and static buffer; later calls capture again (largest first). Idempotent."""
        with self._lock:
            for p in self.pieces:
                p.close()
            if self._full is not None:
                self._full.close()
            if self.env.capturer is not None:
                self.env.capturer.forget_growth()
            self._complete.clear()
            self._largest_first = not any(p.stateful for p in self.pieces)

    def __repr__(self) -> str:
        why = f", reason={str(self.reason)!r}" if self.reason else ""
        return (f"PiecewiseSubgraph(state={self.state.value}{why}, pieces={len(self.pieces)}, "
                f"splitting_ops={len(self.splitters)}, buckets={self.buckets}, captured={self.captured_buckets})")


def _produced_by(o: Any) -> str | None:
    """The submodule whose output ``o`` (an output node's argument) is, if any."""
    if not isinstance(o, fx.Node):
        return None
    if o.op == "call_module":
        return str(o.target)
    if o.op == "call_function" and o.args and isinstance(o.args[0], fx.Node) and o.args[0].op == "call_module":
        return str(o.args[0].target)
    return None
