"""The public names: every name the README documents imports from ``gfxgraph`` (and from
``hipgraph_bridge`` where it did before the package was split into layers)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import gfxgraph
import hipgraph_bridge

README = Path(__file__).resolve().parents[1] / "README.md"

GFXGRAPH_NAMES = """
enable disable is_enabled stats reset_stats health_check BridgedCUDAGraph ShapeBucketPool default_buckets
gfxgraph_backend BackendOptions backend_stats compiled_subgraphs ConditionalGraph DeviceWhileLoop DeviceDecodeLoop LoopCondition
conditional_select GraphCompositor LaunchPipeline UpdatableGraph SwapResult UpdateResult GraphState ConfigError
GraphCaptureError GraphRuntimeError GraphsUnavailableError StaleOutputError __version__
""".split()

HIPGRAPH_BRIDGE_NAMES = """
BridgedCUDAGraph OriginalCUDAGraph GraphState ConfigError GraphCaptureError GraphRuntimeError
GraphsUnavailableError ShapeBucketPool default_buckets gfxgraph_backend BackendOptions backend_stats
compiled_subgraphs ConditionalGraph ConditionalState DeviceWhileLoop DeviceDecodeLoop LoopCondition ConditionalSupport
conditional_support conditional_select GraphCompositor CompositorState SwapResult StageCapture validate_dag
LaunchPipeline UpdatableGraph UpdateResult apply_update current_runtime get_runtime validate_buckets Platform
probe health_check graph_pool_bytes outputs_match tolerance_for __version__ SafeCUDAGraph GraphCapture
""".split()


@pytest.mark.parametrize("name", GFXGRAPH_NAMES)
def test_gfxgraph_exports(name):
    assert name in gfxgraph.__all__ and hasattr(gfxgraph, name)


@pytest.mark.parametrize("name", HIPGRAPH_BRIDGE_NAMES)
def test_hipgraph_bridge_exports(name):
    assert name in hipgraph_bridge.__all__ and hasattr(hipgraph_bridge, name)


def test_both_packages_export_the_same_objects():
    for name in set(GFXGRAPH_NAMES) & set(HIPGRAPH_BRIDGE_NAMES):
        assert getattr(gfxgraph, name) is getattr(hipgraph_bridge, name), name


def test_every_dotted_name_in_the_readme_resolves():
    text = README.read_text()
    refs = set(re.findall(r"\b((?:gfxgraph|hipgraph_bridge)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text))
    assert refs, "the README names no public objects"
    for ref in sorted(refs):
        parts = ref.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"README names {ref}, but {attr!r} is missing"
                obj = getattr(obj, attr)
            break


def test_importing_hipgraph_bridge_patches_nothing():
    import torch

    assert torch.cuda.CUDAGraph is hipgraph_bridge.OriginalCUDAGraph
