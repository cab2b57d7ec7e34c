"""The padded-execution engine's parts: row analysis, static buffers and fill policies, output views,
per-graph entries, and the padding check. The pool (:mod:`hipgraph_bridge.bucketing`), the compile
backend's subgraphs and its piecewise pieces all pad through them."""

from __future__ import annotations

from .confirm import confirm_padding
from .entry import Entry
from .outputs import OutputLayout
from .rows import Mixed, Rows, RowTracer, RowVerdict
from .staging import Arena, FillPolicy, PadRegion, StaticInputs

__all__ = ["RowTracer", "RowVerdict", "Rows", "Mixed", "StaticInputs", "Arena", "FillPolicy", "PadRegion",
           "OutputLayout", "Entry", "confirm_padding"]
