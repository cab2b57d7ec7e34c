"""Pytree helpers for graph inputs and outputs (static buffers, copies, checks)."""

from __future__ import annotations

from typing import Any

import torch

from ._torch_compat import pytree

__all__ = ["clone_tree", "copy_into", "describe", "check_same_layout"]


def clone_tree(tree: Any) -> Any:
    """Clone every tensor leaf (other leaves are kept)."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def describe(x: object) -> str:
    """What ``x`` is, for "expected X, got Y" messages (a tuple shows what it holds)."""
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(describe(v) for v in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"{type(x).__name__} of ({inner})"
    return type(x).__name__


def check_same_layout(name: str, expected: Any, got: Any) -> None:
    """Raise TypeError/ValueError unless ``got`` has ``expected``'s structure, shapes, dtypes, devices."""
    e_leaves, e_spec = pytree.tree_flatten(expected)
    g_leaves, g_spec = pytree.tree_flatten(got)
    if e_spec != g_spec:
        raise TypeError(f"{name}: expected the structure {e_spec}, got {g_spec}")
    for i, (e, g) in enumerate(zip(e_leaves, g_leaves)):
        where = name if len(e_leaves) == 1 else f"{name} leaf {i}"
        if isinstance(e, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"{where}: expected {describe(e)}, got {describe(g)}")
            if g.shape != e.shape or g.dtype != e.dtype or g.device != e.device:
                raise ValueError(f"{where}: expected {describe(e)}, got {describe(g)}")
        elif e != g:
            raise ValueError(f"{where}: expected {e!r} (captured value), got {g!r}")


def copy_into(static: Any, new: Any) -> None:
    """Copy every tensor leaf of ``new`` into the matching leaf of ``static`` (same layout)."""
    for s, n in zip(pytree.tree_leaves(static), pytree.tree_leaves(new)):
        if isinstance(s, torch.Tensor) and s is not n:
            s.copy_(n)
