"""Graph output vs eager output, with tolerances chosen by dtype.

Replays run the same kernels as eager, but padded batches and different
batch sizes can select different GEMM algorithms, so floating-point results
may differ in the last bits. The tolerances below admit that and nothing
more; integer and boolean outputs must match exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import stats
from ._torch_compat import pytree
from .log import log_once

__all__ = ["Tolerance", "tolerance_for", "outputs_match", "checked_against_eager"]


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7, 1e-7),
    torch.float32: Tolerance(1e-4, 1e-5),
    torch.float16: Tolerance(1e-2, 1e-3),
    torch.bfloat16: Tolerance(5e-2, 1e-2),
    torch.complex64: Tolerance(1e-4, 1e-5),
    torch.complex128: Tolerance(1e-7, 1e-7),
}
_EXACT = Tolerance(0.0, 0.0)


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """Tolerance used for ``dtype`` (exact for integers, bools and 8-bit floats' bit patterns)."""
    return _TOLERANCES.get(dtype, _EXACT if not dtype.is_floating_point else Tolerance(1e-1, 1e-1))


def outputs_match(graph_out: object, eager_out: object) -> tuple[bool, str]:
    """Compare two output pytrees leaf by leaf. Returns (match, first difference)."""
    g_leaves, g_spec = pytree.tree_flatten(graph_out)
    e_leaves, e_spec = pytree.tree_flatten(eager_out)
    if g_spec != e_spec:
        return False, f"output structure differs: graph {g_spec} vs eager {e_spec}"
    for i, (g, e) in enumerate(zip(g_leaves, e_leaves)):
        if isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor):
            if g.shape != e.shape or g.dtype != e.dtype:
                return False, (f"leaf {i}: graph {tuple(g.shape)} {g.dtype} vs eager "
                               f"{tuple(e.shape)} {e.dtype}")
            tol = tolerance_for(g.dtype)
            if not torch.allclose(g, e.to(g.device), rtol=tol.rtol, atol=tol.atol, equal_nan=True):
                diff = (g.double() - e.to(g.device).double()).abs().max().item()
                return False, f"leaf {i}: max abs difference {diff:.3g} (rtol {tol.rtol}, atol {tol.atol})"
        elif g != e:
            return False, f"leaf {i}: graph {g!r} vs eager {e!r}"
    return True, ""


def checked_against_eager(graph_out: object, eager_out: object, *, owner: object, what: str) -> object:
    """Validation mode's rule: count the comparison; on a mismatch log it once per ``owner``
    and return the eager result, else the graph's."""
    ok, why = outputs_match(graph_out, eager_out)
    stats.record_validation(ok)
    if ok:
        return graph_out
    log_once(("validation", id(owner)), logging.WARNING,
             "gfxgraph: %s replay differs from eager (%s); returning the eager result", what, why)
    return eager_out
