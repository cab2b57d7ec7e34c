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
    ERROR_CAPTURE_INVALIDATED,
    ERROR_EXEC_UPDATE_FAILURE,
    ERROR_NOT_READY,
    EVENT_DISABLE_TIMING,
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
