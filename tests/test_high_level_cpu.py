"""The seed's high-level API without a GPU: eager fallback, counted, same results, clear errors."""

from __future__ import annotations

import pytest
import torch

import gfxgraph
from conftest import GPU_SKIP_REASON
from gfxgraph import BridgedCUDAGraph, GraphsUnavailableError

pytestmark = pytest.mark.skipif(GPU_SKIP_REASON is None, reason="CPU-only fallback behaviour")


def model(x):
    return torch.tanh(x @ x.T) + 1


def test_capture_falls_back_to_eager_with_reason():
    g = BridgedCUDAGraph()
    x = torch.randn(4, 4)
    with g.capture(model_fn=model, example_input=x) as cap:
        pass
    assert cap.mode == "eager" and cap.fallback_reason.startswith("no_gpu")
    x2 = torch.randn(4, 4)
    assert torch.equal(g.replay(input_tensor=x2), model(x2))
    assert torch.equal(g.replay(), model(x))
    snap = gfxgraph.stats()
    assert snap["fallback_reasons"]["no_gpu"] == 3


def test_low_level_api_raises_clear_error_without_gpu():
    g = BridgedCUDAGraph()
    for call in (g.capture_begin, g.capture_end, g.reset, g.pool, g.instantiate):
        with pytest.raises(GraphsUnavailableError, match="needs a CUDA or ROCm GPU"):
            call()
    with pytest.raises(GraphsUnavailableError):
        g.replay()


def test_bad_arguments_are_named():
    g = BridgedCUDAGraph()
    with pytest.raises(TypeError, match="model_fn: expected a callable"):
        g.capture(model_fn=3)
    with pytest.raises(TypeError, match="example_input: expected a tensor"):
        g.capture(model_fn=model, example_input=[1, 2])
    with pytest.raises(ValueError, match="warmup_iters"):
        g.capture(model_fn=model, warmup_iters=-1)
    with pytest.raises(ValueError, match="buckets= needs dynamic_shapes=True"):
        g.capture(model_fn=model, buckets=[1, 2])
    with pytest.raises(TypeError, match="keep_graph: expected a bool"):
        BridgedCUDAGraph(keep_graph="yes")


def test_static_session_rejects_bucket_and_branch_arguments():
    g = BridgedCUDAGraph()
    with g.capture(model_fn=model, example_input=torch.randn(2, 2)):
        pass
    with pytest.raises(TypeError, match="batch_size= needs capture\\(dynamic_shapes=True\\)"):
        g.replay(batch_size=2)
