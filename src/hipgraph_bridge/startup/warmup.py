"""Warm a pool or a compiled function up before serving: every bucket compiled and captured, largest first.

Serving stacks capture their graphs at start-up, so no request pays for a
compile or a capture. :func:`warmup` does that for the two things gfxgraph
serves:

* a :class:`~hipgraph_bridge.bucketing.pool.ShapeBucketPool`: its
  :meth:`~hipgraph_bridge.bucketing.pool.ShapeBucketPool.capture_all` (the
  pool's own buckets, largest first, garbage collector frozen);
* a function compiled with ``torch.compile(backend="gfxgraph")`` (or
  ``gfxgraph.backend(...)``), with any number of subgraphs: it is called once
  per bucket, largest first, on the example's rows repeated to that many. The
  first call compiles (the batch dimension marked dynamic, so later sizes
  reuse the compile where the code allows) and each call captures the
  subgraphs' bucket of that size. Its graphs and memory are the backend's
  (:func:`~hipgraph_bridge.compile.backend.backend_stats`).

Both show a tqdm bar and end with one summary line (time, graphs, graph
memory), logged at INFO and returned as a :class:`WarmupReport`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from .._torch_compat import maybe_mark_dynamic, pytree, size_oblivious_tracing
from ..bucketing.pool import ShapeBucketPool
from ..compile.backend import backend_stats
from ..compile.subgraph import SubgraphState, live_subgraphs
from ..errors import ConfigError
from ..graph.buckets import default_buckets, validate_buckets
from ..graph.capture import frozen_gc
from ..log import logger

__all__ = ["WarmupReport", "warmup", "resized", "batched_leaves", "example_rows"]


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did.

    ``graphs``: graphs captured during it; ``buckets``: the batch sizes it ran,
    in order; ``seconds``: wall time, device work included; ``compile_seconds``:
    the part spent in the backend's compiles (dynamo and inductor; 0 for a
    pool); ``pool_bytes``: graph-pool memory held afterwards.
    """

    what: str
    buckets: tuple[int, ...]
    graphs: int
    seconds: float
    compile_seconds: float
    pool_bytes: int

    def __str__(self) -> str:
        return (f"gfxgraph warm-up of {self.what}: {len(self.buckets)} batch sizes, {self.graphs} graphs "
                f"captured in {self.seconds:.2f} s ({self.compile_seconds:.2f} s compiling), "
                f"graph memory {self.pool_bytes / 2**20:.1f} MiB")


def warmup(target: Any, *example_args: Any, buckets: Sequence[int] | None = None, batch_dim: int = 0,
           static_args: Collection[int | str] = (), progress: bool = True, one_frame: bool = False,
           **example_kwargs: Any) -> WarmupReport:
    """Compile and capture every bucket of ``target`` now, largest first (module docstring).

    Args:
        target: a ``ShapeBucketPool``, or a callable compiled with the gfxgraph backend.
        example_args, example_kwargs: one call's arguments, any batch size.
        buckets: the batch sizes to warm (a compiled function; default
            :func:`~hipgraph_bridge.default_buckets`, the backend's own default). A pool warms its
            own buckets; passing others raises ``ConfigError``.
        batch_dim: where the example's tensors carry the batch (a compiled function).
        static_args: positions or keyword names of tensors that do not carry the batch even if
            their size there equals the example's batch size (a compiled function).
        progress: show the tqdm bar.
        one_frame: (a compiled function) trace the first, largest size without dynamo's 0/1
            specialisation (PyTorch's ``backed_size_oblivious``), so that size 1 reuses that frame
            instead of a second trace and compile: about half of dynamo's and the compiler's
            start-up for a model with one frame. The frame's code then assumes no size of the
            batch broadcasts: right where the batch dimension is the same in every tensor that
            meets it (a decode step), wrong for code that broadcasts a batch of 1 against another
            tensor's batch, which is why it is not the default. The setting is process-wide while
            the first call traces. A warm cache compiled without it brings the second frame back.
            ``NotImplementedError`` on a torch without the setting.

    Runs under the caller's grad mode: warm inference under ``torch.no_grad()`` or
    ``torch.inference_mode()``, as it will be served. Raises ``ConfigError`` for
    bad options and ``TypeError`` for an example without a batched tensor.
    """
    if not isinstance(batch_dim, int) or isinstance(batch_dim, bool):
        raise ConfigError(f"batch_dim: expected an int, got {batch_dim!r}")
    if not isinstance(one_frame, bool):
        raise ConfigError(f"one_frame: expected a bool, got {one_frame!r}")
    if isinstance(target, ShapeBucketPool):
        if buckets is not None and sorted(set(buckets)) != list(target.options.buckets):
            raise ConfigError(f"buckets: a ShapeBucketPool warms its own buckets {list(target.options.buckets)}; "
                              f"got {list(buckets)} (create the pool with the buckets you want)")
        if one_frame:
            raise ConfigError("one_frame: a ShapeBucketPool runs no dynamo (it is for a compiled function)")
        return _warm_pool(target, example_args, example_kwargs, progress)
    if not callable(target):
        raise TypeError(f"target: expected a ShapeBucketPool or a compiled function, got {type(target).__name__}")
    try:
        sizes = default_buckets() if buckets is None else validate_buckets(buckets)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return _warm_compiled(target, example_args, example_kwargs, sorted(sizes, reverse=True), batch_dim,
                          set(static_args), progress, one_frame)


def _warm_pool(pool: ShapeBucketPool, args: tuple[Any, ...], kwargs: dict[str, Any], progress: bool) -> WarmupReport:
    rep = pool.capture_all(*args, **kwargs)
    report = WarmupReport(what="ShapeBucketPool", buckets=tuple(sorted(pool.options.buckets, reverse=True)),
                          graphs=int(rep["captured"]), seconds=float(rep["seconds"]), compile_seconds=0.0,
                          pool_bytes=int(rep["pool_bytes"]))
    _announce(report, progress)
    return report


def _warm_compiled(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], sizes: list[int],
                   batch_dim: int, static: set[int | str], progress: bool, one_frame: bool) -> WarmupReport:
    rows = example_rows(args, kwargs, batch_dim, static)
    oblivious = size_oblivious_tracing() if one_frame else None  # raises before any call where torch lacks it
    before = backend_stats()
    t0 = time.perf_counter()
    with frozen_gc():
        for i, b in enumerate(tqdm(sizes, desc="gfxgraph warm-up", unit="size", leave=False,
                                   disable=not (progress and len(sizes) > 1))):
            call_args, call_kwargs = resized(args, kwargs, b, rows=rows, batch_dim=batch_dim, static=static)
            if i == 0 and b > 1 and not getattr(fn, "traced_ahead", False):  # a loaded frame's guards refuse marks
                for t in _batched(call_args, call_kwargs, b, batch_dim, static):
                    maybe_mark_dynamic(t, batch_dim)
            lazy = _lazy_calls()
            # the first call traces the frame every later size reuses, and compiles it (a dynamic frame
            # compiles in its first call: torch reads backed_size_oblivious then, so a compile put off to a
            # later call would run without it)
            with oblivious if (oblivious is not None and i == 0) else contextlib.nullcontext():
                fn(*call_args, **call_kwargs)
            # a frame dynamo specialised for this size (size 1 always) runs its traced graph eagerly until
            # its static_compile_after-th call: call again until it is compiled and captured
            for _ in range(_LAZY_RETRIES if torch.cuda.is_available() else 0):  # no GPU: nothing to capture
                now = _lazy_calls()
                if not any(n > lazy.get(k, 0) for k, n in now.items()):  # this size ran no waiting frame
                    break
                lazy = now
                fn(*call_args, **call_kwargs)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = backend_stats()
    report = WarmupReport(what=getattr(fn, "__name__", type(fn).__name__), buckets=tuple(sizes),
                          graphs=max(0, after["graphs"] - before["graphs"]), seconds=seconds,
                          compile_seconds=max(0.0, after["compile_seconds"] - before["compile_seconds"]),
                          pool_bytes=int(after["pool_bytes"]))
    _announce(report, progress)
    return report


_LAZY_RETRIES = 4  # above BackendOptions' default static_compile_after (2): a frame compiles by then


def _lazy_calls() -> dict[int, int]:
    """The backend's subgraphs that still run their traced graph uncompiled (waiting for more calls), with
    the calls each has served (a frame compiled ahead, as a saved one is, may wait before this warm-up)."""
    return {id(s): s.lazy_calls for s in live_subgraphs() if s.state is SubgraphState.LAZY}


def _announce(report: WarmupReport, progress: bool) -> None:
    logger.info("%s", report)
    if progress:
        tqdm.write(str(report))


def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int | str, Any]]:
    return [*enumerate(args), *kwargs.items()]


def example_rows(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int, static: set[int | str]) -> int:
    """The example's batch size: the first tensor's size in ``batch_dim`` outside ``static``."""
    for name, value in _named(args, kwargs):
        if name in static:
            continue
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
                n = int(leaf.shape[batch_dim])
                if n < 1:
                    raise ValueError(f"example: empty batch in dim {batch_dim} of {_where(name)}")
                return n
    raise TypeError(f"example: expected at least one tensor with a batch dimension (dim {batch_dim}) outside "
                    f"static_args; got {len(args)} positional and {sorted(kwargs)} keyword argument(s)")


def resized(args: tuple[Any, ...], kwargs: dict[str, Any], size: int, *, rows: int, batch_dim: int = 0,
            static: Collection[int | str] = (), fresh: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example's arguments at ``size`` rows: each tensor with ``rows`` rows in ``batch_dim`` (outside
    ``static``) has its rows repeated cyclically to ``size``; everything else is passed as it is.
    ``fresh``: new tensors at ``size == rows`` too (the caller's own are not returned), and at
    ``size <= rows`` the first rows with the tensor's own strides."""
    index: dict[torch.device, torch.Tensor] = {}

    def grow(leaf: Any) -> Any:
        if not (isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim and leaf.shape[batch_dim] == rows):
            return leaf
        if size == rows and not fresh:
            return leaf
        if fresh and size <= rows:  # a copy of the first rows with the leaf's own strides (saved guards check them)
            part = leaf.narrow(batch_dim, 0, size)
            return torch.empty_strided(part.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device).copy_(part)
        idx = index.get(leaf.device)
        if idx is None:
            idx = index[leaf.device] = torch.arange(size, device=leaf.device) % rows
        return leaf.index_select(batch_dim, idx)

    out = [v if name in static else pytree.tree_map(grow, v) for name, v in _named(args, kwargs)]
    return tuple(out[:len(args)]), dict(zip(kwargs, out[len(args):]))


def _batched(args: tuple[Any, ...], kwargs: dict[str, Any], size: int, batch_dim: int,
             static: set[int | str]) -> list[torch.Tensor]:
    return [leaf for name, v in _named(args, kwargs) if name not in static
            for leaf in pytree.tree_leaves(v)
            if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim and leaf.shape[batch_dim] == size]


def batched_leaves(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int,
                   static: Collection[int | str]) -> list[torch.Tensor]:
    """The example's tensors that carry its batch: those with the example's batch size in ``batch_dim``
    outside ``static`` (``TypeError`` when there is none)."""
    static = set(static)
    return _batched(args, kwargs, example_rows(args, kwargs, batch_dim, static), batch_dim, static)


def _where(name: int | str) -> str:
    return f"args[{name}]" if isinstance(name, int) else f"kwargs[{name!r}]"
