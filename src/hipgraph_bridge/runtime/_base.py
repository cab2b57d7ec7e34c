"""The interface every runtime backend implements, and the one checking helper.

A backend speaks raw handles (Python ``int`` values of ``cudaGraph_t``,
``cudaGraphExec_t``, ``cudaGraphNode_t``, ``cudaStream_t``, ``cudaEvent_t`` or
their HIP twins); the Pythonic objects in :mod:`.graph` own those handles. Only
calls whose C signatures are the same on CUDA and HIP are in the interface
(handles, ints, pointers), except ``GraphExecUpdate``, whose CUDA 12+ and HIP
signatures differ and which each backend adapts explicitly.

Every status a runtime returns goes through :meth:`Runtime._check`, which turns
a failure into :class:`~hipgraph_bridge.errors.GraphRuntimeError` carrying the
runtime's own error name and message, and clears the runtime's sticky
"last error" so that PyTorch's next kernel-launch check does not trip over it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import GraphRuntimeError

__all__ = ["Runtime", "RuntimeCaps", "ExecUpdateOutcome", "CaptureInfo", "SUCCESS", "ERROR_NOT_READY",
           "ERROR_CAPTURE_INVALIDATED", "ERROR_EXEC_UPDATE_FAILURE", "DEVICE_LAUNCH_REASON",
           "NODE_KERNEL", "NODE_MEMCPY", "NODE_MEMSET", "NODE_GRAPH", "NODE_EMPTY", "COND_IF", "COND_WHILE",
           "COND_SWITCH", "CAPTURE_MODE_THREAD_LOCAL", "HIP_NO_CONDITIONAL"]

# Status codes with the same value in cudaError_t and hipError_t.
SUCCESS = 0
ERROR_NOT_READY = 600  # cudaErrorNotReady / hipErrorNotReady: an event still pending
ERROR_CAPTURE_INVALIDATED = 901  # ...StreamCaptureInvalidated: capture ended, graph lost
ERROR_EXEC_UPDATE_FAILURE = 910  # ...GraphExecUpdateFailure: update refused, not an I/O error

# cudaEventDisableTiming == hipEventDisableTiming == 0x2.
EVENT_DISABLE_TIMING = 0x2

# Graph node types with the same value in cudaGraphNodeType and hipGraphNodeType.
NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, NODE_GRAPH, NODE_EMPTY = 0, 1, 2, 4, 5
# cudaGraphConditionalNodeType (CUDA only).
COND_IF, COND_WHILE, COND_SWITCH = 0, 1, 2
# cudaStreamCaptureModeThreadLocal == hipStreamCaptureModeThreadLocal.
CAPTURE_MODE_THREAD_LOCAL = 1

# HIP's hipGraphNodeType has no conditional node type and there is no conditional-handle API, on
# ROCm 7.2 and on clr's develop branch (https://github.com/ROCm/legacy-rocm-build/issues/6398); the
# feature request is open (https://github.com/ROCm/hip/issues/3905).
HIP_NO_CONDITIONAL = (
    "HIP has no conditional graph nodes (IF/ELSE, SWITCH, WHILE) up to ROCm 7.2 (ROCm/hip#3905, "
    "ROCm/legacy-rocm-build#6398); gfxgraph emulates them there: a device-selected branch by per-branch "
    "dispatch after one host read (or a supergraph with node enable/disable), a loop by the host-driven loop"
)

# HIP: device-side graph launch was requested in https://github.com/ROCm/hip/issues/3160 and AMD's
# answer pointed to host-side hipGraphLaunch only.
DEVICE_LAUNCH_REASON = (
    "device-side graph launch needs CUDA 12.0 or newer (runtime and driver); HIP offers none "
    "(ROCm/hip#3160): the host launch pipeline (upload ahead + double-buffered instances) is used"
)


@dataclass(frozen=True)
class RuntimeCaps:
    """What one runtime binding can do; probed once per runtime object.

    ``runtime_version``/``driver_version`` use the runtime's encoding
    (CUDA: 1000*major + 10*minor; HIP: its own integer). The boolean fields
    say whether the optional entry points exist; strategies that need one fall
    back (with a logged reason) when it does not.
    """

    runtime_version: int
    driver_version: int
    exec_update: bool  # GraphExecUpdate
    child_graph_update: bool  # GraphExecChildGraphNodeSetParams
    upload: bool  # GraphUpload
    device_launch: bool
    device_launch_reason: str


@dataclass(frozen=True)
class ExecUpdateOutcome:
    """What the runtime said to one ``GraphExecUpdate`` call.

    ``ok`` is True when the executable graph now runs the new graph's
    parameters. When False, ``error``/``message`` hold the runtime's error name
    and string (e.g. ``cudaErrorGraphExecUpdateFailure``) and ``result`` the
    update result (e.g. ``cudaGraphExecUpdateErrorTopologyChanged``), or
    ``"unknown"`` when the binding does not report it.
    """

    ok: bool
    result: str
    error: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class CaptureInfo:
    """What the runtime says about a stream's capture (``StreamGetCaptureInfo``).

    ``status``: 0 none, 1 active, 2 invalidated (same values on CUDA and HIP).
    ``graph`` and ``dependencies`` (the nodes the next captured work will
    depend on) are valid only while the capture is active; the graph still
    belongs to the capture.
    """

    status: int
    capture_id: int
    graph: int
    dependencies: tuple[int, ...]


class Runtime:
    """One CUDA or HIP runtime binding behind a common, handle-level interface.

    Attributes:
        name: ``"cuda"`` or ``"hip"``: which runtime the calls reach.
        kind: ``"cuda-bindings"`` or ``"ctypes"``: how they reach it.
        binding: a human-readable description, e.g. ``"cuda-bindings 13.3.1"``.
        prefix: the API's symbol prefix (``"cuda"`` or ``"hip"``), used in messages.

    Every method raises :class:`~hipgraph_bridge.errors.GraphRuntimeError` when
    the runtime reports a failure. Handles are plain ints; 0 is NULL.
    """

    name: str
    kind: str
    binding: str
    prefix: str

    # ------------------------------------------------------------ the checker
    def _check(self, call: str, code: int, *, allow: Sequence[int] = ()) -> int:
        """The one place a runtime status becomes an exception.

        Returns ``code`` when it is success or one of ``allow`` (the runtime's
        last error is cleared for an allowed failure); raises otherwise.
        """
        if code == SUCCESS:
            return code
        # Clear the runtime's "last error" either way: PyTorch checks
        # cudaGetLastError after its own launches and would report ours.
        self._clear_last_error()
        if code in allow:
            return code
        raise GraphRuntimeError(f"{self.prefix}{call}", self._error_name(code), int(code),
                                self._error_string(code))

    def _error_name(self, code: int) -> str:
        raise NotImplementedError

    def _error_string(self, code: int) -> str:
        raise NotImplementedError

    def _clear_last_error(self) -> None:
        raise NotImplementedError

    def _has(self, suffix: str) -> bool:
        """Whether the optional entry point ``prefix + suffix`` is bound."""
        raise NotImplementedError

    # ---------------------------------------------------------------- probing
    @functools.cached_property
    def capabilities(self) -> RuntimeCaps:
        """The cached capability probe: versions and optional entry points."""

        def version(fn: object) -> int:
            try:
                return int(fn())  # type: ignore[operator]
            except GraphRuntimeError:
                return 0

        launchable = self.name == "cuda" and min(version(self.runtime_version), version(self.driver_version)) >= 12000
        return RuntimeCaps(
            runtime_version=version(self.runtime_version),
            driver_version=version(self.driver_version),
            exec_update=self._has("GraphExecUpdate"),
            child_graph_update=self._has("GraphExecChildGraphNodeSetParams"),
            upload=self._has("GraphUpload"),
            device_launch=launchable,
            device_launch_reason="" if launchable else DEVICE_LAUNCH_REASON,
        )

    def describe(self) -> dict[str, object]:
        """A JSON-friendly summary (for health reports and benchmark files)."""
        caps = self.capabilities
        return {
            "name": self.name,
            "kind": self.kind,
            "binding": self.binding,
            "runtime_version": caps.runtime_version,
            "driver_version": caps.driver_version,
            "exec_update": caps.exec_update,
            "child_graph_update": caps.child_graph_update,
            "upload": caps.upload,
            "device_launch": caps.device_launch,
        }

    # ----------------------------------------------------- backend interface
    def runtime_version(self) -> int:
        raise NotImplementedError

    def driver_version(self) -> int:
        raise NotImplementedError

    def graph_create(self) -> int:
        raise NotImplementedError

    def graph_destroy(self, graph: int) -> None:
        raise NotImplementedError

    def graph_clone(self, graph: int) -> int:
        raise NotImplementedError

    def graph_node_count(self, graph: int) -> int:
        raise NotImplementedError

    def graph_add_child(self, graph: int, deps: Sequence[int], child: int) -> int:
        """Add a child-graph node (the runtime clones ``child``); return the node."""
        raise NotImplementedError

    def graph_instantiate(self, graph: int, flags: int = 0) -> int:
        raise NotImplementedError

    def exec_destroy(self, exec_: int) -> None:
        raise NotImplementedError

    def exec_launch(self, exec_: int, stream: int) -> None:
        raise NotImplementedError

    def exec_upload(self, exec_: int, stream: int) -> None:
        raise NotImplementedError

    def exec_set_child(self, exec_: int, node: int, child: int) -> None:
        raise NotImplementedError

    def exec_update(self, exec_: int, graph: int) -> ExecUpdateOutcome:
        """Try to update ``exec_`` in place from ``graph``; a refusal is returned, not raised."""
        raise NotImplementedError

    def stream_capture_status(self, stream: int) -> int:
        """0 none, 1 active, 2 invalidated (same values on CUDA and HIP)."""
        raise NotImplementedError

    def stream_end_capture(self, stream: int) -> int:
        """End capture on ``stream``; return the graph (0 when the capture was invalidated)."""
        raise NotImplementedError

    def event_create(self) -> int:
        raise NotImplementedError

    def event_destroy(self, event: int) -> None:
        raise NotImplementedError

    def event_record(self, event: int, stream: int) -> None:
        raise NotImplementedError

    def event_query(self, event: int) -> bool:
        """True when every recorded piece of work is done (NotReady is not an error)."""
        raise NotImplementedError

    def event_synchronize(self, event: int) -> None:
        raise NotImplementedError

    def stream_wait_event(self, stream: int, event: int) -> None:
        raise NotImplementedError

    # ------------------------------------- capture introspection (both APIs)
    def stream_capture_info(self, stream: int) -> CaptureInfo:
        """The capture state of ``stream``, with its graph and dependencies when active."""
        raise NotImplementedError

    def graph_nodes(self, graph: int) -> list[int]:
        """Every node of ``graph`` (top level), in the runtime's order."""
        raise NotImplementedError

    def node_type(self, node: int) -> int:
        """The node's type (``NODE_KERNEL``, ``NODE_MEMCPY``, ... ; same values on CUDA and HIP)."""
        raise NotImplementedError

    def exec_node_set_enabled(self, exec_: int, node: int, enabled: bool) -> None:
        """Enable or disable a kernel, memcpy or memset ``node`` in the executable ``exec_``.

        Affects later launches only; the runtimes support no other node types.
        """
        raise NotImplementedError

    # ------------------------------------------ conditional nodes (CUDA only)
    def conditional_nodes_reason(self) -> str | None:
        """Why this binding cannot build conditional nodes (None when it can)."""
        return f"{self.binding} does not bind conditional graph nodes"

    def binds_switch_nodes(self) -> bool:
        """Whether this binding knows the SWITCH conditional node type (CUDA 12.8+ bindings)."""
        return False

    def _no_conditional(self) -> NotImplementedError:
        return NotImplementedError(self.conditional_nodes_reason() or "not implemented")

    def conditional_handle_create(self, graph: int, *, default_value: int = 0,
                                  assign_default: bool = True) -> int:
        """A conditional handle for a node of ``graph``; with ``assign_default`` it is
        reset to ``default_value`` at the start of every launch."""
        raise self._no_conditional()

    def graph_add_conditional(self, graph: int, deps: Sequence[int], handle: int, cond_type: int,
                              size: int) -> tuple[int, list[int]]:
        """Add a conditional node (``COND_IF``/``COND_WHILE``/``COND_SWITCH``) with ``size``
        bodies after ``deps``; return the node and its body graphs (owned by the node)."""
        raise self._no_conditional()

    def stream_set_capture_dependencies(self, stream: int, deps: Sequence[int]) -> None:
        """Make the next work captured on ``stream`` depend on exactly ``deps``."""
        raise self._no_conditional()

    def stream_begin_capture_to_graph(self, stream: int, graph: int,
                                      mode: int = CAPTURE_MODE_THREAD_LOCAL) -> None:
        """Begin capturing ``stream`` into the existing ``graph`` (a conditional body)."""
        raise self._no_conditional()

    # ------------------------------------------------------ shared behaviour
    def destroy(self, kind: str, handle: int) -> None:
        """Release one handle by kind (``"graph"``, ``"exec"``, ``"event"``)."""
        if kind == "graph":
            self.graph_destroy(handle)
        elif kind == "exec":
            self.exec_destroy(handle)
        elif kind == "event":
            self.event_destroy(handle)
        else:
            raise ValueError(f"kind: expected 'graph', 'exec' or 'event', got {kind!r}")

    def end_capture_and_discard(self, stream_ptr: int, *, destroy: bool = True) -> None:
        """End stream capture on ``stream_ptr`` (if it is capturing) and destroy the graph.

        Used by the recovery in :mod:`hipgraph_bridge.capture_state`. An invalidated
        capture is ended too (its graph is already gone). ``destroy=False`` leaves the
        graph alive (leaked): a graph holding a conditional node whose body capture
        was invalidated crashes the driver when destroyed or instantiated.
        """
        if self.stream_capture_status(stream_ptr) == 0:
            return
        graph = self.stream_end_capture(stream_ptr)
        if graph and destroy:
            self.graph_destroy(graph)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} via {self.binding}>"
