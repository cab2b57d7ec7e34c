"""Compiling one dynamo subgraph: inductor (its own CUDA graphs off), ``aot_eager``, or as traced.

A subgraph that needs autograd (grad mode on, an input requiring grad) is compiled
with ``trees=True``: inductor then records its forward and backward graphs with its
CUDA-graph trees, as ``mode="reduce-overhead"`` does (``aot_eager``: dynamo's
``cudagraphs`` backend, the same trees over AOT autograd's graphs). The trees make
their graphs with ``torch.cuda.CUDAGraph``, gfxgraph's safe class once
``gfxgraph.enable()`` has swapped it in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import compile_fx, cpp_compiler_problem, is_dynamo_signal, lookup_backend
from ..log import log_once, logger
from .options import BackendOptions

__all__ = ["compile_graph"]


def compile_graph(gm: torch.fx.GraphModule, args: list[Any], opts: BackendOptions, *,
                  on_cpu: bool, trees: bool = False) -> tuple[Callable[..., Any], str, str]:
    """Compile ``gm`` with ``opts.compiler``; returns (function, compiler used, failure or "").

    ``trees``: graph the compiled function with CUDA-graph trees (forward and
    backward, a recording per shape), for subgraphs that need autograd; the
    ``"eager"`` compiler has no trees (the caller does not ask). An inductor
    failure falls back to the traced graph run as it is, without graphs (the
    caller records it as ``compile_failed``): a backend bug must not stop the model.
    """
    compiler = opts.compiler
    if compiler == "inductor" and on_cpu and (why := cpp_compiler_problem()):
        log_once(("gfxgraph-backend-no-cxx",), logging.WARNING,
                 "gfxgraph backend: inductor cannot build CPU kernels (%s); running the traced graphs "
                 "as they are (options={'compiler': 'eager'} silences this)", why)
        compiler = "eager"
    if compiler == "inductor":
        try:
            patches = opts.tree_patches() if trees else opts.inductor_patches()
            return compile_fx(gm, args, patches), "inductor", ""
        except Exception as exc:
            if is_dynamo_signal(exc):
                raise
            logger.warning("gfxgraph backend: inductor failed on a subgraph (%s: %s); it runs as traced, "
                           "without graphs", type(exc).__name__, exc)
            return gm.forward, "eager", f"inductor failed: {type(exc).__name__}: {exc}"
    if compiler == "aot_eager":
        # dynamo's "cudagraphs" backend: AOT autograd's graphs, run as traced, recorded by the trees (which
        # have nothing to record on a CPU: there the plain backend spares their "skipping" notice)
        return lookup_backend("cudagraphs" if trees and not on_cpu else "aot_eager")(gm, args), "aot_eager", ""
    return gm.forward, "eager", ""
