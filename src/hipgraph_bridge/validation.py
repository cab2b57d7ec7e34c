"""Graph output vs eager output, with tolerances chosen by dtype.

Replays run the same kernels as eager, but padded batches and different
batch sizes can select different GEMM algorithms, so floating-point results
may differ in the last bits. The tolerances below admit that and nothing
more; integer and boolean outputs must match exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from . import stats
from ._torch_compat import pytree
from .log import log_once

__all__ = ["Tolerance", "tolerance_for", "outputs_match", "checked_against_eager", "padding_changed"]


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


# relative-norm tolerance of the padding check: well above rounding (GEMMs of two sizes sum in
# different orders), well below what one changed row does to an output
_PADDING_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def padding_changed(padded: Any, unpadded: Any) -> str:
    """Why a padded result differs from an unpadded one beyond rounding ("" when they agree).

    Compared by relative norm per output, so GEMMs of two sizes summing in
    different orders do not count, while one changed row does. Costs a host
    sync and a float64 copy of each output.
    """
    a_leaves, a_spec = pytree.tree_flatten(padded)
    b_leaves, b_spec = pytree.tree_flatten(unpadded)
    if a_spec != b_spec:
        return f"output structure {a_spec} vs {b_spec}"
    for k, (a, b) in enumerate(zip(a_leaves, b_leaves)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {k}: {a!r} vs {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {k}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return f"output {k}: integer values differ"
            continue
        wide = torch.complex128 if a.is_complex() else torch.float64
        fa, fb = a.detach().to(wide), b.detach().to(wide)
        finite = torch.isfinite(fb)
        if not torch.equal(torch.isfinite(fa), finite):
            return f"output {k}: non-finite values in different places"
        fa, fb = fa[finite], fb[finite]
        rel = ((fa - fb).norm() / fb.norm().clamp_min(1e-30)).item()
        if rel > _PADDING_RTOL.get(a.dtype, 1e-3):
            return f"output {k}: relative difference {rel:.3g}"
    return ""
