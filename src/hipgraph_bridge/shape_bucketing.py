"""ShapeBucketPool: one graph per batch-size bucket, padded inputs, one memory pool (gap 53).

Serving stacks capture one graph per batch size and pad each request up to
the next captured size; ``torch.compile(mode="reduce-overhead")`` re-records a
graph per new shape instead. This is the bucketing done once, as an object.

Workflow of a call ``pool(*args, **kwargs)``:

1. Flatten the arguments (any pytree). Tensors carry the batch in dimension
   ``batch_dim`` unless their argument is named in ``static_args``; all batched
   tensors must agree on the batch size ``B``. Non-tensor leaves are part of
   the graph key (each distinct value gets its own graphs) and must be hashable.
2. The first call (or :meth:`capture_all`) fixes the layout: the tree
   structure and each tensor's dtype, device and non-batch shape. A later call
   that differs raises ``ValueError`` naming what was expected.
3. Pick the smallest bucket ``b >= B`` (a table lookup). ``B`` above the largest
   bucket runs eagerly (reason ``oversize``) or raises with ``oversize="error"``.
4. Copy each batched tensor into rows ``[0, B)`` of its static buffer
   (allocated once at the largest bucket; buckets use views of it), fill rows
   ``[B, b)`` with ``pad_value``, copy static tensors into theirs.
5. Replay the bucket's graph. On a bucket's first use, warm up and capture
   it instead: the last warm-up run *is* this call's run (its result is
   returned and the new graph is not replayed), so with the default
   ``warmup_iters=1`` every call runs the model exactly once. Models with
   state that each run advances (a KV cache's write position, a step
   counter) therefore advance once per call, as in eager mode. A capture
   that fails after the warm-up returns the warm-up's result when the batch
   filled the bucket (else the call runs eagerly). Exceptions, where a first
   call runs the model more than once: ``warmup_iters > 1``; outputs that
   differ between the warm-up and the capture; and the one probe run at a
   second batch size when ``batched_outputs`` is not given (see below).
6. Return the outputs sliced back to ``B`` rows, copied (``copy_outputs=True``,
   the default) so the next call cannot overwrite them.

All graphs share one memory pool; :meth:`capture_all` captures largest first so
smaller buckets reuse the largest one's memory. Each graph's output memory is
handed back to that pool after capture (the pool keeps a non-owning view, see
:mod:`.weak_outputs`), so 36 buckets cost about what the largest one alone does,
not the sum of their outputs; the price is that any call may overwrite the
static outputs of every bucket, which is why outputs are copied by default.
Calls must therefore not overlap on different CUDA streams. Model calls (capture, warm-up,
eager fallback) run under ``torch.no_grad()``: this is for inference; use
``torch.cuda.make_graphed_callables`` for training.

Ahead-of-time capture (:meth:`capture_all`) runs the model ``warmup_iters``
times per bucket on the example arguments, so a model with state must reset it
afterwards (``StaticCache.reset()`` and a new prefill, for example); so does
the one extra run at a second batch size that learns which outputs carry the
batch, unless ``batched_outputs`` is given.

Calls are serialised by a lock (static buffers admit one call at a time), and a
call from another CUDA stream than the previous one first waits for it. In
validation mode (``gfxgraph.enable(validate=True)``) every call also runs eagerly
and returns the eager result when they differ.

What it will not do: make a non-batched output that reduces over the batch
(a batch mean) match eager when padding rows are added: such an output sees
the padding. Validation mode catches it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from . import settings as _settings
from . import stats as _stats
from .capture_state import frozen_gc
from .env import check_vram_cap, read_vram_cap
from .log import logger
from .memory import exceeds_vram_cap, graph_pool_bytes
from .platform import probe
from .tree_utils import describe
from .validation import checked_against_eager
from .weak_outputs import release_outputs

__all__ = ["ShapeBucketPool", "default_buckets", "validate_buckets", "BucketPoolSession"]


def default_buckets(max_batch_size: int = 256) -> list[int]:
    """Fine steps at small sizes, coarser above (as serving stacks do): 1, 2, 4, 8, then
    steps of 8 to 64, 16 to 128, 32 to 256, 64 beyond; capped at ``max_batch_size``."""
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size: expected a positive int, got {max_batch_size!r}")
    out = [1, 2, 4, 8]
    b = 8
    while b < max_batch_size:
        b += 8 if b < 64 else 16 if b < 128 else 32 if b < 256 else 64
        out.append(b)
    out = sorted({min(x, max_batch_size) for x in out})
    return out


def validate_buckets(buckets: Iterable[int]) -> list[int]:
    """Positive ints, returned sorted and de-duplicated; anything else is a clear error."""
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise TypeError(f"buckets: expected an iterable of positive ints, got {type(buckets).__name__}")
    values = list(buckets)
    if not values:
        raise ValueError("buckets: expected at least one bucket size, got an empty list")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"buckets: expected positive ints, got {v!r} in {values!r}")
    return sorted(set(values))


@dataclass(frozen=True)
class _Layout:
    """The fixed shape of a call: tree structure and, per leaf, what it is."""

    spec: Any  # pytree.TreeSpec
    kinds: tuple[str, ...]  # per leaf: "batched" | "static" | "const"
    tensor_meta: tuple[Any, ...]  # per leaf: (dtype, device, shape without batch dim) or None
    where: tuple[str, ...]  # per leaf: human path, e.g. "args[0]" or "kwargs['mask']"


@dataclass
class _Bucket:
    """One captured (or eager) bucket for one key of constant arguments."""

    size: int
    key: tuple[Hashable, ...] = ()  # the constant arguments
    graph: Any = None  # BridgedCUDAGraph once captured
    outputs: Any = None  # static output pytree (leaves)
    out_spec: Any = None
    out_batched: tuple[bool, ...] = ()
    reason: str = ""  # fallback reason key when this bucket runs eagerly ("vram_cap", ...)
    failed: str | None = None  # the explanation when this bucket runs eagerly
    slices: dict[int, list[Any]] = field(default_factory=dict)  # B -> sliced static outputs
    first_run: list[Any] | None = None  # output leaves of the last warm-up, until the first call returns them
    warm_out: Any = None  # the last warm-up's output pytree, while capturing (and after a failed capture)


class ShapeBucketPool:
    """Callable pool of graphs, one per batch-size bucket; see the module docstring.

    Args:
        model_fn: the model; called as ``model_fn(*args, **kwargs)``.
        buckets: batch sizes to capture (validated, sorted, de-duplicated);
            default :func:`default_buckets` up to ``max_batch_size``.
        batch_dim: the dimension that carries the batch in inputs and outputs.
        static_args: positions (ints) or keyword names (strs) of tensor arguments
            without a batch dimension; they are copied into static buffers each call.
        pad_value: value of the padding rows (default 0); None leaves them as they are.
        copy_outputs: return copies (default). ``False`` returns views of the
            graph's static outputs: fastest, but overwritten by the next call.
        oversize: ``"eager"`` (default) runs a batch above the largest bucket
            eagerly, counted and logged once; ``"error"`` raises ``ValueError``.
        warmup_iters: eager runs on the capture stream before each capture; on a
            bucket's first call the last one is that call's run (default 1: the
            model runs once per call). 0 captures without warm-up, then replays.
        vram_cap: fraction of device memory; a capture that would pass it runs
            eagerly instead (reason ``vram_cap``). Default: ``GFXGRAPH_VRAM_CAP`` or 0.90.
        capture_error_mode: passed to ``capture_begin``.
        generators: extra ``torch.Generator``\\ s to register with every graph so
            their random streams advance per replay (the default generator always is).
        progress: show a tqdm bar in :meth:`capture_all`.
        batched_outputs: one flag per output leaf saying whether it carries the batch.
            Default: learnt with one extra eager run at another batch size (when there
            are several buckets); pass it for a model whose state has a fixed batch size
            (a KV cache), where that run would fail or write the state.
    """

    def __init__(
        self,
        model_fn: Callable[..., Any],
        buckets: Iterable[int] | None = None,
        *,
        max_batch_size: int = 256,
        batch_dim: int = 0,
        static_args: Collection[int | str] = (),
        pad_value: float | int | bool | None = 0,
        copy_outputs: bool = True,
        oversize: Literal["eager", "error"] = "eager",
        warmup_iters: int = 1,
        vram_cap: float | None = None,
        capture_error_mode: str = "global",
        generators: Sequence[torch.Generator] = (),
        progress: bool = True,
        batched_outputs: Sequence[bool] | None = None,
    ) -> None:
        if not callable(model_fn):
            raise TypeError(f"model_fn: expected a callable, got {type(model_fn).__name__}")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim: expected an int >= 0, got {batch_dim!r}")
        if oversize not in ("eager", "error"):
            raise ValueError(f"oversize: expected 'eager' or 'error', got {oversize!r}")
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
            raise ValueError(f"warmup_iters: expected an int >= 0, got {warmup_iters!r}")
        if pad_value is not None and not isinstance(pad_value, (int, float, bool)):
            raise TypeError(f"pad_value: expected a number or None, got {type(pad_value).__name__}")
        if isinstance(static_args, (str, bytes)) or not isinstance(static_args, Iterable):
            raise TypeError(f"static_args: expected a collection of argument positions (int) or names (str), "
                            f"got {static_args!r}")
        if not isinstance(copy_outputs, bool):
            raise TypeError(f"copy_outputs: expected a bool, got {copy_outputs!r}")
        if not isinstance(progress, bool):
            raise TypeError(f"progress: expected a bool, got {progress!r}")
        for gen in generators:
            if not isinstance(gen, torch.Generator):
                raise TypeError(f"generators: expected torch.Generator objects, got {type(gen).__name__}")
            if gen.device.type != "cuda":  # PyTorch crashes registering a CPU generator with a graph
                raise ValueError(f"generators: expected CUDA generators (torch.Generator(device='cuda')), "
                                 f"got one on {gen.device}")
        for s in static_args:
            if isinstance(s, bool) or not isinstance(s, (int, str)):
                raise TypeError(f"static_args: expected argument positions (int) or names (str), got {s!r}")
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise ValueError("capture_error_mode: expected one of global, thread_local, relaxed, "
                             f"got {capture_error_mode!r}")
        self.model_fn = model_fn
        self.buckets: list[int] = (validate_buckets(buckets) if buckets is not None
                                   else default_buckets(max_batch_size))
        self.max_bucket = self.buckets[-1]
        self.batch_dim = batch_dim
        self.static_args = frozenset(static_args)
        self.pad_value = pad_value
        self.copy_outputs = copy_outputs
        self.oversize = oversize
        self.warmup_iters = warmup_iters
        self.vram_cap = read_vram_cap() if vram_cap is None else check_vram_cap(vram_cap)
        self.capture_error_mode = capture_error_mode
        self.generators = tuple(generators)
        self.progress = progress
        self.batched_outputs = None if batched_outputs is None else tuple(batched_outputs)
        # bucket lookup: _table[B] is the smallest bucket >= B
        self._table = [0] * (self.max_bucket + 1)
        j = 0
        for n in range(1, self.max_bucket + 1):
            while self.buckets[j] < n:
                j += 1
            self._table[n] = self.buckets[j]
        self._graphs_available = probe().graphs_available
        self._lock = threading.RLock()
        self._layout: _Layout | None = None
        self._buffers: list[Any] = []  # per leaf: static buffer (tensor leaves) or None
        self._entries: dict[tuple[int, tuple[Hashable, ...]], _Bucket] = {}
        self._io_cache: dict[int, list[tuple[Any, Any, Any]]] = {}  # B -> (dst, src index, pad view)
        self._pool_handle: Any = None
        self._retired_pools: list[Any] = []  # pools of earlier graphs, after a capture failure
        self._stream: torch.cuda.Stream | None = None
        self._last_stream: torch.cuda.Stream | None = None  # stream of the previous call
        # its handle: comparing handles is much cheaper than Stream objects. None until a first call
        # (the default stream's handle is 0, so 0 cannot mean "no call yet")
        self._last_raw_stream: int | None = None
        self._plain: list[tuple[str, Any]] | None = None  # fixed layout of one-leaf positional arguments
        self._has_consts = False
        self._largest_growth = 0
        self._out_flags: dict[tuple[Hashable, ...], tuple[bool, ...]] = {}
        self.capture_seconds = 0.0

    # ------------------------------------------------------------- arguments
    def _classify(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], _Layout, int]:
        """Flatten a call, and return (leaves, layout, batch size B)."""
        flat: list[Any] = []
        kinds: list[str] = []
        metas: list[Any] = []
        where: list[str] = []
        specs = []
        bd = self.batch_dim
        batch = -1
        first_batched = ""
        for name, value in [*((i, a) for i, a in enumerate(args)), *kwargs.items()]:
            label = f"args[{name}]" if isinstance(name, int) else f"kwargs[{name!r}]"
            leaves, spec = pytree.tree_flatten(value)
            specs.append(spec)
            static = name in self.static_args
            for k, leaf in enumerate(leaves):
                path = label if len(leaves) == 1 else f"{label} leaf {k}"
                flat.append(leaf)
                where.append(path)
                if isinstance(leaf, torch.Tensor):
                    if static or leaf.dim() <= bd:
                        kinds.append("static")
                        metas.append((leaf.dtype, leaf.device, tuple(leaf.shape)))
                        continue
                    n = leaf.shape[bd]
                    if batch < 0:
                        batch, first_batched = n, path
                    elif n != batch:
                        raise ValueError(
                            f"{path}: expected batch size {batch} in dim {bd} (as {first_batched}), got {n}; "
                            "name tensors without a batch dimension in static_args")
                    kinds.append("batched")
                    shape = tuple(leaf.shape)
                    metas.append((leaf.dtype, leaf.device, shape[:bd] + shape[bd + 1:]))
                else:
                    try:
                        hash(leaf)
                    except TypeError:
                        raise TypeError(f"{path}: non-tensor arguments are part of the graph key and must be "
                                        f"hashable; got {type(leaf).__name__}") from None
                    kinds.append("const")
                    metas.append(None)
        if batch < 0:
            raise TypeError(
                f"expected at least one tensor argument with a batch dimension (dim {bd}); got "
                f"({', '.join(describe(a) for a in args)}"
                + (", " + ", ".join(f"{k}={describe(v)}" for k, v in kwargs.items()) if kwargs else "") + ")")
        if batch == 0:
            raise ValueError(f"{first_batched}: empty batch: expected batch size >= 1 in dim {bd}, got 0")
        spec = (len(args), tuple(kwargs), tuple(specs))
        return flat, _Layout(spec, tuple(kinds), tuple(metas), tuple(where)), batch

    def _quick_leaves(self, args: tuple[Any, ...], plan: list[tuple[str, Any]] | None
                      ) -> tuple[list[Any], int] | None:
        """The hot path's flattening, for a fixed layout of plain positional arguments.

        Checks each argument against the layout without building one; None
        sends the call down :meth:`_classify`, which also words the errors.
        """
        if plan is None or len(args) != len(plan):
            return None
        bd = self.batch_dim
        batch = -1
        for a, (kind, meta) in zip(args, plan):
            if kind == "const":
                if type(a) is not meta:  # the exact type: a tuple, None or a tensor takes the full path
                    return None
                try:
                    hash(a)
                except TypeError:
                    return None
                continue
            if not isinstance(a, torch.Tensor) or a.dtype != meta[0] or a.device != meta[1]:
                return None
            shape = a.shape
            if kind == "static":
                if shape != meta[2]:
                    return None
                continue
            if len(shape) <= bd:
                return None
            n = shape[bd]
            if batch < 0:
                batch = n
            elif n != batch:
                return None
            if shape[:bd] + shape[bd + 1:] != meta[2]:
                return None
        return (list(args), batch) if batch >= 1 else None

    def _check_layout(self, layout: _Layout) -> None:
        fixed = self._layout
        assert fixed is not None
        (n_want, kw_want, specs_want), (n_got, kw_got, specs_got) = fixed.spec, layout.spec
        if n_want != n_got or kw_want != kw_got:
            raise ValueError(f"expected {n_want} positional argument(s) and keyword arguments {list(kw_want)} "
                             f"(as at the first call), got {n_got} and {list(kw_got)}")
        names = [f"args[{i}]" for i in range(n_want)] + [f"kwargs[{k!r}]" for k in kw_want]
        for name, want, got in zip(names, specs_want, specs_got):
            if want != got:
                raise ValueError(f"{name}: expected the structure {want} (as at the first call), got {got}")
        if layout.kinds != fixed.kinds:
            raise ValueError(f"expected the arguments {self._describe_layout(fixed)}, "
                             f"got {self._describe_layout(layout)}")
        for path, want_m, got_m in zip(fixed.where, fixed.tensor_meta, layout.tensor_meta):
            if want_m != got_m:
                w, g = want_m, got_m
                raise ValueError(f"{path}: expected dtype={w[0]}, device={w[1]}, shape without the batch dim "
                                 f"{w[2]} (as captured), got dtype={g[0]}, device={g[1]}, shape {g[2]}")

    @staticmethod
    def _describe_layout(layout: _Layout) -> str:
        return "(" + ", ".join(f"{w}: {k}" for w, k in zip(layout.where, layout.kinds)) + ")"

    def _rebuild(self, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        assert self._layout is not None
        nargs, kw_names, specs = self._layout.spec
        values = []
        i = 0
        for spec in specs:
            n = spec.num_leaves
            values.append(pytree.tree_unflatten(leaves[i:i + n], spec))
            i += n
        return tuple(values[:nargs]), dict(zip(kw_names, values[nargs:]))

    def _fix_layout(self, leaves: list[Any], layout: _Layout) -> None:
        """First call: allocate the static buffers at the largest bucket."""
        if self._graphs_available:
            for path, kind, meta in zip(layout.where, layout.kinds, layout.tensor_meta):
                if kind != "const" and meta[1].type != "cuda":
                    raise ValueError(f"{path}: expected a tensor on a CUDA device, got one on {meta[1]}")
        bufs: list[Any] = []
        bd = self.batch_dim
        for leaf, kind in zip(leaves, layout.kinds):
            if kind == "batched":
                shape = list(leaf.shape)
                shape[bd] = self.max_bucket
                fill = 0 if self.pad_value is None else self.pad_value
                bufs.append(torch.full(shape, fill, dtype=leaf.dtype, device=leaf.device))
            elif kind == "static":
                bufs.append(leaf.clone())
            else:
                bufs.append(None)
        self._layout = layout
        self._buffers = bufs
        self._has_consts = "const" in layout.kinds
        nargs, kw_names, specs = layout.spec
        if not kw_names and all(spec.is_leaf() for spec in specs):  # one leaf per argument
            self._plain = [(k, type(leaf) if k == "const" else m)
                           for k, m, leaf in zip(layout.kinds, layout.tensor_meta, leaves)]

    def _io_plan(self, batch: int) -> list[tuple[Any, Any, Any]]:
        """Views used to copy a batch of ``batch`` rows in and pad it (cached per batch size)."""
        plan = self._io_cache.get(batch)
        if plan is None:
            assert self._layout is not None
            bucket = self._table[batch]
            bd = self.batch_dim
            plan = []
            for i, (kind, buf) in enumerate(zip(self._layout.kinds, self._buffers)):
                if kind == "batched":
                    pad = buf.narrow(bd, batch, bucket - batch) if bucket > batch else None
                    plan.append((buf.narrow(bd, 0, batch), i, pad))
                elif kind == "static":
                    plan.append((buf, i, None))
            self._io_cache[batch] = plan
        return plan

    def _stage_inputs(self, leaves: list[Any], batch: int) -> None:
        pad_value = self.pad_value
        for dst, i, pad in self._io_plan(batch):
            src = leaves[i]
            if src is not dst:
                dst.copy_(src)
            if pad is not None and pad_value is not None:
                pad.fill_(pad_value)

    def _bucket_args(self, bucket: int, leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments for running the model on bucket ``bucket``: static-buffer views plus constants."""
        assert self._layout is not None
        bd = self.batch_dim
        bucket_leaves = []
        for kind, buf, leaf in zip(self._layout.kinds, self._buffers, leaves):
            if kind == "batched":
                bucket_leaves.append(buf.narrow(bd, 0, bucket))
            elif kind == "static":
                bucket_leaves.append(buf)
            else:
                bucket_leaves.append(leaf)
        return self._rebuild(bucket_leaves)

    # ------------------------------------------------------------------ call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on this batch through its bucket's graph; see the module docstring.

        Cost over a hand-written bucket loop: flattening the arguments, one lock,
        one dict lookup. Raises ``TypeError``/``ValueError`` for arguments that
        do not fit the pool (naming what was expected).
        """
        plan = self._plain
        quick = self._quick_leaves(args, plan) if not kwargs else None
        if quick is not None:
            leaves, batch = quick
        else:
            leaves, layout, batch = self._classify(args, kwargs)
        with self._lock:
            if quick is not None and self._plain is not plan:  # closed (or re-laid-out) meanwhile
                quick = None
                leaves, layout, batch = self._classify(args, kwargs)
            if quick is None:  # a quick match already fits the fixed layout
                if self._layout is None:
                    self._fix_layout(leaves, layout)
                elif layout != self._layout:
                    self._check_layout(layout)
            if batch > self.max_bucket:
                if self.oversize == "error":
                    raise ValueError(f"batch size {batch} is above the largest bucket {self.max_bucket}; "
                                     "expected at most that (or construct the pool with oversize='eager')")
                _stats.record_fallback("oversize", f"batch {batch} > largest bucket {self.max_bucket}")
                return self._eager(args, kwargs)
            bucket = self._table[batch]
            key = (bucket, tuple(leaf for leaf, k in zip(leaves, self._layout.kinds) if k == "const")
                   if self._has_consts else ())
            entry = self._entries.get(key)
            if self._graphs_available:
                self._order_after_previous_call()
            if entry is None:
                self._stage_inputs(leaves, batch)
                entry = self._capture(bucket, key, leaves)
                first, entry.first_run = entry.first_run, None
                warm, entry.warm_out = entry.warm_out, None
                if first is not None:  # the warm-up was this call's run: do not run the model twice
                    out = self._first_outputs(entry, first, batch)
                    if out is not None:
                        return self._validated(out, args, kwargs) if _settings.current().validate else out
                    logger.debug("gfxgraph: bucket %d: the warm-up's outputs differ from the captured ones; "
                                 "this call replays the graph (the model ran twice)", bucket)
                elif warm is not None and entry.failed is not None and bucket == batch:
                    # the capture failed after a good warm-up of exactly this batch: that run is the result
                    _stats.record_fallback(entry.reason, entry.failed)
                    _record_on_current_stream(pytree.tree_leaves(warm))
                    if self.copy_outputs:  # it may alias the static input buffers
                        warm = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, warm)
                    return warm
                del warm
            elif entry.failed is None:
                self._stage_inputs(leaves, batch)
            if entry.failed is not None:
                _stats.record_fallback(entry.reason, entry.failed)
                return self._eager(args, kwargs)
            if entry.graph is None:
                return self._padded_eager(entry, leaves, batch)
            entry.graph._launch()
            out = self._outputs(entry, entry.outputs, batch)
            if _settings.current().validate:
                return self._validated(out, args, kwargs)
            return out

    def _order_after_previous_call(self) -> None:
        """Calls from different streams must not overlap on the static buffers and shared pool."""
        raw = _current_raw_stream()
        if raw is not None and raw == self._last_raw_stream and self._last_stream is not None:
            return  # the common case: the same stream as the previous call
        stream = torch.cuda.current_stream()
        last = self._last_stream
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._last_stream = stream
        self._last_raw_stream = raw

    def _validated(self, graph_out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Validation mode: compare with eager (dtype-aware), count, return eager on mismatch."""
        return checked_against_eager(graph_out, self._eager(args, kwargs), owner=self, what="ShapeBucketPool")

    def _padded_eager(self, entry: _Bucket, leaves: list[Any], batch: int) -> Any:
        """No GPU: the same padded pipeline as a replay, with the model run eagerly."""
        _stats.record_fallback("no_gpu", probe().reason or "")
        with torch.no_grad():
            a, k = self._bucket_args(entry.size, leaves)
            outputs = self.model_fn(*a, **k)
        self._record_output_layout(entry, outputs, entry.key, leaves)
        return self._outputs(entry, pytree.tree_leaves(outputs), batch, cache=False)

    def _outputs(self, entry: _Bucket, outs: list[Any], batch: int, *, cache: bool = True) -> Any:
        sliced = entry.slices.get(batch) if cache else None
        if sliced is None:
            bd = self.batch_dim
            sliced = [o.narrow(bd, 0, batch) if is_b and batch < entry.size else o
                      for o, is_b in zip(outs, entry.out_batched)]
            if cache:
                entry.slices[batch] = sliced
        if self.copy_outputs:
            sliced = [o.clone() if isinstance(o, torch.Tensor) else o for o in sliced]
        return pytree.tree_unflatten(sliced, entry.out_spec)

    def _first_outputs(self, entry: _Bucket, first: list[Any], batch: int) -> Any:
        """A bucket's first call returns its last warm-up run, as a replay would return it.

        None when the warm-up's outputs differ in shape, dtype or value (for
        non-tensors) from what the graph captured: the model is not the same
        from run to run, so the call replays the graph like the later ones.
        With ``copy_outputs=False`` the result is copied into the graph's static
        outputs, so the returned views are the ones later calls overwrite.
        The warm-up ran on the capture stream; the caller's stream already waits
        for it, and ``record_stream`` keeps the allocator from reusing these
        tensors' memory on that stream while the caller's stream still reads them.
        """
        _record_on_current_stream(first)
        static = entry.outputs
        if static is None:  # captured, then dropped to keep the VRAM cap: the warm-up is all there is
            return self._outputs(entry, first, batch, cache=False)
        if len(first) != len(static):
            return None
        for a, b in zip(first, static):
            if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
                return None
            if isinstance(a, torch.Tensor):
                if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                    return None
            else:
                try:
                    if a != b:
                        return None
                except Exception:  # a value without a plain comparison
                    return None
        if self.copy_outputs:
            return self._outputs(entry, first, batch, cache=False)
        for dst, src in zip(static, first):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        return self._outputs(entry, static, batch)

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with torch.no_grad():
            return self.model_fn(*args, **kwargs)

    # --------------------------------------------------------------- capture
    def _capture(self, bucket: int, key: tuple[int, tuple[Hashable, ...]], leaves: list[Any],
                 *, freeze_gc: bool = True, keep_first: bool = True) -> _Bucket:
        """Capture ``bucket`` for ``key``; the entry is stored only once its outcome is known.

        A ``KeyboardInterrupt`` (or any ``BaseException``) during warm-up or capture
        leaves no entry behind, so the next call tries again; the capture itself was
        already ended cleanly by the graph.
        """
        entry = _Bucket(bucket, key[1])
        if not self._graphs_available:
            self._entries[key] = entry
            return entry  # runs the padded pipeline eagerly (see _padded_eager)
        over, why = exceeds_vram_cap(self._largest_growth, self.vram_cap)
        if over:
            entry.reason, entry.failed = "vram_cap", f"bucket {bucket}: {why}"
            logger.warning("gfxgraph: bucket %d runs eagerly: %s", bucket, why)
            self._entries[key] = entry
            return entry
        stream = self._capture_stream()
        a, k = self._bucket_args(bucket, leaves)
        t0 = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved()
        try:
            out = self._warm_up_and_capture(entry, stream, a, k, freeze_gc, keep_first)
        except Exception as exc:
            entry.reason = "capture_failed"
            entry.failed = f"bucket {bucket}: {type(exc).__name__}: {exc}"
            self._retire_pool()
            self._entries[key] = entry
            logger.warning("gfxgraph: bucket %d runs eagerly from now on: capture failed: %s", bucket, exc)
            return entry
        except BaseException:
            self._retire_pool()
            raise
        self.capture_seconds += time.perf_counter() - t0
        self._record_output_layout(entry, out, key[1], leaves)
        entry.outputs = release_outputs(pytree.tree_leaves(out))
        del out
        warm, entry.warm_out = entry.warm_out, None
        if warm is not None and pytree.tree_structure(warm) == entry.out_spec:
            entry.first_run = pytree.tree_leaves(warm)
        del warm
        growth = torch.cuda.memory_reserved() - reserved_before
        self._largest_growth = max(self._largest_growth, growth)
        over, why = exceeds_vram_cap(0, self.vram_cap)
        if over:  # the estimate was short: undo this capture to keep the cap
            entry.graph.reset()
            entry.graph, entry.outputs = None, None
            entry.reason, entry.failed = "vram_cap", f"bucket {bucket}: after capture {why}"
            torch.cuda.empty_cache()
            logger.warning("gfxgraph: bucket %d runs eagerly: after capture %s", bucket, why)
        self._entries[key] = entry
        return entry

    def _warm_up_and_capture(self, entry: _Bucket, stream: torch.cuda.Stream, a: tuple[Any, ...],
                             k: dict[str, Any], freeze_gc: bool, keep_first: bool) -> Any:
        """Warm up, capture; returns the captured outputs.

        With ``keep_first`` the last warm-up's outputs are left in ``entry.warm_out``
        (before the capture starts, so a failed capture still has them); they stay
        alive during the capture, so its memory figures include them.
        """
        from .graph_manager import BridgedCUDAGraph

        g = BridgedCUDAGraph()
        for gen in self.generators:
            g.register_generator_state(gen)
        warm = None
        with torch.no_grad():
            if self.warmup_iters:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(self.warmup_iters):
                        warm = None  # free the previous run's outputs before the next
                        warm = self.model_fn(*a, **k)
                    if not keep_first:
                        warm = None  # ahead-of-time capture: nobody returns it
                torch.cuda.current_stream().wait_stream(stream)
            entry.warm_out = warm
            del warm
            torch.cuda.synchronize()
            gc_ctx = frozen_gc() if freeze_gc else contextlib.nullcontext()
            with gc_ctx, torch.cuda.stream(stream):
                g.capture_begin(pool=self._pool(), capture_error_mode=self.capture_error_mode)
                try:
                    out = self.model_fn(*a, **k)
                except BaseException as exc:
                    g._discard(f"the captured model raised {type(exc).__name__}: {exc}", capture_ended=False)
                    raise
                g.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
        entry.graph = g
        return out

    def _retire_pool(self) -> None:
        # PyTorch's allocator may keep recording to the pool of a capture that
        # failed; later buckets capture into a fresh pool rather than trust it.
        if self._pool_handle is not None:
            self._retired_pools.append(self._pool_handle)
        self._pool_handle = None

    def _record_output_layout(self, entry: _Bucket, outputs: Any, key: tuple[Any, ...],
                              leaves: list[Any]) -> None:
        """Which outputs carry the batch, learnt once per constant-argument key.

        A tensor with ``b`` rows in ``batch_dim`` may carry the batch or just
        happen to have ``b`` rows (4 hidden units with bucket 4). One extra eager
        run at another batch size tells them apart: batched outputs follow it.
        """
        out_leaves, entry.out_spec = pytree.tree_flatten(outputs)
        flags = self._out_flags.get(key)
        if flags is None:
            bd, b = self.batch_dim, entry.size
            flags = tuple(isinstance(o, torch.Tensor) and o.dim() > bd and o.shape[bd] == b for o in out_leaves)
            probe_size = 1 if b != 1 else (2 if self.max_bucket >= 2 else 0)
            if self.batched_outputs is not None:
                if len(self.batched_outputs) != len(out_leaves):
                    raise ValueError(f"batched_outputs: expected {len(out_leaves)} flags (one per output leaf), "
                                     f"got {len(self.batched_outputs)}")
                flags = tuple(bool(f) for f in self.batched_outputs)
            elif any(flags) and probe_size and len(self.buckets) > 1:
                try:
                    with torch.no_grad():
                        a, k = self._bucket_args(probe_size, leaves)
                        probe_leaves = pytree.tree_leaves(self.model_fn(*a, **k))
                except Exception as exc:  # e.g. a model whose state has a fixed batch size
                    logger.debug("gfxgraph: output probe at batch %d failed (%s); outputs with %d rows "
                                 "are taken as batched", probe_size, exc, b)
                    probe_leaves = []
                if len(probe_leaves) == len(out_leaves):
                    flags = tuple(f and p.shape[bd] == probe_size for f, p in zip(flags, probe_leaves))
            self._out_flags[key] = flags
        entry.out_batched = flags

    def _pool(self) -> Any:
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        return self._pool_handle

    def _capture_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def capture_all(self, *example_args: Any, **example_kwargs: Any) -> dict[str, Any]:
        """Capture every bucket now, largest first (so smaller ones reuse its memory).

        The example arguments fix the layout (any batch size; their rows are
        repeated into the buffers). Shows a tqdm bar when ``progress``; the
        garbage collector stays frozen for the whole run. Logs and returns the
        time and graph-pool memory it took. Buckets that fail run eagerly later.
        """
        leaves, layout, batch = self._classify(example_args, example_kwargs)
        with self._lock:
            if self._layout is None:
                self._fix_layout(leaves, layout)
            elif layout != self._layout:
                self._check_layout(layout)
            self._fill_example(leaves, batch)
            consts = tuple(leaf for leaf, k in zip(leaves, layout.kinds) if k == "const")
            todo = [b for b in reversed(self.buckets) if (b, consts) not in self._entries]
            t0 = time.perf_counter()
            free_before = torch.cuda.mem_get_info()[0] if self._graphs_available else 0
            bar = _progress(todo, self.progress and len(todo) > 1)
            with frozen_gc():
                for b in bar:
                    self._capture(b, (b, consts), leaves, freeze_gc=False, keep_first=False)
            seconds = time.perf_counter() - t0
            report = {
                "buckets": len(todo),
                "captured": sum(1 for b in todo if self._entries[(b, consts)].failed is None),
                "seconds": seconds,
                "pool_bytes": self.pool_bytes(),
                "device_bytes_used": (free_before - torch.cuda.mem_get_info()[0]) if self._graphs_available else 0,
            }
        logger.info("gfxgraph: captured %d/%d buckets in %.2f s; graph pool %.1f MiB",
                    report["captured"], report["buckets"], seconds, report["pool_bytes"] / 2**20)
        return report

    def _fill_example(self, leaves: list[Any], batch: int) -> None:
        """Put example data in every row of the static buffers (repeating its rows)."""
        assert self._layout is not None
        bd = self.batch_dim
        for kind, buf, leaf in zip(self._layout.kinds, self._buffers, leaves):
            if kind == "batched":
                reps = -(-self.max_bucket // batch)
                tiled = leaf.repeat(*[reps if d == bd else 1 for d in range(leaf.dim())])
                buf.copy_(tiled.narrow(bd, 0, self.max_bucket))
            elif kind == "static" and buf is not leaf:
                buf.copy_(leaf)

    # ------------------------------------------------------------ introspect
    @property
    def captured_buckets(self) -> list[int]:
        """Buckets with a captured graph (any constant-argument key)."""
        return sorted({b for (b, _), e in self._entries.items() if e.graph is not None})

    @property
    def failed_buckets(self) -> dict[int, str]:
        """Buckets that run eagerly, with the reason."""
        return {b: f"{e.reason}: {e.failed}" for (b, _), e in self._entries.items() if e.failed is not None}

    def bucket_for(self, batch_size: int) -> int | None:
        """The bucket a batch of ``batch_size`` rows runs in; None when above the largest."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        return self._table[batch_size] if batch_size <= self.max_bucket else None

    def pool_bytes(self) -> int:
        """Bytes reserved by this pool's graphs, as the caching allocator reports them."""
        pools = [p for p in (self._pool_handle, *self._retired_pools) if p is not None]
        return graph_pool_bytes(pools) if pools else 0

    @property
    def pool_handle(self) -> Any:
        """The shared memory-pool handle (None before the first capture)."""
        return self._pool_handle

    def close(self) -> None:
        """Release every graph and static buffer. The pool can be used again (it re-captures)."""
        with self._lock:
            for entry in self._entries.values():
                if entry.graph is not None:
                    entry.graph.reset()
            self._entries.clear()
            self._io_cache.clear()
            self._buffers = []
            self._layout = None
            self._plain, self._has_consts = None, False
            self._last_stream, self._last_raw_stream = None, None
            self._largest_growth = 0
            self._out_flags.clear()

    def __repr__(self) -> str:
        return (f"ShapeBucketPool(buckets={self.buckets}, captured={self.captured_buckets}, "
                f"failed={sorted(self.failed_buckets)})")


def _record_on_current_stream(leaves: list[Any]) -> None:
    """Tensors made on the capture stream, now read on the caller's: keep the allocator from
    reusing their memory on the capture stream before the caller's stream is done with them."""
    current = torch.cuda.current_stream()
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(current)


def _current_raw_stream() -> int | None:
    """The current stream's handle on the current device (None where torch does not expose it)."""
    try:
        return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    except AttributeError:
        return None


def _progress(items: list[int], enabled: bool) -> Iterable[int]:
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but a broken install must not stop capture
        return items
    return tqdm(items, desc="gfxgraph capture", unit="graph", leave=False)


class BucketPoolSession:
    """``BridgedCUDAGraph.capture(dynamic_shapes=True, ...)``: the seed's path into a pool.

    ``with g.capture(dynamic_shapes=True, model_fn=m, buckets=[...], example_input=x):``
    captures every bucket on exit when ``example_input`` is given (lazily otherwise);
    ``g.replay(input_tensor=x)`` runs any batch size; ``g.replay(batch_size=n)``
    replays bucket(n) on what is already in the static input buffer.
    """

    def __init__(self, owner: Any, *, model_fn: Any, buckets: Any, copy_outputs: bool,
                 warmup_iters: int, example_input: Any) -> None:
        if model_fn is None:
            raise TypeError("capture(dynamic_shapes=True) needs model_fn= (the function to bucket)")
        self._owner = owner
        self.pool = ShapeBucketPool(model_fn, buckets, copy_outputs=copy_outputs, warmup_iters=warmup_iters)
        self.example_input = example_input

    def __enter__(self) -> BucketPoolSession:
        self._owner._enter_session_state()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None and self.example_input is not None:
            self.pool.capture_all(self.example_input)
        return False

    def replay(self, *, batch_size: Any = None, branch: Any = None, input_tensor: Any = None) -> Any:
        if branch is not None:
            raise TypeError("replay(branch=...) needs capture(conditional_branches=...)")
        if input_tensor is not None:
            if batch_size is not None:
                n = input_tensor.shape[self.pool.batch_dim] if isinstance(input_tensor, torch.Tensor) else None
                if n != batch_size:
                    raise ValueError(f"batch_size={batch_size} disagrees with input_tensor's batch size {n}")
            return self.pool(input_tensor)
        if batch_size is None:
            raise TypeError("replay() on a dynamic_shapes capture needs input_tensor= or batch_size=")
        return self._replay_static(batch_size)

    def _replay_static(self, batch_size: int) -> Any:
        pool = self.pool
        bucket = pool.bucket_for(batch_size)
        if bucket is None:
            raise ValueError(f"batch_size={batch_size} is above the largest bucket {pool.max_bucket}")
        with pool._lock:
            entries = [e for (b, _), e in pool._entries.items() if b == bucket and e.graph is not None]
            if len(entries) != 1:
                raise RuntimeError(f"replay(batch_size={batch_size}): bucket {bucket} is not captured (or has "
                                   "several constant-argument variants); pass input_tensor= instead")
            entry = entries[0]
            entry.graph._launch()
            return pool._outputs(entry, entry.outputs, batch_size)

    def close(self) -> None:
        self.pool.close()
