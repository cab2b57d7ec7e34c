"""Drop-in: the same script gives bitwise-identical results with GFXGRAPH=1 and without."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import sys, torch
import gfxgraph  # reads GFXGRAPH
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
results = {}

# 1. torch.cuda.graph with a shared pool, serving-stack style: largest first
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256)).to(dev)
pool = torch.cuda.graph_pool_handle()
stream = torch.cuda.Stream()
static_in = torch.zeros(32, 256, device=dev)
graphs, outs = {}, {}
with torch.no_grad():
    for bs in (32, 16, 8):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(static_in[:bs])
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            outs[bs] = model(static_in[:bs])
        graphs[bs] = g
    for i, bs in enumerate((8, 16, 32, 8)):
        x = torch.randn(bs, 256, device=dev, generator=torch.Generator(dev).manual_seed(i))
        static_in[:bs].copy_(x)
        graphs[bs].replay()
        results[f"pool_{i}"] = outs[bs].clone()

# 2. make_graphed_callables, forward and backward
m2 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(dev)
sample = torch.randn(16, 64, device=dev, requires_grad=True)
gm = torch.cuda.make_graphed_callables(m2, (sample,))
for i in range(3):
    inp = torch.randn(16, 64, device=dev, requires_grad=True, generator=torch.Generator(dev).manual_seed(10 + i))
    out = gm(inp)
    out.square().sum().backward()
    results[f"mgc_out_{i}"] = out.detach().clone()
    results[f"mgc_grad_{i}"] = inp.grad.clone()
results["mgc_wgrad"] = m2[0].weight.grad.clone()

# 3. the low-level API
g = torch.cuda.CUDAGraph()
a = torch.randn(128, 128, device=dev)
with torch.cuda.stream(stream):
    g.capture_begin()
    b = torch.softmax(a @ a.T, dim=-1)
    g.capture_end()
torch.cuda.current_stream().wait_stream(stream)
for i in range(2):
    a.copy_(torch.randn(128, 128, device=dev, generator=torch.Generator(dev).manual_seed(20 + i)))
    g.replay()
    results[f"low_{i}"] = b.clone()
torch.cuda.synchronize()
results["graph_class"] = torch.cuda.CUDAGraph.__name__
torch.save(results, sys.argv[1])
"""


def test_same_results_with_and_without_gfxgraph(py, tmp_path):
    paths = {}
    for flag in ("0", "1"):
        paths[flag] = tmp_path / f"out_{flag}.pt"
        r = py(SCRIPT, env={"GFXGRAPH": flag, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, args=[str(paths[flag])])
        assert r.returncode == 0, r.stderr[-4000:]
    off, on = torch.load(paths["0"]), torch.load(paths["1"])
    assert off.pop("graph_class") == "CUDAGraph" and on.pop("graph_class") == "BridgedCUDAGraph"
    assert off.keys() == on.keys()
    for key in off:
        assert torch.equal(off[key], on[key]), key
