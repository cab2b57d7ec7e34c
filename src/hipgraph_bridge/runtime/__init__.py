"""The runtime layer: graph, stream and event calls of the CUDA or HIP runtime, behind one interface.

Two backends behind one handle-level interface (:class:`Runtime`):

* ``cuda-bindings`` (NVIDIA's binding; ``pip install 'gfxgraph[cuda]'``), and
* ``ctypes`` over the runtime library PyTorch already loaded: ``libamdhip64``
  on ROCm, and the very same code over ``libcudart`` on CUDA, so the HIP code
  path is exercised on NVIDIA hardware.

:mod:`.capabilities` holds the one table of what each backend and version
can be trusted to do (every entry with its source); strategy code asks it
instead of comparing versions.

On top, Pythonic owners of handles: :class:`Graph` (builder),
:class:`GraphExec` (executable), :class:`GraphNode`, :class:`Event`.

    from hipgraph_bridge.runtime import current_runtime, Graph
    rt = current_runtime()             # cached; raises GraphsUnavailableError if none
    g = Graph.from_torch(torch_graph)  # captured with keep_graph=True
    exe = g.instantiate()
    exe.launch(torch.cuda.current_stream())

Every failing call raises :class:`~hipgraph_bridge.errors.GraphRuntimeError`
with the runtime's own error name and message.
"""

from __future__ import annotations

from ..config import RUNTIME_KINDS, RuntimeKind, read_runtime_kind
from ._base import (
    CAPTURE_MODE_THREAD_LOCAL,
    COND_IF,
    COND_SWITCH,
    COND_WHILE,
    DEVICE_LAUNCH_REASON,
    HIP_NO_CONDITIONAL,
    NODE_EMPTY,
    NODE_GRAPH,
    NODE_KERNEL,
    NODE_MEMCPY,
    NODE_MEMSET,
    CaptureInfo,
    ExecUpdateOutcome,
    Runtime,
    RuntimeCaps,
)
from ._captures import capture_owner, captures_live, register_capture, unregister_capture
from ._cuda_bindings import INSTALL_HINT
from ._lifetime import deferred_count, drain_deferred
from .capabilities import (
    CAPABILITIES,
    ISSUES,
    TABLE,
    Capabilities,
    KnownIssue,
    Rule,
    Version,
    capabilities_for,
    capabilities_of,
    current_capabilities,
    detect_rocm_version,
    first_version,
    forget_detected_versions,
    identify,
)
from .capability_report import capability_lines, capability_report, machine_capabilities
from ._select import current_runtime, get_runtime, reset_runtime_cache, resolve_runtime, torch_build
from .graph import Event, Graph, GraphExec, GraphNode, as_graph, stream_handle

__all__ = [
    "Capabilities",
    "CAPABILITIES",
    "TABLE",
    "ISSUES",
    "Rule",
    "KnownIssue",
    "Version",
    "capabilities_for",
    "capabilities_of",
    "current_capabilities",
    "detect_rocm_version",
    "first_version",
    "forget_detected_versions",
    "identify",
    "capability_lines",
    "capability_report",
    "machine_capabilities",
    "Runtime",
    "RuntimeCaps",
    "RuntimeKind",
    "RUNTIME_KINDS",
    "ExecUpdateOutcome",
    "CaptureInfo",
    "current_runtime",
    "get_runtime",
    "resolve_runtime",
    "read_runtime_kind",
    "reset_runtime_cache",
    "torch_build",
    "Graph",
    "GraphExec",
    "GraphNode",
    "Event",
    "as_graph",
    "stream_handle",
    "drain_deferred",
    "deferred_count",
    "register_capture",
    "unregister_capture",
    "capture_owner",
    "captures_live",
    "INSTALL_HINT",
    "DEVICE_LAUNCH_REASON",
    "HIP_NO_CONDITIONAL",
    "CAPTURE_MODE_THREAD_LOCAL",
    "NODE_KERNEL",
    "NODE_MEMCPY",
    "NODE_MEMSET",
    "NODE_EMPTY",
    "NODE_GRAPH",
    "COND_IF",
    "COND_WHILE",
    "COND_SWITCH",
]
