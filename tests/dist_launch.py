"""Start every rank of a small process group on this host and collect each rank's scenario facts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = Path(__file__).resolve().parent / "dist_cases.py"
SRC = Path(__file__).resolve().parents[1] / "src"

# NVLink multicast stays off in every process (the device machines' rule); harmless on CPU
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, scenarios: list[str], *, device: str = "cpu", timeout: float = 60.0) -> dict[str, Any]:
    """Run ``scenarios`` on ``world`` ranks; returns {"ranks": [per-rank results], "seconds", "logs"}.

    Every process is killed once ``timeout`` seconds have passed (a hang is a
    failure, never a stuck test run); results written before that are kept.
    """
    port = free_port()
    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GFXGRAPH": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(world)]
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(world)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, str(CASES), str(r), str(world), str(port), str(outs[r]), device,
                                   *scenarios], env=env, stdout=logs[r], stderr=subprocess.STDOUT)
                 for r in range(world)]
        deadline = t0 + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                pass
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in hung:
            procs[r].kill()
            procs[r].wait()
        seconds = time.perf_counter() - t0
        texts = []
        for f in logs:
            f.seek(0)
            texts.append(f.read()[-6000:])
            f.close()
        ranks = [json.loads(o.read_text()) if o.is_file() else {} for o in outs]
    return {"ranks": ranks, "seconds": seconds, "hung": hung, "logs": texts,
            "returncodes": [p.returncode for p in procs]}


def facts(run: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    """Each rank's facts of ``scenario``, or an assertion error carrying the ranks' errors and logs."""
    got = [r.get(scenario) for r in run["ranks"]]
    if all(g is not None and "ok" in g for g in got):
        return [g["ok"] for g in got]
    detail = "\n".join(f"rank {r}: {g}" for r, g in enumerate(got))
    raise AssertionError(f"scenario {scenario} did not finish on every rank (hung: {run['hung']}):\n{detail}\n"
                         + "\n".join(f"--- rank {r} log ---\n{t}" for r, t in enumerate(run["logs"])))
