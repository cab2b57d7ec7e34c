"""Conditional execution decided on the device (gap 51): WHILE, IF and SWITCH nodes vs the host.

Figures and targets (issue 5), all in this process on one GPU:

* WHILE loop of 64 small iterations (an in-place body of 4 kernels on 4096 floats, the
  condition ``i < 64`` folded into the setter kernel), one run = reset the state + the loop:
  - vs a host loop running the same body eagerly and reading ``(i < 64).item()`` every
    iteration: >= 5x;
  - vs the host-driven strategy (a captured step graph and one ``.item()`` per iteration):
    reported;
  - vs the same 64 iterations unrolled into one graph (no condition): ratio reported.
* IF node overhead: device time per replay of a graph holding the setter kernel and an IF node
  around a branch (8 bf16 4096x4096 linear layers on 128 rows), vs the same branch captured
  unconditionally: <= 1.1x; the absolute overhead is reported beside it.
* SWITCH with 4 branches (``ConditionalGraph`` native: selector copied on the device, no host
  read) vs per-branch dispatch after a host read of the selector (``ConditionalGraph``
  dispatch), per call on random device selectors: ratio reported.

Run: ``python -m gfxgraph.suites.conditional --out DIR`` (under a minute on an H200).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from gfxgraph.suites._common import figure, parser, write
from hipgraph_bridge.conditional.native_nodes import BodyPool, NativeConditional, side_stream
from hipgraph_bridge.conditional.support import conditional_support
from hipgraph_bridge.conditional import ConditionalGraph
from hipgraph_bridge.conditional.loop import DeviceWhileLoop, LoopCondition
from hipgraph_bridge.conditional.kernels import setter_kernels

ITERS, N = 64, 4096
IF_ROWS, IF_WIDTH, IF_LAYERS = 128, 4096, 8
SW_ROWS, SW_WIDTH = 32, 1024


def wall_us(fn: Callable[[], object], reps: int, batches: int = 5) -> float:
    """Median over batches of the wall time per call, synchronised at each batch's end."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def device_us(fn: Callable[[], object], reps: int, batches: int = 5) -> float:
    """Median over batches of the device time per call (CUDA events around back-to-back calls)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------- WHILE loop
def body(i: torch.Tensor, x: torch.Tensor) -> None:
    x.mul_(0.999)
    x.add_(0.001)
    x.clamp_(-10.0, 10.0)
    i.add_(1)


def _unrolled(start_i: torch.Tensor, start_x: torch.Tensor) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """The same 64 iterations unrolled into one graph, with the same state reset; returns the
    run function and the state tensors it ends in."""
    i_u, x_u = start_i.clone(), start_x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body(i_u, x_u)
    torch.cuda.current_stream().wait_stream(s)
    unrolled = torch.cuda.CUDAGraph()
    with torch.cuda.graph(unrolled, stream=s):
        for _ in range(ITERS):
            body(i_u, x_u)

    def run_unrolled() -> None:
        i_u.copy_(start_i)
        x_u.copy_(start_x)
        unrolled.replay()

    return run_unrolled, i_u, x_u


def bench_while(quick: bool) -> tuple[list[dict], dict]:
    start_i = torch.zeros((), dtype=torch.int64, device="cuda")
    start_x = torch.randn(N, device="cuda")
    native = DeviceWhileLoop(LoopCondition(0, "<", ITERS), body, (start_i, start_x), max_iters=10 * ITERS,
                             strategy="native", copy_outputs=False)
    native.capture()
    host_graph = DeviceWhileLoop(LoopCondition(0, "<", ITERS), body, (start_i, start_x), max_iters=10 * ITERS,
                                 strategy="host", copy_outputs=False)
    host_graph.capture()

    def host_loop() -> None:
        i, x = start_i.clone(), start_x.clone()
        while (i < ITERS).item():
            body(i, x)

    run_unrolled, i_u, x_u = _unrolled(start_i, start_x)
    # every variant ends in the same state
    i_n, x_n = native.run(start_i, start_x)
    i_h, x_h = host_graph.run(start_i, start_x)
    run_unrolled()
    ref_i, ref_x = start_i.clone(), start_x.clone()
    while (ref_i < ITERS).item():
        body(ref_i, ref_x)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in ((i_n, ref_i), (i_h, ref_i), (i_u, ref_i)))
    worst = max(float((v - ref_x).abs().max()) for v in (x_n, x_h, x_u))
    iterations = int(native.iterations)

    reps = 5 if quick else 20
    t_native = wall_us(lambda: native.run(start_i, start_x), reps * 4)
    t_host_eager = wall_us(host_loop, reps)
    t_host_graph = wall_us(lambda: host_graph.run(start_i, start_x), reps)
    t_unrolled = wall_us(run_unrolled, reps * 4)
    speedup = t_host_eager / t_native
    figures = [
        figure("WHILE (native node), 64 iterations", t_native, None, None, "us"),
        figure("host loop, eager body + .item() per iteration", t_host_eager, None, None, "us"),
        figure("host-driven strategy, step graph + .item() per iteration", t_host_graph, None, None, "us"),
        figure("64 iterations unrolled in one graph", t_unrolled, None, None, "us"),
        figure("host loop (eager + .item()) / WHILE", speedup, ">= 5", speedup >= 5),
        figure("host-driven strategy / WHILE", t_host_graph / t_native, None, None),
        figure("WHILE / unrolled", t_native / t_unrolled, None, None,
               note="what deciding each iteration on the device costs over a fixed unrolled graph"),
        figure("WHILE per iteration", t_native / ITERS, None, None, "us"),
        figure("WHILE iterations counted on the device", iterations, "== 64", iterations == ITERS),
        figure("max |x| difference vs eager (all loop variants)", worst, "== 0", worst == 0.0 and same),
    ]
    return figures, {"while_body_kernels": 4, "while_state_elements": N}


# -------------------------------------------------------------------- IF node
def bench_if(quick: bool) -> tuple[list[dict], dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(IF_WIDTH, IF_WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen) / IF_WIDTH ** 0.5
               for _ in range(IF_LAYERS)]
    x = torch.randn(IF_ROWS, IF_WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)

    def branch(h: torch.Tensor) -> torch.Tensor:
        for w in weights:
            h = torch.nn.functional.gelu(h @ w)
        return h

    out_if = torch.empty_like(x)
    out_plain = torch.empty_like(x)
    pred = torch.ones((), dtype=torch.bool, device="cuda")
    s = torch.cuda.Stream()
    body_stream = side_stream(torch.cuda.current_device(), avoid=[s])
    for stream in (s, body_stream):  # cuBLAS keeps per-stream state: set it up before capture
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            branch(x)
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    pool = BodyPool(torch.cuda.current_device())
    native = NativeConditional(device=torch.cuda.current_device(), body_stream=body_stream, pool=pool)
    g_if, g_plain = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(g_if, stream=s):
            native.if_else(pred, [lambda: out_if.copy_(branch(x))])
        with torch.cuda.graph(g_plain, stream=s):
            out_plain.copy_(branch(x))
    g_if.replay()
    g_plain.replay()
    torch.cuda.synchronize()
    diff = float((out_if.float() - out_plain.float()).abs().max())
    reps = 50 if quick else 200
    t_plain = device_us(g_plain.replay, reps)
    t_if = device_us(g_if.replay, reps)
    pred.fill_(False)
    t_if_skipped = device_us(g_if.replay, reps)
    ratio = t_if / t_plain
    figures = [
        figure("branch captured unconditionally, per replay", t_plain, None, None, "us"),
        figure("setter + IF node around the branch, per replay", t_if, None, None, "us"),
        figure("IF / unconditional", ratio, "<= 1.1", ratio <= 1.1),
        figure("IF overhead per replay", t_if - t_plain, None, None, "us"),
        figure("IF replay with the predicate false (branch skipped)", t_if_skipped, None, None, "us"),
        figure("max |IF output - unconditional output|", diff, "<= 1e-2 (bf16)", diff <= 1e-2),
    ]
    return figures, {"if_branch": f"{IF_LAYERS} x gelu(h @ W), W {IF_WIDTH}x{IF_WIDTH} bf16, {IF_ROWS} rows"}


# ------------------------------------------------------------------ SWITCH node
def bench_switch(quick: bool) -> tuple[list[dict], dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    ws = [torch.randn(SW_WIDTH, SW_WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen) / SW_WIDTH ** 0.5
          for _ in range(4)]
    acts = [torch.relu, torch.tanh, torch.sigmoid, torch.nn.functional.gelu]
    x = torch.randn(SW_ROWS, SW_WIDTH, device="cuda", dtype=torch.bfloat16, generator=gen)

    def make(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda h: acts[k](h @ ws[k]) + h

    graphs = {}
    for strategy in ("native", "dispatch"):
        cg = ConditionalGraph(strategy=strategy, copy_outputs=False)
        for k in range(4):
            cg.add_branch(f"b{k}", make(k))
        cg.capture(x, selectors=("index",))
        graphs[strategy] = cg
    calls = 100 if quick else 400
    sels = torch.randint(0, 4, (calls,), device="cuda")
    worst = 0.0
    for k in range(16):
        a = graphs["native"].run(sels[k]).clone()
        b = graphs["dispatch"].run(sels[k])
        worst = max(worst, float((a.float() - b.float()).abs().max()))

    def sweep(cg: ConditionalGraph) -> Callable[[], None]:
        def run() -> None:
            for k in range(calls):
                cg.run(sels[k])
        return run

    t_native = wall_us(sweep(graphs["native"]), 1) / calls
    t_dispatch = wall_us(sweep(graphs["dispatch"]), 1) / calls
    figures = [
        figure("SWITCH (4 branches, device selector), per call", t_native, None, None, "us"),
        figure("per-branch dispatch after a host read, per call", t_dispatch, None, None, "us"),
        figure("dispatch / SWITCH", t_dispatch / t_native, None, None,
               note="the host read syncs every call; SWITCH leaves the host free"),
        figure("max |SWITCH - dispatch| over 16 calls", worst, "<= 1e-2 (bf16)", worst <= 1e-2),
    ]
    return figures, {"switch_strategies": {k: v.strategy for k, v in graphs.items()}}


def main() -> None:
    args = parser(__doc__).parse_args()
    support = conditional_support()
    if not support.while_loop or not support.branches:
        raise SystemExit(f"native conditional nodes are unavailable here: {support.reason}")
    kernels = setter_kernels()
    figures: list[dict] = []
    extra: dict = {"method": __doc__, "setter_image": kernels.image,
                   "driver_version": support.driver_version, "runtime_version": support.runtime_version}
    for bench in (bench_while, bench_if, bench_switch):
        figs, more = bench(args.quick)
        figures += figs
        extra.update(more)
    write(args.out, "conditional", figures, extra)


if __name__ == "__main__":
    main()
