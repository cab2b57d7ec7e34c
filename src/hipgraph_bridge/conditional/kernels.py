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

from dataclasses import dataclass
from typing import Any

import torch

from ..log import logger
from ..runtime.jit import KernelCache, compile_source, launch, nvrtc_unavailable_reason, nvrtc_version

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


def _make_kernels(device: int, label: str, fns: list[Any]) -> SetterKernels:
    logger.debug("gfxgraph: conditional setter kernels loaded on cuda:%d (%s)", device, label)
    return SetterKernels(device, label, *fns)


_cache = KernelCache(lambda arch: compile_source(KERNEL_SOURCE, arch, name="gfxgraph_setters.cu"), _KERNELS,
                     _make_kernels)


def setter_kernels(device: int | None = None) -> SetterKernels:
    """The setter kernels of ``device`` (default: current), compiled and loaded on first use.

    Thread-safe. Must not be called during a stream capture the first time
    for a device (module loading would invalidate a global-mode capture).

    Raises:
        ImportError: cuda-bindings is missing.
        GraphRuntimeError: NVRTC is missing or failed, or the driver refused every image.
    """
    return _cache.get(device)


