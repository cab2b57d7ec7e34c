"""Warm starts through PyTorch's compile caches: ``gfxgraph.cache.save(path)`` after the warm-up,
``gfxgraph.cache.load(path)`` in the next process before its first compile (see
:mod:`hipgraph_bridge.startup.cache`)."""

from hipgraph_bridge.startup.cache import hits, load, save, supported

__all__ = ["save", "load", "hits", "supported"]
