"""Greedy generation with the EOS check on the device (one launch per K tokens) against per-token loops.

An HF Llama-shaped model (random bf16 weights, sdpa, static KV cache; the llm_decode configs
``llama-small`` and ``llama-1.2b``, 1.5B as built untied), a 16-token prompt, 256 new tokens
with an EOS check every token, at batch 1 and 4. The EOS id is one the eager run never
produces, so every mode decodes all 256 tokens and pays its check each time.

Modes, interleaved round by round (median of the rounds), each over its own cache:

* ``eager``: ``StaticCacheDecoder(graphs=False)``: the step eagerly, one host read per token;
* ``hand-written graph``: one ``torch.cuda.CUDAGraph`` of the step, the loop written out
  (copy the token in, replay, ``where``/``any`` and one host read per token);
* ``pool``: ``StaticCacheDecoder()`` (a ShapeBucketPool graph called zero-copy, one read per token);
* ``device K``: ``StaticCacheDecoder(device_loop=K)``, K = 16, 64, 256 (a WHILE node: one
  launch and one host read per K tokens).

Each figure is tokens/s of a whole generation (prefill included, the same in every mode).
Tokens are compared with eager's (equal, the share of equal tokens, the first step that
differs); with random bf16 weights near-tied logits can flip under a graph's kernel choices,
so the hand-written graph's agreement is the reference for the others'. Targets (issue 18): the best device loop >= 1.15x the best
per-token graph loop (hand-written or pool) on the small model at batch 1, >= 1.0x on the
1.5B model; tokens identical.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gfxgraph.hf import StaticCacheDecoder
from gfxgraph.suites._common import figure, parser, timed, write
from gfxgraph.suites.llm_decode import CONFIGS, HandCaptured, build_model, make_step, new_cache, prefill

PROMPT, NEW, CHUNKS = 16, 256, (16, 64, 256)


class HandLoop:
    """The per-token loop written by hand: one CUDA graph of the step, EOS read on the host each token."""

    def __init__(self, model: Any, b: int, max_len: int) -> None:
        self.model, self.b = model, b
        self.cache = new_cache(model, b, max_len)
        prefill(model, self.cache, torch.zeros(b, 1, dtype=torch.long, device="cuda"))  # the cache's tensors exist
        self.graph = HandCaptured(make_step(model, self.cache), b, 1)

    def generate(self, ids: torch.Tensor, *, max_new_tokens: int, eos_token_id: int) -> torch.Tensor:
        self.cache.reset()
        n = ids.shape[1]
        tok = prefill(self.model, self.cache, ids)
        alive = torch.ones(self.b, dtype=torch.bool, device="cuda")
        out = torch.empty(self.b, max_new_tokens, dtype=torch.long, device="cuda")
        for i in range(max_new_tokens):
            tok = torch.where(alive, tok, eos_token_id)
            alive &= tok != eos_token_id
            out[:, i] = tok
            if i == max_new_tokens - 1 or not bool(alive.any()):
                return out[:, :i + 1]
            g = self.graph  # its static inputs written in place, as a hand-written loop does
            g.ids.copy_(tok.view(self.b, 1))
            g.pos.fill_(n + i)
            g.cp.fill_(n + i)
            g.g.replay()
            tok = g.out[1]
        return out


def _modes(model: Any, b: int, max_len: int) -> dict[str, Any]:
    modes: dict[str, Any] = {"eager": StaticCacheDecoder(model, max_cache_len=max_len, graphs=False),
                             "hand-written graph": HandLoop(model, b, max_len),
                             "pool": StaticCacheDecoder(model, max_cache_len=max_len)}
    for k in CHUNKS:
        modes[f"device K={k}"] = StaticCacheDecoder(model, max_cache_len=max_len, device_loop=k)
    return modes


def run_case(model: Any, b: int, rounds: int) -> dict[str, Any]:
    ids = torch.randint(0, model.config.vocab_size, (b, PROMPT), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(b))
    max_len = PROMPT + NEW + 8
    with torch.no_grad():
        modes = _modes(model, b, max_len)
        capture = {}
        for label, m in modes.items():
            t0 = time.perf_counter()
            if isinstance(m, StaticCacheDecoder):
                m.capture(b)
            capture[label] = time.perf_counter() - t0
        ref = modes["eager"].generate(ids, max_new_tokens=NEW, eos_token_id=None)
        used = set(ref.flatten().tolist())
        eos = next(t for t in range(model.config.vocab_size) if t not in used)  # never produced: all 256 decode
        times: dict[str, list[float]] = {label: [] for label in modes}
        tokens: dict[str, torch.Tensor] = {}
        labels = list(modes)
        for r in range(rounds):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                seconds, tokens[label] = timed(lambda: modes[label].generate(ids, max_new_tokens=NEW,
                                                                               eos_token_id=eos))
                times[label].append(seconds)
    res = {}
    for label in modes:
        made = tokens[label].shape[1]  # NEW unless a mode produced the EOS id eager never did
        res[label] = {"tokens_per_s": b * made / statistics.median(times[label]), "seconds": times[label],
                      "new_tokens": made,
                      "capture_s": capture[label], **compare(tokens[label], ref)}
    res["eos_token_id"] = eos
    return res


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Whether ``got`` equals eager's tokens, the share of equal tokens, and the first step where a row differs."""
    if got.shape != ref.shape:
        return {"tokens_equal_eager": False, "agreement": 0.0, "first_divergence": 0}
    diff = (got != ref).any(dim=0).nonzero()
    return {"tokens_equal_eager": not len(diff), "agreement": float((got == ref).float().mean()),
            "first_divergence": int(diff[0]) if len(diff) else None}


def case_figures(name: str, b: int, r: dict[str, Any]) -> list[dict[str, Any]]:
    labels = [k for k in r if k != "eos_token_id"]
    figs = [figure(f"{name} bs {b} {k} tokens/s", r[k]["tokens_per_s"], None, None, "tok/s",
                   note=f"tokens equal to eager's: {r[k]['tokens_equal_eager']} (agreement {r[k]['agreement']:.3f}, "
                        f"first step that differs: {r[k]['first_divergence']})") for k in labels]
    per_token = max(r["hand-written graph"]["tokens_per_s"], r["pool"]["tokens_per_s"])
    best_k = max((k for k in labels if k.startswith("device")), key=lambda k: r[k]["tokens_per_s"])
    ratio = r[best_k]["tokens_per_s"] / per_token
    target = 1.15 if name == "llama-small" and b == 1 else (1.0 if name != "llama-small" else None)
    figs.append(figure(f"{name} bs {b} best device loop ({best_k}) / best per-token graph loop", ratio,
                       None if target is None else f">= {target}", None if target is None else ratio >= target))
    loops = [k for k in labels if k.startswith("device")]
    same = all(r[k]["tokens_equal_eager"] for k in loops)
    hand = r["hand-written graph"]["tokens_equal_eager"]
    figs.append(figure(f"{name} bs {b} device loops' tokens equal eager's", float(same), "== 1", same,
                       note="the hand-written torch.cuda.CUDAGraph loop's tokens equal eager's too: "
                            f"{hand} (bf16 random weights: near-tied logits flip under other kernel choices)"))
    return figs


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", default="llama-small,llama-1.2b")
    args = p.parse_args()
    rounds = 2 if args.quick else 5
    results: dict[str, Any] = {}
    figures: list[dict[str, Any]] = []
    for name in args.models.split(","):
        model = build_model(name)
        for b in (1, 4):
            r = run_case(model, b, rounds)
            results[f"{name} bs{b}"] = r
            figures += case_figures(name, b, r)
            print(f"{name} bs {b}: " + ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in r.items()
                                                 if isinstance(v, dict)), flush=True)
        del model
        torch.cuda.empty_cache()
    write(args.out, "device_generate", figures, {"method": __doc__, "quick": args.quick, "rounds": rounds,
                                                 "prompt": PROMPT, "new_tokens": NEW, "configs": CONFIGS,
                                                 "results": results})


if __name__ == "__main__":
    main()
