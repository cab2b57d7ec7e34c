"""Where ``generate()`` with ``gfxgraph.hf.compile_config()`` spends its time per token (a diagnostic, not a suite).

device_generate's transformers block measured (2026-12-07, H100) ``compile_config()`` at 0.89x / 0.67x the
default compile (reduce-overhead) at batch 4 / 16 on the small Llama, where both run the graph dynamo made
dynamic at batch 4. This repeats that block's sequence (batch 1, then 4, then 16, 256 new tokens, one compile
per contender from scratch) and, for each contender at each batch size after its first call, records:

- ms per token of one timed ``generate()`` (wall);
- gfxgraph's counters over that call (``gfxgraph.stats()``: captures, replays, fallbacks by reason);
- after the profiled call below, running totals since the contender's ``torch.compiler.reset()``: the
  backend's (``gfxgraph.backend_stats()``: subgraphs graphed or not, and why) and dynamo's (frames
  compiled, recompiles, graph breaks);
- a CPU profile of one more call (``torch.profiler``, CPU activity only: the host's work per token, where a
  host-bound decode spends it), its top ``--top`` entries by self CPU time, per token.

    python tools/hf_backend_probe.py --out bench-out     # a GPU with transformers: JSON, and the top entries printed
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

import gfxgraph
from gfxgraph.hf import compile_config
from gfxgraph.suites._common import timed, write_diagnostic
from gfxgraph.suites.device_generate import NEW, PROMPT, hf_generate_once
from gfxgraph.suites.llm_decode import build_model

CONTENDERS = {"default compile (reduce-overhead)": False, "gfxgraph.hf.compile_config()": True}
COUNTS = ("capture_count", "capture_failures", "replay_count", "fallback_count")


def _diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What ``gfxgraph.stats()`` counted between two snapshots."""
    was = before["fallback_reasons"]
    return {k: after[k] - before[k] for k in COUNTS} | {
        "fallback_reasons": {r: n - was.get(r, 0) for r, n in after["fallback_reasons"].items() if n != was.get(r, 0)}}


def probe(model: Any, label: str, kw: dict[str, Any], batches: list[int], top: int) -> dict[str, Any]:
    torch.compiler.reset()
    counters.clear()
    res: dict[str, Any] = {}
    for b in batches:
        ids = torch.randint(0, model.config.vocab_size, (b, PROMPT), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(b))
        first, _ = timed(lambda: hf_generate_once(model, ids, kw))
        before = gfxgraph.stats()
        seconds, _ = timed(lambda: hf_generate_once(model, ids, kw))
        ms = seconds * 1e3 / NEW
        run = _diff(gfxgraph.stats(), before)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed(lambda: hf_generate_once(model, ids, kw))
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        res[f"bs{b}"] = {
            "first_call_s": first, "ms_per_token": ms, "gfxgraph_counts_per_call": run,
            "dynamo": json.loads(json.dumps({k: dict(v) for k, v in counters.items()
                                             if k in ("stats", "frames", "recompiles", "graph_break")}, default=str)),
            "backend": json.loads(json.dumps(gfxgraph.backend_stats(), default=str)) if "compile_config" in kw else None,
            "cpu_top_us_per_token": [{"name": e.key[:120], "calls_per_token": e.count / NEW,
                                      "self_us_per_token": e.self_cpu_time_total / NEW} for e in rows],
        }
        print(f"{label} bs {b}: {ms:.3f} ms/token, first call {first:.1f} s, gfxgraph {run}", flush=True)
        for e in res[f"bs{b}"]["cpu_top_us_per_token"][:12]:
            print(f"    {e['self_us_per_token']:9.1f} us/token  {e['calls_per_token']:7.2f}/token  {e['name']}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = build_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    results = {}
    for label, gfx in CONTENDERS.items():
        kw = {"cache_implementation": "static"} | ({"compile_config": compile_config()} if gfx else {})
        results[label] = probe(model, label, kw, batches, args.top)
    if args.out:
        write_diagnostic(args.out, "hf_backend_probe", {"method": __doc__, "model": args.model, "new_tokens": NEW,
                                                        "prompt": PROMPT, "results": results})


if __name__ == "__main__":
    main()
