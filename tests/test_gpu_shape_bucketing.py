"""ShapeBucketPool on a GPU: every size equals eager, failures stay local, memory is shared."""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from gfxgraph import ShapeBucketPool

pytestmark = pytest.mark.gpu


def test_every_size_bitwise_equal_for_a_deterministic_model():
    def model(x):
        return torch.sin(x) * 2 + x.square()

    pool = ShapeBucketPool(model, [1, 2, 4, 8, 16, 32, 64])
    for n in range(1, 65):
        x = torch.randn(n, 33, device="cuda")
        assert torch.equal(pool(x), model(x)), n
    assert pool.captured_buckets == [1, 2, 4, 8, 16, 32, 64]
    assert gfxgraph.stats()["fallback_count"] == 0


def test_mlp_all_sizes_up_to_256_match_eager():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    pool = ShapeBucketPool(mlp)  # default buckets up to 256
    report = pool.capture_all(torch.randn(3, 64, device="cuda"))
    assert report["captured"] == len(pool.buckets) and report["pool_bytes"] > 0
    with torch.no_grad():
        for n in range(1, 257):
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(pool(x), mlp(x), rtol=1e-4, atol=1e-5)
    from hipgraph_bridge import graph_pool_bytes

    assert pool.pool_bytes() == graph_pool_bytes([pool.pool_handle]) > 0


def test_multi_input_multi_output_kwargs():
    torch.manual_seed(1)
    w = torch.randn(16, 16, device="cuda")

    def model(x, pos, *, bias, scale=1.0):
        h = (x @ w + bias) * scale
        return {"h": h, "pos2": pos * 2}, h.mean()

    pool = ShapeBucketPool(model, [4, 8, 16], static_args=["bias"])
    bias = torch.randn(16, device="cuda")
    for n in (1, 3, 8, 13, 16):
        x, pos = torch.randn(n, 16, device="cuda"), torch.arange(n, device="cuda")
        (got, got_mean) = pool(x, pos, bias=bias, scale=0.5)
        (want, want_mean) = model(x, pos, bias=bias, scale=0.5)
        torch.testing.assert_close(got["h"], want["h"])
        assert torch.equal(got["pos2"], want["pos2"])
        # h.mean() reduces over the batch: the first call's trace finds it, so nothing is ever padded:
        # each batch size gets a graph of exactly its rows
        torch.testing.assert_close(got_mean, want_mean)
    key = (0.5,)  # the constant argument scale=0.5 is the key
    assert pool.unpadded[key].reason == "rows_coupled" and "aten.mean" in pool.unpadded[key].detail
    assert pool.captured_buckets == [1, 3, 8, 13, 16]
    assert gfxgraph.stats()["fallback_reasons"] == {"rows_coupled": 1}


def test_failing_bucket_runs_eagerly_and_the_rest_keep_working():
    def model(x):
        if x.shape[0] == 8:
            x.sum().item()  # a host sync: capture of this bucket fails
        return x * 3

    pool = ShapeBucketPool(model, [4, 8, 16])
    for n in (2, 6, 12, 7, 3):
        x = torch.randn(n, 5, device="cuda")  # random ops work after the failed capture
        assert torch.equal(pool(x), x * 3)
    assert pool.captured_buckets == [4, 16]
    assert list(pool.failed_buckets) == [8] and "capture" in pool.failed_buckets[8]
    snap = gfxgraph.stats()
    assert snap["fallback_reasons"]["capture_failed"] == 2  # sizes 6 and 7
    assert not torch.cuda.is_current_stream_capturing()


def test_outputs_survive_the_next_call_and_views_on_request():
    pool = ShapeBucketPool(lambda x: x + 1, [8])
    a = pool(torch.zeros(5, 2, device="cuda"))
    b = pool(torch.ones(5, 2, device="cuda"))
    assert torch.equal(a, torch.ones(5, 2, device="cuda")) and torch.equal(b, torch.full((5, 2), 2.0, device="cuda"))
    fast = ShapeBucketPool(lambda x: x + 1, [8], copy_outputs=False)
    a = fast(torch.zeros(5, 2, device="cuda"))
    ptr = a.data_ptr()
    b = fast(torch.ones(5, 2, device="cuda"))
    assert b.data_ptr() == ptr  # documented: views of the static output, overwritten by the next call
    assert torch.equal(a, b)


def test_capture_all_is_largest_first_and_shares_one_pool():
    seen = []
    w = torch.randn(16, 16, device="cuda")

    def model(x):
        seen.append(x.shape[0])
        return torch.relu(x @ w)

    pool = ShapeBucketPool(model, [2, 8, 32], warmup_iters=1, progress=False)
    pool.capture_all(torch.randn(2, 16, device="cuda"))
    captured_order = [n for n in seen if n in (2, 8, 32)]
    assert captured_order[:2] == [32, 32] and captured_order.index(8) < captured_order.index(2)
    assert pool.pool_bytes() > 0
    x = torch.randn(5, 16, device="cuda")
    torch.testing.assert_close(pool(x), torch.relu(x @ w))


def test_vram_cap_sends_buckets_to_eager():
    pool = ShapeBucketPool(lambda x: x * 2, [4, 8], vram_cap=1e-6)
    x = torch.randn(3, 4, device="cuda")
    assert torch.equal(pool(x), x * 2)
    assert pool.captured_buckets == [] and pool.failed_buckets[4].startswith("vram_cap")
    assert gfxgraph.stats()["fallback_reasons"]["vram_cap"] == 1


def test_random_ops_differ_per_call_like_eager():
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)

    def model(x):
        return x + torch.rand(x.shape, device=x.device) + torch.rand(x.shape, device=x.device, generator=gen)

    pool = ShapeBucketPool(model, [4], generators=[gen])
    x = torch.zeros(4, 8, device="cuda")
    a, b = pool(x), pool(x)
    assert not torch.equal(a, b)
    assert ((a >= 0) & (a < 2)).all()


def test_wrong_device_and_seed_path():
    pool = ShapeBucketPool(lambda x: x, [4])
    with pytest.raises(ValueError, match="expected a tensor on a CUDA device"):
        pool(torch.ones(2, 2))
    g = gfxgraph.BridgedCUDAGraph()
    model = lambda x: x * 5  # noqa: E731
    with g.capture(dynamic_shapes=True, model_fn=model, buckets=[2, 4, 8],
                   example_input=torch.ones(2, 3, device="cuda")) as session:
        pass
    assert session.pool.captured_buckets == [2, 4, 8]
    x = torch.randn(6, 3, device="cuda")
    assert torch.equal(g.replay(input_tensor=x), x * 5)
    # batch_size alone replays bucket(5) = 8 on what is in the static input (x's rows + padding)
    out = g.replay(batch_size=5)
    assert torch.equal(out, x[:5] * 5)


def test_thread_local_capture_mode():
    pool = ShapeBucketPool(lambda x: x.exp(), [4, 8], capture_error_mode="thread_local")
    x = torch.randn(7, 3, device="cuda")
    torch.testing.assert_close(pool(x), x.exp())


def test_released_outputs_stay_correct_in_random_order_and_save_memory():
    import random

    torch.manual_seed(2)
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128)).cuda()
    buckets = [8, 16, 32, 48, 64, 96, 128]
    pool = ShapeBucketPool(mlp, buckets, progress=False)
    pool.capture_all(torch.randn(4, 128, device="cuda"))
    rng = random.Random(0)
    with torch.no_grad():
        held = []
        for _ in range(60):
            n = rng.randint(1, 128)
            x = torch.randn(n, 128, device="cuda")
            held.append((x, pool(x)))
        for x, y in held:  # copies made right after each replay are unaffected by later ones
            torch.testing.assert_close(y, mlp(x), rtol=1e-4, atol=1e-5)
    alone = ShapeBucketPool(mlp, [128], progress=False)
    alone.capture_all(torch.randn(4, 128, device="cuda"))
    assert pool.pool_bytes() <= 1.5 * alone.pool_bytes(), (pool.pool_bytes(), alone.pool_bytes())


class _Stepper(torch.nn.Module):
    """A model with state each run advances (as a KV cache's write position)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device="cuda"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return x * self.steps


@pytest.mark.parametrize("warmup_iters,runs_first_call", [(1, 1), (0, 1)])  # stateful: at most 1
def test_model_runs_once_per_call_its_first_included(warmup_iters, runs_first_call):
    m = _Stepper()
    pool = ShapeBucketPool(m, [4, 8], warmup_iters=warmup_iters, stateful=True)
    x = torch.ones(4, 2, device="cuda")
    torch.testing.assert_close(pool(x), x * runs_first_call)  # the first call's own result
    assert int(m.steps) == runs_first_call
    for k in range(1, 8):
        n = (4, 8, 3)[k % 3]  # bucket 4 replays, bucket 8 captures on its first use, 3 rows get a graph of 3
        before = int(m.steps)
        out = pool(torch.ones(n, 2, device="cuda"))
        first_use = (n == 8 and k == 1) or (n == 3 and k == 2)
        after = before + (runs_first_call if first_use else 1)
        assert int(m.steps) == after
        torch.testing.assert_close(out, torch.full((n, 2), float(after), device="cuda"))
    assert pool.captured_buckets == [3, 4, 8] and gfxgraph.stats()["fallback_count"] == 0


def test_a_stateful_first_call_whose_capture_differs_returns_its_warm_up_run():
    m = _Stepper()
    runs = []

    def model(x):
        runs.append(1)
        return m(x), len(runs)  # the int differs between warm-up and capture: the warm-up cannot be reused
    pool = ShapeBucketPool(model, [4], stateful=True)
    y, n = pool(torch.ones(4, 2, device="cuda"))
    assert int(m.steps) == 1 and n == 1  # the warm-up run, not a replay (which would step again)
    torch.testing.assert_close(y, torch.ones(4, 2, device="cuda"))
    y, _ = pool(torch.ones(4, 2, device="cuda"))
    assert int(m.steps) == 2 and pool.captured_buckets == [4]


def test_a_stateful_model_that_raises_is_run_once():
    m = _Stepper()

    def model(x):
        m(x)
        raise RuntimeError("cache full")

    pool = ShapeBucketPool(model, [4], stateful=True)
    with pytest.raises(RuntimeError, match="cache full"):
        pool(torch.ones(4, 2, device="cuda"))
    assert int(m.steps) == 1 and not pool.failed_buckets  # not re-run on the caller's arguments


def test_capture_all_runs_the_warmups_then_calls_run_once():
    m = _Stepper()
    pool = ShapeBucketPool(m, [2, 4], stateful=True, progress=False)
    pool.capture_all(torch.ones(2, 3, device="cuda"))
    assert int(m.steps) == 2  # one warm-up per bucket: a model with state resets after capture_all
    m.steps.zero_()
    for k in range(1, 4):
        out = pool(torch.ones(k, 3, device="cuda"))
        torch.testing.assert_close(out, torch.full((k, 3), float(k), device="cuda"))
    assert int(m.steps) == 3


def test_a_capture_that_fails_after_warm_up_returns_the_warm_up_run():
    class Refuses(_Stepper):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("not capturable")
            return out

    m = Refuses()
    pool = ShapeBucketPool(m, [4], batched_outputs=(True,))
    x = torch.ones(4, 2, device="cuda")
    torch.testing.assert_close(pool(x), x)  # the warm-up's result, not a second (eager) run
    assert int(m.steps) == 1 and pool.failed_buckets
    torch.testing.assert_close(pool(x), x * 2)  # later calls run eagerly, once each
    assert int(m.steps) == 2


def test_a_row_coupled_model_never_returns_a_padded_result():
    def model(x):
        return x - x.mean(0), torch.nn.functional.batch_norm(x, None, None, training=True)

    pool = ShapeBucketPool(model, [8])
    for n in (5, 8, 3, 8, 7):
        x = torch.randn(n, 6, device="cuda")
        for got, want in zip(pool(x), model(x)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert pool.captured_buckets == [3, 5, 7, 8] and pool.row_coupled  # exact sizes: never a padded result
    assert gfxgraph.stats()["fallback_reasons"] == {"rows_coupled": 1}  # found once, by the trace


def test_one_bucket_does_not_take_a_fixed_size_output_for_a_batch():
    table = torch.arange(4.0, device="cuda")

    def model(x):
        return x * 2, table * x.sum()

    pool = ShapeBucketPool(model, [4])
    x = torch.ones(3, 5, device="cuda")
    y, t = pool(x)
    assert y.shape == (3, 5) and t.shape == (4,)
    torch.testing.assert_close(t, table * 15)


def test_inputs_that_require_grad_run_eagerly_and_backward_works():
    lin = torch.nn.Linear(4, 3).cuda()
    pool = ShapeBucketPool(lin, [4, 8])
    x = torch.randn(5, 4, device="cuda", requires_grad=True)
    pool(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    assert gfxgraph.stats()["fallback_reasons"]["grad"] == 1 and pool.captured_buckets == []
    with torch.no_grad():
        torch.testing.assert_close(pool(x), lin(x))
    assert pool.captured_buckets == [8]


def test_a_bad_first_call_raises_the_models_own_error_and_poisons_nothing():
    lin = torch.nn.Linear(4, 2).cuda()
    pool = ShapeBucketPool(lin, [8])
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="3x5"):  # the caller's shape, not the padded 8x5
            pool(torch.ones(3, 5, device="cuda"))
        x = torch.randn(3, 4, device="cuda")
        torch.testing.assert_close(pool(x), lin(x))
    assert pool.captured_buckets == [8] and not pool.failed_buckets


def test_a_stateful_model_runs_once_per_call_and_is_never_padded():
    counter = torch.zeros((), device="cuda")

    def step(x):
        counter.add_(1)  # state the model keeps
        return x * 2

    gfxgraph.enable(validate=True)  # validation would run it twice: a stateful model is exempt
    pool = ShapeBucketPool(step, [4], stateful=True)
    for n in (4, 4, 3, 4):
        torch.testing.assert_close(pool(torch.ones(n, 2, device="cuda")), torch.full((n, 2), 2.0, device="cuda"))
    assert int(counter) == 4
    assert pool.captured_buckets == [3, 4] and gfxgraph.stats()["fallback_count"] == 0  # 3 rows: its own graph
