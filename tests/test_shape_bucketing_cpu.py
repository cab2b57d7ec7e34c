"""ShapeBucketPool logic without a GPU: buckets, validation, padding/slicing, pytrees, bad input.

Without a GPU the pool runs the very pipeline a replay uses (static buffers at the largest
bucket, copy-in, padding, slicing back) with the model run eagerly, so these tests cover it.
"""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from conftest import GPU_SKIP_REASON
from gfxgraph import BridgedCUDAGraph, ShapeBucketPool, default_buckets
from hipgraph_bridge.graph.buckets import BucketTable, validate_buckets

cpu_only = pytest.mark.skipif(GPU_SKIP_REASON is None, reason="exercises the no-GPU pipeline")


def test_default_buckets_fine_then_coarse():
    b = default_buckets()
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] == 256
    steps = [y - x for x, y in zip(b, b[1:])]
    assert steps == sorted(steps)  # never finer further up
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert default_buckets(1) == [1]
    with pytest.raises(ValueError, match="max_batch_size: expected a positive int"):
        default_buckets(0)


def test_validate_buckets_sorts_and_dedups():
    assert validate_buckets([8, 2, 2, 32, 1]) == [1, 2, 8, 32]
    assert validate_buckets(range(1, 4)) == [1, 2, 3]


@pytest.mark.parametrize("bad,exc,msg", [
    ([], ValueError, "at least one"), ([0, 4], ValueError, "positive ints, got 0"),
    ([-1], ValueError, "positive ints"), ([2.5], ValueError, "positive ints, got 2.5"),
    ([True], ValueError, "positive ints"), ("1,2", TypeError, "iterable of positive ints"),
    (7, TypeError, "iterable of positive ints"),
])
def test_bad_bucket_lists(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        ShapeBucketPool(lambda x: x, bad)


def test_bucket_selection_smallest_at_least_batch():
    pool = ShapeBucketPool(lambda x: x, [1, 4, 8, 32])
    assert [pool.bucket_for(n) for n in (1, 2, 4, 5, 8, 9, 32)] == [1, 4, 4, 8, 8, 32, 32]
    assert pool.bucket_for(33) is None
    with pytest.raises(ValueError, match="batch_size: expected a positive int"):
        pool.bucket_for(0)


@pytest.mark.parametrize("kwargs,exc,msg", [
    ({"model_fn": 3}, TypeError, "model_fn: expected a callable"),
    ({"batch_dim": -1}, ValueError, "batch_dim"),
    ({"oversize": "drop"}, ValueError, "oversize: expected 'eager' or 'error'"),
    ({"warmup_iters": -2}, ValueError, "warmup_iters"),
    ({"pad_value": "x"}, TypeError, "pad_value"),
    ({"static_args": [1.5]}, TypeError, "static_args"),
    ({"vram_cap": 2.0}, ValueError, "vram_cap"),
    ({"capture_error_mode": "loose"}, ValueError, "capture_error_mode"),
    ({"generators": [3]}, TypeError, "generators: expected CUDA torch.Generator"),
    ({"generators": [torch.Generator()]}, TypeError, "generators: expected CUDA torch.Generator objects"),
    ({"static_args": "bias"}, TypeError, "static_args: expected a collection"),
    ({"copy_outputs": "no"}, TypeError, "copy_outputs: expected a bool"),
])
def test_bad_options(kwargs, exc, msg):
    args = {"model_fn": lambda x: x, "buckets": [1, 2], **kwargs}
    with pytest.raises(exc, match=msg):
        ShapeBucketPool(**args)


def test_bad_vram_cap_env(monkeypatch):
    monkeypatch.setenv("GFXGRAPH_VRAM_CAP", "90%")
    with pytest.raises(ValueError, match="GFXGRAPH_VRAM_CAP"):
        ShapeBucketPool(lambda x: x, [1])


@cpu_only
def test_padding_and_slicing_through_the_pipeline():
    seen_shapes = []

    def model(x):
        seen_shapes.append(tuple(x.shape))
        return x * 2, x.sum(dim=1)

    pool = ShapeBucketPool(model, [4, 8], pad_value=-1, simulate_padding=True)
    x = torch.arange(15.0).reshape(5, 3)
    y, s = pool(x)  # the first call: one run on its own 5 rows, traced (rows proven independent)
    assert seen_shapes == [(5, 3)] and torch.equal(y, x * 2) and torch.equal(s, x.sum(dim=1))
    y, s = pool(x)
    assert seen_shapes[-1] == (8, 3)  # padded up to bucket 8
    assert torch.equal(y, x * 2) and torch.equal(s, x.sum(dim=1))
    assert y.shape == (5, 3) and s.shape == (5,)
    buf = pool.static_inputs[0]
    assert torch.equal(buf[5:8], torch.full((3, 3), -1.0))  # padding rows hold pad_value
    y2, _ = pool(torch.ones(2, 3))
    assert seen_shapes[-1] == (4, 3) and torch.equal(y2, torch.full((2, 3), 2.0))  # one run per call
    assert len(seen_shapes) == 3 and gfxgraph.stats()["fallback_reasons"]["no_gpu"] == 3


@cpu_only
def test_every_size_matches_eager_with_pytrees_and_kwargs():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)

    def model(inputs, *, mask, scale):
        h = lin(inputs["a"]) + inputs["b"][:, :4]
        return {"h": h * mask * scale, "first": h[:, 0], "n": 3}

    pool = ShapeBucketPool(model, [1, 2, 4, 8, 16], simulate_padding=True)
    for n in range(1, 17):
        a, b, mask = torch.randn(n, 6), torch.randn(n, 5), torch.rand(n, 1)
        got = pool({"a": a, "b": b}, mask=mask, scale=0.5)
        want = model({"a": a, "b": b}, mask=mask, scale=0.5)
        assert got.keys() == want.keys() and got["n"] == 3
        torch.testing.assert_close(got["h"], want["h"])
        torch.testing.assert_close(got["first"], want["first"])
    assert not pool.unpadded and pool.bucket_for(3) == 4


@cpu_only
def test_a_pytree_output_that_sums_over_the_batch_is_never_padded():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)
    runs = []

    def model(x):
        runs.append(x.shape[0])
        h = lin(x)
        return {"h": h, "pooled": h.sum(0)}  # 4 columns, like bucket 4 has rows: found by the trace, not sizes

    pool = ShapeBucketPool(model, [4, 8], simulate_padding=True)
    for n in (3, 5, 3, 7):
        x = torch.randn(n, 6)
        got, want = pool(x), model(x)
        torch.testing.assert_close(got["pooled"], want["pooled"])
        torch.testing.assert_close(got["h"], want["h"])
    assert runs[::2] == [3, 5, 3, 7]  # pool runs only: every one on the caller's own rows
    assert pool.unpadded[()].reason == "rows_coupled" and "aten.sum" in pool.unpadded[()].detail


@cpu_only
def test_batch_dim_and_static_args():
    w = torch.randn(3, 4)

    def model(x, weight):
        return torch.einsum("tbi,ij->tbj", x, weight)

    pool = ShapeBucketPool(model, [2, 4], batch_dim=1, static_args=[1])
    x = torch.randn(7, 3, 3)  # (T, B, C) with the batch in dim 1
    out = pool(x, w)
    assert out.shape == (7, 3, 4)
    torch.testing.assert_close(out, model(x, w))
    with pytest.raises(ValueError, match="args\\[1\\]: expected dtype=torch.float32.*shape without the batch dim \\(3, 4\\)"):
        pool(x, torch.randn(5, 4))


@cpu_only
def test_oversize_eager_or_error():
    pool = ShapeBucketPool(lambda x: x + 1, [2, 4])
    x = torch.zeros(9, 2)
    assert torch.equal(pool(x), x + 1)
    assert gfxgraph.stats()["fallback_reasons"]["oversize"] == 1
    strict = ShapeBucketPool(lambda x: x + 1, [2, 4], oversize="error")
    with pytest.raises(ValueError, match="batch size 9 is above the largest bucket 4"):
        strict(x)


@cpu_only
def test_outputs_are_copies_by_default_and_views_on_request():
    pool = ShapeBucketPool(lambda x: x * 1, [4])
    a = pool(torch.ones(2, 2))
    b = pool(torch.zeros(2, 2))
    assert torch.equal(a, torch.ones(2, 2)) and torch.equal(b, torch.zeros(2, 2))


@cpu_only
@pytest.mark.parametrize("call,exc,msg", [
    (lambda p: p(torch.zeros(0, 4)), ValueError, "empty batch: expected batch size >= 1"),
    (lambda p: p(torch.zeros(3, 5)), ValueError, r"shape without the batch dim \(4,\)"),
    (lambda p: p(torch.zeros(3, 4, dtype=torch.float64)), ValueError, "expected dtype=torch.float32"),
    (lambda p: p(torch.zeros(3, 4, 1)), ValueError, "shape without the batch dim"),
    (lambda p: p([1, 2, 3]), TypeError, "expected at least one tensor argument with a batch dimension"),
    (lambda p: p(torch.tensor(1.0)), TypeError, "expected at least one tensor argument"),
    (lambda p: p(torch.zeros(3, 4), torch.zeros(3, 4)), ValueError, "expected 1 positional argument"),
    (lambda p: p(torch.zeros(3, 4), key=1), ValueError, "keyword arguments \\[\\] \\(as at the first call\\)"),
])
def test_bad_inputs_name_what_was_expected(call, exc, msg):
    pool = ShapeBucketPool(lambda x, **kw: x * 2, [2, 4])
    pool(torch.ones(3, 4))  # fixes the layout
    with pytest.raises(exc, match=msg):
        call(pool)


@cpu_only
def test_unhashable_constant_and_mismatched_batches():
    pool = ShapeBucketPool(lambda x, y, opt: x + y, [4])
    with pytest.raises(TypeError, match="must be hashable"):
        pool(torch.ones(2, 2), torch.ones(2, 2), {1, 2})
    with pytest.raises(ValueError, match="expected batch size 2 in dim 0 \\(as args\\[0\\]\\), got 3"):
        pool(torch.ones(2, 2), torch.ones(3, 2), 1)


@cpu_only
def test_constants_are_part_of_the_key():
    calls = []

    def model(x, mode):
        calls.append(mode)
        return x * (2 if mode == "double" else 3)

    pool = ShapeBucketPool(model, [4], simulate_padding=True)
    x = torch.ones(3, 1)
    assert torch.equal(pool(x, "double"), x * 2)
    assert torch.equal(pool(x, "triple"), x * 3)
    assert set(pool._engine.keys) == {("double",), ("triple",)}  # one row analysis and one graph set per key


@cpu_only
def test_seed_high_level_dynamic_shapes_path():
    g = BridgedCUDAGraph()
    model = lambda x: x.cumsum(dim=1)  # noqa: E731
    with g.capture(dynamic_shapes=True, model_fn=model, buckets=[2, 4, 8]):
        pass
    for n in (1, 3, 8):
        x = torch.randn(n, 5)
        assert torch.equal(g.replay(input_tensor=x), model(x))
    with pytest.raises(ValueError, match="disagrees"):
        g.replay(input_tensor=torch.randn(3, 5), batch_size=4)
    with pytest.raises(TypeError, match="needs model_fn"):
        BridgedCUDAGraph().capture(dynamic_shapes=True)


def test_fast_path_sends_other_constant_kinds_to_the_full_checks():
    pool = ShapeBucketPool(lambda x, k: x * k, [4])
    x = torch.ones(2, 3)
    pool(x, 2)
    with pytest.raises(ValueError, match="structure"):
        pool(x, (torch.ones(2),))  # a container where an int was: the layout differs
    torch.testing.assert_close(pool(x, 3), x * 3)  # another int: another key, same layout


def test_a_call_from_another_stream_waits_for_the_default_stream(monkeypatch):
    """The default stream's handle is 0: the first call on it must still be remembered."""
    from hipgraph_bridge.graph import ordering

    class FakeStream:
        def __init__(self, handle: int) -> None:
            self.handle, self.waited = handle, []

        def wait_stream(self, other: "FakeStream") -> None:
            self.waited.append(other.handle)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, FakeStream) and other.handle == self.handle

    default, side = FakeStream(0), FakeStream(7)
    current = {"s": default}
    monkeypatch.setattr(ordering, "current_raw_stream", lambda: current["s"].handle)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: current["s"])
    order = ordering.CallOrder()
    order.after_previous()
    order.after_previous()
    current["s"] = side
    order.after_previous()
    assert side.waited == [0]
    assert default.waited == []


# ------------------------------------------------- eager is the model on your own arguments
@cpu_only
def test_without_a_gpu_calls_run_the_model_on_the_callers_arguments():
    seen = []

    def model(x):
        seen.append(tuple(x.shape))
        return x - x.mean(0)  # rows interact: padding would change the result

    pool = ShapeBucketPool(model, [4, 8])
    for n in (3, 5, 8):
        x = torch.randn(n, 2)
        torch.testing.assert_close(pool(x), model(x))
    assert (4, 2) not in seen[:3] and (8, 2) not in seen[:2]  # never padded
    assert gfxgraph.stats()["fallback_reasons"]["no_gpu"] == 3


@cpu_only
@pytest.mark.parametrize("model", [
    lambda x: x - x.mean(0),
    lambda x: (x - x.min(0).values) / (x.max(0).values - x.min(0).values),
    lambda x: x - x.max(0).values,
])
def test_a_row_coupled_model_is_never_padded_whatever_the_data(model):
    seen = []

    def traced(x):
        seen.append(x.shape[0])
        return model(x)

    pool = ShapeBucketPool(traced, [4, 8], simulate_padding=True)
    # data on which padding happens to change nothing for min/max (the old one-call check passed it)
    first = torch.tensor([[-2., -1], [1, 2], [.3, -.2]])
    torch.testing.assert_close(pool(first), model(first))
    for n in (3, 5, 3, 6):
        x = torch.rand(n, 2) + 1
        torch.testing.assert_close(pool(x), model(x))
    assert seen == [3, 3, 5, 3, 6]  # every run on the caller's own rows: never padded
    assert pool.unpadded[()].reason == "rows_coupled"
    assert gfxgraph.stats()["fallback_reasons"]["rows_coupled"] == 1  # decided once, by the trace


@cpu_only
def test_each_call_runs_the_model_once():
    rows = []

    def model(x):
        rows.append(x.shape[0])
        return x * 2

    pool = ShapeBucketPool(model, [8], simulate_padding=True)
    for _ in range(3):
        torch.testing.assert_close(pool(torch.ones(5, 2)), torch.full((5, 2), 2.0))
    assert rows == [5, 8, 8]  # the first on its own rows (traced), then padded to 8


@cpu_only
@pytest.mark.parametrize("given", [True, None])
def test_a_stateful_model_is_never_padded(given):
    steps = []
    seen = torch.zeros(())

    def model(x):
        steps.append(x.shape[0])
        seen.add_(1)  # state the call did not create: found by the trace when not given
        return x * 2

    pool = ShapeBucketPool(model, [4], stateful=given, simulate_padding=True)
    torch.testing.assert_close(pool(torch.ones(3, 2)), torch.full((3, 2), 2.0))
    assert steps == [3] and pool.stateful  # on the caller's 3 rows, once: never padded
    assert pool.bucket_for(3) == 3 and pool.unpadded[()].reason == "stateful"
    pool(torch.ones(4, 2))
    pool(torch.ones(2, 2))
    assert steps == [3, 4, 2] and seen.item() == 3


@cpu_only
def test_which_outputs_carry_the_batch_comes_from_the_trace():
    """A (4,) output with bucket 4 is not batched, and the pool never runs the model at another size to tell."""
    bias = torch.arange(4.0)
    sizes = []

    def model(x):
        sizes.append(x.shape[0])
        return x * 2, bias + x.shape[1]

    pool = ShapeBucketPool(model, [4], simulate_padding=True)
    for n in (4, 3, 4):
        y, b = pool(torch.ones(n, 4))
        assert y.shape == (n, 4) and b.shape == (4,)
        torch.testing.assert_close(b, bias + 4)
    assert sizes == [4, 4, 4]


@cpu_only
def test_a_model_that_raises_only_on_the_padded_inputs_runs_that_bucket_eagerly():
    seen = []

    def model(x):
        seen.append(x.shape[0])
        if x.shape[0] == 8:
            raise RuntimeError("no 8-row batches")
        return x + 1

    pool = ShapeBucketPool(model, [4, 8], simulate_padding=True)
    torch.testing.assert_close(pool(torch.zeros(5, 2)), torch.ones(5, 2))  # its own 5 rows (traced)
    torch.testing.assert_close(pool(torch.zeros(6, 2)), torch.ones(6, 2))  # padded to 8: raised; eager on 6
    assert seen == [5, 8, 6] and 8 in pool.failed_buckets
    torch.testing.assert_close(pool(torch.zeros(7, 2)), torch.ones(7, 2))
    assert seen == [5, 8, 6, 7]  # the failed bucket runs eagerly without trying the padded run again
    reasons = gfxgraph.stats()["fallback_reasons"]
    assert reasons["padded_run_failed"] == 2 and "capture_failed" not in reasons


@cpu_only
def test_a_model_that_raises_on_the_callers_arguments_too_raises_its_error_and_fixes_nothing():
    def model(x):
        if x.shape[1] != 2:
            raise ValueError("expected 2 features")
        return x + 1

    pool = ShapeBucketPool(model, [4], simulate_padding=True)
    with pytest.raises(ValueError, match="expected 2 features"):
        pool(torch.zeros(3, 5))
    assert not pool.static_inputs and not pool.failed_buckets  # the first call fixed no layout, failed no bucket
    torch.testing.assert_close(pool(torch.zeros(3, 2)), torch.ones(3, 2))


@cpu_only
def test_a_stateful_model_that_raises_runs_once_and_raises():
    runs = []

    def model(x):
        runs.append(x.shape[0])
        raise RuntimeError("cache full")

    pool = ShapeBucketPool(model, [4], stateful=True, simulate_padding=True)
    with pytest.raises(RuntimeError, match="cache full"):
        pool(torch.zeros(4, 2))
    assert runs == [4]  # never re-run: a second run would write its state twice


@cpu_only
def test_a_module_in_training_mode_with_batch_norm_or_dropout_is_not_padded():
    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).train()
    ref = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).train()
    ref.load_state_dict(bn.state_dict())
    pool = ShapeBucketPool(bn, [4, 8], simulate_padding=True)
    for n in (3, 5, 3, 2, 7, 6):
        x = torch.randn(n, 3)
        torch.testing.assert_close(pool(x), ref(x))
    assert bn[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item() == 6  # as many runs as calls
    torch.testing.assert_close(bn[1].running_mean, ref[1].running_mean)
    why = pool.unpadded[()]
    assert why.reason == "training_layers" and "BatchNorm1d '1'" in why.detail and "model.eval()" in why.detail
    drop = ShapeBucketPool(torch.nn.Dropout(0.5).train(), [4], simulate_padding=True)
    drop(torch.ones(3, 2))
    assert drop.unpadded[()].reason == "training_layers"


def test_stateful_with_several_warm_up_runs_is_refused():
    with pytest.raises(ValueError, match="warmup_iters=2 with stateful=True: expected 0 or 1"):
        ShapeBucketPool(lambda x: x, [4], stateful=True, warmup_iters=2)


def test_inputs_that_require_grad_run_eagerly_with_autograd():
    lin = torch.nn.Linear(3, 2)
    pool = ShapeBucketPool(lin, [4])
    x = torch.randn(3, 3, requires_grad=True)
    y = pool(x)
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert gfxgraph.stats()["fallback_reasons"]["grad"] == 1
    with torch.no_grad():
        torch.testing.assert_close(pool(x), lin(x))  # no grad mode: the inputs' flag does not matter


@pytest.mark.parametrize("kwargs,call,exc,msg", [
    ({"static_args": [3]}, lambda p: p(torch.ones(2, 2)), ValueError, r"static_args: \[3\] name no argument"),
    ({"static_args": ["w"]}, lambda p: p(torch.ones(2, 2)), ValueError, r"keywords among \[\]"),
    ({"batch_dim": 1}, lambda p: p(torch.ones(2, 2), torch.ones(5)), ValueError,
     r"args\[1\]: expected a tensor with a batch dimension at dim 1, got shape \(5,\); name it in static_args"),
])
def test_arguments_that_do_not_fit_the_options_are_named(kwargs, call, exc, msg):
    pool = ShapeBucketPool(lambda x, *a, **k: x, [4], **kwargs)
    with pytest.raises(exc, match=msg):
        call(pool)


@pytest.mark.parametrize("kwargs,exc,msg", [
    ({"buckets": [4], "max_batch_size": 8}, ValueError, "expected one of them"),
    ({"batched_outputs": "yes"}, TypeError, "batched_outputs: expected a sequence of bools"),
    ({"batched_outputs": [1, 0]}, TypeError, "batched_outputs: expected a sequence of bools"),
    ({"stateful": "no"}, TypeError, "stateful: expected a bool"),
])
def test_conflicting_or_malformed_options(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        ShapeBucketPool(lambda x: x, **kwargs)


@cpu_only
def test_capture_all_without_a_gpu_reports_nothing_captured():
    pool = ShapeBucketPool(lambda x: x * 2, [2, 4], progress=False)
    report = pool.capture_all(torch.ones(2, 3))
    assert report["buckets"] == 2 and report["captured"] == 0 and pool.captured_buckets == []


def test_the_bucket_table_holds_the_buckets_only_whatever_the_largest():
    huge = ShapeBucketPool(lambda x: x, [1, 2**31])
    assert huge.bucket_for(2) == 2**31 and huge.bucket_for(2**31) == 2**31 and huge.bucket_for(2**31 + 1) is None
    wide = ShapeBucketPool(lambda x: x, max_batch_size=2**31)
    assert len(wide.buckets) < 100 and wide.buckets[-1] == 2**31
    assert wide.bucket_for(300) == 320 and wide.bucket_for(2**31 - 5) == 2**31
    table = BucketTable([4, 2**40], exact=True)
    assert table[7] == 7 and table.bucket_for(2**40) == 2**40 and table.__slots__  # no per-size list
