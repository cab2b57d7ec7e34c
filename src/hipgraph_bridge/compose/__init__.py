"""Graphs of graphs: composition with hot swap, upload-ahead launch pipelines, exec update."""

from __future__ import annotations

from .compositor import CompositorState, GraphCompositor, StageCapture, SwapResult, validate_dag
from .exec_update import UpdatableGraph, UpdateResult, apply_update
from .pipeline import LaunchPipeline

__all__ = ["GraphCompositor", "CompositorState", "StageCapture", "SwapResult", "validate_dag", "UpdatableGraph",
           "UpdateResult", "apply_update", "LaunchPipeline"]
