"""Device-side graph launch (CUDA 12+): executable graphs that a kernel launches, and those kernels.

CUDA lets a kernel running inside a graph launch another executable graph
(``cudaGraphLaunch`` in device code). The launched graph must have been
instantiated with ``cudaGraphInstantiateFlagDeviceLaunch`` and uploaded, and
its nodes may only be kernels, copies and memsets between device memory, and
child graphs; it may not be launched from the device while a launch of it is
running (``cudaErrorInvalidValue``); a graph may queue at most 255 tail
launches and 120 fire-and-forget launches per execution; and it may be updated
only from the host, then uploaded again (CUDA C++ Programming Guide, "Device
Graph Launch"; the capability table cites it row by row).

A kernel that calls ``cudaGraphLaunch`` is relocatable device code linked
against the CUDA device runtime, ``libcudadevrt.a``. gfxgraph compiles its two
launchers with NVRTC (``--relocatable-device-code=true``; NVRTC declares the
device runtime's API itself), links them with nvJitLink against the
``libcudadevrt.a`` that ``cuda.pathfinder`` finds (the CUDA toolkit, or the
``nvidia-cuda-runtime`` wheel that CUDA builds of PyTorch install), once per
process and architecture, and loads them once per device. Both launch with
``cudaStreamGraphTailLaunch``: the launched graph runs when the launching
graph has finished, and work queued after the launching graph on its stream
waits for it, so a device launch is ordered like a host launch.

* ``gfxgraph_launch_one(execs, index, status)``: tail-launch ``execs[index]``.
* ``gfxgraph_launch_bucket(n, sizes, execs, count, chosen, status)``: tail-launch
  the graph of the smallest of the ascending ``sizes`` that holds ``n[0]`` rows;
  an ``n`` outside ``[1, sizes[count - 1]]`` launches ``execs[count]`` instead (a
  graph that zero-fills the outputs) and records ``OUT_OF_RANGE`` in ``status``.

``status[0]`` keeps the first error: ``cudaGraphLaunch``'s code, or ``OUT_OF_RANGE``.
HIP has no device-side graph launch (ROCm/hip#3160): everything here refuses
it with that reason, and callers keep the host path.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GraphRuntimeError
from ..log import logger
from ._base import Runtime
from .jit import KernelCache, compile_source, link_cubin, nvjitlink_unavailable_reason, nvrtc_unavailable_reason, \
    nvrtc_version

__all__ = ["DEVICE_LAUNCH_FLAG", "OUT_OF_RANGE", "LAUNCHER_SOURCE", "LauncherKernels", "launcher_kernels",
           "find_cudadevrt", "device_launch_unavailable_reason", "HIP_NO_DEVICE_LAUNCH"]

DEVICE_LAUNCH_FLAG = 4  # cudaGraphInstantiateFlagDeviceLaunch
OUT_OF_RANGE = -1  # status: a device-sized call's n was outside [1, largest bucket]
HIP_NO_DEVICE_LAUNCH = ("HIP has no device-side graph launch (requested in ROCm/hip#3160; AMD pointed to host "
                        "hipGraphLaunch): the host path is used")

LAUNCHER_SOURCE = r"""
/* cudaGraphLaunch, cudaGraphExec_t and cudaStreamGraphTailLaunch: NVRTC's built-in device runtime API. */
__device__ static void gfxgraph_note(int* status, int code) {
    atomicCAS(status, 0, code);  /* keep the first error */
}

extern "C" __global__ void gfxgraph_launch_one(const unsigned long long* execs, int index, int* status) {
    const cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)execs[index], cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) gfxgraph_note(status, (int)err);
}

extern "C" __global__ void gfxgraph_launch_bucket(const long long* n, const long long* sizes,
                                                  const unsigned long long* execs, int count,
                                                  long long* chosen, int* status) {
    const long long rows = n[0];
    int pick = count;
    if (rows >= 1) {
        for (int i = 0; i < count; ++i) {
            if (sizes[i] >= rows) { pick = i; break; }
        }
    }
    chosen[0] = pick < count ? sizes[pick] : 0;
    if (pick == count) gfxgraph_note(status, -1);
    const cudaError_t err = cudaGraphLaunch((cudaGraphExec_t)execs[pick], cudaStreamGraphTailLaunch);
    if (err != cudaSuccess) gfxgraph_note(status, (int)err);
}
"""

_NAMES = ("gfxgraph_launch_one", "gfxgraph_launch_bucket")


def find_cudadevrt() -> str | None:
    """The path of ``libcudadevrt.a``, or None.

    Looks where ``cuda.pathfinder`` looks (``CUDA_HOME``/``CUDA_PATH``, the
    toolkit, NVIDIA's wheels), then in the ``nvidia`` wheels' ``lib`` folders
    of this interpreter (``nvidia/cu13/lib``, ``nvidia/cuda_runtime/lib``).
    """
    try:
        from cuda import pathfinder

        return str(pathfinder.find_static_lib("cudadevrt"))
    except Exception:  # not installed, or not found there: look in the wheels ourselves
        pass
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    try:  # the wheel of NVRTC's CUDA major first: nvJitLink links a device runtime of its own major
        major = nvrtc_version()[0]
    except Exception:
        major = 13
    subs = sorted(("cu13/lib", "cu12/lib", "cuda_runtime/lib"),
                  key=lambda sub: not (sub.startswith(f"cu{major}/") or (major == 12 and sub.startswith("cuda_"))))
    for root in roots:
        for sub in subs:
            path = os.path.join(root, sub, "libcudadevrt.a")
            if os.path.isfile(path):
                return path
    return None


def device_launch_unavailable_reason(runtime: Runtime) -> str | None:
    """Why device-side launch cannot be used with ``runtime`` here (None when everything it needs is present:
    CUDA runtime and driver 12.0+, a GPU, NVRTC, nvJitLink and ``libcudadevrt.a``). Cheap: finds and loads
    libraries, compiles nothing."""
    if runtime.name != "cuda":
        return HIP_NO_DEVICE_LAUNCH
    caps = runtime.capabilities
    if caps.runtime_version < 12000 or caps.driver_version < 12000:
        return (f"device-side graph launch needs CUDA 12.0 (runtime {caps.runtime_version}, driver "
                f"{caps.driver_version}): the host path is used")
    if not torch.cuda.is_available():
        return "device-side graph launch needs a CUDA GPU; none is visible"
    for why in (nvrtc_unavailable_reason(), nvjitlink_unavailable_reason()):
        if why is not None:
            return f"device-side graph launch needs NVRTC and nvJitLink: {why}"
    if find_cudadevrt() is None:
        return ("device-side graph launch needs the CUDA device runtime library libcudadevrt.a, found neither "
                "through cuda.pathfinder (CUDA_HOME, CUDA_PATH, the toolkit) nor in the nvidia wheels: pip install "
                "nvidia-cuda-runtime (the CUDA major of the driver) or set CUDA_HOME: the host path is used")
    return None


@dataclass(frozen=True)
class LauncherKernels:
    """The loaded launcher kernels of one device (driver ``CUfunction`` objects)."""

    device: int
    image: str
    launch_one: Any
    launch_bucket: Any


def _link(arch: int) -> list[tuple[str, bytes]]:
    """The launchers compiled with -rdc for ``arch`` and linked with ``libcudadevrt.a``: one cubin."""
    devrt = find_cudadevrt()
    if devrt is None:
        raise GraphRuntimeError("find_static_lib", "CUDADEVRT_NOT_FOUND", -1,
                                "libcudadevrt.a not found: pip install nvidia-cuda-runtime or set CUDA_HOME")
    images = dict(compile_source(LAUNCHER_SOURCE, arch, name="gfxgraph_launchers.cu",
                                 options=("--relocatable-device-code=true",)))
    cubin = images.get(f"cubin sm_{arch}")
    if cubin is None:
        raise GraphRuntimeError("nvrtcGetSupportedArchs", "NVRTC_ARCH_UNSUPPORTED", -1,
                                f"this NVRTC cannot emit code for sm_{arch}; device launch needs a "
                                "relocatable cubin for the device's own architecture")
    return [(f"linked cubin sm_{arch}", link_cubin(cubin, arch, libraries=(devrt,)))]


def _make_kernels(device: int, label: str, fns: list[Any]) -> LauncherKernels:
    logger.debug("gfxgraph: device-launch kernels loaded on cuda:%d (%s)", device, label)
    return LauncherKernels(device, label, *fns)


_cache = KernelCache(_link, _NAMES, _make_kernels)


def launcher_kernels(device: int | None = None) -> LauncherKernels:
    """The launcher kernels of ``device`` (default: current), compiled, linked and loaded on first use.

    Thread-safe. The first call for a device must not happen during a stream
    capture (loading a module would invalidate it). Cost of the first call:
    an NVRTC compile and an nvJitLink link (a few hundred ms); later: a dict read.

    Raises:
        GraphRuntimeError: NVRTC, nvJitLink or ``libcudadevrt.a`` is missing, or a step failed.
        ImportError: cuda-bindings is missing.
    """
    return _cache.get(device)
