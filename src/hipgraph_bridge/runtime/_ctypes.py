"""HIP backend (and a CUDA twin) over ctypes: one code path, two symbol prefixes.

Why ctypes over the HIP runtime library rather than hip-python: the ROCm
build of PyTorch already loads ``libamdhip64.so``, so binding the two dozen
graph, stream and event entry points we use costs no extra dependency,
nothing to build, and no version matrix against ROCm releases; hip-python is
a large package pinned to one ROCm version, a heavy extra for ~25 calls.

The same class is parameterised by library and symbol prefix: pointed at
``libcudart`` with prefix ``"cuda"`` it runs the very same code on NVIDIA
hardware (``GFXGRAPH_RUNTIME=ctypes`` or ``get_runtime("ctypes")``), which is
how the HIP path is tested here. Only calls whose C signatures are identical
in CUDA 12+ and HIP are bound generically (handles, ints, pointers, the same
status codes and enum values). The one exception, ``GraphExecUpdate``, takes a
result struct on CUDA 12+ and two out-pointers on HIP; each flavour is bound
with its own prototype below. The HIP names bound here are checked against
``hip_api_symbols.txt`` (from HIP's documented ``hip_runtime_api.h``) by a CPU
test. Linux only (library discovery reads ``/proc/self/maps`` and uses sonames).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, GraphRuntimeError, GraphsUnavailableError
from ._library import LIBRARY_STEMS, Api, find_runtime_library
from ._base import (
    ERROR_CAPTURE_INVALIDATED,
    ERROR_EXEC_UPDATE_FAILURE,
    ERROR_NOT_READY,
    EVENT_DISABLE_TIMING,
    HIP_NO_CONDITIONAL,
    CaptureInfo,
    ExecUpdateOutcome,
    Runtime,
)

__all__ = ["CtypesRuntime", "find_runtime_library", "bound_symbols", "lazily_bound_symbols", "Api",
           "LIBRARY_STEMS"]

_int = ctypes.c_int
_vp = ctypes.c_void_p
_pvp = ctypes.POINTER(ctypes.c_void_p)
_pint = ctypes.POINTER(ctypes.c_int)


class _CudaExecUpdateResultInfo(ctypes.Structure):
    # cudaGraphExecUpdateResultInfo (CUDA 12+): enum result; node errorNode; node errorFromNode.
    _fields_ = [("result", ctypes.c_int), ("errorNode", ctypes.c_void_p),
                ("errorFromNode", ctypes.c_void_p)]


# suffix -> (restype, argtypes, required). Status-returning calls return the
# error enum as int. Required entry points exist in every HIP >= 5.3 and
# CUDA >= 11.4 runtime; optional ones turn a strategy off when missing.
_COMMON: dict[str, tuple[Any, tuple[Any, ...], bool]] = {
    "GetErrorName": (ctypes.c_char_p, (_int,), True),
    "GetErrorString": (ctypes.c_char_p, (_int,), True),
    "GetLastError": (_int, (), True),
    "RuntimeGetVersion": (_int, (_pint,), True),
    "DriverGetVersion": (_int, (_pint,), True),
    "GraphCreate": (_int, (_pvp, ctypes.c_uint), True),
    "GraphDestroy": (_int, (_vp,), True),
    "GraphClone": (_int, (_pvp, _vp), True),
    "GraphGetNodes": (_int, (_vp, _pvp, ctypes.POINTER(ctypes.c_size_t)), True),
    "GraphAddChildGraphNode": (_int, (_pvp, _vp, _pvp, ctypes.c_size_t, _vp), True),
    "GraphInstantiateWithFlags": (_int, (_pvp, _vp, ctypes.c_ulonglong), True),
    "GraphExecDestroy": (_int, (_vp,), True),
    "GraphLaunch": (_int, (_vp, _vp), True),
    "GraphUpload": (_int, (_vp, _vp), False),
    "GraphExecChildGraphNodeSetParams": (_int, (_vp, _vp, _vp), False),
    "GraphNodeGetType": (_int, (_vp, _pint), False),
    "GraphNodeSetEnabled": (_int, (_vp, _vp, ctypes.c_uint), False),
    "StreamIsCapturing": (_int, (_vp, _pint), True),
    "StreamEndCapture": (_int, (_vp, _pvp), True),
    "StreamWaitEvent": (_int, (_vp, _vp, ctypes.c_uint), True),
    "EventCreateWithFlags": (_int, (_pvp, ctypes.c_uint), True),
    "EventDestroy": (_int, (_vp,), True),
    "EventRecord": (_int, (_vp, _vp), True),
    "EventQuery": (_int, (_vp,), True),
    "EventSynchronize": (_int, (_vp,), True),
}

_EXEC_UPDATE: dict[str, tuple[Any, tuple[Any, ...], bool]] = {
    # CUDA 12+: (exec, graph, cudaGraphExecUpdateResultInfo*)
    "cuda": (_int, (_vp, _vp, ctypes.POINTER(_CudaExecUpdateResultInfo)), False),
    # HIP: (exec, graph, hipGraphNode_t* hErrorNode_out, hipGraphExecUpdateResult* updateResult_out)
    "hip": (_int, (_vp, _vp, _pvp, _pint), False),
}

# StreamGetCaptureInfo with the graph and dependencies: its name and arity differ by API and
# version (HIP and CUDA 12.0-12.2: the 6-argument _v2; CUDA 12.3+: _v3 with an edge-data
# out-pointer, 7 arguments; CUDA 13: the unsuffixed name with the _v3 signature, while CUDA 12's
# unsuffixed name is the legacy 3-argument call). It is bound on first use, once the runtime
# version is known, taking the first exported candidate; a candidate is never called with
# fewer arguments than it may take.
_CAPTURE_INFO_6 = (_int, (_vp, _pint, ctypes.POINTER(ctypes.c_ulonglong), _pvp, _pvp,
                          ctypes.POINTER(ctypes.c_size_t)))
_CAPTURE_INFO_7 = (_int, (_vp, _pint, ctypes.POINTER(ctypes.c_ulonglong), _pvp, _pvp, _pvp,
                          ctypes.POINTER(ctypes.c_size_t)))


def _capture_info_candidates(api: Api, runtime_version: int) -> list[tuple[str, tuple[Any, tuple[Any, ...]]]]:
    if api == "hip":
        return [("StreamGetCaptureInfo_v2", _CAPTURE_INFO_6)]
    if runtime_version >= 13000:
        return [("StreamGetCaptureInfo_v3", _CAPTURE_INFO_7), ("StreamGetCaptureInfo", _CAPTURE_INFO_7)]
    return [("StreamGetCaptureInfo_v3", _CAPTURE_INFO_7), ("StreamGetCaptureInfo_v2", _CAPTURE_INFO_6)]


_UPDATE_RESULTS = (
    "Success", "Error", "ErrorTopologyChanged", "ErrorNodeTypeChanged", "ErrorFunctionChanged",
    "ErrorParametersChanged", "ErrorNotSupported", "ErrorUnsupportedFunctionChange",
    "ErrorAttributesChanged",  # CUDA only; HIP stops at 7
)


def bound_symbols(api: Api) -> list[str]:
    """Every symbol the ctypes backend binds for ``api`` (for the HIP symbol-table test)."""
    return sorted(api + s for s in [*_COMMON, "GraphExecUpdate"])


def lazily_bound_symbols(api: Api) -> list[str]:
    """Symbols bound on first use (their arity depends on the runtime version)."""
    names = {name for v in (0, 13000) for name, _ in _capture_info_candidates(api, v)}
    return sorted(api + name for name in names)


def _signatures(api: Api) -> dict[str, tuple[Any, tuple[Any, ...], bool]]:
    return {**_COMMON, "GraphExecUpdate": _EXEC_UPDATE[api]}


# ------------------------------------------------------------ library lookup
class CtypesRuntime(Runtime):
    """A CUDA or HIP runtime library driven through ctypes.

    Args:
        lib: a loaded library (``ctypes.CDLL``) or any object whose attributes
            are ctypes function pointers named ``prefix + suffix``.
        api: ``"cuda"`` or ``"hip"``: the symbol prefix and struct flavour.
        path: where the library came from (for messages).

    Raises:
        GraphsUnavailableError: a required entry point is missing (named in the message).
    """

    kind = "ctypes"

    def __init__(self, lib: Any, api: Api, *, path: str = "") -> None:
        if api not in ("cuda", "hip"):
            raise ValueError(f"api: expected 'cuda' or 'hip', got {api!r}")
        self.name = api
        self.prefix = api
        self.path = path or getattr(lib, "_name", "") or "?"
        self.binding = f"ctypes {os.path.basename(self.path)}"
        self._lib = lib  # keeps the library loaded as long as the functions are used
        self._fn: dict[str, Any] = {}
        missing = []
        for suffix, (restype, argtypes, required) in _signatures(api).items():
            fn = self._bind(lib, api + suffix, restype, argtypes)
            if fn is not None:
                self._fn[suffix] = fn
            elif required:
                missing.append(api + suffix)
        if missing:
            raise GraphsUnavailableError(
                f"{self.path}: the {api.upper()} runtime library lacks {', '.join(missing)}; "
                f"expected a CUDA >= 11.4 libcudart or a HIP >= 5.3 libamdhip64"
            )
        self._launch = self._fn["GraphLaunch"]
        self._record = self._fn["EventRecord"]
        self._capture_info: tuple[Any, bool] | None = None  # (function, has edge-data out)

    @staticmethod
    def _bind(lib: Any, symbol: str, restype: Any, argtypes: tuple[Any, ...]) -> Any:
        try:
            ptr = getattr(lib, symbol)
        except AttributeError:
            return None
        # A prototype of our own, so the library object's shared function
        # pointers are never mutated and fakes built from callbacks work too.
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        if not address:
            return None
        return ctypes.CFUNCTYPE(restype, *argtypes)(address)

    @classmethod
    def open(cls, path: str, *, api: Api | None = None) -> CtypesRuntime:
        """Load ``path`` and bind it; the API is detected from its symbols unless given.

        Raises:
            ConfigError: ``path`` is not a loadable shared library, or exports
                neither ``hipGraphCreate`` nor ``cudaGraphCreate``.
            GraphsUnavailableError: a required entry point is missing.
        """
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise ConfigError(
                f"GFXGRAPH_LIB / runtime library {path!r}: expected a loadable shared library "
                f"(libcudart.so* or libamdhip64.so*), but it could not be loaded: {exc}"
            ) from exc
        if api is None:
            if hasattr(lib, "hipGraphCreate"):
                api = "hip"
            elif hasattr(lib, "cudaGraphCreate"):
                api = "cuda"
            else:
                raise ConfigError(
                    f"GFXGRAPH_LIB / runtime library {path!r}: expected a CUDA runtime "
                    "(exporting cudaGraphCreate) or a HIP runtime (exporting hipGraphCreate); "
                    "it exports neither"
                )
        return cls(lib, api, path=path)

    # --------------------------------------------------------------- checking
    def _call(self, suffix: str, *args: Any, allow: Sequence[int] = ()) -> int:
        code = self._fn[suffix](*args)
        if code:
            self._check(suffix, code, allow=allow)
        return code

    def _error_name(self, code: int) -> str:
        try:
            raw = self._fn["GetErrorName"](int(code))
            return raw.decode() if raw else f"{self.prefix}Error({code})"
        except Exception:
            return f"{self.prefix}Error({code})"

    def _error_string(self, code: int) -> str:
        try:
            raw = self._fn["GetErrorString"](int(code))
            return raw.decode() if raw else "unrecognized error code"
        except Exception:
            return "unrecognized error code"

    def _clear_last_error(self) -> None:
        try:
            self._fn["GetLastError"]()
        except Exception:
            pass

    def _has(self, suffix: str) -> bool:
        return suffix in self._fn

    def _need(self, suffix: str) -> None:
        if suffix not in self._fn:
            raise GraphsUnavailableError(
                f"{self.prefix}{suffix} is not exported by {self.path}; this strategy "
                "needs a newer runtime"
            )

    # ---------------------------------------------------------------- version
    def runtime_version(self) -> int:
        out = ctypes.c_int(0)
        self._call("RuntimeGetVersion", ctypes.byref(out))
        return out.value

    def driver_version(self) -> int:
        out = ctypes.c_int(0)
        self._call("DriverGetVersion", ctypes.byref(out))
        return out.value

    # ----------------------------------------------------------------- graphs
    def graph_create(self) -> int:
        out = ctypes.c_void_p()
        self._call("GraphCreate", ctypes.byref(out), 0)
        return out.value or 0

    def graph_destroy(self, graph: int) -> None:
        self._call("GraphDestroy", graph)

    def graph_clone(self, graph: int) -> int:
        out = ctypes.c_void_p()
        self._call("GraphClone", ctypes.byref(out), graph)
        return out.value or 0

    def graph_node_count(self, graph: int) -> int:
        count = ctypes.c_size_t(0)
        self._call("GraphGetNodes", graph, None, ctypes.byref(count))
        return int(count.value)

    def graph_add_child(self, graph: int, deps: Sequence[int], child: int) -> int:
        out = ctypes.c_void_p()
        arr = (ctypes.c_void_p * len(deps))(*[int(d) for d in deps]) if deps else None
        self._call("GraphAddChildGraphNode", ctypes.byref(out), graph, arr, len(deps), child)
        return out.value or 0

    def graph_instantiate(self, graph: int, flags: int = 0) -> int:
        out = ctypes.c_void_p()
        self._call("GraphInstantiateWithFlags", ctypes.byref(out), graph, int(flags))
        return out.value or 0

    # ------------------------------------------------------------- executable
    def exec_destroy(self, exec_: int) -> None:
        self._call("GraphExecDestroy", exec_)

    def exec_launch(self, exec_: int, stream: int) -> None:
        code = self._launch(exec_, stream)
        if code:
            self._check("GraphLaunch", code)

    def exec_upload(self, exec_: int, stream: int) -> None:
        self._need("GraphUpload")
        self._call("GraphUpload", exec_, stream)

    def exec_set_child(self, exec_: int, node: int, child: int) -> None:
        self._need("GraphExecChildGraphNodeSetParams")
        self._call("GraphExecChildGraphNodeSetParams", exec_, node, child)

    def exec_update(self, exec_: int, graph: int) -> ExecUpdateOutcome:
        self._need("GraphExecUpdate")
        if self.prefix == "cuda":
            info = _CudaExecUpdateResultInfo()
            code = self._call("GraphExecUpdate", exec_, graph, ctypes.byref(info),
                              allow=(ERROR_EXEC_UPDATE_FAILURE,))
            result_code = int(info.result)
        else:
            error_node = ctypes.c_void_p()
            result = ctypes.c_int(0)
            code = self._call("GraphExecUpdate", exec_, graph, ctypes.byref(error_node),
                              ctypes.byref(result), allow=(ERROR_EXEC_UPDATE_FAILURE,))
            result_code = int(result.value)
        name = self._update_result_name(result_code)
        if code == 0:
            return ExecUpdateOutcome(True, name)
        return ExecUpdateOutcome(False, name, self._error_name(code), self._error_string(code))

    def _update_result_name(self, code: int) -> str:
        if 0 <= code < len(_UPDATE_RESULTS):
            return f"{self.prefix}GraphExecUpdate{_UPDATE_RESULTS[code]}"
        return f"{self.prefix}GraphExecUpdateResult({code})"

    # ---------------------------------------------------------------- streams
    def stream_capture_status(self, stream: int) -> int:
        status = ctypes.c_int(0)
        self._call("StreamIsCapturing", stream, ctypes.byref(status))
        return int(status.value)

    def stream_end_capture(self, stream: int) -> int:
        out = ctypes.c_void_p()
        self._call("StreamEndCapture", stream, ctypes.byref(out),
                   allow=(ERROR_CAPTURE_INVALIDATED,))
        return out.value or 0

    # ----------------------------------------------------------------- events
    def event_create(self) -> int:
        out = ctypes.c_void_p()
        self._call("EventCreateWithFlags", ctypes.byref(out), EVENT_DISABLE_TIMING)
        return out.value or 0

    def event_destroy(self, event: int) -> None:
        self._call("EventDestroy", event)

    def event_record(self, event: int, stream: int) -> None:
        code = self._record(event, stream)
        if code:
            self._check("EventRecord", code)

    def event_query(self, event: int) -> bool:
        return self._call("EventQuery", event, allow=(ERROR_NOT_READY,)) == 0

    def event_synchronize(self, event: int) -> None:
        self._call("EventSynchronize", event)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("StreamWaitEvent", stream, event, 0)

    # ---------------------------------------------------- capture introspection
    def _capture_info_fn(self) -> tuple[Any, bool]:
        if self._capture_info is None:
            api: Api = "hip" if self.prefix == "hip" else "cuda"
            candidates = _capture_info_candidates(api, self.capabilities.runtime_version)
            for suffix, (restype, argtypes) in candidates:
                fn = self._bind(self._lib, self.prefix + suffix, restype, argtypes)
                if fn is not None:
                    self._fn[suffix] = fn
                    self._capture_info = (fn, len(argtypes) == 7)
                    break
            else:
                names = ", ".join(self.prefix + name for name, _ in candidates)
                raise GraphsUnavailableError(f"{self.path} exports none of {names}; reading a capture's "
                                             "graph (the supergraph strategy) needs one")
        return self._capture_info

    def stream_capture_info(self, stream: int) -> CaptureInfo:
        fn, edge_out = self._capture_info_fn()
        status = ctypes.c_int(0)
        cid = ctypes.c_ulonglong(0)
        graph = ctypes.c_void_p()
        deps = ctypes.c_void_p()
        count = ctypes.c_size_t(0)
        if edge_out:
            edges = ctypes.c_void_p()
            code = fn(stream, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph),
                      ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count))
        else:
            code = fn(stream, ctypes.byref(status), ctypes.byref(cid), ctypes.byref(graph),
                      ctypes.byref(deps), ctypes.byref(count))
        if code:
            self._check("StreamGetCaptureInfo", code)
        if status.value != 1:
            return CaptureInfo(int(status.value), 0, 0, ())
        if not graph.value:
            raise GraphRuntimeError(f"{self.prefix}StreamGetCaptureInfo", "graphNotReported", 0,
                                    f"the capture is active but {self.path} returned no graph; its "
                                    "StreamGetCaptureInfo does not have the expected signature")
        n = int(count.value)
        # The runtime owns the dependency array and may reuse it on the next stream call: copy now.
        arr = ctypes.cast(deps, ctypes.POINTER(ctypes.c_void_p)) if deps.value else None
        found = tuple(int(arr[i] or 0) for i in range(n)) if arr is not None else ()
        return CaptureInfo(1, int(cid.value), int(graph.value or 0), found)

    def graph_nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self._call("GraphGetNodes", graph, None, ctypes.byref(count))
        if count.value == 0:
            return []
        arr = (ctypes.c_void_p * count.value)()
        self._call("GraphGetNodes", graph, arr, ctypes.byref(count))
        return [int(arr[i] or 0) for i in range(int(count.value))]

    def node_type(self, node: int) -> int:
        self._need("GraphNodeGetType")
        out = ctypes.c_int(0)
        self._call("GraphNodeGetType", node, ctypes.byref(out))
        return int(out.value)

    def exec_node_set_enabled(self, exec_: int, node: int, enabled: bool) -> None:
        self._need("GraphNodeSetEnabled")
        self._call("GraphNodeSetEnabled", exec_, node, 1 if enabled else 0)

    # -------------------------------------------------------- conditional nodes
    def conditional_nodes_reason(self) -> str | None:
        if self.prefix == "hip":
            return HIP_NO_CONDITIONAL
        # The CUDA twin could bind the C structs, but native conditionals also need the
        # NVRTC-compiled value setter, which comes with cuda-bindings.
        return ("the ctypes binding of libcudart does not build conditional nodes: they need the "
                "NVRTC-compiled value-setter kernel, which gfxgraph loads through cuda-bindings "
                "(pip install 'gfxgraph[cuda]'); use the cuda-bindings runtime")
