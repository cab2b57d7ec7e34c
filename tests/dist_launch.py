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


def launch_groups(groups: list[tuple[int, list[str]]], *, timeout: float = 60.0) -> list[dict[str, Any]]:
    """:func:`launch` on the CPU for several groups at once (each of its own size, port and scenarios), all
    started together, one result per group; every rank is forked from a warm interpreter that imported torch
    (``_warm_python``: a rank's start-up then costs no torch import). The same bound kills every rank."""
    import _warm_python

    env = {**os.environ, **NO_MULTICAST, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GFXGRAPH": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        argvs, outs, logs, sizes = [], [], [], []
        for g, (world, scenarios) in enumerate(groups):
            port = free_port()
            sizes.append(world)
            for r in range(world):
                outs.append(Path(tmp) / f"group{g}_rank{r}.json")
                logs.append(Path(tmp) / f"group{g}_rank{r}.log")
                argvs.append([str(CASES), str(r), str(world), str(port), str(outs[-1]), "cpu", *scenarios])
        t0 = time.perf_counter()
        returncodes, killed = _warm_python.run_group(argvs, env=env, outputs=logs, timeout=timeout)
        seconds = time.perf_counter() - t0
        texts = [log.read_text()[-6000:] if log.is_file() else "" for log in logs]
        ranks = [json.loads(o.read_text()) if o.is_file() else {} for o in outs]
    results, start = [], 0
    for world in sizes:
        part = slice(start, start + world)
        results.append({"ranks": ranks[part], "seconds": seconds, "hung": [r for r, k in enumerate(killed[part]) if k],
                        "logs": texts[part], "returncodes": returncodes[part]})
        start += world
    return results


def facts(run: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    """Each rank's facts of ``scenario``, or an assertion error carrying the ranks' errors and logs."""
    got = [r.get(scenario) for r in run["ranks"]]
    if all(g is not None and "ok" in g for g in got):
        return [g["ok"] for g in got]
    detail = "\n".join(f"rank {r}: {g}" for r, g in enumerate(got))
    raise AssertionError(f"scenario {scenario} did not finish on every rank (hung: {run['hung']}):\n{detail}\n"
                         + "\n".join(f"--- rank {r} log ---\n{t}" for r, t in enumerate(run["logs"])))
