"""gfxgraph.hf's argument checks, which need neither a GPU nor transformers."""

from __future__ import annotations

import pytest
import torch

from gfxgraph.hf import StaticCacheDecoder


@pytest.mark.parametrize("bad", [1, 0, "8", True, 2.0])
def test_max_cache_len_checked(bad):
    with pytest.raises(ValueError, match="max_cache_len: expected an int >= 2"):
        StaticCacheDecoder(object(), max_cache_len=bad)


@pytest.mark.parametrize("ids,match", [(torch.zeros(2, 3), "token ids"), (torch.zeros(3, dtype=torch.long), "token ids"),
                                       ("abc", "token ids")])
def test_input_ids_checked(ids, match):
    with pytest.raises(ValueError, match=match):
        StaticCacheDecoder(object(), max_cache_len=8).generate(ids, max_new_tokens=2)


@pytest.mark.parametrize("new", [0, -1, "2", True])
def test_max_new_tokens_checked(new):
    with pytest.raises(ValueError, match="max_new_tokens: expected an int >= 1"):
        StaticCacheDecoder(object(), max_cache_len=8).generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=new)


def test_prompt_plus_new_tokens_must_fit():
    with pytest.raises(ValueError, match="expected at most max_cache_len=8"):
        StaticCacheDecoder(object(), max_cache_len=8).generate(torch.zeros(1, 5, dtype=torch.long), max_new_tokens=4)
