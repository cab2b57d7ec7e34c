"""The compile backend in grad mode on a GPU: CUDA-graph trees (forward and backward) on gfxgraph's graph class.

Run with ``python -m pytest -m gpu tests/test_compile_grad_gpu.py``. Each test turns
``gfxgraph.enable()`` on, so the trees' ``torch.cuda.CUDAGraph`` objects are
gfxgraph's ``BridgedCUDAGraph`` and their captures and replays show in
``gfxgraph.stats()``.
"""

from __future__ import annotations

import copy
import gc
import logging
import weakref

import pytest
import torch
import torch._dynamo

import gfxgraph
from hipgraph_bridge import compile as cb
from hipgraph_bridge.compile import SubgraphState, backend_stats

pytestmark = pytest.mark.gpu
cb.register()  # also from a checkout that is not installed (no entry points)
_before: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # also clears the CUDA-graph trees
    gc.collect()
    _before.clear()
    _before.update(cb.compiled_subgraphs())
    gfxgraph.enable()
    yield
    torch._dynamo.reset()
    gfxgraph.disable()


def subgraphs() -> list[cb.CompiledSubgraph]:
    return [s for s in cb.compiled_subgraphs() if s not in _before]


class MLP(torch.nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def _model(width: int = 64) -> MLP:
    torch.manual_seed(0)
    return MLP(width).cuda()


def test_readme_example_without_no_grad_replays_graphs(caplog):
    """``fast = torch.compile(model, backend="gfxgraph")`` called in grad mode (parameters requiring grad),
    its outputs dropped after use: trees record once per batch size and replay from then on."""
    model = _model()
    fast = torch.compile(model, backend="gfxgraph")
    with caplog.at_level(logging.INFO, logger="gfxgraph"):
        for _ in range(6):
            for n in (4, 8):
                x = torch.randn(n, 64, device="cuda")
                y = fast(x)
                assert y.requires_grad
                torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
                del y
    trees = [s for s in subgraphs() if s.state is SubgraphState.TREES]
    assert trees, [repr(s) for s in subgraphs()]
    st = gfxgraph.stats()
    assert st["capture_count"] >= 1 and st["replay_count"] >= 4, st  # on BridgedCUDAGraph: enable() is on
    assert backend_stats()["trees"]["subgraphs"] == len(trees)
    assert backend_stats()["trees"]["unused_backwards"] >= 1
    warned = [r for r in caplog.records if "inference in grad mode" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "torch.no_grad()" in warned[0].getMessage()


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_training_loop_matches_eager_losses_with_flat_memory(compiler):
    """50 SGD steps through the backend (forward and backward graphs replayed) against the same steps
    eagerly: losses equal within tolerance, no capture after the first steps, allocated memory flat."""
    eager = _model(128)
    graphed = copy.deepcopy(eager)
    fast = torch.compile(graphed, backend="gfxgraph", options={"compiler": compiler})
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=0.05)
    gen = torch.Generator(device="cuda").manual_seed(1)
    # one batch, fitted for 50 steps: its loss falls steadily (fresh random targets every step would not)
    x = torch.randn(32, 128, device="cuda", generator=gen)
    target = torch.randn(32, 128, device="cuda", generator=gen)
    losses_e, losses_g, allocated, captures, replays = [], [], [], [], []
    for _ in range(50):
        for model, opt, losses in ((eager, opt_e, losses_e), (fast, opt_g, losses_g)):
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            del loss
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        st = gfxgraph.stats()
        captures.append(st["capture_count"])
        replays.append(st["replay_count"])
    torch.testing.assert_close(torch.tensor(losses_g), torch.tensor(losses_e), rtol=1e-3, atol=1e-5)
    assert losses_g[-1] < 0.9 * losses_g[0], losses_g  # it trained
    trees = [s for s in subgraphs() if s.state is SubgraphState.TREES]
    assert trees and all(s.compiler == compiler for s in trees), [repr(s) for s in subgraphs()]
    assert backend_stats()["trees"]["unused_backwards"] == 0  # every forward's graph went through a backward
    assert captures[10] >= 2 and captures[-1] == captures[10], captures  # forward and backward recorded once
    assert replays[-1] - replays[10] >= 2 * 39, replays  # then replayed, forward and backward, every step
    steady = allocated[10:]
    assert max(steady) - min(steady) <= 16 * 1024, allocated  # flat: nothing kept per step


def test_no_grad_still_gets_bucketed_graphs_beside_the_trees():
    model = _model()
    fast = torch.compile(model, backend="gfxgraph")
    x = torch.randn(6, 64, device="cuda")
    fast(x).sum().backward()  # grad mode: the trees
    with torch.no_grad():
        for n in (3, 6, 7, 6):
            x = torch.randn(n, 64, device="cuda")
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
    states = {s.state for s in subgraphs()}
    assert SubgraphState.GRAPHED in states
    assert backend_stats()["graphs"] >= 1
