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
  reduce-overhead's graph memory beside it;
* last, steady-state ms per call at each batch size of SWEEP, per mode (``per_batch_ms``, no
  target): where padding to a bucket shows.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import torch

from gfxgraph.suites._common import figure, parser, write
from hipgraph_bridge import ShapeBucketPool, graph_pool_bytes

WIDTH, BLOCKS, CALLS, MAX_BS = 512, 8, 300, 256
BUCKETS_20 = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 256]
BUCKETS_36 = sorted([1, 2, 4, 8, 12, *range(16, 257, 8)])
# batch sizes of the per-size sweep (buckets and sizes between them), and calls timed per size
SWEEP = (1, 2, 3, 4, 6, 8, 12, 16, 20, *range(24, 257, 8))
SWEEP_REPS = 20


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


def per_batch_ms(fn, sizes: tuple[int, ...], passes: int) -> dict[str, float]:
    """Steady-state ms per call at each batch size: the best of ``passes`` timed runs of
    SWEEP_REPS calls, after two untimed calls at that size (reduce-overhead records a size it has
    not seen on its second call). Keys: the sizes, as strings (JSON)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    out: dict[str, float] = {}
    for n in sizes:
        x = torch.randn(n, WIDTH, device="cuda", dtype=torch.bfloat16, generator=g)
        fn(x)
        fn(x)
        out[str(n)] = steady_ms_per_call(fn, [x] * SWEEP_REPS, passes)
    return out


def _hand_written(model: torch.nn.Module, stream: list[torch.Tensor], passes: int) -> tuple[HandWritten, dict]:
    hw_nogc = HandWritten(model, BUCKETS_20, freeze_gc=False)  # the first capture pays one-time set-up
    del hw_nogc
    torch.cuda.empty_cache()
    hw = HandWritten(model, BUCKETS_20, freeze_gc=True)
    gc_running_s = HandWritten(model, BUCKETS_20, freeze_gc=False).capture_s
    return hw, {"hw_capture_s": hw.capture_s, "hw_capture_gc_running_s": gc_running_s,
                "hw_ms": steady_ms_per_call(hw, stream, passes)}


def _pool(model: torch.nn.Module, stream: list[torch.Tensor], passes: int) -> tuple[ShapeBucketPool, dict]:
    t0 = time.perf_counter()
    pool = ShapeBucketPool(model, BUCKETS_20, progress=False)
    report = pool.capture_all(stream[0])
    first_pass_s = run_stream(pool, stream)
    total_s = time.perf_counter() - t0
    return pool, {"pool_capture_s": report["seconds"], "pool_report": report, "first_pass_s": first_pass_s,
                  "pool_total_s": total_s, "pool_ms": steady_ms_per_call(pool, stream, passes)}


def _memory(model: torch.nn.Module, stream: list[torch.Tensor]) -> tuple[list, dict]:
    """36 buckets in one pool vs the largest bucket alone (both pools stay alive: returned)."""
    alone = ShapeBucketPool(model, [BUCKETS_36[-1]], progress=False)
    alone.capture_all(stream[0])
    many = ShapeBucketPool(model, BUCKETS_36, progress=False)
    many_report = many.capture_all(stream[0])
    return [alone, many], {"alone_bytes": alone.pool_bytes(), "many_bytes": many.pool_bytes(),
                           "many_report": many_report}


def _reduce_overhead(model: torch.nn.Module, stream: list[torch.Tensor], passes: int) -> tuple[Any, dict]:
    torch.compiler.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    before_graph_bytes = graph_pool_bytes()
    with torch.no_grad():
        t0 = time.perf_counter()
        run_stream(compiled, stream)
        first_s = time.perf_counter() - t0
        ro_ms = steady_ms_per_call(compiled, stream, passes)
    return compiled, {"ro_first_s": first_s, "ro_ms": ro_ms, "ro_graph_bytes": graph_pool_bytes() - before_graph_bytes}


def _figures(m: dict) -> list[dict]:
    pool_ms, hw_ms, eager_ms, ro_first_s = m["pool_ms"], m["hw_ms"], m["eager_ms"], m["ro_first_s"]
    pool_capture_s, hw_capture_s, pool_total_s = m["pool_capture_s"], m["hw_capture_s"], m["pool_total_s"]
    many_bytes, alone_bytes, worst = m["many_bytes"], m["alone_bytes"], m["worst"]
    return [
        figure("eager, per call", eager_ms, None, None, "ms"),
        figure("hand-written bucket loop (20 buckets), per call", hw_ms, None, None, "ms"),
        figure("ShapeBucketPool (20 buckets), per call", pool_ms, None, None, "ms"),
        figure("reduce-overhead, per call (steady state)", m["ro_ms"], None, None, "ms"),
        figure("pool / hand-written (steady state)", pool_ms / hw_ms, "<= 1.05", pool_ms / hw_ms <= 1.05),
        figure("eager / pool (speed-up)", eager_ms / pool_ms, ">= 4", eager_ms / pool_ms >= 4),
        figure("pool total for the stream (capture + first pass)", pool_total_s, None, None, "s"),
        figure("reduce-overhead total for the stream (compile + recording)", ro_first_s, None, None, "s"),
        figure("reduce-overhead total / pool total", ro_first_s / pool_total_s, ">= 10",
               ro_first_s / pool_total_s >= 10),
        figure("hand-written capture, gc frozen", hw_capture_s, None, None, "s"),
        figure("hand-written capture, gc running (2M-object heap)", m["hw_capture_gc_running_s"], None, None, "s"),
        figure("pool capture_all", pool_capture_s, None, None, "s"),
        figure("pool capture / hand-written capture (gc frozen)", pool_capture_s / hw_capture_s, "<= 1.2",
               pool_capture_s / hw_capture_s <= 1.2),
        figure("graph pool, 36 buckets shared", many_bytes / 2**20, None, None, "MiB"),
        figure("graph pool, largest bucket alone", alone_bytes / 2**20, None, None, "MiB"),
        figure("36 shared / largest alone", many_bytes / alone_bytes, "<= 1.25", many_bytes / alone_bytes <= 1.25),
        figure("reduce-overhead graph memory (all its pools)", m["ro_graph_bytes"] / 2**20, None, None, "MiB",
               note="graph-pool bytes that appeared during the compiled run"),
        figure("max |pool - hand-written| over 50 calls", worst, "== 0", worst == 0.0),
    ]


def main() -> None:
    args = parser(__doc__).parse_args()
    passes = 2 if args.quick else 5
    model = make_model()
    stream = make_stream()
    # a server-sized heap of Python objects, so garbage collection has real work to do
    heap = [(i, str(i)) for i in range(2_000_000)]
    m: dict[str, Any] = {}
    with torch.no_grad():
        m["eager_ms"] = steady_ms_per_call(model, stream, passes)
    hw, more = _hand_written(model, stream, passes)
    m.update(more)
    pool, more = _pool(model, stream, passes)
    m.update(more)
    # correctness on the stream: the pool equals the hand-written loop bitwise (same graphs' work)
    with torch.no_grad():
        m["worst"] = max((pool(x).float() - hw(x).float()).abs().max().item() for x in stream[:50])
    keep, more = _memory(model, stream)
    m.update(more)
    del heap
    compiled, more = _reduce_overhead(model, stream, passes)
    m.update(more)
    # per batch size, after every figure above (a size the stream never drew records a new graph
    # for reduce-overhead, which must not count in its memory)
    with torch.no_grad():
        per_batch = {"eager": per_batch_ms(model, SWEEP, passes),
                     "reduce-overhead": per_batch_ms(compiled, SWEEP, passes)}
    per_batch.update({"hand-written": per_batch_ms(hw, SWEEP, passes), "pool": per_batch_ms(pool, SWEEP, passes)})
    write(args.out, "shape_bucketing", _figures(m), {
        "method": __doc__, "model": f"{BLOCKS} residual MLP blocks, width {WIDTH}, bf16",
        "calls": CALLS, "max_batch": MAX_BS, "buckets_20": BUCKETS_20, "buckets_36": BUCKETS_36,
        "pool_capture_report": m["pool_report"], "pool36_capture_report": m["many_report"],
        "first_pass_s": m["first_pass_s"], "per_batch_ms": per_batch, "sweep_reps": SWEEP_REPS,
    })
    del keep


if __name__ == "__main__":
    main()
