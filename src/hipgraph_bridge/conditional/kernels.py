"""The tiny device kernels that set a conditional node's value, compiled once with NVRTC.

A CUDA conditional node (IF, IF/ELSE, SWITCH, WHILE) reads a *conditional
handle* whose value must be set on the device, by a kernel that calls
``cudaGraphSetConditional``. PyTorch ships no such kernel, so gfxgraph
compiles three of them at run time with NVRTC (through ``cuda-bindings``) and
loads them with the driver API:

* ``gfxgraph_set_if(handle, pred)``: value = ``pred[0] != 0`` (one byte: a bool tensor).
* ``gfxgraph_set_switch(handle, index, n)``: value = ``index[0]`` when it is in
  ``[0, n)``, else ``n`` (the default body, which zero-fills the outputs).
* ``gfxgraph_loop_step(handle, value, kind, op, rhs_i, rhs_f, counter, max_iters, first)``:
  the WHILE step, folded into one kernel: count the iteration
  (``counter = 0`` on the first call, ``+1`` after each body), compare the
  state scalar ``value`` with the right-hand side (or test it for non-zero),
  and stop at ``max_iters``. Folding the comparison saves the kernels a
  separate ``cond_fn`` would launch on every iteration.
* ``gfxgraph_decode_step(handle, ...)``: the WHILE step of a greedy decode loop
  (:mod:`hipgraph_bridge.generation`), one thread per sequence in one block: the
  EOS bookkeeping, the token written into its output column and fed back, the
  position and column advanced, and the loop stopped when every sequence has
  ended or the launch's limit is reached: one kernel instead of a dozen tiny ones.

The source declares ``cudaGraphSetConditional`` itself, so no CUDA headers and
no device runtime library are needed. Compilation happens once per process
and GPU architecture (about 100 ms), the module is loaded once per device,
and both are cached; always before a capture, because loading a module during
a capture is not allowed. Loading needs the CUDA context PyTorch created:
:func:`setter_kernels` creates it (a CUDA tensor) first.

Launching a setter (:func:`launch`) costs one ``cuLaunchKernel`` of a single
thread; during a capture it becomes a kernel node of the graph.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GraphRuntimeError
from ..log import logger
from ..runtime import INSTALL_HINT

__all__ = ["SetterKernels", "setter_kernels", "nvrtc_version", "nvrtc_unavailable_reason", "launch",
           "dtype_kind", "COMPARE_OPS", "KERNEL_SOURCE", "compile_source", "DECODE_STEP_MAX_BATCH"]

KERNEL_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

extern "C" __global__ void gfxgraph_set_if(cudaGraphConditionalHandle handle, const unsigned char* pred) {
    cudaGraphSetConditional(handle, pred[0] != 0 ? 1u : 0u);
}

/* An index outside [0, n) selects body n: the default body that zero-fills the outputs. */
extern "C" __global__ void gfxgraph_set_switch(cudaGraphConditionalHandle handle, const long long* index,
                                               unsigned int n) {
    const long long i = index[0];
    cudaGraphSetConditional(handle, (i >= 0 && i < (long long)n) ? (unsigned int)i : n);
}

/* kind: 0 bool/uint8, 1 int8, 2 int16, 3 int32, 4 int64, 5 float32, 6 float64.
   op: 0 non-zero, 1 <, 2 <=, 3 >, 4 >=, 5 ==, 6 !=. */
__device__ static bool gfxgraph_holds(const void* p, int kind, int op, long long rhs_i, double rhs_f) {
    if (kind >= 5) {
        const double v = kind == 5 ? (double)((const float*)p)[0] : ((const double*)p)[0];
        switch (op) {
            case 1: return v < rhs_f;
            case 2: return v <= rhs_f;
            case 3: return v > rhs_f;
            case 4: return v >= rhs_f;
            case 5: return v == rhs_f;
            case 6: return v != rhs_f;
            default: return v != 0.0;
        }
    }
    long long v;
    switch (kind) {
        case 0: v = ((const unsigned char*)p)[0]; break;
        case 1: v = ((const signed char*)p)[0]; break;
        case 2: v = ((const short*)p)[0]; break;
        case 3: v = ((const int*)p)[0]; break;
        default: v = ((const long long*)p)[0]; break;
    }
    switch (op) {
        case 1: return v < rhs_i;
        case 2: return v <= rhs_i;
        case 3: return v > rhs_i;
        case 4: return v >= rhs_i;
        case 5: return v == rhs_i;
        case 6: return v != rhs_i;
        default: return v != 0;
    }
}

/* counter = body iterations done so far; the loop goes on while the condition holds
   and fewer than max_iters iterations ran. */
extern "C" __global__ void gfxgraph_loop_step(cudaGraphConditionalHandle handle, const void* value, int kind,
                                              int op, long long rhs_i, double rhs_f, int* counter,
                                              int max_iters, int first) {
    const int done = first ? 0 : counter[0] + 1;
    counter[0] = done;
    const bool go = done < max_iters && gfxgraph_holds(value, kind, op, rhs_i, rhs_f);
    cudaGraphSetConditional(handle, go ? 1u : 0u);
}

/* control = {column written this launch, steps allowed this launch, any sequence going};
   eos_pad = {GFXGRAPH_MAX_EOS EOS ids (-1: unused slot), pad id}; out is (batch, chunk) row-major;
   one block of >= batch threads. */
#define GFXGRAPH_MAX_EOS 8
extern "C" __global__ void gfxgraph_decode_step(cudaGraphConditionalHandle handle, const long long* nxt,
                                                long long* tokens, long long* out, long long* control,
                                                long long* position, unsigned char* unfinished,
                                                const long long* eos_pad, int batch, int chunk) {
    const int b = threadIdx.x;
    const long long col = control[0];
    int alive = 0;
    if (b < batch) {
        const bool going = unfinished[b] != 0;
        const long long t = going ? nxt[b] : eos_pad[GFXGRAPH_MAX_EOS];
        bool eos = false;
        for (int i = 0; i < GFXGRAPH_MAX_EOS; ++i) eos = eos || t == eos_pad[i];
        const bool still = going && !eos;
        unfinished[b] = still ? 1 : 0;
        out[(long long)b * chunk + col] = t;
        tokens[b] = t;
        alive = still ? 1 : 0;
    }
    alive = __syncthreads_or(alive);  /* every thread has read col before thread 0 advances it */
    if (b == 0) {
        const long long next = col + 1;
        control[0] = next;
        control[2] = alive;
        position[0] += 1;
        cudaGraphSetConditional(handle, (alive && next < control[1] && next < chunk) ? 1u : 0u);
    }
}
"""

_KERNELS = ("gfxgraph_set_if", "gfxgraph_set_switch", "gfxgraph_loop_step", "gfxgraph_decode_step")
DECODE_STEP_MAX_BATCH = 1024  # one block
MAX_EOS_IDS = 8  # EOS ids the decode step compares with (GFXGRAPH_MAX_EOS in the kernel source)

# Comparison operators of the loop step, by their codes in the kernel.
COMPARE_OPS: dict[str, int] = {"nonzero": 0, "<": 1, "<=": 2, ">": 3, ">=": 4, "==": 5, "!=": 6}

_DTYPE_KINDS: dict[torch.dtype, int] = {
    torch.bool: 0, torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.float32: 5, torch.float64: 6,
}


def dtype_kind(dtype: torch.dtype) -> int:
    """The loop-step kernel's code for ``dtype``.

    Raises:
        TypeError: a dtype the kernel cannot read (half precision, complex, unsigned > 8 bits).
    """
    kind = _DTYPE_KINDS.get(dtype)
    if kind is None:
        raise TypeError(f"expected a bool, int8/16/32/64, uint8, float32 or float64 scalar for the loop "
                        f"condition, got {dtype}; compute the condition with cond_fn= instead")
    return kind


@dataclass(frozen=True)
class SetterKernels:
    """The loaded setter kernels of one device (driver ``CUfunction`` objects)."""

    device: int
    image: str  # what was loaded, e.g. "ptx compute_90" or "cubin sm_90"
    set_if: Any
    set_switch: Any
    loop_step: Any
    decode_step: Any


_lock = threading.Lock()
_images: dict[int, list[tuple[str, bytes]]] = {}  # arch -> [(label, image)], compiled once
_loaded: dict[int, SetterKernels] = {}  # device -> kernels


def _modules() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as exc:
        raise ImportError(f"NVRTC setter kernels need cuda-bindings: {INSTALL_HINT} ({exc})") from exc
    return driver, nvrtc


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor). Loads libnvrtc; compiles nothing.

    Raises:
        ImportError: cuda-bindings is missing.
        GraphRuntimeError: libnvrtc cannot be loaded (the message says what to install).
    """
    _, nvrtc = _modules()
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # cuda.pathfinder raises its own error when libnvrtc is absent
        raise GraphRuntimeError(
            "nvrtcVersion", "NVRTC_NOT_FOUND", -1,
            f"libnvrtc could not be loaded ({exc}); CUDA builds of PyTorch install it as the "
            "nvidia-cuda-nvrtc wheel: pip install nvidia-cuda-nvrtc (the same CUDA major as the driver)",
        ) from exc
    _nvrtc_check(nvrtc, "nvrtcVersion", err)
    return int(major), int(minor)


def nvrtc_unavailable_reason() -> str | None:
    """Why the setter kernels cannot be compiled here (None when NVRTC loads)."""
    try:
        nvrtc_version()
    except (ImportError, GraphRuntimeError) as exc:
        return str(exc)
    return None


def _nvrtc_check(nvrtc: Any, call: str, err: Any, log: str = "") -> None:
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


def _driver_check(driver: Any, call: str, err: Any) -> None:
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


def compile_source(source: str, arch: int) -> list[tuple[str, bytes]]:
    """Compile ``source`` for compute capability ``arch`` (e.g. 90); return loadable images.

    With NVRTC supporting ``sm_<arch>``: the PTX (JIT-compiled by the driver,
    as the feasibility run loaded it) first, then the CUBIN (needs no JIT: the
    fallback when the driver is older than NVRTC's PTX). Otherwise: the PTX
    of the newest virtual architecture NVRTC knows below ``arch``.

    Raises:
        GraphRuntimeError: the compilation failed (the NVRTC log is in the message).
    """
    _, nvrtc = _modules()
    err, supported = nvrtc.nvrtcGetSupportedArchs()
    _nvrtc_check(nvrtc, "nvrtcGetSupportedArchs", err)
    supported = sorted(int(a) for a in supported)
    exact = arch in supported
    target = arch if exact else max([a for a in supported if a <= arch] or [supported[0]])
    opt = f"--gpu-architecture={'sm' if exact else 'compute'}_{target}"
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"gfxgraph_setters.cu", 0, [], [])
    _nvrtc_check(nvrtc, "nvrtcCreateProgram", err)
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, 1, [opt.encode()])
        if int(getattr(err, "value", err)) != 0:
            _nvrtc_check(nvrtc, "nvrtcCompileProgram", err, _program_log(nvrtc, prog))
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
    _nvrtc_check(nvrtc, f"nvrtcGet{what}Size", err)
    buf = b" " * int(size)  # PTX: size counts the terminating NUL, which loading needs
    (err,) = getattr(nvrtc, f"nvrtcGet{what}")(prog, buf)
    _nvrtc_check(nvrtc, f"nvrtcGet{what}", err)
    return buf


def ensure_context(device: int) -> None:
    """Make ``device``'s primary context (the one PyTorch uses) current on this thread."""
    driver, _ = _modules()
    err, ctx = driver.cuCtxGetCurrent()
    _driver_check(driver, "cuCtxGetCurrent", err)
    if int(ctx) != 0:
        err, current = driver.cuCtxGetDevice()
        if int(getattr(err, "value", err)) == 0 and int(current) == device:
            return
    err, dev = driver.cuDeviceGet(device)
    _driver_check(driver, "cuDeviceGet", err)
    err, primary = driver.cuDevicePrimaryCtxRetain(dev)  # retained for the process: kernels live there
    _driver_check(driver, "cuDevicePrimaryCtxRetain", err)
    (err,) = driver.cuCtxSetCurrent(primary)
    _driver_check(driver, "cuCtxSetCurrent", err)


def setter_kernels(device: int | None = None) -> SetterKernels:
    """The setter kernels of ``device`` (default: current), compiled and loaded on first use.

    Thread-safe. Must not be called during a stream capture the first time
    for a device (module loading would invalidate a global-mode capture).

    Raises:
        ImportError: cuda-bindings is missing.
        GraphRuntimeError: NVRTC is missing or failed, or the driver refused every image.
    """
    dev = torch.cuda.current_device() if device is None else int(device)
    found = _loaded.get(dev)
    if found is not None:
        return found
    with _lock:
        found = _loaded.get(dev)
        if found is not None:
            return found
        driver, _ = _modules()
        torch.empty(1, device=f"cuda:{dev}")  # PyTorch creates the primary context first
        major, minor = torch.cuda.get_device_capability(dev)
        arch = 10 * major + minor
        images = _images.get(arch)
        if images is None:
            images = compile_source(KERNEL_SOURCE, arch)
            _images[arch] = images
        with torch.cuda.device(dev):
            ensure_context(dev)
            module, label = _load_first(driver, images)
        fns = []
        for name in _KERNELS:
            err, fn = driver.cuModuleGetFunction(module, name.encode())
            _driver_check(driver, "cuModuleGetFunction", err)
            fns.append(fn)
        kernels = SetterKernels(dev, label, *fns)
        _loaded[dev] = kernels
        logger.debug("gfxgraph: conditional setter kernels loaded on cuda:%d (%s)", dev, label)
        return kernels


def _load_first(driver: Any, images: Sequence[tuple[str, bytes]]) -> tuple[Any, str]:
    errors: list[str] = []
    for label, image in images:
        err, module = driver.cuModuleLoadData(image)
        try:
            _driver_check(driver, "cuModuleLoadData", err)
        except GraphRuntimeError as exc:
            errors.append(f"{label}: {exc}")
            continue
        return module, label
    raise GraphRuntimeError("cuModuleLoadData", "CUDA_ERROR_NO_LOADABLE_IMAGE", -1,
                            "the driver loaded none of the compiled setter images (" + "; ".join(errors)
                            + "); an NVRTC newer than the driver emits PTX the driver cannot JIT: "
                            "install the NVRTC of the driver's CUDA version")


def launch(fn: Any, args: Sequence[tuple[Any, Any]], stream: int, *, device: int, threads: int = 1) -> None:
    """Launch ``fn`` as one block of ``threads`` threads on the raw ``stream``; ``args`` are (ctypes type,
    value) pairs.

    During a capture the launch becomes a kernel node; its arguments are
    copied at launch, so they need not outlive this call.
    """
    driver, _ = _modules()
    ensure_context(device)
    values = [ctype(value) for ctype, value in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    (err,) = driver.cuLaunchKernel(fn, 1, 1, 1, threads, 1, 1, 0, driver.CUstream(int(stream)),
                                   ctypes.addressof(pointers), 0)
    _driver_check(driver, "cuLaunchKernel", err)
