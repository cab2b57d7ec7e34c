"""health_check() on this machine (the GPU variant is in test_gpu_graph_manager.py)."""

from __future__ import annotations

import types

import pytest

import gfxgraph
from conftest import GPU_SKIP_REASON


@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="CPU-only behaviour")
def test_cpu_only_health_says_why():
    report = gfxgraph.health_check()
    assert report["ok"] is False
    assert report["backend"] is None and report["gpu"] is None
    assert report["arch"] is None and report["rocm"] is None
    assert report["vram_total_mb"] is None
    assert "CPU-only build" in report["details"][0] or "no GPU" in report["details"][0]


def test_bad_config_makes_an_otherwise_healthy_report_not_ok(monkeypatch):
    from hipgraph_bridge import health

    monkeypatch.setattr(health, "_device_report", lambda: {"ok": True, "details": ["replays matched eager"]})
    monkeypatch.setenv("GFXGRAPH_VRAM_CAP", "half")
    report = health.health_check()
    assert report["ok"] is False
    assert report["details"][0].startswith("configuration: GFXGRAPH_VRAM_CAP='half': expected a fraction")
    assert report["details"][1:] == ["replays matched eager"]
    monkeypatch.delenv("GFXGRAPH_VRAM_CAP")
    report = health.health_check()
    assert report["ok"] is True and report["config_errors"] == []


def test_native_bridge_needs_a_gpu_of_the_runtimes_api(monkeypatch):
    from hipgraph_bridge import health
    from hipgraph_bridge.platform import Platform

    monkeypatch.setattr(health, "current_runtime",
                        lambda: types.SimpleNamespace(name="cuda", binding="ctypes libcudart.so.13"))

    def on(backend):
        reason = None if backend else "PyTorch 2.13.0+cpu is a CPU-only build"
        monkeypatch.setattr(health, "probe", lambda: Platform(backend, "2.13", None, int(bool(backend)),
                                                               "GPU" if backend else None, None, reason))
        return health.native_bridge_available()

    ok, why = on(None)
    assert ok is False and "cuda runtime via ctypes libcudart.so.13 loads, but there is no GPU" in why
    assert "CPU-only build" in why
    ok, why = on("hip")
    assert ok is False and "PyTorch is a HIP build" in why
    assert on("cuda") == (True, "cuda runtime via ctypes libcudart.so.13")


@pytest.mark.skipif(GPU_SKIP_REASON is None, reason="CPU-only behaviour")
def test_forced_ctypes_runtime_on_cpu_torch_is_not_a_native_bridge(monkeypatch):
    from hipgraph_bridge.runtime import reset_runtime_cache

    monkeypatch.setenv("GFXGRAPH_RUNTIME", "ctypes")
    reset_runtime_cache()
    try:
        report = gfxgraph.health_check()
    finally:
        reset_runtime_cache()
    assert report["native_bridge"] is False
    detail = next(d for d in report["details"] if d.startswith("native bridge: "))
    # with a libcudart on the machine the binding loads, and the report says why it is no bridge
    assert "loads, but there is no GPU" in detail or "could not find" in detail
