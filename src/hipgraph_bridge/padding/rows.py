"""Which rows of a batch each value depends on, read from a trace of the model's ops.

Padding a call of ``n`` rows up to a bucket of ``b`` rows is sound only when
row ``i`` of every output depends on row ``i`` of the inputs alone (and on
values that carry no rows: parameters, constants). :class:`RowTracer` proves
that, or finds the op that breaks it, from a dispatcher-level trace of one
run: a ``TorchDispatchMode`` that sees every aten op the model runs and gives
each tensor a *row label*:

* ``None``: depends on no row of the batch (parameters, constants, factories);
* ``Rows(dim, inner, outer)``: along ``dim``, index ``i`` belongs to row
  ``(i // inner) % rows`` (``inner > 1`` after a view merged the batch with
  the dims after it, ``outer > 1`` when the batch block repeats), and nothing
  else depends on more than its own row;
* ``Mixed(why)``: depends on several rows: an op reduced, scanned out of
  order, sorted, contracted, concatenated, selected or indexed along the
  batch, or a view split it (``proven``); or an op the rules do not know met
  batch data (not proven either way).

Labels follow the batch through views (reshape, permute, slice, split),
broadcasting, reductions, norms, contractions (mm, bmm, convolution,
attention), indexing, concatenation and padding. A scan along the batch
(``cumsum``) keeps its label: row ``i`` then depends on rows ``<= i`` only,
which padding at the end never changes.

The same trace finds what padding must never touch: writes to tensors the
call did not create (a buffer, a parameter, a KV cache a closure holds), the
call's own inputs written in place, random ops, and batch data read on the
host (``.item()``, a branch on a tensor, ``.tolist()``: data-dependent
control flow). Beside the dispatch mode, a function mode
(:class:`~.sizes.PythonReads`) sees what reaches no aten op: the batch's
size read from a shape and used as a number (``x / x.shape[0]``), which
labels the result as depending on every row, and ``.tolist()``/``.numpy()``.

Cost: one Python call per aten op and one per torch call of the traced run
(tens of microseconds at most), once per pool key. Nothing here runs the model: the caller traces
a run it makes anyway (a warm-up), or a compiled graph on fake tensors.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import torch

from .._torch_compat import (OP_COMPOSITE, OP_REGION, RowDispatchMode, compiled_code_runs_eagerly, inline_subgraph,
                             op_kind, op_writes, pytree)
from ..fallbacks import Reason
from .sizes import PythonReads, takes_size

__all__ = ["Rows", "Mixed", "Label", "RowVerdict", "RowTracer", "join"]

aten = torch.ops.aten


class Rows(NamedTuple):
    """Along ``dim``, index ``i`` belongs to batch row ``(i // inner) % rows`` (see the module docstring).

    ``shaped``: only the size follows the batch (``zeros_like(x)``, ``torch.zeros(x.shape[0], 3)``): the
    values hold no row, but an output like it must still be sliced back. Where it meets a real
    row label in another dim, the size was a coincidence and the real one wins. ``iota``: the
    values are the row indices themselves (``torch.arange(B)``, through views), so ``x[iota, j]``
    reads row ``i`` into row ``i`` (transformers' attention masks index the batch this way); any
    op other than a view, a copy or a clone drops it. A new tensor with one dimension of the
    batch's size is taken as ``shaped``: ``torch.zeros(x.shape[0], 3)`` and ``torch.zeros(8, 3)``
    at 8 rows look the same to a dispatch mode, and a bucket's first padded call, checked against
    its own unpadded run, tells them apart.
    """

    dim: int
    inner: int = 1
    outer: int = 1
    shaped: bool = False
    iota: bool = False  # ``arange(rows)`` through views: indexing the batch with it picks each row itself


class Mixed:
    """Depends on several rows of the batch; ``why`` names the op. ``proven``: False when the op was unknown.
    ``size``: through the batch's size used as a number (the verdict's reason is ``SIZE_AS_VALUE``)."""

    __slots__ = ("why", "proven", "size")

    def __init__(self, why: str, proven: bool = True, *, size: bool = False) -> None:
        self.why, self.proven, self.size = why, proven, size

    def __repr__(self) -> str:
        return f"Mixed({self.why!r}{'' if self.proven else ', unproven'})"


Label = Union[Rows, Mixed, None]


def join(a: Label, b: Label) -> Label:
    """The label of a value built from values labelled ``a`` and ``b``. Built from anything but itself,
    ``arange(B)`` no longer holds the row indices (``table[arange(B)]``, a masked write into it)."""
    if a == b:
        return a
    if a is None or b is None:
        one = b if a is None else a
        return one._replace(iota=False) if isinstance(one, Rows) else one
    if isinstance(a, Mixed):
        return a if a.proven or not isinstance(b, Mixed) else b
    if isinstance(b, Mixed):
        return b
    a, b = a._replace(iota=False), b._replace(iota=False)
    if a.shaped or b.shaped:  # a size that follows the batch carries no row: the other label decides
        if a.shaped and b.shaped:
            return a if a.dim == b.dim and a.inner == b.inner else None
        return b if a.shaped else a
    if a == b:
        return a
    return Mixed(f"rows of the batch meet along dims {a.dim} and {b.dim}")


@dataclass(frozen=True)
class RowVerdict:
    """What a trace proves about padding a model.

    ``reason`` is None when rows are proven independent (padding allowed);
    else why padding is refused, with ``detail``. ``outputs``: per output leaf,
    the dimension (and merge factors) it carries the batch in, or None.
    """

    reason: Reason | None
    detail: str
    outputs: tuple[Rows | None, ...]
    state_writes: tuple[str, ...] = ()
    input_writes: tuple[str, ...] = ()
    ops: int = 0
    host_read: bool = False  # unproven only because batch values were read on the host (see the pool's engine)

    @property
    def stateful(self) -> bool:
        """The run wrote tensors it did not create (or its own inputs): never re-run, never padded."""
        return bool(self.state_writes or self.input_writes)


# ---------------------------------------------------------------------------------------------- labels


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dims(value: Any, ndim: int) -> set[int] | None:
    """A reduction's dims, normalised; None for all of them."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        return {_norm(int(d), ndim) for d in value}
    return {_norm(int(value), max(ndim, 1))}


def _arg(args: Sequence[Any], kwargs: dict[str, Any], pos: int, name: str, default: Any = None) -> Any:
    if pos < len(args):
        return args[pos]
    return kwargs.get(name, default)


_KINDS: dict[int, int] = {}  # id(op) -> op_kind(op), for the rare ops the dispatch handles apart
_CREATED, _INPUT, _EXTERNAL, _MADE = 0, 1, 2, 3  # what a tensor is to the traced call (_MADE: by a factory)
_Entry = tuple  # (weakref to the tensor, label, kind, weakref to the tensor it views or None)


class RowTracer(RowDispatchMode):
    """Trace one run and label every tensor it makes (module docstring); then :meth:`verdict`.

    Args:
        batched: the call's tensors that carry the batch, with their batch dim.
        inputs: the call's other tensors (static inputs): written in place, they make the model stateful too.
        rows: the number of rows in this run (default: the first batched tensor's size there).
        names: names of the tensors the model holds (its parameters and buffers, by ``id``), for messages.
        scalars: on fake tensors, the values ``.item()`` of an unlabelled 0-dim tensor answers (by ``id``;
            others answer 1): a graph that reads a scalar input (dynamo lifts float attributes such as a
            norm's eps into tensors) runs on, and the value has no rows to follow.

    Tensors are known by ``id`` with a weak reference beside it (a reused ``id`` of a
    freed tensor is told apart), so the trace keeps no intermediate alive.
    """

    def __init__(self, batched: Sequence[tuple[torch.Tensor, int]], inputs: Sequence[torch.Tensor] = (), *,
                 rows: int | None = None, names: dict[int, str] | None = None,
                 scalars: dict[int, Any] | None = None) -> None:
        super().__init__()
        self._names = names or {}
        self._scalars = scalars
        self._info: dict[int, _Entry] = {}
        self._views: dict[int, list[Any]] = {}  # id of a root -> weakrefs of its views
        for t in inputs:
            self._put(t, None, _INPUT, None)
        first = None
        for t, d in batched:
            d = _norm(d, t.dim())
            self._put(t, Rows(d), _INPUT, None)
            first = first if first is not None else int(t.shape[d])
        self.rows = rows if rows is not None else (first or 0)
        self.ops = 0
        self.state_writes: list[str] = []
        self.input_writes: list[str] = []
        self.random = ""
        self.host_read = ""
        self.python = PythonReads(self)
        self._outer = contextlib.ExitStack()
        self._depth = 0

    def __enter__(self) -> RowTracer:
        if self._depth == 0:  # compiled code is traced as the Python it compiles (``fullgraph=True`` too)
            self._outer.enter_context(compiled_code_runs_eagerly())
            self._outer.enter_context(self.python)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        try:
            super().__exit__(*exc)
        finally:
            if self._depth == 0:
                self._outer.close()

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kind = _KINDS.get(id(func))
        if kind is None:
            kind = _KINDS[id(func)] = op_kind(func)
        if kind:  # a region's call; a composite op (autograd off: inference_mode, a region's subgraph)
            out = self._special(func, kind, args, kwargs or {})
            if out is not NotImplemented:
                return out
        if self._scalars is not None and func is _ITEM and self.label(args[0]) is None:
            self.ops += 1
            return self._scalars.get(id(args[0]), 1)
        out = func(*args, **kwargs) if kwargs else func(*args)
        self.ops += 1
        plan = _PLANS.get(id(func))  # by id: an OpOverload's own __hash__ is Python code, ~2 per op
        if plan is None:
            plan = _PLANS[id(func)] = _plan(func)
        rule, seeded, writes, _, view_of_arg, made, _ = plan
        info = self._info
        labelled = False
        for a in args:
            if isinstance(a, torch.Tensor):
                e = info.get(id(a))
                if e is not None and e[1] is not None and e[0]() is a:
                    labelled = True
                    break
            elif type(a) in (list, tuple) and any(self.label(x) is not None for x in a):
                labelled = True
                break
        else:
            if kwargs:
                labelled = any(self.label(v) is not None for v in kwargs.values())
        sized = self._takes_size(func, args, kwargs or {}) if self.python.sizes else None
        try:
            if seeded and not self._not_random(func, args, kwargs or {}):
                self.random = self.random or str(func.overloadpacket)
            if labelled and type(out) in (bool, int, float) and not self.host_read:
                self._host(str(func.overloadpacket))
            if not labelled and not writes[0] and rule is not _batch_norm and sized is None:
                self._plain(func, args, out, view_of_arg)
            elif rule is None:
                self._unknown(func, args, kwargs or {}, out, f"{func} is not known to the row analysis", sized)
            else:
                labels = rule(self, func, args, kwargs or {}, out)
                if sized is not None:
                    labels = [join(lab, sized) for lab in labels]
                self._assign(func, args, kwargs or {}, out, labels, writes, view_of_arg, made)
        except Exception as exc:  # a rule that fails is an unknown op, never the model's error
            self._unknown(func, args, kwargs or {}, out, f"{func}: the row analysis failed on it ({exc})", sized)
        return out

    def _special(self, func: Any, kind: int, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """A region's call (its subgraph's ops traced, each through this mode), a composite op (its
        decomposition's parts traced), or another higher-order operator (refused: the graph is unproven).
        ``NotImplemented``: trace the op as any other."""
        if kind == OP_REGION:
            with self:
                return inline_subgraph(args)
        if kind == OP_COMPOSITE:
            with self:
                return func.decompose(*args, **kwargs)  # NotImplemented: no kernel after all, traced as it is
        raise NotImplementedError(f"{getattr(func, '__name__', func)} is a higher-order operator the row "
                                  "analysis does not follow")

    def _host(self, what: str) -> None:
        self.host_read = (f"the model reads batch values on the host ({what}, e.g. .item(), "
                          "torch.equal or a branch on a tensor): its control flow may depend on the rows")

    def _takes_size(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Mixed | None:
        """A torch call given the batch size runs this op: whether the op takes it as a number."""
        name = takes_size(func, args, kwargs, self.python.sizes)
        if not name:
            return None
        return Mixed(f"{func.overloadpacket} takes the batch size as its {name!r}, a number that padding "
                     "changes (x / x.shape[0])", size=True)

    # ------------------------------------------------------------------ what the function mode asks
    def batch_dims(self, t: torch.Tensor) -> tuple[int, ...]:
        """The dims of ``t`` whose size follows the batch (:class:`~.sizes.PythonReads`)."""
        lab = self.label(t)
        return (lab.dim,) if isinstance(lab, Rows) else ()

    def carries_batch(self, t: torch.Tensor) -> bool:
        return self.label(t) is not None

    def read_on_host(self, what: str) -> None:
        if not self.host_read:
            self._host(what)

    def from_size(self, out: Any, what: str) -> None:
        """``out`` was built from the batch size (``torch.tensor(x.shape[0])``): it depends on every row."""
        for t in _tensors(out):
            e = self._get(t)
            self._put(t, join(None if e is None else e[1], Mixed(what, size=True)), _CREATED if e is None else e[2],
                      None if e is None else e[3])

    def _get(self, t: Any) -> _Entry | None:
        e = self._info.get(id(t))
        return e if e is not None and e[0]() is t else None

    def _put(self, t: torch.Tensor, label: Label, kind: int, root: Any) -> None:
        self._info[id(t)] = (weakref.ref(t), label, kind, root)

    def label(self, t: Any) -> Label:
        if not isinstance(t, torch.Tensor):
            return None
        e = self._get(t)
        return None if e is None else e[1]

    # ------------------------------------------------------------------ bookkeeping
    def _plain(self, func: Any, args: Sequence[Any], out: Any, view_of_arg: bool) -> None:
        """An op on unlabelled values: its outputs carry no rows; views keep their base's kind. A new
        tensor with exactly one dimension of the batch's size is taken to be sized by it (``shaped``)."""
        if view_of_arg and args and isinstance(args[0], torch.Tensor):
            for t in _tensors(out):
                self._new_view(t, args[0], None)
            return
        factory = func.overloadpacket in _NEW or not any(isinstance(a, torch.Tensor) for a in args)
        for t in _tensors(out):
            if self._get(t) is None:
                self._put(t, self._sized(t, func, args) if factory else None, _MADE if factory else _CREATED, None)

    def _sized(self, t: torch.Tensor, func: Any = None, args: Sequence[Any] = ()) -> Label:
        if self.rows < 2:
            return None
        dims = [d for d, n in enumerate(t.shape) if n == self.rows]
        if len(dims) != 1:
            return None
        return Rows(dims[0], shaped=True, iota=func is not None and _is_iota(func, args, t))

    def _unknown(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, why: str,
                 sized: Mixed | None = None) -> None:
        label: Label = sized
        if _first_label(self, args, kwargs) is not None:
            label = join(Mixed(why, proven=False), sized)
        plan = _PLANS.get(id(func)) or _plan(func)
        self._assign(func, args, kwargs, out, [label] * len(_tensors(out)), plan[2], plan[4], plan[5])

    def _assign(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any, labels: Sequence[Label],
                writes: tuple[tuple[int, ...], tuple[str, ...]], view_of_arg: bool, made_here: int) -> None:
        outs = _tensors(out)
        written = self._written(args, kwargs, writes) if writes[0] else []
        view_of = args[0] if view_of_arg and args and isinstance(args[0], torch.Tensor) else None
        for t, lab in zip(outs, labels):
            if any(t is w for w in written):
                continue  # an in-place result: the write below labels it
            if view_of is not None:
                self._new_view(t, view_of, lab)
            else:
                old = self._get(t)
                self._put(t, lab, made_here if old is None else old[2], None if old is None else old[3])
        for w in written:
            new = next((lab for t, lab in zip(outs, labels) if t is w), None)
            if new is None and not any(t is w for t in outs):  # written, not returned (batch norm's running stats)
                new = join(self.label(w), _first_label(self, args, kwargs))
            self._write(func, w, new)

    def _new_view(self, t: torch.Tensor, base: torch.Tensor, label: Label) -> None:
        b = self._get(base)
        kind = _EXTERNAL if b is None else b[2]
        root = base if b is None or b[3] is None else b[3]()
        if root is None:
            root = base
        self._put(t, label, kind, weakref.ref(root))
        self._views.setdefault(id(root), []).append(weakref.ref(t))

    def _written(self, args: Sequence[Any], kwargs: dict[str, Any],
                 writes: tuple[tuple[int, ...], tuple[str, ...]]) -> list[torch.Tensor]:
        positions, names = writes
        out: list[torch.Tensor] = []
        for pos, name in zip(positions, names):
            v = args[pos] if pos < len(args) else kwargs.get(name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor):
                    out.append(t)
        return out

    def _write(self, func: Any, w: torch.Tensor, new: Label) -> None:
        """``func`` wrote ``w`` in place; its contents are now labelled ``new``."""
        old = self._get(w)
        kind = _EXTERNAL if old is None else old[2]
        what = f"{func.overloadpacket} writes a tensor of shape {tuple(w.shape)}"
        if kind == _EXTERNAL:
            root = old[3]() if old is not None and old[3] is not None else w
            name = self._names.get(id(root))
            self.state_writes.append(f"{func.overloadpacket} writes {name!r}" if name else
                                     what + " that the call did not create")
        elif kind == _INPUT:
            self.input_writes.append(what + " that is one of the call's inputs")
        old_label = None if old is None else old[1]
        root_ref = None if old is None else old[3]
        if isinstance(new, Rows) and new.iota and func.overloadpacket is not _COPY:
            new = new._replace(iota=False)  # e.g. arange(B).fill_(0): same shape, other values
        self._put(w, new, kind, root_ref)
        root = root_ref() if root_ref is not None else w
        if new is None:
            # constants written: what else the memory holds keeps its label, unless the view picked
            # positions by the batch's size (``x[-1] = 0`` writes another row once x is padded)
            r = self._get(root) if root is not None and root is not w else None
            if r is not None and (isinstance(old_label, Mixed) or (isinstance(r[1], Rows) and r[1].iota)):
                written = old_label if isinstance(old_label, Mixed) else None
                self._put(root, join(r[1], written), r[2], r[3])
            return
        if root is not None and root is not w:
            r = self._get(root)
            self._put(root, join(None if r is None else r[1], self._root_label(func, w, root, new)), kind,
                      None if r is None else r[3])
        if new == old_label:
            return
        for ref in self._views.get(id(root if root is not None else w), ()):
            v = ref()
            if v is not None and v is not w:
                vi = self._get(v)
                if vi is not None:
                    self._put(v, join(vi[1], Mixed("a view of a tensor written through another view",
                                                   proven=False)), vi[2], vi[3])

    def _root_label(self, func: Any, view: torch.Tensor, root: torch.Tensor, label: Label) -> Label:
        """What writing rows labelled ``label`` into ``view`` makes of the tensor it views: the root's dim
        whose memory stride is the view's row stride (a slice of other dims, a transpose) carries them."""
        if not isinstance(label, Rows):
            return label
        step = view.stride(label.dim) * label.inner
        for r in range(root.dim()):
            if root.stride(r) == step and root.shape[r] == self.rows and label.outer == 1:
                return Rows(r, shaped=label.shaped)
        return Mixed(f"{func.overloadpacket} writes rows of the batch into part of a tensor", proven=False)

    def _not_random(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Seeded ops that draw nothing here: attention and dropout with p = 0 or in eval."""
        spec = _SDPA.get(func.overloadpacket)
        if spec is not None:
            return not _arg(args, kwargs, spec[1], "dropout_p", 0.0)
        if str(func.overloadpacket) in ("aten.native_dropout", "aten.dropout"):  # (input, p, train)
            train = _arg(args, kwargs, 2, "train", True)
            return (train is not None and not train) or not _arg(args, kwargs, 1, "p", 0.0)
        return False

    # ------------------------------------------------------------------ verdict
    def verdict(self, outputs: Any) -> RowVerdict:
        """Whether padding this run's call is sound, and which outputs carry the batch (module docstring)."""
        labels: list[Rows | None] = []
        mixed: Mixed | None = None
        for leaf in pytree.tree_leaves(outputs):
            lab = self.label(leaf)
            if isinstance(lab, Rows) and lab.outer != 1:
                lab = Mixed("an output repeats the batch along one dimension")
            if isinstance(lab, Mixed):
                mixed = lab if mixed is None or (lab.proven and not mixed.proven) else mixed
                labels.append(None)
            else:
                labels.append(None if lab is None else lab._replace(shaped=False))
        kept = self._kept(outputs)
        if kept:
            self.state_writes.append(kept)
        common = dict(outputs=tuple(labels), state_writes=tuple(self.state_writes),
                      input_writes=tuple(self.input_writes), ops=self.ops)
        if self.state_writes or self.input_writes:
            return RowVerdict(Reason.STATEFUL, (self.state_writes or self.input_writes)[0], **common)
        if self.random:
            return RowVerdict(Reason.RANDOM_OPS, f"{self.random} draws random numbers: padding would change "
                              "which numbers each row gets", **common)
        if self.host_read:  # first: what else the run did depends on the branch the data chose
            return RowVerdict(Reason.UNPROVEN, self.host_read, host_read=mixed is None, **common)
        if mixed is not None:
            reason = Reason.SIZE_AS_VALUE if mixed.size else Reason.ROWS_COUPLED if mixed.proven else Reason.UNPROVEN
            return RowVerdict(reason, mixed.why, **common)
        return RowVerdict(None, "", **common)


    def _kept(self, outputs: Any) -> str:
        """A tensor the run allocated at the batch's size (a factory, not a result of the batch's values) that
        outlives the call without being one of its outputs: state the model keeps (a cache it created on this
        call). Results of computations are not counted: a collective's work object may hold them a while."""
        out_ids = {id(t) for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(outputs):  # an output that is a view keeps the tensor it views alive
            e = self._get(t) if isinstance(t, torch.Tensor) else None
            if e is not None and e[3] is not None and e[3]() is not None:
                out_ids.add(id(e[3]()))
        for ref, label, kind, root in list(self._info.values()):
            t = ref()
            if t is None or kind != _MADE or root is not None or label is None or id(t) in out_ids:
                continue
            r = root() if root is not None else None
            if r is not None and id(r) in out_ids:
                continue
            return f"the model keeps a tensor of shape {tuple(t.shape)} it made from the batch (a cache?)"
        return ""


def _is_iota(func: Any, args: Sequence[Any], t: torch.Tensor) -> bool:
    """Whether ``func(*args)`` made ``0, 1, ..., n-1`` (``arange`` from 0 by 1, one dimension)."""
    if func.overloadpacket is not _ARANGE or t.dim() != 1:
        return False
    overload = str(func).rsplit(".", 1)[-1]
    if overload in ("default", "out"):
        return True
    start = args[0] if args else 0
    step = args[2] if overload.startswith("start_step") and len(args) > 2 else 1
    return start == 0 and step == 1


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


def _first_label(tr: RowTracer, args: Sequence[Any], kwargs: dict[str, Any]) -> Label:
    lab: Label = None
    for a in [*args, *kwargs.values()]:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            lab = join(lab, tr.label(x))
    return lab


# ---------------------------------------------------------------------------------------------- rules
# Each rule returns the labels of the op's tensor outputs, in order.

Rule = Callable[[RowTracer, Any, Sequence[Any], dict[str, Any], Any], list[Label]]


def _shift(lab: Label, in_ndim: int, out: torch.Tensor, in_size: int | None = None) -> Label:
    """An input's label broadcast to ``out`` (trailing dims aligned)."""
    if not isinstance(lab, Rows):
        return lab
    d = lab.dim + out.dim() - in_ndim
    if d < 0 or (in_size is not None and in_size != out.shape[d]):
        return Mixed("the batch dimension is broadcast")
    return lab if d == lab.dim else Rows(d, lab.inner, lab.outer, lab.shaped, lab.iota)


def _pointwise(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    outs = _tensors(out)
    if not outs:
        return []
    ref = outs[0]
    lab: Label = None
    for a in [*args, *kwargs.values()]:
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, torch.Tensor):
                xl = tr.label(x)
                if xl is not None:
                    lab = join(lab, _shift(xl, x.dim(), ref, x.shape[xl.dim] if isinstance(xl, Rows) else None))
    if isinstance(lab, Rows) and lab.iota:
        lab = Rows(lab.dim, lab.inner, lab.outer, lab.shaped)  # arange(B) + 1 no longer names each row itself
    return [lab] * len(outs)


def _constant(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """Fills and factories: the result holds no row of the batch (its size may: ``new_zeros(x.shape[0], 3)``)."""
    if args and isinstance(args[0], torch.Tensor) and any(t is args[0] for t in _tensors(out)):
        lab = tr.label(args[0])  # filled in place: the shape is the tensor's own
        return [lab._replace(shaped=True, iota=False) if isinstance(lab, Rows) else None]
    return [tr._sized(t) for t in _tensors(out)]


def _fill_tensor(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """``fill_(value_tensor)``: every element is the (0-dim) value."""
    return [tr.label(_arg(args, kwargs, 1, "value"))]


def _like(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """``zeros_like(x)`` and kin: no row in the values, the batch in the shape."""
    lab = tr.label(args[0])
    if isinstance(lab, Rows):
        return [lab._replace(shaped=True, iota=False)]
    return [None if lab is None else Mixed("a tensor shaped like values that mix rows", proven=False)]


def _copy(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    src = _arg(args, kwargs, 1, "src")
    return [_shift(tr.label(src), src.dim(), args[0], src.shape[tr.label(src).dim]
                   if isinstance(tr.label(src), Rows) else None)]


def _same(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    return [tr.label(args[0])] * len(_tensors(out))


# ---------------------------------------------------------------- views
def _reshape_label(lab: Label, in_shape: Sequence[int], out_shape: Sequence[int], rows: int) -> Label:
    """Where the batch lands when a tensor of ``in_shape`` is read as ``out_shape`` (row-major)."""
    if not isinstance(lab, Rows):
        return lab
    d = lab.dim
    q = lab.inner * math.prod(in_shape[d + 1:])  # flat stride of one row
    span = q * rows
    suffix = 1
    for e in range(len(out_shape) - 1, -1, -1):
        hi = suffix * out_shape[e]
        if q % suffix == 0 and hi % span == 0:
            inner, outer = q // suffix, hi // span
            return Rows(e, inner, outer, lab.shaped, lab.iota and inner == outer == 1)
        if suffix > q:
            break
        suffix = hi
    return Mixed("a view splits the batch dimension")


def _view(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    return [_reshape_label(tr.label(args[0]), tuple(args[0].shape), tuple(out.shape), tr.rows)]


def _permute(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    nd = args[0].dim()
    name = str(func.overloadpacket)
    if name == "aten.permute":
        perm = [_norm(int(p), nd) for p in _arg(args, kwargs, 1, "dims")]
        return [lab._replace(dim=perm.index(lab.dim))]
    if name == "aten.t":
        return [lab._replace(dim=nd - 1 - lab.dim) if nd == 2 else lab]
    d0, d1 = (_norm(int(_arg(args, kwargs, i, n)), nd) for i, n in ((1, "dim0"), (2, "dim1")))
    return [lab._replace(dim=d1 if lab.dim == d0 else d0 if lab.dim == d1 else lab.dim)]


def _unsqueeze(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    u = _norm(int(_arg(args, kwargs, 1, "dim")), out.dim())
    return [lab._replace(dim=lab.dim + (1 if u <= lab.dim else 0))]


def _squeeze(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    shape = tuple(args[0].shape)
    dims = _dims(_arg(args, kwargs, 1, "dim"), len(shape))
    gone = {d for d in (range(len(shape)) if dims is None else dims) if shape[d] == 1}
    if lab.dim in gone:
        return [Mixed("squeezes the batch dimension away")]
    return [lab._replace(dim=lab.dim - sum(1 for g in gone if g < lab.dim))]


def _expand(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    return [_shift(lab, args[0].dim(), out, args[0].shape[lab.dim] if isinstance(lab, Rows) else None)]


def _slice(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    nd = args[0].dim()
    d = _norm(int(_arg(args, kwargs, 1, "dim", 0)), nd)
    if d != lab.dim:
        return [lab]
    if tuple(out.shape) == tuple(args[0].shape) and out.stride() == args[0].stride():
        return [lab]  # the whole dimension
    return [Mixed(f"slices the batch dimension ({func.overloadpacket} on dim {d})")]


def _select(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    d = _norm(int(_arg(args, kwargs, 1, "dim")), args[0].dim())
    if d == lab.dim:
        return [Mixed(f"selects one row of the batch (index {_arg(args, kwargs, 2, 'index')})")]
    return [lab._replace(dim=lab.dim - (1 if d < lab.dim else 0))]


def _split(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    n = len(_tensors(out))
    if not isinstance(lab, Rows):
        return [lab] * n
    name = str(func.overloadpacket)
    d = _norm(int(_arg(args, kwargs, 1 if name == "aten.unbind" else 2, "dim", 0)), args[0].dim())
    if d == lab.dim:
        return [Mixed(f"{name} splits the batch dimension")] * n
    if name == "aten.unbind":
        return [lab._replace(dim=lab.dim - (1 if d < lab.dim else 0))] * n
    return [lab] * n


def _diagonal(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    nd = args[0].dim()
    d1, d2 = _norm(int(_arg(args, kwargs, 2, "dim1", 0)), nd), _norm(int(_arg(args, kwargs, 3, "dim2", 1)), nd)
    if lab.dim in (d1, d2):
        return [Mixed("takes a diagonal across the batch dimension")]
    return [lab._replace(dim=lab.dim - sum(1 for x in (d1, d2) if x < lab.dim))]


def _unfold(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if isinstance(lab, Rows) and _norm(int(_arg(args, kwargs, 1, "dimension")), args[0].dim()) == lab.dim:
        return [Mixed("unfolds windows along the batch dimension")]
    return [lab]


def _complex_view(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if isinstance(lab, Rows) and lab.dim >= out.dim():
        return [Mixed("the batch is the real/imaginary dimension")]
    return [lab]


# ---------------------------------------------------------------- reductions and scans
# packet -> (position, name and default of the dim argument, of keepdim (None: keeps every dim), kind)
# kind: "reduce" (removes or keeps the dims), "scan" (prefix-safe along the batch), "along" (mixes along it)
_REDUCE: dict[Any, tuple[int, str, Any, int | None, str, str]] = {}


def _reduction(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    n = len(_tensors(out))
    if not isinstance(lab, Rows):
        return [lab] * n
    dpos, dname, default, kpos, kname, kind = _REDUCE[func.overloadpacket]
    nd = args[0].dim()
    name = str(func.overloadpacket)
    if _overload(func) == "default" and name in _FULL_BY_DEFAULT:
        dims = None
    else:
        dims = _dims(_arg(args, kwargs, dpos, dname, default), nd)
    if kind == "scan":
        if dims and lab.dim in dims and lab.outer != 1:
            return [Mixed(f"{name} scans along a batch dimension that repeats")] * n
        return [lab] * n
    if dims is None or lab.dim in dims:
        return [Mixed(f"{name} {'reduces over' if kind == 'reduce' else 'works along'} the batch dimension")] * n
    if kind == "along" or kpos is None:
        return [lab] * n
    keep = bool(_arg(args, kwargs, kpos, kname, False))
    return [lab if keep else lab._replace(dim=lab.dim - sum(1 for d in dims if d < lab.dim))] * n


def _overload(func: Any) -> str:
    return str(func).rsplit(".", 1)[-1]


# reductions whose ``default`` overload has no dim argument: they reduce everything
_FULL_BY_DEFAULT = frozenset({"aten.sum", "aten.mean", "aten.max", "aten.min", "aten.median", "aten.nanmedian",
                              "aten.prod", "aten.all", "aten.any", "aten.std", "aten.var", "aten.std_mean",
                              "aten.var_mean"})


def _norms(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """layer norm and RMS norm: statistics over the trailing ``normalized_shape`` dims of each row."""
    lab = tr.label(args[0])
    n = len(_tensors(out))
    extra = join(tr.label(_arg(args, kwargs, 2, "weight")), tr.label(_arg(args, kwargs, 3, "bias"))) \
        if "layer_norm" in str(func) else tr.label(_arg(args, kwargs, 2, "weight"))
    if extra is not None:
        return [Mixed("the norm's weight depends on the batch", proven=False)] * n
    if not isinstance(lab, Rows):
        return [lab] * n
    k = len(_arg(args, kwargs, 1, "normalized_shape"))
    if lab.dim >= args[0].dim() - k:
        return [Mixed(f"{func.overloadpacket} normalises over the batch dimension")] * n
    return [lab] * n


def _batch_norm(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    name = str(func.overloadpacket)
    n = len(_tensors(out))
    if name == "aten._native_batch_norm_legit_no_training":
        training = False
    elif name == "aten._native_batch_norm_legit" and _overload(func) == "no_stats":
        training = bool(_arg(args, kwargs, 3, "training"))
    else:
        training = bool(_arg(args, kwargs, 5, "training"))
    lab = tr.label(args[0])
    if training and name in ("aten.native_batch_norm", "aten.cudnn_batch_norm", "aten.miopen_batch_norm"):
        for pos, arg_name in ((3, "running_mean"), (4, "running_var")):  # written, though the schema says not
            stat = _arg(args, kwargs, pos, arg_name)
            if isinstance(stat, torch.Tensor):
                tr._write(func, stat, tr.label(stat))
    if not isinstance(lab, Rows):
        return [lab] + [None] * (n - 1)
    if training and lab.dim != 1:
        return [Mixed("batch norm in training mode normalises over the batch")] * n
    return [lab] + [Rows(0) if training else None] * (n - 1)


def _group_norm(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    n = len(_tensors(out))
    if not isinstance(lab, Rows):
        return [lab] * n
    if lab.dim != 0 or lab.inner != 1:
        return [Mixed("group norm's groups span the batch dimension")] * n
    return [lab] * n


# ---------------------------------------------------------------- contractions
def _mm_labels(a: Label, b: Label, a_nd: int, b_nd: int, what: str) -> Label:
    """``a @ b`` for (.., n, k) @ (.., k, m) with the same leading batch dims (mm, bmm, mv, dot)."""
    out: Label = None
    lead = max(a_nd, b_nd) - 2
    if isinstance(a, Mixed) or isinstance(b, Mixed):
        return a if isinstance(a, Mixed) else b
    if isinstance(a, Rows):
        if a_nd >= 2 and a.dim == a_nd - 1 or a_nd == 1:
            return Mixed(f"{what} contracts over the batch dimension")
        out = join(out, a)
    if isinstance(b, Rows):
        if b_nd >= 2 and b.dim == b_nd - 2 or b_nd == 1:
            return Mixed(f"{what} contracts over the batch dimension")
        out = join(out, b._replace(dim=b.dim if b.dim < lead else (a_nd - 1 if b_nd >= 2 else b.dim)))
    return out


def _mm(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    name = str(func.overloadpacket)
    if name in ("aten.addmm", "aten.baddbmm", "aten.addmv", "aten._addmm_activation", "aten.addbmm"):
        bias, a, b = args[0], args[1], args[2]
    else:
        bias, a, b = None, args[0], args[1]
    if name == "aten.addbmm":  # sums over the leading (batch) dim of the matrices
        if isinstance(tr.label(a), Rows) and tr.label(a).dim == 0 or isinstance(tr.label(b), Rows) and \
                tr.label(b).dim == 0:
            return [Mixed("addbmm sums over the batch dimension")]
        a_l = tr.label(a)
        b_l = tr.label(b)
        lab = _mm_labels(None if a_l is None else a_l._replace(dim=a_l.dim - 1) if isinstance(a_l, Rows) else a_l,
                         None if b_l is None else b_l._replace(dim=b_l.dim - 1) if isinstance(b_l, Rows) else b_l,
                         2, 2, name)
    else:
        lab = _mm_labels(tr.label(a), tr.label(b), a.dim(), b.dim(), name)
    if bias is not None:
        bl = tr.label(bias)
        lab = join(lab, _shift(bl, bias.dim(), out, bias.shape[bl.dim] if isinstance(bl, Rows) else None))
    return [lab]


def _linear(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    x, w = args[0], args[1]
    bias = _arg(args, kwargs, 2, "bias")
    if tr.label(w) is not None or (bias is not None and tr.label(bias) is not None):
        return [Mixed("a linear layer's weight depends on the batch", proven=False)]
    lab = tr.label(x)
    if isinstance(lab, Rows) and lab.dim == x.dim() - 1:
        return [Mixed("linear contracts over the batch dimension")]
    return [lab]


def _outer(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    a, b = tr.label(args[0]), tr.label(args[1])
    return [join(a, None if not isinstance(b, Rows) else b._replace(dim=1)) if not isinstance(b, Mixed) else b]


def _convolution(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    x, w = args[0], args[1]
    bias = _arg(args, kwargs, 2, "bias")
    if tr.label(w) is not None or tr.label(bias) is not None:
        return [Mixed("a convolution's weight depends on the batch", proven=False)]
    lab = tr.label(x)
    if isinstance(lab, Rows) and (lab.dim != 0 or lab.inner != 1):
        return [Mixed("a convolution runs across the batch dimension")]
    return [lab]


def _spatial(k: int) -> Rule:
    """Pooling, upsampling and spatial padding over the last ``k`` dims of each sample."""

    def rule(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
        lab = tr.label(args[0])
        n = len(_tensors(out))
        if isinstance(lab, Rows) and lab.dim >= args[0].dim() - k:
            return [Mixed(f"{func.overloadpacket} works across the batch dimension")] * n
        return [lab] * n

    return rule


def _channels_spatial(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if isinstance(lab, Rows) and lab.dim >= args[0].dim() - 3:
        return [Mixed(f"{func.overloadpacket} moves values across the batch dimension")]
    return [lab]


_SDPA: dict[Any, tuple[int | None, int]] = {}  # packet -> (position of the mask/bias or None, of dropout_p)


def _attention(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """Attention over (B, H, L, E) queries and (B, H, S, E) keys and values: rows along B, H or L."""
    n = len(_tensors(out))
    q, k, v = args[0], args[1], args[2]
    mask_pos, _ = _SDPA[func.overloadpacket]
    mask = _arg(args, kwargs, mask_pos, "attn_bias") if mask_pos is not None else kwargs.get("attn_mask")
    lab: Label = None
    for t, role in ((q, "q"), (k, "k"), (v, "v"), (mask, "mask")):
        if not isinstance(t, torch.Tensor):
            continue
        tl = tr.label(t)
        if tl is None:
            continue
        if isinstance(tl, Mixed):
            return [tl] * n
        d = tl.dim + 4 - t.dim()
        if role == "q" and d == 3 or role in ("k", "v") and d >= 2 or role == "mask" and d == 3:
            return [Mixed("attention runs across the batch dimension")] * n
        lab = join(lab, tl._replace(dim=d))
    return [lab] + [None if not isinstance(lab, Rows) or lab.dim > 2 else lab] * (n - 1)


def _batch_first_attention(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                           out: Any) -> list[Label]:
    """PyTorch's fused inference paths of nn.MultiheadAttention and nn.TransformerEncoderLayer
    (batch first): each sample attends within itself, so rows along dim 0 stay independent."""
    n = len(_tensors(out))
    lab = _first_label(tr, args, kwargs)
    if lab is None:
        return [None] * n
    for a in [*args, *kwargs.values()]:
        al = tr.label(a) if isinstance(a, torch.Tensor) else None
        if al is not None and not (isinstance(al, Rows) and al.dim == 0 and al.inner == 1):
            return [Mixed(f"{func.overloadpacket} works across the batch dimension")] * n
    return [Rows(0)] * n


def _nll(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """nll_loss per row (reduction none) keeps the rows; a mean or sum over them mixes them."""
    lab = join(tr.label(args[0]), tr.label(args[1]))
    n = len(_tensors(out))
    if lab is not None and _arg(args, kwargs, 3, "reduction", 1) != 0:
        return [Mixed("the loss reduces over the batch")] * n
    return [lab] + [None] * (n - 1)


def _embedding(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    if tr.label(args[0]) is not None:
        return [Mixed("an embedding table depends on the batch", proven=False)]
    return [tr.label(args[1])]


def _cdist(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    a, b = tr.label(args[0]), tr.label(args[1])
    nd = args[0].dim()
    lab: Label = None
    for t, which in ((a, 0), (b, 1)):
        if isinstance(t, Mixed):
            return [t]
        if isinstance(t, Rows):
            if t.dim == nd - 1:
                return [Mixed("cdist contracts over the batch dimension")]
            lab = join(lab, t if t.dim < nd - 2 else t._replace(dim=nd - 2 + which))
    return [lab]


# ---------------------------------------------------------------- indexing
def _index_select(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    x, dim, idx = args[0], _norm(int(args[1]), max(args[0].dim(), 1)), args[2]
    lab, il = tr.label(x), tr.label(idx)
    if isinstance(lab, Rows) and lab.dim == dim:
        return [Mixed("picks rows of the batch by index")]
    if isinstance(il, Rows):
        if isinstance(lab, Rows):
            return [Mixed("indexes with one row's values into another row's")]
        return [Rows(dim, il.inner, il.outer)]
    return [join(lab, il)]


def _gather(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    x, idx = args[0], args[2]
    dim = _norm(int(args[1]), max(x.dim(), 1))
    lab, il = tr.label(x), tr.label(idx)
    if isinstance(lab, Rows) and lab.dim == dim:
        return [Mixed("gathers along the batch dimension")]
    return [join(lab, il)]


def _scatter(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    x = args[0]
    dim = _norm(int(args[1]), max(x.dim(), 1))
    lab: Label = tr.label(x)
    for t in args[2:4]:
        if isinstance(t, torch.Tensor):
            lab = join(lab, tr.label(t))
    if isinstance(lab, Rows) and lab.dim == dim:
        return [Mixed(f"{func.overloadpacket} writes along the batch dimension")]
    return [lab]


def _index(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """``x[i0, i1, ...]`` with index tensors: the broadcast index dims replace the indexed ones."""
    x, indices = args[0], list(args[1])
    lab = tr.label(x)
    if any(isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8) for ix in indices):
        if lab is not None or any(tr.label(ix) is not None for ix in indices):
            return [Mixed("indexes with a mask: the result's size depends on the data")]
        return [None]
    given = [(k, ix) for k, ix in enumerate(indices) if isinstance(ix, torch.Tensor)]
    if isinstance(lab, Mixed) or not given:
        return [lab]
    adv = [k for k, _ in given]
    nb = max(ix.dim() for _, ix in given)
    contiguous = adv == list(range(adv[0], adv[-1] + 1))
    start = adv[0] if contiguous else 0  # where the broadcast index dims land
    out_lab: Label = None
    if isinstance(lab, Rows):
        if lab.dim in adv:
            ix = indices[lab.dim]
            il = tr.label(ix)
            if not (isinstance(il, Rows) and il.iota and lab.inner == 1 and lab.outer == 1):
                return [Mixed("indexes the batch dimension with a tensor")]
            out_lab = Rows(start + il.dim + nb - ix.dim())  # x[arange(B), ...]: row i reads row i
        else:
            kept_before = sum(1 for j in range(lab.dim) if j not in adv)
            at = kept_before if contiguous and lab.dim < adv[0] else kept_before + nb
            out_lab = lab._replace(dim=at)
    for _, ix in given:
        il = tr.label(ix)
        if isinstance(il, Mixed):
            return [il]
        if isinstance(il, Rows):
            out_lab = join(out_lab, il._replace(dim=start + il.dim + nb - ix.dim()))
    return [out_lab]


def _index_put(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    x, indices, values = args[0], list(args[1]), args[2]
    lab, vl = tr.label(x), tr.label(values)
    masks = [ix for ix in indices if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8)]
    if masks and len(masks) == len([ix for ix in indices if ix is not None]) and values.numel() == 1:
        lab = join(lab, vl)  # x[mask] = v: elementwise; a mask at index position k covers dims k, k+1, ...
        pos = 0
        for ix in indices:
            if ix is None:
                pos += 1
                continue
            ml = tr.label(ix)
            if isinstance(ml, Rows):
                ml = ml._replace(dim=pos + ml.dim)
            lab = join(lab, ml)
            pos += ix.dim()
        return [lab]
    adv = [k for k, ix in enumerate(indices) if ix is not None]
    if isinstance(lab, Rows) and lab.dim in adv:
        return [Mixed("writes rows of the batch chosen by index")]
    if any(tr.label(ix) is not None for ix in indices) or vl is not None:
        return [join(lab, Mixed("writes batch values at indexed positions", proven=False))]
    return [lab]


def _index_along(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """index_add / index_copy / index_fill (self, dim, index, source)."""
    x = args[0]
    dim = _norm(int(args[1]), max(x.dim(), 1))
    lab = tr.label(x)
    for t in args[2:4]:
        if isinstance(t, torch.Tensor):
            lab = join(lab, tr.label(t))
    if isinstance(lab, Rows) and lab.dim == dim:
        return [Mixed(f"{func.overloadpacket} works along the batch dimension")]
    return [lab]


def _data_shaped(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """Ops whose result's size depends on the data (nonzero, masked_select, unique)."""
    lab = _first_label(tr, args, kwargs)
    n = len(_tensors(out))
    return [Mixed(f"{func.overloadpacket}'s result size depends on the values of the batch")
            if lab is not None else None] * n


def _host_read(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    if _first_label(tr, args, kwargs) is not None and not tr.host_read:
        tr.host_read = (f"the model reads batch values on the host ({func.overloadpacket}, e.g. .item() or a "
                        "branch on a tensor): its control flow may depend on the rows")
    return [None] * len(_tensors(out))


# ---------------------------------------------------------------- shape changes
def _cat(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    tensors = [t for t in args[0] if isinstance(t, torch.Tensor)]
    nd = out.dim()
    d = _norm(int(_arg(args, kwargs, 1, "dim", 0)), nd)
    stack = str(func.overloadpacket) == "aten.stack"
    lab: Label = None
    for t in tensors:
        tl = tr.label(t)
        if isinstance(tl, Rows):
            if not stack and tl.dim == d:
                return [Mixed("concatenates along the batch dimension")]
            tl = tl._replace(dim=tl.dim + (1 if stack and d <= tl.dim else 0))
        lab = join(lab, tl)
    return [lab]


def _pad(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    pad = list(_arg(args, kwargs, 1, "pad"))
    nd = args[0].dim()
    for i in range(len(pad) // 2):
        if nd - 1 - i == lab.dim and (pad[2 * i] or pad[2 * i + 1]):
            return [Mixed("pads the batch dimension")]
    return [lab]


def _flip(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    name = str(func.overloadpacket)
    dims = _dims(_arg(args, kwargs, 2 if name == "aten.roll" else 1, "dims"), args[0].dim())
    if dims is None or lab.dim in dims:
        return [Mixed(f"{name} reorders the batch dimension")]
    return [lab]


def _repeat(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    reps = list(_arg(args, kwargs, 1, "repeats"))
    d = lab.dim + len(reps) - args[0].dim()
    return [Rows(d, lab.inner, lab.outer * int(reps[d]))]


def _repeat_interleave(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                       out: Any) -> list[Label]:
    lab = tr.label(args[0])
    if not isinstance(lab, Rows):
        return [lab]
    reps, dim = _arg(args, kwargs, 1, "repeats"), _arg(args, kwargs, 2, "dim")
    if dim is None or not isinstance(reps, int):
        return [Mixed("repeat_interleave flattens or repeats rows unevenly", proven=False)]
    if _norm(int(dim), args[0].dim()) == lab.dim:
        if lab.outer != 1:
            return [Mixed("repeat_interleave along a repeated batch dimension")]
        return [lab._replace(inner=lab.inner * reps)]
    return [lab]


def _collective(tr: RowTracer, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> list[Label]:
    """Collectives combine ranks, not rows; gathers and scatters along dim 0 move the batch there."""
    lab = _first_label(tr, args, kwargs)
    name = str(func.overloadpacket)
    if isinstance(lab, Rows) and lab.dim == 0 and any(k in name for k in ("gather", "scatter", "all_to_all")):
        lab = Mixed(f"{name} interleaves ranks along the batch dimension")
    return [lab] * len(_tensors(out))


# ---------------------------------------------------------------- the table
def _op(name: str) -> Any:
    ns, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    try:
        p = getattr(getattr(torch.ops, ns), packet)
        return getattr(p, overload) if overload else p
    except (AttributeError, RuntimeError):
        return None


_RULES: dict[Any, Rule] = {}
_ITEM = _op("aten::_local_scalar_dense.default")
_ARANGE = _op("aten::arange")
_COPY = _op("aten::copy_")
_Plan = tuple[Union[Rule, None], bool, tuple[tuple[int, ...], tuple[str, ...]], bool, bool, int, Any]
# by id(op), the op itself last in the value: held here, an op's id is never reused for another
_PLANS: dict[int, _Plan] = {}
_FRESH = frozenset(p for p in (_op("aten::lift_fresh"), _op("aten::lift_fresh_copy"), _op("aten::lift"))
                   if p is not None)
# factories that take a tensor only for its dtype and device: their size may be the batch's
_NEW = frozenset(p for p in (_op(f"aten::{n}") for n in ("new_zeros", "new_ones", "new_empty", "new_full",
                                                         "new_empty_strided")) if p is not None)
# ops that allocate a tensor for the caller to fill (a cache a model keeps is made by one of them)
_MAKERS = _NEW | frozenset(p for p in (_op(f"aten::{n}") for n in ("zeros_like", "ones_like", "empty_like",
                                                                   "full_like")) if p is not None)


def _plan(func: Any) -> _Plan:
    """What the trace needs of an op, computed once: its rule (an overload's own, else the pointwise
    rule for ops tagged pointwise such as ``max.other``, else the packet's), whether it draws random
    numbers, what it writes, whether it is a view, whether its outputs view its first argument (a
    view, but not ``lift_fresh``), and what its new outputs are to the call (made by a factory or not)."""
    tags = func.tags
    rule = _RULES.get(func)
    packet = func.overloadpacket
    if rule is None:
        rule = _pointwise if torch.Tag.pointwise in tags else _RULES.get(packet)
    is_view = bool(func.is_view)
    return (rule, torch.Tag.nondeterministic_seeded in tags, op_writes(func), is_view,
            is_view and packet not in _FRESH, _MADE if packet in _MAKERS else _CREATED, func)


def _register(rule: Rule, *names: str) -> None:
    for n in names:
        op = _op(n if "::" in n else f"aten::{n}")
        if op is not None:
            _RULES[op] = rule


_register(_view, "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "flatten.using_ints",
          "unflatten.int")
_register(_same, "alias", "detach", "_to_copy", "clone", "contiguous", "lift_fresh", "lift_fresh_copy", "lift",
          "tril", "triu", "_conj", "conj", "positive", "_c10d_functional::wait_tensor")
_register(_copy, "copy_", "copy")
_register(_fill_tensor, "fill_.Tensor", "fill.Tensor")
_register(_like, "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like")
_register(_batch_first_attention, "_native_multi_head_attention", "_transformer_encoder_layer_fwd")
_register(_nll, "nll_loss_forward", "nll_loss2d_forward")
_register(_pointwise, "_prelu_kernel", "masked_fill.Tensor")
_register(_cdist, "_euclidean_dist")
_register(_constant, "fill_.Scalar", "zero_", "fill.Scalar", "zero", "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "scalar_tensor", "empty",
          "zeros", "ones", "full", "arange", "linspace", "logspace", "eye", "empty_strided", "_assert_async")
_register(_permute, "permute", "transpose.int", "t", "swapdims", "swapaxes")
_register(_unsqueeze, "unsqueeze")
_register(_squeeze, "squeeze")
_register(_expand, "expand", "expand_as", "broadcast_to")
_register(_slice, "slice.Tensor", "narrow")
_register(_select, "select.int")
_register(_split, "split.Tensor", "split_with_sizes", "unbind.int", "chunk", "tensor_split")
_register(_diagonal, "diagonal")
_register(_unfold, "unfold")
_register(_complex_view, "view_as_real", "view_as_complex")
_register(_reduction, "glu", "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "var", "std",
          "var_mean", "std_mean", "norm", "linalg_vector_norm", "logsumexp", "all", "any", "count_nonzero",
          "median", "nanmedian", "mode", "kthvalue", "topk", "sort", "argsort", "msort", "cumsum", "cumprod",
          "cummax", "cummin", "logcumsumexp", "_softmax", "_log_softmax", "softmax", "log_softmax",
          "_safe_softmax", "nansum", "aminmax", "special_logsumexp")
_register(_norms, "native_layer_norm", "_fused_rms_norm")
_register(_batch_norm, "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
          "cudnn_batch_norm", "miopen_batch_norm", "_native_batch_norm_legit_functional")
_register(_group_norm, "native_group_norm")
_register(_mm, "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation", "addbmm",
          "_scaled_mm", "_int_mm")
_register(_linear, "linear")
_register(_outer, "outer", "ger")
_register(_convolution, "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
          "conv_transpose2d", "conv_transpose3d", "convolution_overrideable")
for _k, _names in {1: ("max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "upsample_nearest1d",
                       "upsample_linear1d", "reflection_pad1d", "replication_pad1d", "max_pool1d_with_indices",
                       "adaptive_max_pool1d"),
                   2: ("max_pool2d_with_indices", "avg_pool2d", "_adaptive_avg_pool2d", "adaptive_max_pool2d",
                       "upsample_nearest2d", "upsample_bilinear2d", "upsample_bicubic2d", "reflection_pad2d",
                       "replication_pad2d", "im2col", "col2im", "max_pool2d"),
                   3: ("max_pool3d_with_indices", "avg_pool3d", "_adaptive_avg_pool3d", "adaptive_max_pool3d",
                       "upsample_nearest3d", "upsample_trilinear3d", "reflection_pad3d", "replication_pad3d")}.items():
    _register(_spatial(_k), *_names)
_register(_channels_spatial, "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle")
_register(_attention, "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_fused_attention_overrideable")
_register(_embedding, "embedding")
_register(_cdist, "_cdist_forward")
_register(_index_select, "index_select")
_register(_gather, "gather")
_register(_scatter, "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_")
_register(_index, "index.Tensor", "_unsafe_index.Tensor")
_register(_index_put, "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put")
_register(_index_along, "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_")
_register(_data_shaped, "nonzero", "nonzero_static", "masked_select", "masked_scatter", "masked_scatter_",
          "unique_dim", "_unique2", "unique_consecutive", "unique_dim_consecutive", "bincount", "histc",
          "argwhere", "take", "put", "put_", "_embedding_bag", "embedding_bag")
_register(_host_read, "_local_scalar_dense.default", "is_nonzero.default", "equal.default", "is_same_size.default")
_register(_cat, "cat", "stack", "_cat", "hstack", "vstack")
_register(_pad, "constant_pad_nd")
_register(_flip, "flip", "roll")
_register(_repeat, "repeat")
_register(_repeat_interleave, "repeat_interleave.self_int")
for _name in ("_c10d_functional::all_reduce", "_c10d_functional::all_reduce_", "_c10d_functional::broadcast",
              "_c10d_functional::broadcast_", "_c10d_functional::all_gather_into_tensor",
              "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_to_all_single",
              "c10d::allreduce_", "c10d::broadcast_"):
    _register(_collective, _name)

_REDUCE_ARGS = {  # packet name -> (dim position, name, default, keepdim position or None, name, kind)
    "sum": (1, "dim", None, 2, "keepdim", "reduce"), "mean": (1, "dim", None, 2, "keepdim", "reduce"),
    "nansum": (1, "dim", None, 2, "keepdim", "reduce"), "amax": (1, "dim", None, 2, "keepdim", "reduce"),
    "amin": (1, "dim", None, 2, "keepdim", "reduce"), "max": (1, "dim", None, 2, "keepdim", "reduce"),
    "min": (1, "dim", None, 2, "keepdim", "reduce"), "argmax": (1, "dim", None, 2, "keepdim", "reduce"),
    "argmin": (1, "dim", None, 2, "keepdim", "reduce"), "prod": (1, "dim", None, 2, "keepdim", "reduce"),
    "var": (1, "dim", None, 99, "keepdim", "reduce"), "std": (1, "dim", None, 99, "keepdim", "reduce"),
    "var_mean": (1, "dim", None, 99, "keepdim", "reduce"), "std_mean": (1, "dim", None, 99, "keepdim", "reduce"),
    "norm": (2, "dim", None, 3, "keepdim", "reduce"),
    "linalg_vector_norm": (2, "dim", None, 3, "keepdim", "reduce"),
    "logsumexp": (1, "dim", None, 2, "keepdim", "reduce"),
    "special_logsumexp": (1, "dim", None, 2, "keepdim", "reduce"),
    "all": (1, "dim", None, 2, "keepdim", "reduce"), "any": (1, "dim", None, 2, "keepdim", "reduce"),
    "count_nonzero": (1, "dim", None, None, "", "reduce"), "median": (1, "dim", None, 2, "keepdim", "reduce"),
    "nanmedian": (1, "dim", None, 2, "keepdim", "reduce"), "mode": (1, "dim", -1, 2, "keepdim", "reduce"),
    "kthvalue": (2, "dim", -1, 3, "keepdim", "reduce"), "aminmax": (99, "dim", None, 99, "keepdim", "reduce"),
    "topk": (2, "dim", -1, None, "", "along"), "sort": (1, "dim", -1, None, "", "along"),
    "argsort": (1, "dim", -1, None, "", "along"), "msort": (99, "", 0, None, "", "along"),
    "_softmax": (1, "dim", -1, None, "", "along"), "_log_softmax": (1, "dim", -1, None, "", "along"),
    "softmax": (1, "dim", -1, None, "", "along"), "log_softmax": (1, "dim", -1, None, "", "along"),
    "_safe_softmax": (1, "dim", -1, None, "", "along"), "glu": (1, "dim", -1, None, "", "along"),
    "cumsum": (1, "dim", None, None, "", "scan"), "cumprod": (1, "dim", None, None, "", "scan"),
    "cummax": (1, "dim", None, None, "", "scan"), "cummin": (1, "dim", None, None, "", "scan"),
    "logcumsumexp": (1, "dim", None, None, "", "scan"),
}
for _name, _spec in _REDUCE_ARGS.items():
    _p = _op(f"aten::{_name}")
    if _p is not None:
        _REDUCE[_p] = _spec

for _name, _spec2 in {"_scaled_dot_product_flash_attention": (None, 3),
                      "_scaled_dot_product_flash_attention_for_cpu": (None, 3),
                      "_scaled_dot_product_efficient_attention": (3, 5),
                      "_scaled_dot_product_cudnn_attention": (3, 5),
                      "_scaled_dot_product_fused_attention_overrideable": (3, 4)}.items():
    _p = _op(f"aten::{_name}")
    if _p is not None:
        _SDPA[_p] = _spec2
