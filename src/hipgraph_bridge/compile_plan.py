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

__all__ = ["InputSlot", "IntOutput", "GraphPlan", "analyze", "fx_mutated_inputs", "aot_mutated_inputs"]

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

    def indices(self, *kinds: InputKind) -> list[int]:
        return [s.index for s in self.slots if s.kind in kinds]

    @property
    def first_batched(self) -> int | None:
        return next((s.index for s in self.slots if s.kind == "batched"), None)


# ------------------------------------------------------------------ symbols
def _expr(v: Any) -> Any:
    """The sympy expression of a SymInt (None for a plain int or a specialised SymInt)."""
    if isinstance(v, torch.SymInt):
        e = v.node.expr
        return None if e.is_number else e
    return None


def _symbols(shape: Sequence[Any]) -> set[Any]:
    out: set[Any] = set()
    for s in shape:
        e = _expr(s)
        if e is not None:
            out |= e.free_symbols
    return out


def _is_ref(t: torch.Tensor) -> bool:
    if isinstance(t, torch.nn.Parameter):
        return True
    try:
        from torch._dynamo.utils import get_static_address_type
    except ImportError:  # older torch: parameters only
        return False
    return get_static_address_type(t) is not None


def _range(example: Any, symbol: Any) -> tuple[int, int | None]:
    """Batch sizes the frame admits: dynamo specialises 0 and 1, so usually [2, inf)."""
    try:
        vr = example.node.shape_env.bound_sympy(symbol)
        lo = max(1, int(vr.lower))
    except Exception:  # no shape env to ask: assume the usual 0/1 specialisation
        return 2, None
    try:
        hi: int | None = int(vr.upper)
    except Exception:  # int_oo: unbounded
        hi = None
    if hi is not None and hi >= 2**62:
        hi = None
    return lo, hi


def _hint(v: Any) -> int | None:
    """A SymInt's example value without guarding on it (``int(s)`` would specialise it)."""
    if isinstance(v, torch.SymInt):
        h = getattr(v.node, "hint", None)
        return h if isinstance(h, int) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


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
        if _int_like(user.meta.get("example_value")):  # int arithmetic, a size tuple: follow it
            bad = value_use(user)
            if bad is not None:
                return bad
        elif not _size_position(user, node):
            return user
    return None


def _nodes_with_symbol(gm: fx.GraphModule, symbol: Any) -> Iterator[fx.Node]:
    for n in gm.graph.nodes:
        e = _expr(n.meta.get("example_value"))
        if e is not None and symbol in e.free_symbols:
            yield n


# ------------------------------------------------------------------ analysis
def analyze(gm: fx.GraphModule, example_inputs: Sequence[Any], *, batch_dim: int) -> GraphPlan:
    """Classify every input and output of ``gm`` (see the module docstring)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ValueError(f"expected one example input per graph placeholder ({len(placeholders)}), "
                         f"got {len(example_inputs)}")
    fakes = [n.meta.get("example_value", ex) for n, ex in zip(placeholders, example_inputs)]
    names = [n.name for n in placeholders]
    bd = batch_dim
    tensors = [i for i, ex in enumerate(example_inputs) if isinstance(ex, torch.Tensor)]
    refs = {i for i in tensors if _is_ref(example_inputs[i])}
    for i in tensors:
        if not isinstance(fakes[i], torch.Tensor):
            fakes[i] = example_inputs[i]
    static = not any(_symbols(f.shape) if isinstance(f, torch.Tensor) else _expr(f) is not None for f in fakes)

    # the batch: the first non-ref tensor's size in batch_dim (a symbol, or a fixed size)
    batch_symbol, fixed_batch, batch_example = None, None, None
    for i in tensors:
        f = fakes[i]
        if i in refs or f.dim() <= bd:
            continue
        e = _expr(f.shape[bd])
        if e is not None and e.is_Symbol:
            batch_symbol, batch_example = e, f.shape[bd]
        elif e is None:
            fixed_batch = int(example_inputs[i].shape[bd])
        break

    slots: list[InputSlot | None] = [None] * len(fakes)
    where: dict[Any, tuple[int, int]] = {}  # symbol -> (tensor input, dim) that carries it
    for i in tensors:
        f = fakes[i]
        for d, s in enumerate(f.shape):
            e = _expr(s)
            if e is not None and e.is_Symbol:
                where.setdefault(e, (i, d))
        syms = _symbols(f.shape)
        if i in refs:
            slots[i] = InputSlot(i, "ref", names[i])
        elif f.dim() > bd and batch_symbol is not None and _expr(f.shape[bd]) == batch_symbol \
                and batch_symbol not in _symbols([s for d, s in enumerate(f.shape) if d != bd]):
            slots[i] = InputSlot(i, "batched", names[i], varies=len(syms) > 1)
        elif f.dim() > bd and fixed_batch is not None and _expr(f.shape[bd]) is None \
                and f.shape[bd] == fixed_batch:
            slots[i] = InputSlot(i, "batched", names[i], varies=bool(syms))
        else:
            slots[i] = InputSlot(i, "owned", names[i], varies=bool(syms))
    first_batched = next((s.index for s in slots if s is not None and s.kind == "batched"), None)
    batch_hint = int(example_inputs[first_batched].shape[bd]) if first_batched is not None else None
    batch_symbols = set()
    if batch_symbol is not None and first_batched is not None:
        where[batch_symbol] = (first_batched, bd)
        batch_symbols.add(batch_symbol)

    def follows_batch(symbol: Any, hint: int | None) -> bool:
        """A second symbol that equals the batch in the example and is only ever used as a size."""
        return (batch_symbol is not None and first_batched is not None and symbol != batch_symbol
                and hint == batch_hint and all(value_use(n) is None for n in _nodes_with_symbol(gm, symbol)))

    for i in tensors:  # tensors whose batch dim has a symbol of its own (dynamo could not tie them)
        s = slots[i]
        f = fakes[i]
        if s is None or s.kind != "owned" or f.dim() <= bd:
            continue
        e = _expr(f.shape[bd])
        rest = _symbols([x for d, x in enumerate(f.shape) if d != bd])
        if e is not None and e.is_Symbol and e not in rest and follows_batch(e, int(example_inputs[i].shape[bd])):
            slots[i] = InputSlot(i, "batch_like", names[i], varies=bool(rest))
            batch_symbols.add(e)

    unsupported: tuple[str, str] | None = None
    carriers: dict[Any, tuple[int, int | None]] = dict(where)
    for i, f in enumerate(fakes):
        if slots[i] is not None:
            continue
        e = _expr(f)
        if e is not None and e.is_Symbol and e in where:
            kind: InputKind = "batch_int" if e in batch_symbols else "shape_int"
            slots[i] = InputSlot(i, kind, names[i], source=where[e])
            continue
        if e is not None and e.is_Symbol:
            carriers.setdefault(e, (i, None))  # an int that is its own source
            if follows_batch(e, _hint(f)):
                slots[i] = InputSlot(i, "batch_like", names[i], source=where[batch_symbol])
                batch_symbols.add(e)
                continue
        slots[i] = InputSlot(i, "const", names[i])
        if not isinstance(f, torch.SymInt):
            try:
                hash(example_inputs[i])
            except TypeError:
                unsupported = unsupported or ("unsupported_input", f"input {names[i]} is an unhashable "
                                              f"{type(example_inputs[i]).__name__}")
    final = tuple(s for s in slots if s is not None)

    if batch_symbol is not None:
        for n in _nodes_with_symbol(gm, batch_symbol):
            bad = value_use(n)
            if bad is not None:
                unsupported = unsupported or (
                    "batch_value", f"the batch size ({n.name}) is used as a value by {bad.format_node()}; "
                    "a padded replay would see the bucket size there")
                break
    batched_outputs, int_outputs, why = _outputs(gm, frozenset(batch_symbols), carriers, bd)
    unsupported = unsupported or why
    if first_batched is None and unsupported is None:
        unsupported = ("no_batch_input", f"no tensor input has a batch dimension (dim {bd}) to pad")
    lo_hi = (_range(batch_example, batch_symbol) if batch_symbol is not None
             else (fixed_batch or 1, fixed_batch))
    devices = frozenset(example_inputs[i].device.type for i in tensors if i not in refs)
    grad = torch.is_grad_enabled() and any(example_inputs[i].requires_grad for i in tensors)
    return GraphPlan(final, static, batch_symbol, fixed_batch if batch_symbol is None else None, lo_hi,
                     batched_outputs, int_outputs, devices, grad, unsupported)


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
                    if (e := _expr(s)) is not None and e.free_symbols & batch_symbols]
            if dims and (dims != [bd] or _expr(v.shape[bd]) not in batch_symbols):
                # e.g. (2*s0, C) after a cat, or (C, s0): padded rows cannot be sliced off
                return (), (), ("output_shape", f"output {k} has shape {tuple(v.shape)}; the batch must be "
                                f"dimension {bd} of its own to slice the padding off")
            flags.append(bool(dims))
        elif isinstance(v, torch.SymInt) and _expr(v) is not None:
            e = _expr(v)
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
_VIEW_OPS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "select", "transpose", "permute", "t", "T", "mT",
    "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "unfold", "split", "chunk",
    "unbind", "as_strided", "detach", "getitem", "__getitem__", "diagonal", "movedim", "swapaxes",
    "swapdims", "contiguous", "real", "imag", "view_as_real", "view_as_complex", "tensor_split",
})


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
        first = node.args[0]
        root = base.get(first) if isinstance(first, fx.Node) else None
        if root is None:
            continue
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.target is operator.setitem or name == "setitem":
            mutated.add(root)
        elif name in _VIEW_OPS:
            base[node] = root
        elif (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True \
                or node.kwargs.get("out") is not None:
            mutated.add(root)
    return frozenset(mutated)


def aot_mutated_inputs(n_inputs: int) -> frozenset[int] | None:
    """Inputs AOT autograd found mutated in the compile that just ran (None: no metadata).

    Reads the tracing context dynamo sets up around a backend call; the
    metadata is private PyTorch API, so any surprise means "unknown".
    """
    try:
        ctx = torch._guards.TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if meta is None or len(meta.input_info) != n_inputs:
            return None
        return frozenset(i for i, info in enumerate(meta.input_info)
                         if info.mutates_data or info.mutates_metadata)
    except Exception:
        return None
