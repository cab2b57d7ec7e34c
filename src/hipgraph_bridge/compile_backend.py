"""The ``gfxgraph`` torch.compile backend: inductor kernels, replayed through batch-bucket graphs.

``torch.compile(model, backend="gfxgraph")`` (alias ``"hipgraph_bridge"``)
compiles each dynamo subgraph with inductor, *without* inductor's own CUDA
graphs, and serves it through a :class:`~.shape_bucketing.ShapeBucketPool`:
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

Workflow, per subgraph (:class:`CompiledSubgraph`):

1. Read the FX graph (:func:`.compile_plan.analyze`): which inputs carry the
   batch (their ``batch_dim`` size is the batch *symbol*), which are
   parameters/buffers (read in place), which are other tensors (copied into
   static buffers), which ints are sizes (recomputed from tensors, set to the
   *bucket* size inside graphs, so ints never multiply the graphs), and which
   outputs carry the batch.
2. Compile with inductor (``triton.cudagraphs=False``). A frame in which
   dynamo specialised every shape (the first batch size it saw, or size 1:
   dynamo specialises 0 and 1) runs the traced graph eagerly until its
   ``static_compile_after``-th call, then compiles: such frames serve one
   batch size, and compiling each of them up front would double the compile time.
3. Serve calls through the pool: copy in, pad, replay (capture on a bucket's
   first use), slice the outputs back, copy them. Subgraphs separated by graph
   breaks are separate pools, graphed separately.
4. Fall back to the compiled function without graphs, counted and logged once
   per cause, where graphs would be wrong or impossible: training (grad mode on
   and an input requiring grad; backward works, ungraphed), an input the graph
   mutates, the batch size used as a value (``x * x.shape[0]``) or appearing
   other than as one output dimension, rows that depend on each other (the
   first padded call is compared with an unpadded run), a padded call of a
   subgraph that writes to its parameters or buffers (padding rows could
   write to that state; a batch size that is a bucket is graphed), CPU tensors when a GPU
   is present, non-contiguous batched inputs, more than ``max_variants``
   shape/constant variants. Without a GPU the pool runs its padded pipeline
   eagerly, so the whole path is exercised on CPU. ``gfxgraph.enable(validate=True)``
   compares every call with an unpadded run and returns the latter.

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

import enum
import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from . import settings as _settings
from . import stats as _stats
from .compile_plan import GraphPlan, analyze, aot_mutated_inputs, fx_mutated_inputs
from .env import ConfigError, check_vram_cap
from .log import log_once, logger
from .platform import probe
from .shape_bucketing import ShapeBucketPool, default_buckets, validate_buckets
from .validation import outputs_match

__all__ = [
    "BACKEND_NAMES",
    "BackendOptions",
    "CompiledSubgraph",
    "SubgraphState",
    "gfxgraph_backend",
    "register",
    "backend_stats",
    "compiled_subgraphs",
    "reset_backend",
]

BACKEND_NAMES = ("gfxgraph", "hipgraph_bridge")

Compiler = Literal["inductor", "aot_eager", "eager"]
_COMPILERS = ("inductor", "aot_eager", "eager")
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# ------------------------------------------------------------------- options
def _positive_int(name: str, v: Any, *, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"options[{name!r}]: expected an int >= {minimum}, got {v!r}")
    return v


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"options[{name!r}]: expected True or False, got {v!r}")
    return v


@dataclass(frozen=True)
class BackendOptions:
    """Options of the ``gfxgraph`` backend: ``torch.compile(..., options={...})``.

    Attributes:
        buckets: batch sizes to capture; default :func:`.default_buckets` up to
            ``max_batch_size``. Buckets outside the sizes a frame admits are dropped.
        max_batch_size: the largest default bucket (256); larger batches run
            ungraphed (compiled), counted as ``oversize``.
        batch_dim: the dimension that carries the batch, in inputs and outputs (0).
        vram_cap: no new capture once device memory use would pass this fraction;
            default ``GFXGRAPH_VRAM_CAP`` or 0.90.
        copy_outputs: return copies (True). False returns views of the graphs'
            static outputs, overwritten by the next call of this subgraph.
        pad_value: value of padding rows (0).
        warmup_iters: runs before each capture (1).
        compiler: ``"inductor"`` (default); ``"aot_eager"`` or ``"eager"`` (the
            traced graph as it is) for debugging or machines without a C++ compiler.
            Inductor on CPU falls back to ``"eager"`` by itself when no compiler is found.
        inductor_config: extra inductor config patches (CUDA-graph keys refused).
        static_compile_after: a frame with every shape specialised is compiled on
            this call (2); earlier calls run the traced graph eagerly.
        max_variants: graph sets per subgraph for distinct non-batch shapes or
            constant arguments (8); further ones run ungraphed.
        graphs: False compiles only (no graphs): for comparisons.
    """

    buckets: tuple[int, ...] | None = None
    max_batch_size: int = 256
    batch_dim: int = 0
    vram_cap: float | None = None
    copy_outputs: bool = True
    pad_value: float | int | bool | None = 0
    warmup_iters: int = 1
    compiler: Compiler = "inductor"
    inductor_config: tuple[tuple[str, Any], ...] = ()
    static_compile_after: int = 2
    max_variants: int = 8
    graphs: bool = True
    mode_config: tuple[tuple[str, Any], ...] = field(default=(), repr=False)  # from torch.compile(mode=...)

    @classmethod
    def known(cls) -> list[str]:
        """Option names accepted in ``options={...}``."""
        return sorted(f.name for f in fields(cls) if f.name != "mode_config")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None = None, *, mode: str | None = None) -> BackendOptions:
        """Validate ``options`` (and torch.compile's ``mode``); raise :class:`ConfigError` naming the problem."""
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise TypeError(f"gfxgraph backend options: expected a dict, got {type(options).__name__}")
        known = cls.known()
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ConfigError(f"gfxgraph backend: unknown option(s) {', '.join(map(repr, unknown))}; "
                              f"known options: {', '.join(known)}")
        o = dict(options)
        kw: dict[str, Any] = {}
        if o.get("buckets") is not None:
            try:
                kw["buckets"] = tuple(validate_buckets(o["buckets"]))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"options['buckets']: {exc}") from None
        for name in ("max_batch_size", "static_compile_after", "max_variants"):
            if name in o:
                kw[name] = _positive_int(name, o[name])
        for name in ("batch_dim", "warmup_iters"):
            if name in o:
                kw[name] = _positive_int(name, o[name], minimum=0)
        for name in ("copy_outputs", "graphs"):
            if name in o:
                kw[name] = _flag(name, o[name])
        if o.get("vram_cap") is not None:
            kw["vram_cap"] = check_vram_cap(o["vram_cap"], name="options['vram_cap']")
        if "pad_value" in o:
            pv = o["pad_value"]
            if pv is not None and not isinstance(pv, (int, float, bool)):
                raise ConfigError(f"options['pad_value']: expected a number or None, got {pv!r}")
            kw["pad_value"] = pv
        if "compiler" in o:
            if o["compiler"] not in _COMPILERS:
                raise ConfigError(f"options['compiler']: expected one of {', '.join(_COMPILERS)}, "
                                  f"got {o['compiler']!r}")
            kw["compiler"] = o["compiler"]
        if "inductor_config" in o:
            kw["inductor_config"] = _inductor_patches(o["inductor_config"])
        kw["mode_config"] = _mode_patches(mode)
        return cls(**kw)

    def inductor_patches(self) -> dict[str, Any]:
        """Config patches for ``compile_fx``: mode's, then the user's, then CUDA graphs off."""
        return {**dict(self.mode_config), **dict(self.inductor_config), "triton.cudagraphs": False}


def _inductor_patches(cfg: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"options['inductor_config']: expected a dict of inductor config patches, got {cfg!r}")
    for k in cfg:
        if not isinstance(k, str):
            raise ConfigError(f"options['inductor_config']: expected str keys, got {k!r}")
        if "cudagraph" in k:
            raise ConfigError(f"options['inductor_config']: {k!r} is not allowed: gfxgraph captures the graphs "
                              "itself, so inductor's CUDA graphs stay off")
    return tuple(sorted(cfg.items()))


def _mode_patches(mode: str | None) -> tuple[tuple[str, Any], ...]:
    if mode is None or mode in ("default", "reduce-overhead"):  # reduce-overhead: the graphs are ours
        return ()
    if mode not in _MODES:
        raise ConfigError(f"torch.compile(mode={mode!r}) with backend 'gfxgraph': expected one of "
                          f"{', '.join(_MODES)}")
    from torch._inductor import list_mode_options

    return tuple(sorted((k, v) for k, v in list_mode_options(mode).items() if "cudagraph" not in k))


# ------------------------------------------------------------------- backend
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
    merged = {**(options or {}), **option_kwargs}
    opts = BackendOptions.from_mapping(merged, mode=mode)
    sub = CompiledSubgraph(gm, list(example_inputs), opts)

    def run(*args: Any) -> Any:
        return sub(*args)

    run.subgraph = sub  # type: ignore[attr-defined]  # introspection: state, reason, buckets
    return run


_register_lock = threading.Lock()


def register() -> bool:
    """Register :data:`BACKEND_NAMES` with dynamo if ``torch._dynamo`` is imported; cheap and idempotent.

    Returns whether the names are registered now. When dynamo is not imported
    yet this does nothing (the entry point finds the backend later) rather than
    importing it, which costs over a second. A name already taken by another
    function is left alone (logged at debug).
    """
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.backends import registry

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


# ---------------------------------------------------------------- subgraphs
class SubgraphState(enum.Enum):
    LAZY = "lazy"  # every shape specialised: the traced graph runs eagerly until static_compile_after
    GRAPHED = "graphed"  # compiled, served through bucket pools
    UNGRAPHED = "ungraphed"  # compiled, called directly (reason in CompiledSubgraph.reason)


class _BackendPool(ShapeBucketPool):
    """A pool told which outputs carry the batch, from the FX graph, instead of probing.

    The pool's probe runs the model at a second batch size; for a compiled
    frame that size may lie outside what its guards admit (dynamo specialises
    size 1), and the graph's own metadata already knows the answer.
    """

    def __init__(self, model_fn: Callable[..., Any], buckets: Sequence[int], *,
                 batched_outputs: tuple[bool, ...], validate: bool = True, **kwargs: Any) -> None:
        super().__init__(model_fn, buckets, **kwargs)
        self._top_flags = batched_outputs
        self._validate = validate  # False for a subgraph that writes state: an eager re-run would advance it

    def _validated(self, graph_out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return super()._validated(graph_out, args, kwargs) if self._validate else graph_out

    def _record_output_layout(self, entry: Any, outputs: Any, key: Any, leaves: list[Any]) -> None:
        tops = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        if len(tops) != len(self._top_flags):
            super()._record_output_layout(entry, outputs, key, leaves)
            return
        entry.out_spec = pytree.tree_flatten(outputs)[1]
        entry.out_batched = tuple(f for o, f in zip(tops, self._top_flags) for _ in pytree.tree_leaves(o))


@dataclass
class _Variant:
    """One graph set of a subgraph: for one combination of non-batch shapes and constants."""

    pool: ShapeBucketPool
    owned: list[tuple[int, torch.Tensor]]  # (input index, static buffer) copied into per call
    padding_checked: bool = False  # a padded result was compared with an unpadded run


class CompiledSubgraph:
    """One dynamo subgraph, compiled once, served through batch-bucket graphs (module docstring).

    Cost per graphed call over a bare replay: the pool's (flatten, lock, copy
    in, pad, copy out) plus a data-pointer check of the parameters (the graph
    reads them in place, so a replaced parameter means re-capture) and a lock.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], opts: BackendOptions) -> None:
        self.opts = opts
        self.plan: GraphPlan = analyze(gm, example_inputs, batch_dim=opts.batch_dim)
        self._gm: torch.fx.GraphModule | None = gm
        self._lock = threading.RLock()
        self._fn: Callable[..., Any] = gm.forward  # the traced graph as it is, until compiled
        self.compiler: str | None = None
        self.compile_seconds = 0.0
        self.state = SubgraphState.LAZY
        self.reason: str | None = None  # fallback key while UNGRAPHED
        self.detail = ""
        self._level = logging.WARNING
        self._variants: dict[tuple[Any, ...], _Variant] = {}
        self._lazy_calls = 0
        self._writes_state = False  # the graph writes to ref inputs (set at compile)
        p = self.plan
        # tensors dynamo tied to the batch, then those that merely equal it (checked per call)
        self._batched_idx = p.indices("batched") + [i for i in p.indices("batch_like")
                                                     if isinstance(example_inputs[i], torch.Tensor)]
        self._follow = [(s.index, isinstance(example_inputs[s.index], torch.Tensor))
                        for s in p.slots if s.kind == "batch_like"]
        self._ref_idx = p.indices("ref")
        self._ref_ptrs = _ref_pointers(example_inputs, self._ref_idx)
        self._owned_idx = p.indices("owned")
        self._derived = [(s.index, *s.source) for s in p.slots
                         if s.kind in ("batch_int", "shape_int", "batch_like") and s.source is not None]
        self._first = p.first_batched
        bd = opts.batch_dim
        # what makes a call need another graph set: varying non-batch shapes, constant arguments
        self._key_parts: list[tuple[int, int | None]] = [
            (s.index, bd if s.kind in ("batched", "batch_like") else None) for s in p.slots
            if s.varies and s.kind in ("batched", "owned", "batch_like")]
        self._key_parts += [(i, _CONST) for i in p.indices("const")]
        self.buckets = self._choose_buckets()
        _registry.add(self)
        if p.static and opts.static_compile_after > 1:
            return  # LAZY: compile on the static_compile_after-th call
        self._compile(example_inputs)

    # ----------------------------------------------------------- compile
    def _choose_buckets(self) -> list[int]:
        p, o = self.plan, self.opts
        base = list(o.buckets) if o.buckets else default_buckets(o.max_batch_size)
        if p.fixed_batch is not None:  # the frame serves exactly this size: no padding possible
            return [p.fixed_batch] if p.fixed_batch <= base[-1] else []
        lo, hi = p.batch_range
        return [b for b in base if b >= lo and (hi is None or b <= hi)]

    def _compile(self, args: list[Any]) -> None:
        gm = self._gm
        assert gm is not None
        fx_mutated = fx_mutated_inputs(gm)
        t0 = time.perf_counter()
        fn, self.compiler, failure = _compile_graph(gm, args, self.opts, on_cpu=self.plan.devices == {"cpu"})
        seconds = time.perf_counter() - t0
        self.compile_seconds += seconds
        _registry.count_compile(seconds)
        mutated = aot_mutated_inputs(len(args)) if self.compiler != "eager" else None
        if mutated is None:
            mutated = fx_mutated
        # called like dynamo calls a backend's function: with *args. (`_boxed_call` is no guide: AOT's
        # wrapper copies the flag from the boxed function it wraps but takes *args itself.)
        self._fn = fn
        self._gm = None
        # writes to in-place inputs (a KV cache, a step counter) are fine in a graph, but the
        # subgraph must then run exactly once per call: no unpadded re-run to check padding
        self._writes_state = bool(mutated)
        why = self._why_ungraphed(mutated, failure)
        if why is None:
            self.state = SubgraphState.GRAPHED
        else:
            self._ungraph(*why)
        logger.debug("gfxgraph backend: compiled a subgraph with %s in %.2f s (%s%s)", self.compiler,
                     self.compile_seconds, self.state.value, f": {self.reason}" if self.reason else "")

    def _why_ungraphed(self, mutated: frozenset[int], failure: str) -> tuple[str, str, int] | None:
        p, o = self.plan, self.opts
        if not o.graphs:
            return "graphs_off", "options={'graphs': False}", logging.DEBUG
        if failure:
            return "compile_failed", failure, logging.WARNING
        if p.requires_grad:
            return ("training", "grad mode is on and an input requires grad: the compiled function runs "
                    "without graphs (backward works); call under torch.no_grad() or torch.inference_mode(), "
                    "or requires_grad_(False), for graphs", logging.INFO)
        if p.unsupported is not None:
            return (*p.unsupported, logging.WARNING)
        copied = sorted(i for i in mutated if p.slots[i].kind != "ref")
        if copied:
            names = ", ".join(p.slots[i].name for i in copied)
            return ("input_mutation", f"the graph writes to its input(s) {names}, which a graph reads from "
                    "static copies, so the writes would not reach them (parameters, buffers and "
                    "mark_static_address tensors, read in place, may be written)", logging.WARNING)
        if probe().graphs_available and p.devices != {"cuda"}:
            return ("cpu_inputs", f"inputs on {', '.join(sorted(p.devices))}: graphs need every tensor "
                    "input on the GPU", logging.INFO)
        if not self.buckets:
            what = (f"the fixed batch size {p.fixed_batch}" if p.fixed_batch is not None
                    else f"the batch sizes this frame admits {p.batch_range}")
            return "oversize", f"no bucket fits {what}", logging.INFO
        return None

    def _ungraph(self, reason: str, detail: str, level: int) -> None:
        self.state = SubgraphState.UNGRAPHED
        self.reason, self.detail, self._level = reason, detail, level
        self.close()

    # -------------------------------------------------------------- call
    def __call__(self, *args: Any) -> Any:
        """Run the subgraph on dynamo's flat inputs (hot path when GRAPHED)."""
        state = self.state
        if state is SubgraphState.GRAPHED:
            out = self._graphed(args)
            if out is not _UNGRAPHED:
                return out
            state = self.state
        if state is SubgraphState.UNGRAPHED:
            _stats.record_fallback(self.reason or "ungraphed", self.detail, level=self._level)
            return self._fn(*args)
        return self._lazy(args)

    def _lazy(self, args: tuple[Any, ...]) -> Any:
        with self._lock:
            if self.state is SubgraphState.LAZY:
                self._lazy_calls += 1
                if self._lazy_calls >= self.opts.static_compile_after:
                    self._compile(list(args))
        if self.state is not SubgraphState.LAZY:
            return self(*args)
        _stats.record_fallback("static_shape_warmup", "a frame with every shape specialised runs the traced "
                               f"graph eagerly until its call {self.opts.static_compile_after}",
                               level=logging.DEBUG)
        return self._fn(*args)

    def _graphed(self, args: tuple[Any, ...]) -> Any:
        with self._lock:
            if self.state is not SubgraphState.GRAPHED:  # another thread just gave up on graphs
                return _UNGRAPHED
            if self._ref_idx and not _pointers_equal(args, self._ref_ptrs, self._ref_idx):
                self._rebind(args)
            if self._follow and not self._follows_batch(args):
                _stats.record_fallback("batch_mismatch", "a size that usually equals the batch size differs "
                                       "from it in this call")
                return self._fn(*args)
            key = self._key(args) if self._key_parts else ()
            v = self._variants.get(key)
            if v is None:
                v = self._new_variant(key, args)
                if v is None:
                    if self.state is SubgraphState.GRAPHED:  # over max_variants: this call only
                        _stats.record_fallback("max_variants", f"more than {self.opts.max_variants} shape/"
                                               "constant variants of one subgraph")
                        return self._fn(*args)
                    return _UNGRAPHED
            if self._writes_state and not self._exact_bucket(v, args):
                _stats.record_fallback("padded_state_write", "a subgraph that writes to its parameters or "
                                       "buffers runs without graphs at batch sizes that are not a bucket: "
                                       "padding rows could write to that state (pass options={'buckets': "
                                       "[...]} with the sizes you run)")
                return self._fn(*args)
            for i, buf in v.owned:
                buf.copy_(args[i])
            out = v.pool(*[args[i] for i in self._batched_idx])
            if self.plan.int_outputs:
                out = self._fix_int_outputs(out, args)
            if not v.padding_checked or _settings.current().validate:
                out = self._check_padding(v, out, args)
            return out

    def _check_padding(self, v: _Variant, out: Any, args: tuple[Any, ...]) -> Any:
        """Compare the first padded result with an unpadded run of the compiled function (and, in
        validate mode, every result, returning the unpadded one).

        Padding is only sound when rows are independent; a reduction over the
        batch (``x - x.mean(0)``) cannot be read from the graph, but the first
        padded call shows it. The comparison is by relative norm per output, so
        rounding differences between GEMMs of two sizes do not count, while a
        changed row does. Costs one extra run and a host sync, once per variant.
        """
        batch = args[self._first].shape[self.opts.batch_dim]
        bucket = v.pool.bucket_for(batch)
        padded = bucket is not None and bucket > batch
        validate = _settings.current().validate
        if self._writes_state:  # a second run would advance the state twice
            v.padding_checked = True
            if validate:
                log_once(("gfxgraph-backend-novalidate", id(self)), logging.INFO,
                         "gfxgraph backend: a subgraph that writes to its parameters or buffers is not "
                         "validated (comparing would run it twice)")
            return out
        if not padded and not validate:
            return out
        unpadded = self._fn(*args)
        if validate:
            ok, _ = outputs_match(out, unpadded)
            _stats.record_validation(ok)
        if padded and not v.padding_checked:
            v.padding_checked = True
            why = _padding_changed(out, unpadded)
            if why:
                self._ungraph("padding_changes_results", f"batch {batch} padded to {bucket}: {why}; rows depend "
                              "on each other (a reduction over the batch?) or the graph is random",
                              logging.WARNING)
                return unpadded
        return unpadded if validate else out

    def _exact_bucket(self, v: _Variant, args: tuple[Any, ...]) -> bool:
        """No padding for this call (a batch above every bucket counts: the pool runs it unpadded)."""
        batch = args[self._first].shape[self.opts.batch_dim]
        bucket = v.pool.bucket_for(batch)
        return bucket is None or bucket == batch

    def _follows_batch(self, args: tuple[Any, ...]) -> bool:
        """Whether every batch_like input equals the batch size in this call (so padding it is sound)."""
        bd = self.opts.batch_dim
        batch = args[self._first].shape[bd]
        return all((args[i].shape[bd] if is_tensor else args[i]) == batch for i, is_tensor in self._follow)

    def _key(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Which graph set serves this call (its non-batch shapes and constants)."""
        parts: list[Any] = []
        for i, mode in self._key_parts:
            v = args[i]
            if mode == _CONST:
                parts.append(v)
            elif mode is None:
                parts.append(tuple(v.shape))
            else:  # a batched tensor: its shape without the batch
                shape = tuple(v.shape)
                parts.append(shape[:mode] + shape[mode + 1:])
        return tuple(parts)

    def _rebind(self, args: tuple[Any, ...]) -> None:
        """A parameter or buffer moved (replaced, ``.data`` reassigned): the graphs read the old memory."""
        log_once(("gfxgraph-backend-rebind", id(self)), logging.INFO,
                 "gfxgraph backend: parameters or buffers of a compiled subgraph moved; re-capturing its graphs")
        self.close()
        self._ref_ptrs = _ref_pointers(args, self._ref_idx)

    def _new_variant(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> _Variant | None:
        if len(self._variants) >= self.opts.max_variants:
            return None
        bad = [self.plan.slots[i].name for i in self._batched_idx if not args[i].is_contiguous()]
        if bad:  # the pool's buffers are contiguous; the compiled code expects these strides
            self._ungraph("strided_input", f"batched input(s) {', '.join(bad)} are not contiguous",
                          logging.WARNING)
            return None
        template: list[Any] = list(args)
        owned = []
        for i in self._owned_idx:
            template[i] = buf = args[i].detach().clone()  # keeps the strides the compiled code expects...
            if buf.stride() != args[i].stride():  # ...unless they overlap (expanded): no static copy has them
                self._ungraph("strided_input", f"input {self.plan.slots[i].name} has overlapping strides "
                              f"{args[i].stride()}", logging.WARNING)
                return None
            owned.append((i, buf))
        for i in self._batched_idx:
            template[i] = None  # never keep the caller's tensors alive
        for i, _j, _d in self._derived:
            template[i] = None
        o = self.opts
        pool = _BackendPool(self._runner(template), self.buckets, batched_outputs=self.plan.batched_outputs,
                            validate=not self._writes_state,
                            batch_dim=o.batch_dim, pad_value=o.pad_value, copy_outputs=o.copy_outputs,
                            oversize="eager", warmup_iters=o.warmup_iters, vram_cap=o.vram_cap, progress=False)
        v = self._variants[key] = _Variant(pool, owned)
        return v

    def _runner(self, template: list[Any]) -> Callable[..., Any]:
        """The model the pool captures: batched views (at bucket size) in, the full input list rebuilt.

        Runs only at warm-up, capture and eager fallback, never on replay.
        Sizes derived from the batch are read from the views, so inside a
        graph they are the bucket size.
        """
        fn, batched_idx, derived = self._fn, self._batched_idx, self._derived

        def run(*batched: torch.Tensor) -> Any:
            full = list(template)
            for i, t in zip(batched_idx, batched):
                full[i] = t if t.is_contiguous() else t.contiguous()  # batch_dim > 0: views are strided
            for i, j, d in derived:
                full[i] = full[j].shape[d]
            return fn(*full)

        return run

    def _fix_int_outputs(self, out: Any, args: tuple[Any, ...]) -> Any:
        """Symbolic ints among the outputs were captured at bucket size: recompute them for this call."""
        vals = list(out)
        for io in self.plan.int_outputs:
            subs = {sym: (args[j] if d is None else args[j].shape[d]) for sym, j, d in io.sources}
            vals[io.position] = subs[io.expr] if io.expr in subs else int(io.expr.xreplace(subs))
        return tuple(vals) if isinstance(out, tuple) else vals

    # ------------------------------------------------------- introspection
    @property
    def captured_buckets(self) -> list[int]:
        """Buckets with a captured graph, over every variant."""
        return sorted({b for v in list(self._variants.values()) for b in v.pool.captured_buckets})

    def graph_count(self) -> int:
        """Captured graphs over every variant."""
        return sum(len(v.pool.captured_buckets) for v in list(self._variants.values()))

    def pool_bytes(self) -> int:
        """Graph-pool bytes held by this subgraph's graphs (allocator figures)."""
        return sum(v.pool.pool_bytes() for v in list(self._variants.values()))

    def close(self) -> None:
        """Release every graph and static buffer; a later call captures again. Idempotent."""
        with self._lock:
            variants, self._variants = self._variants, {}
            for v in variants.values():
                v.pool.close()

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return (f"CompiledSubgraph(state={self.state.value}{why}, compiler={self.compiler}, "
                f"buckets={self.buckets}, captured={self.captured_buckets})")


_UNGRAPHED = object()  # _graphed's answer when the subgraph just turned UNGRAPHED

# relative-norm tolerance of the padding check: well above rounding (GEMMs of two sizes sum in
# different orders), well below what one changed row does to an output
_PADDING_RTOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def _padding_changed(padded: Any, unpadded: Any) -> str:
    """Why two output pytrees differ beyond rounding ("" when they agree)."""
    a_leaves, a_spec = pytree.tree_flatten(padded)
    b_leaves, b_spec = pytree.tree_flatten(unpadded)
    if a_spec != b_spec:
        return f"output structure {a_spec} vs {b_spec}"
    for k, (a, b) in enumerate(zip(a_leaves, b_leaves)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {k}: {a!r} vs {b!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {k}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                return f"output {k}: integer values differ"
            continue
        wide = torch.complex128 if a.is_complex() else torch.float64
        fa, fb = a.detach().to(wide), b.detach().to(wide)
        finite = torch.isfinite(fb)
        if not torch.equal(torch.isfinite(fa), finite):
            return f"output {k}: non-finite values in different places"
        fa, fb = fa[finite], fb[finite]
        rel = ((fa - fb).norm() / fb.norm().clamp_min(1e-30)).item()
        if rel > _PADDING_RTOL.get(a.dtype, 1e-3):
            return f"output {k}: relative difference {rel:.3g}"
    return ""
_CONST = -1  # key-part mode of a constant argument (else a tensor's batch dim, or None: its whole shape)


def _ref_pointers(args: Sequence[Any], idx: list[int]) -> list[int | None]:
    """Data pointers of the ref inputs, by input position (None elsewhere)."""
    ptrs: list[int | None] = [None] * len(args)
    for i in idx:
        ptrs[i] = args[i].data_ptr()
    return ptrs


def _pointers_equal_py(args: Sequence[Any], ptrs: list[int | None], idx: list[int]) -> bool:
    return all(args[i].data_ptr() == ptrs[i] for i in idx)


@functools.lru_cache(maxsize=1)
def _pointer_check() -> Callable[[Sequence[Any], list[int | None], list[int]], bool]:
    """Inductor's C++ pointer check (CUDA builds; the same check its CUDA graphs make per call) when it
    passes a self-test, else Python (about 0.1 us per parameter)."""
    fast = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if fast is None:
        return _pointers_equal_py
    t = torch.zeros(2)
    try:
        if fast([t, 3], [t.data_ptr(), None], [0]) and not fast([t, 3], [t.data_ptr() + 4, None], [0]):
            return lambda args, ptrs, idx: fast(list(args), ptrs, idx)
    except Exception:
        pass
    return _pointers_equal_py


def _pointers_equal(args: Sequence[Any], ptrs: list[int | None], idx: list[int]) -> bool:
    """Whether the ref inputs still live where the graphs read them (hot path)."""
    return _pointer_check()(args, ptrs, idx)


# ----------------------------------------------------------------- compiling
@functools.lru_cache(maxsize=1)
def _cpu_compiler_problem() -> str | None:
    """Why inductor cannot build CPU kernels here (None: a C++ compiler was found)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _compile_graph(gm: torch.fx.GraphModule, args: list[Any], opts: BackendOptions, *,
                   on_cpu: bool) -> tuple[Callable[..., Any], str, str]:
    """Compile ``gm`` with ``opts.compiler``; returns (function, compiler used, failure or "").

    An inductor failure falls back to the traced graph run as it is, without
    graphs (the caller records it as ``compile_failed``): a backend bug must not
    stop the model.
    """
    compiler = opts.compiler
    if compiler == "inductor" and on_cpu and (why := _cpu_compiler_problem()):
        log_once(("gfxgraph-backend-no-cxx",), logging.WARNING,
                 "gfxgraph backend: inductor cannot build CPU kernels (%s); running the traced graphs "
                 "as they are (options={'compiler': 'eager'} silences this)", why)
        compiler = "eager"
    if compiler == "inductor":
        try:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, args, config_patches=opts.inductor_patches()), "inductor", ""
        except Exception as exc:
            if _is_dynamo_signal(exc):
                raise
            logger.warning("gfxgraph backend: inductor failed on a subgraph (%s: %s); it runs as traced, "
                           "without graphs", type(exc).__name__, exc)
            return gm.forward, "eager", f"inductor failed: {type(exc).__name__}: {exc}"
    if compiler == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, args), "aot_eager", ""
    return gm.forward, "eager", ""


def _is_dynamo_signal(exc: BaseException) -> bool:
    """Exceptions dynamo uses for control flow must reach it."""
    try:
        from torch._dynamo import exc as dexc
    except ImportError:
        return False
    signals = tuple(t for t in (getattr(dexc, "SkipFrame", None), getattr(dexc, "RestartAnalysis", None)) if t)
    return isinstance(exc, signals)


# ------------------------------------------------------------------- stats
class _Registry:
    """Live subgraphs (weakly held) and compile counters, for :func:`backend_stats`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: weakref.WeakSet[CompiledSubgraph] = weakref.WeakSet()
        self.compiles = 0
        self.compile_seconds = 0.0

    def add(self, sub: CompiledSubgraph) -> None:
        with self.lock:
            self.live.add(sub)

    def count_compile(self, seconds: float) -> None:
        with self.lock:
            self.compiles += 1
            self.compile_seconds += seconds

    def subgraphs(self) -> list[CompiledSubgraph]:
        with self.lock:
            return list(self.live)


_registry = _Registry()


def backend_stats() -> dict[str, Any]:
    """What the backend holds now: subgraphs by state, fallback reasons, compiles, graphs, memory.

    Keys: ``subgraphs``, ``graphed``, ``lazy``, ``ungraphed`` (reason -> count),
    ``compiles`` and ``compile_seconds`` (process totals), ``graphs`` (captured
    bucket graphs), ``pool_bytes`` (their graph-pool memory). Cost: walks the
    allocator's segments (milliseconds).
    """
    subs = _registry.subgraphs()
    ungraphed: dict[str, int] = {}
    for s in subs:
        if s.state is SubgraphState.UNGRAPHED:
            ungraphed[s.reason or "?"] = ungraphed.get(s.reason or "?", 0) + 1
    with _registry.lock:
        compiles, seconds = _registry.compiles, _registry.compile_seconds
    return {
        "subgraphs": len(subs),
        "graphed": sum(s.state is SubgraphState.GRAPHED for s in subs),
        "lazy": sum(s.state is SubgraphState.LAZY for s in subs),
        "ungraphed": ungraphed,
        "compiles": compiles,
        "compile_seconds": seconds,
        "graphs": sum(s.graph_count() for s in subs),
        "pool_bytes": sum(s.pool_bytes() for s in subs),
    }


def compiled_subgraphs() -> list[CompiledSubgraph]:
    """The live subgraphs the backend has compiled (state, reason, buckets, captured graphs)."""
    return _registry.subgraphs()


def reset_backend() -> None:
    """Release the graphs of every live subgraph (they re-capture if called again).

    ``torch._dynamo.reset()`` calls this (as ``gfxgraph_backend.reset``) when it
    drops the compiled code.
    """
    for s in _registry.subgraphs():
        s.close()


gfxgraph_backend.reset = reset_backend  # type: ignore[attr-defined]
