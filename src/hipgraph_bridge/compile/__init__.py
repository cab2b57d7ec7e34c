"""``torch.compile(model, backend="gfxgraph")``: inductor kernels replayed through batch-bucket graphs."""

from __future__ import annotations

from .backend import BACKEND_NAMES, backend_stats, compiled_subgraphs, gfxgraph_backend, register, reset_backend
from .options import BackendOptions
from .subgraph import CompiledSubgraph, SubgraphState

__all__ = ["gfxgraph_backend", "BackendOptions", "backend_stats", "compiled_subgraphs", "register", "reset_backend",
           "BACKEND_NAMES", "CompiledSubgraph", "SubgraphState"]
