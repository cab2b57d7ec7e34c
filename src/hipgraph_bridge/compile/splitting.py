"""Where the piecewise backend cuts a dynamo graph: the splitting ops, by name, and the split.

A splitting op runs eagerly, on the call's real shapes; the pieces between
splitting ops are graphed per token-count bucket (:mod:`.piecewise`). The
default splitting ops are PyTorch's scaled-dot-product attention, at the
level dynamo records it (``torch.nn.functional.scaled_dot_product_attention``)
and as the aten ops a model may call directly (flash, memory-efficient,
cuDNN, math, ...). ``options={"splitting_ops": [...]}`` adds more:

=====================================  ===================================================
form                                   example
=====================================  ===================================================
``ns::op`` or ``ns::op.overload``      ``"aten::_scaled_dot_product_flash_attention"``
``torch.ops.ns.op[.overload]``         ``"torch.ops.mylib.attn"`` (a ``torch.library`` op)
a dotted path to a function            ``"torch.nn.functional.scaled_dot_product_attention"``
the op or function object              ``torch.ops.mylib.attn.default``
=====================================  ===================================================

An op named without an overload matches all of its overloads. Names are
resolved when the options are read, so a typo is a :class:`ConfigError`
rather than a split that silently never happens. The split itself is
torch.fx's own :func:`~torch.fx.passes.split_module.split_module`, nodes kept
in their original order (in-place ops stay where they were).
"""

from __future__ import annotations

import importlib
import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from .._torch_compat import op_name, op_packet, resolve_op
from ..errors import ConfigError

__all__ = ["DEFAULT_SPLITTING_OPS", "parse_splitting_ops", "SplittingOps", "Part", "split_graph", "tuple_output",
           "structure_key"]

DEFAULT_SPLITTING_OPS: tuple[str, ...] = (
    "torch.nn.functional.scaled_dot_product_attention",
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_scaled_dot_product_attention_math",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
)

_EXPECTED = ("expected torch op names such as 'aten::_scaled_dot_product_flash_attention', "
             "'torch.ops.mylib.attn' or 'torch.nn.functional.scaled_dot_product_attention', or the op objects")
_OP_NAME = re.compile(r"^(\w+)::(\w+)(?:\.(\w+))?$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")


def _canonical(value: Any) -> str:
    """The canonical name of one entry (``ns::op[.overload]`` or a dotted path), or ConfigError."""
    if isinstance(value, str):
        name = value.strip()
        if name.startswith("torch.ops."):
            parts = name[len("torch.ops."):].split(".")
            if len(parts) in (2, 3) and all(re.fullmatch(r"\w+", p) for p in parts):
                return f"{parts[0]}::{'.'.join(parts[1:])}"
        elif _OP_NAME.match(name) or _DOTTED.match(name):
            return name
        raise ConfigError(f"options['splitting_ops']: {value!r} is not an op name; {_EXPECTED}")
    qualified = op_name(value)
    if qualified is not None:
        return qualified
    module, qual = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if callable(value) and module and qual and _resolve(f"{module}.{qual}") is value:
        return f"{module}.{qual}"
    raise ConfigError(f"options['splitting_ops']: {value!r} ({type(value).__name__}) cannot be named; {_EXPECTED}")


def _resolve(name: str) -> Any:
    """The op or function a canonical name stands for (None: nothing by that name)."""
    m = _OP_NAME.match(name)
    if m is not None:
        return resolve_op([p for p in m.groups() if p is not None])
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj if callable(obj) else None
    return None


def parse_splitting_ops(value: Any) -> tuple[str, ...]:
    """Canonical names of the user's splitting ops (checked to resolve), de-duplicated, in order."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"options['splitting_ops']: expected a list of op names, got {value!r}; {_EXPECTED}")
    names: list[str] = []
    for v in value:
        name = _canonical(v)
        if _resolve(name) is None:
            raise ConfigError(f"options['splitting_ops']: {v!r} names no registered torch op or importable "
                              f"function (register a torch.library op before torch.compile runs); {_EXPECTED}")
        names.append(name)
    return tuple(dict.fromkeys(names))


class SplittingOps:
    """Which FX nodes are splitting ops: the defaults (those this torch has) plus ``extra``."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self.names = tuple(dict.fromkeys((*DEFAULT_SPLITTING_OPS, *extra)))
        self._targets = {t for t in (_resolve(n) for n in self.names) if t is not None}

    def matches(self, node: fx.Node) -> bool:
        """Whether ``node`` calls a splitting op (an overload of a named op included)."""
        if node.op != "call_function":
            return False
        t = node.target
        try:
            return t in self._targets or op_packet(t) in self._targets
        except TypeError:  # an unhashable target is no op of ours
            return False


@dataclass(frozen=True)
class Part:
    """One submodule of the split graph: a piece to graph, or a splitting op to run eagerly."""

    name: str  # its attribute on the split module ("submod_3")
    index: int
    splitting: bool
    module: fx.GraphModule


def split_graph(gm: fx.GraphModule, ops: SplittingOps) -> tuple[fx.GraphModule, list[Part]]:
    """Cut ``gm`` before and after every splitting op (with the ``getitem``\\ s of its tuple output).

    Returns the split module, which calls one submodule per part in order,
    and the parts. Each piece returns a tuple (a single output is wrapped),
    so every compiler accepts it; its caller unwraps it (see :class:`.pieces.Piece`).
    """
    assign: dict[fx.Node, int] = {}
    splitting: set[int] = set()
    pid = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if ops.matches(node):
            pid += 1
            assign[node] = pid
            splitting.add(pid)
            pid += 1
        elif node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and assign.get(node.args[0]) in splitting:
            assign[node] = assign[node.args[0]]
        else:
            assign[node] = pid
    split = split_module(gm, None, lambda n: assign[n], keep_original_order=True)
    parts = []
    for name, module in split.named_children():
        index = int(name.removeprefix("submod_"))
        parts.append(Part(name, index, index in splitting, module))
    parts.sort(key=lambda p: p.index)
    return split, parts


def tuple_output(module: fx.GraphModule) -> bool:
    """Make ``module`` return a tuple; True when it returned a single value (now wrapped)."""
    out = next(n for n in reversed(module.graph.nodes) if n.op == "output")
    if isinstance(out.args[0], (tuple, list)):
        return False
    out.args = ((out.args[0],),)
    module.recompile()
    return True


def structure_key(module: fx.GraphModule) -> Any:
    """A key equal for pieces with the same code over inputs of the same kinds (a model's layers);
    None when a piece holds something that makes sharing its compilation unsafe."""
    index: dict[fx.Node, int] = {}

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        hash(a)
        return a

    parts: list[Any] = []
    try:
        for node in module.graph.nodes:
            index[node] = len(index)
            if node.op in ("get_attr", "call_module"):
                return None
            if node.op == "placeholder":
                v = node.meta.get("example_value")
                if isinstance(v, torch.Tensor):
                    parts.append(("in", type(v).__name__, v.dtype, str(v.device), str(tuple(v.shape)),
                                  str(v.stride()), v.requires_grad))
                else:
                    parts.append(("in", str(v)))
                continue
            parts.append((node.op, node.target, arg(node.args), arg(node.kwargs)))
    except TypeError:  # an unhashable constant
        return None
    return tuple(parts)
