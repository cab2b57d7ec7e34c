"""What the device loop adds per iteration: the WHILE loop against the same body replayed in a plain graph.

A diagnostic for issue 26 (not a suite: no targets). For bodies of ``n`` kernels, tiny ones (an in-place
add on 1024 floats) and heavy ones (bf16 2048x2048 linear layers on one row and a scale, two kernels
each, as a decode step's are), a ``DeviceDecodeLoop`` over a step that runs the body and returns ``tokens + 1`` decodes 256 tokens in one
launch (CUDA events, the median of 5 runs), and the same step plus the token's copy, captured in a plain
graph, is replayed 256 times back to back behind a GPU sleep (the GPU's time, not the host's launches).
The difference per iteration is what the loop costs: the conditional node, the bookkeeping kernel, and
whatever a kernel costs more inside a conditional body than in a top-level graph.

    python tools/loop_costs.py --out bench-out      # a GPU: JSON and a table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch

from gfxgraph.suites._common import capture_graph, gpu_ms_per_replay
from hipgraph_bridge.generation.device_loop import DeviceDecodeLoop

TOKENS = 256


def body(kind: str, n: int) -> Callable[[], None]:
    """``n`` kernels of ``kind`` ("tiny": an add on 1024 floats; "linear": a linear layer and a scale, two
    kernels each, on a (1, 2048) bf16 row)."""
    if kind == "tiny":
        buf = torch.zeros(1024, device="cuda")

        def tiny() -> None:
            for _ in range(n):
                buf.add_(1.0)
        return tiny
    ws = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(n // 2)]
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    def linears() -> None:
        h = x
        for w in ws:
            h = torch.nn.functional.linear(h, w) * 0.01
        x.copy_(h)
    return linears


def loop_us(run: Callable[[], None]) -> float:
    """Microseconds per token of a loop over ``run``, 256 tokens in one launch."""
    def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        run()
        return tokens + 1

    loop = DeviceDecodeLoop(step, batch_size=1, chunk=TOKENS)
    tok, pos = torch.zeros(1, dtype=torch.long, device="cuda"), torch.zeros((), dtype=torch.long, device="cuda")
    loop.generate(tok, pos, max_new_tokens=4)  # captured
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loop.generate(tok, pos, max_new_tokens=TOKENS)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / TOKENS)
    loop.close()
    return statistics.median(runs)


def graph_us(run: Callable[[], None]) -> float:
    """Microseconds per replay of ``run`` and a token copy in a plain graph, replayed behind a GPU sleep."""
    tok = torch.zeros(1, dtype=torch.long, device="cuda")
    g = capture_graph(lambda: (run(), tok.add_(1)))
    return statistics.median(gpu_ms_per_replay(g.replay, TOKENS) * 1e3 for _ in range(5))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loop_costs: needs a GPU")
    results = {}
    for kind, sizes in (("tiny", (1, 16, 64, 256)), ("linear", (16, 64))):
        for n in sizes:
            run = body(kind, n)
            lp, gr = loop_us(run), graph_us(run)
            results[f"{n} {kind} kernels"] = {"loop_us_per_iteration": lp, "graph_us_per_replay": gr,
                                              "difference_us": lp - gr}
            print(f"{n} {kind} kernels: loop {lp:.2f} us/iteration, plain graph {gr:.2f} us/replay, "
                  f"difference {lp - gr:.2f} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "loop_costs.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "method": __doc__,
                   "results": results}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
