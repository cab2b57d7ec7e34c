"""The row tracer's function mode (:mod:`hipgraph_bridge.padding.sizes`) on CPU: the batch's size as a number.

A dispatch mode sees ``x / x.shape[0]`` as ``x / 5``; the function mode hands
out the batch's size as a :class:`BatchInt` and the tracer refuses padding
(``SIZE_AS_VALUE``) where one reaches an op as a number, while sizes used as
sizes (views, factories, slices) keep the model padded. Each refused case is
checked against its ground truth (padding changes the real rows' results).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import gfxgraph
from hipgraph_bridge import ShapeBucketPool
from hipgraph_bridge.fallbacks import Reason
from hipgraph_bridge.padding.rows import RowTracer, Rows
from hipgraph_bridge.padding.sizes import BatchFloat, BatchInt, BatchShape, number_arguments

from test_row_analysis_cpu import Call, assert_padding_keeps_rows, padding_changes_rows, trace

X = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
TABLE = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the simulated pool path is CPU-only")


# ------------------------------------------------------------------------------------- the tainted numbers
def test_batch_int_stays_tainted_through_arithmetic_with_numbers() -> None:
    n = BatchInt(5)
    for v in (n + 1, 1 + n, n - 1, 10 - n, n * 2, 2 * n, n // 2, 11 // n, n % 3, n ** 2, -n):
        assert type(v) is BatchInt
    for v in (n / 2, 1 / n, n * 0.5, (n / 2) * 3, 3 - n / 2):
        assert type(v) is BatchFloat
    assert n == 5 and hash(n) == hash(5) and repr(n) == "5" and int(n) + 0 == 5
    assert n * X is not NotImplemented and type(n * X) is torch.Tensor  # a tensor's own op runs


def test_batch_shape_answers_as_a_torch_size() -> None:
    s = BatchShape((BatchInt(5), 8))
    assert isinstance(s, torch.Size) and s == torch.Size([5, 8]) and s == (5, 8)
    assert type(s[0]) is BatchInt and type(s[1]) is int and type(s[1:]) is torch.Size
    assert type(s[:1]) is BatchShape and s.numel() == 40 and type(s.numel()) is BatchInt
    assert repr(s) == "torch.Size([5, 8])" and torch.zeros(s).shape == (5, 8)
    b, d = s
    assert type(b) is BatchInt and d == 8
    back = pickle.loads(pickle.dumps(s))
    assert type(back) is torch.Size and back == (5, 8)


def test_number_arguments_tell_values_from_sizes() -> None:
    aten = torch.ops.aten
    names = lambda op: {name for _, name in number_arguments(op)}  # noqa: E731
    assert names(aten.div.Tensor) == {"self", "other"}  # a Python number may come in a tensor's place
    assert names(aten.full.default) == {"fill_value"}  # not its size
    assert names(aten.view.default) == {"self"}
    assert names(aten.slice.Tensor) == {"self", "start", "step"}  # the end is a length, the dim no value
    assert names(aten.arange.start_step) == {"start", "step"}
    assert "steps" in names(aten.linspace.default)


# ------------------------------------------------------------------------------------- verdicts
def _table_row_by_size(x: torch.Tensor) -> torch.Tensor:
    return x + TABLE[x.shape[0] - 1]  # the table is no batch tensor: only the index couples the rows


REFUSED_BY_SIZE = [
    ("divide_by_shape", lambda x: x / x.shape[0], "aten.div"),
    ("multiply_by_reciprocal", lambda x: x * (1 / x.shape[0]), "aten.mul"),
    ("size_method", lambda x: x - x.size(0), "aten.sub"),
    ("numel", lambda x: x / x.numel(), "aten.div"),
    ("shape_unpacked", lambda x: (lambda b, d: x * b)(*x.shape), "aten.mul"),
    ("fill_value", lambda x: x + torch.full((1, 8), x.shape[0] * 2.0), "fill_value"),
    ("tensor_from_size", lambda x: x - torch.tensor(x.shape[0]), "torch.tensor"),
    ("linspace_steps", lambda x: x * torch.linspace(0, 1, x.shape[0])[:, None], "steps"),
    ("index_by_size", _table_row_by_size, "index"),
    ("arange_from_size", lambda x: x + torch.arange(x.shape[0], 2 * x.shape[0])[:, None], "start"),
]


@pytest.mark.parametrize("fn, match", [pytest.param(f, m, id=i) for i, f, m in REFUSED_BY_SIZE])
def test_batch_size_used_as_a_number_refuses_padding(fn: Callable[[torch.Tensor], torch.Tensor], match: str) -> None:
    call = Call(fn, (X,))
    v = trace(call)
    assert v.reason is Reason.SIZE_AS_VALUE, f"got {v.reason}: {v.detail}"
    assert match in v.detail and "batch size" in v.detail
    assert padding_changes_rows(call)  # the expectation itself


def _mlp_with_sizes(x: torch.Tensor) -> torch.Tensor:
    b, d = x.shape
    h = x.view(b, 2, d // 2).reshape(x.size(0), -1)
    h = h + torch.zeros(b, 1) + x.new_full((x.shape[0], d), 0.5)
    i = torch.arange(x.shape[0])
    return h[i][: x.shape[0]].expand(b, -1) * d


KEPT = [
    ("views_factories_slices", _mlp_with_sizes),
    ("split_into_sizes", lambda x: torch.cat(x.split([3, 5], dim=1), 1) * x.shape[1]),
    ("sdpa_reshape", lambda x: F.scaled_dot_product_attention(*(x.view(x.shape[0], 2, 1, 4),) * 3).flatten(1)),
    ("layer_norm_on_the_last_dims", lambda x: F.layer_norm(x, x.shape[1:])),
]


@pytest.mark.parametrize("fn", [pytest.param(f, id=i) for i, f in KEPT])
def test_batch_size_used_as_a_size_keeps_padding(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    call = Call(fn, (X,))
    v = trace(call)
    assert v.reason is None, f"{v.reason}: {v.detail}"
    assert v.outputs == (Rows(0),)
    assert_padding_keeps_rows(call, v.outputs)


def test_a_size_number_that_reaches_no_output_refuses_nothing() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.full((1,), x.shape[0])  # made, never used
        return x * 2

    assert trace(Call(fn, (X,))).reason is None


@pytest.mark.parametrize("read", ["tolist", "numpy"])
def test_python_reads_of_batch_values_are_host_reads(read: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        top = max(getattr(x[:, 0], read)())
        return x * 2 if top > 0 else x

    v = trace(Call(fn, (X,)))
    assert v.reason is Reason.UNPROVEN and f"Tensor.{read}" in v.detail and v.host_read


def test_python_reads_of_parameters_are_no_host_reads() -> None:
    scale = torch.tensor([2.0])

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * scale.tolist()[0]

    assert trace(Call(fn, (X,))).reason is None


def test_the_function_mode_leaves_with_the_tracer_and_outside_shapes_are_plain() -> None:
    tracer = RowTracer([(X, 0)])
    with torch.no_grad(), tracer:
        assert type(X.shape) is BatchShape
        with tracer:  # re-entered, as a region's subgraph does
            pass
        assert type(X.shape) is BatchShape
    assert type(X.shape) is torch.Size and type(X.size(0)) is int
    assert not torch._C._is_torch_function_mode_enabled()


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_code_under_the_tracer_is_seen(backend: str, fullgraph: bool) -> None:
    """Compiled code runs eagerly under the tracer (``fullgraph=True`` too), traced whole; afterwards it compiles."""
    torch.compiler.reset()
    compiled: list[int] = []

    def counting(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Callable[..., object]:
        compiled.append(1)
        return torch._dynamo.lookup_backend(backend)(gm, example)

    f = torch.compile(lambda x: (x * 2).sin() / x.shape[0], backend=counting, fullgraph=fullgraph)
    with torch.no_grad(), RowTracer([(X, 0)]) as tracer:
        y = f(X)
    torch.testing.assert_close(y, (X * 2).sin() / 5)
    v = tracer.verdict(y)
    assert v.reason is Reason.SIZE_AS_VALUE and "aten.div" in v.detail
    assert compiled == []  # nothing was compiled under the tracer
    torch.testing.assert_close(f(X), (X * 2).sin() / 5)
    assert compiled == [1]  # the stance is back: the next call compiles
    torch.compiler.reset()


# ------------------------------------------------------------------------------------- the pool
@cpu_only
def test_pool_pads_a_fullgraph_compiled_model() -> None:
    """A ``fullgraph=True`` model used to raise on the pool's traced first call (dynamo tried to compile the
    tracer's own mode); it is traced as its Python and padded."""
    torch.compiler.reset()
    lin = torch.nn.Linear(8, 8)
    f = torch.compile(lin, fullgraph=True, backend="eager")
    pool = ShapeBucketPool(f, [4, 8], simulate_padding=True)
    with torch.no_grad():
        for n in (3, 5, 3):
            x = torch.randn(n, 8)
            torch.testing.assert_close(pool(x), lin(x))
    assert () not in pool.unpadded
    torch.compiler.reset()


@cpu_only
def test_pool_refuses_padding_a_model_that_divides_by_its_batch_size() -> None:
    runs = []

    def model(x: torch.Tensor) -> torch.Tensor:
        runs.append(x.shape[0])
        return x / x.shape[0]

    pool = ShapeBucketPool(model, [4, 8], simulate_padding=True)
    for n in (3, 5, 3):
        x = torch.randn(n, 8)
        torch.testing.assert_close(pool(x), x / n)
    assert runs == [3, 5, 3]  # every run on the caller's own rows: never padded
    refusal = pool.unpadded[()]
    assert refusal.reason == "size_as_value" and "aten.div" in refusal.detail
    assert gfxgraph.stats()["fallback_reasons"]["no_gpu"] >= 3
