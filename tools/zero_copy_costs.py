"""Where a zero-copy call's host time goes beyond a raw ``CUDAGraph.replay()`` (a diagnostic, not a benchmark).

On the call_overhead suite's 64x64 Linear (bucket 8, batch 5 and 8), interleaved rounds, median of the
mean over 200 calls as the suite times them:

- raw ``torch.cuda.CUDAGraph.replay()`` and the C++ method alone on the same graph;
- ``pool.static_io(n).run()``, and the C++ replay of the pool's own graph (is its graph slower to launch?);
- the same zero-copy closure with a launch that does nothing (its Python alone);
- single pieces: the pool's lock, the stream-handle read, the replay counter;
- the GPU time per replay of the raw graph and of the pool's graph (queued behind a GPU sleep).

    python tools/zero_copy_costs.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import threading
import time
from typing import Any, Callable

import torch

from gfxgraph.suites._common import gpu_ms_per_replay
from hipgraph_bridge import OriginalCUDAGraph, ShapeBucketPool
from hipgraph_bridge._torch_compat import base_replay, raw_stream_of


def per_call_us(fn: Callable[[], Any], n: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1000.0


def _previous_closure(fast: Any, inputs: Any, engine: Any) -> Callable[[], Any]:
    """The zero-copy closure as it was at 805d08f (a ``with`` block, the engine's generation read through
    a weak reference), for comparison in the same process."""
    import weakref

    from hipgraph_bridge import config

    engine_ref, gen, batch, padded, tree, graph = (weakref.ref(engine), engine.generation, fast.batch, fast.padded,
                                                    fast.tree, fast.graph)
    launch, tick, mask, record = fast.parts
    lock, order = engine.lock, engine.order
    stream_of, device, now = raw_stream_of, fast.device, time.perf_counter_ns

    def run() -> Any:
        with lock:
            e = engine_ref()
            if e is None or e.generation != gen or e.inputs is not inputs or config.switches.checked \
                    or (padded and inputs.dirty > batch):
                raise RuntimeError("stale")
            if inputs.dirty < batch:
                inputs.dirty = batch
            if stream_of is None or stream_of(device) != order.raw:
                order.after_previous(device)
            if tick() & mask:
                launch(graph)
            else:
                t0 = now()
                launch(graph)
                record(now() - t0)
            return tree

    return run


def modes_for(batch: int, bucket: int = 8) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(batch, 64, device="cuda")
    static_x = torch.zeros(bucket, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(static_x)
    torch.cuda.current_stream().wait_stream(s)
    raw = OriginalCUDAGraph()
    with torch.cuda.graph(raw, stream=s):
        lin(static_x)
    zero = ShapeBucketPool(lin, [bucket], progress=False, copy_outputs=False)
    zero(x)
    io = zero.static_io(batch)
    io.args[0].copy_(x)
    for _ in range(5):
        io.run()
    fast = io.fast
    assert fast is not None, "no fast call installed"
    pool_graph = fast.graph
    noop = dataclasses.replace(fast, parts=(id, fast.parts[1], fast.parts[2], fast.parts[3]))
    noop_run = noop.zero_copy(io.inputs, lambda: None)
    lock = zero._engine.lock
    previous = _previous_closure(fast, io.inputs, zero._engine)
    plain_lock = threading.Lock()

    def with_lock() -> None:
        with lock:
            pass

    def with_plain_lock() -> None:
        with plain_lock:
            pass

    tick = fast.parts[1]
    dsts = [torch.zeros(batch, 1, dtype=torch.long, device="cuda"), torch.zeros(batch, 1, dtype=torch.long,
            device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")]
    srcs = [torch.ones_like(d) for d in dsts]

    def three_copies() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    modes = {
        "raw replay()": raw.replay,
        "raw C++ replay": functools.partial(base_replay, raw),
        "zero-copy run()": io.run,
        "pool graph C++ replay": functools.partial(base_replay, pool_graph),
        "zero-copy closure, no launch": noop_run,
        "previous closure (805d08f), real launch": previous,
        "pool lock (RLock) with": with_lock,
        "threading.Lock with": with_plain_lock,
        "stream handle read": functools.partial(raw_stream_of, 0) if raw_stream_of is not None else (lambda: None),
        "replay counter tick": tick,
        "empty lambda": lambda: None,
        "3 small copy_ (decode inputs)": three_copies,
        "one _foreach_copy_ of them": functools.partial(torch._foreach_copy_, dsts, srcs),
    }
    graphs = {"raw": functools.partial(base_replay, raw), "pool": functools.partial(base_replay, pool_graph)}
    modes["_keep"] = lambda: (zero, io, lin)  # noqa: B023 - keeps the pool alive with the modes
    return modes, graphs


def suite_modes_for(batch: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """The call_overhead suite's own modes (compiled ones included, as in its process), plus the zero-copy
    pool's graph replayed by its C++ method and the zero-copy closure without a launch."""
    from gfxgraph.suites.call_overhead import call_modes

    modes = call_modes(batch)
    io_run = modes["pool zero-copy"]
    closure = io_run.__closure__ or ()
    fast = next(c.cell_contents for c in closure if type(c.cell_contents).__name__ == "FastCall") \
        if any(type(c.cell_contents).__name__ == "FastCall" for c in closure) else None
    graph = next((c.cell_contents for c in closure if type(c.cell_contents).__name__ == "SafeCUDAGraph"), None)
    out = {"raw replay()": modes["raw replay"], "zero-copy run()": io_run}
    if graph is not None:
        out["pool graph C++ replay"] = functools.partial(base_replay, graph)
    out["hand-written loop"] = modes["hand-written loop"]
    out["pool"] = modes["pool"]
    del fast
    graphs = {"pool": out["pool graph C++ replay"]} if graph is not None else {}
    out["_keep"] = lambda: modes  # noqa: B023
    return out, graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=".")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--suite-context", action="store_true", help="time the call_overhead suite's own modes "
                   "(its process state: compiled modes, dynamo) instead of this script's")
    args = p.parse_args()
    res: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    with torch.no_grad():
        for batch in (5, 8):
            if args.suite_context:
                from gfxgraph.suites.llm_decode import warm_compilers

                if batch == 5:
                    warm_compilers()
                modes, graphs = suite_modes_for(batch)
            else:
                modes, graphs = modes_for(batch)
            keep = modes.pop("_keep")
            samples: dict[str, list[float]] = {k: [] for k in modes}
            res.setdefault("samples", {})[f"batch {batch}"] = samples
            names = list(modes)
            for r in range(args.rounds):
                for k in (names if r % 2 == 0 else names[::-1]):
                    samples[k].append(per_call_us(modes[k]))
            us = {k: statistics.median(v) for k, v in samples.items()}
            gpu = {k: gpu_ms_per_replay(g, 400) * 1e3 for k, g in graphs.items()}
            res[f"batch {batch}"] = {"host_us": us, "gpu_us_per_replay": gpu}
            print(f"batch {batch}:")
            for k, v in us.items():
                print(f"  {k:32s} {v:7.3f} us")
            for k, v in gpu.items():
                print(f"  GPU per replay {k:17s} {v:7.3f} us")
            del keep, modes, graphs
    name = "zero_copy_costs_suite" if args.suite_context else "zero_copy_costs"
    with open(f"{args.out}/{name}.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
