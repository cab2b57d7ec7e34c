"""How a graph's outputs become a call's result: which leaves carry the batch, sliced views, copies.

Which outputs carry the batch, and in which dimension, comes from the row
analysis of the model's trace (:mod:`.rows`), or from ``batched_outputs``
when the caller gives it: never from sizes alone (4 hidden units in bucket 4
would look batched) and never from a run at another size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._torch_compat import pytree
from ..log import logger
from .rows import Rows

__all__ = ["OutputLayout", "flags_to_rows", "same_kinds"]


@dataclass
class OutputLayout:
    """One bucket's outputs: their tree, where each leaf carries the batch, sliced views per batch size.

    ``rows[k]`` is the :class:`~.rows.Rows` of leaf ``k`` (its batch dim and how
    many elements there belong to one row) or None for a leaf without the batch.
    """

    size: int  # the bucket
    spec: Any
    rows: tuple[Rows | None, ...]
    _views: dict[int, tuple[list[Any], Any]] = field(default_factory=dict)  # batch -> (sliced leaves, tree)

    def __post_init__(self) -> None:
        # A leaf or a flat tuple of leaves (the common outputs) is rebuilt without pytree's walk.
        n = self.spec.num_leaves
        if self.spec == pytree.tree_structure(0):
            self.rebuild: Callable[[list[Any]], Any] = lambda leaves: leaves[0]
        elif self.spec == pytree.tree_structure(tuple(range(n))):
            self.rebuild = tuple
        else:
            self.rebuild = functools.partial(_unflatten, spec=self.spec)
        self.immutable = not isinstance(self.rebuild, functools.partial)  # a cached tree cannot be mutated

    def real(self, leaves: list[Any], batch: int) -> list[Any]:
        """The leaves narrowed to the rows of a call of ``batch`` rows (views)."""
        out = []
        for o, r in zip(leaves, self.rows):
            if r is not None and batch < self.size and isinstance(o, torch.Tensor):
                o = o.narrow(r.dim, 0, batch * r.inner)
            out.append(o)
        return out

    def views(self, leaves: list[Any], batch: int) -> tuple[list[Any], Any]:
        """The sliced leaves of a graph's static outputs for ``batch`` rows and their tree (None when the
        tree is rebuilt per call), made once per batch size: the same objects every call."""
        cached = self._views.get(batch)
        if cached is None:
            cached = self._views[batch] = self._slice(leaves, batch)
        return cached

    def _slice(self, leaves: list[Any], batch: int) -> tuple[list[Any], Any]:
        sliced = self.real(leaves, batch)
        return sliced, self.rebuild(sliced) if self.immutable else None

    def result(self, leaves: list[Any], batch: int, *, copy: bool, cache: bool) -> Any:
        """The outputs of a call of ``batch`` rows: batched leaves sliced to ``batch``, copied if asked.

        ``cache`` keeps the sliced views per batch size (for a graph's static
        outputs); uncopied, a leaf or tuple result is then the same object every call.
        """
        sliced, tree = self.views(leaves, batch) if cache else self._slice(leaves, batch)
        if copy:
            return self.rebuild([o.clone() if isinstance(o, torch.Tensor) else o for o in sliced])
        return tree if tree is not None else self.rebuild(sliced)


def _unflatten(leaves: list[Any], *, spec: Any) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def flags_to_rows(flags: Sequence[bool], leaves: Sequence[Any], batch_dim: int) -> tuple[Rows | None, ...]:
    """``batched_outputs`` flags as per-leaf rows (the batch in ``batch_dim``, one element per row)."""
    if len(flags) != len(leaves):
        raise ValueError(f"batched_outputs: expected {len(leaves)} flags (one per output leaf), got {len(flags)}")
    out: list[Rows | None] = []
    for k, (f, leaf) in enumerate(zip(flags, leaves)):
        if f and not (isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim):
            raise ValueError(f"batched_outputs: output leaf {k} is flagged as carrying the batch, but it is "
                             f"{'a tensor of shape ' + str(tuple(leaf.shape)) if isinstance(leaf, torch.Tensor) else type(leaf).__name__}"
                             f" with no dim {batch_dim}; expected False for it")
        out.append(Rows(batch_dim) if f else None)
    return tuple(out)


def same_kinds(first: list[Any], static: list[Any]) -> bool:
    """Whether two output leaf lists agree in kind, shape, dtype and device (and in value, for non-tensors)."""
    if len(first) != len(static):
        return False
    for a, b in zip(first, static):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                return False
            continue
        try:
            if a != b:
                return False
        except Exception:  # a value without a plain comparison
            logger.debug("gfxgraph: output values %r and %r cannot be compared", type(a), type(b))
            return False
    return True
