"""The ``gfxgraph`` torch.compile backend on a GPU: eager results at every size, few compilations,
graph breaks, kwargs, fallbacks that keep results right."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import gfxgraph
from hipgraph_bridge import compile as cb
from hipgraph_bridge.compile import SubgraphState, backend_stats

pytestmark = pytest.mark.gpu
cb.register()  # also when the tests run from a checkout that is not installed (no entry points)

_before: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    gc.collect()
    _before.clear()
    _before.update(cb.compiled_subgraphs())
    counters.clear()
    yield
    torch._dynamo.reset()


def subgraphs() -> list[cb.CompiledSubgraph]:
    """The subgraphs this test compiled."""
    return [s for s in cb.compiled_subgraphs() if s not in _before]


def frames() -> int:
    return int(counters["stats"]["unique_graphs"])


class MLP(torch.nn.Module):
    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width)) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def _mlp(**kw) -> MLP:
    torch.manual_seed(0)
    return MLP(**kw).cuda().eval()


def test_every_size_1_to_256_equals_eager_with_two_compilations():
    compiles_before = backend_stats()["compiles"]
    m = _mlp()
    c = torch.compile(m, backend="gfxgraph")
    with torch.no_grad():
        for n in range(1, 257):
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4, msg=f"batch {n}")
        assert frames() <= 2, counters["stats"]  # size 1 (specialised by dynamo), then the symbolic batch
        fallbacks = dict(gfxgraph.stats()["fallback_reasons"])
        for n in range(256, 0, -1):  # second pass: every bucket replays, nothing new
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4, msg=f"batch {n}")
    assert frames() <= 2
    dyn = next(s for s in subgraphs() if s.plan.batch_symbol is not None)
    assert dyn.state is SubgraphState.GRAPHED and dyn.compiler == "inductor"
    assert dyn.captured_buckets == dyn.buckets  # every bucket from 2 to 256 captured once
    assert gfxgraph.stats()["fallback_reasons"] == fallbacks
    assert set(fallbacks) <= {"static_shape_warmup"}
    stats = backend_stats()
    assert stats["graphs"] >= len(dyn.buckets) and stats["pool_bytes"] > 0
    assert stats["compiles"] - compiles_before <= 2  # the symbolic batch; size 1 on its second call


def test_random_order_with_mark_dynamic_stays_at_two_frames():
    m = _mlp()
    c = torch.compile(m, backend="gfxgraph")
    rng = random.Random(0)
    sizes = [rng.randint(1, 256) for _ in range(120)] + [1, 256, 1]
    with torch.no_grad():
        for i, n in enumerate(sizes):
            x = torch.randn(n, 64, device="cuda")
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4, msg=f"batch {n}")
    assert frames() == 2  # the symbolic batch, and size 1
    assert all(s.state is not SubgraphState.UNGRAPHED for s in subgraphs())


def test_graph_breaks_each_subgraph_graphed():
    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = MLP(32, 1)
            self.b = MLP(32, 1)

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h).relu(), x.shape[0]

    torch.manual_seed(0)
    m = Broken().cuda().eval()
    c = torch.compile(m, backend="gfxgraph")
    with torch.no_grad():
        for n in [*range(1, 70), 130, 255, 1, 1]:
            x = torch.randn(n, 32, device="cuda")
            got, rows = c(x)
            torch.testing.assert_close(got, m(x)[0], rtol=1e-4, atol=1e-4, msg=f"batch {n}")
            assert rows == n
    dynamic = [s for s in subgraphs() if s.plan.batch_symbol is not None]
    assert len(dynamic) == 2
    for s in dynamic:
        assert s.state is SubgraphState.GRAPHED and len(s.captured_buckets) >= 10, s
    assert frames() <= 4  # two halves, each: size 1 (specialised) and the symbolic batch


def test_kwargs_batched_and_static_tensors():
    class KW(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = MLP(64, 1)

        def forward(self, x, *, bias, scale, shift=0.5):
            return self.mlp(x + bias) * scale + shift

    torch.manual_seed(0)
    m = KW().cuda().eval()
    c = torch.compile(m, backend="gfxgraph")
    with torch.no_grad():
        for n in [3, *range(1, 257, 7), 256]:
            x, bias = torch.randn(n, 64, device="cuda"), torch.randn(n, 64, device="cuda")
            scale = torch.randn(64, device="cuda")  # a new static tensor every call: copied in
            torch.testing.assert_close(c(x, bias=bias, scale=scale, shift=0.5),
                                       m(x, bias=bias, scale=scale, shift=0.5), rtol=1e-4, atol=1e-4)
    dyn = next(s for s in subgraphs() if s.plan.batch_symbol is not None)
    assert dyn.state is SubgraphState.GRAPHED and dyn.captured_buckets
    assert frames() <= 3


def test_outputs_survive_the_next_call_and_views_on_request():
    m = _mlp()
    c = torch.compile(m, backend="gfxgraph", dynamic=True)
    with torch.no_grad():
        a = c(torch.ones(5, 64, device="cuda"))
        keep = a.clone()
        c(torch.zeros(5, 64, device="cuda"))
        torch.testing.assert_close(a, keep)
    torch._dynamo.reset()
    v = torch.compile(m, backend="gfxgraph", dynamic=True, options={"copy_outputs": False})
    with torch.no_grad():
        a = v(torch.ones(5, 64, device="cuda"))
        b = v(torch.zeros(5, 64, device="cuda"))
        assert a.data_ptr() == b.data_ptr()  # a view of the graph's static output


def test_parameters_updated_in_place_and_replaced():
    m = _mlp()
    c = torch.compile(m, backend="gfxgraph", dynamic=True)
    x = torch.randn(7, 64, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
        m.blocks[0][1].weight.mul_(0.5)  # in place: the graph reads the same memory
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
        m.blocks[0][1].weight = torch.nn.Parameter(torch.randn(256, 64, device="cuda"))  # moved: re-capture
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)


def test_training_runs_on_cudagraph_trees():
    m = _mlp().train()
    c = torch.compile(m, backend="gfxgraph")
    for n in (3, 9, 17):
        x = torch.randn(n, 64, device="cuda")
        c(x).square().mean().backward()
        got = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        m(x).square().mean().backward()
        for g, p in zip(got, m.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
        m.zero_grad()
    assert any(s.state is SubgraphState.TREES for s in subgraphs())  # tests/test_compile_grad_gpu.py: more


def test_vram_cap_and_oversize_keep_results():
    m = _mlp()
    c = torch.compile(m, backend="gfxgraph", dynamic=True, options={"vram_cap": 1e-6, "max_batch_size": 64})
    with torch.no_grad():
        for n in (3, 17, 64, 200):
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    reasons = gfxgraph.stats()["fallback_reasons"]
    assert reasons.get("vram_cap", 0) >= 1 and reasons.get("oversize", 0) >= 1


def test_bf16_model_is_graphed_not_flagged_by_the_padding_check():
    torch.manual_seed(0)
    m = MLP(512, 4).cuda().to(torch.bfloat16).eval()
    c = torch.compile(m, backend="gfxgraph")
    with torch.no_grad():
        for n in [198, 37, 5, 129, 255, 64, 3]:
            x = torch.randn(n, 512, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(c(x), m(x), rtol=5e-2, atol=5e-2)
    dyn = next(s for s in subgraphs() if s.plan.batch_symbol is not None)
    assert dyn.state is SubgraphState.GRAPHED, dyn.detail


def test_rows_depending_on_each_other_get_exact_size_graphs():
    def f(x):
        return torch.softmax(x, dim=0) * 3  # across the batch: padding changes every row

    c = torch.compile(f, backend="gfxgraph")
    for n in (3, 5, 6, 7, 9, 5):
        x = torch.randn(n, 16, device="cuda")
        torch.testing.assert_close(c(x), f(x))
    dyn = next(s for s in subgraphs() if s.plan.batch_symbol is not None)
    assert dyn.state.value == "graphed" and dyn.verdict.reason == "rows_coupled"  # read from the graph
    (variant,) = dyn._variants.values()
    assert variant.pool.captured_buckets == [5, 6, 7, 9]  # one graph per size the dynamic frame saw


def test_cpu_model_on_a_gpu_machine_runs_ungraphed():
    torch.manual_seed(0)
    m = MLP(16, 1).eval()
    c = torch.compile(m, backend="gfxgraph", options={"compiler": "aot_eager"})
    with torch.no_grad():
        for n in (3, 5, 6):
            x = torch.randn(n, 16)
            torch.testing.assert_close(c(x), m(x))
    assert any(s.reason == "cpu_inputs" for s in subgraphs())


def test_static_frame_compiles_and_graphs_on_its_second_call():
    m = _mlp()
    c = torch.compile(m, backend="gfxgraph")
    x = torch.randn(1, 64, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    (only,) = subgraphs()
    assert only.state is SubgraphState.GRAPHED and only.captured_buckets == [1]
    assert gfxgraph.stats()["fallback_reasons"].get("static_shape_warmup") == 1


class _Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device="cuda"))
        torch._dynamo.mark_static_address(self.steps)
        self.lin = torch.nn.Linear(8, 8, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return self.lin(x) * self.steps


def test_state_written_in_place_is_graphed_and_advances_once_per_call():
    m = _Counter()
    c = torch.compile(m, backend="gfxgraph", options={"buckets": [4, 16]})
    gfxgraph.reset_stats()
    with torch.no_grad():
        for k, n in enumerate([4, 16, 4, 16, 16, 4, 4, 16], start=1):
            x = torch.randn(n, 8, device="cuda")
            want = m.lin(x) * k
            torch.testing.assert_close(c(x), want, atol=1e-4, rtol=1e-4)
            assert int(m.steps) == k
        x = torch.randn(5, 8, device="cuda")  # not a bucket: never padded (the state), a graph of 5 rows
        torch.testing.assert_close(c(x), m.lin(x) * 9, atol=1e-4, rtol=1e-4)
        assert int(m.steps) == 9
    graphed = [s for s in subgraphs() if s.state is SubgraphState.GRAPHED]
    assert graphed and sum(s.graph_count() for s in graphed) >= 3, subgraphs()
    assert not gfxgraph.stats()["fallback_reasons"].get("stateful"), gfxgraph.stats()


def test_validate_mode_does_not_run_a_state_writing_subgraph_twice():
    m = _Counter()
    c = torch.compile(m, backend="gfxgraph", options={"buckets": [4]})
    gfxgraph.enable(validate=True)
    try:
        with torch.no_grad():
            for k in range(1, 6):
                x = torch.randn(4, 8, device="cuda")
                torch.testing.assert_close(c(x), m.lin(x) * k, atol=1e-4, rtol=1e-4)
                assert int(m.steps) == k
    finally:
        gfxgraph.disable()
