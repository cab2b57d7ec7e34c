"""The ``gfxgraph`` torch.compile backend without a GPU: discovery, options, results equal eager.

Without a GPU a graphed subgraph runs on the call's own inputs; these tests
pass ``simulate_padding=True`` so that it runs the pool's padded pipeline
eagerly instead (static buffers, padding, slicing) and they cover the
backend's whole input/output plumbing. Most use ``compiler="aot_eager"`` (no C++ build); one
test compiles with inductor on CPU (gcc), which takes a while on a cold cache.
"""

from __future__ import annotations

import gc
import importlib.metadata
import weakref

import pytest
import torch
import torch._dynamo

import gfxgraph
from hipgraph_bridge import ShapeBucketPool
from conftest import GPU_SKIP_REASON
from hipgraph_bridge import compile as cb
from hipgraph_bridge.compile import (
    BACKEND_NAMES,
    BackendOptions,
    SubgraphState,
    backend_stats,
    gfxgraph_backend,
    register,
)
from hipgraph_bridge.errors import ConfigError

register()  # also when the tests run from a checkout that is not installed (no entry points)
cpu_only = pytest.mark.skipif(GPU_SKIP_REASON is None, reason="exercises the no-GPU pipeline")
FAST = {"compiler": "aot_eager", "simulate_padding": True}


_before: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    gc.collect()
    gc.freeze()  # the survivors (fake-tensor dispatch caches dynamo's reset keeps, ...): out of later collections' way
    _before.clear()
    _before.update(cb.compiled_subgraphs())  # anything still alive from earlier tests
    yield
    torch._dynamo.reset()


def compiled_subgraphs() -> list[cb.CompiledSubgraph]:
    """The subgraphs this test compiled."""
    return [s for s in cb.compiled_subgraphs() if s not in _before]


def _states() -> list[tuple[str, str | None]]:
    return sorted((s.state.value, s.reason) for s in compiled_subgraphs())


def _installed() -> bool:
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    return all(n in eps.names for n in BACKEND_NAMES)


class MLP(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _run(model, sizes, *, options=None, width=8, **compile_kw):
    torch.manual_seed(0)
    c = torch.compile(model, backend="gfxgraph", options={**FAST, **(options or {})}, **compile_kw)
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, width)
            torch.testing.assert_close(c(x), model(x), msg=f"batch {n}")
    return c


# ---------------------------------------------------------------- discovery
def test_found_by_both_names_without_importing_anything(warm_py):
    if not _installed():
        pytest.skip("the distribution is not installed (pip install -e .): no entry points to find")
    r = warm_py("""
        import sys, torch
        m = torch.nn.Linear(4, 3).eval()
        assert "hipgraph_bridge" not in sys.modules and "gfxgraph" not in sys.modules
        for name in ("gfxgraph", "hipgraph_bridge"):
            torch._dynamo.reset()
            c = torch.compile(m, backend=name, options={"compiler": "eager"})
            with torch.no_grad():
                for n in (3, 5, 9):
                    x = torch.randn(n, 4)
                    torch.testing.assert_close(c(x), m(x))
        from hipgraph_bridge.compile import gfxgraph_backend
        from torch._dynamo.backends.registry import lookup_backend
        assert lookup_backend("gfxgraph") is lookup_backend("hipgraph_bridge") is gfxgraph_backend
        assert "gfxgraph" not in sys.modules  # the public package was never needed
        print("OK")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout


def test_register_never_imports_dynamo(warm_py):
    r = warm_py("""
        import sys
        import gfxgraph
        from hipgraph_bridge.compile import register
        assert register() is False
        gfxgraph.enable()
        assert "torch._dynamo" not in sys.modules, "register()/enable() imported torch._dynamo"
        print("OK")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OK" in r.stdout


def test_register_and_enable_register_both_names_idempotently():
    from torch._dynamo.backends import registry

    assert register() is True
    assert register() is True
    gfxgraph.enable()
    gfxgraph.enable()
    for name in BACKEND_NAMES:
        assert registry.lookup_backend(name) is gfxgraph_backend
    assert set(BACKEND_NAMES) <= set(torch._dynamo.list_backends())


def test_register_leaves_a_name_taken_by_someone_else(monkeypatch):
    from torch._dynamo.backends import registry

    def other(gm, example_inputs):
        return gm.forward

    monkeypatch.setitem(registry._COMPILER_FNS, "hipgraph_bridge", other)
    assert register() is True
    assert registry._COMPILER_FNS["hipgraph_bridge"] is other


# ------------------------------------------------------------------ options
def test_unknown_option_lists_the_known_ones():
    with pytest.raises(ConfigError) as info:
        BackendOptions.from_mapping({"bucket": [1, 2], "graphs": True})
    msg = str(info.value)
    assert "unknown option(s) 'bucket'" in msg
    for name in ("buckets", "batch_dim", "vram_cap", "max_batch_size", "copy_outputs", "compiler"):
        assert name in msg


def test_unknown_option_through_torch_compile():
    c = torch.compile(torch.nn.Linear(4, 4), backend="gfxgraph", options={"bogus": 1})
    with pytest.raises(Exception, match="known options: batch_dim, buckets"):
        c(torch.randn(2, 4))


@pytest.mark.parametrize("options,msg", [
    ({"buckets": [0, 4]}, "options\\['buckets'\\]: buckets: expected positive ints"),
    ({"buckets": "1,2"}, "options\\['buckets'\\]"),
    ({"batch_dim": -1}, "options\\['batch_dim'\\]: expected an int >= 0"),
    ({"max_batch_size": 0}, "options\\['max_batch_size'\\]: expected an int >= 1"),
    ({"vram_cap": 1.5}, "options\\['vram_cap'\\]: expected a fraction"),
    ({"copy_outputs": "yes"}, "options\\['copy_outputs'\\]: expected a bool"),
    ({"pad_value": "x"}, "options\\['pad_value'\\]: expected a number or None"),
    ({"compiler": "tvm"}, "options\\['compiler'\\]: expected one of inductor, aot_eager, eager"),
    ({"inductor_config": {"triton.cudagraphs": True}}, "inductor's CUDA graphs stay off"),
    ({"inductor_config": [1]}, "expected a dict of inductor config patches"),
    ({"static_compile_after": 0}, "static_compile_after"),
    ({"max_variants": True}, "max_variants"),
])
def test_bad_option_values_name_what_was_expected(options, msg):
    with pytest.raises(ConfigError, match=msg):
        BackendOptions.from_mapping(options)


def test_options_and_modes():
    o = BackendOptions.from_mapping({"buckets": [8, 1, 8, 64], "batch_dim": 1, "vram_cap": 0.5},
                                    mode="max-autotune-no-cudagraphs")
    assert o.buckets == (1, 8, 64) and o.batch_dim == 1 and o.vram_cap == 0.5
    patches = o.inductor_patches()
    assert patches["triton.cudagraphs"] is False and patches.get("max_autotune") is True
    assert BackendOptions.from_mapping(None, mode="reduce-overhead").inductor_patches() == {"triton.cudagraphs": False}
    assert "triton.cudagraphs" not in dict(BackendOptions.from_mapping({}, mode="max-autotune").mode_config)
    with pytest.raises(ConfigError, match="expected one of default, reduce-overhead"):
        BackendOptions.from_mapping({}, mode="turbo")
    with pytest.raises(TypeError, match="expected a dict"):
        BackendOptions.from_mapping([("buckets", [1])])


def test_options_bound_as_keywords():
    import functools

    m = MLP().eval()
    backend = functools.partial(gfxgraph_backend, compiler="aot_eager", buckets=[4, 16])
    c = torch.compile(m, backend=backend, dynamic=True)
    with torch.no_grad():
        for n in (3, 7, 12):
            x = torch.randn(n, 8)
            torch.testing.assert_close(c(x), m(x))
    assert [s.buckets for s in compiled_subgraphs()] == [[4, 16]]


# ------------------------------------------------------------------ results
def test_inductor_results_equal_eager():
    m = MLP().eval()
    _run(m, [3, 5, 1, 7, 64, 5], options={"compiler": "inductor"})
    subs = compiled_subgraphs()
    assert {s.compiler for s in subs if s.state is not SubgraphState.LAZY} == {"inductor"}
    assert any(s.state is SubgraphState.GRAPHED and s.plan.batch_symbol is not None for s in subs)


@cpu_only
def test_runs_the_padded_pipeline_without_a_gpu():
    _run(MLP().eval(), [3, 5, 6])
    assert gfxgraph.stats()["fallback_reasons"].get("no_gpu", 0) >= 2


def test_every_size_one_compilation_of_the_batch():
    from torch._dynamo.utils import counters

    counters.clear()
    m = MLP().eval()
    _run(m, range(1, 41))
    assert counters["stats"]["unique_graphs"] <= 2  # size 1 (specialised), then the symbolic batch
    dynamic = [s for s in compiled_subgraphs() if s.plan.batch_symbol is not None]
    assert len(dynamic) == 1 and dynamic[0].buckets[0] == 2  # dynamo admits sizes >= 2 there
    assert backend_stats()["compiles"] >= 1


def test_mark_dynamic_gives_one_frame_for_every_size_but_one():
    from torch._dynamo.utils import counters

    counters.clear()
    m = MLP().eval()
    c = torch.compile(m, backend="gfxgraph", options=FAST)
    with torch.no_grad():
        for i, n in enumerate([37, 100, 1, 5, 64, 1]):
            x = torch.randn(n, 8)
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(c(x), m(x))
    assert counters["stats"]["unique_graphs"] == 2  # the batch, and size 1


def test_oversize_and_custom_buckets():
    m = MLP().eval()
    _run(m, [3, 5, 20, 9, 33], options={"buckets": [4, 8, 16]})
    dyn = next(s for s in compiled_subgraphs() if s.plan.batch_symbol is not None)
    assert dyn.buckets == [4, 8, 16]
    assert gfxgraph.stats()["fallback_reasons"].get("oversize", 0) == 2


def test_graph_breaks_each_subgraph_served_separately():
    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h) * 2, x.shape[0]

    m = Broken().eval()
    c = torch.compile(m, backend="gfxgraph", options=FAST)
    with torch.no_grad():
        for n in (3, 5, 6, 11, 2):
            x = torch.randn(n, 8)
            out, rows = c(x)
            torch.testing.assert_close(out, m(x)[0])
            assert rows == n
    dynamic = [s for s in compiled_subgraphs() if s.plan.batch_symbol is not None]
    assert len(dynamic) == 2 and all(s.state is SubgraphState.GRAPHED for s in dynamic)
    # the second subgraph gets x.shape[0] as an int dynamo could not tie to its input: it follows the batch
    kinds = {slot.kind for s in dynamic for slot in s.plan.slots}
    assert "batch_like" in kinds
    assert all(len(s._variants) == 1 for s in dynamic)


def test_kwargs_static_tensors_and_int_outputs():
    class KW(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, *, bias, scale, offset=0.0):
            y = self.lin(x) + bias
            return {"y": y * scale + offset, "n": x.shape[0], "s": y.sum(-1)}

    m = KW().eval()
    c = torch.compile(m, backend="gfxgraph", options=FAST)
    scale = torch.randn(8)
    with torch.no_grad():
        for n in (3, 4, 7, 9, 2):
            x, bias = torch.randn(n, 8), torch.randn(n, 8)
            got, want = c(x, bias=bias, scale=scale, offset=1.5), m(x, bias=bias, scale=scale, offset=1.5)
            torch.testing.assert_close(got["y"], want["y"])
            torch.testing.assert_close(got["s"], want["s"])
            assert got["n"] == n
            scale = scale + 1  # a static (non-batched) tensor changes between calls: copied in every call
    dyn = next(s for s in compiled_subgraphs() if s.plan.batch_symbol is not None)
    kinds = {slot.name: slot.kind for slot in dyn.plan.slots}
    assert sorted(k for k in kinds.values() if k == "batched") == ["batched", "batched"]
    assert "owned" in kinds.values() and "ref" in kinds.values()


def test_outputs_are_copies_unless_asked():
    m = MLP().eval()
    c = torch.compile(m, backend="gfxgraph", options=FAST, dynamic=True)
    with torch.no_grad():
        a = c(torch.ones(3, 8))
        keep = a.clone()
        c(torch.zeros(3, 8))
        torch.testing.assert_close(a, keep)


# ------------------------------------------------------------------ fallbacks
def test_training_takes_the_trees_path_with_gradients_of_eager():
    torch.manual_seed(0)
    m = MLP()
    c = torch.compile(m, backend="gfxgraph", options=FAST)
    for n in (3, 5, 6):
        x = torch.randn(n, 8)
        c(x).square().sum().backward()
        got = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        m(x).square().sum().backward()
        for g, p in zip(got, m.parameters()):
            torch.testing.assert_close(g, p.grad)
        m.zero_grad()
    # CUDA-graph trees as reduce-overhead (tests/test_compile_grad_*.py); CPU tensors on a GPU machine: none
    assert (("trees", None) if GPU_SKIP_REASON else ("ungraphed", "cpu_inputs")) in _states()
    assert "training" not in gfxgraph.stats()["fallback_reasons"]


def test_input_mutation_is_not_graphed():
    def f(x):
        x.mul_(2)
        return x + 1

    c = torch.compile(f, backend="gfxgraph", options=FAST)
    for n in (3, 5, 6):
        x = torch.randn(n, 4)
        x0 = x.clone()
        torch.testing.assert_close(c(x), x0 * 2 + 1)
        torch.testing.assert_close(x, x0 * 2)  # the caller's tensor was written
    assert ("ungraphed", "input_mutation") in _states()


class Counter(torch.nn.Module):
    """Writes state it reads in place (a step counter, as a KV cache's write position): graphable."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        torch._dynamo.mark_static_address(self.steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return x * 2 + self.steps


@pytest.mark.parametrize("warmup_iters", [1, 3])  # a state-writing subgraph warms up at most once
def test_state_writes_are_graphed_and_run_once_per_call(warmup_iters):
    m = Counter()
    c = torch.compile(m, backend="gfxgraph", options={**FAST, "buckets": [4, 8], "warmup_iters": warmup_iters})
    with torch.no_grad():
        for k in range(1, 7):
            x = torch.randn(4, 3)
            torch.testing.assert_close(c(x), x * 2 + k)  # the first call included: one run per call
            assert int(m.steps) == k
    assert any(s.state is SubgraphState.GRAPHED for s in compiled_subgraphs()), _states()


def test_state_writes_are_not_padded():
    m = Counter()
    c = torch.compile(m, backend="gfxgraph", options={**FAST, "buckets": [4, 8]})
    gfxgraph.reset_stats()
    with torch.no_grad():
        for k, n in enumerate((4, 5, 8, 3, 2), start=1):
            x = torch.randn(n, 3)
            torch.testing.assert_close(c(x), x * 2 + k)
            assert int(m.steps) == k
    assert not gfxgraph.stats()["fallback_reasons"].get("stateful")  # exact-size graphs instead
    gfxgraph.reset_stats()
    with torch.no_grad():
        x = torch.randn(9, 3)  # above every bucket: runs unpadded, counted as oversize
        torch.testing.assert_close(c(x), x * 2 + 6)
        assert int(m.steps) == 6
    reasons = gfxgraph.stats()["fallback_reasons"]
    assert reasons.get("oversize", 0) >= 1 and not reasons.get("stateful"), reasons


@pytest.mark.parametrize("fn,reason", [
    (lambda x: x * x.shape[0], "batch_value"),  # the batch size as a value: padding would change it
    (lambda x: x[x.shape[0] - 1] + x, "batch_value"),  # the last row moves with padding
    (lambda x: torch.cat([x, x]), "output_shape"),  # (2B, C): the padding cannot be sliced off
])
def test_graphs_that_padding_would_break_run_ungraphed(fn, reason):
    c = torch.compile(fn, backend="gfxgraph", options=FAST)
    for n in (3, 5, 6, 7):
        x = torch.randn(n, 4)
        torch.testing.assert_close(c(x), fn(x))
    assert ("ungraphed", reason) in _states()


@pytest.mark.parametrize("fn,why", [
    (lambda x: x - x.mean(0), "aten.mean reduces over the batch dimension"),
    (lambda x: x.softmax(0) * 2, "aten._softmax works along the batch dimension"),
    (lambda x: x - x.max(0).values, "aten.max reduces over the batch dimension"),
])
def test_a_graph_whose_rows_interact_is_graphed_at_exact_sizes(fn, why):
    c = torch.compile(fn, backend="gfxgraph", options=FAST)
    for n in (3, 5, 6, 7, 5):
        x = torch.randn(n, 4)
        torch.testing.assert_close(c(x), fn(x))
    dyn = next(s for s in compiled_subgraphs() if s.plan.batch_symbol is not None)
    assert dyn.state is SubgraphState.GRAPHED and dyn.verdict.reason == "rows_coupled" and dyn.verdict.detail == why
    (variant,) = dyn._variants.values()
    assert variant.pool.unpadded[()].reason == "rows_coupled" and variant.pool.bucket_for(5) == 5


def test_sizes_used_as_sizes_stay_graphed():
    def f(x, y):
        z = x[: y.shape[0]] + y  # x and y carry the batch under two symbols
        return z.view(z.shape[0], 2, 2).sum(-1) + torch.arange(z.shape[0]).unsqueeze(1)

    c = torch.compile(f, backend="gfxgraph", options=FAST)
    for n in (3, 5, 6, 7):
        x, y = torch.randn(n, 4), torch.randn(n, 4)
        torch.testing.assert_close(c(x, y), f(x, y))
    dyn = next(s for s in compiled_subgraphs() if s.plan.batch_symbol is not None)
    assert dyn.state is SubgraphState.GRAPHED and len(dyn._variants) == 1


def test_static_frames_compile_on_their_nth_call():
    m = MLP().eval()
    _run(m, [5, 5, 5], options={"static_compile_after": 3})
    (only,) = compiled_subgraphs()
    assert only.plan.static and only.state is SubgraphState.GRAPHED and only.buckets == [5]
    assert gfxgraph.stats()["fallback_reasons"].get("static_shape_warmup") == 2


def test_replaced_parameters_are_followed():
    m = MLP().eval()
    c = torch.compile(m, backend="gfxgraph", options=FAST, dynamic=True)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
        m.up.weight = torch.nn.Parameter(torch.randn(16, 8))
        torch.testing.assert_close(c(x), m(x))
        m.down.weight.data = torch.randn(8, 16)
        torch.testing.assert_close(c(x), m(x))
        m.up.bias.add_(1)  # in place: same memory
        torch.testing.assert_close(c(x), m(x))


def test_no_cxx_compiler_falls_back_to_the_traced_graph(monkeypatch):
    from hipgraph_bridge.compile import compiler

    monkeypatch.setattr(compiler, "cpp_compiler_problem", lambda: "InvalidCxxCompiler: no g++")
    _run(MLP().eval(), [3, 5], options={"compiler": "inductor"})
    assert {s.compiler for s in compiled_subgraphs() if s.compiler} == {"eager"}


def test_inductor_failure_falls_back_with_a_reason(monkeypatch):
    import torch._inductor.compile_fx as cfx

    def broken(*a, **k):
        raise RuntimeError("simulated inductor bug")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    _run(MLP().eval(), [3, 5, 6], options={"compiler": "inductor"})
    assert ("ungraphed", "compile_failed") in _states()


def test_graphs_off_and_validate_mode():
    m = MLP().eval()
    _run(m, [3, 5], options={"graphs": False})
    assert ("ungraphed", "graphs_off") in _states()
    torch._dynamo.reset()
    gfxgraph.enable(validate=True)
    _run(m, [3, 5, 6])
    snap = gfxgraph.stats()
    assert snap["validation_checks"] >= 2 and snap["validation_failures"] == 0


def test_backend_stats_and_reset():
    _run(MLP().eval(), [3, 5, 6, 9])
    s = backend_stats()
    assert s["subgraphs"] >= 2 and s["graphed"] >= 1 and s["compiles"] >= 1
    assert set(s) >= {"lazy", "ungraphed", "compile_seconds", "graphs", "pool_bytes"}
    cb.reset_backend()
    assert all(not sub._variants for sub in compiled_subgraphs())
    assert gfxgraph_backend.reset is cb.reset_backend  # torch._dynamo.reset() releases the graphs


def test_pool_of_a_state_writing_subgraph_never_reruns_it_to_validate():
    calls = []

    def fn(x):
        calls.append(1)
        return x + 1

    x = torch.ones(4, 3)  # fills the bucket: nothing to pad
    gfxgraph.enable(validate=True)
    try:
        quiet = ShapeBucketPool(fn, [4], batched_outputs=(True,), stateful=True, simulate_padding=True)
        torch.testing.assert_close(quiet(x), x + 1)
        assert calls == [1]  # never re-run to validate
        checked = ShapeBucketPool(fn, [4], batched_outputs=(True,), simulate_padding=True)
        torch.testing.assert_close(checked(x), x + 1)  # the first call is its own (eager) run: nothing to check
        torch.testing.assert_close(checked(x), x + 1)
        assert calls == [1, 1, 1, 1]  # the default pool compares the second with a run of its own
        assert gfxgraph.stats()["validation_checks"] == 1
    finally:
        gfxgraph.disable()


def test_without_a_gpu_a_subgraph_runs_on_the_calls_own_inputs():
    seen = []

    def f(x):
        seen.append(x.shape[0])
        return x - x.mean(0)  # rows depend on each other: padding would change the result

    c = torch.compile(f, backend="gfxgraph", options={"compiler": "aot_eager"})
    for n in (3, 5, 6):
        x = torch.randn(n, 4)
        torch.testing.assert_close(c(x), f(x))
    assert not any(n in (4, 8) for n in seen[-3:]), seen  # never padded to a bucket
