"""hipgraph_bridge: gfxgraph's implementation. Importing it patches nothing.

Use :mod:`gfxgraph` for the public API (``gfxgraph.enable()``); import from
here to use the classes without the patch.
"""

from __future__ import annotations

from .capture_state import GraphState
from . import ops  # registers torch.ops.gfxgraph.conditional_select
from .compositor import CompositorState, GraphCompositor, StageCapture, SwapResult, validate_dag
from .errors import ConfigError, GraphCaptureError, GraphRuntimeError, GraphsUnavailableError
from .graph_manager import BridgedCUDAGraph, OriginalCUDAGraph
from .compile_backend import BackendOptions, backend_stats, gfxgraph_backend
from .cond_nodes import ConditionalSupport, conditional_support
from .conditional import ConditionalGraph, ConditionalState
from .device_loop import DeviceWhileLoop, LoopCondition
from .exec_update import UpdatableGraph, UpdateResult, apply_update
from .health import health_check
from .launch_pipeline import LaunchPipeline
from .memory import graph_pool_bytes
from .platform import Platform, probe
from .runtime import current_runtime, get_runtime
from .shape_bucketing import ShapeBucketPool, default_buckets, validate_buckets
from .ops import conditional_select
from .validation import outputs_match, tolerance_for

__version__ = "0.1.0"

__all__ = [
    "BridgedCUDAGraph",
    "OriginalCUDAGraph",
    "GraphState",
    "ConfigError",
    "GraphCaptureError",
    "GraphRuntimeError",
    "GraphsUnavailableError",
    "ShapeBucketPool",
    "default_buckets",
    "gfxgraph_backend",
    "BackendOptions",
    "backend_stats",
    "ConditionalGraph",
    "ConditionalState",
    "DeviceWhileLoop",
    "LoopCondition",
    "ConditionalSupport",
    "conditional_support",
    "conditional_select",
    "GraphCompositor",
    "CompositorState",
    "SwapResult",
    "StageCapture",
    "validate_dag",
    "LaunchPipeline",
    "UpdatableGraph",
    "UpdateResult",
    "apply_update",
    "current_runtime",
    "get_runtime",
    "validate_buckets",
    "Platform",
    "probe",
    "health_check",
    "graph_pool_bytes",
    "outputs_match",
    "tolerance_for",
    "__version__",
]
