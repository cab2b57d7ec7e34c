"""Tensor-parallel MLP on two GPUs: ms per call, eager vs graphed with every rank agreeing, bs 1..64.

Two processes (``torch.multiprocessing.spawn``, no torchrun), one GPU each, one NCCL group.
The model: LAYERS Llama-7B-shaped MLP blocks (hidden 4096, intermediate 11008 split over the
ranks, bf16), each a column-parallel gate/up, a row-parallel down and an ``all_reduce``.
Modes, each run by both ranks at once at every batch size:

* eager;
* ``ShapeBucketPool(process_group=RankAgreement(batch="equal"))``: a host round per call
  checks that both ranks run the same batch size;
* the same with ``batch="trusted"`` (no per-call round: tensor parallelism guarantees the sizes);
* a hand-captured ``torch.cuda.graph`` per batch size (no padding, no checks): the floor.

Figures: eager / pool speed-up at bs 1, 8 and 64, pool (trusted) / hand-captured graph, and what
the per-call round costs; every size's times (the slower rank's) are in ``per_size``. Rank 0 writes
the JSON. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends) in both processes.
"""

from __future__ import annotations

import os
import datetime
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gfxgraph.suites._common import figure, parser, write
from hipgraph_bridge import RankAgreement, ShapeBucketPool

HIDDEN, FFN, LAYERS, WORLD = 4096, 11008, 4, 2
SIZES = [1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 40, 48, 64]
BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64]


class TensorParallelMLP(torch.nn.Module):
    """LAYERS residual SwiGLU MLPs, this rank's shard of each (column- then row-parallel)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        part = FFN // WORLD
        g = torch.Generator(device="cuda").manual_seed(100 + rank)
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        self.gate = [torch.randn(HIDDEN, part, generator=g, **kw) / HIDDEN ** 0.5 for _ in range(LAYERS)]
        self.up = [torch.randn(HIDDEN, part, generator=g, **kw) / HIDDEN ** 0.5 for _ in range(LAYERS)]
        self.down = [torch.randn(part, HIDDEN, generator=g, **kw) / FFN ** 0.5 for _ in range(LAYERS)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, HIDDEN), the same on both ranks
        for gate, up, down in zip(self.gate, self.up, self.down):
            y = (torch.nn.functional.silu(x @ gate) * (x @ up)) @ down  # (B, HIDDEN), this rank's partial sum
            dist.all_reduce(y)
            x = x + y
        return x


def ms_per_call(fn, x: torch.Tensor, iters: int) -> float:
    """Host-to-host ms per call on this rank (both ranks run the same loop), the slower rank's."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - t0) / iters * 1e3], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def hand_graphs(model: TensorParallelMLP) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]]:
    """One torch.cuda.graph per batch size, largest first into one pool (what serving code writes)."""
    graphs, pool, stream = {}, torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    for n in sorted(SIZES, reverse=True):
        x = torch.zeros(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(x)  # warm-up: the communicator and cuBLAS set up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode="thread_local"):  # NCCL watchdog thread
            out = model(x)
        graphs[n] = (g, x, out)
    return graphs


def measure(rank: int, iters: int) -> dict[str, object]:
    model = TensorParallelMLP(rank)
    pools = {rule: ShapeBucketPool(model, BUCKETS, copy_outputs=False, progress=False,
                                   process_group=RankAgreement(batch=rule, timeout=120))
             for rule in ("equal", "trusted")}
    example = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    captured = {rule: pool.capture_all(example)["captured"] for rule, pool in pools.items()}
    graphs = hand_graphs(model)

    def hand(x: torch.Tensor) -> torch.Tensor:
        g, static, out = graphs[x.shape[0]]
        static.copy_(x)
        g.replay()
        return out

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)  # the same inputs on both ranks
    with torch.no_grad():
        for n in SIZES:
            x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            err = (pools["trusted"](x).float() - model(x).float()).abs().max().item()
            rows.append({"bs": n, "eager_ms": ms_per_call(model, x, iters),
                         "pool_equal_ms": ms_per_call(pools["equal"], x, iters),
                         "pool_trusted_ms": ms_per_call(pools["trusted"], x, iters),
                         "hand_graph_ms": ms_per_call(hand, x, iters), "max_abs_diff_vs_eager": err})
    failed = {rule: pool.failed_buckets for rule, pool in pools.items()}
    return {"per_size": rows, "captured": captured, "failed": failed}


def figures(doc: dict[str, object]) -> list[dict[str, object]]:
    rows = {r["bs"]: r for r in doc["per_size"]}  # type: ignore[union-attr]
    out = [figure(f"eager / pool (trusted), bs {n}", rows[n]["eager_ms"] / rows[n]["pool_trusted_ms"], None, None,
                  "x", f"{rows[n]['eager_ms']:.3f} vs {rows[n]['pool_trusted_ms']:.3f} ms") for n in (1, 8, 64)]
    ratio = statistics.median(r["pool_trusted_ms"] / r["hand_graph_ms"] for r in rows.values())
    out.append(figure("pool (trusted) / hand-captured graph, median over sizes", ratio, "<= 1.05", ratio <= 1.05))
    round_us = statistics.median((r["pool_equal_ms"] - r["pool_trusted_ms"]) * 1e3 for r in rows.values())
    out.append(figure("per-call batch round (equal - trusted), median", round_us, None, None, "us"))
    worst = max(r["max_abs_diff_vs_eager"] for r in rows.values())
    out.append(figure("max |pool - eager| over sizes (bf16)", worst, None, None))
    return out


def worker(rank: int, port: int, out_dir: str, quick: bool) -> None:
    os.environ.update(NO_MULTICAST)  # also where a rank was started some other way
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    try:
        doc = measure(rank, 50 if quick else 300)
        if rank == 0:
            write(out_dir, "tp_mlp", figures(doc), {**doc, "model": {"hidden": HIDDEN, "ffn": FFN, "layers": LAYERS,
                                                                    "world": WORLD, "dtype": "bfloat16"}})
    finally:
        dist.destroy_process_group()


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def main() -> None:
    os.environ.update(NO_MULTICAST)  # before anything starts NCCL; the spawned ranks inherit it
    args = parser(__doc__).parse_args()
    if torch.cuda.device_count() < WORLD:
        write(args.out, "tp_mlp", [], {"skipped": f"needs {WORLD} GPUs, found {torch.cuda.device_count()} "
                                                  "(kind nvidia-h200-x2)"})
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args.out, args.quick), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
