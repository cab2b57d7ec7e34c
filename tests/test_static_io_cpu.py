"""Padding that is not refilled per call, and zero-copy calls (StaticIO), through the simulated pipeline.

``simulate_padding=True`` runs a pool's calls as a replay would (padded static
buffers, sliced outputs) on a machine without a GPU; the GPU twins of these
tests are in test_static_io_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from hipgraph_bridge import ShapeBucketPool, StaleOutputError
from hipgraph_bridge.bucketing.buffers import PAD_FILL, PAD_KEEP, PAD_ROWS

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the simulated pipeline is the CPU path")


@pytest.fixture(autouse=True)
def _fresh_stats():
    gfxgraph.reset_stats()
    yield
    gfxgraph.disable()


def _calls(model):
    seen = []

    def fn(*args, **kwargs):
        seen.append(args[0].shape[0])
        return model(*args, **kwargs)
    return fn, seen


@cpu_only
def test_row_wise_model_keeps_stale_padding():
    fn, seen = _calls(lambda x: x * 2)
    pool = ShapeBucketPool(fn, [8], pad_value=0, simulate_padding=True)
    big = torch.arange(24.0).reshape(8, 3)
    assert torch.equal(pool(big), big * 2)
    small = torch.ones(3, 3)
    assert torch.equal(pool(small), small * 2)  # checked (rows padded with copies of its own)
    assert pool._entries[(8, ())].padding_checked and not pool._entries[(8, ())].refill
    buf = pool.static_inputs[0]
    assert torch.equal(buf[3:8], torch.ones(5, 3))  # the check's copies stay: no refill per call
    other = torch.full((2, 3), 7.0)
    assert torch.equal(pool(other), other * 2)
    assert torch.equal(buf[2:8], torch.ones(6, 3))  # rows beyond the call kept what was there


@cpu_only
def test_batch_sum_model_gets_its_padding_refilled():
    # zero rows leave a batch sum unchanged, copies of real rows do not: the check finds out and refills
    fn, _ = _calls(lambda x: x - x.sum(dim=0, keepdim=True))
    pool = ShapeBucketPool(fn, [8], pad_value=0, simulate_padding=True)
    x = torch.randn(5, 3)
    torch.testing.assert_close(pool(x), x - x.sum(0, keepdim=True))
    entry = pool._entries[(8, ())]
    assert entry.padding_checked and entry.refill and not pool.row_coupled
    pool(torch.randn(8, 3))  # fills every row
    y = torch.randn(2, 3)
    torch.testing.assert_close(pool(y), y - y.sum(0, keepdim=True))
    assert torch.equal(pool.static_inputs[0][2:8], torch.zeros(6, 3))  # refilled with pad_value


@cpu_only
def test_batch_mean_model_runs_padded_calls_eagerly():
    fn, _ = _calls(lambda x: x - x.mean(dim=0, keepdim=True))
    pool = ShapeBucketPool(fn, [8], simulate_padding=True)
    x = torch.randn(5, 3)
    torch.testing.assert_close(pool(x), x - x.mean(0, keepdim=True))  # eager's answer, reported
    assert () in pool.row_coupled
    assert gfxgraph.stats()["fallback_reasons"].get("padding_changes_results") == 1


@cpu_only
def test_pad_value_none_never_refills():
    fn, _ = _calls(lambda x: x - x.sum(dim=0, keepdim=True))
    pool = ShapeBucketPool(fn, [8], pad_value=None, simulate_padding=True)
    x = torch.randn(5, 3)
    torch.testing.assert_close(pool(x), x - x.sum(0, keepdim=True))
    assert () in pool.row_coupled  # no value to refill with: eager from now on


@cpu_only
def test_refill_padding_option_fills_every_padded_call():
    fn, _ = _calls(lambda x: x + 1)
    pool = ShapeBucketPool(fn, [8], pad_value=-1, refill_padding=True, simulate_padding=True)
    pool(torch.ones(8, 3))
    pool(torch.ones(3, 3))
    assert torch.equal(pool.static_inputs[0][3:8], torch.full((5, 3), -1.0))
    with pytest.raises(TypeError, match="refill_padding: expected a bool"):
        ShapeBucketPool(fn, [8], refill_padding="yes")


def test_stage_modes_on_a_buffer():
    pool = ShapeBucketPool(lambda x: x, [8], pad_value=-1, simulate_padding=True)
    x = torch.arange(9.0).reshape(3, 3)
    leaves, layout, _ = pool._classify((x,), {})
    inputs = pool._fixed_inputs(leaves, layout)
    inputs.stage([x], 3, PAD_ROWS)
    assert torch.equal(inputs.buffers[0][3:8], x[torch.arange(5) % 3])
    inputs.stage([x], 3, PAD_FILL)
    assert torch.equal(inputs.buffers[0][3:8], torch.full((5, 3), -1.0))
    inputs.stage([torch.zeros(2, 3)], 2, PAD_KEEP)
    assert torch.equal(inputs.buffers[0][2], x[2]) and torch.equal(inputs.buffers[0][3:8], torch.full((5, 3), -1.0))


@cpu_only
def test_static_io_reads_the_views_and_returns_output_views():
    fn, seen = _calls(lambda x, y: (x * 2 + y, x.sum(dim=1)))
    pool = ShapeBucketPool(fn, [4, 8], simulate_padding=True)
    with pytest.raises(RuntimeError, match="layout is not fixed yet"):
        pool.static_io(3)
    pool(torch.zeros(8, 3), torch.zeros(8, 3))
    io = pool.static_io(5)
    assert io.bucket == 8 and repr(io) == "StaticIO(batch_size=5, bucket=8)"
    x, y = io.args
    assert x.shape == (5, 3) and x.data_ptr() == pool.static_inputs[0].data_ptr()
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    x.copy_(a)
    y.copy_(b)
    out, s = io.run()
    torch.testing.assert_close(out, a * 2 + b)
    torch.testing.assert_close(s, a.sum(dim=1))
    assert out.shape == (5, 3) and s.shape == (5,)


@pytest.mark.parametrize("bad", [0, 9, -1, 2.5, True, "3"])
def test_static_io_batch_size_checked(bad):
    pool = ShapeBucketPool(lambda x: x, [4, 8], simulate_padding=True)
    with pytest.raises(ValueError, match=r"batch_size: expected an int in \[1, 8\]"):
        pool.static_io(bad)


@cpu_only
def test_static_io_refuses_constant_arguments_and_closed_pools():
    pool = ShapeBucketPool(lambda x, k: x * k, [4], simulate_padding=True)
    pool(torch.ones(4, 2), 3)
    with pytest.raises(ValueError, match="expected tensor arguments only"):
        pool.static_io(2)
    pool = ShapeBucketPool(lambda x: x * 3, [4], simulate_padding=True)
    pool(torch.ones(4, 2))
    io = pool.static_io(4)
    pool.close()
    with pytest.raises(RuntimeError, match="its pool was closed"):
        io.run()


@cpu_only
def test_static_io_debug_mode_catches_stale_views_and_rebinding():
    pool = ShapeBucketPool(lambda x: x * 3, [4], simulate_padding=True)
    pool(torch.ones(4, 2))
    gfxgraph.enable(debug=True)
    io = pool.static_io(4)
    io.args[0].fill_(1.0)
    first = io.run()
    assert torch.equal(first, torch.full((4, 2), 3.0))  # usable until the next call
    second = io.run()
    assert float(second.sum()) == 24.0
    with pytest.raises(StaleOutputError, match="a later pool call overwrote"):
        first.sum()
    assert type(second.sum()) is torch.Tensor  # results of ops on a guarded view are plain tensors
    pool2 = ShapeBucketPool(lambda x, mask: x * mask, [4], simulate_padding=True)
    pool2(torch.ones(4, 2), mask=torch.ones(4, 2))
    io2 = pool2.static_io(4)
    io2.kwargs["mask"] = torch.zeros(4, 2)
    with pytest.raises(RuntimeError, match="no longer the static buffer's view"):
        io2.run()
