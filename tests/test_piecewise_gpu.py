"""Piecewise graphs in the ``gfxgraph`` compile backend on a GPU: eager results at many sequence
lengths, piece graphs replayed from one pool, decode through the full graph, a static KV cache."""

from __future__ import annotations


import pytest
import torch
import torch._dynamo

import gfxgraph
from hipgraph_bridge import compile as cb
from hipgraph_bridge.compile import SubgraphState, backend_stats

from _piecewise_models import BEFORE, SEEN, CachedAttention, TinyLM, frames, fresh_dynamo  # noqa: F401 (autouse)

pytestmark = pytest.mark.gpu
cb.register()  # also when the tests run from a checkout that is not installed (no entry points)
TOL = {torch.float32: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=5e-2, atol=1e-1)}
LENGTHS = [5, 37, 2, 100, 64, 129, 17, 255, 3, 500, 64, 8, 300, 31, 512, 77]
MIXED = [(2, 9), (3, 40), (2, 100), (4, 17), (3, 64), (2, 9), (4, 200)]  # (batch, length)


def model(dtype: torch.dtype, **kw) -> TinyLM:
    return TinyLM(d=256, heads=4, layers=3, vocab=512, **kw).cuda().to(dtype).eval()


def inputs(n: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(n * 131 + batch)
    ids = torch.randint(0, 512, (batch, n), device="cuda", generator=g)
    return ids, torch.arange(n, device="cuda").expand(batch, n)


def run(c, m, lengths, dtype, batch: int = 1) -> None:
    with torch.no_grad():
        for n in lengths:
            ids, pos = inputs(n, batch)
            torch.testing.assert_close(c(ids, pos), m(ids, pos), **TOL[dtype], msg=f"{n} tokens, batch {batch}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_many_lengths_equal_eager_and_replay_piece_graphs(dtype):
    m = model(dtype)
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True})
    run(c, m, LENGTHS, dtype)
    (frame,) = frames()
    assert frame.state is SubgraphState.GRAPHED and frame.compiler == "inductor"
    assert [p.status() for p in frame.pieces] == ["graphed"] * 4, frame.report()
    assert frame.buckets[-1] in frame.captured_buckets  # the largest bucket went first
    first = backend_stats()["piecewise"]
    assert first["piece_captures"] >= 4 * 8 and first["piece_replays"] > 0 and first["piece_eager_runs"] == 0
    assert first["pool_bytes"] > 0 and first["capture_seconds"] > 0 and first["largest_first_seconds"] > 0
    assert first["graphs"] == sum(p.graph_count() for p in frame.pieces)
    assert frame.env.capturer is not None and frame.env.capturer.pool_handle is not None  # one pool, every piece
    run(c, m, LENGTHS[::-1], dtype)  # again: every graph replays, none is captured
    again = backend_stats()["piecewise"]
    assert again["piece_captures"] == first["piece_captures"], (first, again)
    assert again["piece_replays"] >= first["piece_replays"] + 4 * (len(LENGTHS) - 1)
    assert gfxgraph.stats()["replay_count"] >= again["piece_replays"]


def test_attention_runs_on_the_real_shapes_between_graphed_pieces():
    m = model(torch.float32, attn="custom")
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True, "splitting_ops": ["gfxtest::attn"]})
    with torch.no_grad():
        for n in (5, 37, 100, 3, 200):
            ids, pos = inputs(n)
            want = m(ids, pos)
            SEEN.clear()
            torch.testing.assert_close(c(ids, pos), want, **TOL[torch.float32])
            # the call's own three layers on its n rows, after (on the first piecewise call) the capture
            # of the largest bucket, which runs the model on 512 padded rows
            assert SEEN[-3:] == [(1, 4, n, 64)] * 3 and set(SEEN) <= {(1, 4, n, 64), (1, 4, 512, 64)}, SEEN
    assert all(p.status() == "graphed" and p.captured_buckets for p in frames()[0].pieces)


def test_mixed_batches_and_lengths_equal_eager():
    m = model(torch.bfloat16)
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True})
    with torch.no_grad():
        for b, n in MIXED:
            ids, pos = inputs(n, b)
            torch.testing.assert_close(c(ids, pos), m(ids, pos), **TOL[torch.bfloat16], msg=f"batch {b}, {n}")
    frame = next(f for f in frames() if len(f._variants) > 1)
    assert all(p.status() == "graphed" for p in frame.pieces)


def test_mixed_batches_capture_once_per_batch_and_bucket_and_replay_when_both_repeat():
    """A piece graph's key is (token bucket, batch size), and the stream's first call is a frame of its own.

    Dynamo compiles the first (2, 9) with static sizes (no token count: served whole, ``full``) and
    (3, 40) as a frame with batch and length dynamic; the second (2, 9) lands in that frame, where
    (bucket 16, batch 2) is new: it captures. No (bucket, batch) repeats within the piecewise frame,
    so the first pass replays no piece (as the 2026-12-01 run saw); the same stream again replays
    every piece on every call and captures nothing. The CPU twin runs this on simulated graphs.
    """
    m = model(torch.bfloat16)
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True})
    with torch.no_grad():
        for b, n in MIXED:
            c(*inputs(n, b))
    (frame,) = frames()
    first = frame.report()
    (whole,) = [s for s in cb.compiled_subgraphs() if s not in BEFORE and getattr(s, "role", "") == "full"]
    assert whole.calls == 1 and first["calls"]["piecewise"] == 6, first  # the first (2, 9): a static frame
    keys = [(16, 2), (24, 4), (40, 3), (64, 3), (112, 2), (224, 4), (512, 3)]  # 512: the largest, first
    assert all(sorted(p.entries) == keys for p in frame.pieces), [sorted(p.entries) for p in frame.pieces]
    assert first["piece_replays"] == 0 and first["piece_captures"] == 4 * len(keys), first
    with torch.no_grad():
        for b, n in MIXED:  # every call meets its key now, (2, 9) too: dynamo tries the frame it used last first
            ids, pos = inputs(n, b)
            torch.testing.assert_close(c(ids, pos), m(ids, pos), **TOL[torch.bfloat16], msg=f"batch {b}, {n}")
    again = frame.report()
    assert again["calls"]["piecewise"] == 6 + len(MIXED) and whole.calls == 1, again
    assert again["piece_captures"] == first["piece_captures"] and again["piece_replays"] == 4 * len(MIXED), again
    assert again["piece_eager_runs"] == 0


def test_decode_takes_the_full_graph():
    m = model(torch.bfloat16)
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True})
    run(c, m, [9, 33, 1, 1, 1, 1, 70, 1], torch.bfloat16)
    full = [s for s in cb.compiled_subgraphs() if s not in BEFORE and getattr(s, "role", "") == "full"
            and s.state is SubgraphState.GRAPHED]  # the frame dynamo compiled for one token
    assert len(full) == 1 and full[0].plan.static and full[0].captured_buckets == [1], full
    stats = backend_stats()["piecewise"]
    assert stats["calls"]["full"] >= 5 and stats["calls"]["piecewise"] >= 2
    replays = gfxgraph.stats()["replay_count"]
    run(c, m, [1, 1], torch.bfloat16)
    assert gfxgraph.stats()["replay_count"] >= replays + 2  # the decode graph replays


def test_static_kv_cache_written_inside_a_piece_stays_right():
    dtype = torch.float32
    m = CachedAttention(d=64, max_len=256, device="cuda", dtype=dtype).eval()
    ref = CachedAttention(d=64, max_len=256, device="cuda", dtype=dtype).eval()
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True, "token_buckets": [8, 16, 32, 64]})
    with torch.no_grad():
        for prompt in (13, 16, 5, 32, 16, 40):
            for cache in (m.k_cache, m.v_cache, ref.k_cache, ref.v_cache):
                cache.zero_()
            for step, n in enumerate([prompt, 1, 1, 1]):
                start = 0 if step == 0 else prompt + step - 1
                x = torch.randn(1, n, 64, device="cuda", dtype=dtype)
                pos = torch.arange(start, start + n, device="cuda")
                torch.testing.assert_close(c(x, pos), ref(x, pos), **TOL[dtype], msg=f"prompt {prompt} step {step}")
                torch.testing.assert_close(m.k_cache, ref.k_cache, **TOL[dtype])
                torch.testing.assert_close(m.v_cache, ref.v_cache, **TOL[dtype])
    writer = next(p for f in frames() for p in f.pieces if p.stateful)
    assert writer.status() == "unpadded: stateful"
    assert set(writer.captured_buckets) <= {16, 32} and writer.captured_buckets  # only where n was a bucket
    assert gfxgraph.stats()["fallback_reasons"].get("stateful", 0) >= 2


def test_validate_mode_compares_every_piece_on_the_gpu():
    m = model(torch.float32)
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True})
    gfxgraph.enable(validate=True)
    try:
        run(c, m, [5, 37, 100, 37], torch.float32)
    finally:
        gfxgraph.disable()
    snap = gfxgraph.stats()
    assert snap["validation_checks"] >= 4 * 3 and snap["validation_failures"] == 0, snap


def test_a_reduction_over_the_sequence_runs_unpadded_on_the_gpu():
    m = model(torch.float32, extra="seq_mean")
    c = torch.compile(m, backend="gfxgraph", options={"piecewise": True})
    run(c, m, [5, 37, 100, 7], torch.float32)
    (frame,) = frames()
    assert [p.status() for p in frame.pieces][-1] == "unpadded: rows_coupled"
    assert all(p.status() == "graphed" for p in frame.pieces[:-1])
