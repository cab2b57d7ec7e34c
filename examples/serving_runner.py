"""A serving-stack style graph runner (the low-level pattern SGLang and vLLM use), unchanged
code that gfxgraph makes safe: run it as ``GFXGRAPH=1 python examples/serving_runner.py``.

Needs: torch and a CUDA or ROCm GPU to capture graphs. Without a GPU it serves every request
eagerly on the CPU (as serving stacks do with graphs off) and says so; ``--requests N``
(default 200) sets the number of request batches.

* one memory pool, graphs captured largest batch first (smaller ones reuse its memory);
* ``torch.cuda.graph(g, pool=..., stream=...)`` per batch size, static input buffer;
* each request batch is padded up to the next captured size and sliced back.

With GFXGRAPH=1, ``torch.cuda.CUDAGraph`` is gfxgraph's BridgedCUDAGraph: a capture that fails
is ended cleanly instead of poisoning the stream, and ``gfxgraph.stats()`` counts everything.
"""

from __future__ import annotations

import argparse
import bisect
import random
import sys
import time

import torch

import gfxgraph

CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64]
WIDTH = 1024


class Runner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.static_in = torch.zeros(CAPTURE_SIZES[-1], WIDTH, device="cuda", dtype=torch.bfloat16)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        t0 = time.perf_counter()
        with torch.no_grad():
            for bs in reversed(CAPTURE_SIZES):  # largest first
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    model(self.static_in[:bs])  # warm-up
                torch.cuda.current_stream().wait_stream(self.stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                    self.outputs[bs] = model(self.static_in[:bs])
                self.graphs[bs] = g
        self.capture_s = time.perf_counter() - t0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n > CAPTURE_SIZES[-1]:
            with torch.no_grad():
                return self.model(x)  # too large for any graph
        bs = CAPTURE_SIZES[bisect.bisect_left(CAPTURE_SIZES, n)]
        self.static_in[:n].copy_(x)
        self.static_in[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n].clone()


def serve_eagerly(model: torch.nn.Module, requests: int) -> int:
    """The CPU path: the same request stream, every batch run eagerly (no graphs to capture)."""
    print("serving_runner: no GPU here, so every request runs eagerly on the CPU (no graphs captured)")
    rng = random.Random(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(requests):
            model(torch.randn(rng.randint(1, 80), WIDTH))
    print(f"served {requests} request batches eagerly in {time.perf_counter() - t0:.2f} s; "
          f"gfxgraph enabled={gfxgraph.is_enabled()}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(prog="serving_runner")
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
                                  for _ in range(6)]).eval()
    if not torch.cuda.is_available():
        return serve_eagerly(model, args.requests)
    model = model.cuda().to(torch.bfloat16)
    runner = Runner(model)
    rng = random.Random(0)
    worst = 0.0
    for _ in range(args.requests):
        x = torch.randn(rng.randint(1, 80), WIDTH, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            worst = max(worst, (runner.forward(x).float() - model(x).float()).abs().max().item())
    torch.cuda.synchronize()
    graph_cls = type(next(iter(runner.graphs.values()))).__name__
    snap = gfxgraph.stats()
    print(f"graph class: {graph_cls}; captured {len(runner.graphs)} graphs in {runner.capture_s:.3f} s; "
          f"max |graph - eager| = {worst:.3g}")
    print(f"gfxgraph.stats(): captures={snap['capture_count']} replays={snap['replay_count']} "
          f"fallbacks={snap['fallback_count']} pool={snap['graph_pool_bytes'] / 2**20:.1f} MiB")
    ok = worst < 0.1 and (graph_cls == "BridgedCUDAGraph") == gfxgraph.is_enabled()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
