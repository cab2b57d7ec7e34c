"""gfxgraph.hf on a CPU: argument checks, the causal-LM check, EOS ids as transformers takes them.

The checks of ``generate()``'s arguments run before any cache or graph exists; they use
the small random Llama of the GPU tests, made on the CPU (transformers needed).
"""

from __future__ import annotations

import pytest
import torch

from _tiny_llama import prompt, tiny_llama
from gfxgraph.hf import StaticCacheDecoder


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    return tiny_llama(transformers, device="cpu")


@pytest.mark.parametrize("model", [torch.nn.Linear(4, 4), object(), "gpt2"])
def test_a_model_that_is_not_a_transformers_causal_lm_is_refused_at_construction(model):
    with pytest.raises(TypeError, match="expected a transformers causal LM") as info:
        StaticCacheDecoder(model, max_cache_len=8)
    assert type(model).__qualname__ in str(info.value)


def test_an_encoder_decoder_model_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, vocab_size=32)
    with pytest.raises(TypeError, match="decoder-only"):
        StaticCacheDecoder(transformers.T5ForConditionalGeneration(cfg), max_cache_len=8)


@pytest.mark.parametrize("bad", [1, 0, "8", True, 2.0])
def test_max_cache_len_checked(llama, bad):
    with pytest.raises(ValueError, match="max_cache_len: expected an int >= 2"):
        StaticCacheDecoder(llama, max_cache_len=bad)


@pytest.mark.parametrize("ids,match", [(torch.zeros(2, 3), "token ids"), (torch.zeros(3, dtype=torch.long), "token ids"),
                                       ("abc", "token ids")])
def test_input_ids_checked(llama, ids, match):
    with pytest.raises(ValueError, match=match):
        StaticCacheDecoder(llama, max_cache_len=8).generate(ids, max_new_tokens=2)


@pytest.mark.parametrize("new", [0, -1, "2", True])
def test_max_new_tokens_checked(llama, new):
    with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1"):
        StaticCacheDecoder(llama, max_cache_len=8).generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=new)


def test_prompt_plus_new_tokens_must_fit(llama):
    with pytest.raises(ValueError, match="expected at most max_cache_len=8"):
        StaticCacheDecoder(llama, max_cache_len=8).generate(torch.zeros(1, 5, dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("eos,error", [("2", TypeError), (2.0, TypeError), ([1, "2"], TypeError), (True, TypeError),
                                       (torch.tensor([1.0]), TypeError), (-1, ValueError), ([], ValueError)])
def test_bad_eos_ids_are_named(llama, eos, error):
    with pytest.raises(error, match="eos_token_id: expected"):
        StaticCacheDecoder(llama, max_cache_len=8).generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2,
                                                            eos_token_id=eos)


# ------------------------------------------------------------------ EOS ids as transformers takes them
NEW, PROMPT = 12, 6


def _hf_generate(llama, ids, **kw):
    with torch.no_grad():
        out = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, **kw)
    return out[:, PROMPT:]


def _pad_to(t, n):
    return torch.nn.functional.pad(t, (0, n - t.shape[1]), value=0) if t.shape[1] < n else t


def _two_eos(free):
    """Two tokens that end rows 0 and 1 mid-way, neither the other's row's earlier token."""
    a, b = int(free[0, 3]), int(free[1, 6])
    assert a != b
    return a, b


def test_several_eos_ids_end_each_sequence_as_transformers_does(llama):
    dec = StaticCacheDecoder(llama, max_cache_len=PROMPT + NEW + 4, graphs=False)
    ids = prompt(3, PROMPT, seed=3, device="cpu")
    free = dec.generate(ids, max_new_tokens=NEW, eos_token_id=None)
    assert free.shape == (3, NEW)
    a, b = _two_eos(free)
    want = _hf_generate(llama, ids, eos_token_id=[a, b])
    for eos in ([a, b], (a, b), torch.tensor([a, b]), torch.tensor([[a], [b]])):
        got = dec.generate(ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, want[:, :got.shape[1]]) and torch.equal(_pad_to(got, want.shape[1]), want), eos
    row0, row1 = got[0].tolist(), got[1].tolist()
    assert row0.index(a) <= 3 and all(t == 0 for t in row0[row0.index(a) + 1:])  # ended by the first id
    first_b = min(i for i, t in enumerate(row1) if t in (a, b))
    assert first_b <= 6 and all(t == 0 for t in row1[first_b + 1:])  # ended by whichever came first
    one = dec.generate(ids, max_new_tokens=NEW, eos_token_id=a, pad_token_id=0)  # an int still works
    assert torch.equal(_pad_to(one, NEW), _pad_to(_hf_generate(llama, ids, eos_token_id=a), NEW))


def test_eos_defaults_to_the_generation_config(llama, monkeypatch):
    dec = StaticCacheDecoder(llama, max_cache_len=PROMPT + NEW + 4, graphs=False)
    ids = prompt(2, PROMPT, seed=5, device="cpu")
    a, b = _two_eos(dec.generate(ids, max_new_tokens=NEW, eos_token_id=None))
    monkeypatch.setattr(llama.generation_config, "eos_token_id", [a, b])
    want = dec.generate(ids, max_new_tokens=NEW, eos_token_id=[a, b])  # pad: the first EOS id, as transformers
    assert want.shape[1] < NEW or bool((want == a).any() or (want == b).any())
    assert torch.equal(dec.generate(ids, max_new_tokens=NEW), want)
    monkeypatch.setattr(llama.generation_config, "eos_token_id", None)
    assert dec.generate(ids, max_new_tokens=NEW).shape == (2, NEW)  # none configured: every token decoded


# ------------------------------------------------------------------ left-padded prompts with an attention mask
LENGTHS = (3, 11, 7, 20)


def _left_padded(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        ids[i, n - length:] = torch.randint(1, 1000, (length,), generator=g)
        mask[i, n - length:] = 1
    return ids, mask


def _hf_padded(llama, ids, mask, new, **kw):
    with torch.no_grad():
        return llama.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                              **kw)[:, ids.shape[1]:]


PADDED_NEW = 14


@pytest.fixture(scope="module")
def padded_reference(llama):
    """transformers' generate() on the left-padded batch: without an EOS, and with an EOS id only row 1
    produces (from its third token on), so that row ends early and the others run to the budget."""
    ids, mask = _left_padded()
    free = _hf_padded(llama, ids, mask, PADDED_NEW, eos_token_id=None, min_new_tokens=PADDED_NEW)
    rows = free.tolist()
    eos = next(t for t in rows[1][2:] if all(t not in row for i, row in enumerate(rows) if i != 1))
    return ids, mask, free, eos, _hf_padded(llama, ids, mask, PADDED_NEW, eos_token_id=eos)


@pytest.mark.parametrize("mode", [dict(graphs=False), dict(), dict(device_loop=4), dict(device_loop=1)])
def test_left_padded_prompts_give_generates_tokens_row_by_row(llama, padded_reference, mode):
    ids, mask, free, eos, want = padded_reference
    new = PADDED_NEW
    dec = StaticCacheDecoder(llama, max_cache_len=ids.shape[1] + new + 2, **mode)
    got = dec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None)
    for r in range(len(LENGTHS)):
        assert got[r].tolist() == free[r].tolist(), (mode, r)
    rows = free.tolist()
    end = rows[1].index(eos)
    got = dec.generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=eos, pad_token_id=0)
    assert got.shape == want.shape == (len(LENGTHS), new), mode
    assert all(got[r].tolist() == want[r].tolist() for r in range(len(LENGTHS))), mode
    assert got[1, end + 1:].eq(0).all() and got[1, :end + 1].tolist() == rows[1][:end + 1]
    # the same decoder then decodes an unpadded batch (a mask of ones is no padding) as before
    plain = ids[:, -3:]
    assert torch.equal(dec.generate(plain, attention_mask=torch.ones_like(plain), max_new_tokens=new,
                                    eos_token_id=None),
                       _hf_padded(llama, plain, torch.ones_like(plain), new, eos_token_id=None, min_new_tokens=new))


def test_left_padded_sampling_is_the_same_on_every_path_and_draws_at_each_rows_position(llama):
    from hipgraph_bridge.generation.sampling import SamplingParams, sample_tokens

    ids, mask = _left_padded((2, 9, 5))
    settings = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=8, eos_token_id=None)
    new = 10
    paths = [StaticCacheDecoder(llama, max_cache_len=32, graphs=False), StaticCacheDecoder(llama, max_cache_len=32),
             StaticCacheDecoder(llama, max_cache_len=32, device_loop=4)]
    got = [d.generate(ids, attention_mask=mask, max_new_tokens=new, **settings) for d in paths]
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    # the reference: the full forward pass with generate()'s mask and positions, row i's token after its
    # position p drawn at (seed, i, p)
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=8)
    seq, m = ids, mask
    with torch.no_grad():
        for _ in range(new):
            pos = (m.cumsum(-1) - 1).masked_fill(m == 0, 0)
            logits = llama(input_ids=seq, attention_mask=m, position_ids=pos).logits[:, -1, :]
            tok = sample_tokens(logits, params, torch.arange(3), pos[:, -1])
            seq, m = torch.cat([seq, tok.view(3, 1)], 1), torch.cat([m, torch.ones(3, 1, dtype=m.dtype)], 1)
    assert torch.equal(got[0], seq[:, ids.shape[1]:])


@pytest.mark.parametrize("mask,match", [
    (torch.ones(2, 3), "tensor of 0/1"), (torch.ones(2, 4, dtype=torch.long), "tensor of 0/1"),
    (torch.tensor([[1, 1, 0], [1, 1, 1]]), "left padding"), (torch.tensor([[0, 2, 1], [1, 1, 1]]), "0 .* and 1"),
    (torch.tensor([[0, 0, 0], [1, 1, 1]]), "at least one real token"), ("ones", "tensor of 0/1")])
def test_bad_attention_masks_are_named(llama, mask, match):
    with pytest.raises(ValueError, match=f"attention_mask: expected.*{match}|attention_mask: expected {match}"):
        StaticCacheDecoder(llama, max_cache_len=16, graphs=False).generate(
            torch.ones(2, 3, dtype=torch.long), attention_mask=mask, max_new_tokens=2)
