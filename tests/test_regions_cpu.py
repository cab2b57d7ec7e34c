"""Regions traced once (``torch.compiler.nested_compile_region``): a model whose repeated layer is a region
reaches the backend as one subgraph called through ``invoke_subgraph``. The backend follows the batch
size into the region (a size, not a value) and the row analysis traces the region's ops, so such a graph
is padded where its rows are independent and refused where they are not, as an inlined graph would be."""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from hipgraph_bridge.compile.backend import compiled_subgraphs, register
from hipgraph_bridge.compile.plan import analyze
from hipgraph_bridge.fallbacks import Reason
from hipgraph_bridge.padding.fx import trace_graph

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason="torch.compiler.nested_compile_region is missing (added in torch 2.8)")

register()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph_of(fn, x: torch.Tensor):
    """The FX graph dynamo hands a backend for ``fn(x)``, the batch marked dynamic, and its example inputs."""
    got = {}

    def grab(gm, example_inputs):
        got["gm"], got["ex"] = gm, example_inputs
        return gm.forward

    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        torch.compile(fn, backend=grab)(x)
    return got["gm"], got["ex"]


def _verdict(fn):
    gm, ex = _graph_of(fn, torch.randn(6, 8))
    assert any(n.op == "call_function" and "invoke_subgraph" in str(n.target) for n in gm.graph.nodes)
    plan = analyze(gm, ex, batch_dim=0)
    batched = {i: 0 for i, e in enumerate(ex) if isinstance(e, torch.Tensor) and e.dim() == 2 and e.shape[0] == 6}
    return plan, trace_graph(gm, ex, batched=batched, symbols={plan.batch_symbol}, lo=2)


lin = torch.nn.Linear(8, 8)


@torch.compiler.nested_compile_region
def per_row(x):
    return torch.relu(lin(x)) * 2


@torch.compiler.nested_compile_region
def centred(x):
    return x - x.mean(0)


@torch.compiler.nested_compile_region
def counted(x):
    return x * x.shape[0]


def test_a_region_of_independent_rows_is_proven_through_its_ops():
    plan, verdict = _verdict(lambda x: per_row(per_row(x)) + 1)
    assert plan.unsupported is None  # the batch size passed into the region is a size there
    assert verdict.reason is None and verdict.ops >= 6  # the region's ops, both calls, traced


def test_a_region_that_couples_rows_is_refused():
    _, verdict = _verdict(lambda x: centred(centred(x)))  # called twice: dynamo inlines a region called once
    assert verdict.reason is Reason.ROWS_COUPLED and "mean" in verdict.detail


def test_a_region_that_uses_the_batch_size_as_a_value_is_refused():
    plan, _ = _verdict(lambda x: counted(counted(x)) + 1)
    assert plan.unsupported is not None and plan.unsupported[0] == "batch_value"


@torch.compiler.nested_compile_region
def by_numel(x):
    return x * x.numel()


def test_a_region_that_reads_the_batch_from_its_own_tensor_is_refused():
    """The batch reaches the region inside a tensor, not as an int operand: x.numel() in the subgraph."""
    plan, _ = _verdict(lambda x: by_numel(by_numel(x)))
    assert plan.unsupported is not None and plan.unsupported[0] == "batch_value"


@torch.compiler.nested_compile_region
def doubling(x, cache):
    cache.mul_(2)
    return x + cache


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_a_region_that_writes_an_input_is_not_graphed_and_the_write_lands(compiler):
    """The compiler "eager" leaves no AOT record of mutations: the FX graph's, regions included, tells."""
    def step(x, cache):
        return doubling(doubling(x, cache), cache)

    f = torch.compile(step, backend="gfxgraph", options={"compiler": compiler, "simulate_padding": True})
    with torch.no_grad():
        for n in (6, 3):
            x, cache, mine = torch.zeros(n, 8), torch.ones(n, 8), torch.ones(n, 8)
            if n == 6:
                torch._dynamo.mark_dynamic(x, 0)
                torch._dynamo.mark_dynamic(cache, 0)
            torch.testing.assert_close(f(x, cache), step(x, mine))
            assert torch.equal(cache, mine)  # the caller's tensor written as eager writes it


def test_another_higher_order_op_is_unproven_not_an_error():
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, (x,))

    gm, ex = _graph_of(f, torch.randn(6, 8))
    plan = analyze(gm, ex, batch_dim=0)
    batched = {i: 0 for i, e in enumerate(ex) if isinstance(e, torch.Tensor) and e.dim() == 2}
    verdict = trace_graph(gm, ex, batched=batched, symbols={plan.batch_symbol}, lo=2)
    assert verdict.reason is Reason.UNPROVEN and "higher-order operator" in verdict.detail


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    @torch.compiler.nested_compile_region
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def test_a_stack_of_region_layers_is_served_padded_and_equals_eager():
    """Eight layers, one region: the backend pads it (no refusal), and every batch size equals eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Layer() for _ in range(8)]).eval()
    before = set(compiled_subgraphs())
    f = torch.compile(model, backend="gfxgraph", options={"compiler": "aot_eager", "simulate_padding": True})
    with torch.no_grad():
        for i, n in enumerate([6, 3, 1, 5, 8]):
            x = torch.randn(n, 8)
            if i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(f(x), model(x), msg=f"batch {n}")
    dynamic = [s for s in compiled_subgraphs() if s not in before and s.plan.batch_symbol is not None]
    assert len(dynamic) == 1 and dynamic[0].plan.unsupported is None
    assert dynamic[0].verdict is not None and dynamic[0].verdict.reason is None  # padding proven safe
    assert gfxgraph.backend_stats()["subgraphs"] >= 1


def test_a_transformers_llama_with_region_layers_is_proven_and_equals_eager():
    """Decoder layers bound to one region (compile_regions). Inside the region ops reach
    the row analysis before autograd's decomposition (linear, to, scaled_dot_product_attention, ...): it
    decomposes them itself, so the verdict is the inlined graph's (rows independent)."""
    transformers = pytest.importorskip("transformers")
    from _tiny_llama import tiny_llama

    model = tiny_llama(transformers, device="cpu")
    assert gfxgraph.compile_regions(model.model.layers) == 2

    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1, :]

    before = set(compiled_subgraphs())
    f = torch.compile(step, backend="gfxgraph", options={"compiler": "aot_eager", "simulate_padding": True})
    with torch.no_grad():
        for i, n in enumerate([6, 3, 5]):
            ids = (torch.arange(n).view(n, 1) * 7 + 11) % 1000
            if i == 0:
                torch._dynamo.mark_dynamic(ids, 0)
            torch.testing.assert_close(f(ids, ids), step(ids, ids), msg=f"batch {n}")
    dynamic = [s for s in compiled_subgraphs() if s not in before and s.plan.batch_symbol is not None]
    assert dynamic and all(s.plan.unsupported is None and s.verdict.reason is None for s in dynamic), \
        [(s.plan.unsupported, s.verdict) for s in dynamic]


def test_compile_regions_binds_instances_to_one_region_and_leaves_the_class_alone():
    """Each layer keeps its own weights in the compiled model (the region is reached through a subclass: a
    forward bound per instance would make dynamo reuse the first layer's weights), other instances of the
    class are untouched, and the binding can be undone."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(Plain() for _ in range(4))
    other = Plain()
    assert gfxgraph.compile_regions(layers) == 4
    assert gfxgraph.compile_regions(layers) == 4  # again: nothing changes
    assert len({type(m) for m in layers}) == 1 and all(isinstance(m, Plain) for m in layers)
    assert type(other) is Plain and Plain.forward is type(other).forward
    x = torch.randn(3, 8)
    torch.testing.assert_close(layers[0](x), Plain.forward(layers[0], x))  # eagerly a plain call
    model = torch.nn.Sequential(*layers).eval()
    c = torch.compile(model, backend="gfxgraph", options={"compiler": "aot_eager", "simulate_padding": True})
    with torch.no_grad():
        x = torch.randn(6, 8)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(c(x), model(x))
    layers[1].__class__ = type(layers[1])._gfxgraph_region_of  # undone
    assert type(layers[1]) is Plain
    more = torch.nn.Sequential(Plain(), layers[0])  # a Sequential; one bound already: the class's one region
    assert gfxgraph.compile_regions(more) == 2 and type(more[0]) is type(layers[0])


@pytest.mark.parametrize("bad", [[], torch.nn.Linear(2, 2), [torch.nn.Linear(2, 2), torch.nn.ReLU()], [3],
                                 torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())])
def test_compile_regions_refuses_what_is_not_layers_of_one_class(bad):
    with pytest.raises(TypeError, match="expected"):
        gfxgraph.compile_regions(bad)


class Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def test_a_llama_traced_under_inference_mode_gets_the_no_grad_verdict():
    """Under inference_mode autograd is off, so composite ops (linear, scaled_dot_product_attention, ...) reach
    the row analysis whole: it decomposes them, and the verdict is the one no_grad gives (before, attention in
    eval mode counted as random ops there)."""
    transformers = pytest.importorskip("transformers")
    from _tiny_llama import tiny_llama

    from hipgraph_bridge.padding.rows import RowTracer

    model = tiny_llama(transformers, device="cpu")
    ids = torch.arange(5).view(5, 1) + 3
    verdicts = []
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            tracer = RowTracer([(ids, 0)])
            with tracer:
                out = model(input_ids=ids, position_ids=ids, use_cache=False).logits
            verdicts.append(tracer.verdict(out))
    assert verdicts[1].reason is verdicts[0].reason and verdicts[1].detail == verdicts[0].detail, verdicts
    assert verdicts[0].outputs == verdicts[1].outputs
