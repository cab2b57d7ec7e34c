"""health_check() on this machine (the GPU variant is in test_gpu_graph_manager.py)."""

from __future__ import annotations

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
