"""The static input buffers every bucket's graph reads: allocated once, at the largest bucket.

Batched tensors get one buffer with the largest bucket's rows in
``batch_dim``; bucket ``b`` reads the view of its first ``b`` rows. A call of
``B`` rows copies its tensors into rows ``[0, B)``; rows ``[B, b)`` (the
padding) always hold ``pad_value`` when the graph reads them. They are
filled only when an earlier, larger call left real rows there: the buffers
remember how far real rows may reach, so a stream of calls of one batch size
(a decode loop) pays the fill once, not per call as a hand-written loop that
pads does. Static tensors get a buffer of their own shape.
"""

from __future__ import annotations

from typing import Any

import torch

from .._torch_compat import tensor_version
from .buckets import BucketTable
from .layout import BATCHED, STATIC, CallLayout

__all__ = ["StaticInputs"]


class StaticInputs:
    """Static buffers for one fixed call layout (see the module docstring).

    Cost per call (:meth:`stage`): one copy per tensor argument (none for a
    tensor that already is the buffer's view, as with :meth:`views`), plus one
    fill per padded buffer when an earlier call left real rows in the padding;
    the views are cached per batch size.
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
        # rows [0, dirty) of the batched buffers may hold real rows; every row beyond holds pad_value
        self.dirty = 0
        self.mutated = False  # the model writes its own inputs: any row may change, so every padded call fills
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

    def stage(self, leaves: list[Any], batch: int) -> None:
        """Copy a call's tensors in; fill its bucket's padding rows if real rows may be there.

        A padded call fills rows ``[batch, dirty)`` in one kernel per buffer
        (beyond its bucket too, so later smaller calls find them clean).
        """
        dirty, bd = self.dirty, self.batch_dim
        fill = dirty > batch and self.pad_value is not None
        for dst, i, pad in self._plan(batch):
            src = leaves[i]
            if src is not dst:
                dst.copy_(src)
            if fill and pad is not None:
                self.buffers[i].narrow(bd, batch, dirty - batch).fill_(self.pad_value)
        self.note_written(batch)

    def note_written(self, batch: int) -> None:
        """Rows ``[0, batch)`` now hold a call's data and its bucket's padding holds ``pad_value``."""
        if self.mutated:
            self.dirty = self._table.largest
        elif batch == self._table[batch] and self.pad_value is not None:
            self.dirty = max(self.dirty, batch)  # nothing was filled: rows beyond stay as they were
        else:
            self.dirty = batch

    def versions(self) -> tuple[int, ...]:
        """The buffers' version counters: they move when the model writes its inputs in place."""
        return tuple(tensor_version(b) for b in self.buffers if b is not None)

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
                self.dirty = rows
            elif kind == STATIC and buf is not leaf:
                buf.copy_(leaf)
