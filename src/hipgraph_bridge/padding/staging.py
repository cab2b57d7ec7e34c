"""Static input buffers: allocated once at the largest bucket, each bucket's graph reading a view of them.

A call of ``n`` rows copies its tensors into rows ``[0, n)``; rows ``[n, b)``
of bucket ``b`` are the padding. ``pad_value`` is the value padding rows are
filled with, and a :class:`FillPolicy` says when:

* ``ALWAYS``: the padding rows hold ``pad_value`` whenever a graph reads them.
  They are refilled only when an earlier, larger call left real rows there
  (the buffers remember how far real rows may reach), so a stream of one
  batch size (a decode loop) pays the fill once, not per call.
* ``ONCE``: filled when the buffer is made; afterwards a padding row holds
  ``pad_value`` or a row of an earlier call. No fill kernel per call. Used
  where rows are proven independent and a stale row is a valid input (the
  piecewise pieces: a token id of an earlier call is still a token id).

Two geometries, one vocabulary: :class:`StaticInputs` holds a pool call's
buffers (the batch in ``batch_dim``), :class:`Arena` a piecewise piece's
inputs (strided views, whose strides may depend on the bucket, of one
allocation sized for the largest bucket). :func:`poison_values` and
:class:`PadRegion` are what the padding check fills the padding rows with.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..graph.buckets import BucketTable
from .layout import BATCHED, STATIC, CallLayout

__all__ = ["FillPolicy", "StaticInputs", "Arena", "PadRegion", "poison_values", "span"]


class FillPolicy(enum.Enum):
    ALWAYS = "always"
    ONCE = "once"


class StaticInputs:
    """Static buffers for one fixed call layout (see the module docstring).

    Cost per call (:meth:`stage`): one copy per tensor argument (none for a
    tensor that already is the buffer's view, as with :meth:`views`), plus,
    under ``ALWAYS``, one fill per padded buffer when an earlier call left
    real rows in the padding; the views are cached per batch size.
    """

    def __init__(self, layout: CallLayout, leaves: list[Any], table: BucketTable, *, batch_dim: int,
                 pad_value: float | int | bool | None, policy: FillPolicy = FillPolicy.ALWAYS) -> None:
        self.layout = layout
        self.batch_dim = batch_dim
        self.pad_value = 0 if pad_value is None else pad_value
        self.policy = FillPolicy.ONCE if pad_value is None else policy
        self._table = table
        bufs: list[Any] = []
        for leaf, kind in zip(leaves, layout.kinds):
            if kind == BATCHED:
                shape = list(leaf.shape)
                shape[batch_dim] = table.largest
                bufs.append(torch.full(shape, self.pad_value, dtype=leaf.dtype, device=leaf.device))
            elif kind == STATIC:
                bufs.append(leaf.clone())
            else:
                bufs.append(None)
        self.buffers = bufs  # per leaf: its static buffer, or None for constants
        # rows [0, dirty) of the batched buffers may hold real rows; every row beyond holds pad_value
        self.dirty = 0
        self._plans: dict[tuple[int, int], list[tuple[torch.Tensor, int, torch.Tensor | None]]] = {}

    def batched_buffers(self) -> list[torch.Tensor]:
        return [b for b, k in zip(self.buffers, self.layout.kinds) if k == BATCHED]

    def plan(self, batch: int, bucket: int) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
        """(destination view, leaf index, padding view) per tensor, for ``batch`` rows in ``bucket``."""
        plan = self._plans.get((batch, bucket))
        if plan is None:
            bd = self.batch_dim
            plan = []
            for i, (kind, buf) in enumerate(zip(self.layout.kinds, self.buffers)):
                if kind == BATCHED:
                    pad = buf.narrow(bd, batch, bucket - batch) if bucket > batch else None
                    plan.append((buf.narrow(bd, 0, batch), i, pad))
                elif kind == STATIC:
                    plan.append((buf, i, None))
            self._plans[(batch, bucket)] = plan
        return plan

    def stage(self, leaves: list[Any], batch: int, bucket: int) -> None:
        """Copy a call's tensors in; under ``ALWAYS`` fill rows real rows of earlier calls left in its padding.

        A padded call fills rows ``[batch, dirty)`` in one kernel per buffer
        (beyond its bucket too, so later smaller calls find them clean).
        """
        dirty, bd = self.dirty, self.batch_dim
        fill = dirty > batch and self.policy is FillPolicy.ALWAYS
        for dst, i, pad in self.plan(batch, bucket):
            src = leaves[i]
            if src is not dst:
                dst.copy_(src)
            if fill and pad is not None:
                self.buffers[i].narrow(bd, batch, dirty - batch).fill_(self.pad_value)
        self.note_written(batch, bucket)

    def note_written(self, batch: int, bucket: int) -> None:
        """Rows ``[0, batch)`` now hold a call's data and, under ``ALWAYS``, its bucket's padding holds ``pad_value``."""
        if self.policy is FillPolicy.ONCE or batch == bucket:
            self.dirty = max(self.dirty, batch)  # nothing was filled: rows beyond stay as they were
        else:
            self.dirty = batch

    def views(self, batch: int, bucket: int) -> list[Any]:
        """Per leaf, the buffer view a call of ``batch`` rows reads (None for constants).

        A leaf that is this view is not copied by :meth:`stage`: writing into
        these views is the zero-copy way to give a bucket its inputs.
        """
        views: list[Any] = [None] * len(self.buffers)
        for dst, i, _ in self.plan(batch, bucket):
            views[i] = dst
        return views

    def bucket_args(self, bucket: int, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The model's arguments at ``bucket`` rows: buffer views, plus this call's constants."""
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

    def pad_regions(self, batch: int, bucket: int) -> list[PadRegion]:
        """The padding of every batched buffer for ``batch`` rows in ``bucket`` (for the padding check)."""
        bd = self.batch_dim
        return [PadRegion(b.narrow(bd, 0, bucket), b.narrow(bd, 0, batch), b.narrow(bd, batch, bucket - batch))
                for b in self.batched_buffers()]

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


def span(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements a strided view of ``shape``/``strides`` reaches from its first one."""
    return 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))


class Arena:
    """One allocation per input, sized for the largest bucket, read through strided views per bucket.

    The strides of a bucket's view may depend on the bucket (a contiguous
    ``(1, b, H)`` view), so the views are ``as_strided`` on a flat buffer.
    Filled with ``pad_value`` when allocated (``FillPolicy.ONCE``): a view
    made later for a larger need gets a new allocation, and views of the older
    one keep it alive for the graphs that read them.
    """

    def __init__(self, pad_value: float | int | bool | None) -> None:
        self.pad_value = 0 if pad_value is None else pad_value
        self.policy = FillPolicy.ONCE
        self._flats: dict[Any, torch.Tensor] = {}

    def view(self, key: Any, shape: tuple[int, ...], strides: tuple[int, ...], largest: tuple[tuple[int, ...],
             tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The view of ``shape``/``strides`` for input ``key``, in its allocation for the largest bucket."""
        need = span(shape, strides)
        flat = self._flats.get(key)
        if flat is None or flat.numel() < need:
            flat = torch.full((max(need, span(*largest)),), self.pad_value, dtype=dtype, device=device)
            self._flats[key] = flat
        return flat.as_strided(shape, strides)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flats.values())

    def clear(self) -> None:
        self._flats.clear()


@dataclass(frozen=True)
class PadRegion:
    """One padded input of a graph: its view at the bucket, the real rows in it, the padding rows.

    ``pad`` may be None when the padding is not one rectangle (padded along
    several dims): then :meth:`fill` fills the whole view and restores the real rows.
    """

    whole: torch.Tensor
    real: torch.Tensor
    pad: torch.Tensor | None

    def fill(self, value: float | int | bool) -> None:
        if self.pad is not None:
            self.pad.fill_(value)
            return
        keep = self.real.clone()
        self.whole.fill_(value)
        self.real.copy_(keep)


def poison_values(region: PadRegion, pad_value: float | int | bool) -> list[float | int | bool]:
    """What the padding check fills a region's padding with, besides ``pad_value``.

    Floating inputs: NaN (any row that reads a padding row turns NaN) and a
    large finite value (for code that ignores NaN: comparisons, ``nan_to_num``).
    Integer inputs: a value of the call's own rows (a token id stays a valid
    index: no out-of-range read on the device), or ``pad_value + 1`` when every
    real value is ``pad_value``. Booleans: the other value.
    """
    t = region.whole
    if t.dtype == torch.bool:
        return [not bool(pad_value)]
    if t.is_floating_point() or t.is_complex():
        big = min(1.0e4, torch.finfo(t.dtype).max / 8) if t.is_floating_point() else 1.0e4
        return [math.nan, big]
    real = region.real.reshape(-1)
    other = real[real != pad_value]  # a value of the call's own rows that is not the padding's
    if other.numel():
        return [other[0].item()]
    # every real value is the pad value (all token ids 0, padded with 0): its neighbour, inside the
    # dtype's range (a token id one past the pad value is still small enough to index with)
    info = torch.iinfo(t.dtype)
    return [int(pad_value) + 1 if int(pad_value) < info.max else int(pad_value) - 1]
