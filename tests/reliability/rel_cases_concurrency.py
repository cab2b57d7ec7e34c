"""Concurrency: stats and replays from many threads, captures in several threads, shared pools.

Counts scale with ``GFXGRAPH_RELIABILITY_SCALE`` (floors keep a smoke run meaningful).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

import gfxgraph
from gfxgraph import BridgedCUDAGraph, ShapeBucketPool
from hipgraph_bridge import OriginalCUDAGraph
from rel_registry import Ctx, SilentWrong, Skip, case
from rel_tools import check_healthy, describe_exc


def _gpu(ctx: Ctx) -> None:
    if not ctx.gpu:
        raise Skip("needs a GPU")


def _join_all(threads: list[threading.Thread], timeout: float) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads did not finish: {stuck}"


@case("conc_stats_and_replays_8_threads", "concurrency", api="low-level replay + gfxgraph.stats()",
      kind="8 threads replay their own graphs and call stats(); a 9th reads stats continuously",
      timeout=120.0, cost=8.0)
def _stats_replays(ctx: Ctx) -> None:
    _gpu(ctx)
    threads_n, per = 8, max(2_000, int(20_000 * ctx.scale))
    gfxgraph.enable()
    graphs = []
    for i in range(threads_n):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        acc = torch.zeros(1, dtype=torch.int64, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            acc.add_(i + 1)
        acc.zero_()
        graphs.append((s, g, acc))
    torch.cuda.synchronize()
    gfxgraph.reset_stats()
    errors: list[str] = []
    stop = threading.Event()
    reader: dict[str, Any] = {"snapshots": 0, "non_monotonic": 0}

    def worker(i: int) -> None:
        s, g, _ = graphs[i]
        try:
            with torch.cuda.stream(s):
                for k in range(per):
                    g.replay()
                    if k % 1000 == 0:
                        snap = gfxgraph.stats()
                        assert snap["replay_count"] >= 0 and "fallback_reasons" in snap
                s.synchronize()
        except BaseException as exc:  # noqa: BLE001
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    def read_stats() -> None:
        last = 0
        try:
            while not stop.is_set():
                n = gfxgraph.stats()["replay_count"]
                reader["snapshots"] += 1
                if n < last:
                    reader["non_monotonic"] += 1
                last = n
        except BaseException as exc:  # noqa: BLE001
            errors.append(f"stats reader: {type(exc).__name__}: {exc}")

    r = threading.Thread(target=read_stats, name="stats-reader")
    r.start()
    try:
        _join_all([threading.Thread(target=worker, args=(i,), name=f"replayer-{i}") for i in range(threads_n)],
                  100.0)
    finally:
        stop.set()
        r.join(10)
    torch.cuda.synchronize()
    snap = gfxgraph.stats()
    ctx.observed.update(replays_per_thread=per, reader=reader,
                        stats={k: snap[k] for k in ("replay_count", "replay_samples", "avg_replay_us")})
    assert not errors, errors
    for i, (_, _, acc) in enumerate(graphs):
        assert int(acc.item()) == per * (i + 1), f"thread {i}: its graph ran {int(acc.item()) // (i + 1)} times"
    assert snap["replay_count"] == threads_n * per, f"stats counted {snap['replay_count']} of {threads_n * per}"
    assert reader["non_monotonic"] == 0, reader
    assert snap["replay_samples"] > 0 and snap["avg_replay_us"] > 0


def _concurrent_captures(ctx: Ctx, *, rng: bool) -> dict[str, Any]:
    threads_n, rounds = 6, max(3, int(10 * ctx.scale))
    gfxgraph.enable()
    barrier = threading.Barrier(threads_n, timeout=60)
    results: list[list[Any]] = [[] for _ in range(threads_n)]
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            s = torch.cuda.Stream()
            x = torch.full((4096,), float(i + 1), device="cuda")
            s.wait_stream(torch.cuda.current_stream())
            for r in range(rounds):
                g = torch.cuda.CUDAGraph()
                barrier.wait()
                err = None
                with torch.cuda.stream(s):
                    g.capture_begin(capture_error_mode="thread_local")
                    try:
                        y = x * (r + 2) + 1
                        noise = torch.rand(256, device="cuda") if rng else None
                        barrier.wait()  # every thread is inside its capture now
                        z = y.sum()
                    finally:
                        try:
                            g.capture_end()
                        except Exception as exc:  # noqa: BLE001
                            err = exc
                barrier.wait()  # every capture has ended
                if err is None:
                    with torch.cuda.stream(s):
                        g.replay()
                results[i].append((g, y, z, noise, float(i + 1) * (r + 2) + 1, describe_exc(err)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")
            barrier.abort()

    _join_all([threading.Thread(target=worker, args=(i,), name=f"capturer-{i}") for i in range(threads_n)], 120.0)
    torch.cuda.synchronize()
    assert not errors, errors
    failed = []
    repeats = 0
    for i, per in enumerate(results):
        for r, (g, y, z, noise, v, err) in enumerate(per):
            if err is not None:
                failed.append({"thread": i, "round": r, "error": err})
                continue
            assert torch.equal(y, torch.full_like(y, v)), f"thread {i} round {r}: replay is wrong"
            assert float(z.item()) == v * y.numel(), f"thread {i} round {r}: the reduction is wrong"
            if noise is not None:
                first = noise.clone()
                g.replay()
                torch.cuda.synchronize()
                repeats += int(torch.equal(first, noise))
    snap = gfxgraph.stats()
    return {"threads": threads_n, "rounds": rounds, "failed": failed, "rng_repeats": repeats,
            "stats": {k: snap[k] for k in ("capture_count", "capture_failures")}}


@case("conc_thread_local_captures", "concurrency", api="low-level, capture_error_mode=thread_local",
      kind="6 threads capture at the same time, each on its own stream and graph", timeout=120.0, cost=5.0)
def _captures(ctx: Ctx) -> None:
    _gpu(ctx)
    out = _concurrent_captures(ctx, rng=False)
    ctx.observed.update(out)
    assert not out["failed"], out["failed"]
    assert out["stats"]["capture_count"] == out["threads"] * out["rounds"], out["stats"]
    check_healthy([torch.cuda.Stream()])


@case("conc_thread_local_captures_with_rng", "concurrency", api="low-level, capture_error_mode=thread_local",
      kind="6 threads capture random ops at the same time (safety: no abort, each capture works or fails "
           "cleanly, RNG healthy afterwards)", timeout=120.0, cost=5.0)
def _captures_rng(ctx: Ctx) -> None:
    _gpu(ctx)
    out = _concurrent_captures(ctx, rng=True)
    ctx.observed.update(out)
    ok = out["threads"] * out["rounds"] - len(out["failed"])
    assert out["stats"]["capture_count"] == ok, out["stats"]
    assert out["stats"]["capture_failures"] >= len(out["failed"]), "failed captures were not counted"
    check_healthy([torch.cuda.Stream()])
    if out["rng_repeats"]:
        raise SilentWrong(f"{out['rng_repeats']} graphs captured concurrently replay the same random numbers")


def _pool_threads(ctx: Ctx, *, own_streams: bool) -> None:
    _gpu(ctx)
    threads_n, calls = 4, max(10, int(60 * ctx.scale))
    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda") / 64

    def model(x: torch.Tensor) -> torch.Tensor:  # ~0.1 ms of GPU work per call: overlap is likely if allowed
        for _ in range(8):
            x = torch.tanh(x @ w)
        return x

    gfxgraph.enable()
    pool = ShapeBucketPool(model, [8, 16, 32], progress=False)
    errors: list[str] = []
    wrong: list[str] = []
    barrier = threading.Barrier(threads_n, timeout=60)

    def worker(i: int) -> None:
        try:
            s = torch.cuda.Stream() if own_streams else torch.cuda.default_stream()
            gen = torch.Generator(device="cuda").manual_seed(i)
            inputs = [torch.randn(3 + (i * 7 + k) % 29, 4096, device="cuda", generator=gen) for k in range(calls)]
            torch.cuda.synchronize()
            barrier.wait()
            outs = []
            with torch.cuda.stream(s), torch.no_grad():
                for x in inputs:
                    outs.append(pool(x))
            s.synchronize()
            with torch.no_grad():
                for k, (x, o) in enumerate(zip(inputs, outs)):
                    if not torch.allclose(o, model(x), rtol=1e-3, atol=1e-4):
                        wrong.append(f"thread {i} call {k} (batch {x.shape[0]})")
        except BaseException as exc:  # noqa: BLE001
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")
            barrier.abort()

    with torch.no_grad():
        pool.capture_all(torch.randn(4, 4096, device="cuda"))
    _join_all([threading.Thread(target=worker, args=(i,)) for i in range(threads_n)], 100.0)
    ctx.observed.update(threads=threads_n, calls_per_thread=calls, wrong_results=len(wrong),
                        first_wrong=wrong[:5], captured=pool.captured_buckets)
    assert not errors, errors
    if wrong:
        raise SilentWrong(f"{len(wrong)} of {threads_n * calls} pool calls from concurrent threads returned "
                          f"another call's data: {wrong[:3]}")


@case("conc_pool_threads_default_stream", "concurrency", api="ShapeBucketPool",
      kind="4 threads call one pool (all on the default stream)", timeout=120.0, cost=4.0)
def _pool_default(ctx: Ctx) -> None:
    _pool_threads(ctx, own_streams=False)


@case("conc_pool_threads_own_streams", "concurrency", api="ShapeBucketPool",
      kind="4 threads call one pool, each from its own current stream")
def _pool_streams(ctx: Ctx) -> None:
    _pool_threads(ctx, own_streams=True)


@case("conc_enable_disable_while_capturing", "concurrency", where="any", api="gfxgraph.enable()/disable()",
      kind="8 threads toggle enable()/disable() while the main thread captures and replays", timeout=90.0)
def _toggling(ctx: Ctx) -> None:
    original = torch.cuda.CUDAGraph
    errors: list[str] = []

    def toggler(i: int) -> None:
        try:
            k = 0
            while k < 2_000:
                if (i + k) % 2:
                    gfxgraph.enable(validate=bool(k % 3 == 0))
                else:
                    gfxgraph.disable()
                gfxgraph.is_enabled()
                k += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(f"toggler {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=toggler, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    rounds = 0
    try:
        while rounds < 20 or (rounds < 2_000 and any(t.is_alive() for t in threads)):
            rounds += 1
            if ctx.gpu:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                x = torch.ones(64, device="cuda")
                g = BridgedCUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    y = x + 1
                g.replay()
                torch.cuda.synchronize()
                assert torch.equal(y, x + 1)
            else:
                g = BridgedCUDAGraph()
                with g.capture(model_fn=lambda t: t + 1, example_input=torch.ones(4)):
                    pass
                assert torch.equal(g.replay(input_tensor=torch.zeros(4)), torch.ones(4))
    finally:
        for t in threads:
            t.join(60)
    gfxgraph.disable()
    ctx.observed.update(restored=torch.cuda.CUDAGraph is original, capture_rounds=rounds)
    assert not errors, errors
    assert torch.cuda.CUDAGraph is original and torch.cuda.graphs.CUDAGraph is OriginalCUDAGraph, \
        "disable() did not restore torch.cuda.CUDAGraph exactly"
    assert not gfxgraph.is_enabled()
