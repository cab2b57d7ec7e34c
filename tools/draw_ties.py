"""What ties at the k-th logit cost the top-k draw kernel: random logits against flat ones (every token tied).

A diagnostic for issue 26 (not a suite). The kernel re-reads, in one program, each share of the row whose
own top-``window`` list ends at the k-th value (its share may hold more ties than the list): on logits where
every token ties (a pad token's zero embedding through a model without biases gives such a row), that is the
whole vocabulary, twice. Eager calls on the 1.2B model's vocabulary (launch included).

    python tools/draw_ties.py --out bench-out      # a GPU: JSON and the lines below
"""

import argparse

import torch

from gfxgraph.suites._common import write_diagnostic
from hipgraph_bridge.generation.sampling import SamplingParams, chooser
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--out", default="bench-out")
args = p.parse_args()
v = 128256
us: dict[str, float] = {}
rows = {"random": torch.randn(1, v, device="cuda").bfloat16(),
        "all zero": torch.zeros(1, v, device="cuda", dtype=torch.bfloat16),
        "random, 1/8 tied at 0": torch.where(torch.rand(1, v, device="cuda") < 0.125, 0.0,
                                             torch.randn(1, v, device="cuda") - 5).bfloat16()}
for name, logits in rows.items():
    ch = chooser(SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=1), v, "cuda")
    seq = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    for _ in range(3):
        ch(logits, seq, pos)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(50):
        ch(logits, seq, pos)
    b.record()
    torch.cuda.synchronize()
    us[name] = a.elapsed_time(b) / 50 * 1000
    print(f"top-k 50 top-p 0.9 draw, {name}: {us[name]:.1f} us per call (eager, launch included)")
write_diagnostic(args.out, "draw_ties", {"vocab": v, "method": __doc__, "us_per_call": us})
