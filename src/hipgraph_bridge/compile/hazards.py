"""Ops that make padding along the token dimension change a piece's real rows.

Padding rows onto a piece is harmless while every row of every output
depends only on the same row of the inputs: linear layers, norms over the
hidden dimension, MLPs, rotary embeddings from given positions. An op that
reduces, scans, sorts, shifts, concatenates, contracts or scatters *along*
a dimension that carries the token count mixes the padding rows into the
real ones (a mean over the sequence, a softmax over it outside attention, a
cumsum, ``x[:, -1]``), and so does a reshape that splits that dimension.
:func:`padding_hazard` reads a piece's FX graph for such ops; a piece that
has one runs without padding (:mod:`.pieces`). It is a guard, not a proof:
the first padded call of every bucket is still compared with an unpadded run.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from .._torch_compat import sym_expr

__all__ = ["padding_hazard"]

# name -> (position of the dim argument, default when absent; None: every dim)
_ALONG_DIM: dict[str, tuple[int, int | None]] = {
    **{n: (1, None) for n in (
        "sum", "mean", "nansum", "nanmean", "prod", "amax", "amin", "std", "var", "std_mean", "var_mean",
        "logsumexp", "argmax", "argmin", "any", "all", "count_nonzero", "median", "nanmedian", "aminmax",
        "softmax", "log_softmax", "softmin", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
        "flip", "select", "narrow", "unbind_copy", "max", "min")},
    **{n: (1, -1) for n in ("sort", "argsort", "mode", "glu")},
    **{n: (2, -1) for n in ("topk", "kthvalue", "diff")},
    **{n: (2, None) for n in ("norm", "vector_norm", "quantile", "nanquantile", "roll", "repeat_interleave")},
    **{n: (2, 0) for n in ("split", "chunk", "tensor_split", "split_with_sizes")},
    "unbind": (1, 0), "msort": (1, 0), "normalize": (2, 1),
}
_CONCAT = frozenset({"cat", "concat", "concatenate"})
_CONTRACT = frozenset({"linear", "matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "__matmul__", "tensordot", "dot",
                       "vdot", "inner", "kron", "chain_matmul", "bilinear"})
_SCATTER = frozenset({"scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_put",
                      "index_fill", "index_reduce", "put", "masked_scatter", "embedding_bag", "bincount", "histc",
                      "nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"})
_WINDOWED = ("conv", "avg_pool", "max_pool", "adaptive_", "lp_pool", "interpolate", "upsample", "pixel_",
             "unfold", "fold", "fft", "ifft", "rfft", "irfft", "stft", "cross_entropy", "nll_loss")
_VIEWS = frozenset({"view", "reshape", "unflatten", "_unsafe_view", "view_as", "reshape_as"})


def _name(node: fx.Node) -> str:
    raw = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    raw = raw if isinstance(raw, str) else ""
    if raw.endswith("_") and not raw.endswith("__"):
        raw = raw[:-1]  # in-place twins behave the same along a dim
    return raw


def _value(a: Any) -> Any:
    return a.meta.get("example_value") if isinstance(a, fx.Node) else a


def _carrying(t: Any, symbol: Any) -> set[int]:
    """Dims of ``t`` whose size involves ``symbol``."""
    if not isinstance(t, torch.Tensor):
        return set()
    return {d for d, s in enumerate(t.shape) if (e := sym_expr(s)) is not None and symbol in e.free_symbols}


def _dims(node: fx.Node, pos: int, default: int | None, rank: int) -> set[int] | None:
    """The dims an op works along (None: every dim)."""
    d: Any = node.kwargs.get("dim", node.kwargs.get("dims", node.kwargs.get("axis", ...)))
    if d is ...:
        d = node.args[pos] if len(node.args) > pos else default
    if d is None:
        return None
    items = d if isinstance(d, (list, tuple)) else (d,)
    if not all(isinstance(x, int) for x in items):
        return None  # a dim given by a tensor or symbol: assume the worst
    return {x % rank if rank else 0 for x in items}


def _tensor_args(node: fx.Node) -> Iterator[Any]:
    for a in (*node.args, *node.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            v = _value(x)
            if isinstance(v, torch.Tensor):
                yield v


def _getitem_hazard(node: fx.Node, symbol: Any) -> bool:
    """``x[...]`` with an int or a bounded slice on a dim that carries the token count."""
    base, index = _value(node.args[0]), node.args[1]
    carrying = _carrying(base, symbol)
    if not carrying:
        return False
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        at = items.index(Ellipsis)
        consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:at] + [slice(None)] * (base.dim() - consumed) + items[at + 1:]
    dim = 0
    for item in items:
        if item is None:
            continue
        if dim in carrying:
            tensor_index = isinstance(_value(item), torch.Tensor)
            stop_only = isinstance(item, slice) and item.start is None and item.step is None \
                and (item.stop is None or isinstance(item.stop, fx.Node))
            if not (tensor_index or stop_only):  # x[:, :n] keeps the rows; x[:, -1], x[:, 1:] do not
                return True
        dim += 1
    return False


def _row_preserving(e: Any, symbol: Any) -> bool:
    """``s``, ``4*s`` or ``s*b``: whole token rows, possibly merged with other dims; not ``s/2`` or ``s + 1``."""
    if e == symbol:
        return True
    if not e.is_Mul:
        return False
    coeff, rest = e.as_coeff_Mul()
    powers = rest.as_powers_dict()
    return bool(coeff.is_integer and coeff > 0 and powers.get(symbol) == 1 and all(f.is_Symbol for f in powers))


def _view_hazard(node: fx.Node, symbol: Any) -> bool:
    """A reshape that splits the token dimension (``s/2`` rows of pairs) mixes neighbouring rows."""
    out = _value(node)
    if not isinstance(out, torch.Tensor):
        return False
    for s in out.shape:
        e = sym_expr(s)
        if e is not None and symbol in e.free_symbols and not _row_preserving(e, symbol):
            return True
    return False


def _node_hazard(node: fx.Node, symbol: Any) -> bool:
    name = _name(node)
    first = _value(node.args[0]) if node.args else None
    carrying = _carrying(first, symbol)
    if node.target is operator.getitem:
        return isinstance(first, torch.Tensor) and _getitem_hazard(node, symbol)
    if name in _VIEWS:
        return _view_hazard(node, symbol)
    if name in _CONCAT:
        tensors = [t for t in (_value(x) for x in (node.args[0] if node.args else ())) if isinstance(t, torch.Tensor)]
        dims = _dims(node, 1, 0, tensors[0].dim() if tensors else 0)
        return any(dims is None or dims & _carrying(t, symbol) for t in tensors)
    if name in _ALONG_DIM and carrying:
        if name in ("max", "min") and len(node.args) > 1 and isinstance(_value(node.args[1]), torch.Tensor):
            return False  # elementwise max/min of two tensors
        dims = _dims(node, *_ALONG_DIM[name], first.dim())
        return dims is None or bool(dims & carrying)
    if name in ("layer_norm", "rms_norm") and carrying:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape", ())
        k = len(shape) if isinstance(shape, (list, tuple)) else 1
        return bool(carrying & set(range(first.dim() - k, first.dim())))
    if name in ("group_norm", "instance_norm", "local_response_norm", "batch_norm") and carrying:
        training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
        return name != "batch_norm" or training is not False
    if name in _CONTRACT or name == "einsum":
        return any(_carrying(t, symbol) for t in _tensor_args(node)) and _contracts(node, name, symbol)
    if name in _SCATTER or name.startswith(_WINDOWED) or name.endswith("_loss") or name == "pad":
        return any(_carrying(t, symbol) for t in _tensor_args(node))
    return False


def _contracts(node: fx.Node, name: str, symbol: Any) -> bool:
    """Whether a matmul-like op sums over a dim that carries the token count."""
    if name == "einsum" and isinstance(node.args[0], str):
        eq = node.args[0].replace(" ", "")
        ins, _, out = eq.partition("->")
        operands = [_value(x) for x in (node.args[1] if len(node.args) == 2 and isinstance(node.args[1],
                                                                                     (list, tuple)) else node.args[1:])]
        for letters, t in zip(ins.split(","), operands):
            if "." in letters or not isinstance(t, torch.Tensor):
                return True
            if any(letter not in out for d, letter in enumerate(letters) if d in _carrying(t, symbol)):
                return True
        return False
    if name == "linear":
        a = _value(node.args[0])
        return isinstance(a, torch.Tensor) and a.dim() - 1 in _carrying(a, symbol)
    if name in ("matmul", "mm", "bmm", "__matmul__"):
        a, b = (_value(x) for x in node.args[:2])
        return (isinstance(a, torch.Tensor) and a.dim() - 1 in _carrying(a, symbol)) or \
            (isinstance(b, torch.Tensor) and b.dim() >= 2 and b.dim() - 2 in _carrying(b, symbol))
    return True


def padding_hazard(gm: fx.GraphModule, symbol: Any) -> str | None:
    """The first op of ``gm`` that mixes rows along a dim carrying ``symbol``, described; None if none is found."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if _node_hazard(node, symbol):
            return (f"{node.format_node()} works along a dimension that carries the token count {symbol}, "
                    "so padding rows would change the real ones")
    return None
