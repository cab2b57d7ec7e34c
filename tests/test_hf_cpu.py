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
