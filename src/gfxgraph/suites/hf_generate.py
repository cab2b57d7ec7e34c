"""transformers' own generate() with the gfxgraph backend against its default reduce-overhead.

A Llama-shaped model built from a config (random bf16 weights, sdpa, static KV cache; nothing
downloaded), greedy, 128 new tokens after a 16-token prompt, at batch 1, 4 and 5 (5 is not one
of the default buckets; the decode step writes the cache, so it gets a graph of its own size).
Modes, each in a fresh dynamo: ``generate(disable_compile=True)`` (eager); ``compile_config=
gfxgraph.hf.compile_config()``; transformers' default ``CompileConfig()`` (inductor,
reduce-overhead); and ``gfxgraph.hf.StaticCacheDecoder`` (the decode loop without generate()'s
per-token Python). Per batch size, in the order 1, 4, 5 (so each compile mode sees the batch
dimension become dynamic at the second size): the first call's seconds (compile and capture
included) and ms/token of the median of 3 later calls. Tokens are compared with eager's
(inductor's kernels round differently, so with random weights a few greedy ties may flip:
the agreement is reported, for reduce-overhead too). Inductor's caches are off (as in
llm_decode), so each compile mode's first call is a cold compile.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch

import gfxgraph.hf
from gfxgraph.suites._common import figure, parser, timed, write
from gfxgraph.suites.llm_decode import CONFIGS, build_model

PROMPT, NEW, SIZES = 16, 128, (1, 4, 5)


def run_mode(model: Any, mode: str, reps: int) -> dict[str, Any]:
    from transformers import CompileConfig  # optional: this suite needs transformers, the package does not

    torch.compiler.reset()
    decoder = gfxgraph.hf.StaticCacheDecoder(model, max_cache_len=PROMPT + NEW + 8) if mode == "decoder" else None
    kw: dict[str, Any] = {"disable_compile": True} if mode == "eager" else {
        "compile_config": gfxgraph.hf.compile_config() if mode == "gfxgraph" else CompileConfig()}
    res: dict[str, Any] = {}
    for b in SIZES:
        ids = torch.randint(0, model.config.vocab_size, (b, PROMPT), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(b))

        def call() -> torch.Tensor:
            with torch.no_grad():
                if decoder is not None:
                    return decoder.generate(ids, max_new_tokens=NEW, eos_token_id=None)  # no EOS: min_new_tokens
                return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                      min_new_tokens=NEW, do_sample=False, cache_implementation="static",
                                      pad_token_id=0, **kw)[:, PROMPT:]

        first, tokens = timed(call)
        later = [timed(call)[0] for _ in range(reps)]
        res[f"bs{b}"] = {"first_call_s": first, "ms_per_token": statistics.median(later) / NEW * 1e3,
                         "tokens": tokens}
    torch.compiler.reset()
    return res


def main() -> None:
    args = parser(__doc__).parse_args()
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # first calls are cold compiles, in both modes
    model = build_model("llama-small")
    reps = 1 if args.quick else 3
    modes = {m: run_mode(model, m, reps) for m in ("eager", "gfxgraph", "reduce-overhead", "decoder")}
    figures = []
    for b in SIZES:
        key = f"bs{b}"
        ref = modes["eager"][key]["tokens"]
        for m, r in modes.items():
            r[key]["token_agreement"] = float((r[key].pop("tokens") == ref).float().mean()) if m != "eager" else 1.0
        gx, ro, dec = modes["gfxgraph"][key], modes["reduce-overhead"][key], modes["decoder"][key]
        tag = f"generate bs {b}{' (not a bucket)' if b == 5 else ''}"
        figures += [
            figure(f"{tag} eager ms/token", modes["eager"][key]["ms_per_token"], None, None, "ms"),
            figure(f"{tag} gfxgraph ms/token", gx["ms_per_token"], "<= reduce-overhead",
                   gx["ms_per_token"] <= ro["ms_per_token"], "ms",
                   note=f"tokens equal to eager's: {gx['token_agreement']:.3f}"),
            figure(f"{tag} reduce-overhead ms/token", ro["ms_per_token"], None, None, "ms",
                   note=f"tokens equal to eager's: {ro['token_agreement']:.3f}"),
            figure(f"{tag} gfxgraph first call", gx["first_call_s"], "<= reduce-overhead",
                   gx["first_call_s"] <= ro["first_call_s"], "s", note="compile and capture included"),
            figure(f"{tag} reduce-overhead first call", ro["first_call_s"], None, None, "s"),
            figure(f"{tag} StaticCacheDecoder ms/token", dec["ms_per_token"], None, None, "ms",
                   note=f"tokens equal to eager's: {dec['token_agreement']:.3f}; capture in the first call "
                        f"{dec['first_call_s']:.2f} s"),
        ]
    write(args.out, "hf_generate", figures, {"method": __doc__, "results": modes, "config": CONFIGS["llama-small"]})


if __name__ == "__main__":
    main()
