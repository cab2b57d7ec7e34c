"""The compile backend in grad mode, and ``gfxgraph.backend(**options)``, without a GPU.

In grad mode with parameters requiring grad a subgraph needs autograd: it takes the
CUDA-graph trees path (``SubgraphState.TREES``), compiled as ``mode="reduce-overhead"``
compiles it. Without a GPU the trees have nothing to record; these tests check the
path chosen, the config inductor is asked for, gradients equal to eager, the counts
in ``backend_stats()["trees"]`` and the one WARNING for inference in grad mode.
``tests/test_compile_grad_gpu.py`` checks the recordings and replays on a GPU.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
import torch._dynamo

import gfxgraph
import gfxgraph.hf
from conftest import GPU_SKIP_REASON
from hipgraph_bridge import compile as cb
from hipgraph_bridge.compile import SubgraphState, backend_stats, compiler as compiler_mod
from hipgraph_bridge.errors import ConfigError

cb.register()
cpu_only = pytest.mark.skipif(GPU_SKIP_REASON is None, reason="exercises the no-GPU pipeline")
_before: weakref.WeakSet = weakref.WeakSet()
WARNING_KEY = "inference in grad mode"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    gc.collect()
    gc.freeze()  # the survivors (fake-tensor dispatch caches dynamo's reset keeps, ...): out of later collections' way
    _before.clear()
    _before.update(cb.compiled_subgraphs())
    yield
    torch._dynamo.reset()


def subgraphs() -> list[cb.CompiledSubgraph]:
    return [s for s in cb.compiled_subgraphs() if s not in _before]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def _grads_match(c, m, x) -> None:
    c(x).square().sum().backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x).square().sum().backward()
    for g, p in zip(got, m.parameters()):
        torch.testing.assert_close(g, p.grad)
    m.zero_grad()


def _inference_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "gfxgraph" and WARNING_KEY in r.getMessage()]


# ------------------------------------------------------------------ the trees path
@cpu_only
def test_grad_mode_takes_the_trees_path_with_gradients_equal_to_eager(caplog):
    m = _model()
    c = torch.compile(m, backend="gfxgraph", options={"compiler": "aot_eager"})
    with caplog.at_level(logging.INFO, logger="gfxgraph"):
        for n in (3, 5, 6, 5):
            _grads_match(c, m, torch.randn(n, 8))
    trees = [s for s in subgraphs() if s.state is SubgraphState.TREES]
    assert len(trees) == 1 and trees[0].reason is None
    st = backend_stats()
    assert st["trees"]["subgraphs"] == 1
    assert st["trees"]["calls"] == trees[0].tree_calls >= 2  # the first (static) frame runs lazily, then this one
    assert st["trees"]["unused_backwards"] == 0  # every forward's graph went through a backward
    reasons = gfxgraph.stats()["fallback_reasons"]
    assert "training" not in reasons
    assert reasons.get("no_gpu", 0) == trees[0].tree_calls  # no GPU: each trees call counted as eager
    assert not _inference_warnings(caplog)  # training is not inference


def test_trees_path_asks_inductor_for_cudagraph_trees(monkeypatch):
    """The inductor patches of a grad-mode subgraph turn the trees on (reduce-overhead's graphs); the bucketed
    path keeps them off. (compile_fx is spied on and returns the traced graph: gcc is not the point here.)"""
    seen: list[dict] = []

    def spy(gm, args, patches):
        seen.append(dict(patches))
        return gm.forward

    monkeypatch.setattr(compiler_mod, "compile_fx", spy)
    monkeypatch.setattr(compiler_mod, "cpp_compiler_problem", lambda: None)
    m = _model()
    c = torch.compile(m, backend="gfxgraph", dynamic=True,
                      options={"inductor_config": {"max_autotune": False}})
    _grads_match(c, m, torch.randn(4, 8))
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(c(x), m(x))
    assert [p["triton.cudagraphs"] for p in seen] == [True, False]  # grad frame: trees; no_grad frame: ours
    assert all(p["max_autotune"] is False for p in seen)  # the user's inductor config reaches both
    states = {s.state for s in subgraphs()}
    assert states == {SubgraphState.TREES, SubgraphState.GRAPHED}


def test_eager_compiler_in_grad_mode_runs_without_graphs_with_its_reason():
    m = _model()
    c = torch.compile(m, backend="gfxgraph", dynamic=True, options={"compiler": "eager"})
    _grads_match(c, m, torch.randn(5, 8))
    (s,) = subgraphs()
    assert s.state is SubgraphState.UNGRAPHED and s.reason == "training"
    assert "compiler 'inductor' or 'aot_eager'" in s.detail
    assert backend_stats()["trees"]["subgraphs"] == 0


def test_frozen_parameters_in_grad_mode_get_bucketed_graphs():
    """Nothing requires grad (grad mode on): no autograd, so the bucketed path, and no warning."""
    m = _model().requires_grad_(False)
    c = torch.compile(m, backend="gfxgraph", dynamic=True, options={"compiler": "aot_eager",
                                                                    "simulate_padding": True})
    for n in (3, 5):
        x = torch.randn(n, 8)
        torch.testing.assert_close(c(x), m(x))
    (s,) = subgraphs()
    assert s.state is SubgraphState.GRAPHED
    assert backend_stats()["trees"]["subgraphs"] == 0


# ------------------------------------------------------------------ inference in grad mode
def test_inference_in_grad_mode_is_warned_once_with_the_fix(caplog):
    m = _model()
    c = torch.compile(m, backend="gfxgraph", dynamic=True, options={"compiler": "aot_eager"})
    with caplog.at_level(logging.INFO, logger="gfxgraph"):
        for n in (3, 5, 6, 3, 5, 7):
            x = torch.randn(n, 8)
            y = c(x)  # the README example without torch.no_grad(): outputs never backpropagated
            assert y.requires_grad
            torch.testing.assert_close(y, m(x))
    warned = _inference_warnings(caplog)
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert warned[0].levelno == logging.WARNING
    msg = warned[0].getMessage()
    assert "torch.no_grad()" in msg and "torch.inference_mode()" in msg and "bucketed graphs" in msg
    assert backend_stats()["trees"]["unused_backwards"] >= 4


def test_results_in_grad_mode_equal_eager():
    m = _model()
    c = torch.compile(m, backend="gfxgraph", dynamic=True, options={"compiler": "aot_eager"})
    for n in (1, 3, 8):
        x = torch.randn(n, 8)
        torch.testing.assert_close(c(x), m(x))


def test_no_warning_for_a_training_loop_with_forwards_before_one_backward(caplog):
    """Gradient accumulation and a block called twice per step: forwards wait for one backward, no warning."""
    m = _model()
    c = torch.compile(m, backend="gfxgraph", dynamic=True, options={"compiler": "aot_eager"})
    with caplog.at_level(logging.INFO, logger="gfxgraph"):
        for _ in range(3):
            loss = sum(c(c(torch.randn(n, 8))).square().sum() for n in (3, 5))
            loss.backward()
            m.zero_grad()
            del loss
    assert not _inference_warnings(caplog)
    assert backend_stats()["trees"]["unused_backwards"] == 0


# ------------------------------------------------------------------ gfxgraph.backend(**options)
BAD_OPTIONS = [
    {"bucket": [1, 8]},
    {"buckets": [0, 8]},
    {"buckets": "1,8"},
    {"buckets": [1, 8], "max_batch_size": 64},
    {"max_batch_size": 0},
    {"batch_dim": -1},
    {"warmup_iters": "1"},
    {"copy_outputs": "no"},
    {"vram_cap": 1.5},
    {"pad_value": "0"},
    {"compiler": "tvm"},
    {"inductor_config": {"triton.cudagraphs": True}},
    {"inductor_config": {"no_such_key": 1}},
    {"static_compile_after": 0},
    {"max_variants": 0},
    {"graphs": 1},
    {"token_buckets": [1, 8]},
    {"piecewise": True, "splitting_ops": ["no_such_ns::op"]},
]


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=lambda o: ",".join(o))
def test_backend_validates_every_option_at_construction(options):
    with pytest.raises(ConfigError):
        gfxgraph.backend(**options)


def test_backend_object_compiles_like_the_string_backend():
    m = _model().eval()
    b = gfxgraph.backend(compiler="aot_eager", simulate_padding=True, buckets=[2, 8])
    assert b.options.buckets == (2, 8) and "buckets=[2, 8]" in repr(b)
    c = torch.compile(m, backend=b, dynamic=True)
    with torch.no_grad():
        for n in (3, 8, 9):
            x = torch.randn(n, 8)
            torch.testing.assert_close(c(x), m(x))
    (s,) = subgraphs()
    assert s.state is SubgraphState.GRAPHED and s.buckets == [2, 8]
    assert s.opts.compiler == "aot_eager"


def test_string_backend_with_options_keeps_working_and_checks_at_first_call():
    m = _model().eval()
    c = torch.compile(m, backend="gfxgraph", options={"compiler": "aot_eager", "buckets": [2, 4]}, dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(c(torch.ones(3, 8)), m(torch.ones(3, 8)))
    assert subgraphs()[0].buckets == [2, 4]
    bad = torch.compile(m, backend="gfxgraph", options={"bucket": [1, 8]})
    with pytest.raises(Exception, match="unknown option"):
        bad(torch.ones(3, 8))


def test_compile_config_validates_its_own_arguments():
    pytest.importorskip("transformers")
    for kw in ({"dynamic": "yes"}, {"fullgraph": 1}, {"bucket": [1]}, {"max_batch_size": -1}):
        with pytest.raises(ConfigError):
            gfxgraph.hf.compile_config(**kw)
    cfg = gfxgraph.hf.compile_config(dynamic=True, buckets=[1, 4])
    assert cfg.backend == "gfxgraph" and cfg.dynamic is True and cfg.options == {"buckets": [1, 4]}
