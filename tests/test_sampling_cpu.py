"""Sampling's reference implementation on the CPU: Philox4x32-10 against the published known-answer vectors,
transformers' temperature/top-k/top-p rules, the drawn distribution (chi-square over 200,000 draws per
setting) and a stream that depends on (seed, sequence, position) only."""

from __future__ import annotations

import math

import pytest
import torch

from gfxgraph import ConfigError
from hipgraph_bridge.generation.sampling import (WINDOW_MAX, SamplingParams, _reference_uniform, draw,
                                                 filter_logits, filter_scores, filter_tensors, philox4x32,
                                                 sample_tokens, seed_key, top_k_window, uniform)

# Random123's kat_vectors for philox4x32_10: (counter, key) -> output
_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", _KAT)
def test_philox_matches_the_known_answers(counter, key, want):
    got = philox4x32(torch.tensor(counter, dtype=torch.int64), torch.tensor(key, dtype=torch.int64))
    assert [int(x) for x in got] == list(want)


def test_philox_is_vectorised_over_counters():
    counters = torch.tensor([c for c, _, _ in _KAT], dtype=torch.int64)
    keys = torch.tensor([k for _, k, _ in _KAT], dtype=torch.int64)
    assert philox4x32(counters, keys).tolist() == [list(w) for _, _, w in _KAT]


def test_uniform_numbers_are_a_function_of_seed_sequence_and_position():
    pos = torch.arange(100_000)
    u = uniform(7, torch.tensor(3), pos)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert torch.equal(u[123:130], uniform(7, torch.tensor(3), pos[123:130]))  # no state: any slice, any order
    assert not torch.equal(u[:50], uniform(8, torch.tensor(3), pos[:50]))  # another seed
    assert not torch.equal(u[:50], uniform(7, torch.tensor(4), pos[:50]))  # another sequence
    grid = uniform(7, torch.arange(4).view(4, 1), torch.arange(5).view(1, 5))
    assert grid.shape == (4, 5) and torch.equal(grid[3], uniform(7, torch.tensor(3), torch.arange(5)))
    big = uniform(2**64 - 1, torch.tensor(2**31), torch.tensor(2**40))  # every bit of the key and counter used
    assert 0 <= big.item() < 1


def test_filters_follow_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[0, :5] = 2.0  # ties at the k-th value are kept
    for t, k, p in [(1.0, None, None), (0.7, 5, None), (1.0, None, 0.8), (1.3, 3, 0.9), (0.5, 10, 0.3)]:
        want = logits.clone()
        if t != 1.0:
            want = transformers.TemperatureLogitsWarper(t)(None, want)
        if k is not None:
            want = transformers.TopKLogitsWarper(k)(None, want)
        if p is not None:
            want = transformers.TopPLogitsWarper(p)(None, want)
        got = filter_logits(logits, t, k, p)
        # transformers' top-p sorts with an unstable sort: which of the tied tokens in row 0 it keeps is
        # not defined (here the lowest ids go first); the values kept are the same
        assert torch.equal(got[1:], want[1:]), (t, k, p)
        assert torch.equal(got[0].sort().values, want[0].sort().values), (t, k, p)


# chi-square critical values at p = 0.001 by degrees of freedom
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("t, k, p", [(1.0, None, None), (0.7, 5, None), (1.0, None, 0.8), (1.3, 3, 0.9)])
def test_draws_follow_the_filtered_distribution(t, k, p):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    params = SamplingParams(do_sample=True, temperature=t, top_k=k, top_p=p, seed=20261202)
    n = 200_000
    tokens = sample_tokens(logits.expand(n, -1), params, torch.zeros(n, dtype=torch.long), torch.arange(n))
    counts = torch.bincount(tokens, minlength=8).double()
    probs = filter_logits(logits, t, k, p).softmax(-1)[0].double()
    kept = probs > 0
    assert counts[~kept].sum() == 0  # a removed token is never drawn
    expected = probs[kept] * n
    chi2 = (((counts[kept] - expected) ** 2) / expected).sum().item()
    df = int(kept.sum()) - 1
    assert chi2 < _CHI2_999[df], (chi2, df, counts.tolist(), expected.tolist())


def test_a_sequences_tokens_do_not_depend_on_its_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    params = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, seed=5)
    together = sample_tokens(logits, params, torch.arange(4), torch.full((4,), 17))
    alone = [sample_tokens(logits[i:i + 1], params, torch.tensor([i]), torch.tensor([17])).item() for i in range(4)]
    assert together.tolist() == alone
    again = sample_tokens(logits, params, torch.arange(4), torch.full((4,), 17))
    assert torch.equal(together, again)


def test_greedy_ignores_the_rest():
    logits = torch.randn(3, 10)
    params = SamplingParams(do_sample=False, temperature=0.1, top_k=2, seed=1)
    assert torch.equal(sample_tokens(logits, params, torch.arange(3), torch.zeros(3)), logits.argmax(-1))


@pytest.mark.parametrize("kwargs", [{"temperature": 0}, {"temperature": math.inf}, {"temperature": True},
                                    {"top_k": -1}, {"top_k": 2.5}, {"top_p": 0}, {"top_p": 1.5},
                                    {"seed": -1}, {"seed": 2**64}, {"do_sample": 1}])
def test_bad_parameters_are_refused_naming_what_was_expected(kwargs):
    with pytest.raises(ConfigError, match="expected"):
        SamplingParams(**kwargs)


def test_sampling_needs_a_seed_and_with_seed_draws_one():
    params = SamplingParams(do_sample=True)
    with pytest.raises(ConfigError, match="seed"):
        sample_tokens(torch.randn(1, 4), params, torch.zeros(1), torch.zeros(1))
    seeded = params.with_seed()
    assert seeded.seed is not None and seeded.with_seed() is seeded


def test_top_k_zero_is_off_as_in_transformers():
    assert SamplingParams(do_sample=True, top_k=0).top_k is None


# ------------------------------------------------------------------ the fused kernel's fallback, the filters left out
def test_the_reference_runs_on_a_cpu_and_the_kernel_is_refused_there():
    from hipgraph_bridge.generation import sampling

    seq, pos = torch.arange(6), torch.tensor(2**33 + 5)
    auto = uniform(11, seq, pos)
    assert torch.equal(auto, uniform(11, seq, pos, fused=False))  # CPU tensors: the reference, whatever triton
    if not torch.cuda.is_available():
        assert "no GPU" in sampling.fused_unavailable_reason()
    assert sampling.prepare_fused("cpu") is False
    with pytest.raises(RuntimeError, match="fused=True.*cannot run: the tensors are on cpu"):
        uniform(11, seq, pos, fused=True)


@pytest.mark.slow  # some minutes: the interpreter runs the bitonic networks in numpy
def test_fused_kernel_matches_the_reference_in_tritons_interpreter(py):
    """The kernel's integer arithmetic (uint32 words, umulhi, the int64 -> uint32 casts) checked without a GPU:
    triton's interpreter runs it on CPU tensors. Needs triton (PyTorch's CUDA/ROCm builds ship it)."""
    pytest.importorskip("triton")
    r = py("""
        import torch
        from hipgraph_bridge.generation._philox_triton import uniform_fused
        from hipgraph_bridge.generation.sampling import seed_key, uniform
        g = torch.Generator().manual_seed(0)
        for seed in (0, 1, 2**32 - 1, 2**32, 2**64 - 1, 0xA4093822299F31D0):
            key = seed_key(seed, "cpu")
            seq = torch.randint(0, 2**32, (300,), generator=g)
            pos = torch.randint(0, 2**62, (300,), generator=g)
            pos[:4] = torch.tensor([0, 2**32 - 1, 2**32, 2**63 - 1])
            assert torch.equal(uniform_fused(key, seq, pos), uniform(key, seq, pos, fused=False)), seed
            scalar = torch.tensor(2**40 + 7)  # broadcast: stride 0
            assert torch.equal(uniform_fused(key, seq, scalar), uniform(key, seq, scalar, fused=False)), seed
        # the draws: Gumbel-max, and top-k (+ top-p) in one kernel, on logits with ties, -inf and a masked tail
        import hipgraph_bridge.generation._philox_triton as kernels
        from hipgraph_bridge.generation._philox_triton import gumbel_max_fused, topk_draw_fused
        from hipgraph_bridge.generation.sampling import draw, filter_scores, filter_tensors, top_k_window
        tiny = torch.full((4, 300), 1e-3) * (1 + torch.randint(0, 64, (4, 300), generator=g) * 2.0**-20)
        cases = [(torch.round(torch.randn(4, vocab, generator=g) * 8) / 4, 0.7) for vocab in (17, 300, 2500)]
        cases.append((cases[1][0].to(torch.bfloat16), 0.7))  # the logits' dtype: the kernels read it
        # a temperature that merges distinct logits into ties (subnormal scores): ties beyond the window
        cases.append((tiny, 1e37))
        signed = torch.full((4, 300), -5.0)  # -0.0 and 0.0 tied at the k-th value; ties above it cut by top-p
        signed[:, 100], signed[:, 10:15], signed[:, 15:25] = 3.0, -0.0, 0.0
        signed[1:, [5, 140, 290]], signed[1:, [3, 50, 100, 127, 128, 130, 170, 200, 255, 256, 260, 299]] = 2.0, 1.0
        cases.append((signed, 1.0))
        cases.append((cases[1][0], 0.7))  # again with at most 2 programs a row: each reads its share in steps
        # the interpreter's bitonic top-k is slow: top-k programs of 128 tokens a step (any power of two
        # >= the window serves), at most 4 of them a row, and for the last case 2 a row (several steps each)
        kernels._TOPK_SUB = 128
        for n, (logits, temp) in enumerate(cases):
            kernels._TOPK_PROGRAMS, kernels._DRAW_PROGRAMS = (2, 2) if n == len(cases) - 1 else (4, 64)
            vocab = logits.shape[1]
            if temp < 1:
                logits[1, 5:] = -float("inf")  # k beyond the finite tokens: the k-th value is -inf
                logits[2] = 0.5  # every token tied
            seq = torch.arange(4)
            for pos in (torch.tensor(3), torch.tensor([0, 7, 2**33, 9])):
                ref = draw(logits.float(), 5, seq, pos, fused=False)
                assert torch.equal(gumbel_max_fused(logits, seed_key(5, "cpu"), seq, pos), ref), vocab
                t = filter_tensors(temp, None, None, vocab, "cpu")[0]
                ref = draw(logits.float() / t, 5, seq, pos, fused=False)
                got = gumbel_max_fused(logits, seed_key(5, "cpu"), seq, pos, temperature=t)
                assert torch.equal(got, ref), (vocab, temp)
                for k, p in [(1, None), (10, None), (16, 0.9), (40, 0.5), (100, 0.95), (16, 0.8), (40, 0.6)]:
                    w = top_k_window(k)
                    if w is None or w >= vocab or pos.dim() == 0 or vocab > 300:  # the interpreter's time
                        continue
                    t, kk, cut = filter_tensors(temp, k, p, vocab, "cpu")
                    flags = dict(use_top_k=True, use_top_p=p is not None, k_window=w)
                    want = draw(filter_scores(logits, t, kk, cut, **flags), 5, seq, pos, fused=False)
                    got = topk_draw_fused(logits, t, kk, cut, seed_key(5, "cpu"), seq, pos, window=w,
                                          top_p=p is not None)
                    assert torch.equal(got, want), (vocab, temp, k, p, got.tolist(), want.tolist())
        scaled = tiny / filter_tensors(1e37, None, None, 300, "cpu")[0]
        assert (scaled.topk(16).values[:, -1:] == scaled.topk(16).values[:, 9:10]).all()  # the case is the one meant
        print("ok")
    """, env={"TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def test_top_p_removes_ties_in_a_fixed_order_whatever_topk_returns():
    """transformers leaves the order of tied tokens to an unstable sort; here it is fixed: tokens tied at the
    k-th value and tokens tied above it go lowest id first (as transformers' stable sort on the CPU orders
    them); -0.0 and 0.0 are one value."""
    from hipgraph_bridge.generation.sampling import filter_scores, filter_tensors

    logits = torch.full((1, 40), -5.0)
    logits[0, 0] = 4.0
    logits[0, [3, 7, 11, 20]] = 2.0  # tied above the k-th value
    logits[0, [30, 31, 32]] = 1.0  # the k-th value (k = 8) and its ties
    # p: 0.592, 0.080 each, 0.029 each; running sums from the smallest: 0.029, 0.059, 0.088 (the k-th's
    # ties), then 0.168 (id 3), 0.249 (id 7), 0.329 (id 11), 0.409 (id 20): a cut of 0.25 keeps 0, 11, 20
    settings = filter_tensors(1.0, 8, 0.75, 40, "cpu")
    kept = filter_scores(logits, *settings, k_window=16).isfinite().nonzero()[:, 1].tolist()
    assert kept == [0, 11, 20]
    signed = torch.full((1, 40), -5.0)
    signed[0, 30] = 3.0
    signed[0, 0:5], signed[0, 5:15] = 0.0, -0.0  # 15 tokens tied at 0 (k = 16: the 16th value is 0)
    settings = filter_tensors(1.0, 16, 0.8, 40, "cpu")  # 0.2 of the mass goes: the 7 lowest ids of the ties
    kept = filter_scores(signed, *settings, k_window=16).isfinite().nonzero()[:, 1].tolist()
    full = filter_scores(signed, *settings, k_window=None).isfinite().nonzero()[:, 1].tolist()
    assert kept == list(range(7, 15)) + [30], kept
    assert len(full) == len(kept)  # the sort of the vocabulary removes as many (its tie order is its own)


def test_filters_that_are_off_are_left_out_with_the_same_scores():
    from hipgraph_bridge.generation.sampling import filter_flags, filter_scores, filter_tensors

    torch.manual_seed(3)
    logits = torch.randn(5, 300) * 4
    logits[1, :10] = -math.inf  # removed already: the full path's k-th value may be -inf
    for t, k, p in [(1.0, None, None), (0.6, None, None), (0.8, 7, None), (1.2, None, 0.9), (1.0, None, 1.0)]:
        settings = filter_tensors(t, k, p, logits.shape[-1], "cpu")
        full = filter_scores(logits, *settings)  # every filter run, the off ones removing nothing
        use_k, use_p = filter_flags(k, p)
        assert torch.equal(filter_scores(logits, *settings, use_top_k=use_k, use_top_p=use_p), full), (t, k, p)
    assert filter_flags(None, None) == (False, False) and filter_flags(0, 1.0) == (False, False)
    assert filter_flags(5, 0.9) == (True, True)


# ------------------------------------------------------------------ top-k's window; the Gumbel-max draw
def test_the_top_k_window_is_a_power_of_two_and_large_k_sorts():
    assert [top_k_window(k) for k in (None, 0, 1, 16, 17, 50, 64, 65, WINDOW_MAX)] == \
        [None, None, 16, 16, 32, 64, 64, 128, WINDOW_MAX]
    assert top_k_window(WINDOW_MAX + 1) is None


@pytest.mark.parametrize("seed", range(6))
def test_the_window_removes_the_tokens_the_sort_removes(seed):
    """top-k then top-p from a topk window against the one-sort path (transformers' arithmetic), on logits
    without ties: the same tokens removed, for every k in the window and several p."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 3000, generator=g) * (1 + seed)
    for k, p in [(1, 0.5), (7, 0.9), (50, 0.9), (50, 0.3), (64, 0.99), (40, 0.05)]:
        settings = filter_tensors(0.8, k, p, logits.shape[-1], "cpu")
        window = filter_scores(logits, *settings, k_window=64)
        sort = filter_scores(logits, *settings)
        assert torch.equal(window.isinf(), sort.isinf()), (k, p)
        assert torch.equal(window, sort)


def test_ties_at_the_kth_value_beyond_the_window_are_counted_over_the_vocabulary():
    """40 tokens tie at the k-th value, more than a 16-token window holds: top-p removes as many of them as
    transformers does (which ones it removes follows its unstable sort; here the lowest ids go first)."""
    transformers = pytest.importorskip("transformers")
    logits = torch.full((1, 200), -8.0)
    logits[0, [3, 78, 150]] = torch.tensor([4.0, 3.0, 2.5])
    tied = torch.arange(20, 140, 3)  # 40 tokens at 0.0
    logits[0, tied] = 0.0
    for k, p in [(10, 0.9), (10, 0.99), (10, 0.999), (3, 0.5), (4, 0.999999)]:
        want = transformers.TopPLogitsWarper(p)(None, transformers.TopKLogitsWarper(k)(None, logits.clone()))
        got = filter_scores(logits, *filter_tensors(1.0, k, p, 200, "cpu"), k_window=16)
        assert int(got.isfinite().sum()) == int(want.isfinite().sum()), (k, p)
        assert torch.equal(got[0, [3, 78, 150]].isfinite(), want[0, [3, 78, 150]].isfinite()), (k, p)
        kept_ties = tied[got[0, tied].isfinite()]
        assert torch.equal(kept_ties, tied[len(tied) - len(kept_ties):]), (k, p)  # the highest ids stay
    every_tied = torch.zeros(1, 50)  # the largest value tied too: one token stays whatever p
    got = filter_scores(every_tied, *filter_tensors(1.0, 5, 0.01, 50, "cpu"), k_window=16)
    assert int(got.isfinite().sum()) == 1


def test_the_draw_is_gumbel_max_over_the_streams_lanes():
    """Token v of a row takes the uniform number of lane v + 1 at the row's (seed, sequence, position): the draw
    is the argmax of score - log(-log(u)); lane 0 (uniform()) is not one of them; a removed token never wins."""
    scores = torch.randn(3, 30)
    scores[:, ::2] = -math.inf
    seq, pos = torch.tensor([0, 1, 2]), torch.tensor([5, 5, 2**33])
    u = _reference_uniform(seed_key(9, "cpu"), seq.view(3, 1), pos.view(3, 1), torch.arange(1, 31).view(1, 30))
    want = (scores.double() - torch.log(-torch.log(u))).argmax(-1)
    got = draw(scores, 9, seq, pos)
    assert torch.equal(got, want) and (got % 2 == 1).all()
    assert torch.equal(u[:, 0], _reference_uniform(seed_key(9, "cpu"), seq, pos, torch.ones(3, dtype=torch.long)))
    assert not torch.equal(u[:, 0], uniform(9, seq, pos))  # lane 0 is another number
    assert torch.equal(draw(scores, seed_key(9, "cpu"), seq, pos), got)  # an int seed or its key
    assert torch.equal(draw(scores[1:2], 9, torch.tensor(1), torch.tensor(5)), got[1:2])  # one row alone
    with pytest.raises(RuntimeError, match=r"draw\(fused=True\)"):
        draw(scores, 9, seq, pos, fused=True)


# ------------------------------------------------------------------ the greedy choice
def test_greedy_is_argmax_on_a_cpu_and_refuses_the_kernel_there():
    from hipgraph_bridge.generation.sampling import greedy

    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    x[1, [7, 200]] = 9.0  # a tie: the first
    x[2, [50, 9]] = float("nan")  # a NaN is the largest: the first NaN
    x[3] = -float("inf")
    assert torch.equal(greedy(x), x.argmax(-1)) and greedy(x).tolist()[1:] == [7, 9, 0]
    with pytest.raises(RuntimeError, match=r"greedy\(fused=True\): the Triton kernel cannot run: the logits are "
                                           r"on cpu; fused=None picks torch's argmax"):
        greedy(x, fused=True)
    with pytest.raises(ValueError, match=r"greedy: expected \(batch, vocab\) logits, got shape \(300,\)"):
        greedy(x[0])
