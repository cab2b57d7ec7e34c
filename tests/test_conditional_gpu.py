"""GPU tests of conditional execution (gap 51): every strategy against eager, no host sync on the
native path, WHILE loops that stop at the right iteration and at the cap, memory safety of bodies,
capture failures that fall back and leave the process working.

Run on the device with ``pytest -m gpu tests/test_conditional_gpu.py``. Native-node tests skip
with the probe's reason where the driver or binding lacks conditional nodes.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph, GraphState
from hipgraph_bridge.conditional.native_nodes import BodyPool, NativeConditional, side_stream
from hipgraph_bridge.conditional.support import conditional_support
from hipgraph_bridge.conditional import ConditionalGraph
from hipgraph_bridge.conditional.loop import DeviceWhileLoop, LoopCondition
from hipgraph_bridge.conditional.ops import conditional_select

pytestmark = pytest.mark.gpu

W = 32


def _support_or_skip(*, branches: bool = True, loops: bool = False):
    s = conditional_support()
    if (branches and not s.branches) or (loops and not s.while_loop):
        pytest.skip(f"native conditional nodes unavailable: {s.reason}")
    return s


@contextlib.contextmanager
def no_host_sync():
    """Any synchronising CUDA call in the block raises (PyTorch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(W, W, device="cuda", generator=g) / W ** 0.5 for _ in range(3)]


def make_branches(weights):
    w0, w1, w2 = weights

    def mlp(x):  # allocates intermediates: exercises the body pool
        return torch.tanh(x @ w0) @ w1 + 1.0

    def scale(x):
        return x * 3.0 - 0.5

    def gate(x):
        return torch.sigmoid(x @ w2) * x

    return [mlp, scale, gate]


def eager(fns, choice, x):
    if 0 <= choice < len(fns):
        with torch.no_grad():
            return fns[choice](x)
    return torch.zeros_like(x)


def build(fns, strategy="auto", **kwargs):
    cg = ConditionalGraph(strategy=strategy, **kwargs)
    for i, fn in enumerate(fns):
        cg.add_branch(f"b{i}", fn)
    return cg


STRATEGY_CASES = [
    pytest.param("native", None, id="native"),
    pytest.param("supergraph", None, id="supergraph"),
    pytest.param("supergraph", "ctypes", id="supergraph-ctypes-hip-path"),
    pytest.param("dispatch", None, id="dispatch"),
]


# ------------------------------------------------------------- branch strategies
@pytest.mark.parametrize("strategy,runtime", STRATEGY_CASES)
def test_index_selection_matches_eager_for_random_indices(strategy, runtime, weights):
    if strategy == "native":
        _support_or_skip()
    fns = make_branches(weights)
    x = torch.randn(8, W, device="cuda")
    cg = build(fns, strategy, runtime=runtime)
    cg.capture(x, selectors=("index",))
    assert cg.strategy == strategy, cg.strategy_reason
    gen = torch.Generator().manual_seed(1)
    choices = torch.randint(-1, 5, (24,), generator=gen).tolist() + [0, 1, 2, 3, -1]
    for choice in choices:
        xi = torch.randn(8, W, device="cuda")
        sel = torch.tensor(choice, device="cuda")
        out = cg.run(sel, xi)
        torch.testing.assert_close(out, eager(fns, choice, xi), rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"index {choice}: {m}")
    cg.close()


@pytest.mark.parametrize("strategy,runtime", STRATEGY_CASES)
def test_bool_selection_matches_eager_for_random_predicates(strategy, runtime, weights):
    if strategy == "native":
        _support_or_skip()
    fns = make_branches(weights)[:2]
    x = torch.randn(4, W, device="cuda")
    cg = build(fns, strategy, runtime=runtime)
    cg.capture(x, selectors=("bool",))
    assert cg.strategy == strategy, cg.strategy_reason
    preds = (torch.rand(20, generator=torch.Generator().manual_seed(2)) > 0.5).tolist() + [True, False]
    for pred in preds:
        xi = torch.randn(4, W, device="cuda")
        out = cg.run(torch.tensor(pred, device="cuda"), xi)
        torch.testing.assert_close(out, eager(fns, 0 if pred else 1, xi), rtol=1e-4, atol=1e-4)
    cg.close()


def test_runs_by_name_and_index_replay_per_branch_graphs(weights):
    fns = make_branches(weights)
    x = torch.randn(8, W, device="cuda")
    cg = build(fns)
    cg.capture(x)
    assert cg.failed_branches == {}
    before = gfxgraph.stats()["replay_count"]
    for i, fn in enumerate(fns):
        xi = torch.randn(8, W, device="cuda")
        torch.testing.assert_close(cg.run(f"b{i}", xi), eager(fns, i, xi), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cg.run(i, xi), eager(fns, i, xi), rtol=1e-4, atol=1e-4)
    assert gfxgraph.stats()["replay_count"] - before == 6
    assert gfxgraph.stats()["fallback_count"] == 0


def test_outputs_are_copies_unless_asked(weights):
    fns = make_branches(weights)[:2]
    x = torch.randn(2, W, device="cuda")
    cg = build(fns)
    cg.capture(x)
    first = cg.run("b1", x)
    cg.run("b1", torch.zeros_like(x))
    torch.testing.assert_close(first, eager(fns, 1, x))  # not overwritten by the second run
    static = build(fns, copy_outputs=False)
    static.capture(x)
    assert static.run("b1", x) is static.run("b1", x)


# ----------------------------------------------------------------- native: no sync
def test_native_selection_makes_no_host_sync(weights):
    _support_or_skip()
    fns = make_branches(weights)
    x = torch.randn(8, W, device="cuda")
    cg = build(fns, "native")
    cg.capture(x, selectors=("index", "bool") if len(fns) == 2 else ("index",))
    sels = torch.randint(-1, 4, (16,), device="cuda")  # drawn on the device: no host value
    inputs = [torch.randn(8, W, device="cuda") for _ in range(16)]
    with no_host_sync():
        outs = [cg.run(sels[k], inputs[k]) for k in range(16)]
    for k, out in enumerate(outs):
        torch.testing.assert_close(out, eager(fns, int(sels[k]), inputs[k]), rtol=1e-4, atol=1e-4)


def test_native_bool_selection_makes_no_host_sync(weights):
    _support_or_skip()
    fns = make_branches(weights)[:2]
    x = torch.randn(8, W, device="cuda")
    cg = build(fns, "native")
    cg.capture(x, selectors=("bool",))
    preds = torch.rand(12, device="cuda") > 0.5
    with no_host_sync():
        outs = [cg.run(preds[k], x) for k in range(12)]
    for k, out in enumerate(outs):
        torch.testing.assert_close(out, eager(fns, 0 if bool(preds[k]) else 1, x), rtol=1e-4, atol=1e-4)


def test_auto_picks_native_and_logs_it(weights, caplog):
    _support_or_skip()
    with caplog.at_level(logging.DEBUG, logger="gfxgraph"):
        cg = build(make_branches(weights))
        cg.capture(torch.randn(2, W, device="cuda"))
    assert cg.strategy == "native"
    assert "strategy native" in caplog.text


def test_native_body_memory_is_not_handed_to_other_tensors(weights):
    """Intermediates allocated inside bodies live in the body pool, so tensors allocated after
    capture never share their memory and are not overwritten by a replay."""
    _support_or_skip()
    fns = make_branches(weights)
    x = torch.randn(64, W, device="cuda")
    cg = build(fns, "native")
    cg.capture(x, selectors=("index",))
    body_pool = cg._device_graphs["index"].body_pool
    assert body_pool.routes
    pool_segments = [s for s in torch.cuda.memory_snapshot()
                     if tuple(s.get("segment_pool_id", (0, 0))) == tuple(body_pool.pool_id)]
    assert pool_segments, "the bodies' intermediates did not go to the body pool"
    canaries = [torch.full((64, W), 7.0, device="cuda") for _ in range(64)]
    for choice in (0, 2, 0, 1):
        out = cg.run(torch.tensor(choice, device="cuda"), x)
        torch.testing.assert_close(out, eager(fns, choice, x), rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    assert all(bool((c == 7.0).all()) for c in canaries)


# ---------------------------------------------------------- capture failures
def test_branch_whose_capture_fails_runs_eagerly_and_the_next_capture_works(weights):
    fns = make_branches(weights)

    def syncs(x):
        return x * float(x.sum().item() != 0.0)  # a host read: illegal while capturing

    cg = build([fns[0], syncs, fns[1]])
    x = torch.randn(4, W, device="cuda")
    cg.capture(x, selectors=("index",))
    assert set(cg.failed_branches) == {"b1"} and "capture_failed" in cg.failed_branches["b1"]
    torch.testing.assert_close(cg.run("b1", x), syncs(x))
    assert gfxgraph.stats()["fallback_reasons"]["capture_failed"] >= 1
    # the device path cannot hold a syncing branch: it fell back to dispatch, still correct
    for choice in (0, 1, 2):
        torch.testing.assert_close(cg.run(torch.tensor(choice, device="cuda"), x),
                                   [fns[0], syncs, fns[1]][choice](x), rtol=1e-4, atol=1e-4)
    assert cg.strategy in ("dispatch", "native")
    # the process is fine: a new capture works
    ok = build(fns)
    ok.capture(x)
    torch.testing.assert_close(ok.run(2, x), eager(fns, 2, x), rtol=1e-4, atol=1e-4)


def test_native_body_that_raises_is_discarded_cleanly(weights):
    _support_or_skip()
    x = torch.randn(4, W, device="cuda")
    outputs = torch.zeros(4, W, device="cuda")
    sel = torch.zeros((), dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    body_stream = side_stream(0, avoid=[stream])
    pool = BodyPool(0)
    native = NativeConditional(device=0, body_stream=body_stream, pool=pool)

    def bad():
        raise ZeroDivisionError("inside a body")

    g = BridgedCUDAGraph()
    with pytest.raises(ZeroDivisionError), g.capturing(stream=stream):
        native.switch(sel, [lambda: outputs.copy_(x), bad])
    assert g.state is GraphState.FAILED and "ZeroDivisionError" in g.failure_reason
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(body_stream):
        assert not torch.cuda.is_current_stream_capturing()
    # both streams work again, eagerly and under capture
    y = x * 2
    g2 = BridgedCUDAGraph()
    with torch.cuda.graph(g2, stream=stream):
        z = y + 1
    g2.replay()
    torch.testing.assert_close(z, x * 2 + 1)


# -------------------------------------------------------------------- loops
def counting_body(i, x):
    x.mul_(0.5).add_(1.0)
    i.add_(1)


def eager_loop(cond, body, state, max_iters):
    state = tuple(t.clone() for t in state)
    done = 0
    with torch.no_grad():
        while done < max_iters and bool(cond(*state)):
            new = body(*state)
            if new is not None:
                state = tuple(new)
            done += 1
    return state, done


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_while_stops_at_a_data_dependent_iteration(strategy):
    if strategy == "native":
        _support_or_skip(branches=False, loops=True)
    state = (torch.zeros((), dtype=torch.int64, device="cuda"), torch.randn(256, device="cuda"))
    loop = DeviceWhileLoop(LoopCondition(0, "<", 40), counting_body, state, max_iters=1000, strategy=strategy)
    loop.capture()
    assert loop.strategy == strategy, loop.strategy_reason
    gen = torch.Generator().manual_seed(3)
    for limit in torch.randint(0, 41, (10,), generator=gen).tolist() + [0, 40]:
        start = torch.tensor(40 - limit, dtype=torch.int64, device="cuda")  # runs `limit` iterations
        x_start = torch.randn(256, device="cuda")
        i, x = loop.run(start, x_start)
        (ref_i, ref_x), n = eager_loop(lambda a, b: a < 40, counting_body, (start, x_start), 1000)
        assert int(loop.iterations) == n == limit
        assert int(i) == int(ref_i) == 40
        torch.testing.assert_close(x, ref_x)


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_while_stops_at_the_cap(strategy):
    if strategy == "native":
        _support_or_skip(branches=False, loops=True)
    state = (torch.zeros((), dtype=torch.int64, device="cuda"), torch.ones(16, device="cuda"))
    loop = DeviceWhileLoop(LoopCondition(0, "<", 10_000), counting_body, state, max_iters=17, strategy=strategy)
    i, x = loop.run()
    assert int(i) == 17 and int(loop.iterations) == 17
    (ref_i, ref_x), _ = eager_loop(lambda a, b: a < 10_000, counting_body, state, 17)
    torch.testing.assert_close(x, ref_x)
    zero = DeviceWhileLoop(LoopCondition(0, "<", 5), counting_body, state, max_iters=0, strategy=strategy)
    assert int(zero.run()[0]) == 0 and int(zero.iterations) == 0


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_while_with_cond_fn_on_values_and_a_functional_body(strategy):
    if strategy == "native":
        _support_or_skip(branches=False, loops=True)

    def cond(n, v):
        return v.abs().sum() < 1000.0  # data-dependent on the values

    def body(n, v):
        return n + 1, v * 1.7 + 0.1

    gen = torch.Generator(device="cuda").manual_seed(4)
    state = (torch.zeros((), dtype=torch.int32, device="cuda"), torch.randn(64, device="cuda", generator=gen))
    loop = DeviceWhileLoop(cond, body, state, max_iters=500, strategy=strategy)
    for _ in range(3):
        start = (torch.zeros((), dtype=torch.int32, device="cuda"), torch.randn(64, device="cuda", generator=gen))
        n, v = loop.run(*start)
        (ref_n, ref_v), done = eager_loop(cond, body, start, 500)
        assert int(n) == int(ref_n) == int(loop.iterations) == done > 0
        torch.testing.assert_close(v, ref_v)


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_loop_captures_again_after_close_in_a_fresh_pool(strategy):
    """close() releases every graph of the loop's pool, which PyTorch's allocator then refuses to
    capture into: the next run captures through a fresh capturer and pool."""
    if strategy == "native":
        _support_or_skip(branches=False, loops=True)
    state = (torch.zeros((), dtype=torch.int64, device="cuda"), torch.ones(8, device="cuda"))
    loop = DeviceWhileLoop(LoopCondition(0, "<", 5), counting_body, state, strategy=strategy)
    pools = []
    for _ in range(3):
        i, x = loop.run(*state)
        assert loop.strategy == strategy, loop.strategy_reason
        (ref_i, ref_x), _ = eager_loop(lambda a, b: a < 5, counting_body, state, 1000)
        assert int(i) == 5 and torch.equal(x, ref_x)
        pools.append(loop._capturer.pool_handle)
        loop.close()
        assert loop.strategy == "pending"
    assert len(set(pools)) == 3
    assert gfxgraph.stats()["fallback_count"] == 0


def test_native_while_makes_no_host_sync():
    _support_or_skip(branches=False, loops=True)
    state = (torch.zeros((), dtype=torch.int64, device="cuda"), torch.randn(128, device="cuda"))
    loop = DeviceWhileLoop(LoopCondition(0, "<", 64), counting_body, state, max_iters=1000, strategy="native")
    loop.capture()
    starts = [torch.randint(0, 64, (), device="cuda") for _ in range(6)]
    xs = [torch.randn(128, device="cuda") for _ in range(6)]
    results = []
    with no_host_sync():
        for s, xv in zip(starts, xs):
            results.append((loop.run(s, xv), loop.iterations.clone()))
    for s, xv, ((i, x), iters) in zip(starts, xs, results):
        (ref_i, ref_x), n = eager_loop(lambda a, b: a < 64, counting_body, (s, xv), 1000)
        assert int(i) == 64 and int(iters) == n
        torch.testing.assert_close(x, ref_x)


def test_loop_whose_capture_fails_runs_eagerly():
    def body(i, x):
        if float(x.sum().item()) > -1e30:  # a host read inside the body
            x.add_(1.0)
        i.add_(1)

    state = (torch.zeros((), dtype=torch.int64, device="cuda"), torch.zeros(8, device="cuda"))
    loop = DeviceWhileLoop(LoopCondition(0, "<", 4), body, state)
    i, x = loop.run()
    assert loop.strategy == "eager" and "capture failed" in loop.strategy_reason
    assert int(i) == 4 and torch.equal(x, torch.full((8,), 4.0, device="cuda"))
    assert gfxgraph.stats()["fallback_reasons"]["capture_failed"] >= 1
    ok = DeviceWhileLoop(LoopCondition(0, "<", 4), counting_body, state)
    assert int(ok.run()[0]) == 4 and ok.strategy in ("native", "host")


# -------------------------------------------------------------- the seed's API
def test_bridged_graph_capture_with_branches_replays_by_branch(weights):
    fns = make_branches(weights)
    x = torch.randn(8, W, device="cuda")
    g = BridgedCUDAGraph()
    with g.capture(conditional_branches={"mlp": fns[0], "scale": fns[1], "gate": fns[2]}, example_input=x) as cap:
        pass
    assert cap.mode == "graph"
    for name, fn in zip(("mlp", "scale", "gate"), fns):
        xi = torch.randn(8, W, device="cuda")
        torch.testing.assert_close(g.replay(branch=name, input_tensor=xi), fn(xi), rtol=1e-4, atol=1e-4)
    xi = torch.randn(8, W, device="cuda")
    torch.testing.assert_close(g.replay(branch=torch.tensor(2, device="cuda"), input_tensor=xi), fns[2](xi),
                               rtol=1e-4, atol=1e-4)
    g.reset()


# --------------------------------------------------------------------- the op
def test_conditional_select_on_cuda_in_a_graph_and_compiled():
    a, b = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    pred = torch.tensor(True, device="cuda")
    assert torch.equal(conditional_select(pred, a, b), a)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        conditional_select(pred, a, b)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, stream=s):
        out = conditional_select(pred, a * 2, b)
    for value in (False, True, False):
        pred.fill_(value)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, a * 2 if value else b)

    def f(p, x, y):
        return torch.ops.gfxgraph.conditional_select(p, x.sin(), y.cos())

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(pred, a, b), f(pred, a, b))
