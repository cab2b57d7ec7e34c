"""The padded-execution engine on a GPU: padding only where proven, the poisoned-replay check, state as in eager.

Each test drives real captures and replays: the row analysis decides from the trace of a bucket's first
run, the padding check replays the captured graph with poisoned padding rows, and a model that writes
state runs once per call in graphs of its exact size.
"""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from gfxgraph import ShapeBucketPool

pytestmark = pytest.mark.gpu


@torch.library.custom_op("gfxtest_gpu::rowmix_pointwise", mutates_args=(), tags=(torch.Tag.pointwise,))
def _rowmix_pointwise(x: torch.Tensor) -> torch.Tensor:
    return x + x.sum(dim=0, keepdim=True)  # tagged pointwise, yet every row reads every other one


@_rowmix_pointwise.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("gfxtest_gpu::opaque_rowmix", mutates_args=())
def _opaque_rowmix(x: torch.Tensor) -> torch.Tensor:
    return x + x.amax(dim=0, keepdim=True)  # an op the row analysis does not know


@_opaque_rowmix.register_fake
def _(x):
    return torch.empty_like(x)


class Counting(torch.nn.Module):
    """A row-independent MLP that counts how often its Python runs."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.net(x)


def test_a_row_independent_model_is_padded_checked_once_per_bucket_and_replayed():
    torch.manual_seed(0)
    m = Counting().cuda().eval()
    pool = ShapeBucketPool(m, [4, 8])
    sizes = [3, 3, 8, 5, 6, 3, 2, 7]
    runs = []
    with torch.no_grad():
        for n in sizes:
            before = m.runs
            x = torch.randn(n, 16, device="cuda")
            torch.testing.assert_close(pool(x), m.net(x), rtol=1e-4, atol=1e-5)
            runs.append(m.runs - before)
    # a bucket's first call: its own run + the capture (warmup_iters=1); bucket 8, first captured at its
    # exact size, runs the model once more on its first padded call (5 rows): that call's own run, which
    # answers it and is the padding check's reference; every other call: a replay
    assert runs == [2, 0, 2, 1, 0, 0, 0, 0]
    assert pool.captured_buckets == [4, 8] and not pool.unpadded
    assert all(e.confirmed for (b, _), e in pool._engine.entries.items())  # both buckets padded and checked
    buf = pool.static_inputs[0]
    assert torch.equal(buf[7:8], torch.zeros(1, 16, device="cuda"))  # the padding is clean after the checks


@pytest.mark.parametrize("model", [
    lambda x: x - x.mean(0),
    lambda x: (x - x.min(0).values) / (x.max(0).values - x.min(0).values),
    lambda x: x.topk(2, dim=0).values.sum(0) + x,
    lambda x: x - x.sort(0).values,
])
def test_a_row_coupled_model_gets_exact_size_graphs(model):
    pool = ShapeBucketPool(model, [4, 8])
    for n in (3, 5, 3, 6, 5):
        x = torch.rand(n, 4, device="cuda") + 1
        torch.testing.assert_close(pool(x), model(x))
    assert pool.unpadded[()].reason == "rows_coupled"
    assert pool.captured_buckets == [3, 5, 6]  # one graph per batch size, in the pool's memory


def test_the_padding_check_catches_coupling_the_trace_believed_away():
    op = torch.ops.gfxtest_gpu.rowmix_pointwise
    pool = ShapeBucketPool(lambda x: op(x) * 2, [8])
    for n in (5, 5, 3, 8):
        x = torch.randn(n, 4, device="cuda")
        torch.testing.assert_close(pool(x), (x + x.sum(0, keepdim=True)) * 2)
    why = pool.unpadded[()]
    assert why.reason == "padding_changes_results" and "NaN" in why.detail
    assert gfxgraph.stats()["fallback_reasons"]["padding_changes_results"] == 1


def test_an_op_the_trace_cannot_see_through_is_not_padded_unless_vouched_for():
    op = torch.ops.gfxtest_gpu.opaque_rowmix
    plain = ShapeBucketPool(op, [8])
    x = torch.randn(5, 4, device="cuda")
    torch.testing.assert_close(plain(x), op(x))
    assert plain.unpadded[()].reason == "unproven" and "opaque_rowmix" in plain.unpadded[()].detail
    vouched = ShapeBucketPool(op, [8], rows_independent=True)  # a wrong promise: the check still runs
    for n in (5, 3):
        x = torch.randn(n, 4, device="cuda") - 10
        torch.testing.assert_close(vouched(x), op(x))
    assert vouched.unpadded[()].reason == "padding_changes_results"


def test_a_batch_norm_in_training_mode_runs_once_per_call_like_eager():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).cuda().train()
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).cuda().train()
    ref.load_state_dict(m.state_dict())
    pool = ShapeBucketPool(m, [4, 8])
    with torch.no_grad():
        for n in (3, 5, 3, 2, 7, 6, 5):
            x = torch.randn(n, 8, device="cuda")
            torch.testing.assert_close(pool(x), ref(x), rtol=1e-4, atol=1e-5)
    assert m[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item() == 7
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)
    torch.testing.assert_close(m[1].running_var, ref[1].running_var)
    assert pool.unpadded[()].reason == "training_layers" and pool.stateful


def test_a_buffer_accumulator_is_found_stateful_and_equals_eager():
    class Acc(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total += x.sum(0)
            return x * 2

    m = Acc().cuda()
    pool = ShapeBucketPool(m, [4, 8])
    want = torch.zeros(4, device="cuda")
    for n in (3, 5, 3, 8, 2, 5):
        x = torch.randn(n, 4, device="cuda")
        torch.testing.assert_close(pool(x), x * 2)
        want += x.sum(0)
    torch.testing.assert_close(m.total, want)
    assert pool.stateful and pool.unpadded[()].reason == "stateful" and "'total'" in pool.unpadded[()].detail


def test_a_kv_cache_written_through_a_closure_equals_eager():
    cache = torch.zeros(8, 16, 4, device="cuda")
    ref = torch.zeros(8, 16, 4, device="cuda")
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    ref_pos = torch.zeros((), dtype=torch.long, device="cuda")

    def step(x, cache, pos):  # writes row `pos` of every sequence's cache, advances pos, attends over it
        n = x.shape[0]
        cache[:n].index_copy_(1, pos.view(1), x.unsqueeze(1))
        pos += 1
        return cache[:n].sum(1) + x

    pool = ShapeBucketPool(lambda x: step(x, cache, pos), [4, 8])
    for n in (3, 3, 5, 3, 8, 2):
        x = torch.randn(n, 4, device="cuda")
        torch.testing.assert_close(pool(x), step(x, ref, ref_pos))
        torch.testing.assert_close(cache, ref)
    assert pos.item() == ref_pos.item() == 6 and pool.stateful


def test_python_runs_per_call_follow_warmup_iters():
    for warmup, first in ((0, 1), (1, 2), (2, 3)):
        torch.manual_seed(0)
        m = Counting().cuda().eval()
        pool = ShapeBucketPool(m, [8], warmup_iters=warmup)
        with torch.no_grad():
            counts = []
            for n in (5, 5, 8, 3):
                before = m.runs
                x = torch.randn(n, 16, device="cuda")
                torch.testing.assert_close(pool(x), m.net(x), rtol=1e-4, atol=1e-5)
                counts.append(m.runs - before)
        # warmup_iters=0: the first call captures its exact size (nothing padded before the trace decides),
        # the second bucket 8 (its capture run, and its own run: the padding check's reference), later
        # calls replay
        expected = [first, 0, 0, 0] if warmup else [1, 2, 0, 0]
        assert counts == expected, (warmup, counts)


def test_zero_copy_calls_take_the_fast_path_after_the_check():
    torch.manual_seed(0)
    m = Counting().cuda().eval()
    pool = ShapeBucketPool(m, [8], copy_outputs=False)
    with torch.no_grad():
        pool(torch.randn(8, 16, device="cuda"))
        io = pool.static_io(5)
        for _ in range(3):
            x = torch.randn(5, 16, device="cuda")
            io.args[0].copy_(x)
            out = io.run()
            torch.testing.assert_close(out, m.net(x), rtol=1e-4, atol=1e-5)
    # the first call's own run and capture (bucket 8 at its exact size), the first padded call's own run
    # (the check's reference), then replays only; the zero-copy closure is installed
    assert io.fast is not None and m.runs == 3 and "run" in vars(io)


def test_a_transformers_decode_step_that_reads_its_positions_on_the_host_is_padded_by_its_graph():
    """transformers checks position_ids for packed sequences with a host read, skipped while a stream
    captures: the own run is unproven, the capture's own trace proves the graph row-independent."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()

    def step(ids, pos):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1, :]

    pool = ShapeBucketPool(step, [4, 8])
    with torch.no_grad():
        for n in (3, 5, 3, 7, 8):
            ids = torch.randint(0, 100, (n, 1), device="cuda")
            pos = torch.full((n, 1), 5, device="cuda")
            torch.testing.assert_close(pool(ids, pos), step(ids, pos), rtol=1e-4, atol=1e-4)
    assert not pool.unpadded and pool.captured_buckets == [4, 8]
