"""Soak: many replays and many capture/reset cycles with memory flat, and prompt release of graphs.

Counts scale with ``GFXGRAPH_RELIABILITY_SCALE`` (the committed run uses 1.0:
1,000,000 replays and 10,000 capture/reset cycles). Memory is read after a
warm-up phase (the baseline) and at ten checkpoints: the caching allocator's
``memory_allocated``/``memory_reserved`` (after ``empty_cache`` for the
capture/reset soak, so that only memory still owned by something counts) and
the process RSS from ``/proc/self/statm``. Every checkpoint must be within 1%
of the baseline (allocator figures also within one 2 MiB segment, since the
baseline of a tiny graph is a few MiB).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph
from hipgraph_bridge import OriginalCUDAGraph
from rel_registry import Ctx, Skip, case
from rel_tools import memory_sample

TOLERANCE = 0.01
SEGMENT = 2 << 20  # the allocator's small-segment size: one segment of slack for tiny baselines


def _check_flat(ctx: Ctx, base: dict[str, int], samples: list[dict[str, int]]) -> None:
    worst: dict[str, float] = {}
    problems = []
    for key in ("allocated", "reserved", "rss"):
        b = base[key]
        slack = max(TOLERANCE * b, SEGMENT if key != "rss" else 0)
        peak = max(s[key] for s in samples)
        worst[key] = (peak - b) / b if b else float(peak)
        if peak - b > slack:
            problems.append(f"{key}: baseline {b} B, peak {peak} B (+{(peak - b) / 2**20:.2f} MiB)")
    ctx.observed["growth_fraction"] = worst
    ctx.observed["baseline"] = base
    ctx.observed["checkpoints"] = samples
    assert not problems, "memory not flat within 1%: " + "; ".join(problems)


@case("soak_replay_1m", "soak", api="low-level replay", kind="1,000,000 replays of a tiny graph, stats on",
      timeout=170.0, cost=30.0)
def _replays(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU")
    total = max(20_000, int(1_000_000 * ctx.scale))
    warm = total // 20
    gfxgraph.enable()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    acc = torch.zeros(1, dtype=torch.int64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        acc.add_(1)
    acc.zero_()
    torch.cuda.synchronize()
    gfxgraph.reset_stats()
    replay = g.replay
    for _ in range(warm):
        replay()
    gfxgraph.stats()  # its first call initialises what it needs: before the baseline
    base = memory_sample()
    samples = []
    per = (total - warm) // 10
    t0 = time.perf_counter()
    for _ in range(10):
        for _ in range(per):
            replay()
        samples.append(memory_sample())
        gfxgraph.stats()  # the snapshot path too, while the counters grow
    seconds = time.perf_counter() - t0
    done = warm + 10 * per
    snap = gfxgraph.stats()
    ctx.observed.update(replays=done, us_per_replay=round(seconds / (10 * per) * 1e6, 3),
                        stats={k: snap[k] for k in ("replay_count", "replay_samples", "avg_replay_us",
                                                    "replay_us_p50", "replay_us_p99")})
    assert int(acc.item()) == done, f"the graph ran {int(acc.item())} times, {done} replays were asked"
    assert snap["replay_count"] == done, f"stats count {snap['replay_count']} replays, {done} were made"
    _check_flat(ctx, base, samples)


@case("soak_capture_reset_10k", "soak", api="torch.cuda.graph + reset()", kind="10,000 capture/replay/reset "
      "cycles of one graph object", timeout=170.0, cost=25.0)
def _cycles(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU")
    total = max(200, int(10_000 * ctx.scale))
    warm = total // 10
    gfxgraph.enable()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    x = torch.ones(4096, device="cuda")
    g = torch.cuda.CUDAGraph()
    want = torch.full_like(x, 3.0)

    def cycle(i: int) -> None:
        with torch.cuda.graph(g, stream=s):
            y = x * 2 + 1  # allocates its output in the graph's pool
        g.replay()
        if i % 97 == 0:
            torch.cuda.synchronize()
            assert torch.equal(y, want), f"cycle {i}: replay is wrong"
        del y
        g.reset()

    gfxgraph.reset_stats()
    for i in range(warm):
        cycle(i)
    base = memory_sample(empty_cache=True)
    samples = []
    per = (total - warm) // 10
    t0 = time.perf_counter()
    for c in range(10):
        for i in range(per):
            cycle(warm + c * per + i)
        samples.append(memory_sample(empty_cache=True))
    seconds = time.perf_counter() - t0
    done = warm + 10 * per
    snap = gfxgraph.stats()
    ctx.observed.update(cycles=done, ms_per_cycle=round(seconds / (10 * per) * 1e3, 4),
                        stats={k: snap[k] for k in ("capture_count", "capture_failures", "capture_seconds")})
    assert snap["capture_count"] == done and snap["capture_failures"] == 0, snap
    _check_flat(ctx, base, samples)


@case("soak_graph_released_without_gc", "soak", api="BridgedCUDAGraph lifetime",
      kind="a dropped captured graph returns its pool at once, like torch.cuda.CUDAGraph (no gc run needed)")
def _release(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    x = torch.ones(16 << 20, device="cuda")  # 64 MiB: the output makes the pool's memory obvious
    result: dict[str, Any] = {}
    was = gc.isenabled()
    gc.disable()
    try:
        for cls in (OriginalCUDAGraph, BridgedCUDAGraph):
            base = memory_sample(empty_cache=True)["reserved"]
            g = cls()
            with torch.cuda.graph(g, stream=s):
                y = x * 2
            g.replay()
            held = memory_sample(empty_cache=True)["reserved"]
            del y, g
            after_drop = memory_sample(empty_cache=True)["reserved"]
            gc.collect()
            after_gc = memory_sample(empty_cache=True)["reserved"]
            result[cls.__name__] = {"base_mib": base / 2**20, "held_mib": held / 2**20,
                                    "after_drop_mib": after_drop / 2**20, "after_gc_mib": after_gc / 2**20}
    finally:
        if was:
            gc.enable()
    ctx.observed["reserved"] = result
    bridged = result["BridgedCUDAGraph"]
    assert bridged["after_drop_mib"] <= bridged["base_mib"] + 2, (
        f"dropping a captured BridgedCUDAGraph kept {bridged['after_drop_mib'] - bridged['base_mib']:.0f} MiB "
        f"reserved until a gc run (PyTorch's own graph: {result['CUDAGraph']})")
