"""Compile a repeated layer once: its instances bound to one ``torch.compiler.nested_compile_region``.

Dynamo traces a model's forward op by op, so a 16-layer decoder costs 16 layers
of tracing and 16 of inductor's compile. PyTorch's ``nested_compile_region``
(torch >= 2.8) marks a function whose calls are traced once and reused: the
compiled graph calls that one subgraph (``invoke_subgraph``) for every layer.
:func:`compile_regions` binds each given layer's ``forward`` to one such region
(the instances get a subclass whose ``forward`` is the region; their class
itself is left alone, and other instances of it are untouched). The gfxgraph backend
follows the batch into the region and its row analysis traces the region's ops,
so the graph is padded where rows are independent, as an inlined one would be.

What a region requires (PyTorch's rule, not checked here): every call of it is
the same computation, whatever layer calls it (the layers' own parameters are
its inputs), with no Python side effects that differ between calls.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["compile_regions"]


def compile_regions(layers: Iterable[torch.nn.Module]) -> int:
    """Bind every module of ``layers`` (all of one class, e.g. ``model.model.layers`` of a transformers
    decoder) to one compile region; returns how many were bound. Call it before ``torch.compile``.

    Undo with ``layer.__class__ = type(layer)._gfxgraph_region_of``. ``state_dict()`` is unchanged;
    pickling a whole bound module (``torch.save(model)``) needs the binding undone first. Raises ``TypeError`` for anything but a non-empty sequence of
    modules of one class, and ``NotImplementedError`` on a torch without ``nested_compile_region``.
    Costs nothing at run time outside a compile (eagerly the region is a plain call).
    """
    whole_module = isinstance(layers, torch.nn.Module) and not isinstance(layers, torch.nn.ModuleList)
    mods = [] if whole_module else list(layers)
    if not mods or not all(isinstance(m, torch.nn.Module) for m in mods):
        raise TypeError(f"layers: expected a non-empty sequence (e.g. an nn.ModuleList) of modules of one class, "
                        f"got {type(layers).__name__}")
    kinds = {type(m) for m in mods}
    if len(kinds) != 1:
        raise TypeError(f"layers: expected modules of one class (one region serves them all), got "
                        f"{sorted(k.__name__ for k in kinds)}")
    mark = getattr(torch.compiler, "nested_compile_region", None)
    if mark is None:
        raise NotImplementedError(f"compile_regions needs torch.compiler.nested_compile_region (torch >= 2.8); "
                                  f"this is PyTorch {torch.__version__}")
    cls = kinds.pop()
    if getattr(cls, "_gfxgraph_region_of", None) is not None:  # bound already: nothing to do
        return len(mods)
    # a subclass whose forward is the region: a region must be reached through the class (a forward bound
    # per instance, types.MethodType(region, layer), makes dynamo reuse one layer's weights for all)
    sub = type(cls.__name__, (cls,), {"forward": mark(cls.forward), "_gfxgraph_region_of": cls,
                                      "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    for m in mods:
        m.__class__ = sub
    return len(mods)
