"""The ``gfxgraph`` torch.compile backend: inductor kernels, replayed through batch-bucket graphs.

``torch.compile(model, backend="gfxgraph")`` (alias ``"hipgraph_bridge"``)
compiles each dynamo subgraph with inductor, *without* inductor's own CUDA
graphs, and serves it through a :class:`~hipgraph_bridge.ShapeBucketPool`:
one graph per batch-size bucket, padded inputs, one memory pool per subgraph.
``mode="reduce-overhead"`` records a graph per distinct shape instead; on a
stream of batch sizes 1..256 that is hundreds of recordings.

Finding the backend: the distribution declares both names in the entry-point
group ``torch_dynamo_backends``, which dynamo scans the first time it meets
an unknown backend name, so nothing has to be imported first. :func:`register`
(called by ``gfxgraph.enable()``) also registers the names, but only when
``torch._dynamo`` is already imported: importing it costs over a second, and
the entry point covers every installed copy. From a source checkout that is
not installed, import ``torch._dynamo`` before ``register()``/``enable()``.

Per subgraph (:mod:`.subgraph`): inductor kernels (its own CUDA graphs off)
served through a :class:`~hipgraph_bridge.ShapeBucketPool`. A subgraph that
needs autograd (grad mode on and an input, such as a parameter, requiring grad)
is graphed as ``mode="reduce-overhead"`` graphs it instead: inductor's CUDA-graph
trees, forward and backward, a recording per shape (on gfxgraph's safe graph
class while ``gfxgraph.enable()`` is on). Where a graph would
be wrong or impossible the subgraph runs compiled without graphs and says why:
training with ``compiler="eager"``, an input the graph
mutates, the batch size used as a value, rows that depend on each other (the
first padded call is compared with an unpadded run), a padded call of a
subgraph that writes to its parameters or buffers, CPU tensors when a GPU is
present, non-contiguous batched inputs, more than ``max_variants`` variants.
A subgraph whose FX graph calls torch.distributed collectives is graphed
only with ``options={"process_group": group}`` (reason ``collectives``
otherwise): its pools then agree with the other ranks, and so does its
choice to graph. Without a GPU the pool runs its padded pipeline eagerly, so the whole path is
exercised on CPU. ``gfxgraph.enable(validate=True)`` compares every call with
an unpadded run and returns the latter.

Dynamic batch, and how many compilations: dynamo first compiles for the first
batch size it sees, then, when the size changes, once more with the batch
symbolic (automatic dynamic shapes), and once for size 1 if size 1 comes later
(dynamo specialises it). ``torch._dynamo.mark_dynamic(x, batch_dim)`` on the
first input (or ``dynamic=True``) skips the first specialised frame. Only the
symbolic frame is compiled up front (step 2): a stream of sizes 1..256 costs
one inductor compilation, plus one for each specialised frame called again.

What it will not do: prove that rows are independent (a dependence that the
first padded call does not show slips through: use validate mode when in
doubt); share one graph memory pool between subgraphs (each has its own);
keep writes to copied inputs in graphs (it refuses to graph them instead;
writes to parameters, buffers and ``mark_static_address`` tensors, such as a
static KV cache, are kept: the graph writes them in place, and with the
default ``warmup_iters=1`` each call runs the subgraph exactly once, its first
call included, validate mode skipping the comparison); call one
subgraph from several threads at once (calls are serialised by a lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .._torch_compat import dynamo_registry
from ..log import logger
from .options import BackendOptions
from .piecewise import PiecewiseSubgraph, piecewise_subgraph
from .subgraph import Analysis, CompiledSubgraph, SubgraphState, analysis_seconds, compile_counts, live_subgraphs

__all__ = ["BACKEND_NAMES", "gfxgraph_backend", "Backend", "backend", "serve", "register", "backend_stats",
           "piecewise_stats", "trees_stats", "compiled_subgraphs", "reset_backend"]

BACKEND_NAMES = ("gfxgraph", "hipgraph_bridge")


def gfxgraph_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                     options: Mapping[str, Any] | None = None, mode: str | None = None,
                     **option_kwargs: Any) -> Callable[..., Any]:
    """Dynamo backend: compile ``gm`` and serve it through batch-bucket graphs.

    Called by dynamo once per subgraph (``options``/``mode`` come from
    ``torch.compile``); options may also be bound as keywords, e.g.
    ``functools.partial(gfxgraph_backend, buckets=[1, 8, 64])``. Returns the
    function dynamo calls with the flat inputs. Raises :class:`ConfigError` for
    unknown or bad options (dynamo reports it as ``BackendCompilerFailed``).
    """
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"torch.compile(backend='gfxgraph', options=...): expected a dict of option names to "
                        f"values, got {type(options).__name__}; known options: {', '.join(BackendOptions.known())}")
    opts = BackendOptions.from_mapping({**(options or {}), **option_kwargs}, mode=mode)
    return serve(gm, example_inputs, opts)


def serve(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions, *,
          compile_inputs: Sequence[Any] | None = None, analysis: Analysis | None = None) -> Callable[..., Any]:
    """The function dynamo calls for ``gm``: a piecewise frame or one compiled subgraph.

    ``compile_inputs`` and ``analysis`` (not with ``piecewise``): what inductor compiles ``gm`` for,
    where the real ``example_inputs`` do not say which sizes are symbolic (a saved frame's graph: its
    fake values), and the row analysis of ``gm`` another process made (a saved frame's)."""
    if (compile_inputs is not None or analysis is not None) and opts.piecewise:
        raise NotImplementedError("compile_inputs, analysis: the piecewise backend compiles and analyses its "
                                  "pieces from the graph's own fake values")
    sub: Any = (piecewise_subgraph(gm, list(example_inputs), opts) if opts.piecewise
                else CompiledSubgraph(gm, list(example_inputs), opts, analysis=analysis,
                                      compile_inputs=None if compile_inputs is None else list(compile_inputs)))

    if sub.role == "full":  # a frame with splitting ops served whole (decode): its calls are counted
        def run(*args: Any) -> Any:
            sub.calls += 1
            return sub(*args)
    else:
        def run(*args: Any) -> Any:
            return sub(*args)

    run.subgraph = sub  # type: ignore[attr-defined]  # introspection: state, reason, buckets
    return run


class Backend:
    """``torch.compile(model, backend=gfxgraph.backend(buckets=[1, 8]))``: the backend with its options checked.

    Made by :func:`backend`, which validates every option when it is written
    (a :class:`~hipgraph_bridge.errors.ConfigError` there, not a
    ``BackendCompilerFailed`` at the first call). Dynamo calls it once per
    subgraph, like the string backend. ``torch.compile``'s ``mode`` is applied
    at that call (checked then); ``options=`` given to ``torch.compile`` as well
    are merged over these and checked then too. The options are a frozen
    :class:`BackendOptions` (``.options``).
    """

    compiler_name = "gfxgraph"

    def __init__(self, options: BackendOptions, given: Mapping[str, Any]) -> None:
        self.options = options
        self._given = dict(given)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 options: Mapping[str, Any] | None = None, mode: str | None = None) -> Callable[..., Any]:
        opts = self.options
        if options or mode is not None:
            if options is not None and not isinstance(options, Mapping):
                raise TypeError(f"torch.compile(backend=gfxgraph.backend(...), options=...): expected a dict of "
                                f"option names to values, got {type(options).__name__}")
            opts = BackendOptions.from_mapping({**self._given, **(options or {})}, mode=mode)
        return serve(gm, example_inputs, opts)

    def reset(self) -> None:
        """``torch._dynamo.reset()`` calls this: release the graphs of every live subgraph."""
        reset_backend()

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self._given.items())
        return f"gfxgraph.backend({given})"


def backend(**options: Any) -> Backend:
    """A ``torch.compile`` backend with ``options`` checked now: ``torch.compile(m, backend=gfxgraph.backend(...))``.

    Takes the options of ``torch.compile(m, backend="gfxgraph", options={...})``
    as keywords (:class:`BackendOptions` lists them). Every one is validated
    here: an unknown name or a bad value raises
    :class:`~hipgraph_bridge.errors.ConfigError` from this call, which
    ``except gfxgraph.ConfigError`` catches. The string backend with
    ``options=`` keeps working and validates at the first call (dynamo then
    wraps the error in ``BackendCompilerFailed``).
    """
    return Backend(BackendOptions.from_mapping(options), options)


_register_lock = threading.Lock()


def register() -> bool:
    """Register :data:`BACKEND_NAMES` with dynamo if ``torch._dynamo`` is imported; cheap and idempotent.

    Returns whether the names are registered now. When dynamo is not imported
    yet this does nothing (the entry point finds the backend later) rather than
    importing it, which costs over a second. A name already taken by another
    function is left alone (logged at debug).
    """
    registry = dynamo_registry()
    if registry is None:
        return False
    with _register_lock:
        taken = getattr(registry, "_COMPILER_FNS", {})
        for name in BACKEND_NAMES:
            current = taken.get(name)
            if current is None:
                try:
                    registry.register_backend(gfxgraph_backend, name=name)
                except AssertionError:  # registered meanwhile (dynamo's duplicate-name check)
                    pass
            elif current is not gfxgraph_backend:
                logger.debug("gfxgraph: backend name %r is already taken by %r; left as it is", name, current)
    return True


def backend_stats() -> dict[str, Any]:
    """What the backend holds now: subgraphs by state, fallback reasons, compiles, graphs, memory.

    Keys: ``subgraphs``, ``graphed`` (bucketed graphs), ``trees`` (:func:`trees_stats`:
    the subgraphs that need autograd, graphed by CUDA-graph trees), ``lazy``,
    ``ungraphed`` (reason -> count), ``compiles`` and ``compile_seconds`` (process
    totals), ``analysis_seconds`` (process total of gfxgraph's own analysis of the graphs: input
    plans and row analyses), ``graphs`` (captured bucket graphs), ``pool_bytes`` (their graph-pool
    memory), ``piecewise`` (:func:`piecewise_stats`). Cost: walks the allocator's
    segments (milliseconds).
    """
    subs = live_subgraphs()
    ungraphed: dict[str, int] = {}
    for s in subs:
        if s.state is SubgraphState.UNGRAPHED:
            ungraphed[s.reason or "?"] = ungraphed.get(s.reason or "?", 0) + 1
    compiles, seconds = compile_counts()
    return {
        "subgraphs": len(subs),
        "graphed": sum(s.state is SubgraphState.GRAPHED for s in subs),
        "trees": trees_stats(subs),
        "lazy": sum(s.state is SubgraphState.LAZY for s in subs),
        "ungraphed": ungraphed,
        "compiles": compiles,
        "compile_seconds": seconds,
        "analysis_seconds": analysis_seconds(),
        "graphs": sum(s.graph_count() for s in subs),
        "pool_bytes": sum(s.pool_bytes() for s in subs),
        "piecewise": piecewise_stats(subs),
    }


def piecewise_stats(subs: list[Any] | None = None) -> dict[str, Any]:
    """The piecewise frames' figures, summed: pieces, splitting ops, graphs, memory, capture time, calls.

    ``calls``: ``piecewise`` (pieces replayed around eager splitting ops),
    ``full`` (one graph for the whole frame: one-token calls, and the frames
    dynamo compiled for a sequence length of 1), ``eager`` (the pieces compiled,
    unpadded: oversize, no GPU, ungraphed). ``piece_status`` lists how each
    piece runs. Memory: ``pool_bytes`` (graph pools), ``staging_bytes`` (static
    input buffers).
    """
    subs = live_subgraphs() if subs is None else subs
    frames = [s.report() for s in subs if isinstance(s, PiecewiseSubgraph)]
    full = [s for s in subs if isinstance(s, CompiledSubgraph) and s.role == "full"]
    out: dict[str, Any] = {"frames": len(frames), "full_graph_frames": len(full)}
    for key in ("pieces", "splitting_ops", "graphs", "pool_bytes", "staging_bytes", "capture_seconds",
                "largest_first_seconds", "compile_seconds", "piece_replays", "piece_captures", "piece_eager_runs"):
        out[key] = sum(f[key] for f in frames)
    out["graphs"] += sum(s.graph_count() for s in full)
    out["pool_bytes"] += sum(s.pool_bytes() for s in full)
    calls = {"piecewise": 0, "full": sum(s.calls for s in full), "eager": 0}
    for f in frames:
        for k, v in f["calls"].items():
            calls[k] += v
    out["calls"] = calls
    out["piece_status"] = [line for f in frames for line in f["piece_status"]]
    return out


def trees_stats(subs: list[Any] | None = None) -> dict[str, Any]:
    """The autograd path's figures: subgraphs graphed by CUDA-graph trees and their forward calls.

    ``subgraphs``; ``calls`` (forward calls; backward calls run inside autograd and
    are not seen); ``unused_backwards`` (forward calls in grad mode whose autograd
    graph was freed without a backward: inference in grad mode). The trees' own
    graphs are counted in ``gfxgraph.stats()`` (captures, replays) while
    ``gfxgraph.enable()`` is on, and their memory in its ``graph_pool_bytes``.
    """
    subs = live_subgraphs() if subs is None else subs
    trees = [s for s in subs if s.state is SubgraphState.TREES]
    return {"subgraphs": len(trees), "calls": sum(s.tree_calls for s in trees),
            "unused_backwards": sum(s.unused_backwards for s in trees)}


def compiled_subgraphs() -> list[CompiledSubgraph]:
    """The live subgraphs the backend has compiled (state, reason, buckets, captured graphs)."""
    return live_subgraphs()


def reset_backend() -> None:
    """Release the graphs of every live subgraph (they re-capture if called again).

    ``torch._dynamo.reset()`` calls this (as ``gfxgraph_backend.reset``) when it
    drops the compiled code.
    """
    for s in live_subgraphs():
        s.close()


gfxgraph_backend.reset = reset_backend  # type: ignore[attr-defined]
