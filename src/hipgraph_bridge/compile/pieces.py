"""A piece of a piecewise frame: one submodule between splitting ops, graphed per token bucket.

Workflow of a call in a padded call of its frame (``n`` real tokens, bucket ``b``):

1. Tensor inputs that carry the token count arrive padded (``b`` rows: the
   previous piece's graph outputs, which the graph reads in place) or real
   (``n`` rows: a splitting op's output, a frame input); real ones are copied
   into the piece's static buffer (an :class:`~hipgraph_bridge.padding.staging.Arena`,
   ``FillPolicy.ONCE``: its padding rows hold ``pad_value`` or rows of earlier
   calls, harmless where rows are proven independent). The token count passed
   as an int is the bucket size inside the graph.
2. The key's graph replays. It was captured on the key's first call, into the
   frame's one memory pool, while the outputs of the pieces before it were
   alive, so it never overwrites what later pieces still read; its outputs
   stay padded for the next piece.
3. The first padded call of every graph is checked by the engine's padding
   check (:mod:`hipgraph_bridge.padding.confirm`): the graph replayed with its
   padding rows poisoned; rows that interact stop the piece's padding. In
   validation mode every call is compared with an unpadded run.

A piece runs without padding, compiled, on its inputs narrowed to the real
rows (reason counted) when padding could change its results (the row
analysis of its graph, :mod:`hipgraph_bridge.padding.rows`; the token count
used as a value; sizes such as ``2*s`` at its boundary; a padding check that
failed) or when it writes state it keeps (a static KV cache): such a piece is
graphed only for calls whose token count is a bucket, with at most one
warm-up, and never run twice for one call. Without a GPU (``simulate_padding``)
the same pipeline runs, the compiled piece called on the padded buffers where
a replay would be (and on poisoned ones for the check).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .. import config, stats
from .._torch_compat import non_owning_view, sym_expr, weak_view_supported
from ..fallbacks import Fallback, Reason
from ..graph.capture import record_on_current_stream
from ..graph.weak_outputs import release_outputs
from ..padding.confirm import confirm_padding
from ..padding.entry import Entry
from ..padding.fx import trace_graph
from ..padding.staging import Arena, PadRegion
from ..validation import checked_against_eager
from .parts import Layout, Mode, PieceEnv, narrow, token_dims
from .plan import graph_modules, value_use

__all__ = ["Piece"]


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    pad_dims: tuple[int, ...]  # dims whose size is exactly the token count
    layout: Layout
    mutated: bool
    broadcast: tuple[int, ...]  # dims of stride 0 (an expanded input): staged once, not per row


@dataclass
class _Entry(Entry):
    """One graph of a piece, for one key: the engine's entry, plus what the piece reads and where."""

    statics: list[Any] = field(default_factory=list)  # per tensor slot: the tensor the graph reads (None until set)
    ptrs: list[int] = field(default_factory=list)
    out_ptrs: frozenset[int] = frozenset()
    views: dict[int, list[Any]] = field(default_factory=dict)  # n -> per slot the real rows' view


def _one_row(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


class Piece:
    """One piece (module docstring). ``fn`` is its compiled function, returning a tuple.

    Cost of a replayed call: a data-pointer check per tensor input, a copy
    and a fill for each input that is not already the graph's own, the
    replay, an int recomputed per symbolic-size output.
    """

    def __init__(self, name: str, module: fx.GraphModule, fn: Callable[..., Any], env: PieceEnv, *,
                 single: bool, refs: frozenset[int], mutated: frozenset[int], never: Fallback | None,
                 trivial: bool) -> None:
        self.name, self.env, self.fn, self.single, self.trivial = name, env, fn, single, trivial
        token = env.token
        fakes = [n.meta.get("example_value") for n in module.graph.nodes if n.op == "placeholder"]
        self.slots: list[_TensorSlot] = []
        self.token_ints: list[int] = []
        compound: list[str] = []
        for k, f in enumerate(fakes):
            if isinstance(f, torch.Tensor) and k not in refs:
                dims, mixed = token_dims(f, token)
                layout = Layout(f)
                broadcast = tuple(d for d, st in enumerate(layout.strides) if isinstance(st, int) and st == 0)
                self.slots.append(_TensorSlot(k, dims, layout, k in mutated, broadcast))
                if mixed:
                    compound.append(f"input {k} has shape {tuple(f.shape)}")
            elif (e := sym_expr(f)) is not None and token in e.free_symbols:
                if e == token:
                    self.token_ints.append(k)
                else:
                    compound.append(f"input {k} is the size {e}")
        outs = next(n for n in reversed(module.graph.nodes) if n.op == "output").args[0]
        self.out_dims: list[tuple[int, tuple[int, ...]]] = []
        self.int_outputs: list[tuple[int, Any]] = []
        for k, o in enumerate(outs):
            v = o.meta.get("example_value") if isinstance(o, fx.Node) else o
            if isinstance(v, torch.Tensor):
                dims, mixed = token_dims(v, token)
                if dims:
                    self.out_dims.append((k, dims))
                if mixed:
                    compound.append(f"output {k} has shape {tuple(v.shape)}")
            elif (e := sym_expr(v)) is not None and token in e.free_symbols:
                self.int_outputs.append((k, e))
        self.stateful = bool(mutated & refs)
        if never is None and mutated - refs:
            never = Fallback(Reason.INPUT_MUTATION, f"{name} writes to its input(s) {sorted(mutated - refs)}, which "
                             "a graph would read from static copies")
        self.never = never  # why this piece is never graphed
        # why it is never padded
        self.block = None if trivial else self._padding_block(module, fakes, refs, compound)
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self._arena = Arena(env.pad_value)
        self.replays = self.captures = self.eager_runs = 0

    def _padding_block(self, module: fx.GraphModule, fakes: list[Any], refs: frozenset[int],
                       compound: list[str]) -> Fallback | None:
        token = self.env.token
        if self.stateful:
            return Fallback(Reason.STATEFUL, f"{self.name} writes state it keeps (a static KV cache?): padding rows "
                            "would write to it, so it is graphed only when the token count is a bucket", logging.INFO)
        if compound:
            return Fallback(Reason.SIZE_EXPRESSION, f"{self.name}: {compound[0]}, which padding cannot slice back",
                            logging.INFO)
        for node in (n for g in graph_modules(module) for n in g.graph.nodes):  # regions' subgraphs too
            e = sym_expr(node.meta.get("example_value"))
            if e is not None and token in e.free_symbols and (bad := value_use(node)) is not None:
                return Fallback(Reason.SIZE_AS_VALUE, f"{self.name}: the token count is used as a value by "
                                f"{bad.format_node()}; a padded graph would see the bucket size there")
        several = [s.index for s in self.slots if len(s.pad_dims) > 1]
        if several:
            return Fallback(Reason.UNPROVEN, f"{self.name}: input {several[0]} carries the token count in several "
                            "dimensions, which the row analysis does not follow")
        lo, hi = self.env.token_range
        verdict = trace_graph(module, fakes, batched={s.index: s.pad_dims[0] for s in self.slots if s.pad_dims},
                              refs=refs, symbols={token}, lo=lo, hi=hi)
        if verdict.reason is not None and verdict.reason != Reason.STATEFUL:
            return Fallback(verdict.reason, f"{self.name}: {verdict.detail}")
        return None

    # ----------------------------------------------------------------- call
    def __call__(self, *args: Any) -> Any:
        """Run the piece for the frame's current call (hot path: a replay)."""
        ctx = self.env.ctx
        if ctx.mode is Mode.DIRECT:
            out = self.fn(*args)
            return out[0] if self.single else out
        if self.trivial:
            out = self._run_real(args)
        elif self.never is not None:
            out = self._fallback(self.never, args)
        elif ctx.padded and self.block is not None:
            out = self._fallback(self.block, args)
        else:
            entry = self.entries.get(ctx.key)
            if entry is None:
                out = self._first(args)
            elif entry.fallback is not None:
                out = self._fallback(entry.fallback, args)
            else:
                out = self._checked(entry, self._run(entry, args), args)
        return out[0] if self.single else out

    def _fallback(self, why: Fallback, args: tuple[Any, ...]) -> tuple[Any, ...]:
        stats.record_fallback(why)
        self.eager_runs += 1
        return self._run_real(args)

    def _run_real(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The compiled piece on the call's real rows (padded inputs narrowed, strides conformed)."""
        ctx = self.env.ctx
        if not ctx.padded:
            return self.fn(*args)
        call = list(args)
        n = ctx.n
        for slot in self.slots:
            a = call[slot.index]
            if slot.pad_dims and any(a.shape[d] != n for d in slot.pad_dims):
                a = narrow(a, slot.pad_dims, n)
            if not (slot.mutated or self.trivial):  # the compiled piece checks its inputs' strides
                a = slot.layout.conform(a, ctx.values)
            call[slot.index] = a
        return self.fn(*call)

    def _run(self, entry: _Entry, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Replay the key's graph (or, without a GPU, run the piece on the padded buffers)."""
        if entry.graph is None:  # simulate_padding: the compiled piece on the padded buffers
            out = self.fn(*self._bucket_args(entry, args, capture=False))
            return self._fix_ints(out) if self.int_outputs else out
        ptrs = entry.ptrs
        for pos, slot in enumerate(self.slots):
            a = args[slot.index]
            if a.data_ptr() != ptrs[pos]:
                self._stage(entry, pos, a)
        entry.graph.replay()
        self.replays += 1
        self.env.ctx.ran.append(entry)
        out = entry.outputs
        return self._fix_ints(out) if self.int_outputs else out

    def _fix_ints(self, out: tuple[Any, ...]) -> tuple[Any, ...]:
        """Sizes the graph computed for the bucket, recomputed for the call's real token count."""
        vals = list(out)
        for k, e in self.int_outputs:
            vals[k] = int(e.xreplace(self.env.ctx.values))
        return tuple(vals)

    def _checked(self, entry: _Entry, out: tuple[Any, ...], args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A graph's first padded result goes through the padding check; every result in validation mode is
        compared with an unpadded run of the compiled piece."""
        ctx = self.env.ctx
        if ctx.padded and not entry.confirmed and not self.stateful:
            why = self._confirm(entry, args)
            if why:
                detail = (f"{self.name}: bucket {ctx.b} for {ctx.n} tokens: {why}; rows depend on each other, so "
                          "this piece runs unpadded from now on")
                self.block = Fallback(Reason.PADDING_CHANGES_RESULTS, detail)
                ctx.blocked = True
                stats.record_fallback(self.block)
                return tuple(self._run_real(args))
        if not (config.switches.validate and not self.stateful):
            return out
        reference = tuple(self._run_real(args))  # compilers return lists or tuples
        mine = self._real_rows(out)
        if checked_against_eager(mine, reference, owner=self, what="piecewise piece") is reference:
            return reference
        return out

    def _real_rows(self, out: Any) -> tuple[Any, ...]:
        ctx = self.env.ctx
        if not ctx.padded:
            return tuple(out)
        return tuple(narrow(t, dims, ctx.n) if isinstance(t, torch.Tensor) else t
                     for t, dims in zip(out, self._dims_per_output(len(out))))

    def _confirm(self, entry: _Entry, args: tuple[Any, ...]) -> str:
        """The engine's padding check on this piece's graph (or, without a GPU, its compiled function run on
        the poisoned buffers): "" when the real rows hold whatever the padding holds."""
        ctx = self.env.ctx
        regions = []
        for pos, slot in enumerate(self.slots):
            st = entry.statics[pos]
            if not slot.pad_dims or st is None or any(st.shape[d] == ctx.n for d in slot.pad_dims):
                continue
            real = narrow(st, slot.pad_dims, ctx.n)
            pad = st.narrow(slot.pad_dims[0], ctx.n, ctx.b - ctx.n) if len(slot.pad_dims) == 1 else None
            regions.append(PadRegion(st, real, pad))
        if entry.graph is not None:
            replay = entry.graph.replay

            def read() -> list[Any]:
                return list(self._real_rows(entry.outputs))
        else:  # simulate_padding: the compiled piece on the padded (and poisoned) buffers
            call = self._bucket_args(entry, args, capture=False)
            last: list[Any] = []

            def replay() -> None:
                last[:] = [tuple(self.fn(*call))]

            def read() -> list[Any]:
                return list(self._real_rows(last[0]))
        why = confirm_padding(replay, regions, self.env.pad_value or 0, read)
        entry.confirmed = not why
        return why

    def _dims_per_output(self, count: int) -> list[tuple[int, ...]]:
        dims: list[tuple[int, ...]] = [()] * count
        for k, d in self.out_dims:
            dims[k] = d
        return dims

    # -------------------------------------------------------------- capture
    def _first(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The key's first call: build its static inputs, capture (no GPU: run padded), answer the call.

        A key's pieces capture in one call, in order, each while the outputs
        of those before it are alive; a piece that meets a key the others
        captured earlier runs unpadded instead and has the key captured anew.
        """
        ctx, env = self.env.ctx, self.env
        if ctx.complete and env.capturer is not None:
            ctx.stale = True
            return self._fallback(Fallback(Reason.RECAPTURE, f"{self.name} meets a key its frame captured without "
                                           "it; the key's graphs are captured again, together, on its next call",
                                           logging.DEBUG), args)
        entry = _Entry(ctx.b, ctx.key, statics=[None] * len(self.slots), ptrs=[0] * len(self.slots))
        call = self._bucket_args(entry, args, capture=True)
        if env.capturer is None:  # simulate_padding without a GPU
            self.entries[ctx.key] = entry
            out = self.fn(*call)
            return self._checked(entry, self._fix_ints(out) if self.int_outputs else out, args)
        run = lambda: self.fn(*call)  # noqa: E731
        warmup = min(env.warmup_iters, 1) if self.stateful else env.warmup_iters
        captured = env.capturer.capture(run, f"{self.name} token bucket {ctx.b}", warm=[run] * warmup,
                                        keep_warm=self.stateful)
        if captured.fallback is not None:
            return self._failed(entry, captured, args)
        entry.graph = captured.graph
        leaves = tuple(captured.outputs)
        entry.outputs = tuple(release_outputs(list(leaves)))
        entry.out_ptrs = frozenset(t.data_ptr() for t in leaves if isinstance(t, torch.Tensor))
        self.entries[ctx.key] = entry
        self.captures += 1
        if self.stateful and captured.warm is not None:  # ran once: its warm-up is this call's run
            record_on_current_stream(list(captured.warm))
            return tuple(captured.warm)
        entry.graph.replay()
        ctx.ran.append(entry)
        out = self._fix_ints(leaves) if self.int_outputs else leaves  # strong: alive until later pieces ran
        return self._checked(entry, out, args)

    def _failed(self, entry: _Entry, captured: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A capture that failed: the piece's own error when it raised on the real rows, else eager."""
        ctx = self.env.ctx
        if captured.stage == "warm_up":  # the piece raised on the static inputs
            if not ctx.padded or self.stateful:
                raise captured.error
            out = self._run_real(args)  # raises the piece's own error for a bad input
            entry.fallback = Fallback(Reason.PADDED_RUN_FAILED, captured.fallback.detail)
        else:
            entry.fallback = captured.fallback
            if captured.warm is not None:  # a state-writing piece ran in its warm-up: never run it again
                self.entries[ctx.key] = entry
                stats.record_fallback(entry.fallback)
                record_on_current_stream(list(captured.warm))
                return tuple(captured.warm)
            out = None
        self.entries[ctx.key] = entry
        return out if out is not None else self._fallback(entry.fallback, args)

    def _bucket_args(self, entry: _Entry, args: tuple[Any, ...], *, capture: bool) -> list[Any]:
        """The piece's arguments at the bucket: padded inputs as they are, real ones staged and padded.

        At capture an input that is already a graph output of this call (at
        bucket size) is read in place: the graph records its address. None
        when an input must be staged but its layout overlaps (expanded).
        """
        env, ctx = self.env, self.env.ctx
        call = list(args)
        for k in self.token_ints:
            call[k] = ctx.b
        at_b = {**ctx.values, env.token: ctx.b}
        produced: set[int] = set()
        if capture and env.capturer is not None:
            produced = set().union(*(e.out_ptrs for e in ctx.ran))
        for pos, slot in enumerate(self.slots):
            a = args[slot.index]
            shape, strides = slot.layout.realize(at_b)
            if tuple(a.shape) == shape and (env.capturer is None or a.data_ptr() in produced) and not slot.mutated:
                if capture:
                    entry.statics[pos] = non_owning_view(a) if weak_view_supported and a.is_cuda else a
                    entry.ptrs[pos] = a.data_ptr()
                continue
            if entry.statics[pos] is None:
                buf = self._staging(pos, slot, shape, strides, at_b)
                entry.statics[pos], entry.ptrs[pos] = buf, buf.data_ptr()
            self._stage(entry, pos, a)
            call[slot.index] = entry.statics[pos]
        return call

    def _staging(self, pos: int, slot: _TensorSlot, shape: tuple[int, ...], strides: tuple[int, ...],
                 at_b: dict[Any, int]) -> torch.Tensor:
        """A static input buffer at the bucket: a view of the slot's arena allocation for the largest bucket
        (``FillPolicy.ONCE``: padding rows hold ``pad_value`` or a real row of an earlier call, both harmless
        to rows that do not interact, and token ids stay valid indices)."""
        largest = slot.layout.realize({**at_b, self.env.token: self.env.largest})
        return self._arena.view((pos, self.env.ctx.exact), shape, strides, largest, slot.layout.dtype,
                                slot.layout.device)

    def _stage(self, entry: _Entry, pos: int, a: torch.Tensor) -> None:
        """Copy ``a`` into the slot's static input: whole when it has the bucket's shape, else its real
        rows (the padding rows were filled when the buffer was made; see :meth:`_staging`)."""
        st, slot = entry.statics[pos], self.slots[pos]
        if slot.broadcast:  # an expanded input: its one row along those dims is all there is to copy
            st, a = _one_row(st, slot.broadcast), _one_row(a, slot.broadcast)
        if a.shape == st.shape:
            st.copy_(a)
            return
        n = self.env.ctx.n
        region = entry.views.get(n)
        if region is None:
            region = entry.views[n] = [None] * len(self.slots)
        view = region[pos]
        if view is None:
            view = region[pos] = narrow(st, tuple(d for d in slot.pad_dims if d not in slot.broadcast), n)
        if a.shape != view.shape:
            raise RuntimeError(f"gfxgraph piecewise: {self.name} input {slot.index} has shape "
                               f"{tuple(a.shape)}; expected {tuple(view.shape)} or {tuple(st.shape)}")
        view.copy_(a)

    # -------------------------------------------------------- introspection
    @property
    def captured_buckets(self) -> list[int]:
        """Token buckets with a captured graph."""
        return sorted({k[0] for k, e in self.entries.items() if e.graph is not None})

    @property
    def buckets_used(self) -> list[int]:
        """Token buckets this piece ran at (graphs, failed captures, and without a GPU the padded runs)."""
        return sorted({k[0] for k in self.entries})

    def graph_count(self) -> int:
        return sum(1 for e in self.entries.values() if e.graph is not None)

    def staging_bytes(self) -> int:
        return self._arena.nbytes()

    def status(self) -> str:
        """How this piece runs: "graphed", "trivial", or the reason it is never graphed / never padded."""
        if self.trivial:
            return "trivial"
        if self.never is not None:
            return f"ungraphed: {self.never.reason.value}"
        return "graphed" if self.block is None else f"unpadded: {self.block.reason.value}"

    def drop(self, key: tuple[Any, ...]) -> None:
        """Release the graph of one key (the key is about to be captured again)."""
        entry = self.entries.pop(key, None)
        if entry is not None and entry.graph is not None:
            entry.graph.reset()

    def close(self) -> None:
        """Release every graph and static buffer (they are captured again on use)."""
        for e in self.entries.values():
            if e.graph is not None:
                e.graph.reset()
        self.entries.clear()
        self._arena.clear()
