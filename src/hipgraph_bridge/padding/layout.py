"""The layout of a pool call: which arguments carry the batch, and what every leaf must look like.

A call ``pool(*args, **kwargs)`` is flattened into leaves (any pytree). Each
leaf is one of three kinds:

* ``batched``: a tensor with the batch in ``batch_dim`` (all of them agree on its size ``B``);
* ``static``: a tensor named in ``static_args``, or a 0-dim tensor (copied whole); a
  tensor with dims but none at ``batch_dim`` is an error unless named there;
* ``const``: any other value, part of the graph key (it must be hashable).

The first call fixes the layout (tree structure, kinds, and per tensor its
dtype, device and shape without the batch dimension); a later call that
differs raises ``ValueError`` naming what was expected.
"""

from __future__ import annotations

import functools

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from .._torch_compat import pytree
from ..tree import describe

__all__ = ["CallLayout", "classify", "QuickPlan", "BATCHED", "STATIC", "CONST"]

BATCHED, STATIC, CONST = "batched", "static", "const"


@dataclass(frozen=True)
class CallLayout:
    """The fixed shape of a call: tree structure and, per leaf, what it is."""

    spec: Any  # (number of args, keyword names, per argument its pytree spec)
    kinds: tuple[str, ...]  # per leaf: BATCHED | STATIC | CONST
    tensor_meta: tuple[Any, ...]  # per leaf: (dtype, device, shape without the batch dim) or None
    where: tuple[str, ...]  # per leaf: human path, e.g. "args[0]" or "kwargs['mask']"

    @functools.cached_property
    def has_consts(self) -> bool:
        return CONST in self.kinds

    def check_on(self, device_type: str) -> None:
        """Every tensor leaf is on a ``device_type`` device (else ``ValueError`` naming the leaf)."""
        for path, meta in zip(self.where, self.tensor_meta):
            if meta is not None and meta[1].type != device_type:
                raise ValueError(f"{path}: expected a tensor on a {device_type.upper()} device, got one on {meta[1]}")

    def consts(self, leaves: list[Any]) -> tuple[Any, ...]:
        """The constant leaves of a call: its graph key."""
        return tuple(leaf for leaf, k in zip(leaves, self.kinds) if k == CONST)

    def rebuild(self, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The ``(args, kwargs)`` these leaves stand for."""
        nargs, kw_names, specs = self.spec
        values = []
        i = 0
        for spec in specs:
            n = spec.num_leaves
            values.append(pytree.tree_unflatten(leaves[i:i + n], spec))
            i += n
        return tuple(values[:nargs]), dict(zip(kw_names, values[nargs:]))

    def check_matches(self, got: CallLayout) -> None:
        """Raise ``ValueError`` naming the first difference between ``got`` and this layout."""
        (n_want, kw_want, specs_want), (n_got, kw_got, specs_got) = self.spec, got.spec
        if n_want != n_got or kw_want != kw_got:
            raise ValueError(f"expected {n_want} positional argument(s) and keyword arguments {list(kw_want)} "
                             f"(as at the first call), got {n_got} and {list(kw_got)}")
        names = [f"args[{i}]" for i in range(n_want)] + [f"kwargs[{k!r}]" for k in kw_want]
        for name, want, have in zip(names, specs_want, specs_got):
            if want != have:
                raise ValueError(f"{name}: expected the structure {want} (as at the first call), got {have}")
        if got.kinds != self.kinds:
            raise ValueError(f"expected the arguments {self.describe()}, got {got.describe()}")
        for path, w, g in zip(self.where, self.tensor_meta, got.tensor_meta):
            if w != g:
                raise ValueError(f"{path}: expected dtype={w[0]}, device={w[1]}, shape without the batch dim "
                                 f"{w[2]} (as captured), got dtype={g[0]}, device={g[1]}, shape {g[2]}")

    def describe(self) -> str:
        return "(" + ", ".join(f"{w}: {k}" for w, k in zip(self.where, self.kinds)) + ")"


def _leaf_kind(leaf: Any, path: str, *, static: bool, batch_dim: int) -> tuple[str, Any]:
    if not isinstance(leaf, torch.Tensor):
        try:
            hash(leaf)
        except TypeError:
            raise TypeError(f"{path}: non-tensor arguments are part of the graph key and must be "
                            f"hashable; got {type(leaf).__name__}") from None
        return CONST, None
    if static or leaf.dim() == 0:
        return STATIC, (leaf.dtype, leaf.device, tuple(leaf.shape))
    if leaf.dim() <= batch_dim:
        raise ValueError(f"{path}: expected a tensor with a batch dimension at dim {batch_dim}, got shape "
                         f"{tuple(leaf.shape)}; name it in static_args if it has no batch dimension")
    shape = tuple(leaf.shape)
    return BATCHED, (leaf.dtype, leaf.device, shape[:batch_dim] + shape[batch_dim + 1:])


def classify(args: tuple[Any, ...], kwargs: dict[str, Any], *, batch_dim: int,
             static_args: Collection[int | str]) -> tuple[list[Any], CallLayout, int]:
    """Flatten a call; return (leaves, layout, batch size B).

    Raises:
        TypeError: no batched tensor, or an unhashable non-tensor leaf.
        ValueError: batched tensors disagree on the batch size, or it is 0.
    """
    flat: list[Any] = []
    kinds: list[str] = []
    metas: list[Any] = []
    where: list[str] = []
    specs = []
    batch, first = -1, ""
    for name, value in [*enumerate(args), *kwargs.items()]:
        label = f"args[{name}]" if isinstance(name, int) else f"kwargs[{name!r}]"
        leaves, spec = pytree.tree_flatten(value)
        specs.append(spec)
        for k, leaf in enumerate(leaves):
            path = label if len(leaves) == 1 else f"{label} leaf {k}"
            kind, meta = _leaf_kind(leaf, path, static=name in static_args, batch_dim=batch_dim)
            if kind == BATCHED:
                n = leaf.shape[batch_dim]
                if batch < 0:
                    batch, first = n, path
                elif n != batch:
                    raise ValueError(f"{path}: expected batch size {batch} in dim {batch_dim} (as {first}), "
                                     f"got {n}; name tensors without a batch dimension in static_args")
            flat.append(leaf)
            kinds.append(kind)
            metas.append(meta)
            where.append(path)
    unknown = sorted((s for s in static_args if s not in kwargs and not (isinstance(s, int) and s < len(args))),
                     key=str)
    if unknown:
        raise ValueError(f"static_args: {unknown} name no argument of this call; expected positions below "
                         f"{len(args)} or keywords among {sorted(kwargs)}")
    if batch < 0:
        given = ", ".join([*(describe(a) for a in args), *(f"{k}={describe(v)}" for k, v in kwargs.items())])
        raise TypeError(f"expected at least one tensor argument with a batch dimension (dim {batch_dim}); "
                        f"got ({given})")
    if batch == 0:
        raise ValueError(f"{first}: empty batch: expected batch size >= 1 in dim {batch_dim}, got 0")
    layout = CallLayout((len(args), tuple(kwargs), tuple(specs)), tuple(kinds), tuple(metas), tuple(where))
    return flat, layout, batch


class QuickPlan:
    """The hot path's flattening, for a layout of plain positional arguments (one leaf each).

    :meth:`match` checks each argument against the layout without building
    one; None sends the call down :func:`classify`, which also words the errors.
    A batched argument's shapes seen before are answered from a small table
    (shape -> batch size): slicing a ``torch.Size`` costs more than the rest
    of the check.
    """

    _SHAPES = 4096  # at most this many shapes remembered per argument (one per batch size in practice)

    def __init__(self, layout: CallLayout, leaves: list[Any], batch_dim: int) -> None:
        self.batch_dim = batch_dim
        self.plan: list[tuple[str, Any, Any, Any, dict[Any, int]]] = []
        for k, m, leaf in zip(layout.kinds, layout.tensor_meta, leaves):
            if k == CONST:
                self.plan.append((k, type(leaf), None, None, {}))
            else:
                self.plan.append((k, m[0], m[1], m[2], {}))

    @staticmethod
    def applies(layout: CallLayout) -> bool:
        nargs, kw_names, specs = layout.spec
        return not kw_names and all(spec.is_leaf() for spec in specs)

    def match(self, args: tuple[Any, ...]) -> tuple[list[Any], int] | None:
        plan = self.plan
        if len(args) != len(plan):
            return None
        batch = -1
        for a, (kind, dtype, device, rest, seen) in zip(args, plan):
            if kind == CONST:
                if type(a) is not dtype:  # the exact type: a tuple, None or a tensor takes the full path
                    return None
                try:
                    hash(a)
                except TypeError:
                    return None
                continue
            if not isinstance(a, torch.Tensor) or a.dtype != dtype or a.device != device or a.requires_grad:
                return None
            shape = a.shape
            if kind == STATIC:
                if shape != rest:
                    return None
                continue
            n = seen.get(shape)
            if n is None:
                n = self._batch(shape, rest)
                if n is None:
                    return None
                if len(seen) < self._SHAPES:
                    seen[shape] = n
            if batch < 0:
                batch = n
            elif n != batch:
                return None
        return (list(args), batch) if batch >= 1 else None

    def _batch(self, shape: torch.Size, rest: Any) -> int | None:
        bd = self.batch_dim
        if len(shape) <= bd or shape[:bd] + shape[bd + 1:] != rest:
            return None
        return int(shape[bd])
