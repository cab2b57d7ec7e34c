"""Run-time compiled CUDA kernels: NVRTC, nvJitLink and the driver's module loader, through cuda-bindings.

PyTorch ships no kernel that sets a conditional node's value or launches a
graph from the device, so gfxgraph compiles its own few at run time. This
module holds what every such kernel needs: compile a source for the device's
architecture (NVRTC), link relocatable code against a static library such as
the CUDA device runtime (nvJitLink), load the image into PyTorch's context and
launch a kernel on a raw stream (the driver API). Every call's result is
checked and turned into :class:`~hipgraph_bridge.errors.GraphRuntimeError`
with the library's own message. CUDA only: HIP has neither conditional nodes
nor device-side graph launch.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from ..errors import GraphRuntimeError
from ._cuda_bindings import INSTALL_HINT

__all__ = ["bindings", "nvrtc_version", "nvrtc_unavailable_reason", "nvrtc_check", "driver_check", "compile_source",
           "ensure_context", "load_first", "launch", "link_cubin", "nvjitlink_unavailable_reason", "KernelCache"]


def bindings() -> tuple[Any, Any]:
    """cuda-bindings' ``driver`` and ``nvrtc`` modules (ImportError with the install hint when absent)."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as exc:
        raise ImportError(f"gfxgraph's run-time compiled kernels need cuda-bindings: {INSTALL_HINT} ({exc})") from exc
    return driver, nvrtc


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor). Loads libnvrtc; compiles nothing.

    Raises:
        ImportError: cuda-bindings is missing.
        GraphRuntimeError: libnvrtc cannot be loaded (the message says what to install).
    """
    _, nvrtc = bindings()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # cuda.pathfinder raises its own error when libnvrtc is absent
        raise GraphRuntimeError(
            "nvrtcVersion", "NVRTC_NOT_FOUND", -1,
            f"libnvrtc could not be loaded ({exc}); CUDA builds of PyTorch install it as the "
            "nvidia-cuda-nvrtc wheel: pip install nvidia-cuda-nvrtc (the same CUDA major as the driver)",
        ) from exc
    nvrtc_check(nvrtc, "nvrtcVersion", err)
    return int(major), int(minor)


def nvrtc_unavailable_reason() -> str | None:
    """Why the setter kernels cannot be compiled here (None when NVRTC loads)."""
    try:
        nvrtc_version()
    except (ImportError, GraphRuntimeError) as exc:
        return str(exc)
    return None


def nvrtc_check(nvrtc: Any, call: str, err: Any, log: str = "") -> None:
    """Raise :class:`GraphRuntimeError` with NVRTC's own message (and the program ``log``) unless ``err`` is 0."""
    code = int(getattr(err, "value", err))
    if code == 0:
        return
    try:
        res = nvrtc.nvrtcGetErrorString(err)
        text = res[-1] if isinstance(res, tuple) else res  # (result, bytes) in cuda-bindings
        text = text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        text = "unknown NVRTC error"
    name = getattr(err, "name", f"nvrtcResult({code})")
    raise GraphRuntimeError(call, name, code, text + (f"\n{log}" if log else ""))


def driver_check(driver: Any, call: str, err: Any) -> None:
    """Raise :class:`GraphRuntimeError` with the driver's error name and string unless ``err`` is 0."""
    code = int(getattr(err, "value", err))
    if code == 0:
        return
    try:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        name, text = f"CUresult({code})", "unrecognized error code"
    raise GraphRuntimeError(call, name, code, text)


def compile_source(source: str, arch: int, *, name: str = "gfxgraph.cu",
                   options: Sequence[str] = ()) -> list[tuple[str, bytes]]:
    """Compile ``source`` for compute capability ``arch`` (e.g. 90); return loadable images.

    With NVRTC supporting ``sm_<arch>``: the PTX (JIT-compiled by the driver,
    as the feasibility run loaded it) first, then the CUBIN (needs no JIT: the
    fallback when the driver is older than NVRTC's PTX). Otherwise: the PTX
    of the newest virtual architecture NVRTC knows below ``arch``.

    Raises:
        GraphRuntimeError: the compilation failed (the NVRTC log is in the message).
    """
    _, nvrtc = bindings()
    err, supported = nvrtc.nvrtcGetSupportedArchs()
    nvrtc_check(nvrtc, "nvrtcGetSupportedArchs", err)
    supported = sorted(int(a) for a in supported)
    exact = arch in supported
    target = arch if exact else max([a for a in supported if a <= arch] or [supported[0]])
    opts = [f"--gpu-architecture={'sm' if exact else 'compute'}_{target}".encode(), *(o.encode() for o in options)]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    nvrtc_check(nvrtc, "nvrtcCreateProgram", err)
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(getattr(err, "value", err)) != 0:
            nvrtc_check(nvrtc, "nvrtcCompileProgram", err, _program_log(nvrtc, prog))
        images = [(f"ptx compute_{target}", _read(nvrtc, prog, "PTX"))]
        if exact:
            images.append((f"cubin sm_{target}", _read(nvrtc, prog, "CUBIN")))
        return images
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _program_log(nvrtc: Any, prog: Any) -> str:
    try:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * int(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        return buf.rstrip(b"\x00 ").decode(errors="replace")
    except Exception:
        return ""


def _read(nvrtc: Any, prog: Any, what: str) -> bytes:
    err, size = getattr(nvrtc, f"nvrtcGet{what}Size")(prog)
    nvrtc_check(nvrtc, f"nvrtcGet{what}Size", err)
    buf = b" " * int(size)  # PTX: size counts the terminating NUL, which loading needs
    (err,) = getattr(nvrtc, f"nvrtcGet{what}")(prog, buf)
    nvrtc_check(nvrtc, f"nvrtcGet{what}", err)
    return buf


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context (the one PyTorch uses) current on this thread."""
    driver, _ = bindings()
    err, ctx = driver.cuCtxGetCurrent()
    driver_check(driver, "cuCtxGetCurrent", err)
    if int(ctx) != 0:
        err, current = driver.cuCtxGetDevice()
        if int(getattr(err, "value", err)) == 0 and int(current) == device:
            return
    err, dev = driver.cuDeviceGet(device)
    driver_check(driver, "cuDeviceGet", err)
    err, primary = driver.cuDevicePrimaryCtxRetain(dev)  # retained for the process: kernels live there
    driver_check(driver, "cuDevicePrimaryCtxRetain", err)
    (err,) = driver.cuCtxSetCurrent(primary)
    driver_check(driver, "cuCtxSetCurrent", err)


def load_first(driver: Any, images: Sequence[tuple[str, bytes]]) -> tuple[Any, str]:
    """Load the first of ``images`` ((label, bytes)) the driver accepts into the current context: (module, label).

    Raises:
        GraphRuntimeError: the driver refused every image (each refusal is in the message).
    """
    errors: list[str] = []
    for label, image in images:
        err, module = driver.cuModuleLoadData(image)
        try:
            driver_check(driver, "cuModuleLoadData", err)
        except GraphRuntimeError as exc:
            errors.append(f"{label}: {exc}")
            continue
        return module, label
    raise GraphRuntimeError("cuModuleLoadData", "CUDA_ERROR_NO_LOADABLE_IMAGE", -1,
                            "the driver loaded none of the compiled images (" + "; ".join(errors)
                            + "); an NVRTC newer than the driver emits PTX the driver cannot JIT: "
                            "install the NVRTC of the driver's CUDA version")


def launch(fn: Any, args: Sequence[tuple[Any, Any]], stream: int, *, device: int, threads: int = 1) -> None:
    """Launch ``fn`` as one block of ``threads`` threads on the raw ``stream``; ``args`` are (ctypes type,
    value) pairs.

    During a capture the launch becomes a kernel node; its arguments are
    copied at launch, so they need not outlive this call.
    """
    driver, _ = bindings()
    ensure_context(device)
    values = [ctype(value) for ctype, value in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    (err,) = driver.cuLaunchKernel(fn, 1, 1, 1, threads, 1, 1, 0, driver.CUstream(int(stream)),
                                   ctypes.addressof(pointers), 0)
    driver_check(driver, "cuLaunchKernel", err)


def _nvjitlink() -> Any:
    try:
        from cuda.bindings import nvjitlink
    except ImportError as exc:
        raise ImportError(f"linking device code needs cuda-bindings with nvJitLink: {INSTALL_HINT} ({exc})") from exc
    return nvjitlink


def nvjitlink_unavailable_reason() -> str | None:
    """Why nvJitLink cannot be used here (None when it loads)."""
    try:
        _nvjitlink().version()
    except ImportError as exc:
        return str(exc)
    except Exception as exc:  # cuda.pathfinder raises its own error when libnvJitLink is absent
        return (f"libnvJitLink could not be loaded ({exc}); CUDA builds of PyTorch install it as the "
                "nvidia-nvjitlink wheel: pip install nvidia-nvjitlink (the CUDA major of the driver)")
    return None


def link_cubin(cubin: bytes, arch: int, *, libraries: Sequence[str] = ()) -> bytes:
    """Link relocatable ``cubin`` (NVRTC with ``--relocatable-device-code=true``) with static
    ``libraries`` (paths of ``.a`` files) into a loadable CUBIN for ``sm_<arch>``.

    Raises:
        ImportError: cuda-bindings (or its nvJitLink module) is missing.
        GraphRuntimeError: the link failed (nvJitLink's error log is in the message).
    """
    nvjitlink = _nvjitlink()
    handle = nvjitlink.create(1, [f"-arch=sm_{arch}"])
    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, cubin, len(cubin), "gfxgraph")
            for path in libraries:
                nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, path)
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            size = nvjitlink.get_error_log_size(handle)
            log = bytearray(size)
            if size:
                nvjitlink.get_error_log(handle, log)
            raise GraphRuntimeError("nvJitLinkComplete", type(exc).__name__, -1,
                                    f"{exc}\n{bytes(log).rstrip(bytes(1)).decode(errors='replace')}") from exc
        out = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, out)
        return bytes(out)
    finally:
        nvjitlink.destroy(handle)


_K = TypeVar("_K")


class KernelCache(Generic[_K]):
    """Kernels compiled once per architecture and loaded once per device.

    ``build(arch)`` returns the images to try for an architecture (``[(label, image)]``,
    :func:`load_first`'s order); ``make(device, label, functions)`` wraps the loaded
    ``CUfunction`` objects of ``names``. :meth:`get` is thread-safe; after the first call for a
    device it is a dict read. The first call for a device must not happen during a stream
    capture (loading a module would invalidate it).
    """

    def __init__(self, build: Callable[[int], Sequence[tuple[str, bytes]]], names: Sequence[str],
                 make: Callable[[int, str, list[Any]], _K]) -> None:
        self._build, self._names, self._make = build, tuple(names), make
        self._lock = threading.Lock()
        self._images: dict[int, Sequence[tuple[str, bytes]]] = {}  # arch -> images, built once
        self._loaded: dict[int, _K] = {}  # device -> kernels

    def get(self, device: int | None = None) -> _K:
        """The kernels of ``device`` (default: the current one), built and loaded on first use."""
        dev = torch.cuda.current_device() if device is None else int(device)
        found = self._loaded.get(dev)
        if found is not None:
            return found
        with self._lock:
            found = self._loaded.get(dev)
            if found is not None:
                return found
            driver, _ = bindings()
            torch.empty(1, device=f"cuda:{dev}")  # PyTorch creates the primary context first
            major, minor = torch.cuda.get_device_capability(dev)
            arch = 10 * major + minor
            images = self._images.get(arch)
            if images is None:
                images = self._images[arch] = self._build(arch)
            with torch.cuda.device(dev):
                ensure_context(dev)
                module, label = load_first(driver, images)
            fns = []
            for name in self._names:
                err, fn = driver.cuModuleGetFunction(module, name.encode())
                driver_check(driver, "cuModuleGetFunction", err)
                fns.append(fn)
            found = self._loaded[dev] = self._make(dev, label, fns)
            return found
