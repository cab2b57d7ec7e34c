"""The high-level, eager-fallback API: ``BridgedCUDAGraph.capture(model_fn=...)`` and ``replay(input_tensor=...)``."""

from __future__ import annotations

from .graph import BridgedCUDAGraph

__all__ = ["BridgedCUDAGraph"]
