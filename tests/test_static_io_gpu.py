"""Zero-copy pool calls and padding kept between calls, with real graphs on the GPU."""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from gfxgraph import ShapeBucketPool, StaleOutputError

from _fill_counter import CountFills

pytestmark = pytest.mark.gpu


def _counting(model):
    calls = []

    def fn(*args):
        calls.append(args[0].shape[0])
        return model(*args)
    return fn, calls


def test_static_io_replays_the_bucket_without_running_the_model():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).cuda()
    fn, calls = _counting(lambda x, y: (lin(x) + y, lin(x).argmax(dim=-1)))
    pool = ShapeBucketPool(fn, [4, 8])
    with torch.no_grad():
        pool.capture_all(torch.randn(2, 64, device="cuda"), torch.randn(2, 64, device="cuda"))
        for n in (8, 5, 3):
            io = pool.static_io(n)
            x_view, y_view = io.args
            assert x_view.data_ptr() == pool.static_inputs[0].data_ptr()
            for step in range(4):
                x, y = torch.randn(n, 64, device="cuda"), torch.randn(n, 64, device="cuda")
                x_view.copy_(x)
                y_view.copy_(y)
                before = len(calls)
                out, idx = io.run()
                ref = lin(x) + y
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
                assert torch.equal(idx, lin(x).argmax(dim=-1))
                assert out.shape == (n, 64) and idx.shape == (n,)
                if step >= 1:  # checked on the first padded call; then only the graph runs
                    assert len(calls) == before, (n, step)
                    assert io.fast is not None
    assert gfxgraph.stats()["fallback_count"] == 0


def _count_calls(pool):
    """The ordinary calls the pool makes from now on (a zero-copy run on the fast path makes none)."""
    calls = []
    engine = pool._engine
    inner = engine._call

    def counting(*args, **kwargs):
        calls.append(args[2])
        return inner(*args, **kwargs)

    engine._call = counting
    return calls


def test_static_io_takes_the_fast_path_after_capture_all_and_larger_calls():
    pool = ShapeBucketPool(lambda x: x * 3, [4, 8, 16])
    pool.capture_all(torch.randn(2, 5, device="cuda"))  # every row holds example data now
    io = pool.static_io(5)
    io.args[0].fill_(1.0)
    io.run()  # fills rows 5.. once (its first padded call is also checked)
    io.run()
    calls = _count_calls(pool)
    for _ in range(3):
        assert torch.equal(io.run(), torch.full((5, 5), 3.0, device="cuda"))
    assert calls == [], calls
    pool(torch.randn(16, 5, device="cuda"))  # real rows in the padding again: the next run refills
    calls.clear()
    io.args[0].fill_(2.0)
    assert torch.equal(io.run(), torch.full((5, 5), 6.0, device="cuda")) and calls == [5]
    assert torch.equal(pool.static_inputs[0][5:8], torch.zeros(3, 5, device="cuda"))


def test_padding_filled_only_after_a_larger_call_and_results_equal():
    pool = ShapeBucketPool(lambda x: torch.tanh(x) * 3, [16], pad_value=-2)
    pool(torch.randn(16, 8, device="cuda"))  # the capture (its allocations fill too): not counted
    # the bucket's first padded call (5) also fills its padding for the check: NaN, a large value, pad_value
    for n, fills in ((5, 4), (5, 0), (16, 0), (9, 1), (9, 0), (2, 1), (2, 0)):
        x = torch.randn(n, 8, device="cuda")
        with CountFills() as counter:
            torch.testing.assert_close(pool(x), torch.tanh(x) * 3)
        assert counter.fills == fills, (n, counter.fills)
        assert torch.equal(pool.static_inputs[0][n:], torch.full((16 - n, 8), -2.0, device="cuda"))


def test_batch_sum_and_batch_mean_models_run_in_exact_size_graphs():
    for reduce in (torch.sum, torch.mean):  # zero padding would leave a sum alone: not proof enough
        pool = ShapeBucketPool(lambda x: x - reduce(x, dim=0, keepdim=True), [8])
        pool(torch.randn(8, 4, device="cuda"))
        for n in (5, 3, 7, 3):
            x = torch.randn(n, 4, device="cuda")
            torch.testing.assert_close(pool(x), x - reduce(x, dim=0, keepdim=True))
        assert pool.row_coupled and pool.captured_buckets == [3, 5, 7, 8]


def test_static_io_stays_correct_when_other_calls_dirty_the_padding():
    pool = ShapeBucketPool(lambda x: x * 2 + 1, [8])
    pool(torch.randn(8, 4, device="cuda"))
    io = pool.static_io(3)
    for _ in range(3):
        x = torch.randn(3, 4, device="cuda")
        io.args[0].copy_(x)
        torch.testing.assert_close(io.run(), x * 2 + 1)
        io.args[0].copy_(x)
        calls = _count_calls(pool)
        torch.testing.assert_close(io.run(), x * 2 + 1)  # the fast path
        assert io.fast is not None and calls == [], calls
        pool(torch.randn(8, 4, device="cuda"))  # real rows in the padding again: the next run refills


def test_debug_mode_catches_a_stale_output_view():
    pool = ShapeBucketPool(lambda x: x * 2, [4])
    pool(torch.ones(4, 3, device="cuda"))
    gfxgraph.enable(debug=True)
    try:
        io = pool.static_io(4)
        io.args[0].fill_(1.0)
        first = io.run()
        assert first.sum().item() == 24.0
        io.args[0].fill_(2.0)
        second = io.run()
        with pytest.raises(StaleOutputError):
            first.float()
        assert second.sum().item() == 48.0
    finally:
        gfxgraph.disable()


def test_static_io_after_close_raises_and_a_new_one_works():
    pool = ShapeBucketPool(lambda x: x + 1, [4])
    pool(torch.zeros(4, 2, device="cuda"))
    io = pool.static_io(4)
    io.run()
    pool.close()
    with pytest.raises(RuntimeError, match="its pool was closed"):
        io.run()
    pool(torch.zeros(4, 2, device="cuda"))
    io = pool.static_io(2)
    io.args[0].fill_(5.0)
    assert torch.equal(io.run(), torch.full((2, 2), 6.0, device="cuda"))
