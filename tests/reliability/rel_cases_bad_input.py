"""Bad input over every public entry point: each gets an exception that names what was expected.

Pure argument validation cannot abort the process, so these run grouped, one
interpreter per group:

* ``bad_input_any``: runs (and must pass) on CPU-only machines too; on a GPU
  machine the same checks run with CUDA tensors. Tier 2 objects are checked
  against a small fake runtime (argument validation happens before any runtime call).
* ``bad_input_gpu``: needs real captures (graph states, keep_graph, devices).
* ``bad_input_env``: environment variables read at import and the CLI, each
  in a nested fresh interpreter (under pytest, a process forked from a warm
  interpreter that imported torch only: ``tests/_warm_python.py``).

"Accepted silently" (no exception) is a failure; a wrong result from accepted
bad input is ``silent_wrong``.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph, ConfigError, GraphCompositor, LaunchPipeline, ShapeBucketPool, UpdatableGraph
from hipgraph_bridge.runtime import Graph, Runtime, reset_runtime_cache
from rel_registry import WARM_ENV, Ctx, SilentWrong, Skip, case
from rel_tools import capturing, expect_raises

ANY, GPU, ENV = "bad_input_any", "bad_input_gpu", "bad_input_env"
REPO = Path(__file__).resolve().parents[2]


def bad(name: str, api: str, kind: str, *, group: str = ANY, category: str = "bad_input",
        known_issue: str = "") -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    where = "gpu" if group == GPU else "any"

    def deco(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        def run(ctx: Ctx) -> None:
            if where == "gpu" and not ctx.gpu:
                raise Skip("needs a GPU")
            fn(ctx)

        run.__doc__ = fn.__doc__
        case(name, category, where=where, unit=group, timeout=150.0 if group == ENV else 120.0,
             cost=3.0, api=api, kind=kind, known_issue=known_issue)(run)
        return fn

    return deco


def _dev(ctx: Ctx) -> str:
    return "cuda" if ctx.gpu else "cpu"


def _record(ctx: Ctx, *results: dict[str, Any]) -> None:
    ctx.observed.setdefault("raised", []).extend(results)


def _id(t: Any) -> Any:
    return t


class _FakeRuntime(Runtime):
    """Hands out handles and does nothing: argument checks happen before any real runtime call."""

    name, kind, prefix, binding = "cuda", "fake", "cuda", "fake (reliability suite)"

    def __init__(self) -> None:
        self._ids = itertools.count(0x1000, 0x10)

    def _new(self) -> int:
        return next(self._ids)

    def _error_name(self, code: int) -> str:
        return f"cudaErrorFake{code}"

    def _error_string(self, code: int) -> str:
        return "fake"

    def _clear_last_error(self) -> None:
        pass

    def _has(self, suffix: str) -> bool:
        return True

    def runtime_version(self) -> int:
        return 13000

    def driver_version(self) -> int:
        return 13000

    def graph_create(self) -> int:
        return self._new()

    def graph_destroy(self, graph: int) -> None:
        pass

    def graph_clone(self, graph: int) -> int:
        return self._new()

    def graph_node_count(self, graph: int) -> int:
        return 0

    def graph_add_child(self, graph: int, deps: Any, child: int) -> int:
        return self._new()

    def graph_instantiate(self, graph: int, flags: int = 0) -> int:
        return self._new()

    def exec_destroy(self, exec_: int) -> None:
        pass

    def exec_launch(self, exec_: int, stream: int) -> None:
        pass

    def exec_upload(self, exec_: int, stream: int) -> None:
        pass

    def event_create(self) -> int:
        return self._new()

    def event_destroy(self, event: int) -> None:
        pass

    def event_record(self, event: int, stream: int) -> None:
        pass

    def event_query(self, event: int) -> bool:
        return True

    def event_synchronize(self, event: int) -> None:
        pass

    def stream_wait_event(self, stream: int, event: int) -> None:
        pass


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


# ================================================================= BridgedCUDAGraph / enable()
@bad("b_keep_graph_not_bool", "BridgedCUDAGraph()", "keep_graph of another type")
def _b_keep(ctx: Ctx) -> None:
    for v in ("yes", 1, None):
        _record(ctx, expect_raises(TypeError, r"keep_graph: expected a bool", BridgedCUDAGraph, keep_graph=v))


@bad("b_enable_flags_not_bool", "gfxgraph.enable()", "debug=/validate= of another type")
def _b_enable(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"debug and validate must be bools", gfxgraph.enable, debug="yes"))
    _record(ctx, expect_raises(TypeError, r"debug and validate must be bools", gfxgraph.enable, validate=1))
    assert not gfxgraph.is_enabled(), "a rejected enable() call enabled gfxgraph anyway"


@bad("b_capture_model_fn_not_callable", "BridgedCUDAGraph.capture()", "model_fn not callable")
def _b_model_fn(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"model_fn: expected a callable, got int",
                               BridgedCUDAGraph().capture, model_fn=3))


@bad("b_capture_example_input_not_tensor", "BridgedCUDAGraph.capture()", "example_input not a tensor pytree")
def _b_example(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"example_input: expected a tensor",
                               BridgedCUDAGraph().capture, model_fn=_double, example_input=[1, 2]))


@bad("b_capture_warmup_iters", "BridgedCUDAGraph.capture()", "warmup_iters negative / float / bool")
def _b_warmup(ctx: Ctx) -> None:
    for v in (-1, 1.5, True):
        _record(ctx, expect_raises(ValueError, r"warmup_iters: expected an int >= 0",
                                   BridgedCUDAGraph().capture, model_fn=_double, warmup_iters=v))


@bad("b_capture_buckets_without_dynamic_shapes", "BridgedCUDAGraph.capture()", "buckets= without dynamic_shapes")
def _b_buckets_static(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"buckets= needs dynamic_shapes=True",
                               BridgedCUDAGraph().capture, model_fn=_double, buckets=[1, 2]))


@bad("b_capture_dynamic_and_conditional", "BridgedCUDAGraph.capture()", "dynamic_shapes with conditional_branches")
def _b_dyn_cond(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"cannot be combined", BridgedCUDAGraph().capture, model_fn=_double,
                               dynamic_shapes=True, conditional_branches={"a": _double}))


@bad("b_capture_dynamic_without_model_fn", "BridgedCUDAGraph.capture()", "dynamic_shapes without model_fn")
def _b_dyn_nomodel(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"needs model_fn", BridgedCUDAGraph().capture, dynamic_shapes=True))


@bad("b_capture_dynamic_bad_buckets", "BridgedCUDAGraph.capture()", "dynamic_shapes with a bad bucket list")
def _b_dyn_buckets(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"buckets: expected positive ints", BridgedCUDAGraph().capture,
                               model_fn=_double, dynamic_shapes=True, buckets=[0, 4]))


# ================================================================= ShapeBucketPool options
def _pool(**kwargs: Any) -> ShapeBucketPool:
    args = {"model_fn": _double, "buckets": [2, 4], "progress": False, **kwargs}
    return ShapeBucketPool(**args)


@bad("b_pool_model_fn_not_callable", "ShapeBucketPool()", "model_fn not callable")
def _b_pool_fn(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"model_fn: expected a callable", _pool, model_fn="model"))


@bad("b_pool_buckets_empty", "ShapeBucketPool()", "empty bucket list")
def _b_pool_empty(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"at least one bucket", _pool, buckets=[]))


@bad("b_pool_buckets_not_positive", "ShapeBucketPool()", "bucket sizes 0 / negative")
def _b_pool_nonpos(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"positive ints, got 0", _pool, buckets=[0, 4]))
    _record(ctx, expect_raises(ValueError, r"positive ints, got -1", _pool, buckets=[-1]))


@bad("b_pool_buckets_not_int", "ShapeBucketPool()", "bucket sizes float / bool")
def _b_pool_nonint(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"positive ints, got 2.5", _pool, buckets=[2.5]))
    _record(ctx, expect_raises(ValueError, r"positive ints, got True", _pool, buckets=[True, 4]))


@bad("b_pool_buckets_not_iterable", "ShapeBucketPool()", "buckets as a str / an int")
def _b_pool_noniter(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"iterable of positive ints", _pool, buckets="1,2"))
    _record(ctx, expect_raises(TypeError, r"iterable of positive ints", _pool, buckets=7))


@bad("b_pool_max_batch_size", "ShapeBucketPool() / default_buckets()", "max_batch_size 0 / float")
def _b_pool_max(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"max_batch_size: expected a positive int", _pool, buckets=None,
                               max_batch_size=0))
    _record(ctx, expect_raises(ValueError, r"max_batch_size: expected a positive int", gfxgraph.default_buckets,
                               2.5))


@bad("b_pool_batch_dim", "ShapeBucketPool()", "batch_dim negative / str")
def _b_pool_bd(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"batch_dim: expected an int >= 0", _pool, batch_dim=-1))
    _record(ctx, expect_raises(ValueError, r"batch_dim: expected an int >= 0", _pool, batch_dim="0"))


@bad("b_pool_oversize_mode", "ShapeBucketPool()", "oversize not 'eager'/'error'")
def _b_pool_oversize(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"oversize: expected 'eager' or 'error'", _pool, oversize="drop"))


@bad("b_pool_pad_value", "ShapeBucketPool()", "pad_value a str")
def _b_pool_pad(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"pad_value: expected a number or None", _pool, pad_value="x"))


@bad("b_pool_static_args_items", "ShapeBucketPool()", "static_args holding a float")
def _b_pool_static_items(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"static_args: expected argument positions", _pool, static_args=[1.5]))


@bad("b_pool_static_args_str", "ShapeBucketPool()", "static_args='bias' (a str, not a list of names)")
def _b_pool_static_str(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"static_args", _pool, static_args="bias"))


@bad("b_pool_vram_cap", "ShapeBucketPool()", "vram_cap outside (0, 1] / a str")
def _b_pool_vram(ctx: Ctx) -> None:
    for v in (2.0, 0, "0.5"):
        _record(ctx, expect_raises(ValueError, r"vram_cap: expected a fraction of device memory in \(0\.0, 1\.0\]",
                                   _pool, vram_cap=v))


@bad("b_pool_capture_error_mode", "ShapeBucketPool()", "capture_error_mode unknown")
def _b_pool_mode(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"capture_error_mode: expected one of global, thread_local, relaxed",
                               _pool, capture_error_mode="loose"))


@bad("b_pool_generators_not_generators", "ShapeBucketPool()", "generators=[3]")
def _b_pool_gens(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"generators", _pool, generators=[3]))


@bad("b_pool_copy_outputs_not_bool", "ShapeBucketPool()", "copy_outputs='no'")
def _b_pool_copy(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"copy_outputs", _pool, copy_outputs="no"))


# ================================================================= ShapeBucketPool calls
def _fixed_pool(ctx: Ctx, **kwargs: Any) -> ShapeBucketPool:
    pool = _pool(model_fn=lambda x, **kw: x * 2, **kwargs)
    x = torch.ones(3, 4, device=_dev(ctx))
    out = pool(x)  # fixes the layout: one float32 (B, 4) tensor
    if not torch.equal(out, x * 2):
        raise SilentWrong("the pool's first call is wrong")
    return pool


def _call_check(name: str, kind: str, exc: Any, pattern: str,
                make: Callable[[str], tuple[tuple[Any, ...], dict[str, Any]]], **pool_kwargs: Any) -> None:
    @bad(name, "ShapeBucketPool.__call__", kind)
    def _check(ctx: Ctx) -> None:
        pool = _fixed_pool(ctx, **pool_kwargs)
        args, kwargs = make(_dev(ctx))
        _record(ctx, expect_raises(exc, pattern, pool, *args, **kwargs))


_call_check("b_pool_call_empty_batch", "a batch of 0 rows", ValueError, r"empty batch: expected batch size >= 1",
            lambda d: ((torch.zeros(0, 4, device=d),), {}))
_call_check("b_pool_call_wrong_feature_shape", "another non-batch shape", ValueError,
            r"shape without the batch dim \(4,\)", lambda d: ((torch.zeros(3, 5, device=d),), {}))
_call_check("b_pool_call_wrong_dtype", "another dtype", ValueError, r"expected dtype=torch\.float32",
            lambda d: ((torch.zeros(3, 4, dtype=torch.float64, device=d),), {}))
_call_check("b_pool_call_wrong_rank", "another rank", ValueError, r"shape without the batch dim",
            lambda d: ((torch.zeros(3, 4, 1, device=d),), {}))
_call_check("b_pool_call_no_tensor", "no tensor argument", TypeError,
            r"expected at least one tensor argument with a batch dimension", lambda d: (([1, 2, 3],), {}))
_call_check("b_pool_call_scalar_tensor", "a 0-dim tensor", TypeError, r"expected at least one tensor argument",
            lambda d: ((torch.tensor(1.0, device=d),), {}))
_call_check("b_pool_call_wrong_arg_count", "an extra positional argument", ValueError,
            r"expected 1 positional argument", lambda d: ((torch.zeros(3, 4, device=d), torch.zeros(3, 4, device=d)), {}))
_call_check("b_pool_call_unexpected_kwarg", "an unexpected keyword argument", ValueError,
            r"keyword arguments \[\] \(as at the first call\)", lambda d: ((torch.zeros(3, 4, device=d),), {"key": 1}))
_call_check("b_pool_call_oversize_error", "a batch above the largest bucket with oversize='error'", ValueError,
            r"batch size 9 is above the largest bucket 4", lambda d: ((torch.zeros(9, 4, device=d),), {}),
            oversize="error")


@bad("b_pool_call_wrong_device", "ShapeBucketPool.__call__", "a tensor on another device than at the first call")
def _b_pool_device(ctx: Ctx) -> None:
    pool = _fixed_pool(ctx)
    other = "cpu" if ctx.gpu else "meta"
    _record(ctx, expect_raises(ValueError, r"device=", pool, torch.zeros(3, 4, device=other)))


@bad("b_pool_call_unhashable_constant", "ShapeBucketPool.__call__", "an unhashable non-tensor argument")
def _b_pool_unhashable(ctx: Ctx) -> None:
    pool = _pool(model_fn=lambda x, y, opt: x + y)
    d = _dev(ctx)
    _record(ctx, expect_raises(TypeError, r"must be hashable; got set", pool, torch.ones(2, 2, device=d),
                               torch.ones(2, 2, device=d), {1, 2}))


@bad("b_pool_call_mismatched_batches", "ShapeBucketPool.__call__", "two batched tensors of different batch sizes")
def _b_pool_mismatch(ctx: Ctx) -> None:
    pool = _pool(model_fn=lambda x, y: x + y)
    d = _dev(ctx)
    _record(ctx, expect_raises(ValueError, r"expected batch size 2 in dim 0 \(as args\[0\]\), got 3", pool,
                               torch.ones(2, 2, device=d), torch.ones(3, 2, device=d)))


@bad("b_pool_bucket_for", "ShapeBucketPool.bucket_for()", "batch_size 0 / bool / float")
def _b_bucket_for(ctx: Ctx) -> None:
    pool = _pool()
    for v in (0, True, 2.0):
        _record(ctx, expect_raises(ValueError, r"batch_size: expected a positive int", pool.bucket_for, v))


# ================================================================= high-level replay arguments
def _dynamic_graph(ctx: Ctx) -> BridgedCUDAGraph:
    g = BridgedCUDAGraph()
    with g.capture(dynamic_shapes=True, model_fn=_double, buckets=[2, 4, 8],
                   example_input=torch.ones(2, 3, device=_dev(ctx))):
        pass
    return g


def _static_graph(ctx: Ctx) -> BridgedCUDAGraph:
    g = BridgedCUDAGraph()
    with g.capture(model_fn=_double, example_input=torch.ones(8, 64, device=_dev(ctx))):
        pass
    return g


@bad("b_dynamic_replay_disagreeing_batch_size", "BridgedCUDAGraph.replay()", "batch_size= disagrees with the input")
def _b_dyn_disagree(ctx: Ctx) -> None:
    g = _dynamic_graph(ctx)
    _record(ctx, expect_raises(ValueError, r"batch_size=4 disagrees with input_tensor's batch size 3", g.replay,
                               input_tensor=torch.ones(3, 3, device=_dev(ctx)), batch_size=4))


@bad("b_dynamic_replay_no_arguments", "BridgedCUDAGraph.replay()", "dynamic session replayed without arguments")
def _b_dyn_noargs(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"needs input_tensor= or batch_size=", _dynamic_graph(ctx).replay))


@bad("b_dynamic_replay_above_largest_bucket", "BridgedCUDAGraph.replay()", "batch_size above the largest bucket")
def _b_dyn_above(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"above the largest bucket 8", _dynamic_graph(ctx).replay,
                               batch_size=999))


@bad("b_dynamic_replay_branch", "BridgedCUDAGraph.replay()", "branch= on a dynamic-shape session")
def _b_dyn_branch(ctx: Ctx) -> None:
    _record(ctx, expect_raises(TypeError, r"branch=\.\.\.\) needs capture\(conditional_branches",
                               _dynamic_graph(ctx).replay, branch="a"))


@bad("b_static_replay_batch_size_or_branch", "BridgedCUDAGraph.replay()", "batch_size= / branch= on a static session")
def _b_static_args(ctx: Ctx) -> None:
    g = _static_graph(ctx)
    _record(ctx, expect_raises(TypeError, r"batch_size= needs capture\(dynamic_shapes=True\)", g.replay,
                               batch_size=2))
    _record(ctx, expect_raises(TypeError, r"branch= needs capture\(conditional_branches", g.replay, branch="x"))


@bad("b_capture_twice_on_one_object", "BridgedCUDAGraph.capture()", "capture() twice on one graph object (valid "
     "input; must work on every build)", category="fault")
def _b_twice(ctx: Ctx) -> None:
    g = BridgedCUDAGraph()
    d = _dev(ctx)
    with g.capture(model_fn=_double, example_input=torch.ones(4, 4, device=d)):
        pass
    with g.capture(model_fn=lambda t: t + 1, example_input=torch.ones(4, 4, device=d)) as cap:
        pass
    ctx.observed["mode"] = cap.mode
    x = torch.randn(4, 4, device=d)
    if not torch.equal(g.replay(input_tensor=x), x + 1):
        raise SilentWrong("the second capture() on one object replays the first model")


# ================================================================= environment variables (read at use)
class _env:
    def __init__(self, **values: str) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v
        reset_runtime_cache()

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_runtime_cache()


@bad("b_env_vram_cap", "GFXGRAPH_VRAM_CAP", "90% / 1.5 / 0 / half")
def _b_env_vram(ctx: Ctx) -> None:
    for raw in ("90%", "1.5", "0", "half"):
        with _env(GFXGRAPH_VRAM_CAP=raw):
            _record(ctx, expect_raises(ConfigError, r"GFXGRAPH_VRAM_CAP=.*expected a fraction of device memory in "
                                       r"\(0\.0, 1\.0\]", _pool))


@bad("b_env_runtime_lib", "GFXGRAPH_LIB", "a missing file / a folder")
def _b_env_lib(ctx: Ctx) -> None:
    from hipgraph_bridge.runtime import get_runtime

    for raw in ("/nonexistent/libcudart.so.13", str(REPO)):
        with _env(GFXGRAPH_LIB=raw):
            _record(ctx, expect_raises(ConfigError, r"GFXGRAPH_LIB=.*expected the path of a regular file",
                                       get_runtime))
            report = gfxgraph.health_check()
            ctx.observed["health_native_bridge"] = report["native_bridge"]
            assert report["native_bridge"] is False and any("GFXGRAPH_LIB" in d for d in report["details"]), \
                f"health_check() does not name the bad GFXGRAPH_LIB: {report['details']}"


@bad("b_env_runtime_kind", "GFXGRAPH_RUNTIME", "an unknown binding name")
def _b_env_kind(ctx: Ctx) -> None:
    from hipgraph_bridge.runtime import get_runtime

    with _env(GFXGRAPH_RUNTIME="fastest"):
        _record(ctx, expect_raises(ConfigError, r"GFXGRAPH_RUNTIME='fastest': expected one of auto, "
                                   r"cuda-bindings, ctypes", get_runtime))


# ================================================================= Tier 2 objects (fake runtime)
def _fake_graph(rt: _FakeRuntime) -> Graph:
    return Graph.create(runtime=rt)


@bad("b_compositor_options", "GraphCompositor()", "swap unknown / runtime of another type / unknown runtime kind")
def _b_comp_opts(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"swap: expected one of auto, reinstantiate", GraphCompositor,
                               runtime=_FakeRuntime(), swap="fast"))
    _record(ctx, expect_raises(TypeError, r"runtime: expected None, a Runtime or one of", GraphCompositor, runtime=5))
    _record(ctx, expect_raises(ValueError, r"runtime: expected None, a Runtime or one of auto, cuda-bindings, ctypes, got .nope.", GraphCompositor,
                               runtime="nope"))


@bad("b_compositor_add_arguments", "GraphCompositor.add()", "name not a str / empty; after a str; not a graph")
def _b_comp_add(ctx: Ctx) -> None:
    rt = _FakeRuntime()
    comp = GraphCompositor(runtime=rt)
    _record(ctx, expect_raises(TypeError, r"name: expected a str, got int", comp.add, 1, _fake_graph(rt)))
    _record(ctx, expect_raises(ValueError, r"name: expected a non-empty str", comp.add, "", _fake_graph(rt)))
    comp.add("a", _fake_graph(rt))
    _record(ctx, expect_raises(TypeError, r"write after=\['a'\]", comp.add, "b", _fake_graph(rt), after="a"))
    _record(ctx, expect_raises(ValueError, r"already exists", comp.add, "a", _fake_graph(rt)))
    _record(ctx, expect_raises(TypeError, r"expected a torch\.cuda\.CUDAGraph captured with keep_graph=True",
                               comp.add, "c", "not a graph"))


@bad("b_compositor_dag_and_state", "GraphCompositor.instantiate()/launch()", "unknown dependency, cycle, launch "
     "before instantiate")
def _b_comp_dag(ctx: Ctx) -> None:
    rt = _FakeRuntime()
    comp = GraphCompositor(runtime=rt)
    _record(ctx, expect_raises(RuntimeError, r"instantiate\(\) first", comp.launch, 0))
    comp.add("a", _fake_graph(rt), after=["ghost"])
    _record(ctx, expect_raises(ValueError, r"'ghost', which is not a child", comp.instantiate, stream=0))
    comp = GraphCompositor(runtime=rt)
    comp.add("a", _fake_graph(rt), after=["b"])
    comp.add("b", _fake_graph(rt), after=["a"])
    _record(ctx, expect_raises(ValueError, r"the dependencies form a cycle", comp.instantiate, stream=0))


@bad("b_updatable_graph_arguments", "UpdatableGraph()", "strategy unknown / not a graph")
def _b_updatable(ctx: Ctx) -> None:
    rt = _FakeRuntime()
    _record(ctx, expect_raises(ValueError, r"strategy: expected one of auto, reinstantiate", UpdatableGraph,
                               _fake_graph(rt), runtime=rt, strategy="never"))
    _record(ctx, expect_raises(TypeError, r"expected a torch\.cuda\.CUDAGraph", UpdatableGraph, 5, runtime=rt))


@bad("b_launch_pipeline_arguments", "LaunchPipeline()", "instances 0 / bool / float; device_launch not a bool")
def _b_pipeline(ctx: Ctx) -> None:
    rt = _FakeRuntime()
    for v in (0, True, 2.0):
        _record(ctx, expect_raises(ValueError, r"instances: expected an int >= 1", LaunchPipeline, _fake_graph(rt),
                                   runtime=rt, instances=v))
    _record(ctx, expect_raises(TypeError, r"device_launch: expected a bool, got str", LaunchPipeline,
                               _fake_graph(rt), runtime=rt, device_launch="yes"))


# ================================================================= GPU-only checks
def _side() -> torch.cuda.Stream:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return s


@bad("g_capture_begin_error_mode", "BridgedCUDAGraph.capture_begin()", "capture_error_mode unknown", group=GPU)
def _g_mode(ctx: Ctx) -> None:
    g = BridgedCUDAGraph()
    s = _side()
    with torch.cuda.stream(s):
        _record(ctx, expect_raises(RuntimeError, r"Unknown capture error mode",  # PyTorch's own message
                                   g.capture_begin, capture_error_mode="strict"))
    assert not capturing(s) and g.state.value == "empty"


@bad("g_torch_graph_error_mode", "torch.cuda.graph()", "capture_error_mode unknown", group=GPU)
def _g_tg_mode(ctx: Ctx) -> None:
    gfxgraph.enable()
    s = _side()

    def go() -> None:
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=s, capture_error_mode="strict"):
            pass

    _record(ctx, expect_raises(RuntimeError, r"Unknown capture error mode", go))
    ctx.observed["current_stream_left_set"] = torch.cuda.current_stream() != torch.cuda.default_stream()
    torch.cuda.set_stream(torch.cuda.default_stream())
    assert not capturing(s)


@bad("g_capture_begin_pool_not_a_handle", "BridgedCUDAGraph.capture_begin()", "pool= a str / an int / a 1-tuple",
     group=GPU)
def _g_pool(ctx: Ctx) -> None:
    s = _side()
    for v in ("x", 5, (1,)):
        g = BridgedCUDAGraph()
        with torch.cuda.stream(s):
            _record(ctx, expect_raises((TypeError, ValueError), r"pool", g.capture_begin, pool=v))
        assert not capturing(s)


def _hl_replay_check(name: str, kind: str, exc: Any, pattern: str, make: Callable[[], Any]) -> None:
    @bad(name, "BridgedCUDAGraph.replay(input_tensor=)", kind, group=GPU)
    def _check(ctx: Ctx) -> None:
        g = _static_graph(ctx)
        _record(ctx, expect_raises(exc, pattern, g.replay, input_tensor=make()))


_hl_replay_check("g_hl_replay_wrong_shape", "another shape", ValueError, r"expected Tensor\(shape=\(8, 64\)",
                 lambda: torch.ones(4, 64, device="cuda"))
_hl_replay_check("g_hl_replay_wrong_dtype", "another dtype", ValueError, r"dtype=torch\.float32",
                 lambda: torch.ones(8, 64, device="cuda", dtype=torch.float16))
_hl_replay_check("g_hl_replay_wrong_device", "a CPU tensor", ValueError, r"device=cuda",
                 lambda: torch.ones(8, 64))
_hl_replay_check("g_hl_replay_wrong_structure", "a list instead of a tensor", TypeError,
                 r"input_tensor: expected the structure", lambda: [torch.ones(8, 64, device="cuda")])
_hl_replay_check("g_hl_replay_not_a_tensor", "an int", TypeError, r"input_tensor: expected", lambda: 3)


@bad("g_hl_example_input_on_cpu", "BridgedCUDAGraph.capture()", "example_input on the CPU with a GPU present",
     group=GPU)
def _g_hl_cpu(ctx: Ctx) -> None:
    def go() -> None:
        with BridgedCUDAGraph().capture(model_fn=_double, example_input=torch.ones(4, 4)):
            pass

    _record(ctx, expect_raises(ValueError, r"example_input: expected tensors on a CUDA device", go))


@bad("g_pool_first_call_on_cpu", "ShapeBucketPool.__call__", "a CPU tensor with a GPU present", group=GPU)
def _g_pool_cpu(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"expected a tensor on a CUDA device", _pool(), torch.ones(2, 2)))


@bad("g_graph_state_errors", "BridgedCUDAGraph", "replay before capture, capture_end without begin, capture_begin "
     "on a captured graph, replay(input_tensor=) on a low-level graph", group=GPU)
def _g_states(ctx: Ctx) -> None:
    g = BridgedCUDAGraph()
    _record(ctx, expect_raises(RuntimeError, r"without a preceding successful capture", g.replay))
    _record(ctx, expect_raises(RuntimeError, r"call capture_begin\(\) first", g.capture_end))
    s = _side()
    x = torch.ones(4, device="cuda")
    with torch.cuda.graph(g, stream=s):
        x.add_(1)
    with torch.cuda.stream(s):
        _record(ctx, expect_raises(RuntimeError, r"already owns a captured graph", g.capture_begin))
    _record(ctx, expect_raises(TypeError, r"high-level capture", g.replay, input_tensor=x))


@bad("g_register_generator_not_a_generator", "BridgedCUDAGraph.register_generator_state()", "a str", group=GPU)
def _g_gen(ctx: Ctx) -> None:
    _record(ctx, expect_raises((TypeError, RuntimeError), r"Generator", BridgedCUDAGraph().register_generator_state,
                               "gen"))


@bad("g_pool_cpu_generator", "ShapeBucketPool()", "generators=[a CPU torch.Generator]", group=GPU)
def _g_pool_cpu_gen(ctx: Ctx) -> None:
    # refused at construction: registering a CPU generator with a CUDA graph crashes PyTorch
    _record(ctx, expect_raises((TypeError, ValueError), r"generators: expected CUDA", _pool,
                               generators=[torch.Generator()]))


def _keep_graph(keep: bool) -> Any:
    g = torch.cuda.CUDAGraph(keep_graph=keep)
    x = torch.ones(4, device="cuda")
    with torch.cuda.graph(g, stream=_side()):
        x.add_(1)
    return g


@bad("g_tier2_graph_without_keep_graph", "GraphCompositor.add() / LaunchPipeline() / UpdatableGraph()",
     "a graph captured without keep_graph=True", group=GPU)
def _g_unkept(ctx: Ctx) -> None:
    g = _keep_graph(False)
    _record(ctx, expect_raises(ValueError, r"keep_graph=True", GraphCompositor().add, "a", g))
    _record(ctx, expect_raises(ValueError, r"keep_graph=True", LaunchPipeline, g))
    _record(ctx, expect_raises(ValueError, r"keep_graph=True", UpdatableGraph, g))


@bad("g_tier2_stream_and_update_arguments", "LaunchPipeline(stream=) / UpdatableGraph.update()",
     "stream a str / a negative handle; update() with a non-graph", group=GPU)
def _g_tier2_args(ctx: Ctx) -> None:
    g = _keep_graph(True)
    _record(ctx, expect_raises(TypeError, r"stream: expected a torch\.cuda\.Stream", LaunchPipeline, g, stream="s"))
    _record(ctx, expect_raises(ValueError, r"stream: expected a non-negative raw stream handle", LaunchPipeline, g,
                               stream=-1))
    ug = UpdatableGraph(g)
    _record(ctx, expect_raises(TypeError, r"expected a torch\.cuda\.CUDAGraph", ug.update, "graph"))
    ug.close()


# ================================================================= import-time environment and CLI
def _python(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("GFXGRAPH", "HGB_"))}
    full.update(env)
    argv = [*((["-c", code]) if code else []), *args]
    warm = os.environ.get(WARM_ENV)
    if warm:  # the pytest glue's: the same run, without a torch import of its own
        return _warm_python(warm).run(argv, env=full, cwd=str(REPO), timeout=60)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=full, timeout=60,
                          cwd=str(REPO))


def _warm_python(path: str) -> Any:
    import importlib.util

    module = sys.modules.get("_warm_python")
    if module is None:
        spec = importlib.util.spec_from_file_location("_warm_python", path)
        module = sys.modules["_warm_python"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


_IMPORT = "import logging, sys; {config}import gfxgraph; print('ENABLED', gfxgraph.is_enabled())"


@bad("b_env_gfxgraph_bad_value", "GFXGRAPH (read at import)", "GFXGRAPH=yes", group=ENV)
def _b_env_enable(ctx: Ctx) -> None:
    r = _python(_IMPORT.format(config="logging.basicConfig(); "), {"GFXGRAPH": "yes"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ENABLED False" in r.stdout, "a bad GFXGRAPH value enabled gfxgraph"
    assert "GFXGRAPH='yes'" in r.stderr and "1, debug, validate, 0" in r.stderr, \
        f"the warning does not name the variable and the accepted values: {r.stderr[-1000:]}"
    quiet = _python(_IMPORT.format(config=""), {"GFXGRAPH": "yes"})
    ctx.observed["visible_without_logging_configured"] = "GFXGRAPH" in quiet.stderr


@bad("b_env_log_level_bad_value", "HGB_LOG_LEVEL (read at import)", "HGB_LOG_LEVEL=loud", group=ENV)
def _b_env_log(ctx: Ctx) -> None:
    r = _python(_IMPORT.format(config="logging.basicConfig(); "), {"HGB_LOG_LEVEL": "loud"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HGB_LOG_LEVEL='loud'" in r.stderr and "debug, info, warn, error" in r.stderr, \
        f"the warning does not name the variable and the accepted values: {r.stderr[-1000:]}"


@bad("b_cli_bad_arguments", "python -m gfxgraph", "a missing script; an unknown option", group=ENV)
def _b_cli(ctx: Ctx) -> None:
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    r = _python("", env, "-m", "gfxgraph", "/nonexistent/job.py")
    ctx.observed["missing_script"] = {"rc": r.returncode, "stderr": r.stderr[-300:]}
    assert r.returncode == 2 and "expected a Python script" in r.stderr, r.stderr[-1000:]
    r = _python("", env, "-m", "gfxgraph", "doctor", "--bogus")
    ctx.observed["unknown_option"] = {"rc": r.returncode, "stderr": r.stderr[-300:]}
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr, r.stderr[-1000:]


# ------------------------------------------------- options and arguments that were accepted silently
def _plain_pool(**kw: Any) -> ShapeBucketPool:
    return ShapeBucketPool(lambda x, *a, **k: x * 2, progress=False, **kw)


@bad("b_pool_static_args_unknown", "ShapeBucketPool.__call__", "static_args naming an argument the call lacks")
def _b_static_unknown(ctx: Ctx) -> None:
    x = torch.ones(2, 3, device=_dev(ctx))
    _record(ctx, expect_raises(ValueError, r"static_args: \[2\] name no argument", _plain_pool(static_args=[2]), x))
    _record(ctx, expect_raises(ValueError, r"static_args: \['mask'\] name no argument",
                               _plain_pool(static_args=["mask"]), x))


@bad("b_pool_buckets_and_max_batch_size", "ShapeBucketPool()", "buckets together with max_batch_size")
def _b_buckets_and_max(ctx: Ctx) -> None:
    _record(ctx, expect_raises(ValueError, r"expected one of them", _plain_pool, buckets=[4], max_batch_size=8))


@bad("b_pool_batch_dim_beyond_rank", "ShapeBucketPool.__call__", "batch_dim beyond an input's rank")
def _b_batch_dim(ctx: Ctx) -> None:
    pool = _plain_pool(buckets=[4], batch_dim=1)
    x = torch.ones(2, 3, device=_dev(ctx))
    _record(ctx, expect_raises(ValueError, r"args\[1\]: expected a tensor with a batch dimension at dim 1, got "
                                           r"shape \(3,\); name it in static_args", pool, x, torch.ones(3, device=_dev(ctx))))


@bad("b_pool_batched_outputs_malformed", "ShapeBucketPool()", "batched_outputs='yes' / [1, 0]")
def _b_batched_outputs(ctx: Ctx) -> None:
    for v in ("yes", [1, 0]):
        _record(ctx, expect_raises(TypeError, r"batched_outputs: expected a sequence of bools", _plain_pool,
                                   batched_outputs=v))


@bad("b_pool_wrong_feature_size_names_the_callers_shape", "ShapeBucketPool.__call__",
     "a model error on the first call names the caller's shape, not the padded one")
def _b_feature_size(ctx: Ctx) -> None:
    lin = torch.nn.Linear(4, 2).to(_dev(ctx))
    pool = ShapeBucketPool(lin, [8], progress=False)
    with torch.no_grad():
        _record(ctx, expect_raises(RuntimeError, r"3x5", pool, torch.ones(3, 5, device=_dev(ctx))))
        torch.testing.assert_close(pool(torch.ones(3, 4, device=_dev(ctx))), lin(torch.ones(3, 4, device=_dev(ctx))))
    ctx.observed["bucket_usable_after_a_bad_call"] = not pool.failed_buckets


@bad("b_conditional_copy_outputs_not_bool", "ConditionalGraph()", "copy_outputs='x'")
def _b_cg_copy(ctx: Ctx) -> None:
    from gfxgraph import ConditionalGraph

    _record(ctx, expect_raises(TypeError, r"copy_outputs: expected a bool, got 'x'", ConditionalGraph,
                               copy_outputs="x"))


@bad("b_conditional_forced_native_different_outputs", "ConditionalGraph.capture()",
     "strategy='native' with branches of different output shapes")
def _b_cg_native_shapes(ctx: Ctx) -> None:
    from gfxgraph import ConditionalGraph

    for strategy in ("native", "supergraph"):
        cg = ConditionalGraph(strategy=strategy)
        cg.add_branch("a", lambda x: x * 2)
        cg.add_branch("b", lambda x: x.sum(0))
        x = torch.ones(4, 3, device=_dev(ctx))
        _record(ctx, expect_raises((ValueError, RuntimeError), r"same structure, shapes and dtypes|native' needs",
                                   cg.capture, x))


@bad("b_loop_state_not_tensors", "DeviceWhileLoop()", "state=(3, 4)")
def _b_loop_state(ctx: Ctx) -> None:
    from gfxgraph import DeviceWhileLoop, LoopCondition

    _record(ctx, expect_raises(TypeError, r"state: expected a tensor or a non-empty tuple/list of tensors, got "
                                          r"tuple of \(int, int\)", DeviceWhileLoop, LoopCondition(0, "<", 3),
                               lambda *s: None, (3, 4)))


@bad("b_compile_options_not_a_mapping", "torch.compile(backend='gfxgraph')", "options=[...]")
def _b_compile_options_list(ctx: Ctx) -> None:
    from hipgraph_bridge import gfxgraph_backend

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    _record(ctx, expect_raises(TypeError, r"expected a dict of option names to values, got list",
                               gfxgraph_backend, gm, [torch.ones(2)], options=["buckets"]))


@bad("b_compile_buckets_and_max_batch_size", "torch.compile(backend='gfxgraph')", "buckets with max_batch_size")
def _b_compile_both(ctx: Ctx) -> None:
    from hipgraph_bridge import BackendOptions

    _record(ctx, expect_raises(ConfigError, r"expected one of them", BackendOptions.from_mapping,
                               {"buckets": [4], "max_batch_size": 8}))


@bad("b_compile_unknown_inductor_key", "torch.compile(backend='gfxgraph')", "inductor_config={'max_autotun': True}")
def _b_compile_inductor_key(ctx: Ctx) -> None:
    from hipgraph_bridge import BackendOptions

    _record(ctx, expect_raises(ConfigError, r"unknown inductor config key\(s\) 'max_autotun' \(did you mean "
                                            r"'max_autotune'", BackendOptions.from_mapping,
                               {"inductor_config": {"max_autotun": True}}))


@bad("b_static_replay_wrong_shape", "BridgedCUDAGraph.replay(input_tensor=)",
     "a wrong shape or dtype is refused the same way with or without a GPU")
def _b_static_replay_layout(ctx: Ctx) -> None:
    g = BridgedCUDAGraph()
    with g.capture(model_fn=lambda t: t * 2, example_input=torch.ones(4, 3, device=_dev(ctx))):
        pass
    _record(ctx, expect_raises(ValueError, r"input_tensor: expected Tensor\(shape=\(4, 3\)", g.replay,
                               input_tensor=torch.ones(5, 3, device=_dev(ctx))))
    _record(ctx, expect_raises(ValueError, r"dtype=torch.float32", g.replay,
                               input_tensor=torch.ones(4, 3, dtype=torch.float64, device=_dev(ctx))))
