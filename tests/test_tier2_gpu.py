"""Tier 2 on a GPU: runtime layer, compositor (gap 54), launch pipeline (gap 52), exec update.

Every test runs once per runtime binding: ``cuda-bindings`` and ``ctypes`` over
the libcudart PyTorch loaded, which is the HIP backend's code path forced on
CUDA. The HIP-style strategies (re-instantiation fallbacks, one instance vs
two) are forced through parameters. What ``"auto"`` does is the capability
table's answer for the runtime (in place on CUDA; re-instantiation on HIP).
Results are compared with eager PyTorch.
"""

from __future__ import annotations

import pytest
import torch

from hipgraph_bridge import BridgedCUDAGraph, GraphRuntimeError
from hipgraph_bridge.compose.compositor import GraphCompositor
from hipgraph_bridge.compose.exec_update import UpdatableGraph
from hipgraph_bridge.compose.pipeline import LaunchPipeline
from hipgraph_bridge.runtime import (
    Graph,
    capabilities_of,
    deferred_count,
    drain_deferred,
    get_runtime,
    stream_handle,
)

pytestmark = pytest.mark.gpu

PREFIX = "hip" if getattr(torch.version, "hip", None) else "cuda"  # runtime API prefix


def _kinds() -> list[str]:
    if getattr(torch.version, "hip", None):
        return ["ctypes"]  # HIP: the ctypes backend is the only one
    return ["cuda-bindings", "ctypes"]


@pytest.fixture(params=_kinds())
def rt(request):
    if request.param == "cuda-bindings":
        pytest.importorskip("cuda.bindings")
    return get_runtime(request.param)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _capture(fn, *, graph_cls=torch.cuda.CUDAGraph, pool=None):
    """Warm ``fn`` up on a side stream, then capture it into a keep_graph graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = graph_cls(keep_graph=True)
    with torch.cuda.graph(g, pool=pool, stream=s):
        out = fn()
    return g, out


def _warm(*fns) -> None:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


# ---------------------------------------------------------------- runtime layer
def test_runtime_binding_is_what_was_asked_for(rt):
    assert rt.name == PREFIX
    caps = rt.capabilities
    if PREFIX == "cuda":
        assert caps.runtime_version >= 12000 and caps.driver_version >= 12000
    assert caps.exec_update and caps.child_graph_update and caps.upload
    assert caps.device_launch is (PREFIX == "cuda")
    if rt.kind == "ctypes":
        assert ("libcudart" if PREFIX == "cuda" else "libamdhip64") in rt.binding


def test_torch_graph_instantiated_and_launched_by_us(rt):
    x = torch.randn(4096, device="cuda")
    g, y = _capture(lambda: torch.sin(x) * 2 + 1)
    graph = Graph.from_torch(g, runtime=rt)
    assert not graph.owned and graph.node_count() >= 2
    exe = graph.instantiate(upload_stream=torch.cuda.current_stream())
    for seed in range(3):
        x.copy_(torch.randn(4096, device="cuda", generator=_gen(seed)))
        exe.launch()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, torch.sin(x) * 2 + 1)
    clone = graph.clone()
    assert clone.owned and clone.node_count() == graph.node_count()
    exe.close()
    exe.close()
    clone.close()
    with pytest.raises(RuntimeError, match="closed"):
        exe.launch()


def test_runtime_error_carries_the_runtime_message_and_torch_keeps_working(rt):
    with pytest.raises(GraphRuntimeError) as info:
        rt.graph_instantiate(0)  # NULL graph
    err = info.value
    assert err.call == f"{PREFIX}GraphInstantiateWithFlags"
    assert err.name.startswith(f"{PREFIX}Error") and err.code != 0
    assert err.explanation == rt._error_string(err.code) and err.explanation
    with pytest.raises(GraphRuntimeError, match=f"{PREFIX}GraphLaunch"):
        rt.exec_launch(0, stream_handle(None))  # NULL executable
    # The runtime's last error was cleared: PyTorch's next launch check is clean.
    assert torch.ones(8, device="cuda").sum().item() == 8.0
    torch.cuda.synchronize()


def test_keep_graph_false_is_refused_with_the_fix():
    x = torch.ones(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    with pytest.raises(ValueError, match="keep_graph=True"):
        Graph.from_torch(g)


def test_release_during_capture_is_deferred_then_done(rt):
    g = Graph.create(runtime=rt)
    x = torch.ones(16, device="cuda")
    before = deferred_count()
    bg = BridgedCUDAGraph()
    with torch.cuda.graph(bg):
        x.add_(1)
        g.close()  # a destroy now could invalidate the capture: deferred
        assert deferred_count() == before + 1
    assert drain_deferred() >= 1
    assert deferred_count() == 0
    bg.replay()
    torch.cuda.synchronize()


def test_end_capture_and_discard_ends_a_dangling_capture():
    cudart = pytest.importorskip("cuda.bindings.runtime")
    rt = get_runtime("cuda-bindings")
    s = torch.cuda.Stream()
    mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
    err, = cudart.cudaStreamBeginCapture(s.cuda_stream, mode)
    assert int(err) == 0
    assert rt.stream_capture_status(s.cuda_stream) == 1
    rt.end_capture_and_discard(s.cuda_stream)
    assert rt.stream_capture_status(s.cuda_stream) == 0
    rt.end_capture_and_discard(s.cuda_stream)  # not capturing: a no-op


# ------------------------------------------------------------------- compositor
def test_composed_stages_equal_pieces_in_order_and_eager(rt):
    n = 1 << 16
    x = torch.randn(n, device="cuda")
    _warm(lambda: torch.sin(x * 2 + 1) * 3)
    comp = GraphCompositor(runtime=rt)
    with comp.stage("a"):
        h = x * 2 + 1
    with comp.stage("b", after=["a"]):
        y = torch.sin(h) * 3
    with comp.stage("c", after=["b"]):
        z = y + h
    comp.instantiate()
    assert comp.order == ["a", "b", "c"] and comp.exec.source.node_count() == 3

    pieces = [comp.child(name) for name in ("a", "b", "c")]
    for p in pieces:
        p.instantiate()
    for seed in range(5):
        x.copy_(torch.randn(n, device="cuda", generator=_gen(seed)))
        comp.launch()
        composed = z.clone()
        for p in pieces:  # the same pieces, replayed one by one in order
            p.replay()
        torch.cuda.synchronize()
        assert torch.equal(composed, z)
        hh = x * 2 + 1
        torch.testing.assert_close(composed, torch.sin(hh) * 3 + hh)


def test_user_captured_graphs_composed_with_add(rt):
    x = torch.randn(1024, device="cuda")
    g1, a = _capture(lambda: x * 3)
    g2, b = _capture(lambda: a - 1, pool=g1.pool())
    comp = GraphCompositor(runtime=rt)
    comp.add("second", g2, after=["first"])  # declared before its dependency
    comp.add("first", g1)
    comp.instantiate()
    for seed in range(3):
        x.copy_(torch.randn(1024, device="cuda", generator=_gen(seed)))
        comp.launch()
        torch.cuda.synchronize()
        torch.testing.assert_close(b, x * 3 - 1)
    assert comp.child("first") is g1


def test_dag_edges_respected_consumers_never_see_stale_producer_output(rt):
    # A slow producer (many kernels over 16 MiB) and consumers that only read
    # its output: without the edges the consumers would run beside it and read
    # the previous launch's values.
    n = 1 << 22
    x = torch.empty(n, device="cuda")
    buf, left, right, merged = (torch.empty(n, device="cuda") for _ in range(4))

    def produce():
        t = x * 1.0
        for _ in range(24):
            t = t * 1.0 + 0.0
        buf.copy_(t)

    _warm(produce, lambda: torch.mul(buf, 2.0, out=left), lambda: torch.add(buf, 1.0, out=right),
          lambda: torch.add(left, right, out=merged))
    comp = GraphCompositor(runtime=rt)
    with comp.stage("produce"):
        produce()
    with comp.stage("left", after=["produce"]):
        torch.mul(buf, 2.0, out=left)
    with comp.stage("right", after=["produce"]):
        torch.add(buf, 1.0, out=right)
    with comp.stage("merge", after=["left", "right"]):
        torch.add(left, right, out=merged)
    comp.instantiate()
    assert comp.order[0] == "produce" and comp.order[-1] == "merge"
    results, inputs = [], []
    for seed in range(20):
        src = torch.randn(n, device="cuda", generator=_gen(100 + seed))
        x.copy_(src)
        comp.launch()
        results.append(merged[:4096].clone())  # ordered after the launch on this stream
        inputs.append(src[:4096])
    torch.cuda.synchronize()
    for src, got in zip(inputs, results):
        torch.testing.assert_close(got, src * 2.0 + (src + 1.0))


@pytest.mark.parametrize("swap", ["auto", "reinstantiate"])
def test_hot_swapped_child_changes_the_output(rt, swap):
    x = torch.randn(8192, device="cuda")
    mid, out = torch.empty_like(x), torch.empty_like(x)
    _warm(lambda: torch.mul(x, 2.0, out=mid), lambda: torch.add(mid, 1.0, out=out),
          lambda: torch.mul(mid, 3.0, out=out))
    comp = GraphCompositor(runtime=rt, swap=swap)
    with comp.stage("a"):
        torch.mul(x, 2.0, out=mid)
    with comp.stage("b", after=["a"]):
        torch.add(mid, 1.0, out=out)
    comp.instantiate()
    comp.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2.0 + 1.0)

    with comp.restage("b") as cap:
        torch.mul(mid, 3.0, out=out)  # same topology: one kernel
    assert cap.result is not None
    if swap == "auto" and capabilities_of(rt).child_graph_update:
        assert cap.result.method == "set_params" and cap.result.reason is None
    elif swap == "auto":  # HIP: the table says re-instantiate
        assert cap.result.method == "reinstantiate" and "not used on ROCm" in cap.result.reason
    else:
        assert cap.result.method == "reinstantiate" and "requested" in cap.result.reason
    x.copy_(torch.randn(8192, device="cuda", generator=_gen(7)))
    comp.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2.0 * 3.0)


def test_swap_with_changed_topology_falls_back_with_reason(rt):
    x = torch.randn(4096, device="cuda")
    mid, out = torch.empty_like(x), torch.empty_like(x)
    _warm(lambda: torch.mul(x, 2.0, out=mid), lambda: torch.add(mid, 1.0, out=out),
          lambda: torch.mul(torch.sin(mid), 3.0, out=out))
    comp = GraphCompositor(runtime=rt)
    with comp.stage("a"):
        torch.mul(x, 2.0, out=mid)
    with comp.stage("b", after=["a"]):
        torch.add(mid, 1.0, out=out)
    comp.instantiate()
    with comp.restage("b") as cap:
        torch.mul(torch.sin(mid), 3.0, out=out)  # two kernels where there was one
    assert cap.result.method == "reinstantiate"
    if capabilities_of(rt).child_graph_update:  # else (HIP) the table's reason: no in-place swap is tried
        assert "refused" in cap.result.reason and f"{PREFIX}Error" in cap.result.reason
    comp.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.sin(x * 2.0) * 3.0)
    assert comp.reinstantiations == 1


def test_failed_stage_leaves_the_compositor_usable(rt):
    x = torch.ones(256, device="cuda")
    comp = GraphCompositor(runtime=rt)
    with pytest.raises(ZeroDivisionError):
        with comp.stage("bad"):
            x.add_(1)
            raise ZeroDivisionError("in the region")
    with pytest.raises(RuntimeError):  # the runtime rejects the sync; capture ended cleanly
        with comp.stage("sync"):
            x.sum().item()
    assert "bad" not in comp and "sync" not in comp
    with comp.stage("good"):
        y = x * 2
    comp.instantiate()
    comp.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 2)


# ---------------------------------------------------------------- launch pipeline
@pytest.mark.parametrize("instances", [2, 1])
@pytest.mark.parametrize("strategy", ["auto", "reinstantiate"])
def test_pipeline_equals_plain_replays_over_many_launches(rt, instances, strategy):
    n, launches, switch = 2048, 1000, 500
    x, tmp, y = (torch.zeros(n, device="cuda") for _ in range(3))

    def work(scale):
        torch.mul(x, scale, out=tmp)
        torch.add(tmp, 1.0, out=y)

    g3, _ = _capture(lambda: work(3.0))
    g5, _ = _capture(lambda: work(5.0))
    inputs = torch.randn(launches, n, device="cuda", generator=_gen(1))
    got = torch.empty_like(inputs)
    pipe = LaunchPipeline(g3, runtime=rt, instances=instances, strategy=strategy)
    for k in range(launches):
        if k == switch:
            result = pipe.update(g5)
            in_place = strategy == "auto" and capabilities_of(rt).exec_update
            expected = "exec_update" if in_place else "reinstantiate"
            assert result.method == expected
        x.copy_(inputs[k])
        pipe.launch()
        got[k].copy_(y)
    pipe.synchronize()
    torch.cuda.synchronize()
    assert pipe.launches == launches and pipe.updates == 1

    g3.instantiate()
    g5.instantiate()
    plain = torch.empty_like(inputs)
    for k in range(launches):
        x.copy_(inputs[k])
        (g3 if k < switch else g5).replay()
        plain[k].copy_(y)
    torch.cuda.synchronize()
    assert torch.equal(got, plain)
    torch.testing.assert_close(got[:switch], inputs[:switch] * 3.0 + 1.0)
    torch.testing.assert_close(got[switch:], inputs[switch:] * 5.0 + 1.0)
    pipe.close()
    pipe.close()


def test_pipeline_on_its_own_stream(rt):
    s = torch.cuda.Stream()
    x = torch.zeros(512, device="cuda")
    g, y = _capture(lambda: x * 2)
    pipe = LaunchPipeline(g, runtime=rt, stream=s)
    for k in range(10):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.fill_(float(k))
        pipe.launch()
        s.synchronize()
        assert torch.equal(y, torch.full_like(x, 2.0 * k))


def test_pipeline_device_launch_runs_each_instance_from_the_device(rt):
    if PREFIX != "cuda" or rt.kind == "ctypes":
        pytest.skip("device launch: CUDA through cuda-bindings (HIP: ROCm/hip#3160)")
    x = torch.zeros(1 << 16, device="cuda")
    g, y = _capture(lambda: x + 1)
    pipe = LaunchPipeline(g, runtime=rt, device_launch=True)
    try:
        assert pipe.device_launch and pipe.device_launch_reason is None
        for k in range(5):  # each launch on the pipeline's stream, read after a sync
            with torch.cuda.stream(torch.cuda.ExternalStream(pipe.stream)):
                x.fill_(float(k))
            pipe.launch()
            torch.cuda.synchronize()
            assert torch.equal(y, torch.full_like(x, k + 1.0))
        # far more launches than CUDA lets one graph queue (255 tail launches): the stream orders them
        with torch.cuda.stream(torch.cuda.ExternalStream(pipe.stream)):
            x.fill_(0.0)
        for _ in range(1000):
            pipe.launch()
            with torch.cuda.stream(torch.cuda.ExternalStream(pipe.stream)):
                x.copy_(y)  # the next launch reads what the previous one wrote
        pipe.synchronize()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, 1000.0))  # 1000 launches, each after the one before
        pipe.check()  # no device-side launch error
    finally:
        pipe.close()


def test_pipeline_device_launch_takes_updates(rt):
    if PREFIX != "cuda" or rt.kind == "ctypes":
        pytest.skip("device launch: CUDA through cuda-bindings")
    x = torch.ones(64, device="cuda")
    g1, y1 = _capture(lambda: x + 1)
    pipe = LaunchPipeline(g1, runtime=rt, device_launch=True, strategy="reinstantiate")
    try:
        pipe.launch()
        torch.cuda.synchronize()
        assert torch.equal(y1, x + 1)
        g2, y2 = _capture(lambda: x + 5)
        pipe.update(g2)  # re-instantiated for device launch: the handle table is rewritten
        for _ in range(3):
            pipe.launch()
        torch.cuda.synchronize()
        assert torch.equal(y2, x + 5)
        pipe.check()
    finally:
        pipe.close()


# ------------------------------------------------------------------ exec update
@pytest.mark.parametrize("strategy", ["auto", "reinstantiate"])
def test_exec_update_in_place_and_fallback(rt, strategy):
    x, tmp, y = (torch.randn(4096, device="cuda") for _ in range(3))
    g3, _ = _capture(lambda: (torch.mul(x, 3.0, out=tmp), torch.add(tmp, 1.0, out=y)))
    ug = UpdatableGraph(g3, runtime=rt, strategy=strategy)
    ug.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 3.0 + 1.0)

    with ug.recapture() as cap:
        torch.mul(x, 5.0, out=tmp)
        torch.add(tmp, 1.0, out=y)
    res = cap.result
    in_place = strategy == "auto" and capabilities_of(rt).exec_update  # not on HIP: the table's answer
    if in_place:
        assert res.method == "exec_update" and res.reason is None
        assert res.result == f"{PREFIX}GraphExecUpdateSuccess"
    else:
        assert res.method == "reinstantiate"
    ug.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 5.0 + 1.0)

    # Topology change: two extra kernels. Exec update refuses; re-instantiated.
    g_other, _ = _capture(lambda: (torch.mul(torch.sin(x), 7.0, out=tmp),
                                   torch.add(tmp.cos(), 1.0, out=y)))
    res = ug.update(g_other)
    assert res.method == "reinstantiate" and res.reason
    if in_place:
        assert "GraphExecUpdate refused" in res.reason
        if rt.kind == "ctypes":  # ctypes reports the detailed result
            assert res.result.startswith(f"{PREFIX}GraphExecUpdateError")
    ug.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, (torch.sin(x) * 7.0).cos() + 1.0)
    ug.close()
