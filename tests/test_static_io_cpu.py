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

from _fill_counter import CountFills

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
def test_padding_is_filled_only_after_a_larger_call_left_rows_there():
    pool = ShapeBucketPool(lambda x: x * 2, [8], pad_value=-1, simulate_padding=True)
    for n, fills in ((3, 0), (3, 0), (8, 0), (3, 1), (3, 0), (5, 0), (2, 1)):
        x = torch.randn(n, 4)
        with CountFills() as counter:
            torch.testing.assert_close(pool(x), x * 2)
        buf = pool.static_inputs[0]
        assert counter.fills == fills, (n, counter.fills)
        assert torch.equal(buf[n:], torch.full((8 - n, 4), -1.0)), n  # the padding always holds pad_value
    assert pool._engine.inputs.dirty == 2


@cpu_only
def test_capture_all_examples_count_as_real_rows():
    pool = ShapeBucketPool(lambda x: x + 1, [4, 8], simulate_padding=True)
    pool.capture_all(torch.ones(2, 3))
    assert pool._engine.inputs.dirty == 8
    y = torch.randn(3, 3)
    torch.testing.assert_close(pool(y), y + 1)  # the first call: its own rows only, nothing padded yet
    torch.testing.assert_close(pool(y), y + 1)  # padded to 4
    # the fill reaches every row the examples left, beyond the bucket too: later calls find them clean
    assert torch.equal(pool.static_inputs[0][3:8], torch.zeros(5, 3)) and pool._engine.inputs.dirty == 3


@cpu_only
def test_a_model_that_writes_its_inputs_is_stateful_and_never_padded():
    def model(x):
        out = x * 2
        x.add_(1)  # writes its own input in place
        return out

    pool = ShapeBucketPool(model, [8], simulate_padding=True)
    for n in (5, 3, 5):
        x = torch.randn(n, 3)
        want = model(x.clone())
        torch.testing.assert_close(pool(x), want)
    assert pool.unpadded[()].reason == "stateful" and "one of the call's inputs" in pool.unpadded[()].detail


@cpu_only
def test_a_batch_sum_model_is_never_padded_even_when_zero_padding_would_leave_it_alone():
    pool = ShapeBucketPool(lambda x: x - x.sum(dim=0, keepdim=True), [8], simulate_padding=True)
    pool(torch.randn(8, 3))
    for n in (5, 2, 7):
        x = torch.randn(n, 3)
        torch.testing.assert_close(pool(x), x - x.sum(0, keepdim=True))
    assert pool.row_coupled and pool.bucket_for(5) == 5


@cpu_only
def test_static_io_reads_the_views_and_returns_output_views():
    fn, seen = _calls(lambda x, y: (x * 2 + y, x.sum(dim=1)))
    pool = ShapeBucketPool(fn, [4, 8], simulate_padding=True)
    with pytest.raises(RuntimeError, match="layout is not fixed yet"):
        pool.static_io(3)
    pool(torch.zeros(8, 3), torch.zeros(8, 3))
    io = pool.static_io(5)
    assert repr(io) == "StaticIO(batch_size=5)" and pool.bucket_for(5) == 8
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
    row = second[0]  # a view of the output: as stale as it after the next call
    io.run()
    with pytest.raises(StaleOutputError):
        row.tolist()
    pool2 = ShapeBucketPool(lambda x, mask: x * mask, [4], simulate_padding=True)
    pool2(torch.ones(4, 2), mask=torch.ones(4, 2))
    io2 = pool2.static_io(4)
    io2.kwargs["mask"] = torch.zeros(4, 2)
    with pytest.raises(RuntimeError, match="no longer the static buffer's view"):
        io2.run()
