"""BridgedCUDAGraph on a GPU: drop-in behaviour of every PyTorch API, and the high-level API."""

from __future__ import annotations

import os

import pytest
import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph, GraphCaptureError, GraphState

pytestmark = pytest.mark.gpu


def _side_stream() -> torch.cuda.Stream:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    return s


def test_low_level_capture_replay_matches_eager_and_counts():
    x = torch.randn(256, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    s = _side_stream()
    with torch.cuda.stream(s):
        y = torch.relu(x @ w)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = BridgedCUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin()
        y = torch.relu(x @ w)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    assert g.state is GraphState.READY
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.testing.assert_close(y, torch.relu(x @ w), rtol=0, atol=0)
    snap = gfxgraph.stats()
    assert snap["capture_count"] == 1 and snap["replay_count"] == 5
    for _ in range(32):  # one replay in REPLAY_SAMPLE_EVERY is timed
        g.replay()
    snap = gfxgraph.stats()
    assert snap["replay_count"] == 37 and snap["replay_samples"] >= 2
    assert snap["replay_us_p50"] > 0


def test_torch_cuda_graph_with_shared_pool_and_enable():
    gfxgraph.enable()
    x = torch.ones(1024, device="cuda")
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    assert isinstance(g1, BridgedCUDAGraph)
    s = torch.cuda.Stream()
    with torch.cuda.graph(g1, stream=s):
        a = x * 3
    with torch.cuda.graph(g2, pool=g1.pool(), stream=s):
        b = a + x
    x.fill_(2.0)
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(b, torch.full_like(x, 8.0))
    assert gfxgraph.stats()["graph_pool_bytes"] > 0


def test_keep_graph_raw_handles_instantiate_and_debug_dump(tmp_path):
    x = torch.ones(16, device="cuda")
    g = BridgedCUDAGraph(keep_graph=True)
    s = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        y = x + 1
    assert isinstance(g.raw_cuda_graph(), int) and g.raw_cuda_graph() != 0
    g.instantiate()
    assert g.raw_cuda_graph_exec() != 0
    path = tmp_path / "graph.dot"
    g.debug_dump(str(path))
    assert path.exists() and "digraph" in path.read_text()[:200]
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 2.0))


def test_rng_differs_per_replay_and_registered_generator():
    g = BridgedCUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        r = torch.rand(1000, device="cuda")
    g.replay()
    first = r.clone()
    g.replay()
    assert not torch.equal(first, r)
    # a user generator registered with the graph also advances per replay
    custom = torch.Generator(device="cuda")
    custom.manual_seed(123)
    g2 = BridgedCUDAGraph()
    g2.register_generator_state(custom)
    with torch.cuda.graph(g2, stream=s):
        r2 = torch.rand(1000, device="cuda", generator=custom)
    g2.replay()
    a = r2.clone()
    g2.replay()
    assert not torch.equal(a, r2)


def test_make_graphed_callables_forward_backward_match_eager():
    gfxgraph.enable()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    for _ in range(3):
        inp = torch.randn(32, 64, device="cuda", requires_grad=True)
        out = graphed(inp)
        out.sum().backward()
        inp_ref = inp.detach().clone().requires_grad_(True)
        out_ref = ref(inp_ref)
        out_ref.sum().backward()
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(inp.grad, inp_ref.grad)
    assert gfxgraph.stats()["capture_count"] >= 2  # forward and backward graphs


def test_state_errors_are_clear():
    g = BridgedCUDAGraph()
    with pytest.raises(RuntimeError, match="without a preceding successful capture(.|\n)*capture the graph first"):
        g.replay()  # PyTorch's own message, then gfxgraph's hint
    with pytest.raises(RuntimeError, match="capture_end\\(\\) called on a graph in state 'empty'"):
        g.capture_end()
    with pytest.raises(RuntimeError, match="Unknown capture error mode"):
        with torch.cuda.stream(torch.cuda.Stream()):
            g.capture_begin(capture_error_mode="strict")
    assert g.state is GraphState.EMPTY
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    s = torch.cuda.Stream()
    x = torch.ones(4, device="cuda")
    with torch.cuda.graph(g, stream=s):
        x.add_(1)
    with pytest.raises(RuntimeError, match="already owns a captured graph(.|\n)*call reset"):
        with torch.cuda.stream(s):
            g.capture_begin()
    with pytest.raises(TypeError, match="high-level capture"):
        g.replay(input_tensor=x)
    g.reset()
    assert g.state is GraphState.EMPTY
    with torch.cuda.graph(g, stream=s):  # reusable after reset
        x.add_(1)
    g.replay()


def test_region_exception_discards_partial_graph():
    g = BridgedCUDAGraph()
    s = torch.cuda.Stream()
    x = torch.zeros(8, device="cuda")
    with pytest.raises(ValueError, match="boom"):
        with torch.cuda.graph(g, stream=s):
            x.add_(1)
            raise ValueError("boom")
    assert g.state is GraphState.FAILED and "ValueError: boom" in g.failure_reason
    with pytest.raises(RuntimeError, match="capture failed and was discarded"):
        g.replay()
    assert gfxgraph.stats()["capture_failures"] == 1
    g2 = BridgedCUDAGraph()
    with torch.cuda.graph(g2, stream=s):
        x.add_(1)
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.ones(8, device="cuda"))


def test_nested_capture_begin_refused_and_outer_capture_survives():
    s = torch.cuda.Stream()
    x = torch.ones(8, device="cuda")
    outer, inner = BridgedCUDAGraph(), BridgedCUDAGraph()
    with torch.cuda.stream(s):
        outer.capture_begin()
        y = x * 5
        with pytest.raises(GraphCaptureError, match="already capturing"):
            inner.capture_begin()
        y = y + 1
        outer.capture_end()
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 6.0))


def test_high_level_static_capture_matches_eager_and_outputs_survive():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 128).cuda()

    def model(x):
        return torch.sigmoid(lin(x))

    g = BridgedCUDAGraph()
    with torch.no_grad():
        with g.capture(model_fn=model, example_input=torch.randn(16, 128, device="cuda")) as cap:
            pass
        assert cap.mode == "graph", cap.fallback_reason
        xs = [torch.randn(16, 128, device="cuda") for _ in range(4)]
        outs = [g.replay(input_tensor=x) for x in xs]
        for x, out in zip(xs, outs):  # earlier outputs were not overwritten by later replays
            torch.testing.assert_close(out, model(x), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"expected Tensor\(shape=\(16, 128\)"):
            g.replay(input_tensor=torch.randn(8, 128, device="cuda"))
        with pytest.raises(ValueError, match="dtype=torch.float32"):
            g.replay(input_tensor=torch.randn(16, 128, device="cuda").half())
        with pytest.raises(ValueError, match="device=cuda"):
            g.replay(input_tensor=torch.randn(16, 128))
        with pytest.raises(TypeError, match="input_tensor: expected the structure"):
            g.replay(input_tensor=[1, 2])


def test_high_level_capture_failure_falls_back_to_eager():
    def syncing_model(x):
        if x.sum().item() > 1e9:  # host sync: illegal during capture
            return x
        return x * 2

    g = BridgedCUDAGraph()
    with g.capture(model_fn=syncing_model, example_input=torch.ones(4, device="cuda")) as cap:
        pass
    assert cap.mode == "eager" and cap.fallback_reason.startswith("capture_failed")
    x = torch.arange(4.0, device="cuda")
    assert torch.equal(g.replay(input_tensor=x), x * 2)
    snap = gfxgraph.stats()
    assert snap["fallback_reasons"]["capture_failed"] >= 2 and snap["capture_failures"] == 1
    # the stream and the process are healthy: a normal capture works next
    g2 = BridgedCUDAGraph()
    with g2.capture(model_fn=lambda t: t + 1, example_input=torch.ones(4, device="cuda")) as cap2:
        pass
    assert cap2.mode == "graph"
    assert torch.equal(g2.replay(input_tensor=x), x + 1)


def test_validation_mode_catches_a_graph_that_went_stale():
    gfxgraph.enable(validate=True)
    scale = {"v": 2.0}

    def model(x):
        return x * scale["v"]  # a Python float: baked into the graph at capture

    g = BridgedCUDAGraph()
    with g.capture(model_fn=model, example_input=torch.ones(4, device="cuda")):
        pass
    x = torch.arange(4.0, device="cuda")
    assert torch.equal(g.replay(input_tensor=x), x * 2)
    scale["v"] = 3.0  # eager now differs from the captured graph
    out = g.replay(input_tensor=x)
    assert torch.equal(out, x * 3)  # the eager result is returned
    snap = gfxgraph.stats()
    assert snap["validation_checks"] == 2 and snap["validation_failures"] == 1


def test_health_check_on_gpu():
    report = gfxgraph.health_check()
    assert report["ok"] is True, report["details"]
    assert report["backend"] in ("cuda", "hip")
    assert report["gpu"] and report["arch"] and report["rocm"] == report["arch"]
    if report["backend"] == "cuda":
        major, minor = torch.cuda.get_device_capability()
        assert report["arch"] == f"sm_{major}{minor}"
    assert report["vram_total_mb"] > report["vram_free_mb"] > 0
    assert report["max_abs_error"] == 0.0


@pytest.mark.skipif(os.environ.get("GFXGRAPH_SKIP_SLOW") == "1", reason="slow")
def test_failed_captures_do_not_leak_pool_memory():
    x = torch.ones(1 << 20, device="cuda")
    s = torch.cuda.Stream()

    def fail_once():
        g = BridgedCUDAGraph()
        with pytest.raises(Exception):
            with torch.cuda.graph(g, stream=s):
                y = x * 2  # allocates in the private pool
                y.sum().item()

    for _ in range(3):
        fail_once()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    for _ in range(30):
        fail_once()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= base + (4 << 20)
    g = BridgedCUDAGraph()
    with torch.cuda.graph(g, stream=s):
        z = x + 1
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, torch.full_like(x, 2.0))


def test_shared_pool_after_a_failed_capture_is_usable_or_refused_clearly():
    pool = torch.cuda.graph_pool_handle()
    s = torch.cuda.Stream()
    x = torch.ones(8, device="cuda")
    g = BridgedCUDAGraph()
    with pytest.raises(RuntimeError):
        with torch.cuda.graph(g, pool=pool, stream=s):
            (x * 2).sum().item()
    g2 = BridgedCUDAGraph()
    try:
        with torch.cuda.graph(g2, pool=pool, stream=s):
            z = x * 3
    except RuntimeError as exc:  # PyTorch's allocator refuses the pool; gfxgraph's hint follows its message
        assert "fresh torch.cuda.graph_pool_handle()" in str(exc)
        torch.cuda.set_stream(torch.cuda.default_stream())  # torch.cuda.graph leaves its stream set on refusal
    else:
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(z, x * 3)
    g3 = BridgedCUDAGraph()  # a fresh pool always works
    with torch.cuda.graph(g3, pool=torch.cuda.graph_pool_handle(), stream=s):
        w = x * 4
    g3.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, x * 4)


def test_graph_pool_ids_name_the_pools_made_in_between_even_when_others_are_freed():
    from hipgraph_bridge.graph.memory import graph_pool_bytes, graph_pool_ids

    x = torch.ones(1 << 20, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        y = x * 2
    before = graph_pool_ids()
    del old, y  # an earlier run's pool is freed while the next one captures
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    new = torch.cuda.CUDAGraph()
    with torch.cuda.graph(new):
        z = x + 1
    made = graph_pool_ids() - before
    assert len(made) == 1 and graph_pool_bytes(made) >= z.numel() * 4
    assert graph_pool_bytes(made) == graph_pool_bytes([new.pool()])
