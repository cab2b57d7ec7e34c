"""``torch.ops.gfxgraph.*``: custom ops that trace under ``torch.compile(fullgraph=True)``.

``gfxgraph::conditional_select(Tensor pred, Tensor a, Tensor b) -> Tensor``
returns a new tensor equal to ``a`` when the one-element ``pred`` is true and
to ``b`` otherwise. It never reads ``pred`` on the host: the choice is made by
an elementwise select on the device, so it is capture-safe and makes no sync
(a branch-free alternative to ``if pred.item():`` in captured code). Both
``a`` and ``b`` are computed by the caller; for work that should not run at
all, use :class:`~hipgraph_bridge.ConditionalGraph`.

Kernels: CPU and CUDA (the same select), a fake kernel for tracing (shape and
dtype of ``a``), and autograd (the gradient flows to the selected input).
Registered when this module is imported (``import hipgraph_bridge`` does it).
"""

from __future__ import annotations

import torch

__all__ = ["conditional_select", "OP_NAME"]

OP_NAME = "gfxgraph::conditional_select"
_SCHEMA = "(Tensor pred, Tensor a, Tensor b) -> Tensor"


def _check(pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if pred.dtype != torch.bool:
        raise TypeError(f"conditional_select: pred: expected a bool tensor, got {pred.dtype}")
    if pred.numel() != 1:
        raise ValueError(f"conditional_select: pred: expected one element, got shape {tuple(pred.shape)}")
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"conditional_select: expected a and b of one shape and dtype, got "
                         f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"conditional_select: expected a and b on one device, got {a.device} and {b.device}")
    if pred.device != a.device and pred.device.type != "cpu":
        raise ValueError(f"conditional_select: pred: expected a tensor on {a.device} (or a CPU scalar), "
                         f"got {pred.device}")


def _select(pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(pred, a, b)
    # where() broadcasts the 0-dim predicate on the device: no host read, a new tensor (never an alias).
    return torch.where(pred.reshape(()).to(a.device, non_blocking=True), a, b)


def _fake(pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check(pred, a, b)
    return torch.empty_like(a)


def _setup_context(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])  # type: ignore[attr-defined]


def _backward(ctx: object, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
    (pred,) = ctx.saved_tensors  # type: ignore[attr-defined]
    zero = torch.zeros_like(grad)
    take_a = pred.reshape(()).to(grad.device)
    return None, torch.where(take_a, grad, zero), torch.where(take_a, zero, grad)


def _register() -> None:
    if hasattr(torch.ops, "gfxgraph") and hasattr(torch.ops.gfxgraph, "conditional_select"):
        return  # already registered in this process (a reloaded module)
    torch.library.define(OP_NAME, _SCHEMA)
    torch.library.impl(OP_NAME, "cpu")(_select)
    torch.library.impl(OP_NAME, "cuda")(_select)
    torch.library.register_fake(OP_NAME)(_fake)
    torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context)


_register()


def conditional_select(pred: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` if ``pred`` else ``b``, decided on the device (see the module docstring)."""
    return torch.ops.gfxgraph.conditional_select(pred, a, b)
