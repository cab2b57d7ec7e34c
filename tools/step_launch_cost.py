"""Does a model's step cost more per token in any graph the device may launch, or only in the device loop?

A diagnostic for issue 26 (not a suite: no targets). ``tools/loop_costs.py`` found, on synthetic bodies,
that a plain graph instantiated for device launch (``cudaGraphInstantiateFlagDeviceLaunch``, launched from
the host as usual) replays as slowly as the WHILE loop's iteration, so the loop's fixed cost comes with
such a graph; but those bodies show almost no per-kernel cost, and the 1.2B model's loop does (0.2-0.8 us
per kernel, ``tools/loop_profile.py``). This times, on a device_generate model, per token and in rounds
that alternate (their order turning each round; the median of the rounds):

- ``plain``: the model's step graph (device_generate's hand-written one, with the draw of the setting),
  replayed back to back behind a GPU sleep, as ``device_generate``'s ``step_time`` does;
- ``device-launchable``: the same step captured again on the same static inputs and instantiated for
  device launch, replayed the same way;
- ``loop``: ``StaticCacheDecoder(device_loop=256)``'s loop, 255 tokens in one launch;
- ``hand-step loop`` (greedy only): a ``DeviceDecodeLoop`` over the plain graph's own step and cache (the loop's
  own token and position buffers reshaped to the step's inputs), 255 tokens in one launch: if it costs
  what ``loop`` costs, the decoder's body is not what differs from the step graph;
- ``advancing plain`` (greedy only): the plain graph's step and two one-element adds that move its position
  and cache position on, so that its replays decode at positions 16, 17, ... as the loop does (``plain``
  replays position 16 each time); the adds are two one-element kernels more per replay.

If ``device-launchable`` / ``plain`` is about ``loop`` / ``plain``, the model's per-kernel cost in the loop
comes with a device-launchable graph (the runtime's, not the loop's); if it is near 1, it comes with the
conditional node's body.

    python tools/step_launch_cost.py --models llama-small,llama-1.2b --out bench-out    # a GPU: JSON, a table
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from gfxgraph.hf import StaticCacheDecoder
from gfxgraph.suites._common import gpu_ms_per_replay, write_diagnostic
from gfxgraph.suites.device_generate import (NEW, PROMPT, SAMPLING, HandLoop, _draw_step, _graph_ms_per_step,
                                             _loop_ms_per_token)
from gfxgraph.suites.llm_decode import HandCaptured, build_model, prefill
from hipgraph_bridge.compose.device_launch import instantiate_for_device
from hipgraph_bridge.generation.device_loop import DeviceDecodeLoop
from hipgraph_bridge.graph import SafeCUDAGraph
from hipgraph_bridge.runtime import Graph

TOP = "sample top-k 50 top-p 0.9"


class Launchable:
    """``graph``'s step captured again on its static inputs, instantiated for device launch."""

    def __init__(self, graph: HandCaptured) -> None:
        self.source = graph
        self.g = SafeCUDAGraph(keep_graph=True)
        with torch.cuda.graph(self.g):
            self.out = graph.step(graph.ids, graph.pos, graph.cp)
        self.stream = torch.cuda.current_stream()
        self.exe = instantiate_for_device(Graph.from_torch(self.g), stream=self.stream, track_completion=False)

    def ms_per_step(self, hand: HandLoop, ids: torch.Tensor) -> float:
        """As device_generate's ``_graph_ms_per_step``: the greedy graph's inputs, the cache after the prompt."""
        for mine, theirs in ((self.source.ids, hand.graph.ids), (self.source.pos, hand.graph.pos),
                             (self.source.cp, hand.graph.cp)):
            mine.copy_(theirs)
        hand.cache.reset()
        prefill(hand.model, hand.cache, ids)
        handle = self.stream.cuda_stream
        return gpu_ms_per_replay(lambda: self.exe.launch(handle), NEW - 1)


class HandStepLoop:
    """A device loop over ``hand``'s greedy step: its model, its cache, the argmax the step graph takes."""

    def __init__(self, hand: HandLoop) -> None:
        self.hand, b = hand, hand.b
        step = hand.graph.step

        def loop_step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            return step(tokens.view(b, 1), position.view(1, 1).expand(b, 1), position.view(1))[1]

        self.loop = DeviceDecodeLoop(loop_step, batch_size=b, chunk=256)

    def ms_per_token(self, ids: torch.Tensor) -> float:
        self.hand.cache.reset()
        first = prefill(self.hand.model, self.hand.cache, ids)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.loop.generate(first, ids.shape[1], max_new_tokens=NEW - 1)
        end.record()
        torch.cuda.synchronize()
        assert out.shape[1] == NEW - 1
        return start.elapsed_time(end) / (NEW - 1)


class Advancing:
    """``hand``'s greedy step and the moves of its position and cache position, in one plain graph."""

    def __init__(self, hand: HandLoop) -> None:
        self.hand, g = hand, hand.graph
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = g.step(g.ids, g.pos, g.cp)
            g.pos.add_(1)
            g.cp.add_(1)

    def ms_per_step(self, ids: torch.Tensor) -> float:
        g = self.hand.graph
        self.hand.cache.reset()
        prefill(self.hand.model, self.hand.cache, ids)
        g.pos.fill_(PROMPT)
        g.cp.fill_(PROMPT)
        try:
            return gpu_ms_per_replay(self.graph.replay, NEW - 1)
        finally:  # the 8 replays that measure queueing, then the timed ones, moved it on: back for the others
            g.pos.fill_(PROMPT)
            g.cp.fill_(PROMPT)


def one(model: Any, b: int, label: str, rounds: int) -> dict[str, Any]:
    settings = SAMPLING.get(label, {})
    ids = torch.randint(0, model.config.vocab_size, (b, PROMPT), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(b))
    hand = HandLoop(model, b, PROMPT + NEW + 8)
    hand.cache.reset()
    prefill(model, hand.cache, ids)
    hand.graph.ids.copy_(ids[:, -1:])  # the step after the prompt, as the loop's first
    hand.graph.pos.fill_(PROMPT)
    hand.graph.cp.fill_(PROMPT)
    own = _draw_step(hand, settings) if settings else None
    launchable = Launchable(own or hand.graph)
    dec = StaticCacheDecoder(model, max_cache_len=PROMPT + NEW + 8, device_loop=256)
    dec.generate(ids, max_new_tokens=2, eos_token_id=None, **settings)  # the body captured untimed
    timers: dict[str, Callable[[], float]] = {
        "loop": lambda: _loop_ms_per_token(dec, ids, b, settings),
        "plain": lambda: _graph_ms_per_step(hand, ids, own),
        "device-launchable": lambda: launchable.ms_per_step(hand, ids)}
    if not settings:
        hand_loop = HandStepLoop(hand)
        hand_loop.ms_per_token(ids)  # captured untimed
        timers["hand-step loop"] = lambda: hand_loop.ms_per_token(ids)
        advancing = Advancing(hand)
        timers["advancing plain"] = lambda: advancing.ms_per_step(ids)
    rounds_ms = []
    for r in range(rounds):
        names = list(timers)
        names = names[r % len(names):] + names[:r % len(names)]
        rounds_ms.append({name: timers[name]() for name in names})
    med = {k: statistics.median(x[k] for x in rounds_ms) for k in timers}
    ratio = {f"{a} / plain": statistics.median(x[a] / x["plain"] for x in rounds_ms)
             for a in timers if a != "plain"}
    ratio["loop / device-launchable"] = statistics.median(x["loop"] / x["device-launchable"] for x in rounds_ms)
    return {"ms_per_token": med, "ratios": ratio, "rounds_ms": rounds_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-small,llama-1.2b")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--settings", default=f"greedy,{TOP}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_launch_cost: needs a GPU")
    results: dict[str, Any] = {}
    with torch.no_grad():
        for name in args.models.split(","):
            model = build_model(name)
            for b in map(int, args.batches.split(",")):
                for label in args.settings.split(","):
                    try:
                        r = one(model, b, label, args.rounds)
                    except Exception as exc:  # a diagnostic: say why and go on
                        results[f"{name} bs {b} {label}"] = {"error": f"{type(exc).__name__}: {exc}"}
                        print(f"{name} bs {b} {label}: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    results[f"{name} bs {b} {label}"] = r
                    m, q = r["ms_per_token"], r["ratios"]
                    print(f"{name} bs {b} {label}: plain {m['plain']:.4f} ms, device-launchable "
                          f"{m['device-launchable']:.4f} ms ({q['device-launchable / plain']:.4f}), loop "
                          f"{m['loop']:.4f} ms ({q['loop / plain']:.4f}); loop / device-launchable "
                          f"{q['loop / device-launchable']:.4f}"
                          + (f"; hand-step loop {m['hand-step loop']:.4f} ms ({q['hand-step loop / plain']:.4f})"
                             if "hand-step loop" in m else "")
                          + (f"; advancing plain {m['advancing plain']:.4f} ms ({q['advancing plain / plain']:.4f})"
                             if "advancing plain" in m else ""), flush=True)
            del model
            torch.cuda.empty_cache()
    write_diagnostic(args.out, "step_launch_cost", {"method": __doc__, "results": results})


if __name__ == "__main__":
    main()
