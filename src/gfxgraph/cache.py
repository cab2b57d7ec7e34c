"""Warm starts: ``gfxgraph.cache.save(path)`` / ``load(path)`` carry PyTorch's compile caches to the next
process (see :mod:`hipgraph_bridge.startup.cache`); ``save_compiled(path, fn, *example)`` /
``load_compiled(path)`` save a compiled function's traced frame too, so the next process runs no dynamo
(see :mod:`hipgraph_bridge.startup.frames`)."""

from hipgraph_bridge.startup.cache import hits, load, save, supported
from hipgraph_bridge.startup.frames import load_compiled, save_compiled

__all__ = ["save", "load", "hits", "supported", "save_compiled", "load_compiled"]
