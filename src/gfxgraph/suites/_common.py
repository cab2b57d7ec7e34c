"""Shared pieces of the benchmark suites: environment record, figures with targets, output."""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from hipgraph_bridge._torch_compat import gpu_sleep


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "hip_runtime": getattr(torch.version, "hip", None),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        env["cuda_bindings"] = version("cuda-bindings")
    except PackageNotFoundError:
        env["cuda_bindings"] = None
    if torch.cuda.is_available():
        try:
            from cuda.bindings import runtime as cudart  # optional: the cuda extra

            err, drv = cudart.cudaDriverGetVersion()
            env["driver_api_version"] = drv
        except Exception:
            pass
    return env


def figure(name: str, value: float, target: str | None, passed: bool | None, unit: str = "",
           note: str = "") -> dict[str, Any]:
    """One reported number beside its target (target None: reported, no target)."""
    return {"name": name, "value": value, "unit": unit, "target": target, "pass": passed, "note": note}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``fn()`` between two device syncs, and its result."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def capture_graph(fn: Callable[[], Any], *, calls: int = 1, warmups: int = 1) -> torch.cuda.CUDAGraph:
    """A raw ``torch.cuda.CUDAGraph`` of ``calls`` calls of ``fn``, after ``warmups`` eager calls on a side
    stream (as PyTorch's own capture warms up): a baseline or a piece to time, no gfxgraph in it."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def gpu_ms_per_replay(replay: Callable[[], Any], n: int) -> float:
    """GPU milliseconds per call of ``replay`` (a graph's replay), ``n`` calls queued behind a GPU sleep that
    outlasts queueing them (measured on 8 calls first), so that the CUDA events around them time the GPU's
    work back to back, not the host's launches. ``RuntimeError`` where torch has no sleep kernel."""
    t0 = time.perf_counter()
    for _ in range(8):
        replay()
    queue_s = (time.perf_counter() - t0) / 8 * n
    torch.cuda.synchronize()
    _sleep(int((2 * queue_s + 0.005) * _cycles_per_s()))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _sleep(cycles: int) -> None:
    if not gpu_sleep(cycles):
        raise RuntimeError("gpu_ms_per_replay: this torch has no GPU sleep kernel (torch.cuda._sleep), so the "
                           "replays cannot be queued ahead of the GPU")


@functools.cache
def _cycles_per_s() -> float:
    """The GPU's clock cycles per second as its sleep kernel counts them (timed once per process)."""
    _sleep(1000)  # loaded
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / (start.elapsed_time(end) / 1e3)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default="bench-out", help="folder for the JSON (default: bench-out)")
    p.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    return p


def write(out_dir: str, name: str, figures: list[dict[str, Any]], extra: dict[str, Any], *,
          env: dict[str, Any] | None = None) -> Path:
    """``out_dir/name.json`` (environment, figures, ``extra``) and its table on stdout. ``env``: the
    environment to record instead of this process's (a report merged from runs made elsewhere)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "environment": environment() if env is None else env, "figures": figures, **extra}
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, default=str))
    print(table(name, figures))
    print(f"wrote {path}")
    return path


def write_diagnostic(out_dir: str, name: str, fields: dict[str, Any]) -> str:
    """``out_dir/name.json``: a diagnostic's results (no figures, no targets) after the GPU's name and
    torch's version; returns the path, also printed."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **fields}, f, indent=1)
    print(f"wrote {path}")
    return path


def table(name: str, figures: list[dict[str, Any]]) -> str:
    rows = [f"## {name}", "", "| figure | value | target | result |", "|---|---|---|---|"]
    for f in figures:
        v = f["value"]
        val = f"{v:.4g} {f['unit']}".strip() if isinstance(v, (int, float)) else str(v)
        res = "-" if f["pass"] is None else ("pass" if f["pass"] else "MISS")
        rows.append(f"| {f['name']} | {val} | {f['target'] or '-'} | {res} |")
    return "\n".join(rows)


def package_root() -> Path:
    """The folder that holds the ``gfxgraph`` package (``src/`` in a checkout, site-packages when installed)."""
    return Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child interpreter that must import this same gfxgraph."""
    path = os.pathsep.join(p for p in (str(package_root()), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
