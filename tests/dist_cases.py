"""Scenarios of rank agreement, run by every rank of a gloo group (CPU) or an NCCL group (GPU).

Started by :func:`dist_launch.launch` as ``python tests/dist_cases.py RANK WORLD PORT OUT DEVICE NAME...``.
Each scenario returns facts (JSON-able) that the tests compare across ranks;
the results file is rewritten after every scenario, so a crash or a hang
leaves the earlier ones readable.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hipgraph_bridge import RankAgreement, RankAgreementError, ShapeBucketPool  # noqa: E402

RANK = int(sys.argv[1]) if __name__ == "__main__" else 0
WORLD = int(sys.argv[2]) if __name__ == "__main__" else 1
DEVICE = sys.argv[5] if __name__ == "__main__" else "cpu"
H = 8  # hidden width of the CPU models
CASES: dict[str, Callable[[], dict[str, Any]]] = {}


def case(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CASES[fn.__name__] = fn
    return fn


def agreement(**kw: Any) -> RankAgreement:
    return RankAgreement(**{"timeout": 20.0, **kw})


def data(rank: int, call: int, n: int, width: int = H) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(n, width, generator=g).to(DEVICE)


def weight(seed: int, *shape: int, scaled: bool = False) -> torch.Tensor:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return (w / shape[0] ** 0.5 if scaled else w).to(DEVICE)


class CaptureStage:
    """Says True once, at the capture of a bucket of ``rows``: inside the stream capture on a GPU; on
    CPU at the first run with that many rows (the bucket's simulated capture, see hipgraph_bridge.ranks.decider:
    the scenarios make a call of another size first, whose own run decides padding)."""

    def __init__(self, rows: int, rank: int) -> None:
        self.rows, self.rank, self.armed = rows, rank, True

    def __call__(self, x: torch.Tensor) -> bool:
        if not (self.armed and RANK == self.rank and x.shape[0] == self.rows):
            return False
        if DEVICE == "cuda" and not torch.cuda.is_current_stream_capturing():
            return False  # the warm-up: the fault is for the capture itself
        self.armed = False
        return True


class SumModel:
    """``all_reduce(x @ W) + 1``: rows independent; counts its runs (each holds one collective)."""

    def __init__(self) -> None:
        self.w = weight(7, H, H)
        self.runs = 0
        self.fault: Callable[[torch.Tensor], None] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        y = x @ self.w
        dist.all_reduce(y)
        if self.fault is not None:
            self.fault(x)
        return y + 1


def expected_sum(model: SumModel, inputs: list[torch.Tensor]) -> torch.Tensor:
    """What every rank's output holds: each rank's rows summed, a missing row counting 0."""
    rows = max(t.shape[0] for t in inputs)
    total = torch.zeros(rows, H, device=DEVICE)
    for t in inputs:
        total[: t.shape[0]] += t @ model.w
    return total + 1


def bucket_keys(pool: ShapeBucketPool) -> list[int]:
    return sorted(b for b, _ in pool._engine.entries)  # noqa: SLF001 - the facts the tests compare across ranks


@case
def agreed_max() -> dict[str, Any]:
    """batch='max': per-rank sizes differ; every rank runs the same bucket and gets the summed rows."""
    model = SumModel()
    pool = ShapeBucketPool(model, [2, 4, 8], simulate_padding=True, progress=False,
                           process_group=agreement(batch="max"))
    plan = {0: [3, 5, 1, 7, 2], 1: [5, 2, 1, 8, 2], 2: [1, 6, 1, 3, 4]}
    errs, shapes = [], []
    for call in range(5):
        inputs = [data(r, call, plan[r % 3][call]) for r in range(WORLD)]
        out = pool(inputs[RANK])
        shapes.append(list(out.shape))
        errs.append((out - expected_sum(model, inputs)[: inputs[RANK].shape[0]]).abs().max().item())
    return {"max_err": max(errs), "shapes": shapes, "buckets": bucket_keys(pool), "runs": model.runs,
            "failed": pool.failed_buckets}


@case
def strict_mismatch() -> dict[str, Any]:
    """batch='equal': different sizes raise the same ValueError on every rank; equal ones then run."""
    model = SumModel()
    pool = ShapeBucketPool(model, [2, 4, 8], simulate_padding=True, progress=False, process_group=agreement())
    try:
        pool(data(RANK, 0, 3 + 2 * RANK))
        message = None
    except ValueError as exc:
        message = str(exc)
    out = pool(data(RANK, 1, 4))
    err = (out - expected_sum(model, [data(r, 1, 4) for r in range(WORLD)])).abs().max().item()
    return {"message": message, "err_after": err, "runs": model.runs}


@case
def fault_fallback() -> dict[str, Any]:
    """The last rank's model raises in bucket 8's capture (after its all_reduce): every rank runs 8 eagerly.

    The first call (2 rows) runs on its own rows and decides padding, so the first 8-row run is bucket 8's capture."""
    model = SumModel()
    at_capture = CaptureStage(8, WORLD - 1)

    def fault(x: torch.Tensor) -> None:
        if at_capture(x):
            raise RuntimeError("injected capture fault")

    model.fault = fault
    pool = ShapeBucketPool(model, [2, 4, 8], simulate_padding=True, progress=False, process_group=agreement())
    errs = []
    for call, n in enumerate([2, 8, 3, 8, 6, 2, 8]):
        inputs = [data(r, call, n) for r in range(WORLD)]
        out = pool(inputs[RANK])
        errs.append((out - expected_sum(model, inputs)).abs().max().item())
    return {"max_err": max(errs), "failed": pool.failed_buckets, "captured": pool.captured_buckets,
            "buckets": bucket_keys(pool), "runs": model.runs, "fired": not at_capture.armed}


@case
def padding_disagrees() -> dict[str, Any]:
    """Rows interact on rank 1 only: its row analysis refuses padding, and every rank stops padding that key."""

    def model(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + (x.mean(0, keepdim=True) if RANK == 1 else 0)

    pool = ShapeBucketPool(model, [4, 8], simulate_padding=True, progress=False, process_group=agreement())
    outs = [pool(data(RANK, c, n)) for c, n in enumerate([3, 3, 8])]
    errs = [(o - model(data(RANK, c, o.shape[0]))).abs().max().item() for c, o in enumerate(outs)]
    return {"row_coupled": list(pool.row_coupled.values()), "max_err": max(errs)}


@case
def raised_in_capture() -> dict[str, Any]:
    """Rank 1 raises KeyboardInterrupt inside bucket 4's capture: the others raise at once, naming it."""
    model = SumModel()
    at_capture = CaptureStage(4, 1)

    def fault(x: torch.Tensor) -> None:
        if at_capture(x):
            raise KeyboardInterrupt("injected interrupt")

    model.fault = fault
    pool = ShapeBucketPool(model, [2, 4], simulate_padding=True, progress=False, process_group=agreement())
    pool(data(RANK, 2, 2))  # its own run decides padding: the next 4-row run is bucket 4's capture
    t0 = time.perf_counter()
    try:
        pool(data(RANK, 0, 4))
        outcome = "returned"
    except KeyboardInterrupt as exc:
        outcome = f"KeyboardInterrupt: {exc}"
    except RankAgreementError as exc:
        outcome = f"RankAgreementError: {exc}"
    elapsed = time.perf_counter() - t0
    inputs = [data(r, 1, 4) for r in range(WORLD)]
    out = pool(inputs[RANK])  # every rank tries the capture again, and this time it holds
    return {"outcome": outcome, "elapsed": elapsed, "err_after": (out - expected_sum(model, inputs)).abs().max().item(),
            "captured_or_simulated": bucket_keys(pool), "failed": pool.failed_buckets,
            "captured": pool.captured_buckets}


@case
def tensor_parallel_mlp() -> dict[str, Any]:
    """Column- then row-parallel linears with an all_reduce, through the pool at many sizes: the full MLP."""
    h = 256 if DEVICE == "cuda" else H
    w1, w2 = weight(1, h, 4 * h, scaled=True), weight(2, 4 * h, h, scaled=True)
    cols = slice(RANK * 4 * h // WORLD, (RANK + 1) * 4 * h // WORLD)
    w1_part, w2_part = w1[:, cols].contiguous(), w2[cols].contiguous()

    def tp_mlp(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x @ w1_part) @ w2_part
        dist.all_reduce(y)
        return y

    buckets = [1, 2, 4, 8, 16, 24, 32, 48, 64] if DEVICE == "cuda" else [1, 2, 4, 8, 16]
    sizes = ([(7 * k) % 64 + 1 for k in range(64)] + [64, 1, 33] if DEVICE == "cuda"  # every size in 1..64
             else [1, 3, 16, 5, 8, 11, 2, 7, 13, 4])
    pool = ShapeBucketPool(tp_mlp, buckets, simulate_padding=True, progress=False, process_group=agreement())
    errs = []
    with torch.no_grad():
        for call, n in enumerate(sizes):
            x = data(0, call, n, h)  # every rank holds the same input (tensor parallelism)
            errs.append((pool(x) - torch.relu(x @ w1) @ w2).abs().max().item())
    return {"max_err": max(errs), "failed": pool.failed_buckets, "row_coupled": list(pool.row_coupled),
            "captured": pool.captured_buckets, "sizes": len(set(sizes))}


@case
def compile_backend() -> dict[str, Any]:
    """torch.compile(backend="gfxgraph"): a frame with a collective is refused without process_group,
    graphed (through an agreed pool) with it; both give the eager result."""
    import torch._dynamo  # heavy: only this case compiles

    from hipgraph_bridge.compile import compiled_subgraphs

    w = weight(5, H, H)

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x @ w
        dist.all_reduce(y)
        return y * 2

    facts: dict[str, Any] = {}
    for label, extra in (("without", {}), ("with", {"process_group": agreement()})):
        torch._dynamo.reset()
        gc.collect()
        before = set(compiled_subgraphs())
        fn = torch.compile(f, backend="gfxgraph", options={"compiler": "eager", "simulate_padding": True, **extra})
        errs = []
        for call, n in enumerate([3, 5, 2, 8]):
            x = data(0, call, n)
            errs.append((fn(x) - (x @ w) * 2 * WORLD).abs().max().item())
        subs = [s for s in compiled_subgraphs() if s not in before]
        facts[label] = {"max_err": max(errs), "states": sorted((s.state.value, s.reason or "") for s in subs),
                        "details": sorted(s.detail for s in subs if s.detail)}
    torch._dynamo.reset()
    return facts


@case
def out_of_step() -> dict[str, Any]:
    """Rank 0 calls pool A while rank 1 calls pool B: both raise, naming each rank's step, and never hang."""
    agreed = agreement(timeout=19.0)  # a group of its own: this one breaks
    pools = [ShapeBucketPool(SumModel(), [2], simulate_padding=True, progress=False, process_group=agreed)
             for _ in range(2)]
    t0 = time.perf_counter()
    try:
        pools[RANK % 2](data(RANK, 0, 2))
        message = "returned"
    except RankAgreementError as exc:
        message = str(exc)
    return {"message": message, "elapsed": time.perf_counter() - t0}


@case
def vram_cap_on_one_rank() -> dict[str, Any]:
    """Rank 1's VRAM cap refuses every capture (GPU): every rank runs every bucket eagerly, none replays."""
    model = SumModel()
    pool = ShapeBucketPool(model, [2, 4], progress=False, vram_cap=1e-6 if RANK == 1 else 0.95,
                           process_group=agreement())
    errs = []
    for call, n in enumerate([2, 3, 4, 1, 4]):
        inputs = [data(r, call, n) for r in range(WORLD)]
        errs.append((pool(inputs[RANK]) - expected_sum(model, inputs)).abs().max().item())
    return {"max_err": max(errs), "failed": pool.failed_buckets, "captured": pool.captured_buckets,
            "runs": model.runs}


@case
def peer_stops_calling() -> dict[str, Any]:
    """Rank 1 stops calling the pool: rank 0 raises after the agreement timeout, and at once afterwards."""
    timeout = 1.5
    model = SumModel()
    pool = ShapeBucketPool(model, [2, 4], simulate_padding=True, progress=False,
                           process_group=agreement(timeout=timeout))
    pool(data(RANK, 0, 2))
    facts: dict[str, Any] = {"timeout": timeout}
    if RANK != 0:
        time.sleep(timeout + 2.5)  # alive, but not calling the pool
        return facts
    for label in ("first", "later"):
        t0 = time.perf_counter()
        try:
            pool(torch.ones(2, H))  # no peer: the model is never reached
            facts[label] = "returned"
        except RankAgreementError as exc:
            facts[label] = str(exc)
        facts[f"{label}_elapsed"] = time.perf_counter() - t0
    return facts


def main() -> None:
    rank, world, port, out, device, names = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]),
                                             sys.argv[5], sys.argv[6:])
    extra: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 sums: the ranks' partial products stay comparable
        extra["device_id"] = torch.device("cuda", rank)  # the communicator is made now, not inside a capture
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60), **extra)
    results: dict[str, Any] = {}
    for name in names:
        dist.barrier()  # every rank starts each scenario together
        try:
            results[name] = {"ok": CASES[name]()}
        except BaseException as exc:  # reported, not raised: the other scenarios still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        out.write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: a peer that timed out may have closed its side


if __name__ == "__main__":
    main()
