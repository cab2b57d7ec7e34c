"""Tier 2 on the device: compositor (gap 54), launch pipeline (gap 52), exec update (gap 53).

Figures and targets (issue 4):

* compositor: 3 children composed with GraphCompositor vs the same work captured as one
  monolithic graph (GPU time per launch, target <= 1.05x) and vs the 3 pieces replayed
  separately (reported). GPU time: CUDA events around 40 back-to-back launches, median
  of 15 interleaved rounds, after warm-up.
* pipeline: host time per LaunchPipeline.launch() vs torch's replay() of the same 1-kernel
  graph (reported), batches of 200 with a sync between batches, median of the batches;
  also per runtime binding (cuda-bindings, ctypes = the HIP code path), and the wall time
  of a launch+update step with 2 instances vs 1 (the update of a single instance waits
  for the launch in flight; double buffering removes that stall; reported).
* exec update: host time of GraphExecUpdate vs a new instantiation (+ destroy) of the
  same 120-kernel graph, median of 40 alternating repeats (target: update < re-instantiation).
"""

from __future__ import annotations

import time

import torch

from gfxgraph.suites._common import figure, median, parser, write
from hipgraph_bridge import OriginalCUDAGraph
from hipgraph_bridge.compose.compositor import GraphCompositor
from hipgraph_bridge.compose.pipeline import LaunchPipeline
from hipgraph_bridge.runtime import Graph, current_runtime, get_runtime

N = 1 << 20  # elements per tensor (4 MiB fp32)
KERNELS_PER_PIECE = 24


def piece(t: torch.Tensor) -> torch.Tensor:
    """One child's work: KERNELS_PER_PIECE elementwise kernels."""
    for _ in range(KERNELS_PER_PIECE // 2):
        t = t * 0.999 + 0.001
    return t


def warm(fn) -> None:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def capture(fn, *, keep_graph: bool = True, pool=None):
    warm(fn)
    g = OriginalCUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


def gpu_us_per_launch(launches: dict[str, object], reps: int, rounds: int) -> dict[str, float]:
    """Median GPU time per launch (us) of each callable, rounds interleaved."""
    samples: dict[str, list[float]] = {k: [] for k in launches}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for fn in launches.values():  # warm-up
        for _ in range(5):
            fn()  # type: ignore[operator]
    for r in range(rounds):
        names = list(launches) if r % 2 == 0 else list(reversed(launches))
        for name in names:
            fn = launches[name]
            torch.cuda.synchronize()
            start.record()
            for _ in range(reps):
                fn()  # type: ignore[operator]
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1000.0 / reps)
    return {k: median(v) for k, v in samples.items()}


def host_us_per_call(fns: dict[str, object], batch: int, rounds: int) -> dict[str, float]:
    """Median host time per call (us), batches of ``batch`` with a sync between them."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        names = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in names:
            fn = fns[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                fn()  # type: ignore[operator]
            samples[name].append((time.perf_counter_ns() - t0) / batch / 1000.0)
    torch.cuda.synchronize()
    return {k: median(v) for k, v in samples.items()}


# ------------------------------------------------------------------ compositor
def bench_compositor(rounds: int) -> tuple[list[dict], dict]:
    x = torch.randn(N, device="cuda")
    warm(lambda: piece(piece(piece(x))))
    comp = GraphCompositor()
    with comp.stage("a"):
        a = piece(x)
    with comp.stage("b", after=["a"]):
        b = piece(a)
    with comp.stage("c", after=["b"]):
        c = piece(b)
    comp.instantiate()
    pieces = [comp.child(n) for n in ("a", "b", "c")]
    for p in pieces:
        p.instantiate()
    mono, mono_out = capture(lambda: piece(piece(piece(x))), keep_graph=False)

    comp.launch()
    composed = c.clone()
    mono.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(composed, mono_out))

    stream = int(torch.cuda.current_stream().cuda_stream)

    def separate() -> None:
        for p in pieces:
            p.replay()

    us = gpu_us_per_launch({
        "monolithic": mono.replay,
        "composed": lambda: comp.launch(stream),
        "separate": separate,
    }, reps=40, rounds=rounds)
    ratio = us["composed"] / us["monolithic"]
    figures = [
        figure("compositor: monolithic graph, GPU time per launch", us["monolithic"], None, None, "us"),
        figure("compositor: 3 children composed, GPU time per launch", us["composed"], None, None, "us"),
        figure("compositor: 3 separate replays, GPU time per launch", us["separate"], None, None, "us"),
        figure("composed / monolithic", ratio, "<= 1.05", ratio <= 1.05,
               note=f"{3 * KERNELS_PER_PIECE} kernels over {N} floats; results equal: {same}"),
        figure("composed / 3 separate replays", us["composed"] / us["separate"], None, None),
    ]
    comp.close()
    return figures, {"compositor_results_equal": same, "compositor_us": us}


# -------------------------------------------------------------------- pipeline
def _pipeline_step_us(rounds: int, stream: torch.cuda.Stream) -> dict[int, float]:
    """Wall time (us) of a launch+update step with 1 and 2 instances, on a graph that keeps the GPU
    busy for a while."""
    y = torch.randn(N, device="cuda")
    tmp = torch.empty_like(y)

    def work(scale: float) -> None:
        torch.mul(y, scale, out=tmp)
        for _ in range(20):
            torch.mul(tmp, 1.0, out=tmp)

    ga, _ = capture(lambda: work(1.0))
    gb, _ = capture(lambda: work(1.0001))
    step_us = {}
    for n in (1, 2):
        pipe = LaunchPipeline(ga, instances=n, stream=stream)
        for _ in range(10):
            pipe.launch()
        samples = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for k in range(20):
                pipe.update(gb if k % 2 else ga)
                pipe.launch()
            torch.cuda.synchronize()
            samples.append((time.perf_counter_ns() - t0) / 20 / 1000.0)
        step_us[n] = median(samples)
        pipe.close()
    return step_us


def bench_pipeline(rounds: int) -> tuple[list[dict], dict]:
    x = torch.zeros(1, device="cuda")
    g, _ = capture(lambda: x.add_(1.0))  # one kernel
    g.instantiate()
    stream = torch.cuda.current_stream()
    pipes = {kind: LaunchPipeline(g, runtime=get_runtime(kind), stream=stream)
             for kind in ("cuda-bindings", "ctypes")}
    raw_exec = Graph.from_torch(g).instantiate()
    s = int(stream.cuda_stream)
    us = host_us_per_call({
        "torch replay()": g.replay,
        "LaunchPipeline.launch() cuda-bindings": pipes["cuda-bindings"].launch,
        "LaunchPipeline.launch() ctypes": pipes["ctypes"].launch,
        "GraphExec.launch(int stream)": lambda: raw_exec.launch(s),
    }, batch=200, rounds=rounds * 4)
    ratio = us["LaunchPipeline.launch() cuda-bindings"] / us["torch replay()"]
    figures = [
        figure("pipeline: torch replay() host time", us["torch replay()"], None, None, "us"),
        figure("pipeline: LaunchPipeline.launch() host time (cuda-bindings)",
               us["LaunchPipeline.launch() cuda-bindings"], None, None, "us"),
        figure("pipeline: LaunchPipeline.launch() host time (ctypes, HIP code path)",
               us["LaunchPipeline.launch() ctypes"], None, None, "us"),
        figure("pipeline: raw GraphExec.launch host time", us["GraphExec.launch(int stream)"],
               None, None, "us"),
        figure("pipeline launch / torch replay (host)", ratio, None, None,
               note="launch + completion-event record per call"),
    ]
    for p in pipes.values():
        p.close()
    raw_exec.close()

    step_us = _pipeline_step_us(rounds, stream)
    figures += [
        figure("pipeline: launch+update step, 1 instance (wall)", step_us[1], None, None, "us"),
        figure("pipeline: launch+update step, 2 instances (wall)", step_us[2], None, None, "us"),
        figure("launch+update step, 2 instances / 1 instance", step_us[2] / step_us[1], None, None,
               note="an update of the only instance waits for its launch in flight"),
    ]
    return figures, {"pipeline_host_us": us, "pipeline_step_us": step_us}


# ----------------------------------------------------------------- exec update
def bench_exec_update(rounds: int) -> tuple[list[dict], dict]:
    x = torch.randn(4096, device="cuda")
    tmp = torch.empty_like(x)

    def work(scale: float) -> None:
        torch.mul(x, scale, out=tmp)
        for _ in range(119):
            torch.add(tmp, 1.0, out=tmp)

    g1, _ = capture(lambda: work(3.0))
    g2, _ = capture(lambda: work(5.0))
    rt = current_runtime()
    a, b = Graph.from_torch(g1, runtime=rt), Graph.from_torch(g2, runtime=rt)
    exe = a.instantiate()
    exe.launch()
    torch.cuda.synchronize()
    update_us, inst_us, ok = [], [], True
    for k in range(rounds * 3):
        target = b if k % 2 == 0 else a
        t0 = time.perf_counter_ns()
        outcome = exe.update(target)
        update_us.append((time.perf_counter_ns() - t0) / 1000.0)
        ok = ok and outcome.ok
        t0 = time.perf_counter_ns()
        fresh = target.instantiate()
        fresh.close()
        inst_us.append((time.perf_counter_ns() - t0) / 1000.0)
    exe.launch()
    torch.cuda.synchronize()
    u, i = median(update_us), median(inst_us)
    figures = [
        figure("exec update: GraphExecUpdate host time", u, None, None, "us",
               note=f"120 kernel nodes; every update accepted: {ok}"),
        figure("exec update: instantiate + destroy host time", i, None, None, "us"),
        figure("exec update / re-instantiation", u / i, "< 1.0", u / i < 1.0),
    ]
    exe.close()
    return figures, {"exec_update_all_accepted": ok}


def main() -> None:
    args = parser(__doc__).parse_args()
    rounds = 5 if args.quick else 15
    t0 = time.perf_counter()
    rt = current_runtime()
    figures: list[dict] = []
    extra: dict = {"method": __doc__, "runtime": rt.describe(),
                   "ctypes_runtime": get_runtime("ctypes").describe()}
    for bench in (bench_compositor, bench_pipeline, bench_exec_update):
        f, e = bench(rounds)
        figures += f
        extra.update(e)
    extra["seconds"] = round(time.perf_counter() - t0, 1)
    write(args.out, "tier2", figures, extra)


if __name__ == "__main__":
    main()
