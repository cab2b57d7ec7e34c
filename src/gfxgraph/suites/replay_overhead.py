"""Host time per replay(): BridgedCUDAGraph (enabled, stats on) over raw torch.cuda.CUDAGraph.

A 1-kernel graph, replayed in batches of 200 with a sync between batches (so
the launch queue never fills and blocks the host); raw and bridged batches are
interleaved in one run; the ratio of the medians is the figure. Target <= 1.05.
"""

from __future__ import annotations

import statistics
import time

import torch

import gfxgraph
from gfxgraph.suites._common import figure, median, parser, write
from hipgraph_bridge import OriginalCUDAGraph


def _capture(cls: type, x: torch.Tensor) -> object:
    g = cls()
    s = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        x.add_(1.0)  # one kernel
    return g


def _batch_us(g: object, n: int) -> float:
    replay = g.replay  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        replay()
    t1 = time.perf_counter_ns()
    return (t1 - t0) / n / 1000.0


def _per_call_ns(fn: object, n: int = 20000) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()  # type: ignore[operator]
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    return (t1 - t0) / n


def breakdown(raw: object, bridged: object) -> dict[str, float]:
    """Where the bridged replay's extra host time goes (ns per call, medians of 7)."""
    parts = {
        "raw.replay()": raw.replay,  # type: ignore[attr-defined]
        "bridged.replay()": bridged.replay,  # type: ignore[attr-defined]
        "OriginalCUDAGraph.replay(bridged)": lambda: OriginalCUDAGraph.replay(bridged),
        "bridged.state read": lambda: bridged.state,  # type: ignore[attr-defined]
        "time.perf_counter_ns()": time.perf_counter_ns,
        "empty lambda": lambda: None,
    }
    return {k: statistics.median(_per_call_ns(f, 4000) for _ in range(7)) for k, f in parts.items()}


def main() -> None:
    args = parser(__doc__).parse_args()
    rounds = 50 if args.quick else 400
    n = 200
    gfxgraph.enable()
    x = torch.zeros(1, device="cuda")
    raw = _capture(OriginalCUDAGraph, x)
    bridged = _capture(torch.cuda.CUDAGraph, x)  # BridgedCUDAGraph once enabled
    assert type(bridged).__name__ == "BridgedCUDAGraph"
    for g in (raw, bridged):
        _batch_us(g, n)  # warm-up
    raw_us, br_us = [], []
    for i in range(rounds):
        order = (raw, bridged) if i % 2 == 0 else (bridged, raw)
        for g in order:
            (raw_us if g is raw else br_us).append(_batch_us(g, n))
    torch.cuda.synchronize()
    # every replay ran its kernel: warm-up (2n) plus the timed batches (capture runs nothing)
    assert x.item() == float(2 * n + rounds * n * 2), x.item()
    r, b = median(raw_us), median(br_us)
    snap = gfxgraph.stats()
    parts = breakdown(raw, bridged)
    for k, v in parts.items():
        print(f"  {k:40s} {v:8.1f} ns")
    figures = [
        figure("raw torch.cuda.CUDAGraph replay (host)", r, None, None, "us"),
        figure("BridgedCUDAGraph replay (host, stats on)", b, None, None, "us"),
        figure("bridged / raw", b / r, "<= 1.05", b / r <= 1.05),
        figure("stats replay_us_p50 (bridged)", snap["replay_us_p50"], None, None, "us"),
    ]
    write(args.out, "replay_overhead", figures, {
        "method": __doc__, "rounds": rounds, "replays_per_batch": n,
        "raw_us_samples_quartiles": [sorted(raw_us)[len(raw_us) // 4], r, sorted(raw_us)[3 * len(raw_us) // 4]],
        "bridged_us_samples_quartiles": [sorted(br_us)[len(br_us) // 4], b, sorted(br_us)[3 * len(br_us) // 4]],
        "stats_replay_count": snap["replay_count"],
        "breakdown_ns": parts,
    })


if __name__ == "__main__":
    main()
