"""Prefill of prompts of every length: piecewise graphs vs eager, torch.compile's modes, whole-graph gfxgraph.

A Llama-shaped model built from plain torch modules (RMSNorm, rotary embeddings from the
position ids, grouped-query attention through ``F.scaled_dot_product_attention`` with
``is_causal=True``, SwiGLU MLP), random bf16 weights, in two sizes: ``llama-small`` and the
1.5B (untied Llama-3.2-1B-shaped) config of llm_decode.py. A request is
``model(input_ids (B, L), position_ids (B, L), last (B,)) -> logits (B, vocab)`` of each
row's last prompt token (as a serving stack's prefill computes them).

* stream: 200 requests at batch 1, prompt lengths drawn from 1..1024 (fixed seed);
* mixed: 24 batches of 1..8 requests of lengths drawn from 1..1024, right-padded to the
  longest (causal attention: the padding after a prompt never reaches its last token).

Contenders, in this order, one process per model, every dynamo frame reset in between:
eager, ``backend="gfxgraph"`` with ``piecewise=True`` (token buckets up to 1024),
``backend="gfxgraph"`` (whole-graph batch buckets), ``mode="default"``,
``mode="reduce-overhead"``. The first request marks the sequence dimension dynamic for
every compiled contender alike (one frame for every length; dynamo adds one for length 1).
Compilation runs with inductor's caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), after
every compile path compiled a tiny function once, so each contender pays its own compile.
To fit the time budget (about four minutes on an H200), reduce-overhead runs the first 60
requests of the stream only (it records a graph per prompt length), the mixed run runs on the
small model only and whole-graph ``backend="gfxgraph"`` on the small model only; the JSON
records what ran (``--slow-stream``, ``--mixed-models``, ``--all-contenders`` change it).

Where one command may not run both models, run one model per command (``--models llama-small
--out A``, then ``--models llama-1.5b --out B``) and merge the two: ``--merge A/prefill.json
B/prefill.json --out C`` writes one ``prefill.json`` whose figures and plot are recomputed from
both runs' results (no GPU needed). Each child prints progress lines with elapsed seconds on
stderr, and one line per finished contender on stdout: a child killed by its timeout
(``--child-timeout``, 400 s) leaves the contenders it finished in the JSON, the others marked
failed with the reason.

Per contender: total time for the stream (first pass: compile, capture or recording
included); an untimed second pass (reduce-overhead records a shape's graph on its second
call); steady latency per request (third pass, a host sync around each request) against
prompt length; the same for the mixed run; graph memory (graph-pool bytes from the
allocator); logits' max difference from eager. Totals are compared on the requests both ran.

Targets (issue 15): piecewise total for the stream <= 1/5 of reduce-overhead's; steady
latency <= 0.77x ``mode="default"`` for prompts of at most 64 tokens on the small model, and
<= 1.02x ``mode="default"`` at every length (median per length bin) on both models; graph
memory reported against reduce-overhead's; logits within bf16 tolerance of eager.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gfxgraph.suites._common import child_env, parser, write
from gfxgraph.suites._prefill_report import CONTENDERS, figures_of, merge, plot
from hipgraph_bridge import graph_pool_bytes
from hipgraph_bridge.graph.memory import graph_pool_ids
from hipgraph_bridge.compile import backend_stats, compiled_subgraphs, register
from hipgraph_bridge.validation import tolerance_for

CONFIGS = {
    "llama-1.5b": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256),
    "llama-small": dict(hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=2, vocab=32000),
}
MAX_LEN = 1024
PIECEWISE_OPTIONS = {"piecewise": True, "max_tokens": MAX_LEN}
# the child's stdout: one header line, then one line per contender as it finishes (kept if it is killed later)
_HEAD, _MARK = "MODEL ", "CONTENDER "
DEVICE = "cuda"  # a smoke test of this script's logic may set "cpu"
CHILD_TIMEOUT_S = 400
PROGRESS_EVERY = 25  # first-pass requests between progress lines


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Progress:
    """Progress lines on stderr, flushed at once, so that a killed child shows where its time went."""

    def __init__(self, model: str) -> None:
        self.model, self.mode = model, "setup"
        self.t0 = self.tc = time.perf_counter()

    def start(self, mode: str) -> None:
        self.mode, self.tc = mode, time.perf_counter()
        self("start")

    def seconds(self) -> float:
        """Seconds since the current contender started."""
        return time.perf_counter() - self.tc

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        print(f"prefill {self.model} {self.mode}: {what} [{now - self.tc:.1f} s into {self.mode}, "
              f"{now - self.t0:.1f} s into the child]", file=sys.stderr, flush=True)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    def __init__(self, c: dict[str, int]) -> None:
        super().__init__()
        h, self.nh, self.nkv = c["hidden"], c["heads"], c["kv_heads"]
        self.hd = h // self.nh
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.q = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o = nn.Linear(self.nh * self.hd, h, bias=False)
        self.gate = nn.Linear(h, c["intermediate"], bias=False)
        self.up = nn.Linear(h, c["intermediate"], bias=False)
        self.down = nn.Linear(c["intermediate"], h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (B, L, H)
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.nh, self.hd).transpose(1, 2)  # (B, nh, L, hd)
        k = self.k(h).view(b, s, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, L, hd)
        v = self.v(h).view(b, s, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv  # repeat_kv, as transformers does before sdpa
        k = k[:, :, None].expand(b, self.nkv, rep, s, self.hd).reshape(b, self.nh, s, self.hd)
        v = v[:, :, None].expand(b, self.nkv, rep, s, self.hd).reshape(b, self.nh, s, self.hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, self.nh * self.hd))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, c: dict[str, int]) -> None:
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])
        self.head = nn.Linear(c["hidden"], c["vocab"], bias=False)
        self.hd = c["hidden"] // c["heads"]

    def set_rope(self, theta: float = 500000.0) -> None:
        """A float32 buffer, registered after the bf16 conversion so it stays float32."""
        dev = self.head.weight.device
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.hd, 2, device=dev).float() / self.hd))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, L, H)
        freqs = pos[..., None].float() * self.inv_freq  # (B, L, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, hd)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = x.gather(1, last.view(-1, 1, 1).expand(-1, 1, x.shape[-1]))  # (B, 1, H): each row's last token
        return self.head(self.norm(h))[:, 0]  # (B, vocab)


def build(name: str) -> Llama:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        m = Llama(CONFIGS[name])
    m = m.to(torch.bfloat16).eval()
    m.set_rope()
    return m


def make_requests(n_stream: int, n_mixed: int, vocab: int) -> tuple[list[Any], list[Any]]:
    """(stream, mixed): each request (ids, pos, last, lengths)."""
    rng = random.Random(0)
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def request(lengths: list[int]) -> tuple[Any, ...]:
        top = max(lengths)
        ids = torch.randint(1, vocab, (len(lengths), top), device=DEVICE, generator=g)
        for row, n in enumerate(lengths):
            ids[row, n:] = 0  # right padding
        pos = torch.arange(top, device=DEVICE).repeat(len(lengths), 1)
        last = torch.tensor([n - 1 for n in lengths], device=DEVICE)
        return ids, pos, last, lengths

    stream = [request([rng.randint(1, MAX_LEN)]) for _ in range(n_stream)]
    mixed = [request([rng.randint(1, MAX_LEN) for _ in range(rng.randint(2 if i == 0 else 1, 8))])
             for i in range(n_mixed)]
    return stream, mixed


def make_fn(model: Llama, mode: str) -> Any:
    if mode == "eager":
        return model
    if mode in ("piecewise", "gfxgraph"):
        return torch.compile(model, backend="gfxgraph", options=PIECEWISE_OPTIONS if mode == "piecewise" else None)
    return torch.compile(model, mode=mode)


def first_pass(fn: Any, reqs: list[Any], mark: tuple[int, ...], checkpoint: int = 0,
               say: Progress | None = None) -> tuple[float, float, list[torch.Tensor]]:
    """Seconds for one pass (compile and capture included), and for its first ``checkpoint`` requests;
    the first request marks the dims ``mark`` dynamic. ``say``: a progress line every few requests."""
    outs = []
    at = 0.0
    sync()
    t0 = time.perf_counter()
    for i, (ids, pos, last, _) in enumerate(reqs):
        if i == checkpoint and checkpoint:
            sync()
            at = time.perf_counter() - t0
        if say is not None and i and i % PROGRESS_EVERY == 0:
            say(f"first pass, {i}/{len(reqs)} requests")
        if i == 0 and not isinstance(fn, nn.Module):
            for t in (ids, pos):
                for d in mark:
                    torch._dynamo.mark_dynamic(t, d)
        outs.append(fn(ids, pos, last).clone())
    sync()
    total = time.perf_counter() - t0
    return total, at or total, outs


def steady_pass(fn: Any, reqs: list[Any]) -> tuple[list[float], list[torch.Tensor]]:
    """Milliseconds per request (host sync before and after each), and the logits."""
    ms, outs = [], []
    for ids, pos, last, _ in reqs:
        sync()
        t0 = time.perf_counter()
        out = fn(ids, pos, last)
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
        outs.append(out.clone())
    return ms, outs


def max_diff(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, bool]:
    """Largest |logit - eager| over the requests, and whether every request is within bf16 tolerance."""
    tol = tolerance_for(torch.bfloat16)
    worst, ok = 0.0, True
    for a, b in zip(outs, ref):
        worst = max(worst, (a.float() - b.float()).abs().max().item())
        ok = ok and torch.allclose(a.float(), b.float(), rtol=tol.rtol, atol=tol.atol)
    return worst, ok


def warm_compilers() -> None:
    """Pay inductor's process start-up before any timed compile, for every compile path alike."""
    register()
    x = torch.randn(4, 8, device=DEVICE)
    for kw in ({"mode": "default"}, {"mode": "reduce-overhead"}, {"backend": "gfxgraph"}):
        torch.compiler.reset()
        f = torch.compile(lambda t: F.gelu(t) * 2 + 1, **kw)
        with torch.no_grad():
            for _ in range(3):
                f(x)
    torch.compiler.reset()
    sync()


def run_contender(model: Llama, mode: str, stream: list[Any], mixed: list[Any],
                  eager: dict[str, Any] | None, checkpoint: int, say: Progress) -> dict[str, Any]:
    """One contender: the first pass (timed whole), an untimed pass (graphs recorded on a shape's
    second call settle), the steady pass (timed per request); then the same for the mixed run."""
    torch.compiler.reset()
    sync()
    pools_before = graph_pool_ids()
    fn = make_fn(model, mode)
    res: dict[str, Any] = {"mode": mode, "stream_requests": len(stream), "mixed_batches": len(mixed)}
    with torch.no_grad():
        res["stream_total_s"], res["checkpoint_total_s"], first = first_pass(fn, stream, (1,), checkpoint, say)
        say(f"first pass of the stream: {res['stream_total_s']:.1f} s")
        t0 = time.perf_counter()
        steady_pass(fn, stream)
        res["settle_pass_s"] = time.perf_counter() - t0
        res["stream_ms"], outs = steady_pass(fn, stream)
        say(f"settle and steady passes of the stream: {res['settle_pass_s']:.1f} s and "
            f"{sum(res['stream_ms']) / 1e3:.1f} s")
        mixed_outs: list[torch.Tensor] = []
        if mixed:
            res["mixed_total_s"], _, _ = first_pass(fn, mixed, (0, 1))
            steady_pass(fn, mixed)
            res["mixed_ms"], mixed_outs = steady_pass(fn, mixed)
            say(f"mixed run: first pass {res['mixed_total_s']:.1f} s")
    sync()
    res["graph_bytes"] = graph_pool_bytes(graph_pool_ids() - pools_before)  # this contender's own pools
    if eager is not None:
        res["stream_max_diff"], res["stream_within_tol"] = max_diff(outs, eager["stream_outs"][:len(outs)])
        res["mixed_max_diff"], res["mixed_within_tol"] = max_diff(mixed_outs, eager["mixed_outs"])
        res["first_pass_max_diff"], _ = max_diff(first, eager["stream_outs"][:len(first)])
    else:
        res["stream_outs"], res["mixed_outs"] = outs, mixed_outs
    if mode in ("piecewise", "gfxgraph"):
        res["backend"] = backend_stats()
        res["subgraphs"] = [repr(s) for s in compiled_subgraphs()]
    del fn
    torch.compiler.reset()
    return res


def _emit(mark: str, doc: dict[str, Any]) -> None:
    print(mark + json.dumps(doc), flush=True)


def child(name: str, n_stream: int, n_mixed: int, slow_stream: int, contenders: list[str]) -> None:
    """The contenders on one model. On stdout: a header line (:data:`_HEAD`), then one line per
    contender as it finishes, failed ones too (:data:`_MARK`), so a parent that kills this process
    keeps what finished; progress lines on stderr."""
    say = Progress(name)
    model = build(name)
    stream, mixed = make_requests(n_stream, n_mixed, CONFIGS[name]["vocab"])
    with torch.no_grad():  # CUDA context, cuBLAS handles, workspaces: outside every timing
        model(*stream[0][:3])
    warm_compilers()
    say("model built, compilers warmed")
    _emit(_HEAD, {"model": name, "slow_stream": slow_stream, "contenders": contenders,
                  "params": sum(p.numel() for p in model.parameters()),
                  "stream_lengths": [r[3][0] for r in stream], "mixed_lengths": [r[3] for r in mixed]})
    eager = None
    for mode in contenders:
        n = slow_stream if mode == "reduce-overhead" else n_stream
        say.start(mode)
        try:
            res = run_contender(model, mode, stream[:n], mixed, eager, slow_stream, say)
        except Exception as exc:  # one contender's failure is reported, the others still run
            say(f"failed: {type(exc).__name__}: {exc}"[:500])
            _emit(_MARK, {"mode": mode, "result": {"error": f"{type(exc).__name__}: {exc}"[:2000]}})
            torch.compiler.reset()
            continue
        res["contender_wall_s"] = say.seconds()
        say(f"done: stream total {res['stream_total_s']:.2f} s, median {statistics.median(res['stream_ms']):.3f} ms")
        if mode == "eager":
            eager = res
        _emit(_MARK, {"mode": mode, "result": {k: v for k, v in res.items() if not k.endswith("_outs")}})


def collect(name: str, stdout: str, failure: str | None) -> dict[str, Any]:
    """A model's results from its child's stdout: the header and every contender that finished.

    ``failure`` (None when the child exited 0) says why it stopped; the contender that was
    running and those after it get an error naming it, and the result an ``incomplete`` note.
    """
    res: dict[str, Any] | None = None
    for line in stdout.splitlines():
        if line.startswith(_HEAD):
            res = json.loads(line[len(_HEAD):])
        elif line.startswith(_MARK) and res is not None:
            part = json.loads(line[len(_MARK):])
            res[part["mode"]] = part["result"]
    if res is None:
        return {"model": name, "error": failure or "the child printed no results"}
    missing = [c for c in res["contenders"] if c not in res]
    if missing:
        why = failure or "the child exited without the results of every contender"
        for i, mode in enumerate(missing):
            res[mode] = {"error": f"{why} while this contender ran" if i == 0 else f"not started: {why} first"}
        done = [c for c in res["contenders"] if c not in missing]
        res["incomplete"] = f"{why}; finished: {', '.join(done) or 'none'}; not finished: {', '.join(missing)}"
    return res


def run_collect(name: str, cmd: list[str], *, env: dict[str, str] | None, timeout: float) -> dict[str, Any]:
    """Run a child in a process group of its own and :func:`collect` what it printed. Past
    ``timeout`` seconds the whole group (compile workers included) is killed; what finished stays."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
        failure = None if rc == 0 else f"the child exited with status {rc}"
    except subprocess.TimeoutExpired:
        failure = f"the child was killed after the {timeout:g} s timeout (--child-timeout)"
        _kill_group(proc)
    except BaseException:  # an interrupted parent leaves no child behind
        _kill_group(proc)
        raise
    reader.join(timeout=10)
    return collect(name, "".join(lines), failure)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group that ``proc`` leads (not yet reaped, so its id is still its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"gfxgraph-prefill-{name}-") as tmp:
        env = child_env(TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"), TRITON_CACHE_DIR=str(Path(tmp) / "triton"),
                        PYTHONUNBUFFERED="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")  # each contender pays its own compile
        mixed = args.mixed if name in args.mixed_models.split(",") else 0
        contenders = [c for c in CONTENDERS if name == "llama-small" or args.all_contenders or c != "gfxgraph"]
        cmd = [sys.executable, "-m", "gfxgraph.suites.prefill", "--child", name, "--stream", str(args.stream), "--mixed", str(mixed),
               "--slow-stream", str(args.slow_stream), "--contenders", ",".join(contenders)]
        t0 = time.perf_counter()
        print(f"prefill {name}: child started ({', '.join(contenders)}; timeout {args.child_timeout:g} s)",
              file=sys.stderr, flush=True)
        res = run_collect(name, cmd, env=env, timeout=args.child_timeout)
        print(f"prefill {name}: child ended after {time.perf_counter() - t0:.1f} s"
              + (f": {res.get('error') or res.get('incomplete')}" if "error" in res or "incomplete" in res else ""),
              file=sys.stderr, flush=True)
        return res


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="llama-small,llama-1.5b")
    p.add_argument("--stream", type=int, default=None, help="requests in the batch-1 stream (200)")
    p.add_argument("--mixed", type=int, default=None, help="batches in the mixed run (24)")
    p.add_argument("--slow-stream", type=int, default=None, help="stream requests for reduce-overhead (60)")
    p.add_argument("--mixed-models", default="llama-small", help="models that also run the mixed batches")
    p.add_argument("--all-contenders", action="store_true",
                   help="also run whole-graph backend='gfxgraph' on the 1.5B model (skipped for time by default)")
    p.add_argument("--child-timeout", type=float, default=CHILD_TIMEOUT_S,
                   help=f"seconds a model's child may run before it is killed (default {CHILD_TIMEOUT_S}); the "
                        "contenders it finished are kept")
    p.add_argument("--merge", nargs="+", metavar="PREFILL_JSON",
                   help="write one prefill.json in --out from the prefill.json of runs of other models (e.g. "
                        "--models llama-small and --models llama-1.5b), figures and plot recomputed; runs nothing "
                        "and needs no GPU")
    p.add_argument("--child", choices=tuple(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.merge:
        if args.child or args.models != p.get_default("models"):
            p.error("--merge: expected the prefill.json files and --out only (it runs no model)")
        try:
            merge(args.merge, args.out)
        except (OSError, ValueError) as exc:
            p.error(str(exc))
        return
    if args.child_timeout <= 0:
        p.error(f"--child-timeout: expected a positive number of seconds, got {args.child_timeout:g}")
    args.stream = args.stream or (24 if args.quick else 200)
    args.mixed = args.mixed or (6 if args.quick else 24)
    args.slow_stream = min(args.slow_stream or (12 if args.quick else 60), args.stream)
    if args.child:
        child(args.child, args.stream, args.mixed, args.slow_stream, args.contenders.split(","))
        return
    models = ["llama-small"] if args.quick and args.models == p.get_default("models") else args.models.split(",")
    results = [run_child(name, args) for name in models]
    extra = {"method": __doc__, "quick": args.quick, "plot": plot(results, args.out), "results": results,
             "requests": {"stream": args.stream, "mixed batches": args.mixed, "mixed run on": args.mixed_models,
                          "reduce-overhead stream": args.slow_stream,
                          "note": "reduce-overhead runs the first 'reduce-overhead stream' requests only (it records "
                                  "a graph per prompt length); totals are compared on those requests. The mixed run "
                                  "and, on the 1.5B model, whole-graph backend='gfxgraph' are left out by default "
                                  "to fit the time budget (--mixed-models, --all-contenders)"}}
    write(args.out, "prefill", figures_of(results), extra)


if __name__ == "__main__":
    main()
