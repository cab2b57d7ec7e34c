"""Which runtime binding this process uses, decided once and cached.

Selection (``GFXGRAPH_RUNTIME=auto``, the default):

1. ``GFXGRAPH_LIB`` set: ctypes over that library (its symbols say CUDA or HIP).
2. ROCm build of PyTorch (``torch.version.hip``): ctypes over the
   ``libamdhip64`` PyTorch loaded.
3. CUDA build: ``cuda-bindings`` when importable, else ctypes over the
   ``libcudart`` PyTorch loaded (logged once, with the extra to install).
4. CPU-only build: unavailable (:class:`GraphsUnavailableError`).

``GFXGRAPH_RUNTIME=cuda-bindings`` or ``ctypes`` (or ``get_runtime(kind)``)
forces one binding, which is how the HIP code path (ctypes) is run on NVIDIA
hardware. Successful runtimes are cached per (kind, library); failures are not,
so fixing the environment and retrying works.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Literal

from ..config import RUNTIME_KINDS, RuntimeKind, read_runtime_kind, read_runtime_lib
from ..errors import GraphsUnavailableError
from ..log import log_once
from ..platform import torch_build_version
from ._base import Runtime
from ._ctypes import CtypesRuntime, find_runtime_library
from ._cuda_bindings import INSTALL_HINT, CudaBindingsRuntime

__all__ = ["get_runtime", "current_runtime", "resolve_runtime", "reset_runtime_cache", "torch_build"]

_cache: dict[tuple[str, str | None], Runtime] = {}
_lock = threading.Lock()


def _check_kind(kind: object) -> RuntimeKind:
    if kind not in RUNTIME_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(RUNTIME_KINDS)}, got {kind!r}")
    return kind  # type: ignore[return-value]


def torch_build() -> Literal["cuda", "hip"] | None:
    """Which GPU API the installed PyTorch was built for (None: CPU-only build)."""
    return torch_build_version()[0]


def _ctypes(api: Literal["cuda", "hip"], lib: str | None) -> Runtime:
    if lib is not None:
        return CtypesRuntime.open(lib)  # the library's own symbols say which API it is
    return CtypesRuntime.open(find_runtime_library(api), api=api)


def _create(kind: RuntimeKind, lib: str | None) -> Runtime:
    build = torch_build()
    if kind == "cuda-bindings":
        try:
            return CudaBindingsRuntime()
        except ImportError as exc:
            raise GraphsUnavailableError(str(exc)) from exc
    if kind == "ctypes":
        return _ctypes(build or "cuda", lib)
    # auto
    if lib is not None:
        return _ctypes(build or "cuda", lib)
    if build is None:
        raise GraphsUnavailableError(
            "The native graph runtime layer is unavailable: PyTorch is a CPU-only build. "
            f"On NVIDIA install a CUDA build of PyTorch and {INSTALL_HINT}; on AMD a ROCm build"
        )
    if build == "hip":
        return _ctypes("hip", None)
    try:
        return CudaBindingsRuntime()
    except ImportError as first:
        try:
            rt = _ctypes("cuda", None)
        except Exception as second:
            raise GraphsUnavailableError(
                f"no CUDA runtime binding: {first}; and libcudart could not be bound "
                f"through ctypes either ({second})"
            ) from second
        log_once(("runtime", "ctypes-fallback"), logging.INFO,
                 "gfxgraph: cuda-bindings is not installed; the runtime layer uses ctypes over %s "
                 "(%s for the supported binding)", rt.binding, INSTALL_HINT)
        return rt


def get_runtime(kind: str | None = None, *, environ: Mapping[str, str] | None = None) -> Runtime:
    """The cached runtime for ``kind`` (None: ``GFXGRAPH_RUNTIME``, default ``auto``).

    Raises:
        GraphsUnavailableError: no binding can be loaded; the message says what to install.
        ConfigError: ``GFXGRAPH_RUNTIME`` or ``GFXGRAPH_LIB`` holds a bad value, or
            ``GFXGRAPH_LIB`` is not a loadable runtime library.
        ValueError: ``kind`` is not one of ``auto``, ``cuda-bindings``, ``ctypes``.
    """
    resolved = read_runtime_kind(environ) if kind is None else _check_kind(kind)
    lib = read_runtime_lib(environ)
    key = (resolved, lib)
    with _lock:
        rt = _cache.get(key)
        if rt is None:
            rt = _create(resolved, lib)
            _cache[key] = rt
    return rt


def current_runtime() -> Runtime:
    """The runtime this process uses (cached). See the module docstring for the choice."""
    return get_runtime()


def resolve_runtime(runtime: object) -> Runtime:
    """``runtime`` as a :class:`Runtime`: None = current, a kind name, or a Runtime."""
    if runtime is None:
        return current_runtime()
    if isinstance(runtime, Runtime):
        return runtime
    if isinstance(runtime, str):
        if runtime not in RUNTIME_KINDS:
            raise ValueError(f"runtime: expected None, a Runtime or one of {', '.join(RUNTIME_KINDS)}, "
                             f"got {runtime!r}")
        return get_runtime(runtime)
    raise TypeError("runtime: expected None, a Runtime or one of "
                    f"{', '.join(RUNTIME_KINDS)}, got {type(runtime).__name__}")


def reset_runtime_cache() -> None:
    """Forget cached runtimes (tests, or after changing the environment)."""
    with _lock:
        _cache.clear()
