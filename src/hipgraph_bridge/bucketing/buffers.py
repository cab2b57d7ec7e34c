"""The static input buffers every bucket's graph reads: allocated once, at the largest bucket.

Batched tensors get one buffer with the largest bucket's rows in
``batch_dim``; bucket ``b`` reads the view of its first ``b`` rows. A call of
``B`` rows copies its tensors into rows ``[0, B)``. Rows ``[B, b)`` (the
padding) start as ``pad_value`` and then hold whatever earlier, larger calls
left there: refilling them costs a kernel launch per buffer and call, and a
model whose rows do not interact cannot tell. Whether a model's rows interact
is checked with :data:`PAD_ROWS` staging (see :mod:`.padding`); a model that
needs clean padding gets :data:`PAD_FILL` on every call. Static tensors get a
buffer of their own shape.
"""

from __future__ import annotations

from typing import Any

import torch

from .buckets import BucketTable
from .layout import BATCHED, STATIC, CallLayout

__all__ = ["StaticInputs", "PAD_KEEP", "PAD_FILL", "PAD_ROWS"]

# What a call's staging does with its bucket's padding rows:
PAD_KEEP = 0  # leave them as earlier calls left them (the hot path: no kernel)
PAD_FILL = 1  # fill them with pad_value
PAD_ROWS = 2  # fill them with copies of the call's own rows: the padding check's worst case


class StaticInputs:
    """Static buffers for one fixed call layout (see the module docstring).

    Cost per call (:meth:`stage`): one copy per tensor argument (none for a
    tensor that already is the buffer's view, as with :meth:`views`), plus one
    fill per padded buffer with :data:`PAD_FILL`; the views are cached per batch size.
    """

    def __init__(self, layout: CallLayout, leaves: list[Any], table: BucketTable, *, batch_dim: int,
                 pad_value: float | int | bool | None) -> None:
        self.layout = layout
        self.batch_dim = batch_dim
        self.pad_value = pad_value
        self._table = table
        bufs: list[Any] = []
        for leaf, kind in zip(leaves, layout.kinds):
            if kind == BATCHED:
                shape = list(leaf.shape)
                shape[batch_dim] = table.largest
                fill = 0 if pad_value is None else pad_value
                bufs.append(torch.full(shape, fill, dtype=leaf.dtype, device=leaf.device))
            elif kind == STATIC:
                bufs.append(leaf.clone())
            else:
                bufs.append(None)
        self.buffers = bufs  # per leaf: its static buffer, or None for constants
        self._plans: dict[int, list[tuple[torch.Tensor, int, torch.Tensor | None]]] = {}

    def _plan(self, batch: int) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
        """(destination view, leaf index, padding view) per tensor, for a batch of ``batch`` rows."""
        plan = self._plans.get(batch)
        if plan is None:
            bucket, bd = self._table[batch], self.batch_dim
            plan = []
            for i, (kind, buf) in enumerate(zip(self.layout.kinds, self.buffers)):
                if kind == BATCHED:
                    pad = buf.narrow(bd, batch, bucket - batch) if bucket > batch else None
                    plan.append((buf.narrow(bd, 0, batch), i, pad))
                elif kind == STATIC:
                    plan.append((buf, i, None))
            self._plans[batch] = plan
        return plan

    def stage(self, leaves: list[Any], batch: int, pad: int = PAD_KEEP) -> None:
        """Copy a call's tensors in; ``pad`` says what the bucket's rows beyond ``batch`` get."""
        for dst, i, rows in self._plan(batch):
            src = leaves[i]
            if src is not dst:
                dst.copy_(src)
            if rows is None or pad == PAD_KEEP:
                continue
            if pad == PAD_FILL and self.pad_value is not None:
                rows.fill_(self.pad_value)
            elif pad == PAD_ROWS:
                bd, n = self.batch_dim, rows.shape[self.batch_dim]
                rows.copy_(dst.index_select(bd, torch.arange(n, device=dst.device) % batch))

    def views(self, batch: int) -> list[Any]:
        """Per leaf, the buffer view a call of ``batch`` rows reads (None for constants).

        A leaf that is this view is not copied by :meth:`stage`: writing into
        these views is the zero-copy way to give a bucket its inputs.
        """
        views: list[Any] = [None] * len(self.buffers)
        for dst, i, _ in self._plan(batch):
            views[i] = dst
        return views

    def bucket_args(self, bucket: int, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The model's arguments at bucket ``bucket``: buffer views, plus this call's constants."""
        bd = self.batch_dim
        out = []
        for kind, buf, leaf in zip(self.layout.kinds, self.buffers, leaves):
            if kind == BATCHED:
                out.append(buf.narrow(bd, 0, bucket))
            elif kind == STATIC:
                out.append(buf)
            else:
                out.append(leaf)
        return self.layout.rebuild(out)

    def fill_example(self, leaves: list[Any], batch: int) -> None:
        """Put example data in every row of the buffers (its rows repeated)."""
        bd, rows = self.batch_dim, self._table.largest
        for kind, buf, leaf in zip(self.layout.kinds, self.buffers, leaves):
            if kind == BATCHED:
                reps = -(-rows // batch)
                tiled = leaf.repeat(*[reps if d == bd else 1 for d in range(leaf.dim())])
                buf.copy_(tiled.narrow(bd, 0, rows))
            elif kind == STATIC and buf is not leaf:
                buf.copy_(leaf)
