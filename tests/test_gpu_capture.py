"""The capture primitive on a GPU: what a failed capture leaves behind, and when a region counts as raised."""

from __future__ import annotations

import pytest
import torch

from gfxgraph import BridgedCUDAGraph, GraphState
from hipgraph_bridge import GraphCapture, OriginalCUDAGraph, SafeCUDAGraph, _torch_compat
from hipgraph_bridge.graph.capture import CaptureState, capture_on_stream

pytestmark = pytest.mark.gpu


def _usable() -> None:
    """The next capture works and eager CUDA random numbers work."""
    x = torch.randn(64, device="cuda")
    g = SafeCUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=s):
        y = x * 3 + torch.rand_like(x)
    g.replay()
    torch.cuda.synchronize()
    assert y.shape == x.shape and not torch.cuda.is_current_stream_capturing()


def test_a_capture_inside_an_except_block_keeps_the_graph():
    """An exception already being handled when the capture began is not the region's."""
    x = torch.ones(8, device="cuda")
    s = torch.cuda.Stream()
    g = BridgedCUDAGraph()
    try:
        raise KeyError("handled by the caller, before the capture")
    except KeyError:
        with torch.cuda.stream(s):
            g.capture_begin()
            y = x * 2
            g.capture_end()
    assert g.state is GraphState.READY
    x.fill_(4.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 8.0))


def test_a_graph_context_entered_while_an_exception_is_handled_keeps_the_graph():
    x = torch.ones(8, device="cuda")
    g = BridgedCUDAGraph()
    try:
        raise ValueError("being handled")
    except ValueError:
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            y = x + 1
    assert g.state is GraphState.READY
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x + 1)


def test_a_region_that_raises_is_discarded_and_the_process_stays_usable():
    x = torch.ones(8, device="cuda")
    g = BridgedCUDAGraph()
    with pytest.raises(ZeroDivisionError), torch.cuda.graph(g, stream=torch.cuda.Stream()):
        _ = torch.rand_like(x) + x
        raise ZeroDivisionError("in the region")
    assert g.state is GraphState.FAILED and "raised" in g.failure_reason
    with pytest.raises(RuntimeError, match="capture failed and was discarded"):
        g.replay()
    _usable()


def test_graph_capture_context_on_a_plain_torch_graph():
    x = torch.ones(8, device="cuda")
    g = OriginalCUDAGraph()
    s = torch.cuda.Stream()
    with GraphCapture(g, stream=s, capture_error_mode="thread_local") as cap:
        assert capture_on_stream(s.cuda_stream) is cap and cap.state is CaptureState.CAPTURING
        y = x * 5
    assert cap.state is CaptureState.ENDED and cap.seconds > 0 and capture_on_stream(s.cuda_stream) is None
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 5)
    g2 = OriginalCUDAGraph()
    with pytest.raises(RuntimeError, match="boom"), GraphCapture(g2, stream=s) as cap2:
        _ = torch.randn(4, device="cuda")
        raise RuntimeError("boom")
    assert cap2.state is CaptureState.DISCARDED and "boom" in cap2.failure
    _usable()


def test_a_sync_in_the_region_is_a_capture_error_and_the_stream_recovers():
    x = torch.ones(8, device="cuda")
    g = SafeCUDAGraph()
    s = torch.cuda.Stream()
    with pytest.raises(RuntimeError), g.capturing(stream=s):  # PyTorch refuses the sync while capturing
        _ = (x * 2).sum().item()
    assert g.state is GraphState.FAILED
    with torch.cuda.stream(s):
        assert not torch.cuda.is_current_stream_capturing()
    _usable()


def test_private_torch_paths_on_this_torch():
    paths = _torch_compat.describe()
    assert paths["graph_exit_frame"] is True  # region-raised detection reads torch.cuda.graph's frame
    assert paths["pool_release"] is True and paths["weak_outputs"] is True and paths["raw_stream"] is True
    assert paths["pointer_check"] == "C++"
    major_minor = tuple(int(v) for v in torch.__version__.split(".")[:2])
    assert paths["check_input_liveness"] is (major_minor >= (2, 13))
