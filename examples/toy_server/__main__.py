"""``gfxgraph run -m examples.toy_server --requests N``: a module launched with gfxgraph on.

It answers N synthetic requests of random batch size through a ShapeBucketPool and the
low-level torch.cuda.graph API, then prints gfxgraph.stats(); exit code 0 when every answer
matched eager and gfxgraph was enabled by the launcher.
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
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda().eval()
    pool = gfxgraph.ShapeBucketPool(model, [1, 2, 4, 8, 16, 32], progress=False)
    rng = random.Random(1)
    worst = 0.0
    with torch.no_grad():
        for _ in range(args.requests):
            x = torch.randn(rng.randint(1, 32), 256, device="cuda")
            worst = max(worst, (pool(x) - model(x)).abs().max().item())
    snap = gfxgraph.stats()
    print(f"served {args.requests} requests; enabled={gfxgraph.is_enabled()} max |diff|={worst:.2e} "
          f"captures={snap['capture_count']} replays={snap['replay_count']} fallbacks={snap['fallback_count']}")
    return 0 if worst < 1e-4 and gfxgraph.is_enabled() else 1


if __name__ == "__main__":
    sys.exit(main())
