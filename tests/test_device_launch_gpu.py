"""Device-sized pool calls on the GPU: the bucket is picked and launched on the device (CUDA 12+)."""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from hipgraph_bridge.runtime import current_runtime
from hipgraph_bridge.runtime.device_launch import device_launch_unavailable_reason

pytestmark = pytest.mark.gpu

BUCKETS = [1, 2, 4, 8, 16, 32, 48, 64]


def _needs_device_launch() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    why = device_launch_unavailable_reason(current_runtime())
    if why:
        pytest.skip(why)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).cuda().eval()


@pytest.fixture(scope="module")
def made():
    _needs_device_launch()
    model = _mlp()
    pool = gfxgraph.ShapeBucketPool(model, BUCKETS, progress=False, pad_value=0.0)
    with torch.no_grad():
        call = pool.device_sized(torch.randn(64, 32, device="cuda"))
    yield model, pool, call
    call.close()
    pool.close()


def test_every_n_picks_its_bucket_and_matches_eager(made):
    model, pool, call = made
    assert call.mode == "device", call.reason
    x = torch.randn(64, 32, device="cuda")
    buf = pool.static_inputs[0]
    for n in range(1, 65):
        nd = torch.tensor(n, device="cuda")
        with torch.no_grad():
            out = call(nd, x)
            ref = model(x[:n])
        torch.cuda.synchronize()
        assert int(call.bucket) == min(b for b in BUCKETS if b >= n)
        torch.testing.assert_close(out[:n], ref, rtol=1e-5, atol=1e-5)
        assert not out[n:].any(), f"n={n}: output rows past n are not zero"
        assert not buf[n:].any(), f"n={n}: padding rows of the input hold stale data"
    call.check()


def test_out_of_range_n_zero_fills_and_is_reported(made):
    _, _, call = made
    x = torch.randn(64, 32, device="cuda")
    with torch.no_grad():
        call(torch.tensor(5, device="cuda"), x)
        out = call(torch.tensor(65, device="cuda"), x)
    torch.cuda.synchronize()
    assert not out.any()
    with pytest.raises(ValueError, match=r"outside \[1, 64\]"):
        call.check()
    call.check()  # cleared


def test_a_thousand_queued_calls_stay_in_order(made):
    model, _, call = made
    xs = torch.randn(1000, 64, 32, device="cuda")
    ns = torch.randint(1, 65, (1000,), device="cuda")
    sums = torch.empty(1000, device="cuda")
    with torch.no_grad():
        for i in range(1000):  # no host sync: every n stays on the device
            out = call(ns[i], xs[i])
            sums[i] = out.sum()
        torch.cuda.synchronize()
        call.check()
        for i in range(0, 1000, 97):
            n = int(ns[i])
            torch.testing.assert_close(sums[i], model(xs[i, :n]).sum(), rtol=1e-4, atol=1e-3)


def test_ordinary_calls_after_device_calls_see_clean_padding(made):
    model, pool, call = made
    x = torch.randn(64, 32, device="cuda")
    with torch.no_grad():
        call(torch.tensor(60, device="cuda"), x)
        y = torch.randn(3, 32, device="cuda")
        torch.testing.assert_close(pool(y), model(y), rtol=1e-5, atol=1e-5)


def test_forced_host_path_gives_the_same_outputs(made):
    model, pool, _ = made
    with torch.no_grad():
        host = pool.device_sized(torch.randn(64, 32, device="cuda"), device_launch=False)
        assert host.mode == "host" and "device_launch=False" in host.reason
        x = torch.randn(64, 32, device="cuda")
        for n in (1, 7, 33, 64):
            out = host(torch.tensor(n, device="cuda"), x)
            torch.testing.assert_close(out[:n], model(x[:n]), rtol=1e-5, atol=1e-5)
            assert not out[n:].any()


def test_row_coupled_model_takes_the_host_path_with_the_reason():
    _needs_device_launch()

    def coupled(x):
        return x - x.mean(0)

    pool = gfxgraph.ShapeBucketPool(coupled, [4, 8], progress=False)
    call = pool.device_sized(torch.randn(8, 3, device="cuda"))
    assert call.mode == "host" and "does not pad" in call.reason
    x = torch.randn(8, 3, device="cuda")
    out = call(torch.tensor(5, device="cuda"), x)
    torch.testing.assert_close(out[:5], coupled(x[:5]))
    assert not out[5:].any()
    pool.close()


def test_a_call_object_dropped_at_once_finishes_its_dispatch_first(made):
    model, pool, _ = made
    x = torch.randn(64, 32, device="cuda")
    with torch.no_grad():
        out = pool.device_sized(x)(torch.tensor(9, device="cuda"), x).clone()  # the call object is collected here
        torch.cuda.synchronize()
        torch.testing.assert_close(out[:9], model(x[:9]), rtol=1e-5, atol=1e-5)


def test_a_closed_call_refuses(made):
    _, pool, _ = made
    x = torch.randn(64, 32, device="cuda")
    with torch.no_grad():
        call = pool.device_sized(x)
        call(torch.tensor(3, device="cuda"), x)
        call.close()
        with pytest.raises(RuntimeError, match="closed"):
            call(torch.tensor(3, device="cuda"), x)


def test_host_path_keeps_outputs_without_the_batch():
    _needs_device_launch()
    w = torch.randn(3, 5, device="cuda")

    def two(x):
        y = x @ w
        return y, y.sum()

    pool = gfxgraph.ShapeBucketPool(two, [4, 8], progress=False)
    call = pool.device_sized(torch.randn(8, 3, device="cuda"))
    assert call.mode == "host" and call.reason  # the sum couples rows: the pool does not pad it
    x = torch.randn(8, 3, device="cuda")
    y, total = call(torch.tensor(6, device="cuda"), x)
    torch.testing.assert_close(y[:6], x[:6] @ w)
    assert not y[6:].any()
    torch.testing.assert_close(total, (x[:6] @ w).sum())
    pool.close()
