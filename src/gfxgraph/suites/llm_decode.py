"""Greedy decode of a Llama-architecture model (random bf16 weights, static KV cache).

Hugging Face transformers builds the model from a config (nothing is downloaded): a
Llama-3.2-1B-shaped config (hidden 2048, 16 layers, GQA 32/8 heads, vocab 128256: 1.24B
parameters with tied embeddings, 1.50B as built here, untied) and a small one. For each batch size the decode step

    step(input_ids (B,1), position_ids (B,1), cache_position (1,)) -> (logits (B,V), next (B,))

runs in every mode, side by side in one process:

* eager;
* hand-captured: one ``torch.cuda.graph`` of the step, as a user writes it by hand;
* gfxgraph: ``ShapeBucketPool`` over the eager step (``copy_outputs=False``, the decode-loop
  setting; the default copying variant is reported too);
* ``torch.compile(mode="reduce-overhead")`` and ``torch.compile(backend="gfxgraph")``, the latter
  with ``copy_outputs=False`` (the decode-loop setting: the loop reads the logits before the next
  step, and reduce-overhead's outputs are likewise overwritten by its next replay) and with the
  default ``copy_outputs=True``.

Warm-up and capture run the step, and transformers' StaticCache (5.x) keeps its write position
on the device, advancing it on every run whatever ``cache_position`` says: so after capture (or
the compile modes' first calls) each mode resets the cache and runs the prefill again, as a
serving loop does after capturing. Without that reset every graphed mode, a hand-written
``torch.cuda.graph`` included, decodes with the cache one slot ahead and its logits differ.

Compile warm-up is timed with inductor's caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1), after
both compile modes compiled a tiny function once (inductor's process start-up is paid by neither),
and the backend's modes run before reduce-overhead, so what caching remains favours reduce-overhead.

Every mode is fed the eager run's tokens (teacher forcing), so the logits are compared
step by step with eager (max abs difference, argmax agreement); with random weights the
logits are nearly flat and free-running tokens would diverge on ties. Figures: tokens/s,
ms/token p50/p99 (CUDA events around each step), capture/compile time, graph memory.
Targets (issue 7): gfxgraph within 5% of hand-captured; backend="gfxgraph" no worse than
reduce-overhead in ms/token and warm-up; batch 8 and 32 through the pool within 5% of a
hand-captured graph at the same size.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Callable

import torch

from gfxgraph.suites._common import figure, parser, write
from hipgraph_bridge import ShapeBucketPool, graph_pool_bytes
from hipgraph_bridge.compile import compiled_subgraphs

CONFIGS = {
    "llama-1.2b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096),
    "llama-small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096),
}


def build_model(name: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM  # optional: this suite alone needs transformers

    cfg = LlamaConfig(**CONFIGS[name], torch_dtype=torch.bfloat16)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def new_cache(model: Any, batch: int, max_len: int) -> Any:
    from transformers import StaticCache  # optional: this suite alone needs transformers

    try:  # transformers >= 5: the batch size comes from the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len,
                           device="cuda", dtype=torch.bfloat16)


def make_step(model: Any, cache: Any) -> Callable[..., Any]:
    def step(input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor) -> Any:
        out = model(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :]
        return logits, logits.argmax(dim=-1)
    return step


def prefill(model: Any, cache: Any, prompt: torch.Tensor) -> torch.Tensor:
    n = prompt.shape[1]
    out = model(input_ids=prompt, cache_position=torch.arange(n, device="cuda"), past_key_values=cache,
                use_cache=True)
    return out.logits[:, -1, :].argmax(dim=-1)


def decode(run: Callable[..., Any], first: torch.Tensor, start: int, steps: int,
           forced: list[torch.Tensor] | None) -> dict[str, Any]:
    """Run ``steps`` decode steps; feed ``forced`` tokens when given. Times each step with events."""
    b = first.shape[0]
    tok = first
    logits_all, toks = [], []
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        pos = start + i
        ids = tok.view(b, 1)
        position_ids = torch.full((b, 1), pos, device="cuda", dtype=torch.long)
        cache_position = torch.full((1,), pos, device="cuda", dtype=torch.long)
        events[i][0].record()
        logits, nxt = run(ids, position_ids, cache_position)
        events[i][1].record()
        logits_all.append(logits.float())
        toks.append(nxt.clone())
        tok = forced[i] if forced is not None else nxt
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    per_step = sorted(s.elapsed_time(e) for s, e in events)
    return {"wall_s": wall, "tokens_per_s": b * steps / wall, "ms_p50": statistics.median(per_step),
            "ms_p99": per_step[min(len(per_step) - 1, int(0.99 * len(per_step)))],
            "ms_per_token": wall / steps * 1e3, "logits": logits_all, "tokens": toks}


class HandCaptured:
    """One torch.cuda.graph of the step with static inputs, written by hand."""

    def __init__(self, step: Callable[..., Any], b: int, start: int) -> None:
        # The graph reads, by address, the tensors the step's closure holds (a draw's settings: temperature,
        # k, the Philox key); were the step dropped after capture the allocator would hand their memory to
        # other tensors and the replays would read whatever those hold.
        self.step = step
        self.ids = torch.zeros(b, 1, dtype=torch.long, device="cuda")
        self.pos = torch.full((b, 1), start, dtype=torch.long, device="cuda")
        self.cp = torch.full((1,), start, dtype=torch.long, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(self.ids, self.pos, self.cp)  # warm-up: advances the cache (the caller resets it)
        torch.cuda.current_stream().wait_stream(s)
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g, stream=s):
            self.out = step(self.ids, self.pos, self.cp)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cp: torch.Tensor) -> Any:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.cp.copy_(cp)
        self.g.replay()
        return self.out


def _build_runner(label: str, step: Callable[..., Any], b: int, prompt_len: int, first: torch.Tensor) -> Any:
    """The decode runner of one mode, captured or compiled (compile modes: their first 3 calls run here)."""
    if label == "hand_captured":
        return HandCaptured(step, b, prompt_len)
    if label.startswith("gfxgraph_pool"):
        pool = ShapeBucketPool(step, [b], static_args=[2], stateful=True, progress=False,
                               copy_outputs=(label == "gfxgraph_pool_copy"))
        pool.capture_all(first.view(b, 1), torch.full((b, 1), prompt_len, device="cuda", dtype=torch.long),
                         torch.full((1,), prompt_len, device="cuda", dtype=torch.long))
        return pool
    torch.compiler.reset()
    if label == "reduce_overhead":
        runner = torch.compile(step, mode="reduce-overhead")
    else:
        # copy_outputs=False: the decode-loop setting (the loop reads the logits before the next
        # step), as for the pool above and as reduce-overhead's own outputs behave
        runner = torch.compile(step, backend="gfxgraph", options={"copy_outputs": label == "backend_gfxgraph_copy"})
    for i in range(3):  # compilation and graph recording happen in the first calls
        pos = prompt_len + i
        runner(first.view(b, 1), torch.full((b, 1), pos, device="cuda", dtype=torch.long),
               torch.full((1,), pos, device="cuda", dtype=torch.long))
    return runner


def _run_mode(model: Any, label: str, fresh: Callable[[], tuple[Any, torch.Tensor]], prompt: torch.Tensor,
              steps: int, forced: list[torch.Tensor]) -> dict[str, Any]:
    """Set up one mode over a fresh cache (timed: ``setup_s``, ``graph_bytes``), then decode."""
    b, prompt_len = prompt.shape
    cache, first = fresh()
    step = make_step(model, cache)
    gc.collect()  # the previous mode's graphs go first, or their release counts against this one
    torch.cuda.synchronize()
    pools_before = graph_pool_bytes()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner = _build_runner(label, step, b, prompt_len, first)
    torch.cuda.synchronize()
    setup_s = time.perf_counter() - t0
    graph_bytes = graph_pool_bytes() - pools_before
    # Warm-up and capture ran the step: the cache advanced its own write position
    # (transformers >= 5 keeps it on the device and ignores cache_position). Start over.
    cache.reset()
    first = prefill(model, cache, prompt)
    r = decode(runner, first, prompt_len, steps, forced)
    r["setup_s"] = setup_s
    r["graph_bytes"] = graph_bytes
    if label.startswith("backend_gfxgraph"):  # graphed, or why not: the figures mean nothing without it
        r["subgraphs"] = [repr(s) for s in compiled_subgraphs()]
    del runner
    if label in ("reduce_overhead", "backend_gfxgraph", "backend_gfxgraph_copy"):
        torch.compiler.reset()  # drops the compiled code and, for the backend, its graphs
    return r


def _compare_with_eager(res: dict[str, Any]) -> None:
    """Add each mode's logit difference and greedy-token agreement with eager; drop the tensors."""
    for label, r in res.items():
        if label == "eager":
            continue
        diffs = [(a - e).abs().max().item() for a, e in zip(r["logits"], res["eager"]["logits"])]
        agree = sum(int((a == e).sum()) for a, e in zip(r["tokens"], res["eager"]["tokens"]))
        r["max_abs_logit_diff"] = max(diffs)
        r["argmax_agreement"] = agree / sum(e.numel() for e in res["eager"]["tokens"])  # per token
    for r in res.values():
        r.pop("logits", None)
        r.pop("tokens", None)


def run_case(model: Any, name: str, b: int, prompt_len: int, steps: int, compile_modes: bool) -> dict[str, Any]:
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (b, prompt_len), device="cuda", generator=torch.Generator("cuda").manual_seed(b))
    max_len = prompt_len + steps + 8

    def fresh() -> tuple[Any, torch.Tensor]:
        cache = new_cache(model, b, max_len)
        with torch.no_grad():
            first = prefill(model, cache, prompt)
        return cache, first

    res: dict[str, Any] = {}
    with torch.no_grad():
        cache, first = fresh()
        res["eager"] = decode(make_step(model, cache), first, prompt_len, steps, None)
        # hand-captured and gfxgraph capture the step over a cache object; decode must use that cache.
        # The backend before reduce-overhead: whatever compilation caching is left (see the docstring)
        # favours reduce-overhead, so the warm-up comparison is not tilted our way.
        labels = ("hand_captured", "gfxgraph_pool", "gfxgraph_pool_copy") + (
            ("backend_gfxgraph", "backend_gfxgraph_copy", "reduce_overhead") if compile_modes else ())
        for label in labels:
            res[label] = _run_mode(model, label, fresh, prompt, steps, res["eager"]["tokens"])
    _compare_with_eager(res)
    return res


def warm_compilers() -> None:
    """Pay inductor's one-time process start-up (imports, workers, CUDA/triton set-up) before any
    timed compile, for both compile modes alike: otherwise whichever mode compiles first carries it."""
    x = torch.randn(4, 8, device="cuda")
    for kw in ({"mode": "reduce-overhead"}, {"backend": "gfxgraph"}):
        torch.compiler.reset()
        f = torch.compile(lambda t: torch.nn.functional.gelu(t) * 2 + 1, **kw)
        with torch.no_grad():
            for _ in range(3):
                f(x)
    torch.compiler.reset()
    torch.cuda.synchronize()


def _case_figures(tag: str, r: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures of one (model, batch size) case from its modes' results."""
    figures = []
    hand, pool = r["hand_captured"]["ms_per_token"], r["gfxgraph_pool"]["ms_per_token"]
    for label, what in (("eager", "eager"), ("gfxgraph_pool", "gfxgraph pool"),
                        ("reduce_overhead", "reduce-overhead"), ("backend_gfxgraph", "backend=gfxgraph")):
        if label in r:
            m = r[label]
            figures += [
                figure(f"{tag} {what} tokens/s", m["tokens_per_s"], None, None),
                figure(f"{tag} {what} step p50 (p99 in note)", m["ms_p50"], None, None, "ms",
                       note=f"p99 {m['ms_p99']:.3f} ms"),
            ]
            if label != "eager":
                figures.append(figure(
                    f"{tag} {what} max |logit - eager| (teacher forcing)", m["max_abs_logit_diff"], None,
                    None, note=f"greedy token agreement with eager {m['argmax_agreement']:.3f}"))
    figures += [
        figure(f"{tag} eager ms/token", r["eager"]["ms_per_token"], None, None, "ms"),
        figure(f"{tag} hand-captured ms/token", hand, None, None, "ms"),
        figure(f"{tag} gfxgraph pool ms/token", pool, None, None, "ms"),
        figure(f"{tag} gfxgraph pool / hand-captured", pool / hand, "<= 1.05", pool / hand <= 1.05),
        figure(f"{tag} gfxgraph pool (copy_outputs) / hand-captured",
               r["gfxgraph_pool_copy"]["ms_per_token"] / hand, None, None),
        figure(f"{tag} eager / gfxgraph pool (speed-up)", r["eager"]["ms_per_token"] / pool, None, None),
    ]
    if "reduce_overhead" in r:
        figures += _compile_figures(tag, r)
    return figures


def _compile_figures(tag: str, r: dict[str, Any]) -> list[dict[str, Any]]:
    ro, be, bc = r["reduce_overhead"], r.get("backend_gfxgraph"), r.get("backend_gfxgraph_copy")
    figures = [
        figure(f"{tag} reduce-overhead ms/token", ro["ms_per_token"], None, None, "ms"),
        figure(f"{tag} reduce-overhead warm-up", ro["setup_s"], None, None, "s"),
    ]
    if be is not None:
        figures += [
            figure(f"{tag} backend=gfxgraph ms/token", be["ms_per_token"], "<= reduce-overhead",
                   be["ms_per_token"] <= ro["ms_per_token"], "ms"),
            figure(f"{tag} backend=gfxgraph warm-up", be["setup_s"], "<= reduce-overhead",
                   be["setup_s"] <= ro["setup_s"], "s"),
            figure(f"{tag} backend=gfxgraph graph memory", be["graph_bytes"] / 2**20, None, None, "MiB",
                   note=f"reduce-overhead {ro['graph_bytes'] / 2**20:.0f} MiB"),
        ]
    if bc is not None:
        figures.append(figure(f"{tag} backend=gfxgraph with copy_outputs=True ms/token",
                              bc["ms_per_token"], None, None, "ms",
                              note="the default; a copy of the logits per step"))
    return figures


def main() -> None:
    # compile times must be first-compile times: no inductor cache carries work from one mode to the
    # next (inductor reads this when it is first imported, at the first compile below)
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    p = parser(__doc__)
    p.add_argument("--models", default="llama-1.2b,llama-small")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile modes")
    p.add_argument("--compile-batch", default="1,8,32", help="batch sizes that also run the compile modes")
    args = p.parse_args()
    results: dict[str, Any] = {}
    figures = []
    if not args.no_compile:
        warm_compilers()
    for name in args.models.split(","):
        model = build_model(name)
        results[name] = {"params": sum(x.numel() for x in model.parameters())}
        for b in (int(x) for x in args.batch.split(",")):
            compile_modes = (not args.no_compile and name == "llama-1.2b"
                             and str(b) in args.compile_batch.split(","))
            r = run_case(model, name, b, args.prompt, args.steps, compile_modes)
            results[name][f"bs{b}"] = r
            figures += _case_figures(f"{name} bs={b}", r)
        del model
        torch.cuda.empty_cache()
    write(args.out, "llm_decode", figures, {"method": __doc__, "results": results, "steps": args.steps,
                                            "prompt_len": args.prompt})


if __name__ == "__main__":
    main()
