"""torch.compile(backend="gfxgraph") vs mode="reduce-overhead" vs mode="default" vs ShapeBucketPool(eager).

The model and stream of shape_bucketing.py: 300 calls, batch sizes drawn from 1..256 (fixed
seed), a bf16 model of 8 residual MLP blocks of width 512, every call under torch.no_grad().
Each contender runs in a fresh process with empty inductor and triton caches, so each pays its
own compilation, and none inherits another's graphs or allocator state. Per contender:

* total: the first pass over the stream, compilation and capture included;
* steady state: the best of N later passes, per call (one untimed pass comes first, so late
  compilations, e.g. gfxgraph's of a frame dynamo specialised to batch size 1, are not in it);
* graphs alive at the end and their memory (graph-pool bytes from the allocator);
* dynamo frames compiled, and the largest relative error against eager on 32 calls;
* last, steady-state ms per call at each batch size of shape_bucketing.SWEEP (``per_batch_ms``
  in each result; the pool-eager child also times the eager model: ``eager_per_batch_ms``).

Targets (issue 6): gfxgraph steady state >= 5x reduce-overhead's and faster than the pool over
the eager model; gfxgraph total < mode="default" total + 1 s; graph memory beside
reduce-overhead's. Each figure is quoted with its target, misses included.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gfxgraph.suites._common import child_env, figure, parser, write
from gfxgraph.suites.shape_bucketing import CALLS, SWEEP, make_model, make_stream, per_batch_ms, run_stream
from hipgraph_bridge import ShapeBucketPool, graph_pool_bytes
from hipgraph_bridge._torch_compat import dynamo_counters
from hipgraph_bridge.compile import backend_stats, compiled_subgraphs, register

MODULE = "gfxgraph.suites.compile_backend"  # each contender's child runs this module
CONTENDERS = ("gfxgraph", "reduce-overhead", "default", "pool-eager")
_MARK = "RESULT "
CHILD_TIMEOUT_S = 300


def _graphs_alive() -> int:
    """CUDA graphs alive in this process (BridgedCUDAGraph and inductor's are CUDAGraph instances)."""
    cls = torch.cuda.CUDAGraph
    return sum(1 for o in gc.get_objects() if issubclass(type(o), cls))  # type(): weak proxies raise


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.double(), want.double()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


def child(name: str, passes: int) -> dict[str, Any]:
    """Run one contender over the stream; returns its figures (printed as one JSON line)."""
    counters = dynamo_counters()  # imports dynamo, so register() below finds it
    model = make_model()
    stream = make_stream()
    with torch.no_grad():  # CUDA context, cuBLAS handles and workspaces: outside every timing
        model(stream[0])
        model(stream[-1])
    torch.cuda.synchronize()
    out: dict[str, Any] = {"contender": name}
    if name == "pool-eager":
        with torch.no_grad():
            out["eager_ms"] = min(run_stream(model, stream) for _ in range(passes)) / CALLS * 1e3
        fn: Any = ShapeBucketPool(model, progress=False)  # default buckets, as the backend's
    elif name == "gfxgraph":
        register()  # the entry point finds it when installed; this covers a PYTHONPATH checkout
        fn = torch.compile(model, backend="gfxgraph")
    elif name == "reduce-overhead":
        fn = torch.compile(model, mode="reduce-overhead")
    else:
        fn = torch.compile(model, mode="default")
    bytes_before = graph_pool_bytes()
    counters.clear()
    with torch.no_grad():
        t0 = time.perf_counter()
        out["total_s"] = run_stream(fn, stream)
        out["first_pass_wall_s"] = time.perf_counter() - t0
        if name == "gfxgraph":
            out["compile_s_first_pass"] = backend_stats()["compile_seconds"]
        out["settle_pass_s"] = run_stream(fn, stream)
        out["steady_ms"] = min(run_stream(fn, stream) for _ in range(passes)) / CALLS * 1e3
        worst = 0.0
        for x in stream[:32]:
            worst = max(worst, _rel_error(fn(x), model(x)))
        out["max_rel_error_vs_eager"] = worst
    torch.cuda.synchronize()
    out["graph_bytes"] = graph_pool_bytes() - bytes_before
    out["graphs"] = _graphs_alive()
    out["dynamo_frames"] = int(counters["stats"]["unique_graphs"])
    if name == "gfxgraph":
        out["backend"] = backend_stats()
        out["subgraphs"] = [repr(s) for s in compiled_subgraphs()]
    if name == "pool-eager":
        out["graphs_pool"] = len(fn.captured_buckets)
    with torch.no_grad():  # last: a size the stream never drew may compile or record a new graph
        out["per_batch_ms"] = per_batch_ms(fn, SWEEP, passes)
        if name == "pool-eager":
            out["eager_per_batch_ms"] = per_batch_ms(model, SWEEP, passes)
    return out


def run_child(name: str, passes: int, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"gfxgraph-bench-{name}-") as tmp:
        env = child_env(TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
                        TRITON_CACHE_DIR=str(Path(tmp) / "triton"), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", MODULE, "--child", name, "--passes", str(passes)]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            return {"contender": name, "error": f"timed out after {CHILD_TIMEOUT_S} s",
                    "stderr_tail": (exc.stderr or b"")[-3000:].decode(errors="replace")
                    if isinstance(exc.stderr, bytes) else str(exc.stderr)[-3000:]}
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(_MARK)]
        if r.returncode != 0 or not lines:
            return {"contender": name, "error": f"exit status {r.returncode}", "stderr_tail": r.stderr[-3000:]}
        res = json.loads(lines[-1][len(_MARK):])
        res["process_s"] = time.perf_counter() - t0
        print(f"{name}: total {res['total_s']:.2f} s, steady {res['steady_ms']:.4f} ms/call, "
              f"{res['graphs']} graphs", flush=True)
        return res


def _get(res: dict[str, Any], key: str) -> float | None:
    v = res.get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    p.add_argument("--passes", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    passes = args.passes or (2 if args.quick else 5)
    if args.child:
        print(_MARK + json.dumps(child(args.child, passes)), flush=True)
        return

    results = {name: run_child(name, passes, args.quick) for name in CONTENDERS}
    g, ro, d, pe = (results[n] for n in CONTENDERS)
    g_ms, ro_ms, pe_ms = _get(g, "steady_ms"), _get(ro, "steady_ms"), _get(pe, "steady_ms")
    g_total, d_total = _get(g, "total_s"), _get(d, "total_s")
    speedup_ro = _ratio(ro_ms, g_ms)
    speedup_pool = _ratio(pe_ms, g_ms)
    mib = 2**20
    figures = []
    for name, res in results.items():
        if "error" in res:
            figures.append(figure(f"{name}: failed", None, None, False, note=res["error"]))
            continue
        figures += [
            figure(f"{name}: total for the stream (compile + capture + first pass)", res["total_s"], None, None, "s"),
            figure(f"{name}: steady state per call", res["steady_ms"], None, None, "ms"),
            figure(f"{name}: graphs alive", res["graphs"], None, None),
            figure(f"{name}: graph memory", res["graph_bytes"] / mib, None, None, "MiB"),
            figure(f"{name}: dynamo frames compiled", res["dynamo_frames"], None, None),
            figure(f"{name}: max relative error vs eager (32 calls)", res["max_rel_error_vs_eager"], "< 0.05",
                   res["max_rel_error_vs_eager"] < 0.05),
        ]
    if "eager_ms" in pe:
        figures.append(figure("eager: steady state per call", pe["eager_ms"], None, None, "ms"))
    figures += [
        figure("reduce-overhead steady / gfxgraph steady", speedup_ro, ">= 5",
               speedup_ro is not None and speedup_ro >= 5),
        figure("pool over eager steady / gfxgraph steady (fused kernels)", speedup_pool, "> 1",
               speedup_pool is not None and speedup_pool > 1),
        figure("gfxgraph total", g_total,
               f"< default total + 1 s = {d_total + 1:.2f} s" if d_total is not None else "< default total + 1 s",
               g_total is not None and d_total is not None and g_total < d_total + 1, "s"),
        figure("gfxgraph graph memory / reduce-overhead graph memory",
               _ratio(_get(g, "graph_bytes"), _get(ro, "graph_bytes")), None, None,
               note="reported beside reduce-overhead's (no target)"),
    ]
    if "backend" in g:
        figures += [
            figure("gfxgraph: inductor compilations", g["backend"]["compiles"], None, None),
            figure("gfxgraph: compile seconds in the first pass", g["compile_s_first_pass"], None, None, "s"),
            figure("gfxgraph: compile seconds after the first pass (settle pass)",
                   g["backend"]["compile_seconds"] - g["compile_s_first_pass"], None, None, "s",
                   note="frames dynamo specialised (first size, size 1) compile on their second call"),
        ]
    write(args.out, "compile_backend", figures,
          {"method": __doc__, "passes": passes, "calls": CALLS, "results": results})


if __name__ == "__main__":
    main()
