"""Start-up: seconds from a fresh process to 36 decode-step buckets graphed and the first call served.

Serving processes pay compile and capture before their first request. Each contender runs in its
own fresh interpreter (``python -m gfxgraph.suites.startup --child ...``), on the llm_decode
suite's 1.2B Llama (random bf16 weights; the decode-shaped step without a KV cache, as in the
call_overhead suite's capture part: transformers' StaticCache fixes its batch at its first write):

* ``pool``: ``ShapeBucketPool`` over the eager step, ``gfxgraph.warmup(pool, example)``
  (its ``capture_all``: 36 buckets largest first);
* ``backend``: ``torch.compile(step, backend="gfxgraph")`` and ``gfxgraph.warmup(f, example,
  buckets=BUCKETS_36)`` (one compile with the batch marked dynamic, a capture per bucket);
* ``reduce-overhead``: ``torch.compile(step, mode="reduce-overhead")`` driven over the same 36
  sizes, largest first, three calls each (CUDA-graph trees warm a shape up, record it, replay it);
* ``backend-regions``: ``backend`` with the decoder layers bound to one compile region
  (``gfxgraph.compile_regions(model.model.layers)``: dynamo and inductor see one layer, not 16) and
  ``warmup(..., one_frame=True)`` (batch 1 served by the frame traced at 256);
* ``backend-saved``: the step (taking the model as an argument) traced once by
  ``gfxgraph.cache.save_compiled`` in the cold process, which writes the frame to a file; the warm
  and portable processes ``gfxgraph.cache.load_compiled`` it and run no dynamo. Then
  ``gfxgraph.warmup`` over the 36 sizes, as for ``backend``.

Phases: ``cold`` (empty inductor and triton cache folders), ``warm`` (a second process, the same
folders kept), and for ``backend`` and ``backend-saved`` ``portable`` (empty folders plus the files
the cold process wrote, loaded by ``gfxgraph.cache.load`` and ``load_compiled``: a new machine).
Each child reports its times since its own start; "to first call" is process start to
the first graphed call's result on the host, minus building the model (weights are not
gfxgraph's to load), and its breakdown: imports, warm-up (compile and capture; the compile
share as the backend counts it), graph memory (graph pools, from the allocator), inductor's
cache hits and misses, and the first call's tokens, compared between phases.
Targets (issue 27) beside each figure.

Bytecode: every child reads compiled bytecode, as after a ``pip install`` (which byte-compiles what it
installs) on a Python whose standard library came with its bytecode. Before the contenders the parent
byte-compiles everything a child can import (the standard library, every site-packages folder,
gfxgraph's source; tests folders left out) into one folder (``PYTHONPYCACHEPREFIX``), which the children
read and do not write (``PYTHONDONTWRITEBYTECODE``), so no contender's figures depend on which ran
before it. With a prefix set Python reads bytecode only there (never from ``__pycache__``), so whatever
the parent leaves out is compiled from source in every child. Without this, an environment that sets
``PYTHONDONTWRITEBYTECODE`` over sources installed without bytecode (the H200 we measure on) makes every
process compile torch's Python sources again: 6.8 s of a profiled warm process. Until 2026-12-06 the
prefix held only the heavy packages (torch, transformers and their dependencies, gfxgraph), so every
child still compiled the standard library and the smaller packages it imported: 1036 modules in a
profiled warm ``backend-saved`` process on the H100.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import pstats
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any

import torch

import gfxgraph
import hipgraph_bridge

from gfxgraph.suites._common import child_env, environment, figure, parser, write
from hipgraph_bridge._torch_compat import compile_profile, compile_time_seconds, maybe_mark_dynamic

BUCKETS_36 = sorted([1, 2, 4, 8, 12, *range(16, 257, 8)])
CONTENDERS = ("pool", "backend", "reduce-overhead", "backend-regions", "backend-saved")
NAMED_BACKEND = ("backend", "backend-regions")  # the contenders that compile with the name "gfxgraph"
PORTABLE = ("backend", "backend-saved")  # the contenders with a portable phase (files from the cold process)
FIRST_BATCH = 8  # the first call's batch size: a bucket every contender warmed (reduce-overhead records sizes)


def decode_step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The decode-shaped step with the model as an argument (a saved frame holds no module)."""
    return model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1, :]


def child(contender: str, phase: str, blob: str, spawned: float) -> dict[str, Any]:
    """One contender's start-up in this (fresh) process, started at ``spawned`` (epoch seconds, the
    parent's clock before it started the interpreter); the measurements as a dict."""
    from gfxgraph.suites.call_overhead import build_llama  # transformers: this suite alone needs it
    from gfxgraph.suites.llm_decode import CONFIGS

    imported = time.time()
    out: dict[str, Any] = {"contender": contender, "phase": phase, "import_s": imported - spawned}
    bypassed = _CacheBypasses()  # why a graph skipped inductor's or AOTAutograd's cache: it recompiles every start
    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        lg = logging.getLogger(name)
        lg.addHandler(bypassed)
        lg.setLevel(min(lg.getEffectiveLevel(), logging.INFO))
    if contender in PORTABLE and phase == "portable":
        out["loaded"] = gfxgraph.cache.load(blob)
    t = time.time()
    model = build_llama(CONFIGS["llama-1.2b"])
    torch.cuda.synchronize()
    out["model_s"] = time.time() - t

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1, :]

    example = (torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.zeros(1, 1, dtype=torch.long, device="cuda"))
    ids = torch.arange(FIRST_BATCH, device="cuda").view(FIRST_BATCH, 1) * 7 + 11
    pos = torch.full((FIRST_BATCH, 1), 3, dtype=torch.long, device="cuda")
    t = time.time()
    with torch.no_grad():
        if contender == "pool":
            run: Any = gfxgraph.ShapeBucketPool(step, BUCKETS_36, progress=False)
            rep = gfxgraph.warmup(run, *example, progress=False)
            out.update(graphs=rep.graphs, compile_s=0.0, capture_s=rep.seconds)
        elif contender in ("backend", "backend-regions"):
            fast = contender == "backend-regions"
            if fast:
                gfxgraph.compile_regions(model.model.layers)
            run = torch.compile(step, backend="gfxgraph")
            rep = gfxgraph.warmup(run, *example, buckets=BUCKETS_36, progress=False, one_frame=fast)
            out.update(graphs=rep.graphs, compile_s=rep.compile_seconds)
        elif contender == "backend-saved":
            frame = blob + ".frame"
            t_load = time.time()
            if phase == "cold":
                saved = gfxgraph.cache.save_compiled(frame, decode_step, model, ids, pos)  # traced at batch 8
            else:
                saved = gfxgraph.cache.load_compiled(frame)
            # dynamo's trace, the compile (save_compiled compiles each frame) and the write; or the read
            out["trace_or_load_s"] = time.time() - t_load

            def run(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
                return saved(model, ids, pos)

            rep = gfxgraph.warmup(saved, model, *example, buckets=BUCKETS_36, progress=False)
            out.update(graphs=rep.graphs, compile_s=rep.compile_seconds)
        else:
            run = torch.compile(step, mode="reduce-overhead")
            for i, b in enumerate(reversed(BUCKETS_36)):
                x = torch.zeros(b, 1, dtype=torch.long, device="cuda")
                if i == 0:
                    maybe_mark_dynamic(x, 0)
                for _ in range(3):
                    run(x, x)
        torch.cuda.synchronize()
        out["warmup_s"] = time.time() - t
        logits = run(ids, pos)
        tokens = logits.argmax(-1).tolist()  # the host read: the first call served
    served = time.time()
    times = compile_time_seconds()
    # cold-start breakdown: dynamo's tracing, the backend compiler (inductor inside), gfxgraph's captures
    # (reduce-overhead's recordings are cudagraph trees', which gfxgraph does not time)
    out["breakdown_s"] = {"dynamo": times["dynamo"], "backend compile": times["backend"],
                          "capture": gfxgraph.stats()["capture_seconds"] if contender != "reduce-overhead" else None,
                          "gfxgraph analysis": gfxgraph.backend_stats()["analysis_seconds"]
                          if contender != "reduce-overhead" else None}
    out["compile_profile"] = compile_profile()  # which of dynamo's steps the seconds went to
    out["cache_bypass_reasons"] = sorted(set(bypassed.reasons))
    out.update(tokens=tokens, served_s=served - spawned, to_first_call_s=served - spawned - out["model_s"],
               graph_bytes=gfxgraph.graph_pool_bytes(), cache=gfxgraph.cache.hits())
    if contender in PORTABLE and phase == "cold":
        out["saved"] = gfxgraph.cache.save(blob)
    return out


class _CacheBypasses(logging.Handler):
    """Keeps the messages in which inductor or AOTAutograd says it bypassed its cache, and why."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "ypass" in msg:
            self.reasons.append(msg[:300])


def _bytecode(folder: str) -> dict[str, Any]:
    """Byte-compiles everything a child can import into ``folder`` (the children's ``PYTHONPYCACHEPREFIX``),
    all cores: the standard library, every site-packages folder and gfxgraph's source (tests folders left
    out); what was compiled and how long it took."""
    # the packages' own folders too: a checkout run with PYTHONPATH has them outside site-packages
    dirs = [sysconfig.get_paths()["stdlib"], *site.getsitepackages(), site.getusersitepackages(),
            *(os.path.dirname(os.path.dirname(os.path.abspath(m.__file__ or ""))) for m in (gfxgraph, hipgraph_bridge))]
    dirs = sorted({d for d in dirs if os.path.isdir(d)})
    t = time.time()
    done = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", "-x", r"[/\\]tests?[/\\]", *dirs],
                          env=_bytecode_env(child_env(), folder, write=True), capture_output=True, text=True)
    # files written for another Python (torch's py312-only test helpers) do not compile: counted, not fatal
    return {"prefix": folder, "folders": dirs, "seconds": time.time() - t,
            "files_not_compiled": done.stdout.count("*** Error compiling")}


def _bytecode_env(env: dict[str, str], folder: str, *, write: bool = False) -> dict[str, str]:
    env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = folder
    if not write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _spawn(contender: str, phase: str, folder: str, blob: str, profile: str | None = None,
           pycache: str | None = None) -> dict[str, Any]:
    env = child_env(TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"),
                    TRITON_CACHE_DIR=os.path.join(folder, "triton"))
    if pycache is not None:
        env = _bytecode_env(env, pycache)
    profiler = ["-m", "cProfile", "-o", profile] if profile else []
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        t0 = time.time()
        try:
            done = subprocess.run([sys.executable, *profiler, "-m", "gfxgraph.suites.startup", "--child", contender,
                                   "--phase", phase, "--blob", blob, "--result", result.name, "--spawned", repr(t0)],
                                  env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:  # the other runs' results still get written
            return {"contender": contender, "phase": phase, "error": "timed out after 900 s", "wall_s": 900.0}
        wall = time.time() - t0
        if done.returncode != 0:
            return {"contender": contender, "phase": phase, "error": done.stderr[-2000:], "wall_s": wall}
        got = json.loads(open(result.name).read())
    got["wall_s"] = wall
    return got


def main() -> None:
    p = parser(__doc__)
    for name in ("--child", "--phase", "--blob", "--result", "--spawned"):  # the parent's, for its children
        p.add_argument(name, default=None, help=argparse.SUPPRESS)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--profile", default="", metavar="CONTENDERS",
                   help="comma-separated contenders whose warm process runs once more, after their phases, under "
                        "cProfile: the raw profile is kept beside the JSON and its functions with the most "
                        "cumulative time go into it (a diagnostic: no figure comes from it)")
    p.add_argument("--refigure", default=None, metavar="JSON",
                   help="recompute the figures of a startup.json from its results with this version's rules (no "
                        "GPU); written to --out with the environment and results of the run that measured them")
    args = p.parse_args()
    if args.refigure:
        run = json.loads(open(args.refigure).read())
        extra = {k: v for k, v in run.items() if k not in ("benchmark", "environment", "figures")}
        write(args.out, "startup", figures(run["results"]),
              {**extra, "refigured": "figures recomputed from these results (--refigure)"},
              env=run.get("environment") or {})
        return
    if args.child:
        res = child(args.child, args.phase, args.blob, float(args.spawned))
        with open(args.result, "w") as f:
            json.dump(res, f)
        return
    named = sorted(set(args.contenders.split(",")) & set(NAMED_BACKEND))
    if named and not _backend_entry_point():
        raise SystemExit(f"startup: {', '.join(named)} call torch.compile(backend=\"gfxgraph\"), which PyTorch finds "
                         "through gfxgraph's torch_dynamo_backends entry point, and this Python has none: install "
                         "gfxgraph (pip install --no-deps -e .), or put a checkout set up by it (its "
                         "src/gfxgraph.egg-info) on PYTHONPATH")
    if not torch.cuda.is_available():
        raise SystemExit("startup: needs a CUDA or ROCm GPU")
    unknown = sorted(set(filter(None, args.profile.split(","))) - set(args.contenders.split(",")))
    if unknown:
        raise SystemExit(f"startup: --profile names {', '.join(unknown)}, which --contenders does not run")
    runs: dict[str, dict[str, Any]] = {}
    profiles: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pycache = os.path.join(tmp, "pycache")
        bytecode = _bytecode(pycache)
        for c in args.contenders.split(","):
            folder = os.path.join(tmp, c)
            phases = ("cold", "warm", "portable") if c in PORTABLE else ("cold", "warm")
            files = os.path.join(tmp, f"{c}-compile-cache.bin")  # the cold process writes, the others read
            for ph in phases:
                runs[f"{c} {ph}"] = _spawn(c, ph, os.path.join(tmp, f"{c}-new") if ph == "portable" else folder,
                                           files, pycache=pycache)
                _keep_partial(args.out, runs, profiles)
            if c in args.profile.split(","):  # the raw profile is kept beside the JSON (pstats reads it)
                stats = os.path.join(args.out, f"startup-{c}-warm.prof")
                got = _spawn(c, "warm", folder, files, profile=stats, pycache=pycache)
                profiles[c] = {"to_first_call_s (profiled)": got.get("to_first_call_s"), "error": got.get("error"),
                               "top": _top_functions(stats) if os.path.exists(stats) else []}
                _keep_partial(args.out, runs, profiles)
    write(args.out, "startup", figures(runs), {"method": __doc__, "bytecode": bytecode, "results": runs,
                                               "warm_profiles": profiles})
    os.remove(os.path.join(args.out, "startup.partial.json"))  # startup.json holds it all


def _backend_entry_point() -> bool:
    """Whether PyTorch can look ``backend="gfxgraph"`` up: its children run that name, not the function."""
    return any(ep.name == "gfxgraph" for ep in importlib.metadata.entry_points(group="torch_dynamo_backends"))


def _keep_partial(out: str, runs: dict[str, Any], profiles: dict[str, Any]) -> None:
    """The runs so far, in ``out/startup.partial.json``: they survive a parent killed by a time limit."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "startup.partial.json"), "w") as f:
        json.dump({"environment": environment(), "results": runs, "warm_profiles": profiles}, f, default=str)


def _top_functions(stats_file: str, n: int = 45) -> list[str]:
    """The ``n`` functions with the most cumulative time in a cProfile file, one line each."""
    st = pstats.Stats(stats_file)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:n]  # type: ignore[attr-defined]
    return [f"{ct:8.3f} s cum {tt:8.3f} s own {nc:>7} calls  {file}:{line}({fn})"
            for (file, line, fn), (_, nc, tt, ct, _) in rows]


def figures(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's start-up beside the issue's targets (runs that failed are reported as such)."""
    figs: list[dict[str, Any]] = []
    for name, r in runs.items():
        if "error" in r:
            figs.append(figure(f"{name}: failed", float("nan"), None, False, note=r["error"].splitlines()[-1]
                               if r["error"] else ""))
            continue
        figs.append(figure(f"{name}: process start to first graphed call, model build excluded",
                           r["to_first_call_s"], None, None, "s",
                           note=f"imports {r['import_s']:.1f} s, warm-up {r['warmup_s']:.1f} s"
                                f" (inside it: compile {r.get('compile_s', float('nan')):.1f} s"
                                + (f", frame saved (traced and compiled) or loaded {r['trace_or_load_s']:.1f} s"
                                   if "trace_or_load_s" in r else "")
                                + "), graph memory "
                                f"{r['graph_bytes'] / 2**20:.0f} MiB, fx-graph cache hits/misses "
                                f"{r['cache']['fx_graph_hit']}/{r['cache']['fx_graph_miss']}"
                                + "".join(f", {k} {v:.1f} s" for k, v in r.get("breakdown_s", {}).items()
                                          if v is not None)))
    ok = {k: r for k, r in runs.items() if "error" not in r}
    ro = ok.get("reduce-overhead warm")
    for c in ("backend", "backend-regions", "backend-saved"):
        warm = ok.get(f"{c} warm")
        if warm is None:
            continue
        figs.append(figure(f"{c} warm start: to first graphed call", warm["to_first_call_s"], "<= 5 s",
                           warm["to_first_call_s"] <= 5.0, "s"))
        if ro is not None:
            ratio = warm["to_first_call_s"] / ro["to_first_call_s"]
            figs.append(figure(f"{c} warm / reduce-overhead warm", ratio, "<= 0.5", ratio <= 0.5))
    pool = ok.get("pool warm") or ok.get("pool cold")
    if pool is not None:
        captures = pool["breakdown_s"]["capture"]
        figs.append(figure("capture of the 36 buckets (the pool's graph captures)", captures, "<= 1.0 s",
                           captures <= 1.0, "s"))
        figs.append(figure("pool warm-up of the 36 buckets (per bucket: an eager warm-up run, the capture, "
                           "the padding check's replays)", pool["capture_s"], None, None, "s"))
    for c in CONTENDERS:
        cold = ok.get(f"{c} cold")
        for ph in ("warm", "portable"):
            other = ok.get(f"{c} {ph}")
            if cold is not None and other is not None:
                same = other["tokens"] == cold["tokens"]
                figs.append(figure(f"{c} {ph}: first call's tokens equal the cold process's", float(same), "== 1",
                                   same))
    return figs


if __name__ == "__main__":
    main()
