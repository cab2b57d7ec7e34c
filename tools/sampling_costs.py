"""Where a sampled token's time goes: each piece of the draw captured alone in a CUDA graph and replayed.

A diagnostic for issue 26 (not a suite: no targets). For each vocabulary and batch size it times, per
token, ``argmax`` (greedy's choice), the temperature draw, top-k 50 with top-p 0.9 (the whole
``draw_filtered`` and its one kernel alone), top-p's one sort, and for comparison what the kernels
replaced: torch's ``topk`` of the 64-token window (sorted and not) and the float32 division. Each
piece is captured into its own graph (ten calls) and replayed ``--replays`` times between two CUDA
events (the median of 5 such runs). ``--model`` adds the draws on a suite model's own decode logits
and counts how many rows take the kernel's slower branches.

    python tools/sampling_costs.py --out bench-out          # a GPU: JSON and a table
    python tools/sampling_costs.py --model llama-small      # also on that model's own decode logits
    python tools/sampling_costs.py --cpu-smoke              # no GPU: runs every piece once, times nothing
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from gfxgraph.suites._common import capture_graph, write_diagnostic
from gfxgraph.suites.llm_decode import build_model, make_step, new_cache, prefill
from hipgraph_bridge.generation import sampling
from hipgraph_bridge.generation.sampling import (draw, draw_filtered, filter_scores, filter_tensors, seed_key,
                                                 top_k_window)


def pieces(logits: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The pieces to time, each a function of ``logits`` (``(batch, vocab)`` bf16) and fixed settings."""
    b, vocab = logits.shape
    dev = logits.device
    key, seq, pos = seed_key(1, dev), torch.arange(b, device=dev), torch.zeros((), dtype=torch.long, device=dev)
    t, k, cut = filter_tensors(0.8, 50, 0.9, vocab, dev)
    window = top_k_window(50)
    fused = sampling.fused_unavailable_reason() is None and dev.type == "cuda"

    out: dict[str, Callable[[], Any]] = {
        "argmax (greedy)": lambda: logits.argmax(dim=-1),
        "temperature draw (Gumbel-max, t divided in the kernel)": lambda: draw_filtered(
            logits, t, k, cut, key, seq, pos, use_top_k=False, use_top_p=False, k_window=None),
        "scores: logits.float() / t (no longer run)": lambda: logits.float() / t,
        f"topk({window}) of the logits": lambda: logits.topk(window, dim=-1),
        f"topk({window}) of the logits, unsorted": lambda: logits.topk(window, dim=-1, sorted=False),
        "top-k 50 + top-p 0.9, draw_filtered (whole)": lambda: draw_filtered(
            logits, t, k, cut, key, seq, pos, use_top_k=True, use_top_p=True, k_window=window),
        "top-p 0.9 alone: one sort + draw": lambda: draw(filter_scores(
            logits, t, k, cut, use_top_k=False, use_top_p=True), key, seq, pos),
    }
    if fused:
        module = sampling._fused_module()  # noqa: SLF001 - the diagnostic times the kernel on its own
        out["top-k + top-p kernel alone"] = lambda: module.topk_draw_fused(logits, t, k, cut, key, seq, pos,
                                                                           window=window, top_p=True)
    return out


def model_logits(name: str, steps: int = 64) -> torch.Tensor:
    """``(steps, vocab)`` logits of the device_generate suite's model ``name`` (random bf16 weights), one
    row per greedy decode step after a 16-token prompt: the data the loop's kernel meets there."""
    model = build_model(name)
    cache = new_cache(model, 1, 16 + steps + 8)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    rows = []
    with torch.no_grad():
        tok = prefill(model, cache, prompt)
        step = make_step(model, cache)
        for i in range(steps):
            pos = torch.full((1, 1), 16 + i, dtype=torch.long, device="cuda")
            logits, tok = step(tok.view(1, 1), pos, pos.view(1))
            rows.append(logits.clone())
    return torch.cat(rows)


def tie_stats(logits: torch.Tensor, k: int = 50, window: int = 64, temperature: float = 0.8) -> dict[str, int]:
    """How many rows take the kernel's slower branches: ties at the k-th score beyond the window (a draw
    over the programs' lists) and a program's share whose own top-window ends at the k-th score (read
    again). The shares as the kernel splits the row."""
    module = sampling._fused_module()  # noqa: SLF001 - the diagnostic mirrors the kernel's split
    rows, vocab = logits.shape
    scores = logits.float() / filter_tensors(temperature, None, None, vocab, logits.device)[0]  # as the kernel
    nblocks, chunk = module._split(vocab, module._TOPK_SUB, module._TOPK_PROGRAMS)  # noqa: SLF001
    top = scores.topk(window, dim=-1).values
    kth = top[:, k - 1:k]
    beyond = int(((scores == kth).sum(1) != (top == kth).sum(1)).sum())
    reread = 0
    for r in range(rows):
        for b in range(nblocks):
            part = scores[r, b * chunk:(b + 1) * chunk]
            if part.numel() >= window and bool(part.topk(window).values[-1] == kth[r, 0]):
                reread += 1
                break
    return {"rows": rows, "rows with ties beyond the window": beyond, "rows with a share read again": reread}


def time_graph(fn: Callable[[], Any], replays: int) -> float:
    """Microseconds per replay of ``fn`` captured alone (median of 5 runs of ``replays`` replays)."""
    g = capture_graph(fn, calls=10, warmups=2)  # ten in one graph: the launch of the graph is not the piece's cost
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / (replays * 10))
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--cpu-smoke", action="store_true", help="run every piece once on the CPU, time nothing")
    p.add_argument("--model", action="append", default=[], help="also time the draws on this device_generate "
                   "model's own decode logits (repeatable: llama-small, llama-1.2b)")
    args = p.parse_args()
    if args.cpu_smoke:
        for vocab in (300,):
            for name, fn in pieces(torch.randn(2, vocab).to(torch.bfloat16)).items():
                fn()
                print(f"ran: {name}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("sampling_costs: needs a GPU (--cpu-smoke runs the pieces on the CPU)")
    sampling.prepare_fused("cuda", k_window=top_k_window(50), top_p=True)
    results: dict[str, dict[str, float]] = {}
    for vocab in (32000, 128256):
        for b in (1, 4):
            logits = torch.randn(b, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(b))
            logits = (logits * 3).to(torch.bfloat16)
            case = results[f"vocab {vocab} bs {b}"] = {}
            for name, fn in pieces(logits).items():
                case[name] = time_graph(fn, args.replays)
                print(f"vocab {vocab} bs {b}: {name}: {case[name]:.1f} us", flush=True)
    for name in args.model:
        rows = model_logits(name)
        vocab = rows.shape[1]
        t, k, cut = filter_tensors(0.8, 50, 0.9, vocab, "cuda")
        key, seq, pos = seed_key(1, "cuda"), torch.zeros(1, dtype=torch.long, device="cuda"), torch.zeros(
            (), dtype=torch.long, device="cuda")
        case = results[f"{name} decode logits bs 1"] = {}
        turn = iter(range(10**9))
        # a graph's ten draws read ten consecutive steps' logits (the rows are picked while it is captured)
        draws: dict[str, Callable[[], Any]] = {
            "argmax (greedy)": lambda: rows[next(turn) % len(rows)].view(1, -1).argmax(dim=-1),
            "temperature draw": lambda: draw_filtered(rows[next(turn) % len(rows)].view(1, -1), t, k, cut, key, seq,
                                                      pos, use_top_k=False, use_top_p=False, k_window=None),
            "top-k 50 + top-p 0.9": lambda: draw_filtered(rows[next(turn) % len(rows)].view(1, -1), t, k, cut, key,
                                                          seq, pos, use_top_k=True, use_top_p=True, k_window=64),
        }
        for label, fn in draws.items():
            case[label] = time_graph(fn, args.replays)
            print(f"{name} decode logits bs 1: {label}: {case[label]:.1f} us", flush=True)
        stats = tie_stats(rows)
        case.update({k_: float(v) for k_, v in stats.items()})
        print(f"{name} decode logits: {stats}", flush=True)
    write_diagnostic(args.out, "sampling_costs", {"us_per_call": results})


if __name__ == "__main__":
    main()
