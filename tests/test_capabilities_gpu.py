"""The HIP rows of the capability table, forced on the CUDA device: every choice they make still runs
correctly on real hardware (results compared with eager).

``identify`` is substituted so that the table sees ROCm 7.2.0 on this NVIDIA GPU; the strategies it
picks (per-branch dispatch, the host loop, re-instantiation instead of exec update and in-place hot
swap, capture-status checks, waiting before node toggles) then run over the CUDA runtime, which is
the only way to run them without AMD hardware.
"""

from __future__ import annotations

import pytest
import torch

from hipgraph_bridge import GraphCapture, OriginalCUDAGraph
from hipgraph_bridge.compose.compositor import GraphCompositor
from hipgraph_bridge.compose.exec_update import UpdatableGraph
from hipgraph_bridge.conditional import ConditionalGraph, DeviceWhileLoop, LoopCondition
from hipgraph_bridge.conditional.support import conditional_support
from hipgraph_bridge.runtime import Version, forget_detected_versions, get_runtime
from hipgraph_bridge.runtime import capabilities as caps_mod

pytestmark = pytest.mark.gpu


@pytest.fixture
def hip_rows(monkeypatch):
    """The table answers as for ROCm 7.2.0 on MI300X, for every runtime and for this process."""
    monkeypatch.setattr(caps_mod, "identify", lambda runtime=None: ("hip", Version(7, 2, 0), "forced by the test"))
    forget_detected_versions()
    conditional_support.cache_clear()
    yield
    forget_detected_versions()
    conditional_support.cache_clear()


def _warm(*fns):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def test_hip_rows_pick_dispatch_and_the_host_loop(hip_rows):
    x = torch.randn(4, 16, device="cuda")
    cg = ConditionalGraph()
    cg.add_branch("double", lambda t: t * 2)
    cg.add_branch("shift", lambda t: t - 1)
    cg.capture(x)
    assert cg.strategy == "dispatch" and "HIP has no conditional graph nodes" in cg.strategy_reason
    for pred in (True, False, True):
        xi = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(cg.run(torch.tensor(pred, device="cuda"), xi), xi * 2 if pred else xi - 1)
    cg.close()

    i, acc = torch.zeros((), dtype=torch.int64, device="cuda"), torch.ones(8, device="cuda")

    def body(i, acc):
        acc.mul_(1.5)
        i.add_(1)

    loop = DeviceWhileLoop(LoopCondition(0, "<", 5), body, (i, acc), max_iters=100)
    i_out, acc_out = loop.run(i, acc)
    assert loop.strategy == "host", loop.strategy_reason
    assert int(i_out) == 5
    torch.testing.assert_close(acc_out, torch.full_like(acc, 1.5 ** 5))


def test_hip_rows_supergraph_waits_before_toggling_and_matches_eager(hip_rows):
    x = torch.randn(4, 16, device="cuda")
    cg = ConditionalGraph(strategy="supergraph")
    cg.add_branch("double", lambda t: t * 2)
    cg.add_branch("shift", lambda t: t - 1)
    cg.capture(x, selectors=("bool",))
    assert cg.strategy == "supergraph", cg.strategy_reason
    assert cg._device_graphs["bool"]._done is not None  # HIP's docs do not say toggles spare launches in flight
    for pred in (True, True, False, True, False, False):
        xi = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(cg.run(torch.tensor(pred, device="cuda"), xi), xi * 2 if pred else xi - 1)
    cg.close()


@pytest.mark.parametrize("kind", ["cuda-bindings", "ctypes"])
def test_hip_rows_reinstantiate_instead_of_exec_update_and_hot_swap(hip_rows, kind):
    if kind == "cuda-bindings":
        pytest.importorskip("cuda.bindings")
    rt = get_runtime(kind)
    x, tmp, y = (torch.randn(2048, device="cuda") for _ in range(3))
    _warm(lambda: torch.mul(x, 3.0, out=tmp), lambda: torch.add(tmp, 1.0, out=y))
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        torch.mul(x, 3.0, out=tmp)
        torch.add(tmp, 1.0, out=y)
    ug = UpdatableGraph(g, runtime=rt)
    with ug.recapture() as cap:
        torch.mul(x, 5.0, out=tmp)
        torch.add(tmp, 1.0, out=y)
    assert cap.result.method == "reinstantiate" and "rocm-systems/pull/10714" in cap.result.reason
    ug.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 5.0 + 1.0)
    ug.close()

    mid, out = torch.empty_like(x), torch.empty_like(x)
    _warm(lambda: torch.mul(x, 2.0, out=mid), lambda: torch.add(mid, 1.0, out=out),
          lambda: torch.mul(mid, 3.0, out=out))
    comp = GraphCompositor(runtime=rt)
    with comp.stage("a"):
        torch.mul(x, 2.0, out=mid)
    with comp.stage("b", after=["a"]):
        torch.add(mid, 1.0, out=out)
    comp.instantiate()
    with comp.restage("b") as swap:
        torch.mul(mid, 3.0, out=out)
    assert swap.result.method == "reinstantiate" and "rocm-systems/pull/11434" in swap.result.reason
    comp.launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 6.0)
    comp.close()


def test_hip_rows_check_capture_status_and_healthy_captures_still_work(hip_rows):
    x = torch.ones(64, device="cuda")
    g = OriginalCUDAGraph()
    cap = GraphCapture(g, stream=torch.cuda.Stream())
    assert cap._check_status  # ROCm 7.2.0 does not raise during capture: gfxgraph checks the status
    with cap:
        y = x * 4 + 1
    x.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 9.0))


def test_forced_status_check_discards_a_capture_the_runtime_ended_silently(py):
    """A capture that stopped without an error (what HIP < 7.14 can leave) is discarded, not kept."""
    r = py("""
        import torch
        from hipgraph_bridge import GraphCapture, GraphCaptureError, OriginalCUDAGraph, SafeCUDAGraph
        from hipgraph_bridge.runtime import current_runtime
        rt = current_runtime()
        s = torch.cuda.Stream()
        x = torch.ones(64, device="cuda")
        g = OriginalCUDAGraph()
        try:
            with GraphCapture(g, stream=s, check_capture_status=True):
                y = x * 2
                lost = rt.stream_end_capture(s.cuda_stream)  # the capture ends behind PyTorch's back
                if lost:
                    rt.graph_destroy(lost)
        except GraphCaptureError as exc:
            assert "not capturing" in str(exc) and "187110" in str(exc), exc
        else:
            raise AssertionError("the lost capture was kept")
        with torch.cuda.stream(s):
            assert not torch.cuda.is_current_stream_capturing()
        g2 = SafeCUDAGraph()
        with g2.capturing(stream=s):
            z = x * 3
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(z, torch.full_like(x, 3.0))
        print("OK")
    """, timeout=180)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
