"""``torch.compile(model, backend="gfxgraph")``: inductor kernels replayed through batch-bucket graphs,
or, with ``options={"piecewise": True}``, pieces between attention ops graphed per token bucket."""

from __future__ import annotations

from .backend import (
    BACKEND_NAMES,
    Backend,
    backend_stats,
    compiled_subgraphs,
    gfxgraph_backend,
    piecewise_stats,
    register,
    reset_backend,
    trees_stats,
)
from .options import BackendOptions
from .piecewise import PiecewiseSubgraph
from .splitting import DEFAULT_SPLITTING_OPS
from .subgraph import CompiledSubgraph, SubgraphState

# ``backend()`` (the function) is not re-exported here: it would hide the submodule ``.backend``
__all__ = ["gfxgraph_backend", "Backend", "trees_stats", "BackendOptions", "backend_stats", "piecewise_stats", "compiled_subgraphs",
           "register", "reset_backend", "BACKEND_NAMES", "CompiledSubgraph", "PiecewiseSubgraph", "SubgraphState",
           "DEFAULT_SPLITTING_OPS"]
