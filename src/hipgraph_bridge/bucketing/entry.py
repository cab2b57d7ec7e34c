"""One bucket of a pool: its graph, its static outputs, and what its first call returns."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .._torch_compat import pytree
from ..graph.bridged import SafeCUDAGraph
from ..graph.capture import record_on_current_stream
from ..tree import copy_into
from .outputs import OutputLayout, same_kinds

__all__ = ["Bucket", "MISSING"]

MISSING = object()  # a first call that produced no result of its own


@dataclass
class Bucket:
    """One captured (or eager) bucket for one key of constant arguments."""

    size: int
    key: tuple[Hashable, ...] = ()  # the constant arguments
    graph: SafeCUDAGraph | None = None
    outputs: list[Any] | None = None  # the graph's static output leaves
    layout: OutputLayout | None = None
    reason: str = ""  # fallback reason key when this bucket runs eagerly ("vram_cap", ...)
    failed: str | None = None  # the explanation when this bucket runs eagerly
    padding_checked: bool = False  # a padded result was compared with eager (see .padding)

    def warm_result(self, warm: Any, batch: int, *, batch_dim: int, copy: bool) -> Any:
        """A bucket's first call returns its last warm-up run, as a replay would return it.

        MISSING when the warm-up's outputs differ from what the graph captured
        (the model is not the same from run to run: the call replays instead)
        or cannot be sliced back. With ``copy_outputs=False`` the result is
        copied into the graph's static outputs, so the returned views are the
        ones later calls overwrite. The warm-up ran on the capture stream;
        ``record_stream`` keeps the allocator from reusing its memory there
        while the caller's stream reads it.
        """
        layout = self.layout
        assert layout is not None
        first, spec = pytree.tree_flatten(warm)
        if spec != layout.spec or (batch < self.size and not layout.known):
            return MISSING
        record_on_current_stream(first)
        static = self.outputs
        if static is not None and not same_kinds(first, static):
            return MISSING
        if static is None or copy:  # copied: the warm-up may alias the static input buffers
            return layout.result(first, batch, batch_dim=batch_dim, copy=copy, cache=False)
        copy_into(static, first)
        return layout.result(static, batch, batch_dim=batch_dim, copy=False, cache=True)
