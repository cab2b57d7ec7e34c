"""Host time per replay(): BridgedCUDAGraph (enabled, stats on) over raw torch.cuda.CUDAGraph.

A 1-kernel graph, replayed in batches of 200 with a sync between batches (so
the launch queue never fills and blocks the host); raw and bridged batches are
interleaved in one run; the ratio of the medians is the figure. Target <= 1.05.
"""

from __future__ import annotations

import time

import torch

import gfxgraph
from _common import figure, median, parser, write
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
    })


if __name__ == "__main__":
    main()
