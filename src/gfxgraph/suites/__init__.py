"""The benchmark suites that ``gfxgraph bench`` runs, shipped with the package.

Each public module here (a name without a leading underscore) is one suite, run in a fresh
interpreter as ``python -m gfxgraph.suites.NAME --out DIR [--quick]``; it writes
``DIR/NAME.json`` through :func:`gfxgraph.suites._common.write` (environment, figures with
their targets, and whatever extra data its plots need). ``gfxgraph bench --list`` finds the
suites by listing this package, without importing them.

A suite:

* imports only the package, absolutely (``from gfxgraph.suites._common import figure, parser,
  write``; another suite's helpers as ``from gfxgraph.suites.shape_bucketing import ...``),
  never by a plain module name or through ``sys.path``;
* does nothing at import time beyond imports and constants: no CUDA call, no model built, no
  environment variable set (``main()`` does those), so listing and importing work on CPU;
* imports optional dependencies (transformers, cuda-bindings) inside the function that needs
  them, with a one-line reason;
* ends with ``if __name__ == "__main__": main()``, and starts any child interpreter of its own
  as ``[sys.executable, "-m", "gfxgraph.suites.NAME", ...]`` with ``env=child_env()``.
"""
