"""Sampling inside the device loop on a GPU: the native WHILE loop and the host loop (HIP's strategy, forced on
CUDA) draw the reference sampler's tokens for every chunk size; the reference's draws on the GPU follow the
filtered distribution (chi-square over 200,000 draws)."""

from __future__ import annotations

import pytest
import torch

from hipgraph_bridge.generation import DeviceDecodeLoop
from hipgraph_bridge.generation.sampling import SamplingParams, filter_logits, sample_tokens

pytestmark = pytest.mark.gpu

VOCAB, BATCH = 64, 4


def _table() -> torch.Tensor:
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)).cuda() * 2


def _step(table: torch.Tensor):
    freq = torch.arange(VOCAB, dtype=torch.float32, device="cuda")

    def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return table[tokens] + 0.1 * torch.cos(position.float() * freq)

    return step


def _reference(step, first, start, new, params):
    tok, out = first, []
    for i in range(new):
        pos = torch.tensor(start + i, device="cuda")
        tok = sample_tokens(step(tok, pos), params, torch.arange(BATCH, device="cuda"), pos.expand(BATCH))
        out.append(tok)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_every_strategy_and_chunk_draws_the_reference_tokens(strategy):
    step = _step(_table())
    first = torch.tensor([1, 5, 9, 13], device="cuda")
    settings = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    want = _reference(step, first, 3, 40, SamplingParams(do_sample=True, seed=1234, **settings))
    greedy = _reference(step, first, 3, 40, SamplingParams())
    for chunk in (1, 16, 64):
        loop = DeviceDecodeLoop(step, batch_size=BATCH, chunk=chunk, strategy=strategy)
        got = loop.generate(first, 3, max_new_tokens=40, do_sample=True, seed=1234, **settings)
        assert loop.strategy == strategy
        assert torch.equal(got, want), (strategy, chunk)
        assert torch.equal(loop.generate(first, 3, max_new_tokens=40), greedy)  # greedy after sampling
        other = loop.generate(first, 3, max_new_tokens=40, do_sample=True, seed=1235, **settings)
        assert not torch.equal(other, want)


@pytest.mark.parametrize("t, k, p", [(1.0, None, None), (0.7, 5, None), (1.0, None, 0.8), (1.3, 3, 0.9)])
def test_gpu_draws_follow_the_filtered_distribution(t, k, p):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]], device="cuda")
    n = 200_000
    params = SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p, seed=7)
    tokens = sample_tokens(logits.expand(n, -1), params, torch.zeros(n, dtype=torch.long, device="cuda"),
                           torch.arange(n, device="cuda"))
    counts = torch.bincount(tokens, minlength=8).double().cpu()
    probs = filter_logits(logits, t, k, p).softmax(-1)[0].double().cpu()
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept] * n
    chi2 = (((counts[kept] - expected) ** 2) / expected).sum().item()
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[int(kept.sum()) - 1]
    assert chi2 < critical, (chi2, counts.tolist(), expected.tolist())


def test_static_cache_decoder_samples_alike_on_every_path():
    transformers = pytest.importorskip("transformers")
    from _tiny_llama import prompt, tiny_llama
    from gfxgraph.hf import StaticCacheDecoder

    model = tiny_llama(transformers)
    ids = prompt(4, 6)
    settings = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=3, eos_token_id=None)
    want = StaticCacheDecoder(model, max_cache_len=64, graphs=False).generate(ids, max_new_tokens=24, **settings)
    graphed = StaticCacheDecoder(model, max_cache_len=64).generate(ids, max_new_tokens=24, **settings)
    assert torch.equal(graphed, want)
    for strategy in ("native", "host"):
        for chunk in (1, 16):
            dec = StaticCacheDecoder(model, max_cache_len=64, device_loop=chunk, strategy=strategy)
            assert torch.equal(dec.generate(ids, max_new_tokens=24, **settings), want), (strategy, chunk)


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_switching_between_greedy_and_sampling_on_one_decoder_after_a_full_cache(strategy):
    """Greedy to the cache's end, then sampled, then greedy again on one decoder: each switch recaptures the
    loop's body, whose warm-ups write the cache; the tokens stay those of the eager decoder."""
    transformers = pytest.importorskip("transformers")
    from _tiny_llama import prompt, tiny_llama
    from gfxgraph.hf import StaticCacheDecoder

    model = tiny_llama(transformers)
    ids = prompt(2, 6)
    eager = StaticCacheDecoder(model, max_cache_len=32, graphs=False)
    dec = StaticCacheDecoder(model, max_cache_len=32, device_loop=8, strategy=strategy)
    runs = [dict(max_new_tokens=26), dict(max_new_tokens=26, do_sample=True, top_p=0.9, seed=5),
            dict(max_new_tokens=26)]
    for kw in runs:
        assert torch.equal(dec.generate(ids, eos_token_id=None, **kw), eager.generate(ids, eos_token_id=None, **kw)), kw
