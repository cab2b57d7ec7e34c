"""Host cost of a pool call, zero-copy calls, a decode loop with a host read per token, capture at scale.

Three parts, each mode of a part run side by side in this process:

1. Host time per call (a 64x64 fp32 Linear; batch 5 in bucket 8, and batch 8), modes interleaved
   round by round, median over rounds of the mean over 200 calls (a sync between batches of
   calls keeps the launch queue from filling): raw ``torch.cuda.CUDAGraph.replay()``; a
   hand-written bucket loop (copy the rows in, replay, slice, clone); ``ShapeBucketPool`` with
   ``copy_outputs`` on and off; the zero-copy call (``pool.static_io(n).run()``: the caller's
   kernels write the inputs in place, so the call is the replay and its checks); eager;
   ``torch.compile(backend="gfxgraph")``; ``torch.compile(mode="reduce-overhead")``.
2. Greedy decode with a host read of every token (the EOS check a serving loop makes), an HF
   Llama-shaped model (8 layers, hidden 512, random bf16 weights, static KV cache), bs 1 and 8:
   eager, a hand-written ``torch.cuda.graph`` of the step (copy the inputs in, replay), the pool's
   ordinary call (``copy_outputs=False``), the pool's zero-copy call (the loop writes the next
   token and positions into the views), ``backend="gfxgraph"`` and reduce-overhead. ms/token is
   wall time over the steps; tokens are compared with eager's.
3. Capture at scale: 36 buckets of the llm_decode 1.5B model's decode-shaped step (one new token
   per sequence; without a KV cache, because transformers' StaticCache fixes its batch size at
   the first write, so one cache cannot serve every bucket: the kernels per layer are decode's
   minus the cache write): ``capture_all`` (its first capture traced by the row analysis) against
   a hand-written largest-first loop with the garbage collector frozen, the same order and memory
   pool; the row analysis's one-time cost (the step run under the tracer, verdict included, against
   the same eager run, median of 5 each, bs 1 and 8); then the compile backend's warm-up (compile
   and capture) over the same 36 sizes.
Targets (issues 19 and 24) beside each figure.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import torch

from gfxgraph.suites._common import figure, parser, write
from hipgraph_bridge import OriginalCUDAGraph, ShapeBucketPool, graph_pool_bytes
from hipgraph_bridge._torch_compat import RowDispatchMode
from hipgraph_bridge.padding.rows import RowTracer
from gfxgraph.suites.llm_decode import CONFIGS, HandCaptured, new_cache, prefill, warm_compilers

BUCKETS_36 = sorted([1, 2, 4, 8, 12, *range(16, 257, 8)])
DECODE_CFG = {**CONFIGS["llama-small"], "num_hidden_layers": 8}


# ----------------------------------------------------------------------------- part 1
def _per_call_us(fn: Callable[[], Any], n: int = 200) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    t1 = time.perf_counter_ns()
    return (t1 - t0) / n / 1000.0


def call_modes(batch: int, bucket: int = 8) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(batch, 64, device="cuda")
    static_x = torch.zeros(bucket, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(static_x)
    torch.cuda.current_stream().wait_stream(s)
    raw = OriginalCUDAGraph()
    with torch.cuda.graph(raw, stream=s):
        static_y = lin(static_x)

    def hand() -> torch.Tensor:
        static_x[:batch].copy_(x)
        raw.replay()
        return static_y[:batch].clone()

    pool = ShapeBucketPool(lin, [bucket], progress=False)
    pool_nocopy = ShapeBucketPool(lin, [bucket], progress=False, copy_outputs=False)
    zero = ShapeBucketPool(lin, [bucket], progress=False, copy_outputs=False)
    zero(x)
    io = zero.static_io(batch)
    io.args[0].copy_(x)
    torch.compiler.reset()
    backend = torch.compile(torch.nn.Linear(64, 64).cuda(), backend="gfxgraph",
                            options={"buckets": [bucket], "copy_outputs": True})
    backend_nocopy = torch.compile(torch.nn.Linear(64, 64).cuda(), backend="gfxgraph",
                                   options={"buckets": [bucket], "copy_outputs": False})
    dynamo_floor = torch.compile(torch.nn.Linear(64, 64).cuda(), backend="eager")  # dynamo's own cost per call
    ro = torch.compile(torch.nn.Linear(64, 64).cuda(), mode="reduce-overhead")
    modes = {"raw replay": raw.replay, "hand-written loop": hand, "pool": lambda: pool(x),
             "pool copy_outputs=False": lambda: pool_nocopy(x), "pool zero-copy": io.run,
             "eager": lambda: lin(x), "backend=gfxgraph": lambda: backend(x),
             "backend=gfxgraph copy_outputs=False": lambda: backend_nocopy(x),
             'backend="eager" (dynamo alone)': lambda: dynamo_floor(x), "reduce-overhead": lambda: ro(x)}
    for f in modes.values():  # captures, compiles, the padding check
        for _ in range(5):
            f()
    torch.cuda.synchronize()
    assert torch.allclose(io.run(), lin(x), atol=1e-5) and torch.allclose(pool(x), lin(x), atol=1e-5)
    return modes


def part_call_overhead(rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    res: dict[str, Any] = {}
    figs: list[dict[str, Any]] = []
    with torch.no_grad():
        for batch in (5, 8):
            modes = call_modes(batch)
            samples: dict[str, list[float]] = {k: [] for k in modes}
            names = list(modes)
            for r in range(rounds):
                for k in (names if r % 2 == 0 else names[::-1]):
                    samples[k].append(_per_call_us(modes[k]))
            us = {k: statistics.median(v) for k, v in samples.items()}
            res[f"batch {batch} in bucket 8"] = us
            tag = f"bs {batch}/bucket 8"
            raw, hand, ro = us["raw replay"], us["hand-written loop"], us["reduce-overhead"]
            figs += [figure(f"{tag} {k} host us/call", v, None, None, "us") for k, v in us.items()]
            figs += [
                figure(f"{tag} zero-copy / raw replay", us["pool zero-copy"] / raw, "<= 1.25",
                       us["pool zero-copy"] / raw <= 1.25),
                figure(f"{tag} pool / hand-written loop", us["pool"] / hand, "<= 1.05", us["pool"] / hand <= 1.05),
                figure(f"{tag} hand-written loop / zero-copy", hand / us["pool zero-copy"], ">= 3",
                       hand / us["pool zero-copy"] >= 3),
                figure(f"{tag} backend / reduce-overhead", us["backend=gfxgraph"] / ro, "<= 0.6",
                       us["backend=gfxgraph"] / ro <= 0.6, note="copy_outputs=True (the default; reduce-overhead "
                       "returns its static outputs)"),
                figure(f"{tag} backend copy_outputs=False / reduce-overhead",
                       us["backend=gfxgraph copy_outputs=False"] / ro, "<= 0.6",
                       us["backend=gfxgraph copy_outputs=False"] / ro <= 0.6, note="both return static outputs"),
            ]
            del modes
            torch.compiler.reset()
    return res, figs


# ----------------------------------------------------------------------------- part 2
def build_llama(cfg: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: this suite alone needs transformers

    config = LlamaConfig(**cfg, torch_dtype=torch.bfloat16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def make_step(model: Any, cache: Any) -> Callable[..., Any]:
    def step(ids: torch.Tensor, pos: torch.Tensor, cp: torch.Tensor) -> Any:
        logits = model(input_ids=ids, position_ids=pos, cache_position=cp, past_key_values=cache,
                       use_cache=True).logits[:, -1, :]
        return logits, logits.argmax(dim=-1)
    return step


def host_read_loop(run: Callable[..., Any], first: torch.Tensor, start: int, steps: int) -> tuple[float, list]:
    """Greedy decode reading each token on the host; returns (seconds, tokens per step)."""
    b = first.shape[0]
    tok, toks = first, []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        pos = start + i
        _, nxt = run(tok.view(b, 1), torch.full((b, 1), pos, device="cuda", dtype=torch.long),
                     torch.full((1,), pos, device="cuda", dtype=torch.long))
        toks.append(nxt.tolist())  # the host read: an EOS check would look here
        tok = nxt
    return time.perf_counter() - t0, toks


def zero_copy_loop(io: Any, first: torch.Tensor, start: int, steps: int) -> tuple[float, list]:
    """The same loop through a StaticIO: the next token and positions are written into the views."""
    b = first.shape[0]
    ids, pos, cp = io.args
    ids.copy_(first.view(b, 1))
    pos.fill_(start)
    cp.fill_(start)
    toks = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        _, nxt = io.run()
        toks.append(nxt.tolist())
        ids.copy_(nxt.view(b, 1))
        pos.add_(1)
        cp.add_(1)
    return time.perf_counter() - t0, toks


def _setup(label: str, model: Any, b: int, prompt: torch.Tensor, max_len: int) -> dict[str, Any]:
    """One mode's runner over its own cache; its setup seconds (capture, compile) included."""
    cache = new_cache(model, b, max_len)
    first = prefill(model, cache, prompt)
    step = make_step(model, cache)
    n = prompt.shape[1]
    ex = (first.view(b, 1), torch.full((b, 1), n, device="cuda", dtype=torch.long),
          torch.full((1,), n, device="cuda", dtype=torch.long))
    gc.collect()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run: Any = step
    if label == "hand-written graph":
        run = HandCaptured(step, b, n)
    elif label.startswith("pool"):
        pool = ShapeBucketPool(step, [b], static_args=[2], stateful=True, progress=False, copy_outputs=False)
        pool.capture_all(*ex)
        run = pool.static_io(b) if label == "pool zero-copy" else pool
    elif label != "eager":
        run = (torch.compile(step, backend="gfxgraph", options={"copy_outputs": False})
               if label == "backend=gfxgraph" else torch.compile(step, mode="reduce-overhead"))
        for _ in range(3):
            run(*ex)
    torch.cuda.synchronize()
    return {"run": run, "cache": cache, "setup_s": time.perf_counter() - t0, "times": []}


def _decode_once(m: dict[str, Any], label: str, model: Any, prompt: torch.Tensor, steps: int) -> list:
    m["cache"].reset()  # warm-up, capture and the last round advanced it (transformers 5 keeps its own position)
    first = prefill(model, m["cache"], prompt)
    loop = zero_copy_loop if label == "pool zero-copy" else host_read_loop
    seconds, toks = loop(m["run"], first, prompt.shape[1], steps)
    m["times"].append(seconds / steps * 1e3)
    return toks


def decode_case(model: Any, b: int, steps: int, rounds: int, prompt_len: int = 16) -> dict[str, Any]:
    """The graph modes' loops interleaved round by round (median ms/token); the compile modes after them,
    each in its own dynamo, the same number of rounds."""
    prompt = torch.randint(0, model.config.vocab_size, (b, prompt_len), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(b))
    max_len = prompt_len + steps + 16
    graphs = ("eager", "hand-written graph", "pool", "pool zero-copy")
    modes = {label: _setup(label, model, b, prompt, max_len) for label in graphs}
    tokens: dict[str, list] = {}
    for r in range(rounds):
        for label in (graphs if r % 2 == 0 else graphs[::-1]):
            tokens[label] = _decode_once(modes[label], label, model, prompt, steps)
    for label in ("backend=gfxgraph", "reduce-overhead"):
        torch.compiler.reset()
        modes[label] = _setup(label, model, b, prompt, max_len)
        for _ in range(rounds):
            tokens[label] = _decode_once(modes[label], label, model, prompt, steps)
        modes[label]["run"] = None
        torch.compiler.reset()
    ref = tokens["eager"]
    res = {}
    for label, m in modes.items():
        agree = sum(a == e for ta, te in zip(tokens[label], ref) for a, e in zip(ta, te)) / (steps * b)
        res[label] = {"ms_per_token": statistics.median(m["times"]), "all_ms_per_token": m["times"],
                      "setup_s": m["setup_s"], "token_agreement": agree}
    return res


def part_decode(steps: int, rounds: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model = build_llama(DECODE_CFG)
    res: dict[str, Any] = {}
    figs: list[dict[str, Any]] = []
    with torch.no_grad():
        for b in (1, 8):
            r = decode_case(model, b, steps, rounds)
            res[f"bs{b}"] = r
            hand, zc = r["hand-written graph"]["ms_per_token"], r["pool zero-copy"]["ms_per_token"]
            be, ro = r["backend=gfxgraph"]["ms_per_token"], r["reduce-overhead"]["ms_per_token"]
            figs += [figure(f"decode bs {b} {k} ms/token", v["ms_per_token"], None, None, "ms",
                            note=f"tokens equal to eager's: {v['token_agreement']:.3f}") for k, v in r.items()]
            figs += [
                figure(f"decode bs {b} pool zero-copy / hand-written graph", zc / hand, "<= 0.99", zc / hand <= 0.99),
                figure(f"decode bs {b} pool / hand-written graph", r["pool"]["ms_per_token"] / hand, "<= 1.00",
                       r["pool"]["ms_per_token"] / hand <= 1.00),
                figure(f"decode bs {b} backend / reduce-overhead", be / ro, "<= 1.0", be / ro <= 1.0),
            ]
    del model
    torch.cuda.empty_cache()
    return res, figs


# ----------------------------------------------------------------------------- part 3
def hand_capture_all(step: Callable[..., Any], buckets: list[int]) -> tuple[float, int]:
    """The serving stacks' loop: largest first, one warm-up each, one shared pool, gc frozen."""
    handle = torch.cuda.graph_pool_handle()
    graphs = []
    gc.collect()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gc.freeze()
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        for b in reversed(buckets):
            ids = torch.zeros(b, 1, dtype=torch.long, device="cuda")
            pos = torch.zeros(b, 1, dtype=torch.long, device="cuda")
            with torch.cuda.stream(s):
                step(ids, pos)
            g = OriginalCUDAGraph()
            with torch.cuda.graph(g, pool=handle, stream=s):
                out = step(ids, pos)
            graphs.append((g, ids, pos, out))
        torch.cuda.synchronize()
    finally:
        gc.unfreeze()
    seconds = time.perf_counter() - t0
    used = graph_pool_bytes([handle])
    del graphs
    return seconds, used


class _PassThrough(RowDispatchMode):
    """A dispatch mode that only runs each op: the floor any dispatcher-level trace pays."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def analysis_cost(step: Callable[..., Any]) -> dict[str, Any]:
    """The row analysis's one-time cost: the step run under the tracer (and its verdict) against the same
    eager run, as a pool's first call makes it (its own run, traced), median of 5 each; beside it the
    same run under a dispatch mode that does nothing but run each op (the floor of such a trace)."""
    out: dict[str, Any] = {}
    for b in (1, 8):
        z = torch.zeros(b, 1, dtype=torch.long, device="cuda")

        def eager() -> None:
            step(z, z)

        def floor() -> None:
            with _PassThrough():
                step(z, z)

        def traced() -> Any:
            tracer = RowTracer([(z, 0), (z, 0)], rows=b)
            with tracer:
                y = step(z, z)
            return tracer.verdict(y), tracer.ops

        times: dict[str, list[float]] = {"eager": [], "traced": [], "floor": []}
        verdict, ops = None, 0
        for _ in range(5):
            for label, fn in (("eager", eager), ("traced", traced), ("floor", floor)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                got = fn()
                torch.cuda.synchronize()
                times[label].append((time.perf_counter() - t0) * 1e3)
                if got is not None:
                    verdict, ops = got
        e, t, f = (statistics.median(times[k]) for k in ("eager", "traced", "floor"))
        out[f"bs {b}"] = {"eager_ms": e, "traced_ms": t, "overhead": t / e - 1, "ops": ops,
                          "pass_through_ms": f, "pass_through_overhead": f / e - 1,
                          "verdict": "rows independent" if verdict.reason is None else str(verdict.reason)}
    return out


def part_capture_scale(with_backend: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model = build_llama(CONFIGS["llama-1.2b"])

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, -1, :]

    res: dict[str, Any] = {}
    with torch.no_grad():
        for b in BUCKETS_36:  # cuBLAS picks its kernels per shape once: neither capture run pays for that
            z = torch.zeros(b, 1, dtype=torch.long, device="cuda")
            step(z, z)
        hand_s, hand_bytes = hand_capture_all(step, BUCKETS_36)
        gc.collect()
        torch.cuda.empty_cache()
        pool = ShapeBucketPool(step, BUCKETS_36, progress=False)
        rep = pool.capture_all(torch.zeros(1, 1, dtype=torch.long, device="cuda"),
                               torch.zeros(1, 1, dtype=torch.long, device="cuda"))
        res["analysis"] = analysis_cost(step)
        res["hand-written loop"] = {"seconds": hand_s, "graph_MiB": hand_bytes / 2**20}
        res["capture_all"] = {"seconds": rep["seconds"], "graph_MiB": rep["pool_bytes"] / 2**20,
                              "captured": rep["captured"]}
        pool.close()
        del pool
        gc.collect()
        torch.cuda.empty_cache()
        if with_backend:
            torch.compiler.reset()
            compiled = torch.compile(step, backend="gfxgraph", options={"buckets": BUCKETS_36})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b in reversed(BUCKETS_36):
                z = torch.zeros(b, 1, dtype=torch.long, device="cuda")
                compiled(z, z)
            torch.cuda.synchronize()
            res["backend warm-up (compile + capture)"] = {"seconds": time.perf_counter() - t0}
            torch.compiler.reset()
    ratio = res["capture_all"]["seconds"] / hand_s
    figs = [
        figure("capture 36 buckets 1.5B: hand-written loop", hand_s, None, None, "s",
               note=f"graph memory {res['hand-written loop']['graph_MiB']:.0f} MiB"),
        figure("capture 36 buckets 1.5B: capture_all", res["capture_all"]["seconds"], None, None, "s",
               note=f"graph memory {res['capture_all']['graph_MiB']:.0f} MiB, {rep['captured']} captured"),
        figure("capture 36 buckets 1.5B: capture_all / hand-written loop", ratio, "<= 1.1", ratio <= 1.1,
               note="capture_all includes the row analysis of its first (traced) capture"),
    ]
    for b, a in res["analysis"].items():
        figs += [figure(f"row analysis 1.5B decode step {b}: traced run / eager run - 1", a["overhead"], "<= 0.25",
                        a["overhead"] <= 0.25, note=f"eager {a['eager_ms']:.1f} ms, traced {a['traced_ms']:.1f} ms, "
                        f"{a['ops']} aten ops, verdict without a capture: {a['verdict']}"),
                 figure(f"row analysis 1.5B decode step {b}: pass-through dispatch mode / eager run - 1 (the floor)",
                        a["pass_through_overhead"], None, None,
                        note="a dispatch mode that only runs each op: no dispatcher-level trace costs less")]
    if with_backend:
        figs.append(figure("36 sizes 1.5B: backend=gfxgraph warm-up (compile + capture)",
                           res["backend warm-up (compile + capture)"]["seconds"], None, None, "s",
                           note="serving stacks report 5-20 s of capture at start-up"))
    model = None  # noqa: F841  (the step closes over it)
    torch.cuda.empty_cache()
    return res, figs


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--parts", default="calls,decode,capture")
    p.add_argument("--no-backend-scale", action="store_true", help="skip the backend's 36-size warm-up")
    args = p.parse_args()
    parts = args.parts.split(",")
    results: dict[str, Any] = {}
    figures: list[dict[str, Any]] = []
    warm_compilers()
    if "calls" in parts:
        r, f = part_call_overhead(rounds=10 if args.quick else 60)
        results["calls"], figures = r, figures + f
    if "decode" in parts:
        r, f = part_decode(steps=32 if args.quick else 128, rounds=2 if args.quick else 5)
        results["decode"], figures = r, figures + f
    if "capture" in parts:
        r, f = part_capture_scale(with_backend=not args.no_backend_scale)
        results["capture"], figures = r, figures + f
    write(args.out, "call_overhead", figures, {"method": __doc__, "results": results})


if __name__ == "__main__":
    main()
