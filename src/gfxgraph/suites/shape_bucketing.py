"""ShapeBucketPool vs a hand-written bucket loop, eager, and torch.compile(reduce-overhead).

One stream of 300 calls with batch sizes drawn from 1..256 (fixed seed), through a bf16
model of 8 residual MLP blocks of width 512. Every mode runs the same stream in this
process. Figures and targets (issue 3):

* steady-state time per call: pool within 5% of the hand-written loop (same buckets, same
  work per call: copy in, zero the padding, replay, copy the output), and >= 4x eager;
* total time for the stream including capture/compile: pool >= 10x reduce-overhead;
* capture time: pool capture_all within 1.2x of the hand-written loop (gc frozen), with the
  hand-written loop also timed with the garbage collector running, to show what freezing buys;
* memory: 36 buckets in one shared pool <= 1.25x the largest bucket captured alone, with
  reduce-overhead's graph memory beside it.
"""

from __future__ import annotations

import gc
import random
import time

import torch

from _common import figure, parser, write
from hipgraph_bridge import ShapeBucketPool, graph_pool_bytes

WIDTH, BLOCKS, CALLS, MAX_BS = 512, 8, 300, 256
BUCKETS_20 = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 256]
BUCKETS_36 = sorted([1, 2, 4, 8, 12, *range(16, 257, 8)])


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(BLOCKS)]).cuda().to(torch.bfloat16).eval()


def make_stream() -> list[torch.Tensor]:
    rng = random.Random(0)
    sizes = [rng.randint(1, MAX_BS) for _ in range(CALLS)]
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(n, WIDTH, device="cuda", dtype=torch.bfloat16, generator=g) for n in sizes]


def run_stream(fn, stream: list[torch.Tensor]) -> float:
    """Seconds for one pass over the stream, synchronised at the end."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x in stream:
        fn(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def steady_ms_per_call(fn, stream: list[torch.Tensor], passes: int) -> float:
    return min(run_stream(fn, stream) for _ in range(passes)) / len(stream) * 1e3


class HandWritten:
    """What serving stacks write by hand: one graph per bucket in one pool, largest first."""

    def __init__(self, model: torch.nn.Module, buckets: list[int], *, freeze_gc: bool) -> None:
        self.buckets = buckets
        self.table = [0] * (buckets[-1] + 1)
        j = 0
        for n in range(1, buckets[-1] + 1):
            while buckets[j] < n:
                j += 1
            self.table[n] = buckets[j]
        self.static_in = torch.zeros(buckets[-1], WIDTH, device="cuda", dtype=torch.bfloat16)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if freeze_gc:
            gc.freeze()
            gc.disable()
        try:
            with torch.no_grad():
                for b in reversed(buckets):
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        model(self.static_in[:b])  # warm-up
                    torch.cuda.current_stream().wait_stream(stream)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self.outs[b] = model(self.static_in[:b])
                    self.graphs[b] = g
        finally:
            if freeze_gc:
                gc.enable()
                gc.unfreeze()
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.pool = pool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        b = self.table[n]
        self.static_in[:n].copy_(x)
        if b > n:
            self.static_in[n:b].fill_(0)
        self.graphs[b].replay()
        return self.outs[b][:n].clone()


def main() -> None:
    args = parser(__doc__).parse_args()
    passes = 2 if args.quick else 5
    model = make_model()
    stream = make_stream()
    # a server-sized heap of Python objects, so garbage collection has real work to do
    heap = [(i, str(i)) for i in range(2_000_000)]

    with torch.no_grad():
        eager_ms = steady_ms_per_call(model, stream, passes)

    hw_nogc = HandWritten(model, BUCKETS_20, freeze_gc=False)
    del hw_nogc
    torch.cuda.empty_cache()
    hw = HandWritten(model, BUCKETS_20, freeze_gc=True)
    hw_capture_gc_running = HandWritten(model, BUCKETS_20, freeze_gc=False).capture_s
    hw_ms = steady_ms_per_call(hw, stream, passes)

    t0 = time.perf_counter()
    pool = ShapeBucketPool(model, BUCKETS_20, progress=False)
    report = pool.capture_all(stream[0])
    pool_capture_s = report["seconds"]
    first_pass_s = run_stream(pool, stream)
    pool_total_s = time.perf_counter() - t0
    pool_ms = steady_ms_per_call(pool, stream, passes)

    # correctness on the stream: the pool equals the hand-written loop bitwise (same graphs' work)
    worst = 0.0
    with torch.no_grad():
        for x in stream[:50]:
            worst = max(worst, (pool(x).float() - hw(x).float()).abs().max().item())

    # memory: 36 buckets in one pool vs the largest bucket alone
    alone = ShapeBucketPool(model, [BUCKETS_36[-1]], progress=False)
    alone.capture_all(stream[0])
    alone_bytes = alone.pool_bytes()
    many = ShapeBucketPool(model, BUCKETS_36, progress=False)
    many_report = many.capture_all(stream[0])
    many_bytes = many.pool_bytes()
    del heap

    # torch.compile(mode="reduce-overhead") on the same stream
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    before_graph_bytes = graph_pool_bytes()
    with torch.no_grad():
        t0 = time.perf_counter()
        run_stream(compiled, stream)
        ro_first_s = time.perf_counter() - t0
        ro_ms = steady_ms_per_call(compiled, stream, passes)
    ro_graph_bytes = graph_pool_bytes() - before_graph_bytes

    figures = [
        figure("eager, per call", eager_ms, None, None, "ms"),
        figure("hand-written bucket loop (20 buckets), per call", hw_ms, None, None, "ms"),
        figure("ShapeBucketPool (20 buckets), per call", pool_ms, None, None, "ms"),
        figure("reduce-overhead, per call (steady state)", ro_ms, None, None, "ms"),
        figure("pool / hand-written (steady state)", pool_ms / hw_ms, "<= 1.05", pool_ms / hw_ms <= 1.05),
        figure("eager / pool (speed-up)", eager_ms / pool_ms, ">= 4", eager_ms / pool_ms >= 4),
        figure("pool total for the stream (capture + first pass)", pool_total_s, None, None, "s"),
        figure("reduce-overhead total for the stream (compile + recording)", ro_first_s, None, None, "s"),
        figure("reduce-overhead total / pool total", ro_first_s / pool_total_s, ">= 10",
               ro_first_s / pool_total_s >= 10),
        figure("hand-written capture, gc frozen", hw.capture_s, None, None, "s"),
        figure("hand-written capture, gc running (2M-object heap)", hw_capture_gc_running, None, None, "s"),
        figure("pool capture_all", pool_capture_s, None, None, "s"),
        figure("pool capture / hand-written capture (gc frozen)", pool_capture_s / hw.capture_s, "<= 1.2",
               pool_capture_s / hw.capture_s <= 1.2),
        figure("graph pool, 36 buckets shared", many_bytes / 2**20, None, None, "MiB"),
        figure("graph pool, largest bucket alone", alone_bytes / 2**20, None, None, "MiB"),
        figure("36 shared / largest alone", many_bytes / alone_bytes, "<= 1.25", many_bytes / alone_bytes <= 1.25),
        figure("reduce-overhead graph memory (all its pools)", ro_graph_bytes / 2**20, None, None, "MiB",
               note="graph-pool bytes that appeared during the compiled run"),
        figure("max |pool - hand-written| over 50 calls", worst, "== 0", worst == 0.0),
    ]
    write(args.out, "shape_bucketing", figures, {
        "method": __doc__, "model": f"{BLOCKS} residual MLP blocks, width {WIDTH}, bf16",
        "calls": CALLS, "max_batch": MAX_BS, "buckets_20": BUCKETS_20, "buckets_36": BUCKETS_36,
        "pool_capture_report": report, "pool36_capture_report": many_report,
        "first_pass_s": first_pass_s,
    })


if __name__ == "__main__":
    main()
