"""``gfxgraph run -m examples.toy_server --requests N``: a module launched with gfxgraph on.

Needs: torch. With a CUDA or ROCm GPU its requests replay graphs; without one it
runs eagerly on the CPU and says so (the pool counts each call as a ``no_gpu``
fallback). Run it from the repository root, where ``examples`` is importable.

It answers N synthetic requests of random batch size through a ShapeBucketPool, then
prints gfxgraph.stats(); exit code 0 when every answer matched eager and gfxgraph was
enabled by the launcher.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

import gfxgraph


def main() -> int:
    ap = argparse.ArgumentParser(prog="toy_server")
    ap.add_argument("--requests", type=int, default=100)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("toy_server: no GPU here, so every request runs eagerly on the CPU (no graphs)", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    model = model.to(device).eval()
    pool = gfxgraph.ShapeBucketPool(model, [1, 2, 4, 8, 16, 32], progress=False)
    rng = random.Random(1)
    worst = 0.0
    with torch.no_grad():
        for _ in range(args.requests):
            x = torch.randn(rng.randint(1, 32), 256, device=device)
            worst = max(worst, (pool(x) - model(x)).abs().max().item())
    snap = gfxgraph.stats()
    print(f"served {args.requests} requests; enabled={gfxgraph.is_enabled()} max |diff|={worst:.2e} "
          f"captures={snap['capture_count']} replays={snap['replay_count']} fallbacks={snap['fallback_count']}")
    return 0 if worst < 1e-4 and gfxgraph.is_enabled() else 1


if __name__ == "__main__":
    sys.exit(main())
