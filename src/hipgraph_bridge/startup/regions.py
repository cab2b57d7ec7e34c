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

What a region asks of the layers: every call is the same computation, whatever
layer makes it (the layers' own parameters are its inputs). PyTorch guards each
call: a layer that differs (another size, a per-layer float attribute) is traced
inline, correct but without the saving. A ``StaticCache`` that the first compiled
call would set up must be set up before (an eager prefill does): PyTorch refuses
a region whose output aliases a tensor made inside it. ``piecewise=True`` does
not see attention inside a region, so its split finds no attention op and the
one piece is served at exact sizes: use one or the other.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["compile_regions"]


_SUBCLASSES: dict[type, type] = {}  # a class -> its region subclass: one region per class, however often bound


def compile_regions(layers: Iterable[torch.nn.Module]) -> int:
    """Bind every module of ``layers`` (all of one class, e.g. ``model.model.layers`` of a transformers
    decoder: an ``nn.ModuleList``, an ``nn.Sequential`` or a list) to one compile region; returns how many
    were bound. Call it before ``torch.compile``. Layers of a class bound before (here or in another
    call) share that class's region.

    Undo with ``layer.__class__ = type(layer)._gfxgraph_region_of``. ``state_dict()`` and ``deepcopy`` are
    unchanged; pickling a whole bound module (``torch.save(model)``) needs the binding undone first.
    Raises ``TypeError`` for anything but a non-empty sequence of modules of one class, and
    ``NotImplementedError`` on a torch without ``nested_compile_region``. Eagerly the region is a plain
    call (a fraction of a microsecond more per layer).
    """
    container = isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential))
    whole_module = isinstance(layers, torch.nn.Module) and not container
    mods = [] if whole_module else list(layers)
    if not mods or not all(isinstance(m, torch.nn.Module) for m in mods):
        raise TypeError(f"layers: expected a non-empty sequence (an nn.ModuleList, nn.Sequential or list) of "
                        f"modules of one class, got {type(layers).__name__}")
    originals = {getattr(type(m), "_gfxgraph_region_of", type(m)) for m in mods}
    if len(originals) != 1:
        raise TypeError(f"layers: expected modules of one class (one region serves them all), got "
                        f"{sorted(k.__name__ for k in originals)}")
    mark = getattr(torch.compiler, "nested_compile_region", None)
    if mark is None:
        raise NotImplementedError(f"compile_regions needs torch.compiler.nested_compile_region (torch >= 2.8); "
                                  f"this is PyTorch {torch.__version__}")
    cls = originals.pop()
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        # a subclass whose forward is the region: a region must be reached through the class (a forward bound
        # per instance, types.MethodType(region, layer), makes dynamo reuse one layer's weights for all)
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": mark(cls.forward), "_gfxgraph_region_of": cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    for m in mods:
        m.__class__ = sub
    return len(mods)
