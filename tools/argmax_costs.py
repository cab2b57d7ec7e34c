"""GPU time of the greedy choice: torch's ``argmax`` against ``sampling.greedy``'s Triton kernel (a diagnostic).

The device loop's greedy body chooses with ``sampling.greedy``. device_generate measured torch's argmax
dear on a 128k vocabulary: its temperature-sampling step graph (a Gumbel-max draw, more work per logit) ran
faster than the greedy one at batch 1. Here each choice alone, as the body runs it: one CUDA graph of
``n`` choices over static logits, replayed behind a GPU sleep (``gpu_ms_per_replay``: the GPU's time, not
the host's launches), at decode batch sizes, two vocabularies (the suite's models' 32,000 and 128,256) and
the two dtypes the logits come in (bf16 from a bf16 model; float32). Tokens are checked equal first.

    python tools/argmax_costs.py --out bench-out      # a GPU with triton: JSON and a line per case
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from gfxgraph.suites._common import gpu_ms_per_replay, write_diagnostic
from hipgraph_bridge.generation.sampling import greedy

PER_GRAPH = 20  # choices captured in one graph: the per-replay sleep and launch spread over them


def one_case(b: int, vocab: int, dtype: torch.dtype, replays: int) -> dict[str, Any]:
    x = torch.randn(b, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(b + vocab)).to(dtype)
    assert torch.equal(greedy(x, fused=True), x.argmax(-1))  # eager: loads the kernel, and the answer agrees
    res: dict[str, Any] = {}
    for label, choose in (("torch.argmax", lambda: x.argmax(-1)), ("greedy kernel", lambda: greedy(x, fused=True))):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            choose()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(PER_GRAPH):
                choose()
        res[f"{label} us"] = 1000 * min(gpu_ms_per_replay(g.replay, replays) for _ in range(3)) / PER_GRAPH
    res["kernel / torch"] = res["greedy kernel us"] / res["torch.argmax us"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--replays", type=int, default=50)
    args = p.parse_args()
    cases = {}
    for dtype in (torch.bfloat16, torch.float32):
        for vocab in (32000, 128256):
            for b in (1, 4, 16, 64):
                name = f"{str(dtype).removeprefix('torch.')} vocab {vocab} bs {b}"
                cases[name] = one_case(b, vocab, dtype, args.replays)
                c = cases[name]
                print(f"{name}: torch {c['torch.argmax us']:.2f} us, kernel {c['greedy kernel us']:.2f} us "
                      f"({c['kernel / torch']:.3f})", flush=True)
    write_diagnostic(args.out, "argmax_costs", {"per_graph": PER_GRAPH, "cases": cases})


if __name__ == "__main__":
    main()
