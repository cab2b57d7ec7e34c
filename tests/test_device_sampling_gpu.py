"""Sampling inside the device loop on a GPU: the native WHILE loop and the host loop (HIP's strategy, forced on
CUDA) draw the reference sampler's tokens for every chunk size, filter set and ragged batch; the reference's
draws on the GPU follow the filtered distribution (chi-square over 200,000 draws); the fused Triton uniform
kernel gives the torch reference's bits and the fused Gumbel-max draw its tokens, in and out of a captured
graph."""

from __future__ import annotations

import pytest
import torch

from hipgraph_bridge.generation import DeviceDecodeLoop, sampling
from hipgraph_bridge.generation.sampling import (SamplingParams, draw, draw_filtered, filter_logits, filter_scores,
                                                 filter_tensors, sample_tokens, seed_key, top_k_window, uniform)

pytestmark = pytest.mark.gpu

VOCAB, BATCH = 64, 4


def _table() -> torch.Tensor:
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)).cuda() * 2


def _step(table: torch.Tensor):
    freq = torch.arange(VOCAB, dtype=torch.float32, device="cuda")

    def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:  # position: 0-dim or one per row
        return table[tokens] + 0.1 * torch.cos(position.float().unsqueeze(-1) * freq)

    return step


def _reference(step, first, start, new, params):
    """The host loop with the reference sampler (``start``: an int, or one position per row)."""
    tok, out = first, []
    for i in range(new):
        pos = start + i if isinstance(start, torch.Tensor) else torch.tensor(start + i, device="cuda").expand(BATCH)
        tok = sample_tokens(step(tok, pos), params, torch.arange(BATCH, device="cuda"), pos)
        out.append(tok)
    return torch.stack(out, dim=1)


def _triton_or_skip():
    why = sampling.fused_unavailable_reason()
    if why is not None:
        pytest.skip(f"the fused uniform kernel cannot run here: {why}")


SETTINGS = [{"temperature": 0.8, "top_k": 20, "top_p": 0.9}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8}]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("strategy", ["native", "host"])
def test_every_strategy_and_chunk_draws_the_reference_tokens(strategy, settings):
    step = _step(_table())
    first = torch.tensor([1, 5, 9, 13], device="cuda")
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


# ------------------------------------------------------------------ the fused uniform kernel
def _cases(seed: int):
    """(sequence, position) tensors over the counter's whole range: positions at and past 2**32 (the counter's
    third word), sequences up to 2**32 - 1, and broadcast shapes (a scalar position: stride 0; a grid)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 2**32, (4096,), generator=g)
    seq[:3] = torch.tensor([0, 2**31, 2**32 - 1])
    pos = torch.randint(0, 2**62, (4096,), generator=g)
    pos[:8] = torch.tensor([0, 1, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 5, 2**48 + 3, 2**63 - 1])
    pos[8:1000] = torch.randint(2**32 - 500, 2**32 + 500, (992,), generator=g)  # around the carry into word 2
    cuda = [t.cuda() for t in (seq, pos)]
    return [tuple(cuda), (cuda[0], torch.tensor(2**40 + 7, device="cuda")),
            (torch.arange(64, device="cuda").view(64, 1), cuda[1][:100].view(1, 100))]


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**64 - 1, 0xA4093822299F31D0, 20261202])
def test_fused_uniform_equals_the_reference_bit_for_bit(seed):
    _triton_or_skip()
    key = seed_key(seed, "cuda")
    for seq, pos in _cases(seed & 0xFFFF):
        fused = uniform(key, seq, pos, fused=True)
        ref = uniform(key, seq, pos, fused=False)
        assert fused.dtype == torch.float64 and fused.shape == ref.shape
        assert torch.equal(fused, ref), (seed, int((fused != ref).sum()), fused.numel())
    assert torch.equal(uniform(seed, seq, pos, fused=True), ref)  # an int seed: its key made on the device


def test_uniform_on_the_gpu_runs_the_fused_kernel(monkeypatch):
    _triton_or_skip()
    calls = []
    module = sampling._fused_module()
    original = module.uniform_fused
    monkeypatch.setattr(module, "uniform_fused", lambda *a: calls.append(1) or original(*a))
    seq, pos = torch.arange(8, device="cuda"), torch.full((8,), 2**35, device="cuda")
    got = uniform(5, seq, pos)  # fused=None: the kernel where triton imports
    assert calls == [1] and torch.equal(got, uniform(5, seq, pos, fused=False)) and calls == [1]


def test_fused_uniform_replays_in_a_captured_graph_without_a_warm_up():
    """prepare_fused() compiles and loads the kernel; the capture itself then only records its launch. Replays
    read the key and positions from their buffers (new values each time) and allocate nothing."""
    _triton_or_skip()
    assert sampling.prepare_fused("cuda") is True
    key = seed_key(9, "cuda")
    seq = torch.arange(16, device="cuda")
    pos = torch.zeros(16, dtype=torch.long, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):  # as gfxgraph's own captures run
        out = uniform(key, seq, pos)
    for step in (0, 1, 2**32 - 1, 2**32 + 7):
        pos.fill_(step)
        key.copy_(seed_key(9 + step % 3, "cuda"))
        g.replay()
        assert torch.equal(out, uniform(key, seq, pos, fused=False)), step


@pytest.mark.parametrize("vocab", [7, 2048, 2049, 32000, 128256])
def test_fused_draw_equals_the_reference(vocab):
    """The Gumbel-max kernel against the torch reference on the GPU: the same tokens for every row (a
    quarter of the tokens removed), one block and many, a 0-dim and a per-row position, and a non-contiguous
    row stride."""
    _triton_or_skip()
    g = torch.Generator(device="cuda").manual_seed(vocab)
    scores = torch.randn(6, vocab, device="cuda", generator=g) * 3
    scores[torch.rand(6, vocab, device="cuda", generator=g) < 0.25] = -float("inf")
    seq = torch.arange(6, device="cuda")
    for seed in (0, 17, 2**64 - 1):
        for pos in (torch.tensor(2**32 + 3, device="cuda"), torch.tensor([0, 1, 5, 9, 2**40, 7], device="cuda")):
            fused = draw(scores, seed, seq, pos, fused=True)
            assert fused.dtype == torch.long and fused.shape == (6,)
            assert torch.equal(fused, draw(scores, seed, seq, pos, fused=False)), (seed, pos)
            assert scores.gather(1, fused.view(6, 1)).isfinite().all()
    wide = torch.randn(6, 2 * vocab, device="cuda", generator=g)[:, ::2]  # a row stride of 2 * vocab, step 2
    assert torch.equal(draw(wide, 3, seq, pos, fused=True), draw(wide, 3, seq, pos, fused=False))


@pytest.mark.parametrize("vocab,dtype", [(17, torch.float32), (100, torch.float32), (32000, torch.float32),
                                         (128256, torch.float32), (100, torch.bfloat16), (32000, torch.bfloat16)])
def test_fused_top_k_top_p_draw_equals_the_reference(vocab, dtype):
    """topk's window, top-k, top-p and the draw in one kernel against filter_scores() then draw() in torch ops,
    on logits rounded to quarters so that ties are many (row 0: 40 tied at the k-th value, beyond a small
    window; row 1: only 5 finite tokens, so a k above 5 has -inf for its k-th value; row 2: every token tied).
    The kernels read the logits in their own dtype (bf16: exactly the quarters) and divide by the temperature
    themselves. The temperature alone and top-k alone: the same tokens. With top-p the kernel adds its
    float32 running sums in another order (and triton's exp is not torch's), so a sum within rounding of
    the cut may fall the other way: at most 1% of the draws differ; every token drawn has a finite logit."""
    _triton_or_skip()
    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.round(torch.randn(4, vocab, device="cuda", generator=g) * 12) / 4
    if vocab > 50:
        logits[0, 7:47] = logits[0].max() - 0.25
    logits[1, 5:] = -float("inf")
    logits[2] = 0.5
    logits = logits.to(dtype)
    seq = torch.arange(4, device="cuda")
    differ = total = 0
    for k, p in [(None, None), (1, None), (5, None), (16, None), (50, None), (5, 0.9), (16, 0.9), (50, 0.9), (50, 0.3),
                 (10, 0.99), (1000, 0.95)]:
        settings = filter_tensors(0.8, k, p, vocab, "cuda")
        flags = dict(use_top_k=k is not None, use_top_p=p is not None, k_window=top_k_window(k))
        for seed in (0, 5, 2**63):
            for pos in (torch.tensor(7, device="cuda"), torch.tensor([1, 2, 3, 2**33], device="cuda")):
                fused = draw_filtered(logits, *settings, seed, seq, pos, fused=True, **flags)
                ref = draw(filter_scores(logits, *settings, **flags), seed, seq, pos, fused=False)
                if p is None:
                    assert torch.equal(fused, ref), (k, seed, fused.tolist(), ref.tolist())
                assert logits.gather(1, fused.view(4, 1)).isfinite().all()
                differ += int((fused != ref).sum())
                total += 4
    assert differ <= total // 100, (differ, total)


def test_fused_draws_see_ties_that_the_temperature_makes():
    """The window is topk of the logits; dividing by the temperature can merge distinct logits into one score
    (here subnormal scores, whose precision is low): the kernel finds the k-th value tied with the window's
    last and counts and draws the ties over the row, as the reference does on the divided scores."""
    _triton_or_skip()
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = 1e-3 * (1 + torch.randint(0, 64, (4, 3000), device="cuda", generator=g) * 2.0**-20)
    seq = torch.arange(4, device="cuda")
    for k, p in [(None, None), (10, None), (16, None), (10, 0.9), (40, 0.5)]:
        settings = filter_tensors(1e37, k, p, 3000, "cuda")
        scaled = logits / settings[0]
        if k is not None:
            assert (scaled.topk(top_k_window(k)).values[:, -1] == scaled.topk(k).values[:, -1]).all()
        flags = dict(use_top_k=k is not None, use_top_p=p is not None, k_window=top_k_window(k))
        for seed in (0, 3):
            fused = draw_filtered(logits, *settings, seed, seq, torch.tensor(5, device="cuda"), fused=True, **flags)
            ref = draw(filter_scores(logits, *settings, **flags), seed, seq, torch.tensor(5, device="cuda"),
                       fused=False)
            assert torch.equal(fused, ref), (k, p, fused.tolist(), ref.tolist())


def test_the_fused_top_k_kernel_is_loaded_before_a_capture_without_a_warm_up():
    """prepare_fused(k_window=, top_p=) compiles the window kernel of that variant: a capture of draw_filtered
    with no eager run before it records the launch, and each replay draws the reference's tokens."""
    _triton_or_skip()
    assert sampling.prepare_fused("cuda", k_window=64, top_p=True) is True
    logits = torch.randn(4, 5000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)) * 3
    logits = logits.to(torch.bfloat16)  # prepared for each floating dtype
    settings = filter_tensors(0.9, 50, 0.9, 5000, "cuda")
    key, seq = seed_key(4, "cuda"), torch.arange(4, device="cuda")
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    flags = dict(use_top_k=True, use_top_p=True, k_window=64)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = draw_filtered(logits, *settings, key, seq, pos, **flags)
    differ = 0
    for step in range(3):
        pos.fill_(step)
        g.replay()
        want = draw(filter_scores(logits, *settings, **flags), key, seq, pos, fused=False)
        differ += int((out != want).sum())  # top-p: a running sum within rounding of the cut may differ
    assert differ <= 1, differ


def test_fused_draw_replays_in_a_captured_graph_and_its_draws_follow_the_softmax():
    """The draw captured once after prepare_fused(): each replay reads new positions from the buffer; over
    200,000 replays' worth of rows (one graph of 4,000 rows, 50 positions) the tokens follow the softmax."""
    _triton_or_skip()
    assert sampling.prepare_fused("cuda") is True
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], device="cuda")
    scores = logits.expand(4000, -1).contiguous()
    key, seq = seed_key(31, "cuda"), torch.arange(4000, device="cuda")
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        out = draw(scores, key, seq, pos)
    counts = torch.zeros(8, dtype=torch.float64, device="cuda")
    for step in range(50):
        pos.fill_(step)
        g.replay()
        if step < 3:
            assert torch.equal(out, draw(scores, key, seq, pos, fused=False)), step
        counts += torch.bincount(out, minlength=8).double()
    expected = logits.softmax(-1).double() * 200_000
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 24.32, (chi2, counts.tolist())  # 7 degrees of freedom, p = 0.001


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_ragged_batches_draw_each_row_at_its_own_position(strategy):
    step = _step(_table())
    first = torch.tensor([1, 5, 9, 13], device="cuda")
    start = torch.tensor([3, 40, 0, 2**32 + 1], device="cuda")  # one position per row, one past 2**32
    settings = {"temperature": 0.9, "top_p": 0.9}
    want = _reference(step, first, start, 30, SamplingParams(do_sample=True, seed=77, **settings))
    for chunk in (1, 16):
        loop = DeviceDecodeLoop(step, batch_size=BATCH, chunk=chunk, strategy=strategy)
        got = loop.generate(first, start, max_new_tokens=30, do_sample=True, seed=77, **settings)
        assert loop.strategy == strategy, loop.strategy_reason
        assert torch.equal(got, want), (strategy, chunk)
        greedy = loop.generate(first, start, max_new_tokens=30)
        assert torch.equal(greedy, _reference(step, first, start, 30, SamplingParams()))


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_left_padded_sampling_in_the_decoder_is_the_same_on_every_path(strategy):
    transformers = pytest.importorskip("transformers")
    from _tiny_llama import tiny_llama
    from gfxgraph.hf import StaticCacheDecoder

    model = tiny_llama(transformers)
    g = torch.Generator().manual_seed(4)
    lengths = (3, 17, 9, 40)
    ids = torch.zeros(4, 40, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, 40 - n:] = torch.randint(1, 1000, (n,), generator=g)
        mask[i, 40 - n:] = 1
    ids, mask = ids.cuda(), mask.cuda()
    settings = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=3, eos_token_id=None)
    want = StaticCacheDecoder(model, max_cache_len=80, graphs=False).generate(ids, attention_mask=mask,
                                                                              max_new_tokens=24, **settings)
    graphed = StaticCacheDecoder(model, max_cache_len=80).generate(ids, attention_mask=mask, max_new_tokens=24,
                                                                   **settings)
    assert torch.equal(graphed, want)
    for chunk in (1, 16):
        dec = StaticCacheDecoder(model, max_cache_len=80, device_loop=chunk, strategy=strategy)
        assert torch.equal(dec.generate(ids, attention_mask=mask, max_new_tokens=24, **settings), want), chunk


@pytest.mark.parametrize("settings", [{"temperature": 0.9}, {"temperature": 0.9, "top_k": 20, "top_p": 0.9}])
@pytest.mark.parametrize("strategy", ["native", "host"])
def test_the_loop_draws_the_same_tokens_with_the_kernel_and_with_the_reference(strategy, settings, monkeypatch):
    """The captured body's Triton kernel against the torch reference captured in its place (the module switch):
    the same tokens, inside the WHILE body and in the host loop's step graph."""
    _triton_or_skip()
    step = _step(_table())
    first = torch.tensor([1, 5, 9, 13], device="cuda")
    start = torch.tensor([3, 2**32 - 2, 0, 11], device="cuda")  # a row whose position carries into word 2
    kw = dict(max_new_tokens=40, do_sample=True, seed=5, **settings)
    fused = DeviceDecodeLoop(step, batch_size=BATCH, chunk=16, strategy=strategy).generate(first, start, **kw)
    monkeypatch.setattr(sampling, "FUSED_BY_DEFAULT", False)
    loop = DeviceDecodeLoop(step, batch_size=BATCH, chunk=16, strategy=strategy)
    assert torch.equal(loop.generate(first, start, **kw), fused)
    assert loop.strategy == strategy, loop.strategy_reason


@pytest.mark.parametrize("strategy", ["native", "host"])
def test_a_loop_without_warm_ups_prepares_its_kernels_and_draws_the_reference_tokens(strategy):
    """With warm-ups the body's eager runs compile the Triton variant it uses; with warmup_iters=0 nothing runs
    the body before the capture, so the loop compiles every dtype's variant first: the capture then records the
    launches and the tokens are those of a loop with warm-ups."""
    _triton_or_skip()
    step = _step(_table())
    first = torch.tensor([1, 5, 9, 13], device="cuda")
    kw = dict(max_new_tokens=24, do_sample=True, seed=3, temperature=0.9, top_k=20, top_p=0.8)
    want = DeviceDecodeLoop(step, batch_size=BATCH, chunk=8, strategy=strategy).generate(first, 4, **kw)
    loop = DeviceDecodeLoop(step, batch_size=BATCH, chunk=8, strategy=strategy, warmup_iters=0)
    assert torch.equal(loop.generate(first, 4, **kw), want)
    assert loop.strategy == strategy, loop.strategy_reason
