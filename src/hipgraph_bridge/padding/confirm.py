"""The padding check: replay a bucket's graph with its padding rows poisoned and compare the real rows.

The row analysis (:mod:`.rows`) proves from the trace that padding is sound;
this confirms it on the graph that will serve the calls, without running the
model's Python: the graph is replayed with every padding row filled with
each poison of :func:`~.staging.poison_values` (NaN, a large value, another
valid index), then once more with ``pad_value``, and the real rows of every
output must come out the same each time (outputs without the batch must not
change at all). Where the caller has an unpadded result of the same call at
hand (the warm-up run of a bucket's first call), the padded one must match
it too: that also catches the batch size used as a value (``x * x.shape[0]``),
which no padding content changes.

Cost: one replay per poison plus one, a copy of the real rows per replay and
a host sync; once per bucket (and per constant-argument key).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._torch_compat import pytree
from ..validation import padding_changed
from .staging import PadRegion, poison_values

__all__ = ["confirm_padding"]


def _describe(value: Any) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return repr(value)


def _snapshot(leaves: Sequence[Any]) -> list[Any]:
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves]


def confirm_padding(replay: Callable[[], None], regions: Sequence[PadRegion], pad_value: float | int | bool,
                    real_outputs: Callable[[], list[Any]], *, reference: Any = None) -> str:
    """Whether the real rows hold whatever the padding holds; "" when they do, else what changed.

    ``replay`` runs the graph on the regions' buffers; ``real_outputs``
    returns the outputs' real rows (views). The padding ends holding
    ``pad_value`` and the outputs that replay's result. ``reference``: an
    unpadded result of the same call (the same leaves as ``real_outputs``).
    """
    poisons = [(r, poison_values(r, pad_value)) for r in regions]
    rounds = max((len(p) for _, p in poisons), default=0)
    taken: list[tuple[str, list[Any]]] = []
    try:
        for k in range(rounds):
            what = []
            for r, values in poisons:
                v = values[k] if k < len(values) else pad_value
                r.fill(v)
                what.append(_describe(v))
            replay()
            taken.append((", ".join(dict.fromkeys(what)), _snapshot(real_outputs())))
    finally:
        for r, _ in poisons:
            r.fill(pad_value)
    replay()
    base = real_outputs()
    for what, snap in taken:
        why = padding_changed(snap, base)
        if why:
            return f"padding rows holding {what} instead of {_describe(pad_value)} changed the real rows ({why})"
    if reference is not None:
        ref = pytree.tree_leaves(reference)
        why = padding_changed(base, ref) if len(ref) == len(base) else "a different number of outputs"
        if why:
            return f"the padded result differs from the unpadded run of the same call ({why})"
    return ""
