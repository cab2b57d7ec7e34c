"""Which kernels take longer inside the device loop than in the step graph: a per-kernel profile of both.

A diagnostic for issue 26 (not a suite: no targets). On a device_generate model, the hand-written greedy
step graph (``device_generate.HandLoop``) is replayed ``--tokens`` times and ``StaticCacheDecoder
(device_loop=256)`` decodes ``--tokens`` tokens in one launch, each under ``torch.profiler`` (CUPTI records
the kernels a graph launches, and those of a conditional node's body). Per kernel name: launches and
microseconds per token in each, and the difference, largest first. device_generate's ``step_time``
gives the loop's GPU time per token over its step graph's, ``tools/loop_costs.py`` what a synthetic body
costs the loop; where a model's loop costs more than that, this says which kernels it is in. With
``--sample`` the loop draws with one of device_generate's settings and the step graph is the step with the
same draw (the greedy step graph's kernels are kept beside it).

    python tools/loop_profile.py --model llama-1.2b --out bench-out     # a GPU: JSON and a table
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from gfxgraph.hf import StaticCacheDecoder
from gfxgraph.suites._common import write_diagnostic
from gfxgraph.suites.device_generate import NEW, PROMPT, SAMPLING, HandLoop, _draw_step
from gfxgraph.suites.llm_decode import build_model, prefill


def kernel_us(run: Callable[[], Any], tokens: int) -> dict[str, dict[str, float]]:
    """Per kernel name (the first 100 characters): launches and device microseconds per token of ``run``."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    rows: dict[str, dict[str, float]] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        if us > 0 and e.device_type.name == "CUDA":
            row = rows.setdefault(e.key[:100], {"launches_per_token": 0.0, "us_per_token": 0.0})
            row["launches_per_token"] += e.count / tokens
            row["us_per_token"] += us / tokens
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1.2b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--sample", default="", choices=["", *SAMPLING],
                   help="a device_generate sampling setting: the loop draws with it, and its own step graph (the "
                        "step and the same draw) is profiled beside the greedy one")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loop_profile: needs a GPU")
    model, b, n = build_model(args.model), args.batch, args.tokens
    ids = torch.randint(0, model.config.vocab_size, (b, PROMPT), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(b))
    with torch.no_grad():
        hand = HandLoop(model, b, PROMPT + NEW + 8)
        hand.cache.reset()
        prefill(model, hand.cache, ids)
        # the step after the prompt, as the loop's first: a graph left with the zeros it was captured with would
        # replay token 0 at position 0 (logits that need not be a decode step's)
        hand.graph.ids.copy_(ids[:, -1:])
        hand.graph.pos.fill_(PROMPT)
        hand.graph.cp.fill_(PROMPT)
        settings = SAMPLING.get(args.sample, {})
        greedy = kernel_us(lambda: [hand.graph.g.replay() for _ in range(n)], n)
        graph = greedy
        if settings:  # the step and the loop's draw in one graph, fed the greedy graph's inputs
            own = _draw_step(hand, settings)
            for mine, theirs in ((own.ids, hand.graph.ids), (own.pos, hand.graph.pos), (own.cp, hand.graph.cp)):
                mine.copy_(theirs)
            hand.cache.reset()
            prefill(model, hand.cache, ids)
            graph = kernel_us(lambda: [own.g.replay() for _ in range(n)], n)
        dec = StaticCacheDecoder(model, max_cache_len=PROMPT + NEW + 8, device_loop=256)
        dec.generate(ids, max_new_tokens=2, eos_token_id=None, **settings)  # captured
        first = dec.generate(ids, max_new_tokens=1, eos_token_id=None, **settings)[:, 0]
        loop = dec._slots[b].loop  # noqa: SLF001 - the loop alone, without the decoder's prefill
        assert loop is not None
        in_loop = kernel_us(lambda: loop.generate(first, ids.shape[1], max_new_tokens=n, **settings), n)
    names = set(graph) | set(in_loop)
    zero = {"launches_per_token": 0.0, "us_per_token": 0.0}
    diff = sorted(((k, in_loop.get(k, zero)["us_per_token"] - graph.get(k, zero)["us_per_token"]) for k in names),
                  key=lambda kv: -abs(kv[1]))
    total = {what: sum(r["us_per_token"] for r in rows.values()) for what, rows in (("graph", graph),
                                                                                    ("loop", in_loop))}
    what = args.sample or "greedy"
    print(f"{args.model} bs {b} {what}: kernel time per token, step graph {total['graph']:.1f} us, loop "
          f"{total['loop']:.1f} us; largest differences (loop - graph, us per token):")
    for name, d in diff[:15]:
        g, lp = graph.get(name, zero), in_loop.get(name, zero)
        print(f"  {d:+8.2f}  graph {g['us_per_token']:7.2f} ({g['launches_per_token']:.1f}x)  loop "
              f"{lp['us_per_token']:7.2f} ({lp['launches_per_token']:.1f}x)  {name}")
    # letters, digits and "_" only: a name the device's file transfer (and any shell) takes as it is
    tag = "" if not args.sample else "_" + re.sub(r"[^A-Za-z0-9]+", "_", args.sample).strip("_")
    write_diagnostic(args.out, f"loop_profile_{args.model}_bs{b}{tag}", {
        "model": args.model, "batch": b, "tokens": n, "sampling": what, "method": __doc__,
        "total_us_per_token": total, "greedy_step_graph": greedy, "step_graph": graph, "loop": in_loop,
        "difference_us_per_token": dict(diff)})


if __name__ == "__main__":
    main()
