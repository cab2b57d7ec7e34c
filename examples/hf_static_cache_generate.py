"""Hugging Face transformers greedy generation with a static KV cache, decode step graphed
by gfxgraph: ``python examples/hf_static_cache_generate.py``.

Needs: torch and transformers (``pip install transformers``; without it the script says so in
one line and exits with 1). With a CUDA or ROCm GPU the decode step replays a graph (bf16);
without one it runs eagerly on the CPU (float32, a smaller model) and says so.

The model is a small Llama built from a config with random weights (nothing is downloaded).
The decode step ``(input_ids, position_ids, cache_position) -> next token`` reads and writes
the static cache in place, so it can be captured; ``ShapeBucketPool`` captures it once for the
batch size and replays it for every token. The tokens are checked against eager decoding.
"""

from __future__ import annotations

import sys
import time

import torch

try:
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
except ImportError as exc:  # an optional dependency of this example only
    sys.exit(f"hf_static_cache_generate needs transformers (pip install transformers): {exc}")

from gfxgraph import ShapeBucketPool

BATCH, PROMPT, NEW = 4, 16, 48
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def new_cache(model: LlamaForCausalLM) -> StaticCache:
    try:
        return StaticCache(config=model.config, max_cache_len=PROMPT + NEW + 8)
    except TypeError:  # transformers < 5 wants the batch size up front
        return StaticCache(config=model.config, max_batch_size=BATCH, max_cache_len=PROMPT + NEW + 8,
                           device=DEVICE, dtype=DTYPE)


def generate(model: LlamaForCausalLM, prompt: torch.Tensor, graphed: bool) -> tuple[torch.Tensor, float]:
    cache = new_cache(model)
    out = model(input_ids=prompt, cache_position=torch.arange(PROMPT, device=DEVICE), past_key_values=cache,
                use_cache=True)
    tok = out.logits[:, -1].argmax(-1)

    def step(input_ids, position_ids, cache_position):
        logits = model(input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
                       past_key_values=cache, use_cache=True).logits
        return logits[:, -1].argmax(-1)

    run = ShapeBucketPool(step, [BATCH], static_args=[2], stateful=True, progress=False) if graphed else step
    tokens = [tok]
    _sync()
    t0 = time.perf_counter()
    for i in range(NEW - 1):
        pos = PROMPT + i
        tok = run(tok.view(BATCH, 1), torch.full((BATCH, 1), pos, device=DEVICE),
                  torch.tensor([pos], device=DEVICE))
        tokens.append(tok)
    _sync()
    return torch.stack(tokens, 1), (time.perf_counter() - t0) / (NEW - 1) * 1e3


def main() -> int:
    if DEVICE == "cuda":
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, vocab_size=32000)
    else:  # eager on the CPU shows only that the pipeline runs: a smaller model says so in a fraction of the time
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    if DEVICE == "cpu":
        print("hf_static_cache_generate: no GPU here, so the decode step runs eagerly on the CPU (no graphs)")
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(DTYPE).eval()
    prompt = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT), device=DEVICE)
    with torch.no_grad():
        eager_tokens, eager_ms = generate(model, prompt, graphed=False)
        graph_tokens, graph_ms = generate(model, prompt, graphed=True)
    same = torch.equal(eager_tokens, graph_tokens)
    print(f"eager {eager_ms:.2f} ms/token, gfxgraph {graph_ms:.2f} ms/token ({eager_ms / graph_ms:.1f}x); "
          f"tokens identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
