"""``health_check()``: can this process capture and replay a graph, and get it right?"""

from __future__ import annotations

import time
from typing import Any

import torch

from .config import read_runtime_kind, read_runtime_lib, read_vram_cap
from .errors import ConfigError
from .graph.bridged import SafeCUDAGraph
from .graph.capture import warm_up
from .platform import probe
from .runtime import current_runtime
from .runtime.device_launch import device_launch_unavailable_reason, find_cudadevrt

__all__ = ["health_check", "native_bridge_available", "config_problems", "device_launch_available"]


def native_bridge_available() -> tuple[bool, str]:
    """Whether the native runtime layer works here (graph nodes, exec update, conditional nodes); why not.

    True needs a runtime binding that loads *and* a GPU build of PyTorch for the
    same API with a visible device: the layer works on PyTorch's streams and
    captured graphs, so a runtime library that merely loads (``GFXGRAPH_RUNTIME=ctypes``
    finds a libcudart beside a CPU-only PyTorch) is reported False, with both facts.
    """
    try:
        rt = current_runtime()
    except Exception as exc:
        return False, str(exc)
    loaded = f"{rt.name} runtime via {rt.binding}"
    p = probe()
    if p.backend is None:
        return False, f"{loaded} loads, but there is no GPU for it to work on: {p.reason}"
    if rt.name != p.backend:
        return False, (f"{loaded} loads, but PyTorch is a {p.backend.upper()} build: the runtime "
                       f"layer must bind the {p.backend.upper()} runtime (check GFXGRAPH_LIB)")
    return True, loaded


def device_launch_available() -> tuple[bool, str]:
    """Whether device-side graph launch can be used here (CUDA 12+, NVRTC, nvJitLink, ``libcudadevrt.a``);
    the detail says where the library is, or why not (then the host launch path is used)."""
    try:
        why = device_launch_unavailable_reason(current_runtime())
    except Exception as exc:  # no runtime binding at all
        why = f"no runtime binding: {exc}"
    if why is not None:
        return False, why
    return True, f"available (libcudadevrt: {find_cudadevrt()})"


def config_problems() -> list[str]:
    """The environment variables read at use (not at import) that hold a bad value, each with why.

    A bad value there raises :class:`ConfigError` where it is used (every
    ``ShapeBucketPool`` for ``GFXGRAPH_VRAM_CAP``, the runtime layer for the others).
    """
    problems = []
    for read in (read_vram_cap, read_runtime_kind, read_runtime_lib):
        try:
            read()
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def _graph_round_trip() -> dict[str, Any]:
    """Capture y = x * 2 + 1, replay it on three inputs, compare with eager."""
    x = torch.zeros(1024, device="cuda")
    g = SafeCUDAGraph()
    stream = torch.cuda.Stream()
    warm_up(lambda: x * 2 + 1, stream, 1)  # off the default stream, as capture needs
    t0 = time.perf_counter()
    # not torch.cuda.graph: its device-wide sync would break a capture running in another thread
    with g.capturing(stream=stream, capture_error_mode="thread_local"):
        y = x * 2 + 1
    capture_us = (time.perf_counter() - t0) * 1e6
    worst = 0.0
    replay_ns = []
    for seed in range(3):
        src = torch.randn(1024, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        x.copy_(src)
        t1 = time.perf_counter_ns()
        g.replay()
        replay_ns.append(time.perf_counter_ns() - t1)
        torch.cuda.current_stream().synchronize()
        worst = max(worst, (y - (src * 2 + 1)).abs().max().item())
    g.reset()
    return {"capture_us": capture_us, "replay_us": min(replay_ns) / 1000.0, "max_abs_error": worst}


def health_check() -> dict[str, Any]:
    """Report on GPU graph support; on a GPU, capture, replay and verify a small graph.

    Keys: ``ok``, ``gpu``, ``arch`` (``rocm``: its older name, kept), ``backend``
    (``"cuda"``, ``"hip"`` or None), ``native_bridge``, ``vram_total_mb``,
    ``vram_free_mb``, ``torch``, ``runtime_version``, ``config_errors`` (bad
    ``GFXGRAPH_VRAM_CAP``/``GFXGRAPH_RUNTIME``/``GFXGRAPH_LIB`` values: any makes
    ``ok`` False), ``details`` (a list of human-readable findings; when ``ok``
    is False the first says why).
    Cost: on a GPU, one small capture and three replays (milliseconds).
    """
    report = _device_report()
    problems = config_problems()
    report["config_errors"] = problems
    if problems:
        report["ok"] = False
        report["details"][:0] = [f"configuration: {why}" for why in problems]
    return report


def _device_report() -> dict[str, Any]:
    """The device part of :func:`health_check`: platform, native bridge, the graph round trip."""
    p = probe()
    native, native_detail = native_bridge_available()
    report: dict[str, Any] = {
        "ok": False,
        "gpu": p.device_name,
        "arch": p.arch,
        "rocm": p.arch,  # the arch key's older name, kept for code that reads it
        "backend": p.backend,
        "native_bridge": native,
        "vram_total_mb": None,
        "vram_free_mb": None,
        "torch": p.torch_version,
        "runtime_version": p.runtime_version,
        "details": [],
    }
    details: list[str] = report["details"]
    report["device_launch"], launch_detail = device_launch_available()
    if p.backend is None:
        details.append(p.reason or "no GPU backend")
        details.append(f"native bridge: {native_detail}")
        details.append(f"device-side graph launch: {launch_detail}")
        return report
    free, total = torch.cuda.mem_get_info()
    report["vram_total_mb"] = round(total / 2**20, 1)
    report["vram_free_mb"] = round(free / 2**20, 1)
    try:
        trip = _graph_round_trip()
    except Exception as exc:
        details.append(f"graph capture/replay failed: {type(exc).__name__}: {exc}")
    else:
        report.update(trip)
        if trip["max_abs_error"] == 0.0:
            report["ok"] = True
            details.append(f"captured and replayed a graph on {p.device_name} ({p.arch}); "
                           "replays matched eager exactly")
        else:
            details.append(f"graph replay differed from eager by {trip['max_abs_error']:.3g}")
    details.append(f"native bridge: {native_detail}")
    details.append(f"device-side graph launch: {launch_detail}")
    return report
