"""gfxgraph: safe, drop-in GPU graph capture/replay for PyTorch (CUDA and ROCm/HIP).

    import gfxgraph
    gfxgraph.enable()          # torch.cuda.CUDAGraph is now abort-proof and counted
    print(gfxgraph.stats())

Setting ``GFXGRAPH=1`` (or ``debug``/``validate``) enables it at import;
``GFXGRAPH_LOG_LEVEL=debug`` (alias ``HGB_LOG_LEVEL``) prints the library's log on
stderr (see :mod:`hipgraph_bridge.log` for where records go).
"""

from __future__ import annotations

from typing import Any

from hipgraph_bridge import (
    Backend,
    BackendOptions,
    BridgedCUDAGraph,
    backend,
    backend_stats,
    gfxgraph_backend,
    ConditionalGraph,
    DeviceWhileLoop,
    DeviceDecodeLoop,
    LoopCondition,
    conditional_select,
    GraphCompositor,
    LaunchPipeline,
    SwapResult,
    UpdatableGraph,
    UpdateResult,
    ConfigError,
    GraphCaptureError,
    GraphRuntimeError,
    GraphsUnavailableError,
    StaleOutputError,
    GraphState,
    ShapeBucketPool,
    PoolOptions,
    Fallback,
    Reason,
    RankAgreement,
    RankAgreementError,
    __version__,
    default_buckets,
    health_check,
    warmup,
    WarmupReport,
    compile_regions,
)
from hipgraph_bridge import compiled_subgraphs, graph_pool_bytes
from hipgraph_bridge import stats as _stats
from hipgraph_bridge.config import read_enable_mode
from hipgraph_bridge.log import apply_env_level
from hipgraph_bridge.patching import disable, enable, is_enabled

from . import cache

__all__ = [
    "enable",
    "warmup",
    "WarmupReport",
    "compile_regions",
    "cache",
    "disable",
    "is_enabled",
    "stats",
    "reset_stats",
    "health_check",
    "BridgedCUDAGraph",
    "ShapeBucketPool",
    "PoolOptions",
    "Fallback",
    "Reason",
    "RankAgreement",
    "RankAgreementError",
    "default_buckets",
    "gfxgraph_backend",
    "backend",
    "Backend",
    "BackendOptions",
    "backend_stats",
    "compiled_subgraphs",
    "ConditionalGraph",
    "DeviceWhileLoop",
    "DeviceDecodeLoop",
    "LoopCondition",
    "conditional_select",
    "GraphCompositor",
    "LaunchPipeline",
    "UpdatableGraph",
    "SwapResult",
    "UpdateResult",
    "GraphState",
    "ConfigError",
    "GraphCaptureError",
    "GraphRuntimeError",
    "GraphsUnavailableError",
    "StaleOutputError",
    "__version__",
]


def stats() -> dict[str, Any]:
    """A thread-safe snapshot of gfxgraph's counters.

    Keys: ``enabled``, ``enabled_at`` (epoch seconds or None), ``capture_count``,
    ``capture_failures``, ``capture_seconds``, ``replay_count``,
    ``avg_replay_us`` and ``replay_us_p50``/``p90``/``p99`` (host time per
    replay call, sampled one replay in 16, over the last 4096 samples per
    thread; ``replay_samples`` counts them), ``fallback_count`` and
    ``fallback_reasons`` (eager runs per cause), ``validation_checks``,
    ``validation_failures``, ``graph_pool_bytes`` (reserved by graph memory
    pools, from the allocator; 0 before CUDA is initialised).
    Cost: milliseconds (walks the allocator's segments); not for hot loops.
    """
    snap = _stats.snapshot()
    snap["enabled"] = is_enabled()
    snap["graph_pool_bytes"] = graph_pool_bytes()
    return snap


def reset_stats() -> None:
    """Zero every counter (thread-safe); fallback causes get logged again."""
    _stats.reset()


def _auto_enable() -> None:
    apply_env_level()
    mode = read_enable_mode()
    if mode == "on":
        enable()
    elif mode == "debug":
        enable(debug=True)
    elif mode == "validate":
        enable(validate=True)


_auto_enable()
