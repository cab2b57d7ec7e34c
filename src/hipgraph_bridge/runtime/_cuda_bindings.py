"""CUDA backend on NVIDIA's ``cuda-bindings`` (``pip install 'gfxgraph[cuda]'``).

``cuda.bindings.runtime`` functions return tuples ``(cudaError_t, *outputs)``
and accept plain ints for handle arguments (lists of nodes need
``cudaGraphNode_t`` objects). Its runtime is its own instance (statically
linked), separate from the libcudart PyTorch loads; graph, stream and event
handles are driver objects, so they are shared between the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._base import (
    CAPTURE_MODE_THREAD_LOCAL,
    ERROR_CAPTURE_INVALIDATED,
    ERROR_EXEC_UPDATE_FAILURE,
    ERROR_NOT_READY,
    EVENT_DISABLE_TIMING,
    CaptureInfo,
    ExecUpdateOutcome,
    Runtime,
)

__all__ = ["CudaBindingsRuntime", "MIN_VERSION", "INSTALL_HINT"]

MIN_VERSION = "12.8"
INSTALL_HINT = f"pip install 'gfxgraph[cuda]' (cuda-bindings>={MIN_VERSION})"


def _import_cudart() -> tuple[Any, str]:
    try:
        import cuda.bindings as cb
        from cuda.bindings import runtime as cudart
    except ImportError as exc:
        raise ImportError(
            f"the CUDA runtime binding is not installed: {INSTALL_HINT} ({exc})"
        ) from exc
    return cudart, str(getattr(cb, "__version__", "unknown"))


class CudaBindingsRuntime(Runtime):
    """The CUDA runtime through ``cuda.bindings.runtime``.

    Construction imports the binding and makes no runtime call, so it works
    (and errors translate) on a machine without a driver.

    Raises:
        ImportError: ``cuda-bindings`` is not installed; the message names the extra.
    """

    name = "cuda"
    kind = "cuda-bindings"
    prefix = "cuda"

    def __init__(self) -> None:
        cudart, version = _import_cudart()
        self._rt = cudart
        self.version = version
        self.binding = f"cuda-bindings {version}"
        self._node_t = cudart.cudaGraphNode_t
        self._launch = cudart.cudaGraphLaunch  # hot path: skip the getattr
        self._record = cudart.cudaEventRecord
        # CUDA 13 added edge-data arguments to AddNode/UpdateCaptureDependencies; the
        # 12.x bindings spell those variants with a _v2 suffix.
        self._edge_args = int(version.split(".", 1)[0]) >= 13 if version[:1].isdigit() else True

    # --------------------------------------------------------------- checking
    def _call(self, suffix: str, *args: Any, allow: Sequence[int] = ()) -> tuple[Any, ...]:
        res = getattr(self._rt, "cuda" + suffix)(*args)
        code = int(res[0])
        if code:
            self._check(suffix, code, allow=allow)
        return res

    def _error_name(self, code: int) -> str:
        try:
            err, text = self._rt.cudaGetErrorName(self._rt.cudaError_t(code))
            return text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # an unknown code must not hide the original failure
            return f"cudaError({code})"

    def _error_string(self, code: int) -> str:
        try:
            err, text = self._rt.cudaGetErrorString(self._rt.cudaError_t(code))
            return text.decode() if isinstance(text, bytes) else str(text)
        except Exception:
            return "unrecognized error code"

    def _clear_last_error(self) -> None:
        try:
            self._rt.cudaGetLastError()
        except Exception:
            pass

    def _has(self, suffix: str) -> bool:
        return hasattr(self._rt, "cuda" + suffix)

    # ---------------------------------------------------------------- version
    def runtime_version(self) -> int:
        return int(self._call("RuntimeGetVersion")[1])

    def driver_version(self) -> int:
        return int(self._call("DriverGetVersion")[1])

    # ----------------------------------------------------------------- graphs
    def graph_create(self) -> int:
        return int(self._call("GraphCreate", 0)[1])

    def graph_destroy(self, graph: int) -> None:
        self._call("GraphDestroy", graph)

    def graph_clone(self, graph: int) -> int:
        return int(self._call("GraphClone", graph)[1])

    def graph_node_count(self, graph: int) -> int:
        # numNodes=0 asks for the count only: (err, nodes, numNodes)
        return int(self._call("GraphGetNodes", graph, 0)[2])

    def graph_add_child(self, graph: int, deps: Sequence[int], child: int) -> int:
        nodes = [self._node_t(init_value=int(d)) for d in deps]
        return int(self._call("GraphAddChildGraphNode", graph, nodes, len(nodes), child)[1])

    def graph_instantiate(self, graph: int, flags: int = 0) -> int:
        return int(self._call("GraphInstantiateWithFlags", graph, int(flags))[1])

    # ------------------------------------------------------------- executable
    def exec_destroy(self, exec_: int) -> None:
        self._call("GraphExecDestroy", exec_)

    def exec_launch(self, exec_: int, stream: int) -> None:
        code = int(self._launch(exec_, stream)[0])
        if code:
            self._check("GraphLaunch", code)

    def exec_upload(self, exec_: int, stream: int) -> None:
        self._call("GraphUpload", exec_, stream)

    def exec_set_child(self, exec_: int, node: int, child: int) -> None:
        self._call("GraphExecChildGraphNodeSetParams", exec_, node, child)

    def exec_update(self, exec_: int, graph: int) -> ExecUpdateOutcome:
        res = self._call("GraphExecUpdate", exec_, graph, allow=(ERROR_EXEC_UPDATE_FAILURE,))
        code = int(res[0])
        info = res[1] if len(res) > 1 else None
        # cuda-bindings returns None for the outputs of a failed call, so the
        # detailed result of a refused update may be unknown here.
        result = getattr(getattr(info, "result", None), "name", None)
        if code == 0:
            return ExecUpdateOutcome(True, result or "cudaGraphExecUpdateSuccess")
        return ExecUpdateOutcome(False, result or "unknown", self._error_name(code),
                                 self._error_string(code))

    # ---------------------------------------------------------------- streams
    def stream_capture_status(self, stream: int) -> int:
        return int(self._call("StreamIsCapturing", stream)[1])

    def stream_end_capture(self, stream: int) -> int:
        res = self._call("StreamEndCapture", stream, allow=(ERROR_CAPTURE_INVALIDATED,))
        return int(res[1]) if res[1] is not None else 0

    # ----------------------------------------------------------------- events
    def event_create(self) -> int:
        return int(self._call("EventCreateWithFlags", EVENT_DISABLE_TIMING)[1])

    def event_destroy(self, event: int) -> None:
        self._call("EventDestroy", event)

    def event_record(self, event: int, stream: int) -> None:
        code = int(self._record(event, stream)[0])
        if code:
            self._check("EventRecord", code)

    def event_query(self, event: int) -> bool:
        return int(self._call("EventQuery", event, allow=(ERROR_NOT_READY,))[0]) == 0

    def event_synchronize(self, event: int) -> None:
        self._call("EventSynchronize", event)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("StreamWaitEvent", stream, event, 0)

    # ---------------------------------------------------- capture introspection
    def stream_capture_info(self, stream: int) -> CaptureInfo:
        # 13.x: (err, status, id, graph, deps, edgeData, numDeps); 12.x: no edgeData.
        res = self._call("StreamGetCaptureInfo", stream)
        status = int(getattr(res[1], "value", res[1]))
        if status != 1:
            return CaptureInfo(status, 0, 0, ())
        count = int(res[-1] or 0)
        deps = tuple(int(d) for d in (res[4] or ())[:count])
        return CaptureInfo(status, int(res[2] or 0), int(res[3] or 0), deps)

    def graph_nodes(self, graph: int) -> list[int]:
        count = int(self._call("GraphGetNodes", graph, 0)[2])
        if count == 0:
            return []
        res = self._call("GraphGetNodes", graph, count)
        return [int(n) for n in (res[1] or ())[: int(res[2])]]

    def node_type(self, node: int) -> int:
        kind = self._call("GraphNodeGetType", node)[1]
        return int(getattr(kind, "value", kind))

    def exec_node_set_enabled(self, exec_: int, node: int, enabled: bool) -> None:
        self._call("GraphNodeSetEnabled", exec_, node, 1 if enabled else 0)

    # -------------------------------------------------------- conditional nodes
    def conditional_nodes_reason(self) -> str | None:
        missing = [n for n in ("GraphConditionalHandleCreate", "StreamBeginCaptureToGraph",
                               "GraphAddNode") if not self._has(n)]
        if missing or not hasattr(self._rt, "cudaConditionalNodeParams"):
            return (f"{self.binding} lacks {', '.join('cuda' + m for m in missing) or 'cudaConditionalNodeParams'}"
                    f"; conditional nodes need {INSTALL_HINT}")
        return None

    def binds_switch_nodes(self) -> bool:
        kinds = getattr(self._rt, "cudaGraphConditionalNodeType", None)
        return kinds is not None and hasattr(kinds, "cudaGraphCondTypeSwitch")

    def conditional_handle_create(self, graph: int, *, default_value: int = 0,
                                  assign_default: bool = True) -> int:
        flags = 1 if assign_default else 0  # cudaGraphCondAssignDefault
        return int(self._call("GraphConditionalHandleCreate", graph, int(default_value), flags)[1])

    def graph_add_conditional(self, graph: int, deps: Sequence[int], handle: int, cond_type: int,
                              size: int) -> tuple[int, list[int]]:
        rt = self._rt
        params = rt.cudaGraphNodeParams()
        params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
        cond = params.conditional  # a view into params: the runtime fills phGraph_out there
        cond.handle = rt.cudaGraphConditionalHandle(int(handle))
        cond.type = rt.cudaGraphConditionalNodeType(int(cond_type))
        cond.size = int(size)
        nodes = [self._node_t(init_value=int(d)) for d in deps]
        if self._edge_args:
            res = self._call("GraphAddNode", graph, nodes, None, len(nodes), params)
        else:
            res = self._call("GraphAddNode_v2", graph, nodes, None, len(nodes), params)
        bodies = [int(g) for g in (params.conditional.phGraph_out or ())][: int(size)]
        if len(bodies) != int(size) or not all(bodies):
            raise RuntimeError(f"cudaGraphAddNode added a conditional node but returned {len(bodies)} "
                               f"body graph(s), expected {size}; this cuda-bindings ({self.version}) does "
                               "not report phGraph_out. Upgrade: " + INSTALL_HINT)
        return int(res[1]), bodies

    def stream_set_capture_dependencies(self, stream: int, deps: Sequence[int]) -> None:
        nodes = [self._node_t(init_value=int(d)) for d in deps]
        set_flag = self._rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies
        if self._edge_args:
            self._call("StreamUpdateCaptureDependencies", stream, nodes, None, len(nodes), set_flag)
        else:
            self._call("StreamUpdateCaptureDependencies_v2", stream, nodes, None, len(nodes), set_flag)

    def stream_begin_capture_to_graph(self, stream: int, graph: int,
                                      mode: int = CAPTURE_MODE_THREAD_LOCAL) -> None:
        self._call("StreamBeginCaptureToGraph", stream, graph, None, None, 0,
                   self._rt.cudaStreamCaptureMode(int(mode)))
