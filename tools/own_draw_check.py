"""Why the 1.2B top-k step graph's draw is slow: the draw on that graph's logits, eager and captured alone.

A diagnostic for issue 26 (not a suite). The greedy hand step graph is replayed once after a prompt (as
device_generate's step_time feeds the sampling step graph); its logits are checked for the kernel's tie
path (shares whose window ends at the k-th value) and the top-k draw is timed on them eagerly and as a
graph of the draw alone, against random logits; both step graphs are timed whole.

What it found (own_draw_check_h100_37a530e.json): the logits were ordinary and the draw alone took
34 us, yet the sampling step graph ran 230-940 us slower than the greedy one. The likely cause, found by
reading the code after that run: the benchmark's HandCaptured kept only the graph, so the step's closure
(the chooser's settings and the Philox key on the device) was freed after capture, and the replays read
whatever the allocator had put in that memory since. HandCaptured now keeps the step (a GPU test in
test_gpu_bench_suites.py). Confirmed on an H100 at 8644eed: the test passed and the top-k step graph ran
as fast as the greedy one (device_generate_quick_1.2b_h100_8644eed.json).

    python tools/own_draw_check.py --out bench-out      # a GPU
"""

import argparse
import json
import os

import torch

from gfxgraph.suites.device_generate import NEW, PROMPT, SAMPLING, HandLoop, _draw_step
from gfxgraph.suites.llm_decode import build_model, prefill
from hipgraph_bridge.generation.sampling import SamplingParams, chooser


def hidden_shares(s: torch.Tensor, k: int = 50, window: int = 64) -> tuple[int, int]:
    v = s.shape[-1]
    steps = -(-v // 512)
    per = -(-steps // 32)
    chunk = per * 512
    kth = s.topk(k).values[-1]
    hidden = sum(1 for b in range(0, v, chunk) if s[b:b + chunk].numel() >= window
                 and bool(s[b:b + chunk].topk(window).values[-1] == kth))
    return hidden, int((s == kth).sum())


def us(fn, n: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    settings = SAMPLING["sample top-k 50 top-p 0.9"]
    model = build_model("llama-1.2b")
    v = model.config.vocab_size
    ids = torch.randint(0, v, (1, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.no_grad():
        hand = HandLoop(model, 1, PROMPT + NEW + 8)
        own = _draw_step(hand, settings)
        for label, tok, pos in (("capture's inputs (token 0, position 1)", None, None),
                                ("the step after the prompt", ids[:, -1:], PROMPT)):
            if tok is not None:
                hand.graph.ids.copy_(tok)
                hand.graph.pos.fill_(pos)
                hand.graph.cp.fill_(pos)
            for mine, theirs in ((own.ids, hand.graph.ids), (own.pos, hand.graph.pos), (own.cp, hand.graph.cp)):
                mine.copy_(theirs)
            hand.cache.reset()
            prefill(model, hand.cache, ids)
            hand.graph.g.replay()
            logits = hand.graph.out[0].clone()
            s = logits[0].float() / settings["temperature"]
            hidden, ties = hidden_shares(s)
            choose = chooser(SamplingParams(**settings), v, "cuda")
            rows = torch.zeros(1, dtype=torch.long, device="cuda")
            posn = torch.full((), PROMPT, dtype=torch.long, device="cuda")
            eager = us(lambda: choose(logits, rows, posn))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                choose(logits, rows, posn)
            alone = us(g.replay)
            hand.cache.reset()
            prefill(model, hand.cache, ids)
            whole = us(own.g.replay, 20)
            hand.cache.reset()
            prefill(model, hand.cache, ids)
            greedy = us(hand.graph.g.replay, 20)
            res[label] = {"hidden_shares": hidden, "ties_at_kth": ties, "nan": bool(s.isnan().any()),
                          "logit_std": float(s.std()), "distinct": int(s.unique().numel()),
                          "draw_eager_us": eager, "draw_graph_us": alone, "own_step_graph_us": whole,
                          "greedy_step_graph_us": greedy}
            print(label, res[label], flush=True)
        r = torch.randn(1, v, device="cuda").bfloat16()
        res["random logits draw_eager_us"] = us(lambda: choose(r, rows, posn))
        print(res["random logits draw_eager_us"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "own_draw_check.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
