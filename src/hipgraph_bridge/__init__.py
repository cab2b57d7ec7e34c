"""hipgraph_bridge: gfxgraph's implementation. Importing it patches nothing.

Use :mod:`gfxgraph` for the public API (``gfxgraph.enable()``); import from
here to use the classes without the patch. Layers, bottom up (each imports
only those below it): ``runtime`` <- ``graph`` <- ``ranks``, ``conditional``, ``compose`` <- ``padding``
<- ``bucketing`` <- ``generation``, ``compile`` <- ``compat``; see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from .bucketing import PoolOptions, ShapeBucketPool
from .fallbacks import Fallback, Reason
from .graph.buckets import default_buckets, validate_buckets
from .ranks import RankAgreement
from .compat import BridgedCUDAGraph
from .compile import Backend, BackendOptions, backend_stats, compiled_subgraphs, gfxgraph_backend
from .compile.backend import backend
from .compose import (
    CompositorState,
    GraphCompositor,
    LaunchPipeline,
    StageCapture,
    SwapResult,
    UpdatableGraph,
    UpdateResult,
    apply_update,
    validate_dag,
)
from .conditional import (
    ConditionalGraph,
    ConditionalState,
    ConditionalSupport,
    DeviceWhileLoop,
    LoopCondition,
    conditional_select,
    conditional_support,
)
from .generation import DeviceDecodeLoop
from .errors import (
    ConfigError,
    GraphCaptureError,
    GraphRuntimeError,
    GraphsUnavailableError,
    RankAgreementError,
    StaleOutputError,
)
from .graph import GraphCapture, GraphState, OriginalCUDAGraph, SafeCUDAGraph, graph_pool_bytes
from .health import health_check
from .platform import Platform, probe
from .runtime import current_runtime, get_runtime
from .startup import WarmupReport, compile_regions, warmup
from .validation import outputs_match, tolerance_for

__version__ = "0.1.0"

__all__ = [
    "warmup",
    "compile_regions",
    "WarmupReport",
    "PoolOptions",
    "Fallback",
    "Reason",
    "BridgedCUDAGraph",
    "SafeCUDAGraph",
    "OriginalCUDAGraph",
    "GraphCapture",
    "GraphState",
    "ConfigError",
    "GraphCaptureError",
    "StaleOutputError",
    "GraphRuntimeError",
    "GraphsUnavailableError",
    "ShapeBucketPool",
    "RankAgreement",
    "RankAgreementError",
    "default_buckets",
    "validate_buckets",
    "gfxgraph_backend",
    "backend",
    "Backend",
    "BackendOptions",
    "backend_stats",
    "compiled_subgraphs",
    "ConditionalGraph",
    "ConditionalState",
    "DeviceWhileLoop",
    "LoopCondition",
    "DeviceDecodeLoop",
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
    "Platform",
    "probe",
    "health_check",
    "graph_pool_bytes",
    "outputs_match",
    "tolerance_for",
    "__version__",
]
