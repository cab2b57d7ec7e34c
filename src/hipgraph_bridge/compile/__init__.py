"""``torch.compile(model, backend="gfxgraph")``: inductor kernels replayed through batch-bucket graphs,
or, with ``options={"piecewise": True}``, pieces between attention ops graphed per token bucket."""

from __future__ import annotations

from .backend import (
    BACKEND_NAMES,
    backend_stats,
    compiled_subgraphs,
    gfxgraph_backend,
    piecewise_stats,
    register,
    reset_backend,
)
from .options import BackendOptions
from .piecewise import PiecewiseSubgraph
from .splitting import DEFAULT_SPLITTING_OPS
from .subgraph import CompiledSubgraph, SubgraphState

__all__ = ["gfxgraph_backend", "BackendOptions", "backend_stats", "piecewise_stats", "compiled_subgraphs",
           "register", "reset_backend", "BACKEND_NAMES", "CompiledSubgraph", "PiecewiseSubgraph", "SubgraphState",
           "DEFAULT_SPLITTING_OPS"]
