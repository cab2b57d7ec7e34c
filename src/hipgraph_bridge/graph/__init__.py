"""Capturing and replaying one graph: the capture primitive and the drop-in graph class built on it."""

from __future__ import annotations

from .bridged import GraphState, OriginalCUDAGraph, SafeCUDAGraph
from .capture import CaptureState, GraphCapture, frozen_gc, warm_up
from .memory import graph_pool_bytes

__all__ = ["SafeCUDAGraph", "GraphState", "OriginalCUDAGraph", "GraphCapture", "CaptureState", "frozen_gc",
           "warm_up", "graph_pool_bytes"]
