"""Device launch: a pool call whose batch size lives on the GPU, three ways, 8 buckets, n = 1..64.

The row count ``n`` of each call is computed by a kernel (an element of a device tensor, as a
count of unfinished sequences would be). Contenders, interleaved per n in one run, over a bf16
MLP step (1024 -> 4096 -> 1024, GELU) with buckets 1, 2, 4, 8, 16, 32, 48, 64:

* ``host read``: ``n = int(n_dev)`` (a device sync), then an ordinary pool call on ``x[:n]``;
* ``switch``: ``ConditionalGraph(strategy="native")`` with one branch per bucket, the branch index
  computed on the device (``searchsorted``), one SWITCH node picks it (no host read);
* ``device``: ``pool.device_sized(x)``: one host launch of a graph whose kernel reads ``n`` and
  tail-launches the bucket's device graph (CUDA 12+).

Per call: host time (issuing one call, mean of 200, host-read included) and wall time (200 calls
then a sync, divided by 200: what a loop of such calls sustains). Targets: device launch beats the
host read on wall time at every n (it removes a sync and the host's bucket choice); device launch
costs the host <= 1.25x an ordinary pool call with n known on the host (one graph launch plus a
copy of n and x, like the pool call's own copies). SWITCH is reported: it records every bucket's
kernels in one graph, so its launch costs what the largest body costs to set up; where it wins is
read off the table.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import gfxgraph
from gfxgraph.suites._common import figure, median, parser, write

BUCKETS = [1, 2, 4, 8, 16, 32, 48, 64]
CALLS = 200


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                               torch.nn.Linear(4096, 1024)).cuda().to(torch.bfloat16).eval()


def _timed(fn: Any, calls: int) -> tuple[float, float]:
    """(host us per call, wall us per call) over ``calls`` calls and one final sync."""
    torch.cuda.synchronize()
    host = 0.0
    t0 = time.perf_counter()
    for i in range(calls):
        t = time.perf_counter()
        fn(i)
        host += time.perf_counter() - t
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return host / calls * 1e6, wall / calls * 1e6


def main() -> None:
    args = parser(__doc__).parse_args()
    calls = 50 if args.quick else CALLS
    ns_list = [1, 2, 3, 5, 8, 12, 16, 24, 31, 32, 40, 48, 56, 64] if args.quick else list(range(1, 65))
    model = _model()
    cap = BUCKETS[-1]
    x = torch.randn(cap, 1024, device="cuda", dtype=torch.bfloat16)
    pool = gfxgraph.ShapeBucketPool(model, BUCKETS, progress=False)
    with torch.no_grad():
        call = pool.device_sized(x)
        assert call.mode == "device", call.reason
        cg = gfxgraph.ConditionalGraph(strategy="native", copy_outputs=False)
        for b in BUCKETS:
            cg.add_branch(f"b{b}", lambda t, b=b: torch.nn.functional.pad(model(t[:b]), (0, 0, 0, cap - b)))
        cg.capture(x, selectors=("index",))
        sizes = torch.tensor(BUCKETS, device="cuda")
        rows: dict[str, list[dict[str, float]]] = {"host read": [], "switch": [], "device": [], "pool, n on host": []}
        errors = {"host read": 0.0, "switch": 0.0, "device": 0.0}
        for n in ns_list:
            n_src = torch.full((calls,), n, dtype=torch.int64, device="cuda")  # n as an earlier kernel leaves it
            x_n = x[:n]

            def host_read(i: int) -> Any:
                k = int(n_src[i])
                return pool(x[:k])

            def switch(i: int) -> Any:
                return cg.run(torch.searchsorted(sizes, n_src[i:i + 1]), x)

            def device(i: int) -> Any:
                return call(n_src[i], x)

            def known(i: int) -> Any:
                return pool(x_n)

            fns = {"host read": host_read, "switch": switch, "device": device, "pool, n on host": known}
            for fn in fns.values():
                fn(0)  # warm: first calls at this n
            for name, fn in fns.items():
                h, w = _timed(fn, calls)
                rows[name].append({"n": n, "host_us": h, "wall_us": w})
            ref = model(x_n).float()
            errors["host read"] = max(errors["host read"], (host_read(0).float() - ref).abs().max().item())
            errors["switch"] = max(errors["switch"], (switch(0)[:n].float() - ref).abs().max().item())
            errors["device"] = max(errors["device"], (device(0)[:n].float() - ref).abs().max().item())
        call.check()
    figures = []
    beats = [d["wall_us"] < h["wall_us"] for d, h in zip(rows["device"], rows["host read"])]
    figures.append(figure("device launch wall < host read wall, n where it holds", sum(beats),
                          f"== {len(ns_list)}", all(beats), "of n"))
    for name in ("host read", "switch", "device", "pool, n on host"):
        figures.append(figure(f"{name}: wall per call (median over n)", median([r["wall_us"] for r in rows[name]]),
                              None, None, "us"))
        figures.append(figure(f"{name}: host per call (median over n)", median([r["host_us"] for r in rows[name]]),
                              None, None, "us"))
    ratio = median([d["host_us"] / k["host_us"] for d, k in zip(rows["device"], rows["pool, n on host"])])
    figures.append(figure("device launch host / pool call with n on the host (median over n)", ratio, "<= 1.25",
                          ratio <= 1.25))
    switch_wins = [r["n"] for r, d in zip(rows["switch"], rows["device"]) if r["wall_us"] < d["wall_us"]]
    figures.append(figure("n where SWITCH's wall time beats device launch", len(switch_wins), None, None, "of n"))
    for name, err in errors.items():
        figures.append(figure(f"{name}: max |out - eager| (bf16)", err, "<= 0.125", err <= 0.125))
    write(args.out, "device_launch", figures, {
        "method": __doc__, "buckets": BUCKETS, "calls_per_point": calls, "rows": rows,
        "switch_wins_at_n": switch_wins, "switch_strategy": cg.strategy,
        "plot": {"x": "n", "y": "wall_us", "series": list(rows)},
    })
    cg.close()
    call.close()
    pool.close()


if __name__ == "__main__":
    main()
