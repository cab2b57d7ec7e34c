"""What a dispatch mode cannot see of a model: the batch's size used as a number, and values read without an op.

The row tracer (:mod:`.rows`) sees aten ops, and an op sees plain Python
numbers: in ``x / x.shape[0]`` the divisor arrives as ``5``, the same as a
literal ``5``, yet only the first changes when the batch is padded to 8. And
``Tensor.tolist()`` or ``.numpy()`` of a CPU tensor read its memory with no op
at all. :class:`PythonReads`, a ``TorchFunctionMode`` the tracer holds, sees
both where the model's Python calls torch:

* a shape read of a tensor whose size follows the batch (``x.shape``,
  ``x.size(d)``, ``x.numel()``) answers with a :class:`BatchInt` in the
  batch's place, an ``int`` that stays one through arithmetic. While a torch
  call that got one runs, :attr:`PythonReads.sizes` holds their values, and
  the tracer labels an op that takes one of them where a number goes (not a
  size: :func:`number_arguments`) as depending on every row; a tensor built
  from one (``torch.tensor(n)``) is labelled so too;
* ``tolist``, ``numpy`` and ``__array__`` of a tensor that carries the batch
  are host reads, as ``.item()`` is to the dispatcher.

Not seen: ``len(x)`` (CPython makes ``__len__``'s answer a plain int), a size
made a float by ``float(n)`` or passed through ``math``, a size compared on
the host (a branch on the batch size: the bucket's padded check, against the
unpadded run, sees what it changes), shape reads inside torch's own Python
functions (their ops are known by name), and anything inside compiled code:
dynamo traces the mode, which passes every call through there.

Cost: one Python call per torch call of the traced run, beside the tracer's
one per aten op.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from .._torch_compat import op_arguments

__all__ = ["BatchInt", "BatchFloat", "BatchShape", "PythonReads", "number_arguments"]


# ---------------------------------------------------------------------------------------------- sizes
def _wrap(value: Any) -> Any:
    if type(value) is int:
        return BatchInt(value)
    if type(value) is float:
        return BatchFloat(value)
    return value


def _arith(name: str) -> Callable[[Any, Any], Any]:
    """``__name__``, keeping its result tainted (``radd`` and kin reflected). Only with numbers: with a tensor
    the tensor's own reflected op must run (``n * x`` is ``x.__rmul__(n)``, a torch call that gets ``n``)."""
    reflected = name.startswith("r")
    op = getattr(operator, name[1:] if reflected else name)

    def method(self: Any, other: Any) -> Any:
        if type(other) not in (int, float, bool, BatchInt, BatchFloat):
            return NotImplemented
        mine = self.plain()
        theirs = other.plain() if isinstance(other, (BatchInt, BatchFloat)) else other
        return _wrap(op(theirs, mine) if reflected else op(mine, theirs))

    method.__name__ = f"__{name}__"
    return method


_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow")


class _Tainted:
    """What :class:`BatchInt` and :class:`BatchFloat` share: the plain value, negation, the plain repr."""

    __slots__ = ()
    _plain: type = int

    def plain(self) -> Any:
        return self._plain(self)

    def __neg__(self) -> Any:
        return type(self)(-self.plain())

    def __repr__(self) -> str:
        return repr(self.plain())


class BatchInt(_Tainted, int):
    """An ``int`` computed from the batch's size: it stays one through ``+ - * / // % **`` with numbers
    (``/`` gives a :class:`BatchFloat`), so a torch call that gets it is known to take the batch size."""

    __slots__ = ()


class BatchFloat(_Tainted, float):
    """A ``float`` computed from the batch's size (``n / 2``); see :class:`BatchInt`."""

    __slots__ = ()
    _plain = float


for _cls in (BatchInt, BatchFloat):
    for _name in (*_BINARY, *(f"r{n}" for n in _BINARY)):
        setattr(_cls, f"__{_name}__", _arith(_name))


class BatchShape(tuple):
    """A tensor's shape with :class:`BatchInt` where the batch's size is. It stands in for a ``torch.Size``
    (``torch.Size`` takes no subclass): its items, slices, ``numel()`` and ``isinstance(s, torch.Size)``
    answer as a Size's do, and torch takes it wherever a size goes."""

    __slots__ = ()

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(s, torch.Size) as for the real shape
        return torch.Size

    def __getitem__(self, key: Any) -> Any:
        got = tuple.__getitem__(self, key)
        return BatchShape(got) if isinstance(key, slice) and any(type(v) is BatchInt for v in got) else (
            torch.Size(got) if isinstance(key, slice) else got)

    def __add__(self, other: Any) -> BatchShape:
        return BatchShape(tuple(self) + tuple(other))

    def __radd__(self, other: Any) -> BatchShape:
        return BatchShape(tuple(other) + tuple(self))

    def numel(self) -> int:
        n = 1
        for v in self:
            n = n * v
        return n

    def __repr__(self) -> str:
        return f"torch.Size({list(map(int, self))})"

    def __reduce__(self) -> Any:
        return torch.Size, (tuple(map(int, self)),)


def _sizes_in(values: Iterable[Any]) -> set[float] | None:
    """The batch sizes among ``values`` (through lists, tuples and dicts), or None."""
    found = None
    for v in values:
        t = type(v)
        if t is BatchInt or t is BatchFloat:
            found = found or set()
            found.add(v.plain())
        elif (t is list or t is tuple or t is BatchShape or t is dict) and v:
            inner = _sizes_in(v.values() if t is dict else v)
            if inner:
                found = inner if found is None else found | inner
    return found


# ---------------------------------------------------------------------------------------------- ops
# Integer arguments a size goes into (``SymInt``) that move values rather than set a length: a slice's
# start, an index, a shift, a pad, top-k's count. Arguments that name a dimension never hold a size.
_OFFSETS = frozenset({"start", "index", "step", "k", "shifts", "pad", "storage_offset", "offset"})
_DIMS = frozenset({"dim", "dims", "dim0", "dim1", "dimension", "source", "destination"})


_NUMBERS: dict[int, tuple[tuple[tuple[int, str], ...], Any]] = {}  # by id(op), the op held beside


def number_arguments(op: Any) -> tuple[tuple[int, str], ...]:
    """The arguments of ``op`` (an ``OpOverload``) where a number is a value the result computes with, not
    a size it has: (position, name); a tensor's place counts (a Python number may come there). Scalars, floats and plain ints
    (``diagonal``, ``linspace``'s ``steps``) are; ``SymInt`` ones are sizes (``view``; ``arange``'s end is
    one too) except the offsets above; booleans and dimensions never are. From the op's schema, cached
    (by id, not ``lru_cache``: dynamo, compiling into the tracer, warns of that)."""
    got = _NUMBERS.get(id(op))
    if got is not None:
        return got[0]
    out = []
    packet = str(getattr(op, "overloadpacket", ""))
    for pos, (name, kind) in enumerate(op_arguments(op)):
        if name in _DIMS or kind in ("bool", "other") or (packet == "aten.arange" and name == "end"):
            continue
        if kind == "symint":
            if name in _OFFSETS:
                out.append((pos, name))
        else:
            out.append((pos, name))
    _NUMBERS[id(op)] = (tuple(out), op)
    return tuple(out)


def takes_size(op: Any, args: Sequence[Any], kwargs: dict[str, Any], sizes: frozenset[float]) -> str:
    """The name of ``op``'s argument that holds one of ``sizes`` as a number, or ``""``."""
    for pos, name in number_arguments(op):
        v = args[pos] if pos < len(args) else kwargs.get(name)
        for x in (v if type(v) in (list, tuple) else (v,)):
            if type(x) in (int, float) and x in sizes:
                return name
    return ""


# ---------------------------------------------------------------------------------------------- the mode
class Labels(Protocol):
    """What :class:`PythonReads` asks of the row tracer."""

    def batch_dims(self, t: torch.Tensor) -> tuple[int, ...]: ...
    def carries_batch(self, t: torch.Tensor) -> bool: ...
    def read_on_host(self, what: str) -> None: ...
    def from_size(self, out: Any, what: str) -> None: ...


# By id: the functions live as long as torch, and some (an OpOverload) hash in Python code.
_SHAPE = torch.Tensor.shape  # a getter reaches the mode as this descriptor's ``__get__``
_SIZE, _COUNT, _HOST, _BUILD = range(4)
_SPECIAL: dict[int, tuple[int, str]] = {
    id(torch.Tensor.size): (_SIZE, ""), id(torch.Tensor.numel): (_COUNT, ""), id(torch.numel): (_COUNT, ""),
    **{id(f): (_HOST, name) for f, name in ((torch.Tensor.tolist, "Tensor.tolist"),
                                            (torch.Tensor.numpy, "Tensor.numpy"),
                                            (torch.Tensor.__array__, "Tensor.__array__"))},
    **{id(f): (_BUILD, name) for f, name in ((torch.tensor, "torch.tensor"), (torch.as_tensor, "torch.as_tensor"),
                                             (torch.asarray, "torch.asarray"),
                                             (torch.Tensor.new_tensor, "Tensor.new_tensor"))},
}
_is_compiling = torch.compiler.is_compiling


class PythonReads(TorchFunctionMode):
    """Beside a row tracer: the batch's size handed out as :class:`BatchInt`, torch calls that take one, and
    host reads of batch values that run no op (module docstring). ``sizes``: the batch sizes the torch
    call running now was given (empty outside one)."""

    def __init__(self, labels: Labels) -> None:
        super().__init__()
        self.labels = labels
        self.sizes: frozenset[float] = frozenset()

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_compiling():  # dynamo traces this mode: nothing to see in a graph
            return func(*args, **kwargs)
        if getattr(func, "__self__", None) is _SHAPE:
            return self._shape(args[0], func(*args, **kwargs))
        kind, what = _SPECIAL.get(id(func), (-1, ""))
        if kind == _SIZE:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Size):
                return self._shape(args[0], out)
            return self._dim(args[0], args[1] if len(args) > 1 else kwargs.get("dim"), out)
        if kind == _COUNT:
            out = func(*args, **kwargs)
            return BatchInt(out) if type(out) is int and out >= 2 and self.labels.batch_dims(args[0]) else out
        if kind == _HOST and args and isinstance(args[0], torch.Tensor) and self.labels.carries_batch(args[0]):
            self.labels.read_on_host(what)
        found = _sizes_in(args)
        if kwargs:
            more = _sizes_in(kwargs.values())
            found = more if found is None else found | (more or set())
        if not found:
            return func(*args, **kwargs)
        outer, self.sizes = self.sizes, frozenset(found)
        try:
            out = func(*args, **kwargs)
        finally:
            self.sizes = outer
        if kind == _BUILD:
            self.labels.from_size(out, f"{what} builds a tensor from the batch size")
        return out

    def _shape(self, t: torch.Tensor, shape: torch.Size) -> Any:
        dims = self.labels.batch_dims(t)
        if not dims:
            return shape
        return BatchShape(BatchInt(n) if d in dims and type(n) is int and n >= 2 else n for d, n in enumerate(shape))

    def _dim(self, t: torch.Tensor, d: Any, n: int) -> int:
        if not isinstance(d, int) or type(n) is not int or n < 2:
            return n
        return BatchInt(n) if (d + t.dim() if d < 0 else d) in self.labels.batch_dims(t) else n
