"""A Hugging Face transformers decode step with a static KV cache, graphed by gfxgraph (GPU).

transformers 5.x keeps the static cache's write position on the device and advances it on
every run of the step, so a graph path must run the step exactly once per call (the pool's
and the backend's first calls included) for the decode to match eager decoding.
"""

from __future__ import annotations

import pytest
import torch

from gfxgraph import ShapeBucketPool

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

B, PROMPT, STEPS = 2, 12, 10


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _cache(model):
    try:
        return transformers.StaticCache(config=model.config, max_cache_len=PROMPT + STEPS + 4)
    except TypeError:  # transformers < 5
        return transformers.StaticCache(config=model.config, max_batch_size=B, max_cache_len=PROMPT + STEPS + 4,
                                        device="cuda", dtype=torch.bfloat16)


def _decode(model, wrap):
    """Teacher-forced decode (the same tokens in every mode); returns the logits per step."""
    prompt = torch.randint(0, 1000, (B, PROMPT), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    forced = torch.randint(0, 1000, (STEPS, B), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    cache = _cache(model)

    def step(ids, pos, cache_position):
        return model(input_ids=ids, position_ids=pos, cache_position=cache_position, past_key_values=cache,
                     use_cache=True).logits[:, -1].float()

    run = wrap(step)
    with torch.no_grad():
        model(input_ids=prompt, cache_position=torch.arange(PROMPT, device="cuda"), past_key_values=cache,
              use_cache=True)
        out = []
        for i in range(STEPS):
            p = PROMPT + i
            out.append(run(forced[i].view(B, 1), torch.full((B, 1), p, device="cuda"),
                           torch.full((1,), p, device="cuda")).clone())
    return torch.stack(out)


def test_pool_decode_matches_eager(model):
    eager = _decode(model, lambda step: step)
    graphed = _decode(model, lambda step: ShapeBucketPool(step, [B], static_args=[2], stateful=True, progress=False))
    torch.testing.assert_close(graphed, eager, atol=0, rtol=0)


def test_backend_decode_matches_eager(model):
    import torch._dynamo

    from hipgraph_bridge import compile as cb

    cb.register()
    torch._dynamo.reset()
    eager = _decode(model, lambda step: step)
    compiled = _decode(model, lambda step: torch.compile(step, backend="gfxgraph"))
    # inductor fuses differently from eager: compare as bf16 logits, not bitwise
    torch.testing.assert_close(compiled, eager, atol=0.1, rtol=0.05)
    states = [(s.state.value, s.reason) for s in cb.compiled_subgraphs()]
    assert ("graphed", None) in states, states
    torch._dynamo.reset()
