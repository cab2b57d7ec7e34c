"""One graph of a padded family: the graph, its static outputs, and why it runs eagerly when it does."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .._torch_compat import pytree
from ..fallbacks import Fallback
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import record_on_current_stream
from ..tree import copy_into
from .outputs import OutputLayout, same_kinds

__all__ = ["Entry", "MISSING"]

MISSING = object()  # a first call that produced no result of its own


@dataclass
class Entry:
    """One captured (or eager) graph for one bucket and one key of constant arguments.

    ``fallback`` is set when it runs eagerly; ``confirmed`` once a padded call
    passed the padding check (:mod:`.confirm`); exact-size calls need none.
    """

    size: int
    key: tuple[Hashable, ...] = ()  # the constant arguments
    graph: SafeCUDAGraph | None = None
    outputs: list[Any] | None = None  # the graph's static output leaves
    layout: OutputLayout | None = None
    fallback: Fallback | None = None
    confirmed: bool = False

    def warm_result(self, warm: Any, batch: int, *, copy: bool) -> Any:
        """A bucket's first call returns its last warm-up run, as a replay would return it.

        The warm-up ran at the call's own ``batch`` rows, so its outputs are
        not sliced. MISSING when their structure differs from what the graph
        captured (the model is not the same from run to run: the call replays
        instead). With ``copy_outputs=False`` the result is copied into the
        graph's static outputs, so the returned views are the ones later calls
        overwrite. ``record_stream`` keeps the allocator from reusing the
        warm-up's memory on the capture stream while the caller's stream reads it.
        """
        layout = self.layout
        assert layout is not None
        first, spec = pytree.tree_flatten(warm)
        if spec != layout.spec:
            return MISSING
        record_on_current_stream(first)
        static = self.outputs
        if static is None or copy:  # copied: the warm-up may alias the static input buffers
            return pytree.tree_unflatten([o.clone() if copy and isinstance(o, torch.Tensor) else o for o in first],
                                         spec)
        view = layout.real(static, batch)
        if not same_kinds(first, view):
            return MISSING
        copy_into(view, first)
        return layout.result(static, batch, copy=False, cache=True)
