"""DeviceDecodeLoop sampling on the CPU (the eager strategy runs the body the device strategies capture): a step
that returns logits, greedy or sampled; a seed gives the tokens of the reference sampler at (seed, sequence,
position) whatever the chunk size; switching between greedy and sampling; wrong uses refused."""

from __future__ import annotations

import pytest
import torch

from _tiny_llama import prompt, tiny_llama
from gfxgraph import ConfigError
from gfxgraph.hf import StaticCacheDecoder
from hipgraph_bridge.generation import DeviceDecodeLoop
from hipgraph_bridge.generation.device_loop import BodyKind
from hipgraph_bridge.generation.sampling import (SamplingParams, chooser, draw_filtered, filter_flags, filter_tensors,
                                                 sample_tokens, seed_key, top_k_window)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path; the GPU file covers a GPU")

VOCAB, BATCH = 40, 3
_TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 2


def logits_step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """A toy model: the next token's logits depend on the last token and the position (0-dim, or one per row)."""
    return _TABLE[tokens] + 0.1 * torch.cos(position.float().unsqueeze(-1) * torch.arange(VOCAB, dtype=torch.float32))


def reference(first: torch.Tensor, start: int, new: int, params: SamplingParams) -> torch.Tensor:
    """The host loop with the reference sampler: the token after position p uses (seed, row, p)."""
    tok, out = first, []
    for i in range(new):
        pos = torch.tensor(start + i)
        tok = sample_tokens(logits_step(tok, pos), params, torch.arange(BATCH), pos.expand(BATCH))
        out.append(tok)
    return torch.stack(out, dim=1)


FIRST = torch.tensor([1, 5, 9])


def test_greedy_on_logits_is_argmax():
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=4, device="cpu")
    got = loop.generate(FIRST, 2, max_new_tokens=9)
    assert torch.equal(got, reference(FIRST, 2, 9, SamplingParams(do_sample=False)))


@pytest.mark.parametrize("chunk", [1, 4, 16])
@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.8},
                                      {"temperature": 1.3, "top_k": 3, "top_p": 0.9}])
def test_a_seed_gives_the_reference_tokens_whatever_the_chunk(chunk, settings):
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=chunk, device="cpu")
    got = loop.generate(FIRST, 2, max_new_tokens=12, do_sample=True, seed=99, **settings)
    assert torch.equal(got, reference(FIRST, 2, 12, SamplingParams(do_sample=True, seed=99, **settings)))


def test_seeds_differ_and_switching_modes_recaptures_the_body():
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=4, device="cpu")
    a = loop.generate(FIRST, 0, max_new_tokens=16, do_sample=True, seed=1)
    b = loop.generate(FIRST, 0, max_new_tokens=16, do_sample=True, seed=2)
    greedy = loop.generate(FIRST, 0, max_new_tokens=16)
    again = loop.generate(FIRST, 0, max_new_tokens=16, do_sample=True, seed=1)
    assert not torch.equal(a, b) and torch.equal(a, again)
    assert torch.equal(greedy, reference(FIRST, 0, 16, SamplingParams()))


def test_sampling_with_eos_pads_after_the_end():
    params = SamplingParams(do_sample=True, seed=7, top_k=8)
    want = reference(FIRST, 0, 12, params)
    eos = int(want[0, 3])
    got = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=4, device="cpu").generate(
        FIRST, 0, max_new_tokens=12, do_sample=True, seed=7, top_k=8, eos_token_id=eos, pad_token_id=0)
    first_end = [row.index(eos) if eos in row else None for row in want.tolist()]
    for r, end in enumerate(first_end):
        if end is None:
            assert got[r].tolist() == want[r, :got.shape[1]].tolist()
        else:
            assert got[r, :end + 1].tolist() == want[r, :end + 1].tolist() and got[r, end + 1:].eq(0).all()


def test_sampling_a_step_that_returns_token_ids_is_refused():
    loop = DeviceDecodeLoop(lambda t, p: (t + 1) % VOCAB, batch_size=BATCH, chunk=4, device="cpu")
    with pytest.raises(ValueError, match="returns \\(batch_size, vocab\\) logits"):
        loop.generate(FIRST, 0, max_new_tokens=4, do_sample=True, seed=1)
    assert loop.generate(FIRST, 0, max_new_tokens=2).tolist() == [[2, 3], [6, 7], [10, 11]]


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"top_k": -2}, {"top_p": 2.0}, {"seed": -3}])
def test_bad_sampling_settings_are_config_errors(kwargs):
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=4, device="cpu")
    with pytest.raises(ConfigError):
        loop.generate(FIRST, 0, max_new_tokens=2, do_sample=True, **kwargs)


def test_a_recapture_after_a_generation_starts_from_column_zero():
    # chunk 1: a generation leaves the output column at 1, outside a 1-column buffer; the warm-up of the
    # recapture that a switch to sampling makes must not write there
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=1, device="cpu")
    loop.generate(FIRST, 0, max_new_tokens=3)
    assert int(loop._loop.state[3][0]) == 1
    loop._load(FIRST, 0, None)
    assert loop._loop.state[3].tolist()[:2] == [0, 1]


def test_static_cache_decoder_samples_the_same_tokens_with_and_without_the_device_loop():
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(transformers, device="cpu")
    ids = prompt(2, 5, device="cpu")
    settings = dict(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=11)
    host = StaticCacheDecoder(model, max_cache_len=32, graphs=False).generate(ids, max_new_tokens=12,
                                                                               eos_token_id=None, **settings)
    looped = StaticCacheDecoder(model, max_cache_len=32, device_loop=4).generate(ids, max_new_tokens=12,
                                                                                 eos_token_id=None, **settings)
    assert torch.equal(host, looped)
    # the reference: transformers' forward pass, the token after position p drawn at (seed, row, p)
    with torch.no_grad():
        seq = ids
        params = SamplingParams(**settings)
        for i in range(12):
            p = seq.shape[1] - 1
            logits = model(input_ids=seq).logits[:, -1, :]
            tok = sample_tokens(logits, params, torch.arange(2), torch.full((2,), p))
            seq = torch.cat([seq, tok.view(2, 1)], dim=1)
    assert torch.equal(host, seq[:, ids.shape[1]:])
    other = StaticCacheDecoder(model, max_cache_len=32, graphs=False).generate(
        ids, max_new_tokens=12, eos_token_id=None, **{**settings, "seed": 12})
    assert not torch.equal(host, other)


def test_capture_for_a_kind_of_generation_restarts_the_column_and_keeps_the_body():
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=1, device="cpu")
    loop.generate(FIRST, 0, max_new_tokens=2)
    loop.capture(do_sample=True)
    assert loop._sampling and loop._loop.state[3].tolist()[:2] == [0, 1]
    with pytest.raises(TypeError, match="do_sample"):
        loop.capture(do_sample="yes")


def test_a_refused_sampling_call_changes_nothing_and_a_capture_supersedes_iterators():
    ids_step = DeviceDecodeLoop(lambda t, p: (t + 1) % VOCAB, batch_size=BATCH, chunk=4, device="cpu")
    ids_step.generate(FIRST, 0, max_new_tokens=2)
    strategy = ids_step.strategy
    with pytest.raises(ValueError, match="logits"):
        ids_step.generate(FIRST, 0, max_new_tokens=2, do_sample=True, seed=1)
    with pytest.raises(ValueError, match="logits"):
        ids_step.capture(do_sample=True)
    assert ids_step.strategy == strategy and not ids_step._sampling  # known to return ids: refused up front
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=2, device="cpu")
    it = loop.chunks(FIRST, 0, max_new_tokens=8)
    next(it)
    loop.capture(do_sample=True)
    with pytest.raises(RuntimeError, match="superseded"):
        next(it)
    assert loop.captured_for(True) and not loop.captured_for(False)


# ------------------------------------------------------------------ bodies per filter set; ragged batches
def _sorts_while(fn) -> tuple[int, int]:
    """How many sorts of the vocabulary and how many topk calls ran during ``fn()`` (the profiler's aten::sort,
    aten::topk; top-p orders a window's equal scores with sorts of the window, not counted)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    sorts = topks = 0
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::sort" and any(shape and shape[-1] == VOCAB for shape in e.input_shapes[:1]):
            sorts += e.count
        elif e.key == "aten::topk":
            topks += e.count
    return sorts, topks


def test_plain_temperature_sampling_runs_no_sort_and_a_small_top_k_reads_a_window():
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=4, device="cpu")
    kw = dict(max_new_tokens=8, do_sample=True, seed=4)
    assert _sorts_while(lambda: loop.generate(FIRST, 0, temperature=0.7, **kw)) == (0, 0)
    assert loop.body_kind == BodyKind(sampling=True)
    # top-k (with or without top-p): one topk of a 16-token window per token, no sort of the vocabulary
    assert _sorts_while(lambda: loop.generate(FIRST, 0, top_k=5, **kw)) == (0, 8)
    assert loop.body_kind == BodyKind(sampling=True, top_k=True, k_window=16)
    assert _sorts_while(lambda: loop.generate(FIRST, 0, top_k=5, top_p=0.9, **kw)) == (0, 8)
    assert _sorts_while(lambda: loop.generate(FIRST, 0, top_p=0.9, **kw)) == (8, 0)  # top-p alone: a sort
    assert _sorts_while(lambda: loop.generate(FIRST, 0, top_k=2000, top_p=0.9, **kw)) == (8, 0)  # one, shared
    assert loop.body_kind.k_window is None
    assert _sorts_while(lambda: loop.generate(FIRST, 0, top_p=1.0, **kw)) == (0, 0)  # top_p=1 removes nothing: off


@pytest.mark.parametrize("settings", [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8},
                                      {"temperature": 1.3, "top_k": 3, "top_p": 0.9}])
def test_switching_filters_recaptures_and_keeps_the_reference_tokens(settings):
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=4, device="cpu")
    loop.generate(FIRST, 2, max_new_tokens=5, do_sample=True, seed=1, top_k=2, top_p=0.5)  # another filter set
    got = loop.generate(FIRST, 2, max_new_tokens=12, do_sample=True, seed=99, **settings)
    assert torch.equal(got, reference(FIRST, 2, 12, SamplingParams(do_sample=True, seed=99, **settings)))
    assert loop.captured_for(True, top_k=settings.get("top_k"), top_p=settings.get("top_p"))
    # a body is per filter set and top-k window, not per value: k in 1..16 and any p share the one of (3, 0.9)
    assert loop.captured_for(True, top_k=12, top_p=0.5) == ("top_k" in settings and "top_p" in settings)
    assert not loop.captured_for(True, top_k=17, top_p=0.5)  # the next window: a capture


def reference_ragged(first: torch.Tensor, start: torch.Tensor, new: int, params: SamplingParams) -> torch.Tensor:
    """The reference with one position per row: row i's token after its position p uses (seed, i, p)."""
    tok, out = first, []
    for i in range(new):
        pos = start + i
        logits = torch.stack([logits_step(tok[r:r + 1], pos[r])[0] for r in range(BATCH)])  # row by row
        tok = sample_tokens(logits, params, torch.arange(BATCH), pos)
        out.append(tok)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_ragged_sampling_draws_each_row_at_its_own_position(chunk):
    start = torch.tensor([7, 2, 30])
    settings = dict(temperature=0.9, top_k=10, top_p=0.95)
    loop = DeviceDecodeLoop(logits_step, batch_size=BATCH, chunk=chunk, device="cpu")
    got = loop.generate(FIRST, start, max_new_tokens=12, do_sample=True, seed=21, **settings)
    assert torch.equal(got, reference_ragged(FIRST, start, 12, SamplingParams(do_sample=True, seed=21, **settings)))
    same = loop.generate(FIRST, torch.full((BATCH,), 2), max_new_tokens=12, do_sample=True, seed=21, **settings)
    assert torch.equal(same, reference(FIRST, 2, 12, SamplingParams(do_sample=True, seed=21, **settings)))


def test_chooser_draws_as_draw_filtered_with_its_settings_made_once():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    seq, pos = torch.arange(3), torch.tensor([5, 6, 7])
    assert torch.equal(chooser(SamplingParams(), 300, "cpu")(logits, seq, pos), logits.argmax(-1))
    params = SamplingParams(True, 0.7, 20, 0.9, seed=11)
    choose = chooser(params, 300, "cpu")
    use_k, use_p = filter_flags(20, 0.9)
    ref = draw_filtered(logits, *filter_tensors(0.7, 20, 0.9, 300, "cpu"), seed_key(11, "cpu"), seq, pos,
                        use_top_k=use_k, use_top_p=use_p, k_window=top_k_window(20))
    assert torch.equal(choose(logits, seq, pos), ref)
    assert torch.equal(choose(logits, seq, pos), sample_tokens(logits, params, seq, pos))
    with pytest.raises(ConfigError, match="with a seed"):
        chooser(SamplingParams(True), 300, "cpu")
