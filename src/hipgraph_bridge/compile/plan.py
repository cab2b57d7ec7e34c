"""What a dynamo subgraph's inputs and outputs are, for the ``gfxgraph`` compile backend.

Dynamo hands a backend a flat list of inputs: the user's tensors, but also
parameters and buffers lifted as inputs (``inline_inbuilt_nn_modules``) and
symbolic sizes (``s0``: the batch size itself, as an int) of the tensors that
vary. A bucket pool needs to know, per input, what to do with it:

==========  ==========================================================  =======================
kind        what it is                                                  in a padded replay
==========  ==========================================================  =======================
batched     tensor whose ``batch_dim`` size is the batch symbol (or,    padded into a static
            in a frame with a fixed batch, that fixed size)             buffer, sliced back
ref         parameter, buffer or ``mark_static_address`` tensor         read in place (address
                                                                        checked every call)
owned       any other tensor (no batch dimension)                       copied into a static
                                                                        buffer every call
batch_int   the batch symbol (or a batch_like tensor's), as an int      the *bucket* size
shape_int   another symbolic size that an input tensor carries          read from that tensor
batch_like  a tensor or int that equals the batch size under a symbol   padded / the bucket
            of its own (``x.shape[0]`` carried over a graph break, a    size; a call where it
            second input dynamo could not tie to the first), used       differs from the batch
            only as a size                                              runs without graphs
const       anything else (an int that is not a size, a float, None)    part of the graph key
==========  ==========================================================  =======================

Padding is only sound if the batch size is used as a *size*: a graph that
computes ``x * x.shape[0]`` or reads row ``x.shape[0] - 1`` would see the
bucket size in a replay, so such a graph is marked unsupported (reason
``batch_value``). Rows must also be independent of each other (no reduction
over the batch): that cannot be read from the graph; the backend compares the
first padded call with an unpadded run instead.

The batch symbol comes from the fake tensors dynamo stores on the graph's
placeholders (``node.meta["example_value"]``): the ``batch_dim`` size of the
first non-``ref`` tensor, when it is a plain symbol. Nothing here runs the
model; :func:`analyze` reads the FX graph once per compile.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx

from .._torch_compat import (collective_op_name, static_address_type, subgraph_operand_placeholder,
                             subgraph_operands, sym_expr, sym_hint, sym_range)

__all__ = ["InputSlot", "IntOutput", "GraphPlan", "analyze", "fx_mutated_inputs", "collective_ops", "is_ref",
           "value_use", "graph_modules", "VIEW_OPS"]

InputKind = Literal["batched", "ref", "owned", "batch_int", "shape_int", "batch_like", "const"]


@dataclass(frozen=True)
class InputSlot:
    """One input of the compiled function."""

    index: int
    kind: InputKind
    name: str  # the placeholder's name, for messages
    # batch_int / shape_int: (index of a tensor input, dim) that carries the value
    source: tuple[int, int] | None = None
    # batched/owned: some size besides the batch varies between calls (part of the graph key)
    varies: bool = False


@dataclass(frozen=True)
class IntOutput:
    """A symbolic int the graph returns (``x.shape[0]`` before a graph break): recomputed per call."""

    position: int
    expr: Any  # sympy expression over the symbols in `sources`
    sources: tuple[tuple[Any, int, int | None], ...]  # (symbol, input index, dim; None: the int input itself)


@dataclass(frozen=True)
class GraphPlan:
    """Everything the backend decides about one subgraph, computed once at compile time.

    ``fixed_batch`` is set when dynamo specialised the batch dimension (the
    frame serves exactly that batch size); ``batch_range`` is the range of
    batch sizes the frame's guards admit (buckets must stay inside it).
    ``unsupported`` says why graphs cannot serve this subgraph (None: they can).
    """

    slots: tuple[InputSlot, ...]
    static: bool  # no symbolic size anywhere: dynamo specialised every shape
    batch_symbol: Any  # sympy symbol of the batch, or None
    fixed_batch: int | None
    batch_range: tuple[int, int | None]
    batched_outputs: tuple[bool, ...]  # per top-level output
    int_outputs: tuple[IntOutput, ...]
    devices: frozenset[str]  # device types of the non-ref tensor inputs
    requires_grad: bool  # grad mode on and some tensor input requires grad
    unsupported: tuple[str, str] | None  # (reason key, explanation)
    collectives: tuple[str, ...] = ()  # torch.distributed collectives the graph calls (sorted names)

    def indices(self, *kinds: InputKind) -> list[int]:
        return [s.index for s in self.slots if s.kind in kinds]

    @property
    def first_batched(self) -> int | None:
        return next((s.index for s in self.slots if s.kind == "batched"), None)


# ------------------------------------------------------------------ symbols


def _symbols(shape: Sequence[Any]) -> set[Any]:
    out: set[Any] = set()
    for s in shape:
        e = sym_expr(s)
        if e is not None:
            out |= e.free_symbols
    return out


def is_ref(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or static_address_type(t) is not None


# ------------------------------------------------------- sizes used as values
_SHAPE_METHODS = frozenset({  # every int argument after `self` is a size
    "view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "repeat", "tile", "unflatten",
    "split", "split_with_sizes", "broadcast_to", "_unsafe_view",
})
_FACTORIES = frozenset({"zeros", "ones", "empty", "rand", "randn", "full"})  # the size is args[0]
_CHECKS = ("_check", "_check_is_size", "_assert_scalar", "_assert", "sym_constrain_range_for_size")


def _contains(a: Any, node: fx.Node) -> bool:
    if a is node:
        return True
    if isinstance(a, (tuple, list)):
        return any(_contains(x, node) for x in a)
    if isinstance(a, slice):
        return any(_contains(x, node) for x in (a.start, a.stop, a.step))
    if isinstance(a, dict):
        return any(_contains(x, node) for x in a.values())
    return False


def _only_slice_stop(index: Any, node: fx.Node) -> bool:
    """``x[:n]`` keeps rows independent of padding; ``x[n - 1]`` or ``x[n:]`` do not."""
    if index is node:
        return False
    if isinstance(index, slice):
        return not _contains(index.start, node) and not _contains(index.step, node)
    if isinstance(index, (tuple, list)):
        return all(_only_slice_stop(x, node) for x in index)
    return True


def _size_position(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` takes ``node`` (an int) only where a size goes."""
    name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
    at = [k for k, a in enumerate(user.args) if _contains(a, node)]
    at += [k for k, a in user.kwargs.items() if _contains(a, node)]
    if name in _SHAPE_METHODS:
        return 0 not in at
    if name == "new_full":
        return set(at) <= {1, "size"}
    if name == "narrow":
        return set(at) <= {3, "length"}
    if name in _FACTORIES:
        return set(at) <= {0, "size"}
    if name == "empty_strided":
        return set(at) <= {0, 1, "size", "stride"}
    if name in ("arange", *_CHECKS):
        return True
    if name == "getitem" and user.args and isinstance(user.meta.get("example_value"), torch.Tensor):
        return set(at) <= {1} and _only_slice_stop(user.args[1], node)
    return False


def _int_like(v: Any) -> bool:
    if isinstance(v, (torch.SymInt, int, torch.SymBool)):
        return True
    return isinstance(v, (tuple, list)) and all(_int_like(x) for x in v)


def value_use(node: fx.Node) -> fx.Node | None:
    """The first node that uses the int ``node`` as a value rather than as a size (None: none does)."""
    for user in node.users:
        if user.op == "output":
            continue  # returned ints are recomputed per call
        inner = subgraph_operand_placeholder(user, node)
        if inner is not None:  # a region traced once (nested_compile_region): how its subgraph uses the int
            bad = value_use(inner)
            if bad is not None:
                return bad
        elif _int_like(user.meta.get("example_value")):  # int arithmetic, a size tuple: follow it
            bad = value_use(user)
            if bad is not None:
                return bad
        elif not _size_position(user, node):
            return user
    return None


def _nodes_with_symbol(gm: fx.GraphModule, symbol: Any) -> Iterator[fx.Node]:
    for n in gm.graph.nodes:
        e = sym_expr(n.meta.get("example_value"))
        if e is not None and symbol in e.free_symbols:
            yield n


# ------------------------------------------------------------------ analysis
def analyze(gm: fx.GraphModule, example_inputs: Sequence[Any], *, batch_dim: int) -> GraphPlan:
    """Classify every input and output of ``gm`` (see the module docstring)."""
    return _Analysis(gm, example_inputs, batch_dim).plan()


class _Analysis:
    """One pass over a subgraph's inputs, in the order the kinds depend on each other."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], bd: int) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise ValueError(f"expected one example input per graph placeholder ({len(placeholders)}), "
                             f"got {len(example_inputs)}")
        self.gm, self.examples, self.bd = gm, example_inputs, bd
        self.fakes = [n.meta.get("example_value", ex) for n, ex in zip(placeholders, example_inputs)]
        self.names = [n.name for n in placeholders]
        self.tensors = [i for i, ex in enumerate(example_inputs) if isinstance(ex, torch.Tensor)]
        self.refs = {i for i in self.tensors if is_ref(example_inputs[i])}
        for i in self.tensors:
            if not isinstance(self.fakes[i], torch.Tensor):
                self.fakes[i] = example_inputs[i]
        self.slots: list[InputSlot | None] = [None] * len(self.fakes)
        self.where: dict[Any, tuple[int, int]] = {}  # symbol -> (tensor input, dim) that carries it
        self.batch_symbols: set[Any] = set()
        self.unsupported: tuple[str, str] | None = None
        self.batch_symbol, self.fixed_batch, self.batch_example = self._find_batch()
        self.first_batched: int | None = None
        self.batch_hint: int | None = None

    def _find_batch(self) -> tuple[Any, int | None, Any]:
        """The first non-ref tensor's size in batch_dim: (symbol, fixed size, example size)."""
        bd = self.bd
        for i in self.tensors:
            f = self.fakes[i]
            if i in self.refs or f.dim() <= bd:
                continue
            e = sym_expr(f.shape[bd])
            if e is not None and e.is_Symbol:
                return e, None, f.shape[bd]
            return None, (int(self.examples[i].shape[bd]) if e is None else None), None
        return None, None, None

    def _classify_tensors(self) -> None:
        bd, sym = self.bd, self.batch_symbol
        for i in self.tensors:
            f, name = self.fakes[i], self.names[i]
            for d, s in enumerate(f.shape):
                e = sym_expr(s)
                if e is not None and e.is_Symbol:
                    self.where.setdefault(e, (i, d))
            syms = _symbols(f.shape)
            if i in self.refs:
                self.slots[i] = InputSlot(i, "ref", name)
            elif f.dim() > bd and sym is not None and sym_expr(f.shape[bd]) == sym \
                    and sym not in _symbols([s for d, s in enumerate(f.shape) if d != bd]):
                self.slots[i] = InputSlot(i, "batched", name, varies=len(syms) > 1)
            elif f.dim() > bd and self.fixed_batch is not None and sym_expr(f.shape[bd]) is None \
                    and f.shape[bd] == self.fixed_batch:
                self.slots[i] = InputSlot(i, "batched", name, varies=bool(syms))
            else:
                self.slots[i] = InputSlot(i, "owned", name, varies=bool(syms))
        self.first_batched = next((s.index for s in self.slots if s is not None and s.kind == "batched"), None)
        if self.first_batched is not None:
            self.batch_hint = int(self.examples[self.first_batched].shape[bd])
            if sym is not None:
                self.where[sym] = (self.first_batched, bd)
                self.batch_symbols.add(sym)

    def _follows_batch(self, symbol: Any, hint: int | None) -> bool:
        """A second symbol that equals the batch in the example and is only ever used as a size."""
        return (self.batch_symbol is not None and self.first_batched is not None and symbol != self.batch_symbol
                and hint == self.batch_hint
                and all(value_use(n) is None for n in _nodes_with_symbol(self.gm, symbol)))

    def _tie_batch_like_tensors(self) -> None:
        """Tensors whose batch dim has a symbol of its own (dynamo could not tie them to the batch)."""
        bd = self.bd
        for i in self.tensors:
            s, f = self.slots[i], self.fakes[i]
            if s is None or s.kind != "owned" or f.dim() <= bd:
                continue
            e = sym_expr(f.shape[bd])
            rest = _symbols([x for d, x in enumerate(f.shape) if d != bd])
            if e is not None and e.is_Symbol and e not in rest \
                    and self._follows_batch(e, int(self.examples[i].shape[bd])):
                self.slots[i] = InputSlot(i, "batch_like", self.names[i], varies=bool(rest))
                self.batch_symbols.add(e)

    def _classify_scalars(self) -> dict[Any, tuple[int, int | None]]:
        """Ints and other values; returns every symbol's carrier (a tensor dim, or the int itself)."""
        carriers: dict[Any, tuple[int, int | None]] = dict(self.where)
        for i, f in enumerate(self.fakes):
            if self.slots[i] is not None:
                continue
            name, e = self.names[i], sym_expr(f)
            if e is not None and e.is_Symbol and e in self.where:
                kind: InputKind = "batch_int" if e in self.batch_symbols else "shape_int"
                self.slots[i] = InputSlot(i, kind, name, source=self.where[e])
                continue
            if e is not None and e.is_Symbol:
                carriers.setdefault(e, (i, None))  # an int that is its own source
                if self._follows_batch(e, sym_hint(f)):
                    self.slots[i] = InputSlot(i, "batch_like", name, source=self.where[self.batch_symbol])
                    self.batch_symbols.add(e)
                    continue
            self.slots[i] = InputSlot(i, "const", name)
            if not isinstance(f, torch.SymInt):
                try:
                    hash(self.examples[i])
                except TypeError:
                    self._refuse("unsupported_input", f"input {name} is an unhashable "
                                 f"{type(self.examples[i]).__name__}")
        return carriers

    def _refuse(self, reason: str, detail: str) -> None:
        self.unsupported = self.unsupported or (reason, detail)

    def _check_batch_used_as_size(self) -> None:
        if self.batch_symbol is None:
            return
        # regions' subgraphs too: a region may read the batch from its own tensors (x.numel())
        for n in (n for g in graph_modules(self.gm) for n in _nodes_with_symbol(g, self.batch_symbol)):
            bad = value_use(n)
            if bad is not None:
                self._refuse("batch_value", f"the batch size ({n.name}) is used as a value by "
                             f"{bad.format_node()}; a padded replay would see the bucket size there")
                return

    def plan(self) -> GraphPlan:
        self._classify_tensors()
        self._tie_batch_like_tensors()
        carriers = self._classify_scalars()
        self._check_batch_used_as_size()
        bd, ex = self.bd, self.examples
        batched_outputs, int_outputs, why = _outputs(self.gm, frozenset(self.batch_symbols), carriers, bd)
        if why is not None:
            self._refuse(*why)
        if self.first_batched is None:
            self._refuse("no_batch_input", f"no tensor input has a batch dimension (dim {bd}) to pad")
        sym, fixed = self.batch_symbol, self.fixed_batch
        lo_hi = sym_range(self.batch_example, sym) if sym is not None else (fixed or 1, fixed)
        static = not any(_symbols(f.shape) if isinstance(f, torch.Tensor) else sym_expr(f) is not None
                         for f in self.fakes)
        devices = frozenset(ex[i].device.type for i in self.tensors if i not in self.refs)
        grad = torch.is_grad_enabled() and any(ex[i].requires_grad for i in self.tensors)
        return GraphPlan(tuple(s for s in self.slots if s is not None), static, sym,
                         fixed if sym is None else None, lo_hi, batched_outputs, int_outputs, devices, grad,
                         self.unsupported, collective_ops(self.gm))


def collective_ops(gm: fx.GraphModule) -> tuple[str, ...]:
    """The torch.distributed collectives ``gm`` calls (their waits left out), sorted."""
    names = {collective_op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    return tuple(sorted(n for n in names if n is not None and ".wait_tensor" not in n))


def _outputs(gm: fx.GraphModule, batch_symbols: frozenset[Any], carriers: dict[Any, tuple[int, int | None]],
             bd: int) -> tuple[tuple[bool, ...], tuple[IntOutput, ...], tuple[str, str] | None]:
    """Per top-level output: carries the batch in ``bd``? Symbolic ints to recompute; or why not graphable."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = out_node.args[0]
    if not isinstance(outs, (tuple, list)):
        outs = (outs,)
    flags: list[bool] = []
    ints: list[IntOutput] = []
    for k, o in enumerate(outs):
        v = o.meta.get("example_value") if isinstance(o, fx.Node) else o
        if isinstance(v, torch.Tensor):
            dims = [d for d, s in enumerate(v.shape)
                    if (e := sym_expr(s)) is not None and e.free_symbols & batch_symbols]
            if dims and (dims != [bd] or sym_expr(v.shape[bd]) not in batch_symbols):
                # e.g. (2*s0, C) after a cat, or (C, s0): padded rows cannot be sliced off
                return (), (), ("output_shape", f"output {k} has shape {tuple(v.shape)}; the batch must be "
                                f"dimension {bd} of its own to slice the padding off")
            flags.append(bool(dims))
        elif isinstance(v, torch.SymInt) and sym_expr(v) is not None:
            e = sym_expr(v)
            if any(s not in carriers for s in e.free_symbols):
                return (), (), ("int_output", f"output {k} is the size {e}, which no input carries")
            ints.append(IntOutput(k, e, tuple((s, *carriers[s]) for s in sorted(e.free_symbols, key=str))))
            flags.append(False)
        elif isinstance(v, (torch.SymFloat, torch.SymBool)):
            return (), (), ("int_output", f"output {k} is a symbolic {type(v).__name__}")
        else:
            flags.append(False)
    return tuple(flags), tuple(ints), None


# ------------------------------------------------------------------ mutations
VIEW_OPS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "select", "transpose", "permute", "t", "T", "mT",
    "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "unfold", "split", "chunk",
    "unbind", "as_strided", "detach", "getitem", "__getitem__", "diagonal", "movedim", "swapaxes",
    "swapdims", "contiguous", "real", "imag", "view_as_real", "view_as_complex", "tensor_split",
})


def graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the subgraphs it holds (a region's, ``nested_compile_region``: traced once, called by
    ``invoke_subgraph``), each once: what reads the graph's nodes for a use must read theirs too."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def fx_mutated_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Inputs an in-place op writes to (through views), read from the FX graph.

    Used when the compiler leaves no AOT metadata (the ``eager`` compiler, a
    compile outside dynamo). Generous about what a view is, exact about what
    an in-place op is: names ending in ``_``, ``setitem``, ``inplace=True``, ``out=``.
    """
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    base: dict[fx.Node, int] = dict(index)
    mutated: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function") or not node.args:
            continue
        inner = subgraph_operands(node)
        if inner is not None:  # a region: the operands its subgraph writes, as the caller's inputs
            sub, operands = inner
            written = fx_mutated_inputs(sub)
            mutated.update(base[a] for k, a in enumerate(operands) if k in written and a in base)
            continue
        first = node.args[0]
        root = base.get(first) if isinstance(first, fx.Node) else None
        if root is None:
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.target is operator.setitem or name == "setitem":
            mutated.add(root)
        elif name in VIEW_OPS:
            base[node] = root
        elif (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True \
                or node.kwargs.get("out") is not None:
            mutated.add(root)
    return frozenset(mutated)
