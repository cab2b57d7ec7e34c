"""A toy inference 'server' package, to show ``gfxgraph run -m examples.toy_server``."""
