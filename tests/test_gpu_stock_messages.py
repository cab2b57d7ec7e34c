"""PyTorch's own error messages and exception types pass through gfxgraph (hints come after them).

For each misuse that stock PyTorch rejects itself, the same code runs in a fresh
interpreter twice: once on PyTorch's own ``CUDAGraph``, once on gfxgraph's
``BridgedCUDAGraph``. The exception types must be equal and PyTorch's message
must appear in gfxgraph's verbatim; gfxgraph's run must leave the process
usable (a new capture with a random op works, and eager random numbers too).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = """
import json, sys, torch
impl, case = sys.argv[1], sys.argv[2]
if impl == "stock":
    from hipgraph_bridge import OriginalCUDAGraph as Graph
else:
    import gfxgraph
    gfxgraph.enable()
    Graph = gfxgraph.BridgedCUDAGraph
s = torch.cuda.Stream()
x = torch.ones(16, device="cuda")


def captured():
    g = Graph()
    with torch.cuda.stream(s):
        g.capture_begin()
        y = x * 2
        g.capture_end()
    return g


def misuse():
    if case == "default_stream":
        Graph().capture_begin()
    elif case == "unknown_mode":
        with torch.cuda.stream(s):
            Graph().capture_begin(capture_error_mode="strict")
    elif case == "already_owns":
        g = captured()
        with torch.cuda.stream(s):
            g.capture_begin()
    elif case == "wrong_stream_end":
        g = Graph()
        with torch.cuda.stream(s):
            g.capture_begin()
            x.add_(1)
        with torch.cuda.stream(torch.cuda.Stream()):
            g.capture_end()
    elif case == "replay_before_capture":
        Graph().replay()
    elif case == "pool_before_capture":
        Graph().pool()


out = {}
try:
    misuse()
    out["raised"] = None
except Exception as exc:
    out["raised"] = type(exc).__name__
    out["message"] = str(exc)
if impl == "gfxgraph":
    torch.cuda.set_stream(torch.cuda.default_stream())
    torch.rand(8, device="cuda")  # eager random numbers work
    g = Graph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        z = x + torch.rand(16, device="cuda")
    g.replay()
    torch.cuda.synchronize()
    out["usable_after"] = True
print("RESULT" + json.dumps(out))
"""

CASES = ["default_stream", "unknown_mode", "already_owns", "wrong_stream_end", "replay_before_capture",
         "pool_before_capture"]


def _run(py, impl: str, case: str) -> dict:
    r = py(SCRIPT, args=[impl, case], timeout=120)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, f"{impl} {case}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("case", CASES)
def test_pytorchs_message_and_type_pass_through(py, case):
    stock = _run(py, "stock", case)
    ours = _run(py, "gfxgraph", case)
    assert stock["raised"] is not None, f"stock PyTorch accepted {case}: nothing to compare"
    assert ours["raised"] == stock["raised"], (stock, ours)
    stock_text = stock["message"].strip()
    assert stock_text in ours["message"], f"PyTorch said:\n{stock_text}\ngfxgraph said:\n{ours['message']}"
    assert ours["message"].index(stock_text) < ours["message"].index("[gfxgraph]")  # the hint comes after
    assert ours.get("usable_after") is True
