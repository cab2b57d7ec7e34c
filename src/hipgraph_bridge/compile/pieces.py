"""A piece of a piecewise frame: one submodule between splitting ops, graphed per token bucket.

Workflow of a call in a padded call of its frame (``n`` real tokens, bucket ``b``):

1. Tensor inputs that carry the token count arrive padded (``b`` rows: the
   previous piece's graph outputs, which the graph reads in place) or real
   (``n`` rows: a splitting op's output, a frame input); real ones are copied
   into the piece's static buffer, whose padding rows hold ``pad_value`` or
   real rows of earlier calls (harmless where rows do not interact). The token
   count passed as an int is the bucket size inside the graph.
2. The key's graph replays. It was captured on the key's first call, into the
   frame's one memory pool, while the outputs of the pieces before it were
   alive, so it never overwrites what later pieces still read; its outputs
   stay padded for the next piece.
3. The first padded call of every graph is compared with an unpadded run of
   the piece (rows that interact: the piece is not padded again); in
   validation mode every call is.

A piece runs without padding, compiled, on its inputs narrowed to the real
rows (reason counted) when padding could change its results (:mod:`.hazards`,
the token count used as a value, sizes such as ``2*s`` at its boundary, a
padded check that differed) or when it writes state it keeps (a static KV
cache): such a piece is graphed only for calls whose token count is a bucket,
with at most one warm-up, and never run twice for one call. Without a GPU
(``simulate_padding``) the same pipeline runs, the compiled piece called on
the padded buffers where a replay would be.
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
from ..graph.capture import record_on_current_stream
from ..graph.weak_outputs import release_outputs
from ..validation import checked_against_eager, padding_changed
from .hazards import padding_hazard
from .parts import Layout, Mode, PieceEnv, narrow, span, token_dims
from .plan import value_use

__all__ = ["Piece"]

Why = tuple[str, str, int]  # (reason key, explanation, log level)


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    pad_dims: tuple[int, ...]  # dims whose size is exactly the token count
    layout: Layout
    mutated: bool
    broadcast: tuple[int, ...]  # dims of stride 0 (an expanded input): staged once, not per row


@dataclass
class _Entry:
    """One graph of a piece, for one key."""

    statics: list[Any]  # per tensor slot: the tensor the graph reads (None until set)
    ptrs: list[int]
    graph: Any = None
    outputs: tuple[Any, ...] = ()  # the graph's outputs (non-owning views)
    out_ptrs: frozenset[int] = frozenset()
    views: dict[int, list[Any]] = field(default_factory=dict)  # n -> per slot the real rows' view
    checked: bool = False
    reason: str = ""
    failed: str | None = None


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
                 single: bool, refs: frozenset[int], mutated: frozenset[int], never: Why | None,
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
            never = ("input_mutation", f"{name} writes to its input(s) {sorted(mutated - refs)}, which a graph "
                     "would read from static copies", logging.WARNING)
        self.never = never  # why this piece is never graphed
        self.block = None if trivial else self._padding_block(module, compound)  # why it is never padded
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self._arenas: dict[tuple[Any, ...], torch.Tensor] = {}
        self.replays = self.captures = self.eager_runs = 0

    def _padding_block(self, module: fx.GraphModule, compound: list[str]) -> Why | None:
        token = self.env.token
        if self.stateful:
            return ("padded_state_write", f"{self.name} writes state it keeps (a static KV cache?): padding rows "
                    "would write to it, so it is graphed only when the token count is a bucket", logging.INFO)
        if compound:
            return ("size_expression", f"{self.name}: {compound[0]}, which padding cannot slice back",
                    logging.INFO)
        for node in module.graph.nodes:
            e = sym_expr(node.meta.get("example_value"))
            if e is not None and token in e.free_symbols and (bad := value_use(node)) is not None:
                return ("size_as_value", f"{self.name}: the token count is used as a value by "
                        f"{bad.format_node()}; a padded graph would see the bucket size there", logging.WARNING)
        hazard = padding_hazard(module, token)
        if hazard is not None:
            return "padding_unsafe", f"{self.name}: {hazard}", logging.WARNING
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
            elif entry.failed is not None:
                out = self._fallback((entry.reason, entry.failed, logging.WARNING), args)
            else:
                out = self._checked(entry, self._run(entry, args), args)
        return out[0] if self.single else out

    def _fallback(self, why: Why, args: tuple[Any, ...]) -> tuple[Any, ...]:
        stats.record_fallback(why[0], why[1], level=why[2])
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
        """A graph's first padded result compared with an unpadded run; every result in validation mode."""
        ctx = self.env.ctx
        first = ctx.padded and not entry.checked and not self.stateful
        validate = config.switches.validate and not self.stateful
        if not (first or validate):
            return out
        reference = tuple(self._run_real(args))  # compilers return lists or tuples
        mine = tuple(out)
        if ctx.padded:
            mine = tuple(narrow(t, dims, ctx.n) if isinstance(t, torch.Tensor) else t
                         for t, dims in zip(out, self._dims_per_output(len(out))))
        if first:
            entry.checked = True
            why = padding_changed(mine, reference)
            if why:
                detail = (f"{self.name}: bucket {ctx.b} for {ctx.n} tokens: {why}; rows depend on each other, so "
                          "this piece runs unpadded from now on")
                self.block = ("padding_changes_results", detail, logging.WARNING)
                ctx.blocked = True
                stats.record_fallback("padding_changes_results", detail)
                return reference
        if validate and checked_against_eager(mine, reference, owner=self, what="piecewise piece") is reference:
            return reference
        return out

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
            return self._fallback(("recapture", f"{self.name} meets a key its frame captured without it; the "
                                   "key's graphs are captured again, together, on its next call", logging.DEBUG),
                                  args)
        entry = _Entry([None] * len(self.slots), [0] * len(self.slots))
        call = self._bucket_args(entry, args, capture=True)
        if env.capturer is None:  # simulate_padding without a GPU
            self.entries[ctx.key] = entry
            out = self.fn(*call)
            return self._checked(entry, self._fix_ints(out) if self.int_outputs else out, args)
        warmup = min(env.warmup_iters, 1) if self.stateful else env.warmup_iters
        captured = env.capturer.capture(lambda: self.fn(*call), ctx.b, keep_warm=self.stateful, freeze_gc=True,
                                        warmup_iters=warmup)
        if captured.failed is not None:
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
            entry.reason, entry.failed = "padded_run_failed", captured.failed
        else:
            entry.reason, entry.failed = captured.reason, captured.failed
            if captured.warm is not None:  # a state-writing piece ran in its warm-up: never run it again
                self.entries[ctx.key] = entry
                stats.record_fallback(entry.reason, entry.failed)
                record_on_current_stream(list(captured.warm))
                return tuple(captured.warm)
            out = None
        self.entries[ctx.key] = entry
        return out if out is not None else self._fallback((entry.reason, entry.failed or "", logging.WARNING),
                                                          args)

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
        """A static input buffer at the bucket: a view of one allocation per input sized for the largest bucket."""
        key = (pos, self.env.ctx.exact)
        need = span(shape, strides)
        flat = self._arenas.get(key)
        if flat is None or flat.numel() < need:
            largest = slot.layout.realize({**at_b, self.env.token: self.env.largest})
            # filled once: afterwards a padding row holds this or a real row of an earlier call, both
            # harmless to rows that do not interact, and token ids stay valid indices
            flat = torch.full((max(need, span(*largest)),), self.env.pad_value or 0, dtype=slot.layout.dtype,
                              device=slot.layout.device)
            self._arenas[key] = flat  # views of an older one keep it alive for the graphs that read it
        return flat.as_strided(shape, strides)

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
        return sum(t.numel() * t.element_size() for t in self._arenas.values())

    def status(self) -> str:
        """How this piece runs: "graphed", "trivial", or the reason it is never graphed / never padded."""
        if self.trivial:
            return "trivial"
        if self.never is not None:
            return f"ungraphed: {self.never[0]}"
        return "graphed" if self.block is None else f"unpadded: {self.block[0]}"

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
        self._arenas.clear()
